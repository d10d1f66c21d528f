"""``jaxattn.dot_product_attention`` (jaxattn/nn.py): jax.nn's signature and semantics on
JAX's ``[B, T, N, H]`` layout, the bits of ``jaxattn.attention`` on the transposed
inputs, and its refusals. On the CPU the "pallas" kernels (interpret mode) and the
reference; on an sm90 GPU the default ("mosaic", which reads the layout in place) in the
tests marked gpu."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import np_attention, rand_qkv, rel_err

import jaxattn
from jaxattn.invariance import bits_equal, normal


def t(x):
    """[B, H, S, D] <-> [B, S, H, D]."""
    return jnp.swapaxes(x, 1, 2)


def _with_nan_past(x, lengths):
    """``x [B, S, H, D]`` with NaN at and past ``lengths[b]`` on the sequence axis."""
    pos = jnp.arange(x.shape[1])[None, :, None, None]
    return jnp.where(pos < jnp.asarray(lengths)[:, None, None, None], x, jnp.nan)


def _grads(fn, w, *args):
    return jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * w),
                    tuple(range(len(args))))(*args)


@pytest.mark.parametrize("causal", [True, False])
def test_equals_attention_on_the_transposed_inputs_in_bits(causal):
    """Forward and gradients equal ``jaxattn.attention`` on ``[B, H, S, D]`` in raw
    bits (Sq = Skv = 70: a partial block after a whole one; GQA; keys past
    ``key_value_seq_lengths`` hold NaN), on the Pallas kernels."""
    seed = int(np.random.default_rng().integers(2**16))
    q, k, v = rand_qkv(2, 4, 2, 70, 70, 32, jnp.bfloat16, seed=seed)
    lens = jnp.array([70, 45], jnp.int32)
    kt, vt = (_with_nan_past(t(x), lens) for x in (k, v))
    keep = jnp.arange(70)[None, :] < lens[:, None]
    w = normal(seed, t(q).shape)

    def ours(q, k, v):
        return jaxattn.dot_product_attention(q, k, v, is_causal=causal,
                                             key_value_seq_lengths=lens,
                                             implementation="pallas")

    def theirs(q, k, v):
        return t(jaxattn.attention(t(q), t(k), t(v), causal=causal, key_padding_mask=keep,
                                   backend="pallas"))

    out = ours(t(q), kt, vt)
    assert out.shape == t(q).shape and out.dtype == q.dtype
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert bits_equal(out, theirs(t(q), kt, vt)), f"seed {seed}"
    for name, g, h in zip("qkv", _grads(ours, w, t(q), kt, vt),
                          _grads(theirs, w, t(q), kt, vt), strict=True):
        assert not np.isnan(np.asarray(g, np.float32)).any(), name
        assert bits_equal(g, h), f"d{name} (seed {seed})"
    ref, _ = np_attention(q, k, v, causal=causal, mask=keep)
    assert rel_err(out, t(jnp.asarray(ref))) < 2e-2


def test_is_causal_is_top_left():
    """jax.nn's causal rule (query i sees key j iff j <= i) for Sq < Skv: the bits of
    ``jaxattn.attention`` on the first Sq keys (its bottom-right rule there is the same
    mask), not those of ``jaxattn.attention`` on all keys (a different mask); Sq > Skv
    against jax.nn within tolerance. Pallas kernels."""
    seed = int(np.random.default_rng().integers(2**16))
    q, k, v = rand_qkv(1, 2, 1, 40, 100, 32, jnp.float32, seed=seed)
    out = jaxattn.dot_product_attention(t(q), t(k), t(v), is_causal=True,
                                        implementation="pallas")
    first = jaxattn.attention(q, k[:, :, :40], v[:, :, :40], causal=True, backend="pallas")
    assert bits_equal(out, t(first)), f"seed {seed}"
    bottom_right = jaxattn.attention(q, k, v, causal=True, backend="pallas")
    assert rel_err(out, t(bottom_right)) > 1e-2
    ref, _ = np_attention(q, k, v, causal=True, q_pos=[np.arange(40)])
    assert rel_err(out, t(jnp.asarray(ref))) < 1e-5
    # More queries than keys: rows past the last key see every key.
    out2 = jaxattn.dot_product_attention(t(k), t(q[:, :1]), t(q[:, :1]), is_causal=True,
                                         implementation="reference")
    jnn = jax.nn.dot_product_attention(t(k), t(q[:, :1]), t(q[:, :1]), is_causal=True)
    assert rel_err(out2, jnn) < 1e-5


def test_query_seq_lengths_zero_the_padding_rows_and_their_gradients():
    """Rows at and past ``query_seq_lengths`` give 0 with zero gradients, whatever they
    hold (NaN here), and leave the other rows' bits alone; the rest agrees with
    jax.nn's XLA implementation (rows that see a key)."""
    seed = int(np.random.default_rng().integers(2**16))
    q, k, v = (t(x) for x in rand_qkv(2, 2, 2, 70, 70, 32, jnp.float32, seed=seed))
    q_lens = jnp.array([70, 30], jnp.int32)
    kv_lens = jnp.array([70, 30], jnp.int32)
    qn = _with_nan_past(q, q_lens)
    kn, vn = (_with_nan_past(x, kv_lens) for x in (k, v))
    kw = dict(is_causal=True, query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens)

    def ours(q, k, v):
        return jaxattn.dot_product_attention(q, k, v, implementation="pallas", **kw)

    out = ours(qn, kn, vn)
    assert not np.isnan(np.asarray(out)).any()
    assert np.all(np.asarray(out[1, 30:]) == 0)
    unpadded = jaxattn.dot_product_attention(q, kn, vn, implementation="pallas",
                                             is_causal=True, key_value_seq_lengths=kv_lens)
    assert bits_equal(out[:, :30], unpadded[:, :30]) and bits_equal(out[0], unpadded[0])
    jnn = jax.nn.dot_product_attention(q, k, v, **kw)
    assert rel_err(out, jnn) < 1e-5
    w = normal(seed, q.shape)
    dq, dk, dv = _grads(ours, w, qn, kn, vn)
    for name, g in zip("qkv", (dq, dk, dv), strict=True):
        assert not np.isnan(np.asarray(g)).any(), name
    assert np.all(np.asarray(dq[1, 30:]) == 0) and np.all(np.asarray(dk[1, 30:]) == 0)
    want = _grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kw), w, q, k, v)
    for name, g, r in zip("qkv", (dq, dk, dv), want, strict=True):
        assert rel_err(g, r) < 1e-4, f"d{name} (seed {seed})"


