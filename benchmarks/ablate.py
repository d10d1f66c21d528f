"""Ablations of the Mosaic forward: where its time goes, measured by taking one part away.

    python -m benchmarks.ablate --ablations=exp_free,no_rowmax --runs=64c,256c \\
        --shapes=8:4096,2:16384 --out_dir=$OUT/ablate

Each ablation is a set of text edits to a copy of the ``jaxattn`` package: the kernel
then computes a **wrong answer**, so these runs time and never check (issue 33's
METHOD loop: what a part costs bounds what any change to it can gain). Each run
(``--runs``: head dim and ``c`` causal or ``n`` not) times the unedited package first
and last and each ablation between them, a process each (``benchmarks.mosaic_gpu_check
--nochecks --speed`` with torch cuDNN beside it, the copy first on ``PYTHONPATH``): the
two unedited processes give the spread between processes. The table gives each
ablation's TFLOP/s over the mean of the two, and the same of its ratio to torch cuDNN
in its own process (the machine's level can move between processes). An edit whose
text is not found exactly once raises before anything runs (``--prepare_only`` checks
them all; the CPU tests do).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("ablations", ["exp_free"], "Names of ABLATIONS to time.")
flags.DEFINE_list("runs", ["64c"], "Head dim and mask per run: 64c, 128n, 256c, ...")
flags.DEFINE_list("shapes", ["8:4096", "2:16384"], "B:S points (B * S = 32k is the sweep's).")
flags.DEFINE_integer("iters", 5, "Timed samples (median) per point.")
flags.DEFINE_integer("timeout", 240, "Seconds per process.")
flags.DEFINE_string("out_dir", None, "Write ablate.json and each process's output here.")
flags.DEFINE_bool("prepare_only", False, "Apply every ablation to a copy and exit.")

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORWARD = "jaxattn/backends/mosaic/forward.py"

#: name -> (what is taken away, [(file, old text, new text)]).
ABLATIONS: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "exp_free": (
        "the probabilities' exponential (MUFU ex2 a score): p = s * scale - m, the "
        "rescale's exponential kept",
        [(FORWARD,
          "p32 = self.exp(s * self.s_scale - _rows(m_safe, s.shape))",
          "p32 = s * self.s_scale - _rows(m_safe, s.shape)")]),
    "no_rowmax": (
        "the unmasked blocks' row max (its shuffles): the max taken as 0",
        [(FORWARD,
          "        else:\n            raw_max = s.max(axis=1)\n",
          "        else:\n            raw_max = self.rows_init(0.0)\n")]),
    "no_rowsum": (
        "the running row sum's block term (its per-thread adds and cross-lane shuffles): "
        "l only rescaled, so the bound of what a row sum without per-block shuffles "
        "(per-lane partial sums, reduced once at the end) could gain",
        [(FORWARD,
          "    return l * alpha + p32.sum(axis=1)\n",
          "    return l * alpha\n")]),
    "no_merge_loads": (
        "gmem_state's reads of the running state between SPLITs (the merge takes zeros "
        "for it; the math and the scratch's stores kept: taking the stores away lets "
        "the compiler drop the interior SPLITs' P V too)",
        [(FORWARD,
          "lambda: self.load(chunks[j], plgpu.Layout.WGMMA, False))",
          "lambda: self.tile_zeros(cols))")]),
}


def prepare(name: str, dest: pathlib.Path) -> pathlib.Path:
    """A copy of ``jaxattn`` under ``dest`` with ``name``'s edits; returns ``dest``."""
    if name not in ABLATIONS:
        raise ValueError(f"ablation: {name!r} is not one of {sorted(ABLATIONS)}")
    shutil.copytree(ROOT / "jaxattn", dest / "jaxattn",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for rel, old, new in ABLATIONS[name][1]:
        path = dest / rel
        text = path.read_text()
        if text.count(old) != 1:
            raise ValueError(f"ablation {name!r}: {old!r} occurs {text.count(old)} times in "
                             f"{rel}, not once (the kernel's text moved: update ABLATIONS)")
        path.write_text(text.replace(old, new))
    return dest


def run_one(label: str, path: pathlib.Path | None, head_dim: int, causal: bool,
            out: pathlib.Path) -> list[dict]:
    """One process of ``mosaic_gpu_check --speed`` with ``path`` first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(p) for p in (path, ROOT) if p is not None] + [env.get("PYTHONPATH", "")])
    res = out / label
    cmd = [sys.executable, "-m", "benchmarks.mosaic_gpu_check", "--nochecks", "--speed",
           "--nospeed_pallas", "--peers=torch_cudnn", f"--iters={FLAGS.iters}",
           f"--speed_head_dim={head_dim}",
           "--speed_causal" if causal else "--nospeed_causal",
           f"--speed_shapes={','.join(FLAGS.shapes)}", "--fwd_variants=default",
           f"--out_dir={res}"]
    try:  # (``-m`` puts the working directory first on sys.path: the copy's)
        proc = subprocess.run(cmd, cwd=path or ROOT, env=env, capture_output=True, text=True,
                              timeout=FLAGS.timeout)
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        log = f"timeout after {FLAGS.timeout} s\n{e.stdout or ''}{e.stderr or ''}"
    res.mkdir(parents=True, exist_ok=True)
    (res / "log.txt").write_text(log)
    try:
        rows = json.loads((res / "results.json").read_text())
    except (OSError, ValueError):
        print(f"{label}: no results (log: {res / 'log.txt'})\n{log[-1500:]}", flush=True)
        return []
    return [r for r in rows if r.get("kind") == "speed"]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def table(rows: list[dict]) -> str:
    """TFLOP/s per run, point and process; each ablation over the two defaults' mean,
    and the same of jaxattn over torch cuDNN in its own process (the machine's level
    can move between processes: on 2026-12-07 torch cuDNN read 538 to 612 TFLOP/s in
    four processes of one call)."""
    lines = ["| run | B, S | process | jaxattn | torch cuDNN | over the defaults' mean "
             "| over torch cuDNN, over the defaults' |",
             "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["D"], r["causal"], r["B"], r["S"]) for r in rows if "D" in r})
    for d, causal, b, s in keys:
        at = [r for r in rows if (r.get("D"), r["causal"], r["B"], r["S"]) == (d, causal, b, s)]
        ours = [r for r in at if r["system"].startswith("mosaic:") and "tflops" in r]
        peer = {p["proc"]: p["tflops"] for p in at
                if p["system"] == "torch_cudnn" and "tflops" in p}  # (by process)
        nan = float("nan")
        base = [r for r in ours if r["ablation"] == "default"]
        level = _mean([r["tflops"] for r in base])
        rel = _mean([r["tflops"] / peer.get(r["proc"], nan) for r in base])
        for r in ours:
            p = peer.get(r["proc"], nan)
            lines.append(f"| {d}{'c' if causal else 'n'} | {b}, {s} | {r['ablation']} "
                         f"({r['proc']}) | {r['tflops']:.1f} | {p:.1f} | "
                         f"{r['tflops'] / level:.3f} | {r['tflops'] / p / rel:.3f} |")
    return "\n".join(lines)


def main(argv):
    del argv
    with tempfile.TemporaryDirectory(prefix="jaxattn-ablate-") as tmp:
        copies = {name: prepare(name, pathlib.Path(tmp) / name) for name in FLAGS.ablations}
        if FLAGS.prepare_only:
            print(f"prepared {sorted(copies)}")
            return
        out = pathlib.Path(FLAGS.out_dir or tempfile.mkdtemp(prefix="jaxattn-ablate-out-"))
        out.mkdir(parents=True, exist_ok=True)
        rows: list[dict] = []
        for run in FLAGS.runs:
            head_dim, causal = int(run[:-1]), run.endswith("c")
            order = ["default", *FLAGS.ablations, "default"]
            for i, name in enumerate(order):
                label = f"{run}-{i}-{name}"
                got = run_one(label, copies.get(name), head_dim, causal, out)
                rows += [dict(r, ablation=name, proc=i) for r in got]
                print(label, [(r["system"], r["B"], r["S"], round(r.get("tflops", 0), 1))
                              for r in got], flush=True)
        (out / "ablate.json").write_text(json.dumps(
            {"ablations": {n: ABLATIONS[n][0] for n in FLAGS.ablations}, "rows": rows},
            indent=1))
        md = table(rows)
        (out / "ablate.md").write_text(md + "\n")
        print(md, flush=True)


if __name__ == "__main__":
    app.run(main)
