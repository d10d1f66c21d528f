"""Flax's ``attention_fn`` on jaxattn (jaxattn/flax.py): a small nnx and a small linen
model whose forward and ``jax.grad`` equal, in raw bits, the same model with
``jaxattn.attention`` (transposed to ``[B, H, S, D]`` around it), and agree with Flax's
own attention (jax.nn's XLA implementation) within tolerance; dropout refused. On the
CPU the "pallas" kernels (interpret mode)."""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rand, rel_err

import jaxattn
from jaxattn.invariance import bits_equal

# Flax is imported by the tests themselves, not at collection (2.5 s a worker).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("flax") is None,
                                reason="flax is a test extra")

BACKEND = "pallas"


def _via_attention(query, key, value, bias=None, mask=None, *, is_causal=False, **_):
    """The same attention through ``jaxattn.attention`` on ``[B, H, S, D]``."""
    assert bias is None and mask is None
    t = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
    return t(jaxattn.attention(t(query), t(key), t(value), causal=is_causal,
                               backend=BACKEND))


def _tree_bits_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(bits_equal(x, y) for x, y in zip(la, lb, strict=True))


def _grads_close(got, want, tol=1e-4):
    """Every gradient within ``tol`` of the largest gradient entry of ``want`` (the
    key projection's bias has an exactly-zero gradient in exact arithmetic: only
    rounding noise, no relative error to speak of)."""
    gl, wl = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(gl) == len(wl)
    top = max(float(np.max(np.abs(np.asarray(w)))) for w in wl)
    for g, w in zip(gl, wl, strict=True):
        assert not np.isnan(np.asarray(g)).any()
        assert float(np.max(np.abs(np.asarray(g) - np.asarray(w)))) <= tol * top


def test_nnx_multihead_attention():
    """nnx.MultiHeadAttention with ``attention_fn=jaxattn.flax.dot_product_attention``,
    called with ``is_causal=True``: output and parameter gradients."""
    from flax import nnx
    seed = int(np.random.default_rng().integers(2**16))
    x = rand((2, 70, 32), seed=seed)

    def model(attention_fn):
        kw = {} if attention_fn is None else dict(attention_fn=attention_fn)
        return nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=64,
                                      decode=False, rngs=nnx.Rngs(seed), **kw)

    def run(m):
        def loss(m):
            return jnp.sum(m(x, is_causal=True) ** 2)
        out = m(x, is_causal=True)
        grads = nnx.grad(loss)(m)
        return out, jax.tree.map(jnp.asarray, nnx.state(grads))

    ours = run(model(functools.partial(jaxattn.flax.dot_product_attention,
                                       implementation=BACKEND)))
    same = run(model(_via_attention))
    flax_own = run(model(None))
    assert not np.isnan(np.asarray(ours[0])).any()
    assert bits_equal(ours[0], same[0]), f"seed {seed}"
    assert _tree_bits_equal(ours[1], same[1]), f"seed {seed}"
    assert rel_err(ours[0], flax_own[0]) < 1e-5
    _grads_close(ours[1], flax_own[1])


def test_linen_multihead_attention():
    """linen.MultiHeadDotProductAttention with ``attention_fn=jaxattn.flax.attention_fn(
    is_causal=True)`` (linen passes no ``is_causal``) against linen's own attention with
    ``make_causal_mask``: output and parameter gradients."""
    from flax import linen
    seed = int(np.random.default_rng().integers(2**16))
    x = rand((2, 70, 32), seed=seed)

    def apply(attention_fn, causal_mask=False):
        kw = {} if attention_fn is None else dict(attention_fn=attention_fn)
        m = linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=64, **kw)
        params = m.init(jax.random.key(seed), x)
        mask = linen.make_causal_mask(x[..., 0]) if causal_mask else None

        def loss(p):
            return jnp.sum(m.apply(p, x, mask=mask) ** 2)
        return m.apply(params, x, mask=mask), jax.grad(loss)(params)

    ours = apply(jaxattn.flax.attention_fn(is_causal=True, implementation=BACKEND))
    same = apply(functools.partial(_via_attention, is_causal=True))
    flax_own = apply(None, causal_mask=True)
    assert bits_equal(ours[0], same[0]), f"seed {seed}"
    assert _tree_bits_equal(ours[1], same[1]), f"seed {seed}"
    assert rel_err(ours[0], flax_own[0]) < 1e-5
    _grads_close(ours[1], flax_own[1])


def test_refusals():
    """Dropout (unless deterministic), a dense mask and sowing the weights raise,
    naming the argument."""
    from flax import nnx
    m = nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=16, decode=False,
                               dropout_rate=0.1, rngs=nnx.Rngs(0),
                               attention_fn=jaxattn.flax.dot_product_attention)
    x = rand((1, 5, 8))
    with pytest.raises(ValueError, match="dropout_rate"):
        m(x, deterministic=False)
    assert m(x, deterministic=True).shape == x.shape  # no dropout: served
    with pytest.raises(ValueError, match="^mask"):
        m(x, mask=nnx.make_causal_mask(x[..., 0]), deterministic=True)
    with pytest.raises(ValueError, match="^module"):
        m(x, deterministic=True, sow_weights=True)
