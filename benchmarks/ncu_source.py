"""Where a kernel's warps stall, per instruction, from Nsight Compute's source view.

    python -m benchmarks.ncu_source --csv=ncu-fwd-sass.csv[.gz] [--top=30]

Reads the CSV that ``benchmarks/gpu_suite.sh``'s ncu stage writes with ``NCU_SASS=1``
(``ncu --import REP --page source --csv --print-source sass``) and prints, for the
kernel's hottest loop (the longest run of instructions executed equally often that
holds the most stall samples) and for the whole kernel: the stall reasons' shares,
the samples by opcode, and the instructions that hold the most samples with their
top reasons. A loop's rows are what one warp waits on in one key block; the
producer warpgroup's waits (its own loop) are idle time that costs no issue slot.
"""

from __future__ import annotations

import collections
import csv
import gzip
import io

from absl import app, flags

flags.DEFINE_string("csv", None, "The source view's CSV (gzip if it ends in .gz).")
flags.DEFINE_integer("top", 30, "Instructions to list, hottest first.")
flags.DEFINE_integer("min_run", 100, "Instructions a loop has at least.")
FLAGS = flags.FLAGS

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read(path: str) -> list[dict[str, str]]:
    """The source view's rows (one per SASS instruction), as dicts by column."""
    raw = gzip.open(path, "rt") if path.endswith(".gz") else open(path)
    with raw:
        lines = [line for line in raw if line.startswith('"')]
    rows = list(csv.reader(io.StringIO("".join(lines))))
    head = next(i for i, r in enumerate(rows) if "Source" in r and SAMPLES in r)
    return [dict(zip(rows[head], r, strict=True)) for r in rows[head + 1:]]


def hottest_loop(rows, min_run: int) -> tuple[int, int]:
    """[first, last] of the run of equally often executed instructions (at least
    ``min_run`` of them) holding the most stall samples."""
    runs, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i][EXECUTED] != rows[start][EXECUTED]:
            if i - start >= min_run:
                runs.append((sum(_num(r[SAMPLES]) for r in rows[start:i]), start, i - 1))
            start = i
    if not runs:
        raise ValueError(f"no run of {min_run} equally executed instructions")
    return max(runs)[1:]


def summary(rows, top: int, base: int = 0) -> list[str]:
    """The report's lines for ``rows`` (one loop or the whole kernel), instructions
    numbered from ``base`` (the first row's index in the kernel)."""
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    total = sum(_num(r[SAMPLES]) for r in rows) or 1.0
    by_reason = collections.Counter()
    by_op, reason_of_op = collections.Counter(), collections.defaultdict(collections.Counter)
    for r in rows:
        words = [w for w in r["Source"].split() if not w.startswith("@")]
        op = words[0].split(".")[0] if words else "?"
        by_op[op] += _num(r[SAMPLES])
        for k in reasons:
            by_reason[k] += _num(r[k])
            reason_of_op[op][k] += _num(r[k])
    out = [f"{len(rows)} instructions, {total:.0f} samples"]
    out += [f"  {k[6:]:20s} {v / total:6.1%}" for k, v in by_reason.most_common(8) if v]
    out.append("by opcode:")
    for op, v in by_op.most_common(12):
        why = ", ".join(f"{k[6:]} {c / v:.0%}" for k, c in reason_of_op[op].most_common(2) if c)
        out.append(f"  {op:10s} {v / total:6.1%}  {why}")
    out.append("hottest instructions:")
    for i in sorted(range(len(rows)), key=lambda i: -_num(rows[i][SAMPLES]))[:top]:
        r = rows[i]
        why = ", ".join(f"{k[6:]} {_num(r[k]):.0f}"
                        for k in sorted(reasons, key=lambda k: -_num(r[k]))[:2] if _num(r[k]))
        text = r["Source"].strip()[:64]
        out.append(f"  {base + i:5d} {_num(r[SAMPLES]) / total:6.2%}  {text:64s} {why}")
    return out


def report(path: str, top: int, min_run: int) -> str:
    rows = read(path)
    first, last = hottest_loop(rows, min_run)
    loop = rows[first:last + 1]
    share = sum(_num(r[SAMPLES]) for r in loop) / (sum(_num(r[SAMPLES]) for r in rows) or 1.0)
    return "\n".join([f"{path}: the hottest loop, instructions {first} to {last} "
                      f"(executed {loop[0][EXECUTED]} times; {share:.1%} of the samples)"]
                     + summary(loop, top, first) + ["", "the whole kernel:"] + summary(rows, 0))


def main(argv):
    del argv
    if not FLAGS.csv:
        raise app.UsageError("--csv is required")
    print(report(FLAGS.csv, FLAGS.top, FLAGS.min_run))


if __name__ == "__main__":
    app.run(main)
