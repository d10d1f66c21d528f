"""The GPU timeline of back-to-back causal calls (decode steps, or prefills with
``--query_len``): each kernel's start, end and the gap (or overlap) before it, per
Mosaic launch configuration.

    python3 -m benchmarks.kernel_timeline --batch=1 --seq_len=131072 \\
        --configs=default:,off:pdl=off,foldearly:split_pdl=both
    python3 -m benchmarks.kernel_timeline --batch=8 --seq_len=4096 --query_len=4096 \\
        --head_dim=64 --configs=c3:compute_wgs=3,c3s:compute_wgs=3:skip_padding_rows=True

Nsight Compute replays each kernel alone, so it cannot show two kernels of a stream
running at once (programmatic dependent launch, ``MosaicConfig.pdl``); this records
the kernels as they ran, through CUPTI (PyTorch's profiler, which sees every kernel of
the process, JAX's included). Per configuration it prints the step's period and, per
kernel of a step (by its place: every Mosaic kernel has one name), the median duration,
the median gap before it (negative: it started before the kernel before it ended) and
its end after the one before's (``report.timeline_summary``), and writes every kernel's
times to ``--out_dir``.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks import report

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch", 1, "Batch.")
flags.DEFINE_integer("seq_len", 131072, "Keys (Skv).")
flags.DEFINE_integer("query_len", 1, "Queries a sequence (Sq): 1 for a decode step, up "
                     "to --seq_len for a prefill (causal: the last Sq keys' queries).")
flags.DEFINE_integer("num_q_heads", 32, "Query heads.")
flags.DEFINE_integer("num_kv_heads", 8, "KV heads.")
flags.DEFINE_integer("head_dim", 128, "Head dim.")
flags.DEFINE_integer("steps", 20, "Calls timed back to back (two input sets).")
flags.DEFINE_list("configs", ["default:", "off:pdl=off"], "name:MosaicConfig fields "
                  "(key=value[:key=value...]) per configuration.")
flags.DEFINE_float("hold_s", 0.0, "Seconds of back-to-back calls before the timed "
                   "steps (the GPU at its steady clock and power); the wall-clock "
                   "times of the hold and of the timed steps are printed and kept, "
                   "so a clock log (nvidia-smi) can be read per configuration.")
flags.DEFINE_integer("profile_space", 0, "Each configuration's kernel built and run "
                     "with Mosaic GPU's on-device profiler in it (forward.profiling, "
                     "this many ranges a warpgroup; the trace of its first call kept "
                     "under --out_dir): the timeline of the profiled kernel, which "
                     "benchmarks.mosaic_profile reads; 0: the plain kernel.")
flags.DEFINE_string("out_dir", None, "Write timeline.json here.")


def kernels(prof) -> list[tuple[str, int, int]]:
    """``(name, start_ns, end_ns)`` of the CUDA kernels a torch profile recorded, in
    start order."""
    import torch
    rows = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0:
            rows.append((e.name(), e.start_ns(), e.start_ns() + e.duration_ns()))
    return sorted(rows, key=lambda r: r[1])


def stamp(t: float) -> str:
    """``t`` (seconds since the epoch) as UTC ``HH:MM:SS.mmm``, as nvidia-smi's log."""
    return time.strftime("%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}"


def main(argv):
    del argv
    b, s, d, sq = FLAGS.batch, FLAGS.seq_len, FLAGS.head_dim, FLAGS.query_len
    if not 1 <= sq <= s:
        raise app.UsageError(f"--query_len must be in [1, --seq_len={s}], got {sq}")
    if FLAGS.hold_s < 0:
        raise app.UsageError(f"--hold_s must be >= 0, got {FLAGS.hold_s}")
    if FLAGS.profile_space < 0:
        raise app.UsageError(f"--profile_space must be >= 0, got {FLAGS.profile_space}")
    import torch

    from jaxattn.backends.mosaic import forward as mf
    if not torch.cuda.is_available():
        raise app.UsageError("kernel_timeline records GPU kernels: no CUDA device here")
    sets = []
    for i in range(2):
        ks = jax.random.split(jax.random.PRNGKey(i), 3)
        sets.append((jax.random.normal(ks[0], (b, FLAGS.num_q_heads, sq, d), jnp.bfloat16),
                     jax.random.normal(ks[1], (b, FLAGS.num_kv_heads, s, d), jnp.bfloat16),
                     jax.random.normal(ks[2], (b, FLAGS.num_kv_heads, s, d), jnp.bfloat16)))
    results = {}
    for spec in FLAGS.configs:
        name, fields = report.named_config(spec)
        cfg = mf.MosaicConfig(**fields)
        with contextlib.ExitStack() as stack:
            if FLAGS.profile_space:
                where = FLAGS.out_dir or tempfile.mkdtemp()
                where = os.path.join(where, f"profile-{name}")
                os.makedirs(where, exist_ok=True)
                stack.enter_context(mf.profiling(FLAGS.profile_space, where))
            results[name] = run_config(mf, cfg, fields, sets)
        print_config(name, fields, results[name])
    if FLAGS.out_dir:
        os.makedirs(FLAGS.out_dir, exist_ok=True)
        with open(os.path.join(FLAGS.out_dir, "timeline.json"), "w") as f:
            json.dump({"B": b, "Sq": sq, "Skv": s, "Hq": FLAGS.num_q_heads,
                       "Hkv": FLAGS.num_kv_heads, "D": d, "steps": FLAGS.steps,
                       "profile_space": FLAGS.profile_space, "results": results}, f)


def run_config(mf, cfg, fields, sets) -> dict:
    """One configuration's warm-up, hold (``--hold_s``) and timed steps: its
    ``timeline.json`` entry."""
    from torch.profiler import ProfilerActivity, profile
    fn = jax.jit(lambda q, k, v, cfg=cfg: mf.forward(q, k, v, causal=True, config=cfg))
    for x in sets:  # compile and warm up
        jax.block_until_ready(fn(*x))
    wall = {"hold_start": time.time()}
    calls = 0
    while time.time() - wall["hold_start"] < FLAGS.hold_s:
        jax.block_until_ready([fn(*sets[i % 2]) for i in range(FLAGS.steps)])
        calls += FLAGS.steps
    wall["timed_start"] = time.time()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        outs = [fn(*sets[i % 2]) for i in range(FLAGS.steps)]
        jax.block_until_ready(outs)
    wall["timed_end"] = time.time()
    rows = kernels(prof)
    if not rows:
        raise RuntimeError("the profiler recorded no CUDA kernel (CUPTI not shared "
                           "with JAX in this process?)")
    return {"config": fields, "kernels": rows,
            "summary": report.timeline_summary(rows, FLAGS.steps),
            "span_us": (rows[-1][2] - rows[0][1]) / 1e3,
            "wall": wall, "hold_calls": calls}


def print_config(name: str, fields: dict, res: dict) -> None:
    """The configuration's lines: its kernels' span, the wall times, the step's period
    and each kernel's median duration, gap and end."""
    rows, calls, wall = res["kernels"], res["hold_calls"], res["wall"]
    print(f"== {name} ({fields or 'defaults'}): {len(rows)} kernels in "
          f"{res['span_us']:.1f} us, {FLAGS.steps} steps", flush=True)
    print(f"  wall (UTC): held {calls} calls {stamp(wall['hold_start'])} to "
          f"{stamp(wall['timed_start'])}, timed to {stamp(wall['timed_end'])}", flush=True)
    summary = dict(res["summary"])
    print(f"  step {summary.pop('step_us') or 0:.2f} us (median)", flush=True)
    for kname, st in summary.items():
        gap, end = st["median_gap_before_us"], st["median_end_after_us"]
        print(f"  {st['launches']:4d} x {st['median_us']:9.2f} us, gap before "
              f"{'-' if gap is None else f'{gap:8.2f}'} us, ends "
              f"{'-' if end is None else f'{end:8.2f}'} us after the one before  "
              f"{kname[:80]}", flush=True)


if __name__ == "__main__":
    app.run(main)
