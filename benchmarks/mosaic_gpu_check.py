"""First GPU check of the Mosaic GPU prototypes (docs/mosaic.md, sections 5 and 6).

    python -m benchmarks.mosaic_gpu_check --out_dir=$OUT/mosaic        # H200 only

Forward (``mosaic_fwd.forward``) at real shapes for every (block_m, operand path,
lowering semantics): error against ``reference.forward_fp32_with_lse``, rows with no
visible key, bits against the Pallas backend, and whether the configurations agree in
bits with each other (a row must not depend on its tile). Backward
(``mosaic_bwd.backward``) against the Pallas backward from the same ``(out, lse)``:
error against the fp32 reference's gradients and bits. Every configuration runs in its
own try block, so one failure (or a lowering error on this JAX) is reported and the rest
goes on. Prints a line per result; writes results.json.
"""

from __future__ import annotations

import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import report

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", None, "Write results.json here.")
flags.DEFINE_bool("backward", True, "Also check the backward prototype.")
flags.DEFINE_bool("checks", True, "Run the accuracy / bits checks.")
flags.DEFINE_bool("speed", False, "Time forward and backward against the Pallas backend "
                  "at SPEED_SHAPE (the Mosaic issue's bar is in TFLOP/s).")
flags.DEFINE_integer("iters", 10, "Timed calls (median) for --speed.")

#: (B, Hq, Hkv, S, D), causal, bf16: the shape of the forward-speed bar in docs/.
SPEED_SHAPE = (8, 32, 8, 4096, 128)

FWD_SHAPES = [(2, 8, 2, 2048, 2048, 128), (2, 8, 2, 2048, 2048, 64), (4, 32, 8, 128, 4096, 128),
              (1, 4, 4, 256, 128, 64)]
BWD_SHAPES = [(2, 8, 2, 2048, 2048, 128), (2, 8, 2, 1024, 2048, 64), (1, 4, 4, 256, 128, 64)]


def _inputs(b, hq, hkv, sq, skv, d, seed):
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (b, hq, sq, d), jnp.bfloat16),
            jax.random.normal(ks[1], (b, hkv, skv, d), jnp.bfloat16),
            jax.random.normal(ks[2], (b, hkv, skv, d), jnp.bfloat16),
            jax.random.normal(ks[3], (b, hq, sq, d), jnp.bfloat16))


def _bits(x):
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _same(a, b) -> bool:
    return bool(np.array_equal(_bits(a), _bits(b)))


