"""Launch-parameter sweep of the Pallas kernels on a GPU (prints a table; nothing here
changes the library's defaults by itself).

    python -m benchmarks.tune --what=fwd,bwd,decode

``--block_n`` / ``--split`` also time other values of the schedule constants, to inform
the choice of ``jaxattn.schedule`` (a change there changes every backend's bits).
"""

from __future__ import annotations

import itertools
import math
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from jaxattn import schedule
from jaxattn.backends.pallas import backward as pv
from jaxattn.backends.pallas import forward as pt

FLAGS = flags.FLAGS
flags.DEFINE_list("what", ["fwd", "bwd", "decode"], "Kernels to sweep; 'variants' times "
                  "and checks the schedule variants of --variants; 'launch' times the "
                  "prefill forward's launch options (--launch_options) beside "
                  "JAX's Pallas mha at --launch_shapes, checking each option's bits.")
flags.DEFINE_list("launch_shapes", ["2x4096", "8x4096", "2x16384"],
                  "BxS shapes of --what=launch (causal, Hq=32, Hkv=8, bf16).")
flags.DEFINE_list("variants", ["2:mma", "2:reduce32", "2:tree"],
                  "SOFTMAX_EXP_BASE:ROWSUM pairs for --what=variants.")
flags.DEFINE_list("launch_options", [],
                  "BLOCK_N:ROWSUM:block_m:warps:stages:tile_order items "
                  "for --what=launch (default: _LAUNCH_OPTIONS).")
flags.DEFINE_list("block_n", ["64"], "BLOCK_N values to try.")

_LAUNCH_OPTIONS = [
    "64:mma:128:8:3:ascending", "64:mma:128:8:3:descending",
    "64:mma:128:8:3:heavy_first", "64:mma:64:4:3:descending",
    "64:reduce32:128:8:3:descending", "64:reduce:128:8:3:descending",
    "128:mma:128:8:2:descending", "128:mma:64:4:2:descending",
    "128:mma:128:8:2:heavy_first", "128:reduce32:128:8:2:descending",
    "64:tree:128:8:3:descending", "64:tree:128:8:3:heavy_first",
]
flags.DEFINE_list("split", ["1024"], "SPLIT values to try (decode).")
flags.DEFINE_integer("seq_len", 4096, "Prefill length.")
flags.DEFINE_integer("head_dim", 128, "Head dim.")
flags.DEFINE_integer("reps", 20, "Back-to-back calls per sample.")


def timeit(fn, args, reps):
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            r = fn(*args)
        jax.block_until_ready(r)
        samples.append((time.perf_counter() - t0) / reps)
    return sorted(samples)[2]


def set_schedule(block_n, split):
    schedule.BLOCK_N = block_n
    schedule.SPLIT = split
    schedule.BLOCKS_PER_SPLIT = split // block_n
    jax.clear_caches()


