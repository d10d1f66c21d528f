"""Shared by the benchmark binaries: where results go (``results.json`` and
``results.md`` under ``--out_dir``), one progress line per measured row, and the
synchronous per-call timer, the sampled timer of back-to-back calls over rotating
inputs, and the FLOP count of an attention forward."""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any


def config_fields(spec: str) -> dict:
    """``key=value[:key=value...]`` -> a config's keyword arguments (the binaries'
    launch variants): ints, True / False, None, ``a/b`` tuples of ints, else strings;
    an empty spec is no field."""
    kw = {}
    for pair in filter(None, spec.split(":")):
        key, val = pair.split("=", 1)
        if val in ("True", "False"):
            kw[key] = val == "True"
        elif val == "None":
            kw[key] = None
        elif val.lstrip("-").isdigit():
            kw[key] = int(val)
        elif "/" in val:
            kw[key] = tuple(int(x) for x in val.split("/"))
        else:
            kw[key] = val
    return kw


def named_config(spec: str) -> tuple[str, dict]:
    """``name[:key=value...]`` (a binary's launch variant) -> ``(name, kwargs)`` of
    :func:`config_fields`."""
    name, _, fields = spec.partition(":")
    return name, config_fields(fields)


def write(out_dir: str | None, data: Any, md: str | None = None, **json_kw) -> None:
    """``data`` as ``out_dir/results.json`` and ``md`` (if given) as ``results.md``;
    nothing when ``out_dir`` is None."""
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(data, f, indent=2, **json_kw)
    if md is not None:
        with open(os.path.join(out_dir, "results.md"), "w") as f:
            f.write(md)


def read(paths: list[str], errors: bool = False) -> tuple[list[dict], list[dict]]:
    """The rows and metas of the ``results.json`` files at ``paths`` (the binaries'
    :func:`write`); the rows of systems that failed (an ``error`` key) only with
    ``errors``."""
    rows, metas = [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        metas.append(data["meta"])
        rows += [r for r in data["rows"] if errors or "error" not in r]
    return rows, metas


def print_row(row: dict) -> None:
    """One measured row, floats to 3 decimals, flushed (long runs show progress)."""
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()},
          flush=True)


def median_seconds(fn, args, iters: int) -> float:
    """Median wall time of ``iters`` calls of ``fn(*args)``, each waited for, after one
    untimed call (compilation, first-touch)."""
    return rotating_median_seconds(fn, [args], iters)


def rotating_median_seconds(fn, inputs: list, iters: int) -> float:
    """Median wall time of ``iters`` calls of ``fn``, call i on ``inputs[i % len]`` (the
    input sets rotated), each waited for, after one untimed call per input set."""
    import jax

    for args in inputs:
        jax.block_until_ready(fn(*args))
    times = []
    for i in range(iters):
        args = inputs[i % len(inputs)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sampled_seconds(fn: Callable, inputs: list, sync: Callable, iters: int, warmup: int,
                    max_reps: int, sample_s: float) -> tuple[float, int]:
    """(median seconds per call, reps per sample): each of ``iters`` samples launches
    ``reps`` calls back to back, rotating over the input sets, and synchronises once."""
    for i in range(warmup):
        sync(fn(*inputs[i % len(inputs)]))
    t0 = time.perf_counter()
    sync(fn(*inputs[0]))
    one = time.perf_counter() - t0
    reps = max(1, min(max_reps, math.ceil(sample_s / max(one, 1e-9))))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for r in range(reps):
            out = fn(*inputs[r % len(inputs)])
        sync(out)
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times), reps


def timeline_summary(rows, steps: int = 1) -> dict:
    """``rows``: ``(name, start_ns, end_ns)`` of kernels in start order, ``steps`` steps
    of the same kernels -> per kernel of a step (keyed ``"i:name"``, its place in the
    step: every Mosaic kernel has one name), its launches, median duration, the median
    gap before it (negative where it started before the kernel before it ended; none
    before the first) and the median time from the end of the kernel before it to its
    own end, in us; ``"step_us"``: the median time from one step's first kernel's start
    to the next's."""
    if steps < 1 or len(rows) % steps:
        raise ValueError(f"{len(rows)} kernels are not {steps} steps of equal length")
    per = len(rows) // steps
    out = {}
    for i, (name, start, end) in enumerate(rows):
        s = out.setdefault(f"{i % per}:{name}", {"durations": [], "gaps": [], "ends": []})
        s["durations"].append((end - start) / 1e3)
        if i:
            s["gaps"].append((start - rows[i - 1][2]) / 1e3)
            s["ends"].append((end - rows[i - 1][2]) / 1e3)
    med = statistics.median
    summary = {key: {"launches": len(s["durations"]), "median_us": med(s["durations"]),
                     "median_gap_before_us": med(s["gaps"]) if s["gaps"] else None,
                     "median_end_after_us": med(s["ends"]) if s["ends"] else None}
               for key, s in out.items()}
    firsts = [rows[i][1] for i in range(0, len(rows), per)]
    summary["step_us"] = (med([(b - a) / 1e3 for a, b in zip(firsts[:-1], firsts[1:], strict=True)])
                          if len(firsts) > 1 else None)
    return summary