def _rel(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


def check_forward(results: list) -> None:
    import jaxattn
    from jaxattn import reference
    from jaxattn.kernels import mosaic_fwd as mf
    for shape, causal in itertools.product(FWD_SHAPES, [True, False]):
        q, k, v, _ = _inputs(*shape, seed=sum(shape))
        ro, rl = reference.forward_fp32_with_lse(q, k, v, causal=causal)
        po, pl_ = jaxattn.attention(q, k, v, causal=causal, return_lse=True, backend="pallas")
        outs = []
        for bm, gop, sem in itertools.product([64, 128], [True, False], ["lane", "warpgroup"]):
            row = {"kind": "forward", "shape": shape, "causal": causal, "block_m": bm,
                   "gpu_operands": gop, "semantics": sem}
            try:
                cfg = mf.MosaicConfig(block_m=bm, gpu_operands=gop, semantics=sem)
                t0 = time.time()
                o, lse = jax.block_until_ready(mf.forward(q, k, v, causal=causal, config=cfg))
                fin = np.isfinite(np.asarray(rl))
                row.update(seconds=time.time() - t0, err=_rel(o.astype(jnp.float32), ro),
                           lse_err=float(np.max(np.where(fin, np.abs(np.asarray(lse) -
                                                                     np.asarray(rl)), 0))),
                           empty_rows_ok=bool(np.array_equal(np.isfinite(np.asarray(lse)),
                                                             fin)),
                           nan=bool(np.isnan(np.asarray(o, np.float32)).any()),
                           out_bits_eq_pallas=_same(o, po), lse_bits_eq_pallas=_same(lse, pl_))
                outs.append((o, lse))
            except Exception as e:  # reported; the other configurations go on
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            results.append(row)
            print(row, flush=True)
        if outs:
            results.append({"kind": "forward-configs-agree", "shape": shape, "causal": causal,
                            "equal": all(_same(o, outs[0][0]) and _same(lse, outs[0][1])
                                         for o, lse in outs)})
            print(results[-1], flush=True)


def check_backward(results: list) -> None:
    from jaxattn import reference
    from jaxattn.kernels import mosaic_bwd as mb
    from jaxattn.kernels import pallas_triton_vjp as pv
    for shape, causal in itertools.product(BWD_SHAPES, [True, False]):
        q, k, v, do = _inputs(*shape, seed=sum(shape) + 1)
        scale = 1.0 / np.sqrt(shape[-1])
        out, lse = pv.attention(q, k, v, None, causal, scale, False)
        dlse = jnp.zeros_like(lse)
        ref = jax.vjp(lambda q, k, v, c=causal: reference.forward_fp32(q, k, v, causal=c),
                      q, k, v)[1](do.astype(jnp.float32))
        tri = pv.backward(q, k, v, None, out, lse, do, dlse, causal=causal, scale=scale,
                          interpret=False)
        for gop, sem in itertools.product([True, False], ["lane", "warpgroup"]):
            row = {"kind": "backward", "shape": shape, "causal": causal, "gpu_operands": gop,
                   "semantics": sem}
            try:
                cfg = mb.BwdConfig(gpu_operands=gop, semantics=sem)
                g = jax.block_until_ready(mb.backward(q, k, v, out, lse, do, dlse,
                                                      causal=causal, scale=scale,
                                                      config=cfg))
                row.update(errs=[_rel(a.astype(jnp.float32), r) for a, r in zip(g, ref,
                                                                                 strict=True)],
                           bits_eq_pallas=[_same(a, t) for a, t in zip(g, tri, strict=True)])
            except Exception as e:  # reported; the other configurations go on
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            results.append(row)
            print(row, flush=True)


def time_speed(results: list) -> None:
    """Forward and backward TFLOP/s of the prototypes (their default configs) beside the
    Pallas backend's, causal bf16 at SPEED_SHAPE; one synchronised call per sample."""
    from jaxattn.kernels import mosaic_bwd as mb
    from jaxattn.kernels import mosaic_fwd as mf
    from jaxattn.kernels import pallas_triton as pt
    from jaxattn.kernels import pallas_triton_vjp as pv
    b, hq, hkv, s, d = SPEED_SHAPE
    q, k, v, do = _inputs(b, hq, hkv, s, s, d, seed=7)
    scale = 1 / np.sqrt(d)
    fwd_flops = 4 * b * hq * s * s * d / 2  # causal: half the score matrix
    systems = {
        "mosaic": (jax.jit(lambda q, k, v: mf.forward(q, k, v, causal=True, scale=scale)),
                   lambda q, k, v, o, l, do: mb.backward(q, k, v, o, l, do, causal=True,
                                                         scale=scale)),
        "pallas": (jax.jit(lambda q, k, v: pt.forward(q, k, v, causal=True, scale=scale,
                                                      interpret=False)),
                   lambda q, k, v, o, l, do: pv.backward(q, k, v, None, o, l, do, None,
                                                         causal=True, scale=scale,
                                                         interpret=False)),
    }
    for name, (fwd, bwd) in systems.items():
        row = {"kind": "speed", "system": name, "shape": SPEED_SHAPE, "causal": True}
        try:
            ms = report.median_seconds(fwd, (q, k, v), FLAGS.iters) * 1e3
            o, lse = fwd(q, k, v)
            bms = report.median_seconds(jax.jit(bwd), (q, k, v, o, lse, do), FLAGS.iters) * 1e3
            row.update(fwd_ms=ms, fwd_tflops=fwd_flops / ms / 1e9, bwd_ms=bms,
                       bwd_tflops=2.5 * fwd_flops / bms / 1e9)
        except Exception as e:  # a prototype failing here is a result too
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        results.append(row)
        print(row, flush=True)


def main(argv):
    del argv
    results = [{"jax": jax.__version__, "device": jax.devices()[0].device_kind}]
    print(results[0], flush=True)
    if FLAGS.checks:
        check_forward(results)
        if FLAGS.backward:
            check_backward(results)
    if FLAGS.speed:
        time_speed(results)
    report.write(FLAGS.out_dir, results, default=str)


if __name__ == "__main__":
    app.run(main)
