"""The one merge: empty states pass through bit for bit; merging splits gives the
attention over their union."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from conftest import np_attention, rand, rand_qkv

from jaxattn import reference
from jaxattn.invariance import bits_equal
from jaxattn.merge import finalize, merge


def test_empty_side_returns_other_bits():
    o = rand((3, 5, 8))
    lse = rand((3, 5))
    zero = jnp.zeros_like(o)
    ninf = jnp.full_like(lse, -jnp.inf)
    for out, l in (merge(o, lse, zero, ninf), merge(zero, ninf, o, lse)):
        assert bits_equal(out, o) and bits_equal(l, lse)
    out, l = merge(zero, ninf, zero, ninf)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(l)))


def test_merge_of_two_key_ranges_is_attention_over_their_union():
    q, k, v = rand_qkv(1, 2, 2, 3, 10, 16)
    a = reference.forward_fp32_with_lse(q, k[:, :, :4], v[:, :, :4], causal=False)
    b = reference.forward_fp32_with_lse(q, k[:, :, 4:], v[:, :, 4:], causal=False)
    out, lse = merge(*a, *b)
    ref_out, ref_lse = np_attention(q, k, v, causal=False)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-6)


def test_merge_guards_large_lse_and_has_no_nan_gradient():
    o1, o2 = rand((4, 8)), rand((4, 8))
    l1 = jnp.array([1e4, -jnp.inf, 0.0, -jnp.inf])
    l2 = jnp.array([-1e4, 3.0, -jnp.inf, -jnp.inf])
    out, lse = merge(o1, l1, o2, l2)
    assert bits_equal(out[0], o1[0]) or np.allclose(out[0], o1[0])
    assert bits_equal(out[1], o2[1]) and bits_equal(out[2], o1[2])
    assert not np.isnan(np.asarray(out)).any()
    g = jax.grad(lambda a, b: merge(a, l1, b, l2)[0].sum(), (0, 1))(o1, o2)
    assert not any(np.isnan(np.asarray(x)).any() for x in g)


def test_finalize_empty_rows():
    acc = rand((3, 4))
    out, lse = finalize(acc, jnp.array([-jnp.inf, 1.0, 2.0]), jnp.array([0.0, 2.0, 1.0]))
    assert np.all(np.asarray(out[0]) == 0) and np.isneginf(float(lse[0]))
    np.testing.assert_allclose(out[1], np.asarray(acc[1]) / 2, rtol=1e-7)
    np.testing.assert_allclose(lse[1], 1.0 + np.log(2.0), rtol=1e-7)