def clock_windows(csv_text: str, windows: dict[str, tuple[float, float]]) -> dict:
    """An nvidia-smi log (``--query-gpu=timestamp,clocks.current.sm,power.draw,...
    --format=csv``: UTC stamps ``YYYY/MM/DD HH:MM:SS.mmm``, then ``N MHz``, ``N W``
    and any further columns, the last the throttle reasons' bit mask) read per
    window: name -> ``(start, end)`` in seconds since the epoch (``kernel_timeline``'s
    wall times) -> its samples, the SM clock's median and minimum (MHz), the power's
    median (W) and the reasons' masks seen (other than none). Lines that are not
    samples (the header, nvidia-smi's errors) are skipped."""
    samples = []
    for line in csv_text.splitlines():
        cols = [c.strip() for c in line.split(",")]
        try:
            t = datetime.datetime.strptime(cols[0], "%Y/%m/%d %H:%M:%S.%f").replace(
                tzinfo=datetime.UTC).timestamp()
            mhz, watts = float(cols[1].split()[0]), float(cols[2].split()[0])
        except (ValueError, IndexError):
            continue
        samples.append((t, mhz, watts, cols[-1] if len(cols) > 4 else ""))
    out = {}
    for name, (start, end) in windows.items():
        inside = [x for x in samples if start <= x[0] <= end]
        out[name] = {
            "samples": len(inside),
            "sm_mhz_median": statistics.median(x[1] for x in inside) if inside else None,
            "sm_mhz_min": min((x[1] for x in inside), default=None),
            "power_w_median": statistics.median(x[2] for x in inside) if inside else None,
            "reasons": sorted({x[3] for x in inside if _reasons_mask(x[3])}),
        }
    return out


def _reasons_mask(text: str) -> int:
    """nvidia-smi's throttle reasons (``0x...``) as an int; 0 where not a mask."""
    try:
        return int(text, 16)
    except ValueError:
        return 0


def print_clock_windows(timeline_json: str, clock_csv: str) -> dict:
    """:func:`clock_windows` of ``kernel_timeline``'s ``timeline.json`` (each
    configuration's hold where it held calls, from ``hold_start`` to ``timed_start``,
    and its timed steps)
    in the log ``clock_csv``, a line each; returned too."""
    with open(timeline_json) as f:
        results = json.load(f)["results"]
    windows = {}
    for name, r in results.items():
        wall = r.get("wall") or {}
        if r.get("hold_calls"):  # (--hold_s ran calls)
            windows[f"{name} hold"] = (wall["hold_start"], wall["timed_start"])
        if "timed_end" in wall:
            windows[f"{name} timed"] = (wall["timed_start"], wall["timed_end"])
    with open(clock_csv) as f:
        got = clock_windows(f.read(), windows)
    for name, w in got.items():
        print(f"  clock {name}: {w['samples']} samples, SM median {w['sm_mhz_median']} "
              f"MHz (min {w['sm_mhz_min']}), power median {w['power_w_median']} W, "
              f"reasons {', '.join(w['reasons']) or 'none'}", flush=True)
    return got


def attention_flops(b, hq, sq, skv, d, causal: bool) -> float:
    """Matmul FLOPs of one forward (2 matmuls), counting visible pairs only when causal."""
    if causal:
        off = skv - sq
        if off >= 0:  # rows see off+1 .. off+sq keys
            pairs = sq * off + sq * (sq + 1) / 2
        else:
            pairs = sum(max(0, i + off + 1) for i in range(sq))
    else:
        pairs = sq * skv
    return 4.0 * b * hq * pairs * d


