"""benchmarks/systems.py: the peers' refusals (reported as Unsupported, never as a wrong
result). The peers themselves run in the GPU benchmarks."""

from __future__ import annotations

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


def test_timeline_summary_counts_gaps_and_overlaps():
    """``report.timeline_summary`` (``benchmarks/kernel_timeline.py``'s): per kernel
    name, the launches, the median duration and the median gap before it in us,
    negative where a kernel started before the one before it ended (programmatic
    dependent launch); none before the first kernel."""
    from benchmarks import report
    rows = [("split", 0, 100_000), ("fold", 101_500, 110_000),
            ("split", 109_000, 209_000), ("fold", 212_000, 220_000),
            ("split", 221_000, 321_000)]
    got = report.timeline_summary(rows)
    assert got["split"] == {"launches": 3, "median_us": 100.0,
                            "median_gap_before_us": 0.0}  # median of -1.0 and 1.0
    assert got["fold"] == {"launches": 2, "median_us": 8.25,
                           "median_gap_before_us": 2.25}  # median of 1.5 and 3.0
