"""benchmarks/systems.py: the peers' refusals (reported as Unsupported, never as a wrong
result). The peers themselves run in the GPU benchmarks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from benchmarks import systems


def test_pallas_mgpu_refuses_what_it_cannot_run():
    s = systems.make("pallas_mgpu")
    assert s.name == "pallas_mgpu" and "pallas_mgpu" in systems.JAX_PEERS
    q = jnp.ones((1, 4, 64, 64), jnp.bfloat16)
    k = jnp.ones((1, 2, 128, 64), jnp.bfloat16)
    args = s.prepare(q, k, k)
    with pytest.raises(systems.Unsupported, match="key padding"):
        s.forward(*args, causal=False, kv_lens=jnp.array([100]))
    with pytest.raises(systems.Unsupported, match="Sq == Skv"):
        s.forward(*args, causal=True)
    with pytest.raises(systems.Unsupported, match="multiple of"):
        s.forward(*s.prepare(q, k[:, :, :100], k[:, :, :100]), causal=False)
    with pytest.raises(systems.Unsupported, match="non-causal"):
        s.fwdbwd(*args, s.prepare_like_q(q), causal=True)


def test_unknown_system_names_the_known_ones():
    with pytest.raises(ValueError, match="pallas_mgpu"):
        systems.make("flash4")


def test_pallas_mgpu_key_block_variant():
    """``pallas_mgpu:64``: JAX's attention_mgpu with key blocks of 64 (jaxattn's
    BLOCK_N), named apart from the default 128."""
    s = systems.make("pallas_mgpu:64")
    assert s.name == "pallas_mgpu:64" and "block_kv=64" in s.notes
    q = jnp.ones((1, 4, 64, 64), jnp.bfloat16)
    k = jnp.ones((1, 2, 96, 64), jnp.bfloat16)
    with pytest.raises(systems.Unsupported, match="multiple of 64"):
        s.forward(*s.prepare(q, k, k), causal=False)


def test_jaxattn_backend_off_its_platform_is_unsupported():
    """A jaxattn backend that cannot run here (the Mosaic GPU one off an sm90 GPU) is
    reported as Unsupported, so a benchmark lists it and goes on."""
    import jax
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU the mosaic backend may be available")
    with pytest.raises(systems.Unsupported, match="mosaic"):
        systems.make("jaxattn:mosaic")
    # A launch variant (``jaxattn:mosaic:<MosaicConfig fields>``) likewise.
    # Its fields are read first: a misspelt one is an error, never a default run.
    with pytest.raises(systems.Unsupported, match="sm90"):
        systems.make("jaxattn:mosaic:splits_per_cta=None")
    with pytest.raises(TypeError, match="splits_per_cat"):
        systems.make("jaxattn:mosaic:splits_per_cat=None")


def test_clock_windows_reads_an_nvidia_smi_log_per_window(tmp_path):
    """``report.clock_windows`` (the ``timeline`` stage's clock log read per
    configuration): the samples whose UTC stamps fall in each window, the SM clock's
    median and minimum, the power's median and the throttle reasons' masks other than
    none; the header and nvidia-smi's error lines skipped. ``print_clock_windows``
    takes each configuration's hold and timed windows from ``timeline.json``."""
    import datetime
    import json

    from benchmarks import report
    t0 = datetime.datetime(2026, 12, 7, 19, 5, 25, tzinfo=datetime.UTC).timestamp()
    log = "\n".join([
        "timestamp, clocks.current.sm [MHz], power.draw [W], temperature.gpu, "
        "clocks_event_reasons.active",
        "2026/12/07 19:05:25.000, 1980 MHz, 300.00 W, 50, 0x0000000000000000",
        "2026/12/07 19:05:25.500, 1830 MHz, 690.50 W, 60, 0x0000000000000004",
        "2026/12/07 19:05:26.000, 1900 MHz, 700.00 W, 61, 0x0000000000000000",
        "Unable to determine the device handle for GPU 0: Unknown Error",
        "2026/12/07 19:05:27.000, 1755 MHz, 710.00 W, 62, [N/A]",
    ])
    got = report.clock_windows(log, {"a": (t0 + 0.4, t0 + 1.0), "b": (t0 + 1.5, t0 + 3),
                                     "none": (t0 - 10, t0 - 5)})
    assert got["a"] == {"samples": 2, "sm_mhz_median": 1865.0, "sm_mhz_min": 1830.0,
                        "power_w_median": 695.25, "reasons": ["0x0000000000000004"]}
    assert got["b"] == {"samples": 1, "sm_mhz_median": 1755.0, "sm_mhz_min": 1755.0,
                        "power_w_median": 710.0, "reasons": []}
    assert got["none"] == {"samples": 0, "sm_mhz_median": None, "sm_mhz_min": None,
                           "power_w_median": None, "reasons": []}
    (tmp_path / "clk.csv").write_text(log)
    wall = {"hold_start": t0 - 0.1, "timed_start": t0 + 0.75, "timed_end": t0 + 1.2}
    (tmp_path / "timeline.json").write_text(json.dumps({"results": {
        "c3": {"wall": wall, "hold_calls": 20}, "c2": {"wall": wall, "hold_calls": 0}}}))
    got = report.print_clock_windows(str(tmp_path / "timeline.json"),
                                     str(tmp_path / "clk.csv"))
    assert [got["c3 hold"]["samples"], got["c3 timed"]["samples"]] == [2, 1]
    assert got["c3 timed"]["sm_mhz_median"] == 1900.0
    assert "c2 hold" not in got and got["c2 timed"]["samples"] == 1  # (no calls held)


