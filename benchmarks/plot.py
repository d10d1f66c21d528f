"""PNG plots of attention_bench results: TFLOP/s against sequence length, decode GB/s
against context length. Runs anywhere (no device needed), on results fetched back.

    python -m benchmarks.plot --results=a/results.json,b/results.json --out_dir=docs/x

One figure per (head dim, causal) for the prefill modes found (fwd, fwdbwd, chunked:
one panel each), and one per head dim for decode, with the measured copy bandwidth as a
line. Each figure's caption line holds the date, device, versions and command(s) of the
results it draws.
"""

from __future__ import annotations

import os
from collections import defaultdict

from absl import app, flags

from benchmarks import report

FLAGS = flags.FLAGS
flags.DEFINE_list("results", None, "attention_bench results.json files.")
flags.DEFINE_string("out_dir", None, "Where to write the PNGs.")

PREFILL_MODES = ("fwd", "fwdbwd", "chunked")
MODE_TITLES = {"fwd": "forward", "fwdbwd": "forward + backward",
               "chunked": "chunked prefill (one chunk vs S keys)"}


def _caption(metas: list[dict]) -> str:
    m = metas[0]
    cmds = "; ".join(sorted({x["command"] for x in metas}))
    return (f"{m['date']}, {m['device']}, jax {m['jax']}, torch {m.get('torch', '-')}\n"
            f"{cmds}")[:400]


def plot(rows: list[dict], metas: list[dict], out_dir: str) -> list[str]:
    """Write the figures; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written = []
    groups = defaultdict(list)
    for r in rows:
        if r["mode"] in PREFILL_MODES:
            groups[(r["D"], r["causal"])].append(r)
    for (d, causal), grp in sorted(groups.items()):
        modes = [m for m in PREFILL_MODES if any(r["mode"] == m for r in grp)]
        fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4.2), squeeze=False)
        for ax, mode in zip(axes[0], modes, strict=True):
            by_sys = defaultdict(list)
            for r in grp:
                if r["mode"] == mode:
                    by_sys[r["system"]].append((r["Skv"], r["TFLOP/s"]))
            for system, pts in sorted(by_sys.items()):
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system,
                        linewidth=2.5 if system.startswith("jaxattn") else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length S (keys)")
            ax.set_ylabel("TFLOP/s")
            ax.set_title(MODE_TITLES[mode])
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        r0 = grp[0]
        fig.suptitle(f"Hq={r0['Hq']}, Hkv={r0['Hkv']}, D={d}, {r0.get('dtype', '')}, "
                     f"{'causal' if causal else 'non-causal'}")
        fig.text(0.01, 0.005, _caption(metas), fontsize=6, va="bottom")
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        path = os.path.join(out_dir, f"tflops_d{d}_{'causal' if causal else 'noncausal'}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    dec = defaultdict(list)
    for r in rows:
        if r["mode"] == "decode":
            dec[r["D"]].append(r)
    copy = [m["copy_GBps"] for m in metas if m.get("copy_GBps")]
    for d, grp in sorted(dec.items()):
        fig, ax = plt.subplots(figsize=(6, 4.2))
        by_sys = defaultdict(list)
        for r in grp:
            by_sys[r["system"]].append((r["Skv"], r["GB/s"]))
        for system, pts in sorted(by_sys.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system,
                    linewidth=2.5 if system.startswith("jaxattn") else 1.2)
        if copy:
            ax.axhline(copy[0], color="gray", linestyle="--",
                       label=f"device copy {copy[0]:.0f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (keys)")
        ax.set_ylabel("GB/s of K and V read")
        r0 = grp[0]
        ax.set_title(f"decode, B={r0['B']}, Hq={r0['Hq']}, Hkv={r0['Hkv']}, D={d}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.text(0.01, 0.005, _caption(metas), fontsize=6, va="bottom")
        fig.tight_layout(rect=(0, 0.08, 1, 1))
        path = os.path.join(out_dir, f"decode_gbps_d{d}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv):
    del argv
    if not FLAGS.results or not FLAGS.out_dir:
        raise app.UsageError("--results and --out_dir are required")
    rows, metas = report.read(FLAGS.results)  # the measured rows
    for path in plot(rows, metas, FLAGS.out_dir):
        print(path)


if __name__ == "__main__":
    app.run(main)
