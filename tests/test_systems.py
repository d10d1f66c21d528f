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