def test_timeline_summary_counts_gaps_and_overlaps():
    """``report.timeline_summary`` (``benchmarks/kernel_timeline.py``'s): per kernel of
    a step, keyed by its place (kernels of one name told apart), the launches, the
    median duration, the median gap before it in us (negative where a kernel started
    before the one before it ended: programmatic dependent launch; none before the
    first), the median end after the one before's, and the step's period."""
    from benchmarks import report
    rows = [("k", 0, 100_000), ("k", 101_500, 110_000),
            ("k", 109_000, 209_000), ("k", 206_000, 220_000),
            ("k", 221_000, 321_000), ("k", 320_000, 331_000)]
    got = report.timeline_summary(rows, steps=3)
    assert got["0:k"] == {"launches": 3, "median_us": 100.0,
                          "median_gap_before_us": 0.0,  # median of -1.0 and 1.0
                          "median_end_after_us": 100.0}
    assert got["1:k"] == {"launches": 3, "median_us": 11.0,  # 8.5, 14, 11
                          "median_gap_before_us": -1.0,  # 1.5, -3, -1
                          "median_end_after_us": 10.0}  # 10, 11, 10
    assert got["step_us"] == 110.5  # 109 and 112
    with pytest.raises(ValueError, match="not 4 steps"):
        report.timeline_summary(rows, steps=4)


