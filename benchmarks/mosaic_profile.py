"""Where a Mosaic prefill's time goes per item: Mosaic GPU's on-device profiler over the
forward kernel's named scopes (``forward.profiling``), summarised per warpgroup role.

    python3 -m benchmarks.mosaic_profile --head_dim=64 --causal=false \\
        --shapes=4:1024,1:4096 --configs=default:,c2:compute_wgs=2 --out_dir=/tmp/prof

Each compute warpgroup records, per (tile, head, batch) item, ``item`` and in it
``wait_q`` (the Q tile's barrier), ``wait_k`` (the first K block's), ``fold`` (the
key blocks and the SPLIT fold), ``skip`` (blocks only another warpgroup needs, and
the ping-pong's closing rendezvous) and ``epilogue`` (the output's and lse's stores);
the producer ``produce`` (an item's K/V loads, each once its slot is free). Times are
the SM's clock (cycles), so they compare within a CTA, not across CTAs. Per shape and
configuration the summary gives each range's median cycles over the items after a
CTA's first (the first apart), ``other`` (the item's cycles outside its named ranges),
``gap`` (from one item's end to the next one's start), the fold's cycles per key
block, and a CTA's span (first item's start to last item's end) over its items.
Writes ``profile.json`` (the summaries) and each case's Perfetto trace to
``--out_dir``; Mosaic GPU's own estimate of the profiler's cost per event is
subtracted by JAX.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import shutil
import tempfile

import numpy as np
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
flags.DEFINE_string("out_dir", None, "Write profile.json and the traces here.")

#: A compute warpgroup's ranges, as ``forward``'s named scopes call them.
ITEM_RANGES = ("wait_q", "wait_k", "fold", "skip", "epilogue")


def ranges_of(events: list[dict]) -> dict[int, list[tuple[str, float, float]]]:
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


def items_of(ranges: list[tuple[str, float, float]]) -> list[dict]:
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


def summarise(trace: dict, *, key_blocks: int | None) -> dict:
    """Per role (``compute``: the warpgroups with items; ``producer``: with
    ``produce``) the medians of each range over the items after each CTA's first and
    over the first items; the fold per key block (``key_blocks`` a (non-causal) item);
    the CTAs' spans and items."""
    per_tid = ranges_of(trace["traceEvents"])
    compute, first, produce, spans, counts = [], [], [], [], []
    for rs in per_tid.values():
        items = items_of(rs)
        if items:
            first.append(items[0])
            compute.extend(items[1:])
            spans.append(items[-1]["end"] - items[0]["start"])
            counts.append(len(items))
        produce.extend(b - a for n, a, b in rs if n == "produce")

    def med(rows, key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return float(np.median(vals)) if vals else None

    keys = ("item", *ITEM_RANGES, "other", "gap")
    out = {
        "compute_traces": len(spans),
        "items_per_trace": [int(min(counts, default=0)), int(max(counts, default=0))],
        "later_items": {k: med(compute, k) for k in keys},
        "first_items": {k: med(first, k) for k in keys},
        "produce_median": float(np.median(produce)) if produce else None,
        "span_median": float(np.median(spans)) if spans else None,
        "span_max": float(max(spans)) if spans else None,
        "item_p10_p90": ([float(np.percentile([r["item"] for r in compute], p))
                          for p in (10, 90)] if compute else None),
    }
    if key_blocks and compute:
        out["fold_per_block"] = out["later_items"]["fold"] / key_blocks
        # the item's cycles beyond its blocks at the fold's rate, in blocks
        out["item_overhead_blocks"] = (out["later_items"]["item"]
                                       + (out["later_items"]["gap"] or 0.0)
                                       ) / out["fold_per_block"] - key_blocks
    return out


def main(argv):
    del argv
    import functools

    import jax

    from benchmarks import report
    from benchmarks.mosaic_gpu_check import _inputs
    from jaxattn import schedule
    from jaxattn.backends.mosaic import forward as mf
    if jax.default_backend() != "gpu":
        raise app.UsageError("the on-device profiler records GPU kernels: no GPU here")
    hq, hkv, d = FLAGS.num_q_heads, FLAGS.num_kv_heads, FLAGS.head_dim
    out_dir = FLAGS.out_dir or tempfile.mkdtemp()
    os.makedirs(out_dir, exist_ok=True)
    results = []
    n_sm = mf.sm_count()
    for spec in FLAGS.shapes:
        b, s = (int(x) for x in spec.split(":"))
        q, k, v, _ = _inputs(b, hq, hkv, s, s, d, seed=11)
        for cspec in FLAGS.configs:
            name, kw = report.named_config(cspec)
            # room for every item of the most loaded CTA (64-row tiles of one
            # warpgroup bound it), eight ranges an item, and the rest
            space = FLAGS.space or 8 * (-(-b * hq * -(-s // 64) // n_sm)) + 32
            row = {"B": b, "S": s, "D": d, "causal": FLAGS.causal, "config": name,
                   "space": space}
            tmp = tempfile.mkdtemp()
            try:
                with mf.profiling(space, tmp):
                    f = jax.jit(functools.partial(mf.forward, causal=FLAGS.causal,
                                                  config=mf.MosaicConfig(**kw)))
                    for _ in range(3):  # the last call's trace: a warm GPU
                        jax.block_until_ready(f(q, k, v))
                jax.effects_barrier()
                files = sorted(glob.glob(os.path.join(tmp, "*-trace.json")),
                               key=os.path.getmtime)
                if not files:
                    raise RuntimeError("the profiler wrote no trace")
                with open(files[-1]) as fh:
                    trace = json.load(fh)
                row.update(summarise(trace, key_blocks=None if FLAGS.causal
                                     else -(-s // schedule.BLOCK_N)))
                dst = os.path.join(out_dir, f"trace-{name}-{b}x{s}.json.gz")
                with open(files[-1], "rb") as src, gzip.open(dst, "wb") as g:
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
