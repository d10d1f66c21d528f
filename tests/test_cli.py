"""The main job and the benchmark binary run end to end, and the main job fails loudly."""

from __future__ import annotations

import itertools
import json
import pathlib
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest
from absl import flags
from conftest import cpu_env, with_xla_flags

from jaxattn import check, reference, registry


def test_check_main_job_passes_and_writes_json(tmp_path, capsys):
    """The invariance-matrix job end to end (in this process: ``python -m jaxattn.check``
    is ``check.main`` after absl's flag parsing; its exit code is tested below)."""
    out = tmp_path / "check.json"
    # pallas and reference: the raw Triton backend's interpreter is slow and has its
    # own battery (tests/test_backends.py).
    # Small enough for CI: two blocks of keys, one chunk size off the block grid.
    try:
        # Rows enough to exercise the job (a promised row, a row with n/a results, the
        # table and the JSON); every row runs on every backend in tests/test_backends.py.
        rows = ["batch", "decode", "cp", "jax layout"]
        flags.FLAGS(["check", "--backends=pallas,reference", "--num_q_heads=2",
                     "--num_kv_heads=1", "--head_dim=32", "--seq_len=70", "--decode_steps=2",
                     "--chunk_sizes=50", f"--json_out={out}", f"--rows={','.join(rows)}"])
        with pytest.raises(SystemExit) as exc:
            check.main([])
        assert exc.value.code == 0
    finally:
        flags.FLAGS.unparse_flags()
    stdout = capsys.readouterr().out
    assert "== backend pallas ==" in stdout and "== backend reference ==" in stdout
    assert "decode (2 steps) vs prefill" in stdout
    report = json.loads(out.read_text())
    assert report["passed"] is True
    rows = report["backends"]["pallas"]["invariance"]
    assert len(rows) == 7 and all(r["equal"] for r in rows)
    assert {"varlen", "left padding", "jax layout"} <= set(flags.FLAGS["rows"].default)
    assert [r["kind"] for r in rows if r["case"].startswith("JAX layout")] == [
        "forward", "backward"]
    cp_rows = [r for r in rows if r["case"].startswith("CP")]
    assert len(cp_rows) == 2 and not any(r["checked"] for r in cp_rows)
    assert "n/a" in stdout