def dispatch_floor_ms(iters: int = 10, reps: int = 50) -> float:
    """Milliseconds per call of the smallest jitted program (one add on 1024 floats),
    called back to back as the binaries call attention: the host's dispatch floor, under
    which no jitted call's figure can go (what limits the smallest decode points)."""
    import jax
    import jax.numpy as jnp

    xs = [(jnp.full((1024,), float(i), jnp.float32),) for i in range(3)]
    sec, _ = sampled_seconds(jax.jit(lambda x: x + 1.0), xs, jax.block_until_ready, iters,
                             3, reps, 0.02)
    return sec * 1e3


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy, GB/s counting bytes read plus bytes written: the bandwidth
    the binaries put beside their memory-bound figures."""
    import jax
    import jax.numpy as jnp

    n = nbytes // 4
    xs = [(jax.random.uniform(jax.random.PRNGKey(i), (n,), jnp.float32),) for i in range(2)]
    sec, _ = sampled_seconds(jax.jit(lambda x: x + 1.0), xs, jax.block_until_ready, iters,
                             3, 5, 0.0)
    return 2 * n * 4 / sec / 1e9


#: A compute warpgroup's ranges in a Mosaic prefill's profile, as ``forward``'s named
#: scopes call them (``benchmarks/mosaic_profile.py``).
ITEM_RANGES = ("wait_q", "wait_k", "fold", "skip", "epilogue")


def profile_ranges(events: list[dict]) -> dict[int, list[tuple[str, float, float]]]:
    """The trace's begin/end events paired per trace (``tid``: one warpgroup of one
    CTA) into ``(name, start, end)`` in cycles, in start order; a range nested in one
    of its own name (a scope entered again inside a branch) is dropped."""
    out: dict[int, list] = {}
    stacks: dict[int, list] = {}
    for e in events:
        tid, t = e["tid"], float(e["ts"]) * 1e3  # (the dump's ts is cycles / 1e3)
        st = stacks.setdefault(tid, [])
        if e["ph"] == "B":
            st.append((e["name"], t))
        else:
            name, t0 = st.pop()
            if name != e["name"]:
                raise ValueError(f"unbalanced profile: {name} closed by {e['name']}")
            if all(n != name for n, _ in st):
                out.setdefault(tid, []).append((name, t0, t))
    return {tid: sorted(r, key=lambda x: x[1]) for tid, r in out.items()}


def profile_items(ranges: list[tuple[str, float, float]]) -> list[dict]:
    """One compute warpgroup's items: each ``item`` range's cycles, its named ranges'
    cycles, ``other`` (outside them) and ``gap`` (to the next item's start; None for
    the last)."""
    items = [r for r in ranges if r[0] == "item"]
    rows = []
    for i, (_, t0, t1) in enumerate(items):
        row = {"item": t1 - t0, **{n: 0.0 for n in ITEM_RANGES}}
        for name, a, b in ranges:
            if name in ITEM_RANGES and t0 <= a and b <= t1:
                row[name] += b - a
        row["other"] = row["item"] - sum(row[n] for n in ITEM_RANGES)
        row["gap"] = items[i + 1][1] - t1 if i + 1 < len(items) else None
        row["start"], row["end"] = t0, t1
        rows.append(row)
    return rows


def _deciles(vals: list) -> list[float]:
    """The 10th and 90th percentiles of ``vals`` (statistics' inclusive method)."""
    if len(vals) < 2:
        return [float(vals[0])] * 2
    q = statistics.quantiles(vals, n=10, method="inclusive")
    return [q[0], q[-1]]


def profile_summary(trace: dict, *, key_blocks: int | None,
                    block_ranges: tuple[str, ...] = ()) -> dict:
    """Per role (``compute``: the warpgroups with items; ``producer``: with
    ``produce``) the medians of each range over the items after each CTA's first and
    over the first items; the fold per key block (``key_blocks`` a (non-causal) item);
    the CTAs' spans and items; where the trace has a key block's ranges
    (``block_ranges``, ``forward.BLOCK_SCOPES``, the first its start), each one's
    median and ``block_period``, the median from one block's first range to the next
    one's in the same item."""
    per_tid = profile_ranges(trace["traceEvents"])
    compute, first, produce, spans, counts = [], [], [], [], []
    blocks = {n: [] for n in block_ranges}
    periods = []
    for rs in per_tid.values():
        items = profile_items(rs)
        if items:
            first.append(items[0])
            compute.extend(items[1:])
            spans.append(items[-1]["end"] - items[0]["start"])
            counts.append(len(items))
        produce.extend(b - a for n, a, b in rs if n == "produce")
        for n, a, b in rs:
            if n in blocks:
                blocks[n].append(b - a)
        block_starts = [a for n, a, _ in rs if block_ranges and n == block_ranges[0]]
        for item in items:
            starts = [a for a in block_starts if item["start"] <= a <= item["end"]]
            periods.extend(y - x for x, y in zip(starts, starts[1:], strict=False))

    def med(rows, key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    keys = ("item", *ITEM_RANGES, "other", "gap")
    out = {
        "compute_traces": len(spans),
        "items_per_trace": [int(min(counts, default=0)), int(max(counts, default=0))],
        "later_items": {k: med(compute, k) for k in keys},
        "first_items": {k: med(first, k) for k in keys},
        "produce_median": statistics.median(produce) if produce else None,
        "span_median": statistics.median(spans) if spans else None,
        "span_max": float(max(spans)) if spans else None,
        "item_p10_p90": (_deciles([r["item"] for r in compute]) if compute else None),
    }
    if any(blocks.values()):
        out["blocks"] = {n: statistics.median(v) if v else None
                         for n, v in blocks.items()}
        out["block_period"] = statistics.median(periods) if periods else None
    if key_blocks and compute:
        out["fold_per_block"] = out["later_items"]["fold"] / key_blocks
        # the item's cycles beyond its blocks at the fold's rate, in blocks
        out["item_overhead_blocks"] = (out["later_items"]["item"]
                                       + (out["later_items"]["gap"] or 0.0)
                                       ) / out["fold_per_block"] - key_blocks
    return out