def test_unbatched_inputs_and_the_residual():
    """``[T, N, H]`` inputs give a ``[T, N, H]`` output; ``return_residual`` gives the
    lse ``[T, N]`` in the inputs' dtype, as jax.nn does; a sequence with no key gives 0."""
    q, k, v = (t(x)[0] for x in rand_qkv(1, 4, 2, 20, 33, 16, jnp.float32))
    out, lse = jaxattn.dot_product_attention(q, k, v, scale=0.3, return_residual=True)
    jout, jlse = jax.nn.dot_product_attention(q, k, v, scale=0.3, return_residual=True)
    assert out.shape == q.shape and lse.shape == jlse.shape == (20, 4)
    assert lse.dtype == jlse.dtype
    assert rel_err(out, jout) < 1e-5 and rel_err(lse, jlse) < 1e-5
    none = jaxattn.dot_product_attention(q[None], k[None], v[None],
                                         key_value_seq_lengths=jnp.array([0], jnp.int32))
    assert np.all(np.asarray(none) == 0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(bias=jnp.zeros((1, 2, 8, 8))), "^bias"),
    (dict(mask=jnp.ones((1, 2, 8, 8), bool)), "^mask"),
    (dict(local_window_size=4), "^local_window_size"),
    (dict(implementation="cudnn"), "implementation='cudnn'"),
    (dict(implementation="nope"), "unknown backend 'nope'"),
    (dict(query_seq_lengths=jnp.ones((3,), jnp.int32)), "^query_seq_lengths"),
    (dict(key_value_seq_lengths=jnp.ones((1,), jnp.float32)), "^key_value_seq_lengths"),
])
def test_refusals_name_the_argument(kwargs, match):
    q, k, v = (t(x) for x in rand_qkv(1, 2, 2, 8, 8, 16, jnp.float32))
    with pytest.raises(ValueError, match=match):
        jaxattn.dot_product_attention(q, k, v, **kwargs)


def test_shape_errors():
    q, k, v = (t(x) for x in rand_qkv(1, 3, 2, 8, 8, 16, jnp.float32))
    with pytest.raises(ValueError, match="multiple"):
        jaxattn.dot_product_attention(q, k, v)
    with pytest.raises(ValueError, match="all"):
        jaxattn.dot_product_attention(q[0], k, v)
    with pytest.raises(ValueError, match="same shape"):
        jaxattn.dot_product_attention(q, k, v[:, :4])


# ------------------------------------------------------------------------- on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("b,sq,skv,hq,hkv,d,causal,lens", [
    (2, 300, 300, 8, 2, 128, True, None),
    (2, 300, 300, 8, 2, 64, False, (300, 170)),
    (1, 200, 1000, 4, 4, 128, True, None),   # top-left: Sq != Skv
    (3, 1, 513, 8, 2, 128, False, (513, 7, 64)),  # decode, ragged lengths
])
def test_default_backend_equals_attention_in_bits_on_gpu(b, sq, skv, hq, hkv, d, causal,
                                                         lens):
    """On the GPU's default backend ("mosaic" on sm90: the layout read in place),
    forward and gradients equal ``jaxattn.attention`` on the transposed inputs in raw
    bits (for Sq != Skv: on the first Sq keys, jax.nn's top-left rule), and jax.nn's
    XLA implementation within bf16 tolerance."""
    seed = int(np.random.default_rng().integers(2**16))
    q, k, v = rand_qkv(b, hq, hkv, sq, skv, d, jnp.bfloat16, seed=seed)
    lens_a = None if lens is None else jnp.asarray(lens, jnp.int32)
    keep = None if lens is None else jnp.arange(skv)[None, :] < lens_a[:, None]
    kt, vt = ((t(x) if lens is None else _with_nan_past(t(x), lens_a)) for x in (k, v))
    w = normal(seed, t(q).shape)
    top_left = causal and sq != skv

    def ours(q, k, v):
        return jaxattn.dot_product_attention(q, k, v, is_causal=causal,
                                             key_value_seq_lengths=lens_a)

    def theirs(q, k, v):
        if top_left:
            k, v = k[:, :sq], v[:, :sq]
        return t(jaxattn.attention(t(q), t(k), t(v), causal=causal, key_padding_mask=keep))

    f, g = jax.jit(ours), jax.jit(theirs)
    out = f(t(q), kt, vt)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert bits_equal(out, g(t(q), kt, vt)), f"seed {seed}"
    for name, x, y in zip("qkv", jax.jit(lambda *a: _grads(ours, w, *a))(t(q), kt, vt),
                          jax.jit(lambda *a: _grads(theirs, w, *a))(t(q), kt, vt),
                          strict=True):
        assert not np.isnan(np.asarray(x, np.float32)).any(), name
        assert bits_equal(x, y), f"d{name} (seed {seed})"
    ref = jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=causal,
                                       key_value_seq_lengths=lens_a, implementation="xla")
    assert rel_err(out, ref) < 2e-2