def test_check_runs_as_a_program():
    """``python -m jaxattn.check`` parses its flags and exits non-zero on a bad one."""
    proc = subprocess.run([sys.executable, "-m", "jaxattn.check", "--backends=nonesuch"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "nonesuch" in (proc.stdout + proc.stderr)


def test_check_exits_nonzero_when_a_promised_invariant_breaks(capsys):
    """A backend whose bits change with every trace fails its promised rows; a row whose check
    raises (this stand-in takes no causal offsets, which left padding needs) is reported
    failed with the exception, and the job goes on."""
    counter = itertools.count()

    def noisy(q, k, v, **kw):  # changes its bits on every call
        out, lse = reference.forward_with_lse(q, k, v, **kw)
        return out + jnp.asarray(next(counter) * 1e-3, out.dtype), lse

    registry.register(registry.FunctionBackend("noisy", noisy, follows_schedule=True))
    try:
        flags.FLAGS(["check", "--backends=noisy", "--num_q_heads=2", "--num_kv_heads=1",
                     "--head_dim=16", "--seq_len=24", "--decode_steps=2",
                     "--chunk_sizes=8", "--rows=left padding,batch"])
        with pytest.raises(SystemExit) as exc:
            check.main([])
        assert exc.value.code == 1
    finally:
        registry.unregister("noisy")
        flags.FLAGS.unparse_flags()
    table = capsys.readouterr().out
    assert "raised ValueError: backend 'noisy' takes no causal offsets" in table
    assert any(line.startswith("row alone vs in batch") and " NO " in line
               for line in table.splitlines()), table


def test_benchmark_smoke(tmp_path):
    """The speed binary runs every mode on the CPU (jaxattn's Pallas kernels in interpret
    mode, XLA and torch's CPU SDPA), writes JSON and markdown, and the plotter draws it."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.attention_bench", "--smoke",
                           "--modes=fwd,fwdbwd,chunked,decode", f"--out_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {r["mode"] for r in rows} == {"fwd", "fwdbwd", "chunked", "decode"}
    assert all("error" not in r and r["ms"] > 0 for r in rows), rows
    assert {"jaxattn:pallas", "xla"} <= {r["system"] for r in rows}
    chunk = [r for r in rows if r["mode"] == "chunked"]
    assert all(r["Sq"] < r["Skv"] for r in chunk)
    jax_rows = [r for r in rows if not r["system"].startswith("torch")]
    assert all(r["extra_MB"] is not None and r["extra_MB"] >= 0 for r in jax_rows)
    assert "| fwd | jaxattn:pallas |" in (tmp_path / "results.md").read_text()

    pytest.importorskip("matplotlib")
    plots = tmp_path / "plots"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.plot",
                           f"--results={tmp_path / 'results.json'}", f"--out_dir={plots}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pngs = sorted(p.name for p in plots.iterdir())
    assert pngs == ["decode_gbps_d64.png", "tflops_d64_causal.png"]
    assert all((plots / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


@pytest.mark.slow  # CI time (31 s): the binary's real run is gpu_suite.sh's peers stage
def test_peer_invariance_smoke(tmp_path):
    """The peers' invariance matrix runs on the CPU; jaxattn's column is all equal; no
    system's cell is an error or beyond tolerance (which would mean a broken experiment)."""
    # The smoke mode is the CPU's (tiny shapes some GPU peers refuse); on a GPU host the
    # published matrix comes from the full binary (gpu_suite.sh, stage peers).
    env = cpu_env(CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.peer_invariance", "--smoke",
                           f"--out_dir={tmp_path}"], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    ours = report["systems"]["jaxattn:pallas"]
    assert len(ours) == 8 and all(c["result"] == "equal" for c in ours.values()), ours
    for name, cells in report["systems"].items():
        assert isinstance(cells, dict), (name, cells)
        bad = {k: c for k, c in cells.items() if c["result"] not in ("equal", "differs")}
        assert not bad, (name, bad)
    assert "| run to run (backward) | equal |" in (tmp_path / "results.md").read_text()


def test_bridge_benchmark_smoke(tmp_path):
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bridge_bench", "--smoke",
                           f"--out_dir={tmp_path}"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == 6 and all(r["bridge_ms"] > 0 and r["jax_ms"] > 0 and r["sdpa_ms"] > 0
                                  for r in rows)
    assert {r["shape"] for r in rows} == {"tiny", "decode", "prefill"}
    assert json.loads((tmp_path / "results.json").read_text())["growing"]["bridge_ms"] > 0


def test_cp_benchmark_smoke_on_8_virtual_devices(tmp_path):
    """The multi-device CP binary (the multi-GPU issue's) runs on 8 virtual CPU devices:
    degree 2, bits equal to one device forward and backward."""
    env = cpu_env(XLA_FLAGS=with_xla_flags("--xla_force_host_platform_device_count=8"))
    # Degree 2 (degrees 4 and 8's bits: tests/test_cp.py's mesh test).
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cp_bench", "--smoke",
                           "--degrees=2", f"--out_dir={tmp_path}"], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    rows = report["rows"]
    assert [r["n"] for r in rows] == [2]
    assert all(r["fwd_bits_equal"] and r["bwd_bits_equal"] for r in rows), rows
    assert all(r["fwd_gather_MB"] < r["bwd_gather_MB"] for r in rows)
    assert set(report["meta"]["allgather_GBps"]) == {"2"}


def test_gpu_only_binaries_parse_their_flags():
    """The GPU-only diagnostic binaries import and parse flags on the CPU (no rot). One
    child process for all (CI time: one each took 16 s): each binary's own flags are
    removed after it parses, since several binaries define flags of one name."""
    mods = ("benchmarks.mosaic_gpu_check", "benchmarks.tune", "benchmarks.cp_profile",
            "benchmarks.kernel_probe", "benchmarks.dq_epilogue_ab", "benchmarks.stack_ab")
    code = textwrap.dedent(f"""
        import importlib
        from absl import flags
        for mod in {mods!r}:
            m = importlib.import_module(mod)
            flags.FLAGS(["x"])
            assert callable(m.main), mod
            own = flags.FLAGS.get_key_flags_for_module(m)
            assert own, mod
            for flag in own:
                delattr(flags.FLAGS, flag.name)
            print("ok", mod)
        """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [w for mod in mods for w in ("ok", mod)], proc.stdout


def test_mosaic_asm_writes_the_kernels_modules(tmp_path):
    """benchmarks.mosaic_asm lowers the Mosaic forward for CUDA on this machine and
    writes each shape's modules without source locations, and launches.txt; this
    process lowering one of its shapes gets the same bytes (what a diff of two trees
    relies on), and a config field (ctas_per_sm=1: a producer warpgroup, against the
    default's two CTAs an SM) changes the decode kernels' launches and nothing else
    (not the fold's or a prefill's). (CI time: the decode shapes and one prefill of
    D=128 and of D=256; the rest lower in tests/test_mosaic_probe.py.)"""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    from benchmarks import lowered
    from jaxattn.backends.mosaic import forward as mf
    runs = {}
    some = ("--shapes=decode-split-8x8192,decode-split-8x8193,decode-mask-8x8192,"
            "decode-32x8192,decode-paged16,prefill-2x4096,prefill-d256-2x1024")
    for name, extra in (("a", []), ("one", ["--config=ctas_per_sm=1"])):
        out = tmp_path / name
        proc = subprocess.run([sys.executable, "-m", "benchmarks.mosaic_asm",
                               f"--out_dir={out}", some, *extra], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = {p.name: p.read_text() for p in out.iterdir()}
    here = lowered.modules(lambda: lowered.shapes()["decode-split-8x8193"](
        mf.MosaicConfig()))
    assert "\n".join(here) == runs["a"]["decode-split-8x8193.mlir"]
    assert "loc(" not in runs["a"]["decode-split-8x8193.mlir"]
    lines = dict(zip(*[iter(runs[n]["launches.txt"].splitlines()) for n in ("a", "one")],
                     strict=True))
    changed = {a.split(":")[0] for a, b in lines.items() if a != b}
    assert changed == {"decode-split-8x8192 kernel 0", "decode-split-8x8193 kernel 0",
                       "decode-mask-8x8192 kernel 0", "decode-paged16 kernel 0",
                       "decode-32x8192 kernel 0"}, changed
    assert "decode-split-8x8192 kernel 0: 128 threads" in runs["a"]["launches.txt"]
    assert "decode-split-8x8192 kernel 0: 256 threads" in runs["one"]["launches.txt"]


def _sass_toolchain_missing() -> str | None:
    """Why benchmarks.mosaic_sass cannot run here without a download, or None."""
    import os
    import shutil

    import jaxlib
    cache = os.path.expanduser(f"~/.cache/jaxattn-sass/pjrt-{jaxlib.__version__}/.done")
    if not os.path.exists(cache):
        return "the CUDA plugin wheel is not cached (python -m benchmarks.mosaic_sass fetches it)"
    if not os.path.exists("/usr/local/cuda/bin/ptxas") or shutil.which("gcc") is None:
        return "no CUDA toolkit's ptxas in /usr/local/cuda, or no gcc"
    return None


@pytest.mark.skipif(_sass_toolchain_missing() is not None,
                    reason=str(_sass_toolchain_missing()))
def test_mosaic_sass_shows_ptxas_order(tmp_path):
    """benchmarks.mosaic_sass compiles the prefill kernel to SASS on this machine: 168
    registers a thread, and its unmasked key-block loop as the H200 ran it (332
    instructions, 12 wgmmas, 34 exponentials, no wgmma serialised). ptxas issues the
    ping-pong's "softmax done" arrival before the block's first exponential (three
    arrivals before it: the hand-off after Q K^T, K's slot, and that one): the order
    docs/notes.md "2026-12-05" read (the pin that held the arrival back until the
    softmax's row sums were stored measured 3 to 15% slower on the H200, retired)."""
    out = tmp_path / "default"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.mosaic_sass",
                           f"--out_dir={out}", "--shapes=prefill-2x4096"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (out / "summary.txt").read_text().splitlines()
    assert all("Performance Loss" not in line for line in lines), lines
    head = next(i for i, line in enumerate(lines) if line.startswith("prefill-2x4096"))
    loop = next(i for i in range(head, len(lines)) if lines[i].startswith("  loop"))
    order = lines[loop + 1].split("order:")[1].split()
    assert sum(int(t.partition("*")[2] or 1) for t in order if t.startswith("mufu")) == 34
    assert "Used 168 registers" in lines[head], lines[head]
    assert "332 instructions" in lines[loop] and "HGMMA 12" in lines[loop], lines[loop]
    first = next(i for i, t in enumerate(order) if t.startswith("mufu"))
    assert order[:first].count("arrive") == 3, order


def test_ncu_source_reads_the_h200s_source_view():
    """benchmarks.ncu_source on the H200's source view of the prefill forward (B=2
    S=4096 D=128 causal, docs/benchmarks/h200-2026-12-05-19fbbc9/call2): the hottest
    loop is the unmasked key-block loop mosaic_sass reads on this machine (331 of its
    instructions executed alike, 12 wgmmas), and its hottest instruction the wait for
    Q K^T's wgmma; the whole kernel's samples are mostly the producer's barrier waits."""
    from benchmarks import ncu_source

    path = (pathlib.Path(__file__).parents[1]
            / "docs/benchmarks/h200-2026-12-05-19fbbc9/call2/ncu-fwd-sass.csv.gz")
    rows = ncu_source.read(str(path))
    first, last = ncu_source.hottest_loop(rows, 100)
    loop = rows[first:last + 1]
    assert (first, last) == (605, 935), (first, last)
    assert sum(r["Source"].split()[0].startswith("HGMMA") for r in loop) == 12
    text = ncu_source.report(str(path), 3, 100)
    hottest = text.split("hottest instructions:")[1].splitlines()[1]
    assert "WARPGROUP.DEPBAR" in hottest and hottest.split()[0] == "639", hottest
    kernel = text.split("the whole kernel:")[1].splitlines()
    assert kernel[2].split()[0] == "long_sb", kernel[:3]


def test_sweep_tables_render_ratios_errors_and_decode():
    """benchmarks.sweep_tables: a table per (mode, D, causal), rows by sequence length,
    the default in bold with its ratio to the peer, a failed row as "error", decode in
    GB/s."""
    from benchmarks import sweep_tables

    def row(system, mode, s, b, value, **kw):
        metric = "GB/s" if mode == "decode" else "TFLOP/s"
        return dict(system=system, mode=mode, B=b, Sq=1 if mode == "decode" else s,
                    Skv=s, D=128, causal=True, **{metric: value}, **kw)

    rows = [row("jaxattn:mosaic", "fwd", 4096, 8, 450.0),
            row("torch_cudnn", "fwd", 4096, 8, 500.0),
            row("jaxattn:mosaic", "fwd", 1024, 32, 300.0),
            row("torch_cudnn", "fwd", 1024, 32, None, error="OOM"),
            row("jaxattn:mosaic", "decode", 8192, 8, 2900.0),
            row("torch_cudnn", "decode", 8192, 8, 2000.0)]
    md = sweep_tables.tables(rows, "jaxattn:mosaic", "torch_cudnn")
    fwd, decode = md.split("### ")[1:]
    assert fwd.startswith("Forward TFLOP/s, D=128, causal")
    lines = fwd.strip().splitlines()
    assert lines[1] == "| S | jaxattn mosaic | torch_cudnn | mosaic / torch_cudnn |"
    assert lines[3] == "| 1024 (B=32) | **300** | error | - |"  # sorted by length
    assert lines[4] == "| 4096 (B=8) | **450** | 500 | 0.90 |"
    assert decode.startswith("Decode GB/s")
    assert "| 8192 (B=8) | **2900** | 2000 | 1.45 |" in decode


def test_ablations_apply_to_this_tree_and_the_table_divides_by_the_defaults(tmp_path):
    """benchmarks.ablate: every ablation's edits find their text exactly once in the
    kernel as it is (a stale one would fail on the device after its compile), the copy
    differs from the package only where edited, an unknown name raises; the table gives
    each process over the mean of the two unedited ones, as TFLOP/s and as its ratio
    to torch cuDNN in the same process."""
    from benchmarks import ablate

    for name, (_, edits) in ablate.ABLATIONS.items():
        dest = ablate.prepare(name, tmp_path / name)
        for rel, old, new in edits:
            text = (dest / rel).read_text()
            assert new in text and old not in text.replace(new, ""), (name, rel)
            orig = (ablate.ROOT / rel).read_text()
            assert text == orig.replace(old, new)
    with pytest.raises(ValueError, match="not one of"):
        ablate.prepare("no_such_ablation", tmp_path / "x")

    def row(ablation, proc, system, tflops):
        return dict(ablation=ablation, proc=proc, system=system, tflops=tflops, D=64,
                    causal=True, B=8, S=4096)

    rows = [row("default", 0, "mosaic:default", 300.0), row("default", 0, "torch_cudnn", 400.0),
            row("exp_free", 1, "mosaic:default", 330.0), row("exp_free", 1, "torch_cudnn", 401.0),
            row("default", 2, "mosaic:default", 310.0), row("default", 2, "torch_cudnn", 399.0)]
    lines = ablate.table(rows).splitlines()
    # (over torch cuDNN: 330 / 401 over the mean of 300 / 400 and 310 / 399)
    assert lines[3] == "| 64c | 8, 4096 | exp_free (1) | 330.0 | 401.0 | 1.082 | 1.078 |"
    assert lines[2] == "| 64c | 8, 4096 | default (0) | 300.0 | 400.0 | 0.984 | 0.982 |"


@pytest.mark.parametrize("module, args, message", [
    ("kernel_timeline", ["--seq_len=4096", "--query_len=4097"],
     "--query_len must be in [1, --seq_len=4096], got 4097"),
    ("kernel_timeline", ["--hold_s=-0.5"], "--hold_s must be >= 0, got -0.5"),
    ("kernel_timeline", ["--profile_space=-1"], "--profile_space must be >= 0, got -1"),
    ("mosaic_profile", ["--steady=-1"], "--steady must be >= 0, got -1"),
    ("mosaic_profile", ["--time_calls=-2"], "--time_calls must be >= 0, got -2"),
])
def test_gpu_binaries_refuse_bad_flags_before_the_gpu(module, args, message):
    """``benchmarks.kernel_timeline``'s ``--query_len`` (prefills' timelines),
    ``--hold_s`` and ``--profile_space``, and ``benchmarks.mosaic_profile``'s ``--steady`` and
    ``--time_calls``, are checked before the binary looks for a GPU: out of range, the
    message names the flag and the value."""
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args],
                          capture_output=True, text=True, timeout=300,
                          env=cpu_env(CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]


def test_dq_order_model_counts_the_lag_as_idle():
    """benchmarks.dq_order_model: with no lag the greedy deal is within 2% of perfect
    balance; a lag only delays starts (never below balance, never faster); a hand count
    of two heads of two pairs on two CTAs; non-causal pairs are equal items."""
    from benchmarks import dq_order_model as m

    end0, bal = m.makespan(64, 16, 4, 132, 0)
    assert bal == 16 * 4 * sum(64 - 2 * p for p in range(32)) / 132
    assert bal <= end0 <= 1.02 * bal
    end9, _ = m.makespan(64, 16, 4, 132, 9)
    end17, _ = m.makespan(64, 16, 4, 132, 17)
    assert end0 < end9 < end17
    # 4 tiles, one query head: pair 0 has 4 steps, pair 1 has 2; two heads, two CTAs.
    # Pairs 0 start at 0 on both CTAs; each pair 1 goes where a pair 0 ends (t = 4),
    # a lag of 5 holds it to t = 5: the last end is 7 (without the lag, 6).
    assert m.makespan(4, 2, 1, 2, 5) == (7.0, 6.0)
    assert m.makespan(4, 2, 1, 2, 0) == (6.0, 6.0)
    end, bal = m.makespan(8, 3, 2, 4, 0, causal=False)
    assert (end, bal) == (48.0, 48.0)  # 12 equal items of 2 * 8 steps on 4 CTAs: 3 rounds