def main(argv):
    del argv
    b, hq, hkv, d, s = 2, 32, 8, FLAGS.head_dim, FLAGS.seq_len
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(ks[0], (b, hq, s, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, hkv, s, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, hkv, s, d), jnp.bfloat16)
    do = jax.random.normal(ks[3], (b, hq, s, d), jnp.bfloat16)
    scale = 1 / math.sqrt(d)
    flops = 4 * b * hq * s * s * d / 2
    for bn in [int(x) for x in FLAGS.block_n]:
        set_schedule(bn, 1024)
        if "fwd" in FLAGS.what:
            for bm, w, st in itertools.product([64, 128], [4, 8], [2, 3, 4]):
                cfg = pt.ForwardConfig(block_m=bm, num_warps=w, num_stages=st)
                fn = jax.jit(lambda q, k, v, cfg=cfg: pt.forward(
                    q, k, v, causal=True, scale=scale, interpret=False, path="prefill",
                    config=cfg))
                try:
                    t = timeit(fn, (q, k, v), FLAGS.reps)
                    print(f"fwd BLOCK_N={bn} block_m={bm} warps={w} stages={st}: "
                          f"{t * 1e3:.3f} ms {flops / t / 1e12:.1f} TFLOP/s", flush=True)
                except Exception as e:
                    print(f"fwd BLOCK_N={bn} block_m={bm} warps={w} stages={st}: "
                          f"{type(e).__name__} {str(e)[:120]}", flush=True)
        if "bwd" in FLAGS.what:
            out, lse = pt.forward(q, k, v, causal=True, scale=scale, interpret=False)
            for bq, bkv, w, st in itertools.product([32, 64, 128], [32, 64, 128], [4, 8],
                                                    [2, 3]):
                if bq * bkv > 8192:
                    continue
                cfg = pv.BackwardConfig(block_q=bq, block_kv=bkv, num_warps=w, num_stages=st)
                fn = jax.jit(lambda *a, cfg=cfg: pv.backward(
                    *a, None, causal=True, scale=scale, interpret=False, config=cfg))
                try:
                    t = timeit(fn, (q, k, v, None, out, lse, do), max(3, FLAGS.reps // 4))
                    print(f"bwd block_q={bq} block_kv={bkv} warps={w} stages={st}: "
                          f"{t * 1e3:.3f} ms {2.5 * flops / t / 1e12:.1f} TFLOP/s", flush=True)
                except Exception as e:
                    print(f"bwd block_q={bq} block_kv={bkv} warps={w} stages={st}: "
                          f"{type(e).__name__} {str(e)[:120]}", flush=True)
    if "decode" in FLAGS.what:
        for bn, sp in itertools.product([int(x) for x in FLAGS.block_n],
                                        [int(x) for x in FLAGS.split]):
            set_schedule(bn, sp)
            for skv in (4096, 32768):
                qd = jax.random.normal(ks[0], (8, hq, 1, d), jnp.bfloat16)
                kd = jax.random.normal(ks[1], (8, hkv, skv, d), jnp.bfloat16)
                vd = jax.random.normal(ks[2], (8, hkv, skv, d), jnp.bfloat16)
                for w, st in itertools.product([4, 8], [2, 3, 4]):
                    cfg = pt.ForwardConfig(decode_num_warps=w, decode_num_stages=st)
                    fn = jax.jit(lambda q, k, v, cfg=cfg: pt.forward(
                        q, k, v, causal=True, scale=scale, interpret=False, config=cfg))
                    t = timeit(fn, (qd, kd, vd), FLAGS.reps)
                    gbs = 2 * kd.size * 2 / t / 1e9
                    print(f"decode BLOCK_N={bn} SPLIT={sp} Skv={skv} warps={w} stages={st}: "
                          f"{t * 1e6:.1f} us {gbs:.0f} GB/s", flush=True)
    if "variants" in FLAGS.what:
        _variants(q, k, v, scale, flops)
    if "launch" in FLAGS.what:
        _launch(hq, hkv, d)
    set_schedule(64, 1024)


def _launch(hq, hkv, d):
    """Prefill launch options (none changes the bits; checked here on the GPU) against
    JAX's Pallas mha on the same shapes, in one process."""
    from jax.experimental.pallas.ops.gpu import attention as mha_lib

    from jaxattn.invariance import bits_equal

    scale = 1 / math.sqrt(d)
    default = schedule.BLOCK_N, schedule.ROWSUM
    for shape in FLAGS.launch_shapes:
        b, s = (int(x) for x in shape.split("x"))
        ks = jax.random.split(jax.random.PRNGKey(s + b), 3)
        q = jax.random.normal(ks[0], (b, hq, s, d), jnp.bfloat16)
        k = jax.random.normal(ks[1], (b, hkv, s, d), jnp.bfloat16)
        v = jax.random.normal(ks[2], (b, hkv, s, d), jnp.bfloat16)
        flops = 4 * b * hq * s * s * d / 2
        # mha: [B, S, H, D], no GQA (K and V repeated outside the timed call).
        qm = jnp.swapaxes(q, 1, 2)
        km, vm = (jnp.swapaxes(jnp.repeat(x, hq // hkv, axis=1), 1, 2) for x in (k, v))
        mha = jax.jit(lambda q, k, v: mha_lib.mha(q, k, v, None, sm_scale=scale, causal=True))
        t = timeit(mha, (qm, km, vm), FLAGS.reps)
        print(f"launch B={b} S={s} pallas_mha: {t * 1e3:.3f} ms {flops / t / 1e12:.1f} "
              f"TFLOP/s", flush=True)
        base = None
        # (BLOCK_N, ROWSUM, block_m, warps, stages, tile_order):
        # FLAGS.launch_options, or the grid below.
        for opt in FLAGS.launch_options or _LAUNCH_OPTIONS:
            bn, rowsum, bm, w, st, order = opt.split(":")
            if (int(bn), rowsum) != (schedule.BLOCK_N, schedule.ROWSUM):
                set_schedule(int(bn), 1024)
                schedule.ROWSUM = rowsum
                jax.clear_caches()
                base = None  # bits are compared within one schedule only
            cfg = pt.ForwardConfig(block_m=int(bm), num_warps=int(w), num_stages=int(st),
                                   tile_order=order)
            fn = jax.jit(lambda q, k, v, cfg=cfg: pt.forward(
                q, k, v, causal=True, scale=scale, interpret=False, path="prefill",
                config=cfg))
            name = f"launch B={b} S={s} {opt}"
            try:
                t = timeit(fn, (q, k, v), FLAGS.reps)
                got = fn(q, k, v)
                base = base or got
                same = bits_equal(got[0], base[0]) and bits_equal(got[1], base[1])
                print(f"{name}: {t * 1e3:.3f} ms {flops / t / 1e12:.1f} TFLOP/s "
                      f"bits={'same' if same else 'DIFF'}", flush=True)
            except Exception as e:  # noqa: BLE001 -- a config that fails is a row
                print(f"{name}: {type(e).__name__} {str(e)[:120]}", flush=True)
    set_schedule(default[0], schedule.SPLIT)
    schedule.ROWSUM = default[1]


def _variants(q, k, v, scale, flops):
    """Speed of each schedule variant beside its invariance on this GPU (decode vs
    prefill rows, chunked prefill, tile heights): a variant is usable only if all hold."""
    import jaxattn
    from jaxattn import invariance

    p = invariance.Problem(batch=2, num_q_heads=32, num_kv_heads=8, seq_len=2048,
                           head_dim=FLAGS.head_dim)
    default = schedule.SOFTMAX_EXP_BASE, schedule.ROWSUM
    for variant in FLAGS.variants:
        base, rowsum = variant.split(":")
        schedule.SOFTMAX_EXP_BASE, schedule.ROWSUM = base, rowsum
        jax.clear_caches()
        fn = jax.jit(lambda q, k, v: pt.forward(q, k, v, causal=True, scale=scale,
                                                interpret=False))
        t = timeit(fn, (q, k, v), FLAGS.reps)
        op = jaxattn.get_op("attention", backend="pallas")
        res = invariance.check_decode(op, p, [0, 1, 63, 64, 1000, 2047])
        res += invariance.check_chunked_prefill(op, p, [100, 1000])
        qq, kk, vv = invariance.random_qkv(p)
        tiles = [pt.forward(qq, kk, vv, causal=True, scale=scale, interpret=False,
                            path=path, config=pt.ForwardConfig(block_m=bm))
                 for bm in (16, 64, 128) for path in ("prefill", "split")]
        tiles_ok = all(invariance.bits_equal(a[0], tiles[0][0]) and
                       invariance.bits_equal(a[1], tiles[0][1]) for a in tiles)
        verdicts = " ".join(f"{r.case.split(' ')[0]}={'ok' if r.equal else 'DIFF'}" for r in res)
        print(f"variant exp={base} rowsum={rowsum}: fwd {t * 1e3:.3f} ms "
              f"{flops / t / 1e12:.1f} TFLOP/s; {verdicts} tiles={'ok' if tiles_ok else 'DIFF'}",
              flush=True)
    schedule.SOFTMAX_EXP_BASE, schedule.ROWSUM = default
    jax.clear_caches()


if __name__ == "__main__":
    app.run(main)
