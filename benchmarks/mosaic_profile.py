"""Where a Mosaic prefill's time goes per item: Mosaic GPU's on-device profiler over the
forward kernel's named scopes (``forward.profiling``), summarised per warpgroup role.

    python3 -m benchmarks.mosaic_profile --head_dim=64 --causal=false \\
        --shapes=4:1024,1:4096 --configs=default:,c2:compute_wgs=2 --out_dir=/tmp/prof

Each compute warpgroup records, per (tile, head, batch) item, ``item`` and in it
``wait_q`` (the Q tile's barrier), ``wait_k`` (the first K block's), ``fold`` (the
key blocks and the SPLIT fold), ``skip`` (blocks only another warpgroup needs, and
the ping-pong's closing rendezvous) and ``epilogue`` (the output's and lse's stores);
the producer ``produce`` (an item's K/V loads, each once its slot is free); with
``--blocks`` each key block's ``s``, ``softmax``, ``wait_pv`` and ``pv``
(``forward.BLOCK_SCOPES``: their medians, and a warpgroup's period from one block's
``s`` to the next's). Times are the SM's clock (cycles), so they compare within a
CTA, not across CTAs. Per shape and
configuration the summary gives each range's median cycles over the items after a
CTA's first (the first apart), ``other`` (the item's cycles outside its named ranges),
``gap`` (from one item's end to the next one's start), the fold's cycles per key
block, and a CTA's span (first item's start to last item's end) over its items
(``report.profile_summary``). With ``--steady=N`` the profiled call runs right behind
N unprofiled ones (back to back, as in a benchmark's timed loop). With
``--time_calls=N`` the unprofiled and the profiled executables are then each timed
over N calls back to back (wall time over N, after the trace's call: ``plain_us``,
``traced_us``; the profiled one's include its host-side trace dump after each call,
so the profiled kernel's own duration is ``kernel_timeline --profile_space``'s). Writes
``profile.json`` (the summaries) and each case's Perfetto trace to ``--out_dir``;
Mosaic GPU's own estimate of the profiler's cost per event is subtracted by JAX.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import shutil
import tempfile

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_q_heads", 32, "Query heads.")
flags.DEFINE_integer("num_kv_heads", 8, "KV heads.")
flags.DEFINE_integer("head_dim", 64, "Head dim.")
flags.DEFINE_bool("causal", False, "Causal mask.")
flags.DEFINE_list("shapes", ["4:1024"], "B:S per case (Sq = Skv = S).")
flags.DEFINE_list("configs", ["default:"], "name:MosaicConfig fields "
                  "(key=value[:key=value...]) per configuration.")
flags.DEFINE_integer("space", 0, "Profiler ranges per warpgroup (0: from the items a "
                     "CTA takes, with room).")
flags.DEFINE_bool("blocks", False, "Each key block's ranges too (s, softmax, wait_pv, "
                  "pv: forward.BLOCK_SCOPES; about five ranges a block of SMEM a "
                  "warpgroup: small batches).")
flags.DEFINE_integer("steady", 0, "Unprofiled calls enqueued right before the profiled "
                     "one (compiled ahead), so that it runs back to back after them, the "
                     "GPU at its steady clock and power; 0: the profiled call alone, "
                     "after two warm-up calls.")
flags.DEFINE_integer("time_calls", 0, "After the profiled call, time N calls back to "
                     "back of the unprofiled and of the profiled executable (the row's "
                     "plain_us and traced_us: wall time over N); 0: none.")
flags.DEFINE_string("out_dir", None, "Write profile.json and the traces here.")


def _time_calls(exe, args, n: int) -> float:
    """Microseconds a call of ``exe(*args)`` over ``n`` calls back to back (after one)."""
    import time

    import jax
    jax.block_until_ready(exe(*args))
    t0 = time.perf_counter()
    jax.block_until_ready([exe(*args) for _ in range(n)])
    return (time.perf_counter() - t0) / n * 1e6


def main(argv):
    del argv
    import functools

    import jax
    import jax.numpy as jnp

    from benchmarks import lowered, report
    from jaxattn import schedule
    from jaxattn.backends.mosaic import forward as mf
    for name in ("steady", "time_calls"):
        if FLAGS[name].value < 0:
            raise app.UsageError(f"--{name} must be >= 0, got {FLAGS[name].value}")
    if jax.default_backend() != "gpu":
        raise app.UsageError("the on-device profiler records GPU kernels: no GPU here")
    hq, hkv, d = FLAGS.num_q_heads, FLAGS.num_kv_heads, FLAGS.head_dim
    out_dir = FLAGS.out_dir or tempfile.mkdtemp()
    os.makedirs(out_dir, exist_ok=True)
    results = []
    n_sm = mf.sm_count()
    for spec in FLAGS.shapes:
        b, s = (int(x) for x in spec.split(":"))
        kq, kk, kv = jax.random.split(jax.random.key(11), 3)
        q = jax.random.normal(kq, (b, hq, s, d), jnp.bfloat16)
        k = jax.random.normal(kk, (b, hkv, s, d), jnp.bfloat16)
        v = jax.random.normal(kv, (b, hkv, s, d), jnp.bfloat16)
        for cspec in FLAGS.configs:
            name, kw = report.named_config(cspec)
            cfg = mf.MosaicConfig(**kw)
            row = {"B": b, "S": s, "D": d, "causal": FLAGS.causal, "config": name,
                   "blocks": FLAGS.blocks, "steady": FLAGS.steady}
            tmp = tempfile.mkdtemp()
            try:
                # room for every item of the most loaded CTA, refused where it does
                # not fit beside the kernel's SMEM
                row["space"] = space = FLAGS.space or lowered.profile_space(
                    b, s, hq=hq, hkv=hkv, d=d, causal=FLAGS.causal,
                    config=cfg, blocks=FLAGS.blocks, n_sm=n_sm)
                # The trace's file is named once, when the kernel is lowered, so an
                # executable writes only its first call's: the same kernel without
                # the profiler runs twice first (the GPU and its caches warm), then
                # it is lowered afresh within the profiler (which clears jit's
                # caches), compiled, and run once, right behind --steady unprofiled
                # calls (none by default).
                call = jax.jit(functools.partial(mf.forward, causal=FLAGS.causal,
                                                 config=cfg))
                for _ in range(2):
                    jax.block_until_ready(call(q, k, v))
                plain = (call.lower(q, k, v).compile()
                         if FLAGS.steady or FLAGS.time_calls else None)
                with mf.profiling(space, tmp, blocks=FLAGS.blocks):
                    traced = call.lower(q, k, v).compile()
                    outs = [plain(q, k, v) for _ in range(FLAGS.steady)]
                    jax.block_until_ready([*outs, traced(q, k, v)])
                    del outs
                    if FLAGS.time_calls:
                        for key, exe in (("plain_us", plain), ("traced_us", traced)):
                            row[key] = _time_calls(exe, (q, k, v), FLAGS.time_calls)
                jax.effects_barrier()
                files = glob.glob(os.path.join(tmp, "*-trace.json"))
                if len(files) != 1:
                    raise RuntimeError(f"the profiler wrote {len(files)} traces, not one")
                with open(files[0]) as fh:
                    trace = json.load(fh)
                row.update(report.profile_summary(
                    trace, key_blocks=None if FLAGS.causal else -(-s // schedule.BLOCK_N),
                    block_ranges=mf.BLOCK_SCOPES))
                dst = os.path.join(out_dir, f"trace-{name}-{b}x{s}.json.gz")
                with open(files[0], "rb") as src, gzip.open(dst, "wb") as g:
                    shutil.copyfileobj(src, g)
            except Exception as e:  # reported in the row
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            results.append(row)
            print(row, flush=True)
    with open(os.path.join(out_dir, "profile.json"), "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    app.run(main)
