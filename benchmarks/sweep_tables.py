"""Markdown tables of attention_bench results, as docs/benchmarks.md publishes them. Runs
anywhere (no device needed), on results fetched back.

    python -m benchmarks.sweep_tables --results=a/results.json,b/results.json

One table per (mode, head dim, causal) found: a row per sequence length (its batch in
brackets), a column per system in the order the results list them, the registry's
default in bold, and the default's ratio to ``--ratio_to`` (torch cuDNN unless told).
TFLOP/s for the prefill modes, GB/s for decode; "error" where a system failed.
"""

from __future__ import annotations

from absl import app, flags

from benchmarks import report

FLAGS = flags.FLAGS
flags.DEFINE_list("results", None, "attention_bench results.json files.")
flags.DEFINE_string("default", "jaxattn:mosaic", "The system set in bold.")
flags.DEFINE_string("ratio_to", "torch_cudnn", "The peer the default's ratio is to.")

MODE_TITLES = {"fwd": "Forward TFLOP/s", "fwdbwd": "Forward + backward TFLOP/s",
               "chunked": "Chunked prefill TFLOP/s (one chunk of queries against S keys)",
               "decode": "Decode GB/s (one query a sequence)"}


def _metric(mode: str) -> str:
    return "GB/s" if mode == "decode" else "TFLOP/s"


def tables(rows: list[dict], default: str, ratio_to: str) -> str:
    """The markdown of every (mode, D, causal) group of ``rows`` (attention_bench's rows,
    failed ones included as "error")."""
    groups: dict[tuple, dict] = {}
    for r in rows:
        key = (r["mode"], r["D"], r["causal"])
        length = r["Skv"]
        cell = groups.setdefault(key, {}).setdefault((length, r["B"]), {})
        value = r.get(_metric(r["mode"]))
        cell[r["system"]] = "error" if "error" in r or value is None else value
    out = []
    for (mode, d, causal), cells in groups.items():
        systems = list(dict.fromkeys(s for c in cells.values() for s in c))
        ratio = default in systems and ratio_to in systems
        head = ["S" if mode != "decode" else "keys"] + [
            s.replace(":", " ") for s in systems] + (
            [f"{default.split(':')[-1]} / {ratio_to}"] if ratio else [])
        out.append(f"### {MODE_TITLES.get(mode, mode)}, D={d}, "
                   f"{'causal' if causal else 'non-causal'}")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for (length, b), c in sorted(cells.items()):
            vals = []
            for s in systems:
                v = c.get(s, "-")
                text = v if isinstance(v, str) else f"{v:.0f}"
                vals.append(f"**{text}**" if s == default else text)
            if ratio:
                a, p = c.get(default), c.get(ratio_to)
                ok = all(isinstance(x, float) for x in (a, p))
                vals.append(f"{a / p:.2f}" if ok else "-")
            out.append(f"| {length} (B={b}) | " + " | ".join(vals) + " |")
        out.append("")
    return "\n".join(out)


def main(argv):
    del argv
    if not FLAGS.results:
        raise app.UsageError("--results is required")
    print(tables(report.read(FLAGS.results, errors=True)[0], FLAGS.default,
                 FLAGS.ratio_to))


if __name__ == "__main__":
    app.run(main)