def test_mosaic_profile_summary_splits_an_item():
    """``report.profile_summary`` (``benchmarks.mosaic_profile``'s) on a made-up trace
    (ts in cycles / 1e3, as JAX's dump writes it): two CTAs, each a compute warpgroup
    of two items and a producer; a range re-entered inside itself (a scope inside a
    branch) counted once; the item's named ranges, ``other``, the gap to the next
    item, the first item apart, the fold per key block and the item's overhead in
    blocks."""
    from benchmarks import report as mp
    from jaxattn.backends.mosaic import forward as mf

    def ev(tid, name, t0, t1, pid=1):
        return [{"name": name, "ph": "B", "ts": t0 / 1e3, "pid": pid, "tid": tid},
                {"name": name, "ph": "E", "ts": t1 / 1e3, "pid": pid, "tid": tid}]

    events = []
    for tid, base in ((1, 0.0), (3, 5000.0)):  # compute warpgroups of two CTAs
        for start, fold in ((base, 800.0), (base + 1100.0, 900.0)):
            events += [{"name": "item", "ph": "B", "ts": start / 1e3, "tid": tid,
                        "pid": 1}]
            events += ev(tid, "wait_q", start + 10, start + 20)
            events += ev(tid, "wait_k", start + 20, start + 50)
            events += [{"name": "fold", "ph": "B", "ts": (start + 50) / 1e3,
                        "tid": tid, "pid": 1}]
            events += ev(tid, "fold", start + 60, start + 70)  # nested: dropped
            events += [{"name": "fold", "ph": "E", "ts": (start + 50 + fold) / 1e3,
                        "tid": tid, "pid": 1}]
            events += ev(tid, "epilogue", start + 50 + fold, start + 100 + fold)
            events += [{"name": "item", "ph": "E", "ts": (start + 120 + fold) / 1e3,
                        "tid": tid, "pid": 1}]
        events += ev(tid + 1, "produce", base, base + 1900.0)
    got = mp.profile_summary({"traceEvents": events}, key_blocks=8)
    later, first = got["later_items"], got["first_items"]
    assert later["item"] == 1020.0 and later["fold"] == 900.0
    assert later["wait_q"] == 10.0 and later["wait_k"] == 30.0
    assert later["epilogue"] == 50.0 and later["skip"] == 0.0
    assert later["other"] == 30.0 and later["gap"] is None  # (the last item's)
    assert first["item"] == 920.0 and first["gap"] == 180.0
    assert got["compute_traces"] == 2 and got["items_per_trace"] == [2, 2]
    assert got["span_median"] == 2120.0 and got["produce_median"] == 1900.0
    assert got["fold_per_block"] == 112.5
    assert abs(got["item_overhead_blocks"] - (1020.0 / 112.5 - 8)) < 1e-9
    assert "blocks" not in got
    # a key block's ranges: three blocks of one item, s every 300 cycles
    item = [{"name": "item", "ph": "B", "ts": 0.0, "tid": 9, "pid": 1}]
    for j in range(3):
        t0 = 100.0 + 300 * j
        for name, a, b in (("s", 0, 60), ("softmax", 60, 200), ("wait_pv", 200, 210),
                           ("pv", 210, 290)):
            item += ev(9, name, t0 + a, t0 + b)
    item += [{"name": "item", "ph": "E", "ts": 1.0, "tid": 9, "pid": 1}]
    got = mp.profile_summary({"traceEvents": item}, key_blocks=None,
                             block_ranges=mf.BLOCK_SCOPES)  # (the kernel's names)
    assert got["blocks"] == {"s": 60.0, "softmax": 140.0, "wait_pv": 10.0, "pv": 80.0}
    assert got["block_period"] == 300.0
    with pytest.raises(ValueError, match="unbalanced"):
        mp.profile_ranges([{"name": "a", "ph": "B", "ts": 0, "tid": 1},
                      {"name": "b", "ph": "E", "ts": 1, "tid": 1}])


