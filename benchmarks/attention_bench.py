"""Attention speed: jaxattn beside its JAX peers, measured in one process and run.

    python -m benchmarks.attention_bench --out_dir=/tmp/bench        # GPU
    python -m benchmarks.attention_bench --smoke                     # CPU, tiny shapes

Modes: ``fwd`` and ``fwdbwd`` (TFLOP/s; causal FLOPs count the visible half), and
``decode`` (B sequences, Sq = 1, GB/s of K and V read, beside the measured
device-to-device copy bandwidth counted as bytes read + written). Peers: cuDNN through
``jax.nn.dot_product_attention(implementation="cudnn")`` and XLA through
``implementation="xla"``, and JAX's built-in Pallas Triton ``mha`` (no GQA: it gets K
and V repeated to Hq heads, outside the timed region). Timing: warm-up, then the median
over ``--iters`` samples of ``--reps`` back-to-back calls each (one synchronisation per
sample), rotating over several input sets so that no call reads the previous one's
inputs from L2.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from absl import app, flags

import jaxattn

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch", 2, "Batch for fwd / fwdbwd.")
flags.DEFINE_integer("num_q_heads", 32, "Query heads.")
flags.DEFINE_integer("num_kv_heads", 8, "KV heads.")
flags.DEFINE_integer("head_dim", 128, "Head dim.")
flags.DEFINE_list("seq_lens", ["1024", "4096", "16384"], "Sequence lengths (fwd, fwdbwd).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Dtype.")
flags.DEFINE_bool("causal", True, "Causal attention (fwd, fwdbwd).")
flags.DEFINE_list("modes", ["fwd", "fwdbwd", "decode"], "What to time.")
flags.DEFINE_list("backends", ["jaxattn", "cudnn", "xla", "pallas_mha"], "Systems to time.")
flags.DEFINE_integer("decode_batch", 8, "Batch for decode.")
flags.DEFINE_list("decode_kv_lens", ["4096", "32768"], "Context lengths for decode.")
flags.DEFINE_integer("iters", 10, "Timed samples per point (median reported).")
flags.DEFINE_integer("reps", 10, "Back-to-back calls per timed sample.")
flags.DEFINE_integer("warmup", 3, "Untimed calls first.")
flags.DEFINE_integer("input_sets", 3, "Input sets rotated over (defeats L2 reuse).")
flags.DEFINE_string("out_dir", None, "Write results.json and results.md here.")
flags.DEFINE_bool("smoke", False, "Tiny shapes that run on a CPU (CI keeps the binary alive);"
                  " jaxattn runs its Pallas kernels, in interpret mode there.")
flags.DEFINE_string("jaxattn_backend", None, "Backend of jaxattn (default: platform priority).")


def _time(fn: Callable, inputs: list, iters: int, warmup: int, reps: int) -> float:
    """Median seconds per call: each of ``iters`` samples launches ``reps`` calls back to
    back, rotating over the input sets, and synchronises once (the device stays busy;
    host dispatch overlaps it)."""
    for i in range(warmup):
        jax.block_until_ready(fn(*inputs[i % len(inputs)]))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for r in range(reps):
            out = fn(*inputs[r % len(inputs)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def attention_flops(b, hq, sq, skv, d, causal: bool) -> float:
    """Matmul FLOPs of one forward (2 matmuls), counting visible pairs only when causal."""
    if causal:
        off = skv - sq
        pairs = sum(min(skv, max(0, i + off + 1)) for i in range(sq)) if sq < 65536 else \
            sq * skv / 2
    else:
        pairs = sq * skv
    return 4.0 * b * hq * pairs * d


def _random(shape, dtype, key):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def make_fn(system: str, causal: bool, scale: float, hq: int, hkv: int):
    """A jitted ``fn(q, k, v) -> out`` in the system's layout, and an input transform."""
    if system == "jaxattn":
        backend = FLAGS.jaxattn_backend or ("pallas" if FLAGS.smoke else None)
        fn = lambda q, k, v: jaxattn.attention(q, k, v, causal=causal, scale=scale,
                                               backend=backend)
        return jax.jit(fn), lambda q, k, v: (q, k, v)
    to_bshd = lambda x: jnp.swapaxes(x, 1, 2)
    if system in ("cudnn", "xla"):
        fn = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, implementation=system)
        return jax.jit(fn), lambda q, k, v: (to_bshd(q), to_bshd(k), to_bshd(v))
    if system == "pallas_mha":
        from jax.experimental.pallas.ops.gpu import attention as mha_lib
        g = hq // hkv
        fn = lambda q, k, v: mha_lib.mha(q, k, v, None, sm_scale=scale, causal=causal)
        rep = lambda x: to_bshd(jnp.repeat(x, g, axis=1))
        return jax.jit(fn), lambda q, k, v: (to_bshd(q), rep(k), rep(v))
    raise ValueError(f"unknown system {system!r}")


