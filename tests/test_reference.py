"""The fp32 reference against an independent float64 NumPy computation, and its
contract: GQA, causal offsets, scale, padding, empty rows, dtypes, gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import np_attention, rand, rand_qkv, rel_err

from jaxattn import reference
from jaxattn.invariance import bits_equal


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sq,skv", [(9, 9), (3, 11), (1, 7), (12, 5)])
def test_forward_fp32_matches_float64(causal, sq, skv):
    q, k, v = rand_qkv(2, 4, 2, sq, skv, 16)
    out, lse = reference.forward_fp32_with_lse(q, k, v, causal=causal)
    ref_out, ref_lse = np_attention(q, k, v, causal=causal)
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
    assert out.shape == (2, 4, sq, 16) and lse.shape == (2, 4, sq)
    np.testing.assert_allclose(out, ref_out, rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse)[fin], ref_lse[fin], rtol=1e-6, atol=2e-6)
    assert not np.isnan(np.asarray(out)).any()


def test_forward_fp32_is_true_fp32_under_hostile_precision():
    q, k, v = rand_qkv(1, 2, 2, 16, 16, 32)
    ref_out, _ = np_attention(q, k, v)
    for ambient in ("bfloat16", "tensorfloat32", "float32"):
        with jax.default_matmul_precision(ambient):
            out = jax.jit(reference.forward_fp32)(q, k, v)
            jaxpr = jax.make_jaxpr(reference.forward_fp32)(q, k, v)
        assert rel_err(out, ref_out) < 1e-5, ambient
        dots = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
        assert len(dots) == 2
        for e in dots:
            assert e.params["precision"] == (jax.lax.Precision.HIGHEST,) * 2, ambient


def _all_eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for sub in _subjaxprs(e.params):
            yield from _all_eqns(sub)


def _subjaxprs(params):
    for p in params.values():
        for x in (p if isinstance(p, (tuple, list)) else (p,)):
            if hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):
                yield x.jaxpr
            elif hasattr(x, "eqns"):
                yield x


def test_closed_form_causal_prefill_and_decode():
    # With zero scale every visible key weighs the same: row i of a causal prefill is the
    # mean of v[0..i]; a decode query (Sq=1) sees the whole cache.
    q, k, v = rand_qkv(1, 1, 1, 6, 6, 8)
    out, lse = reference.forward_fp32_with_lse(q, k, v, causal=True, scale=0.0)
    expect = np.cumsum(np.asarray(v[0, 0]), 0) / np.arange(1, 7)[:, None]
    np.testing.assert_allclose(out[0, 0], expect, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse[0, 0], np.log(np.arange(1, 7)), rtol=1e-6)
    dec = reference.forward_fp32(q[:, :, -1:], k, v, causal=True, scale=0.0)
    np.testing.assert_allclose(dec[0, 0, 0], np.asarray(v[0, 0]).mean(0), rtol=1e-6, atol=1e-6)
    # Chunk of queries 2..3 against keys 0..3: offset Skv - Sq = 2.
    chunk = reference.forward_fp32(q[:, :, 2:4], k[:, :, :4], v[:, :, :4], causal=True,
                                   scale=0.0)
    np.testing.assert_allclose(chunk[0, 0], expect[2:4], rtol=1e-6, atol=1e-6)


def test_gqa_mapping_head_h_reads_kv_head_h_div_g():
    q, k, v = rand_qkv(1, 6, 3, 5, 5, 8)
    out = reference.forward_fp32(q, k, v)
    for h in range(6):
        one = reference.forward_fp32(q[:, h:h + 1], k[:, h // 2:h // 2 + 1],
                                     v[:, h // 2:h // 2 + 1])
        np.testing.assert_allclose(out[:, h], one[:, 0], rtol=1e-6, atol=1e-6)
    # repeat (not interleave) would pair head 1 with KV head 1: make sure that differs.
    wrong = reference.forward_fp32(q[:, 1:2], k[:, 1:2], v[:, 1:2])
    assert rel_err(out[:, 1], wrong[:, 0]) > 1e-2


def test_scale_default_custom_and_zero():
    q, k, v = rand_qkv(1, 2, 1, 4, 6, 16)
    default = reference.forward_fp32(q, k, v)
    explicit = reference.forward_fp32(q, k, v, scale=0.25)
    assert bits_equal(default, explicit)  # 1/sqrt(16)
    custom = reference.forward_fp32(q, k, v, scale=0.7)
    np.testing.assert_allclose(custom, np_attention(q, k, v, scale=0.7)[0], rtol=2e-5, atol=2e-6)
    zero = reference.forward_fp32(q, k, v, scale=0.0, causal=False)
    np.testing.assert_allclose(zero[0, 0], np.broadcast_to(np.asarray(v[0, 0]).mean(0), (4, 16)),
                               rtol=1e-6, atol=1e-6)


def test_padding_mask_and_fully_masked_rows():
    q, k, v = rand_qkv(2, 2, 1, 5, 5, 8)
    mask = jnp.array([[True, False, True, True, False], [False, False, True, True, True]])
    out, lse = reference.forward_fp32_with_lse(q, k, v, key_padding_mask=mask)
    ref_out, ref_lse = np_attention(q, k, v, mask=np.asarray(mask))
    np.testing.assert_allclose(out, ref_out, rtol=2e-5, atol=2e-6)
    # Batch 1 rows 0 and 1 see no key (causal, keys 0 and 1 padded): 0 and -inf.
    assert np.all(np.asarray(out[1, :, :2]) == 0.0)
    assert np.all(np.isneginf(np.asarray(lse[1, :, :2])))
    assert not np.isnan(np.asarray(out)).any()


def test_empty_kv_and_more_queries_than_keys():
    q, k, v = rand_qkv(1, 2, 2, 4, 0, 8)
    out, lse = reference.forward_fp32_with_lse(q, k, v)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))
    q, k, v = rand_qkv(1, 2, 2, 6, 3, 8)  # offset -3: rows 0..2 see nothing
    out, lse = reference.forward_fp32_with_lse(q, k, v)
    assert np.all(np.asarray(out[:, :, :3]) == 0) and np.all(np.isneginf(np.asarray(lse[:, :, :3])))
    np.testing.assert_allclose(out, np_attention(q, k, v)[0], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype,bar", [(jnp.bfloat16, 3e-2), (jnp.float16, 5e-3)])
def test_dtype_path_within_bar(dtype, bar, record_property):
    q, k, v = rand_qkv(2, 4, 2, 64, 64, 64, dtype)
    out = reference.forward(q, k, v)
    assert out.dtype == dtype
    ref = reference.forward_fp32(q, k, v)
    err = rel_err(out, ref)
    record_property("max_rel_err", err)
    print(f"reference {jnp.dtype(dtype).name} drift: {err:.2e} (bar {bar})")
    assert 0 < err < bar


def test_row_alone_vs_in_batch_bits():
    q, k, v = rand_qkv(4, 4, 2, 24, 24, 16, jnp.bfloat16)
    out, lse = jax.jit(reference.forward_with_lse)(q, k, v)
    for i in range(4):
        o1, l1 = jax.jit(reference.forward_with_lse)(q[i:i + 1], k[i:i + 1], v[i:i + 1])
        assert bits_equal(o1[0], out[i]) and bits_equal(l1[0], lse[i])


def test_inputs_not_mutated():
    q, k, v = rand_qkv(1, 2, 1, 4, 4, 8)
    copies = [np.array(x) for x in (q, k, v)]
    jax.grad(lambda q, k, v: reference.forward_fp32(q, k, v).sum(), (0, 1, 2))(q, k, v)
    for x, c in zip((q, k, v), copies, strict=True):
        assert bits_equal(x, c)


def test_gradients_match_float64_finite_differences():
    jax.config.update("jax_enable_x64", True)
    try:
        q, k, v = (x.astype(jnp.float64) for x in rand_qkv(1, 2, 1, 4, 5, 8))
        mask = jnp.array([[True, True, False, True, True]])
        w = rand((1, 2, 4, 8)).astype(jnp.float64)
        loss = lambda q, k, v: jnp.sum(reference._attend(
            q, k, v, scale=0.3, precision=jax.lax.Precision.HIGHEST, p_dtype=jnp.float64,
            visible=reference.visibility(4, 5, causal=True, key_padding_mask=mask, batch=1))[0]
            * w)
        grads = jax.grad(loss, (0, 1, 2))(q, k, v)
        eps = 1e-6
        for arg, g in zip(range(3), grads, strict=True):
            x = [q, k, v][arg]
            flat = np.asarray(x).ravel()
            for idx in range(0, flat.size, 7):
                e = np.zeros_like(flat)
                e[idx] = eps
                xp = jnp.asarray((flat + e).reshape(x.shape))
                xm = jnp.asarray((flat - e).reshape(x.shape))
                args_p = [q, k, v]
                args_m = [q, k, v]
                args_p[arg], args_m[arg] = xp, xm
                fd = (loss(*args_p) - loss(*args_m)) / (2 * eps)
                assert abs(float(fd) - float(np.asarray(g).ravel()[idx])) < 1e-6
        # The padded key gets exactly zero gradient.
        assert np.all(np.asarray(grads[1])[0, :, 2] == 0)
    finally:
        jax.config.update("jax_enable_x64", False)


def test_fp32_gradients_match_float64_reference_and_no_nan_on_empty_rows():
    q, k, v = rand_qkv(1, 2, 1, 6, 3, 8)  # rows 0..2 see no key
    w = rand((1, 2, 6, 8))
    g = jax.grad(lambda q, k, v: jnp.sum(reference.forward_fp32(q, k, v) * w), (0, 1, 2))(q, k, v)
    jax.config.update("jax_enable_x64", True)
    try:
        f64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
        w64 = jnp.asarray(np.asarray(w, np.float64))
        g64 = jax.grad(lambda q, k, v: jnp.sum(reference._attend(
            q, k, v, scale=1 / np.sqrt(8), precision=jax.lax.Precision.HIGHEST,
            p_dtype=jnp.float64, visible=reference.visibility(6, 3, causal=True,
                                                              key_padding_mask=None, batch=1)
        )[0] * w64), (0, 1, 2))(*f64)
    finally:
        jax.config.update("jax_enable_x64", False)
    for a, b in zip(g, g64, strict=True):
        assert not np.isnan(np.asarray(a)).any()
        assert rel_err(a, b) < 1e-5
    assert np.all(np.asarray(g[0])[:, :, :3] == 0)


def test_jittable_and_lse_differentiable():
    q, k, v = rand_qkv(1, 2, 2, 4, 4, 8)
    f = jax.jit(lambda q, k, v: reference.forward_with_lse(q, k, v)[1].sum())
    g = jax.grad(f)(q, k, v)
    assert g.shape == q.shape and not np.isnan(np.asarray(g)).any()