def test_mosaic_profile_lowers_into_the_prefill():
    """``forward.profiling`` puts Mosaic GPU's profiler into the prefill kernel lowered
    for CUDA (its clock reads, its SMEM: four 32-bit entries a range per warpgroup)
    and nothing outside the context; it refuses an empty setting."""
    from benchmarks import lowered
    from jaxattn.backends.mosaic import forward as mf
    S = jax.ShapeDtypeStruct
    q, k = S((1, 32, 1024, 64), jnp.bfloat16), S((1, 8, 1024, 64), jnp.bfloat16)

    def lower():
        try:
            mf.lower_for_cuda(q, k, k, causal=False)
        except ValueError:  # the trace's write-out needs a GPU backend, after lowering
            pass

    plain = lowered.modules(lower)
    if plain is None:
        pytest.skip("this JAX does not expose the lowered Mosaic GPU modules")
    with mf.profiling(64, "/tmp/unused"):
        (prof,) = lowered.modules(lower)
    (plain,) = plain
    assert "%clock" not in plain and "%clock" in prof
    threads, smem = lowered.launch_of(plain)
    assert lowered.launch_of(prof) == (threads, smem + 64 * 4 * 4 * threads // 128)
    assert mf._PROFILE == {}
    with mf.profiling(64, "/tmp/unused", blocks=True):
        (blocks,) = lowered.modules(lower)
    assert blocks.count("%clock") > prof.count("%clock")  # (the block's four ranges)
    assert mf._PROFILE_BLOCKS is False

    def lower_jitted():  # the public, jitted forward: traced before, within and after
        try:
            jax.jit(functools.partial(mf.forward, causal=False)).trace(q, k, k).lower(
                lowering_platforms=("cuda",))
        except ValueError:
            pass

    (before,) = lowered.modules(lower_jitted)
    with mf.profiling(64, "/tmp/unused"):
        (within,) = lowered.modules(lower_jitted)
    (after,) = lowered.modules(lower_jitted)
    assert "%clock" not in before and "%clock" in within and "%clock" not in after
    with pytest.raises(ValueError, match="space > 0"):
        with mf.profiling(0, "/tmp/unused"):
            pass


def test_profile_space_counts_the_most_loaded_cta():
    """``lowered.profile_space`` (``mosaic_profile``'s default ``--space``): the ranges
    of the CTA whose items hold the most, read from the launch lowered for CUDA. D=64
    non-causal B=1 S=1024: three warpgroups' 192-row tiles, 6 x 32 items on 132 CTAs,
    so two items of 16 blocks (8 + 5 x 16 ranges each with ``blocks``) and 32; causal
    B=8 S=4096 without blocks: 22 x 32 x 8 items dealt by the greedy table, 46 at most;
    S=65536 with blocks (one 1024-block item a CTA) does not fit beside the kernel's
    SMEM and says so."""
    from benchmarks import lowered
    from jaxattn.backends.mosaic import forward as mf
    space = functools.partial(lowered.profile_space, hq=32, hkv=8, d=64,
                              config=mf.MosaicConfig(), n_sm=132)
    try:
        assert space(1, 1024, causal=False, blocks=True) == 2 * (8 + 5 * 16) + 32
    except ValueError as e:
        if "does not expose" in str(e):
            pytest.skip(str(e))
        raise
    assert space(1, 1024, causal=False, blocks=False) == 2 * 8 + 32
    assert space(8, 4096, causal=True, blocks=False) == 46 * 8 + 32
    with pytest.raises(ValueError, match="no --blocks"):
        space(1, 65536, causal=False, blocks=True)


def test_named_config_parses_a_launch_variant():
    """``report.named_config`` (the binaries' ``name[:key=value...]`` variants): ints,
    True/False, None, ``a/b`` tuples and strings; a bare name has no field."""
    from benchmarks import report
    assert report.named_config("default") == ("default", {})
    assert report.named_config("two:ctas_per_sm=2:pdl=off:fence=False:persistent=None:"
                               "registers=240/24") == (
        "two", {"ctas_per_sm": 2, "pdl": "off", "fence": False, "persistent": None,
                "registers": (240, 24)})


def test_sass_reader_finds_the_loop_and_its_order():
    """``benchmarks.sass`` on a made-up ``nvdisasm -c`` excerpt: the guarded back branch
    is the loop (the unguarded jump back from an out-of-line retry is not), its mix,
    and the order of its events with runs collapsed."""
    from benchmarks import sass
    text = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        ".L_x_5:",
        "        /*0010*/                   WARPGROUP.ARRIVE ;",
        "        /*0020*/                   HGMMA.64x64x16.F32.BF16 R88, gdesc[UR8], RZ, !UPT ;",
        "        /*0030*/                   HGMMA.64x64x16.F32.BF16 R88, gdesc[UR9], R88, gsb0 ;",
        ".L_x_6:",
        "        /*0040*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR5], R3 ;",
        "        /*0050*/              @!P0 BRA `(.L_x_9) ;",
        "        /*0060*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
        "        /*0070*/                   SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR6], RZ ;",
        "        /*0080*/                   MUFU.EX2 R4, R4 ;",
        "        /*0090*/                   MUFU.EX2 R5, R5 ;",
        "        /*00a0*/                   STS [R2], R5 ;",
        "        /*00b0*/                   F2FP.BF16.F32.PACK_AB R6, R5, R4 ;",
        "        /*00c0*/               @P1 BRA `(.L_x_5) ;",
        "        /*00d0*/                   EXIT ;",
        ".L_x_9:",
        "        /*00e0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR5], R3 ;",
        "        /*00f0*/                   BRA `(.L_x_6) ;",
    ])
    instrs, labels = sass.parse(text)
    assert len(instrs) == 16 and labels == {".L_x_5": 0x10, ".L_x_6": 0x40, ".L_x_9": 0xe0}
    assert instrs[5].pred == "@!P0" and instrs[5].base == "BRA"
    assert sass.loops(instrs, labels) == [(0x10, 0xc0)]
    loop = sass.body(instrs, (0x10, 0xc0))
    assert sass.mix(loop, top=3) == "WARPGROUP 2, HGMMA 2, SYNCS 2"
    assert sass.timeline(loop) == "fence mma*2 trywait wait0 arrive mufu*2 sts cvt"