def bench_attention(system, mode, b, hq, hkv, sq, skv, d, dtype, causal, iters, warmup,
                    n_sets) -> dict:
    scale = 1.0 / math.sqrt(d)
    fn, prep = make_fn(system, causal, scale, hq, hkv)
    keys = jax.random.split(jax.random.PRNGKey(sq * 7 + skv), 4 * n_sets)
    sets = []
    for i in range(n_sets):
        q = _random((b, hq, sq, d), dtype, keys[4 * i])
        k = _random((b, hkv, skv, d), dtype, keys[4 * i + 1])
        v = _random((b, hkv, skv, d), dtype, keys[4 * i + 2])
        args = prep(q, k, v)
        if mode == "fwdbwd":
            do = _random(args[0].shape, dtype, keys[4 * i + 3])
            args = (*args, do)
        sets.append(jax.block_until_ready(args))
    if mode == "fwdbwd":
        base = fn

        def fwdbwd(q, k, v, do):
            out, vjp = jax.vjp(base, q, k, v)
            return vjp(do)
        run = jax.jit(fwdbwd)
    else:
        run = fn
    sec = _time(run, sets, iters, warmup, FLAGS.reps if not FLAGS.smoke else 1)
    flops = attention_flops(b, hq, sq, skv, d, causal)
    row = {"system": system, "mode": mode, "B": b, "Hq": hq, "Hkv": hkv, "Sq": sq,
           "Skv": skv, "D": d, "dtype": str(jnp.dtype(dtype)), "causal": causal,
           "ms": sec * 1e3}
    if mode == "decode":
        kv_bytes = 2 * b * hkv * skv * d * jnp.dtype(dtype).itemsize
        row["GB/s"] = kv_bytes / sec / 1e9
    else:
        row["TFLOP/s"] = flops * (3.5 if mode == "fwdbwd" else 1.0) / sec / 1e12
    return row


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy, GB/s counting bytes read plus bytes written."""
    n = nbytes // 4
    xs = [jax.random.uniform(jax.random.PRNGKey(i), (n,), jnp.float32) for i in range(2)]
    copy = jax.jit(lambda x: x + 1.0)
    sec = _time(copy, [(x,) for x in xs], iters, 3, 5)
    return 2 * n * 4 / sec / 1e9


def to_markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Measured {meta['date']} on {meta['device']} (jax {meta['jax']}, "
             f"jaxlib {meta['jaxlib']}); command: `{meta['command']}`", ""]
    if meta.get("copy_GBps"):
        lines += [f"Device-to-device copy bandwidth (read + write): "
                  f"{meta['copy_GBps']:.0f} GB/s", ""]
    lines += ["| mode | system | B | Hq | Hkv | Sq | Skv | D | causal | ms | TFLOP/s | GB/s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['system']} | {r['B']} | {r['Hq']} | {r['Hkv']} "
                         f"| {r['Sq']} | {r['Skv']} | {r['D']} | {r['causal']} | error: "
                         f"{r['error'][:60]} | | |")
            continue
        tf = f"{r['TFLOP/s']:.1f}" if "TFLOP/s" in r else ""
        gb = f"{r['GB/s']:.0f}" if "GB/s" in r else ""
        lines.append(f"| {r['mode']} | {r['system']} | {r['B']} | {r['Hq']} | {r['Hkv']} | "
                     f"{r['Sq']} | {r['Skv']} | {r['D']} | {r['causal']} | {r['ms']:.3f} | "
                     f"{tf} | {gb} |")
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    dtype = jnp.dtype(FLAGS.dtype)
    if FLAGS.smoke:
        shapes = dict(b=1, hq=4, hkv=2, d=64)
        seq_lens, kv_lens, dec_b = [64], [128], 2
        systems = [s for s in FLAGS.backends if s in ("jaxattn", "xla")]
        iters, warmup = 2, 1
    else:
        shapes = dict(b=FLAGS.batch, hq=FLAGS.num_q_heads, hkv=FLAGS.num_kv_heads,
                      d=FLAGS.head_dim)
        seq_lens = [int(s) for s in FLAGS.seq_lens]
        kv_lens = [int(s) for s in FLAGS.decode_kv_lens]
        dec_b = FLAGS.decode_batch
        systems = FLAGS.backends
        iters, warmup = FLAGS.iters, FLAGS.warmup
    meta = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "jaxlib": jax.lib.__version__ if hasattr(jax, "lib")
            else "", "command": "python -m benchmarks.attention_bench " +
            " ".join(os.sys.argv[1:]),
            "jaxattn_backend": FLAGS.jaxattn_backend or ("pallas" if FLAGS.smoke else
                                                         jaxattn.get_op().backend)}
    rows = []

    def record(system, mode, **kw):
        try:
            row = bench_attention(system, mode, dtype=dtype, iters=iters, warmup=warmup,
                                  n_sets=FLAGS.input_sets, **kw)
        except Exception as e:  # a peer that cannot run this shape is reported, not fatal
            row = {"system": system, "mode": mode, "B": kw["b"], "Hq": kw["hq"],
                   "Hkv": kw["hkv"], "Sq": kw["sq"], "Skv": kw["skv"], "D": kw["d"],
                   "causal": kw["causal"], "error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()},
              flush=True)

    for mode in ("fwd", "fwdbwd"):
        if mode not in FLAGS.modes:
            continue
        for s in seq_lens:
            for system in systems:
                record(system, mode, b=shapes["b"], hq=shapes["hq"], hkv=shapes["hkv"],
                       sq=s, skv=s, d=shapes["d"], causal=FLAGS.causal)
    if "decode" in FLAGS.modes:
        if jax.default_backend() != "cpu":
            meta["copy_GBps"] = copy_bandwidth()
        for s in kv_lens:
            for system in systems:
                if system == "pallas_mha":
                    continue  # needs Sq to be a multiple of its 128-row block
                record(system, "decode", b=dec_b, hq=shapes["hq"], hkv=shapes["hkv"], sq=1,
                       skv=s, d=shapes["d"], causal=system == "jaxattn")
    md = to_markdown(rows, meta)
    print(md)
    if FLAGS.out_dir:
        os.makedirs(FLAGS.out_dir, exist_ok=True)
        with open(os.path.join(FLAGS.out_dir, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
        with open(os.path.join(FLAGS.out_dir, "results.md"), "w") as f:
            f.write(md)


if __name__ == "__main__":
    app.run(main)
