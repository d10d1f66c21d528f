"""Tests specific to the Pallas kernels: launch parameters never change the bits, the
split-parallel and prefill paths agree, the in-kernel merge agrees with an XLA fold, and
memory stays O(B*H*S*D)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    ON_GPU,
    assert_configs_keep_bits,
    assert_paths_agree,
    rand,
    rand_qkv,
    rel_err,
    warps_stages_config,
)

from jaxattn import reference, schedule
from jaxattn.backends.pallas import backward as pv
from jaxattn.backends.pallas import forward as pt
from jaxattn.invariance import bits_equal
from jaxattn.merge import fold
from jaxattn.registry import get_op as jaxattn_get_op

INTERPRET = not ON_GPU

#: Cases run in CI (tests/conftest.py: the others with -m slow on the CPU, all of them
#: on the GPU battery; about 30 s of CI): the split path against prefill at each length
#: once (causal at two, non-causal at one), tile heights 16 and 128 (the smallest and
#: the default's; 32 and 64 between them on the GPU).
CPU_CASES = {
    "test_split_parallel_and_prefill_paths_agree_in_bits": (
        "True-1-2118", "False-3-1025", "True-40-300"),
    "test_tile_height_does_not_change_bits": ("16", "128"),
}


def _forward(q, k, v, mask=None, causal=True, **kw):
    return pt.forward(q, k, v, mask, causal=causal, scale=1 / math.sqrt(q.shape[-1]),
                      interpret=INTERPRET, **kw)


@pytest.mark.parametrize("sq,skv", [(1, 2 * schedule.SPLIT + 70), (3, schedule.SPLIT + 1),
                                    (40, 300)])
@pytest.mark.parametrize("causal", [True, False])
def test_split_parallel_and_prefill_paths_agree_in_bits(sq, skv, causal):
    q, k, v = rand_qkv(2, 4, 2, sq, skv, 64, jnp.bfloat16)
    mask = jnp.asarray(np.random.default_rng(sq).uniform(size=(2, skv)) > 0.2)
    # Causal with a mask, non-causal without (each path's masked and unmasked kernels).
    assert_paths_agree(_forward, q, k, v, mask if causal else None, causal)


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_tile_height_does_not_change_bits(block_m):
    """A row's bits do not depend on which other rows share its tile."""
    q, k, v = rand_qkv(1, 8, 2, 100, 1200, 64, jnp.bfloat16, seed=11)
    assert_configs_keep_bits(_forward, q, k, v, [pt.ForwardConfig(block_m=block_m)])


@pytest.mark.parametrize("sq", [pytest.param(100, marks=pytest.mark.slow),
                                pytest.param(128, marks=pytest.mark.slow), 40])
def test_tile_launch_orders_do_not_change_bits(sq):
    """Every tile order maps each program to its own tile: tiles within one head (Sq a
    multiple of the tile), straddling heads, and shorter than a tile."""
    q, k, v = rand_qkv(2, 8, 2, sq, 300, 64, jnp.bfloat16, seed=sq)
    mask = jnp.asarray(np.random.default_rng(sq).uniform(size=(2, 300)) > 0.2)
    # Without a mask only once (the masked kernel is the superset; CI time).
    for m in (None, mask) if sq == 100 else (mask,):
        base = _forward(q, k, v, m, True, path="prefill")
        orders = [dict(tile_order=o) for o in ("descending", "heavy_first", "auto")]
        orders.append(dict(tile_order="auto", heavy_first_max_kv_bytes=0))  # descending
        # Two tile heights where tiles straddle heads (Sq=100), one elsewhere.
        for bm, order in itertools.product((16, 32) if sq == 100 else (16,), orders):
            got = _forward(q, k, v, m, True, path="prefill",
                           config=pt.ForwardConfig(block_m=bm, **order))
            assert bits_equal(got[0], base[0]) and bits_equal(got[1], base[1]), (bm, order)


@pytest.mark.gpu
@pytest.mark.parametrize("warps,stages", [(4, 2), (8, 3), (4, 3)])
def test_warps_and_stages_do_not_change_bits(warps, stages):
    q, k, v = rand_qkv(2, 32, 8, 600, 2100, 128, jnp.bfloat16, seed=12)
    assert_configs_keep_bits(_forward, q, k, v, [warps_stages_config(warps, stages)])


def test_whole_block_steps_compute_the_same_values():
    """The unmasked fast path (used on the GPU) in interpret mode: values, not bits."""
    for causal, sq, skv in [(True, 70, 200), (False, 64, 64), (True, 200, 130)]:
        q, k, v = rand_qkv(2, 4, 2, sq, skv, 64, jnp.bfloat16)
        ref, ref_lse = reference.forward_fp32_with_lse(q, k, v, causal=causal)
        cf = pt.ForwardConfig(block_m=32, whole_blocks=True)
        out, lse = _forward(q, k, v, causal=causal, config=cf)
        assert rel_err(out, ref) < 3e-2
        do = rand(q.shape, jnp.bfloat16)
        cb = pv.BackwardConfig(block_q=32, block_kv=32, whole_blocks=True)
        got = pv.backward(q, k, v, None, out, lse, do, None, causal=causal,
                          scale=1 / 8, interpret=INTERPRET, config=cb)
        want = jax.vjp(lambda a, b, c, causal=causal: reference.forward_fp32(a, b, c,
                                                                            causal=causal),
                       *(x.astype(jnp.float32) for x in (q, k, v)))[1](do.astype(jnp.float32))
        for g, w in zip(got, want, strict=True):
            assert rel_err(g, w) < 5e-2


@pytest.mark.gpu
def test_whole_block_steps_give_the_masked_bits_on_gpu():
    q, k, v = rand_qkv(2, 8, 2, 700, 700, 128, jnp.bfloat16, seed=13)
    do = rand(q.shape, jnp.bfloat16, seed=14)
    for causal in (True, False):
        fast = _forward(q, k, v, causal=causal, config=pt.ForwardConfig(whole_blocks=True))
        slow = _forward(q, k, v, causal=causal, config=pt.ForwardConfig(whole_blocks=False))
        assert bits_equal(fast[0], slow[0]) and bits_equal(fast[1], slow[1])
        for order in ("ascending", "descending", "heavy_first"):
            cfg = pt.ForwardConfig(whole_blocks=True, tile_order=order)
            other = _forward(q, k, v, causal=causal, path="prefill", config=cfg)
            assert bits_equal(other[0], slow[0]) and bits_equal(other[1], slow[1]), cfg
        grads = [pv.backward(q, k, v, None, *fast, do, None, causal=causal,
                             scale=1 / math.sqrt(128), interpret=False,
                             config=dataclasses.replace(pv.backward_config(128), whole_blocks=w))
                 for w in (True, False)]
        for a, b in zip(*grads, strict=True):
            assert bits_equal(a, b)


def test_in_kernel_merge_equals_xla_fold_of_the_split_states():
    """The combine kernel's fold and an XLA ``lax.scan`` of :func:`merge` over the same
    partial states give the same bits (on the GPU this compares Triton with XLA)."""
    q, k, v = rand_qkv(2, 4, 2, 3, 3 * schedule.SPLIT + 50, 64, jnp.bfloat16, seed=15)
    scale = 1 / 8
    o_parts, lse_parts = pt.split_partials(q, k, v, causal=True, scale=scale,
                                           interpret=INTERPRET)
    assert o_parts.shape[2] == 4

    o_xla, lse_xla = jax.jit(fold)(jnp.moveaxis(o_parts, 2, 0), jnp.moveaxis(lse_parts, 2, 0))
    out, lse = _forward(q, k, v, path="split")
    b, hq, sq, d = q.shape
    assert bits_equal(lse_xla.reshape(b, hq, sq), lse)
    assert bits_equal(o_xla.astype(q.dtype).reshape(q.shape), out)


@pytest.mark.gpu
def test_memory_is_linear_in_sequence_length():
    s = 8192
    q = jax.ShapeDtypeStruct((1, 8, s, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 2, s, 128), jnp.bfloat16)
    loss = lambda q, k, v: pv.attention(q, k, v, None, None, True, 0.1, False)[0].astype(
        jnp.float32).sum()
    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, k).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    q_bytes = 1 * 8 * s * 128 * 2
    scores_bytes = 1 * 8 * s * s * 4  # what a [Sq, Skv] fp32 score tensor would take
    assert temp < 4 * q_bytes, temp
    assert 4 * q_bytes < scores_bytes / 16


def test_backward_config_is_validated():
    with pytest.raises(ValueError, match="block_q must be a power of two"):
        pv.BackwardConfig(block_q=48)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        pt.ForwardConfig(block_m=8)
    with pytest.raises(ValueError, match="tile_order must be"):
        pt.ForwardConfig(tile_order="random")


#: The schedule candidates no default uses (benchmarks/tune.py --what=variants).
CANDIDATES = [("e", "reduce"), ("2", "reduce"), ("2", "reduce32"), ("2", "tree")]


@pytest.mark.parametrize("base,rowsum", [("2", "mma")] + [
    pytest.param(*c, marks=pytest.mark.slow) for c in CANDIDATES])
def test_schedule_variants_are_accurate_and_keep_decode_bits(base, rowsum):
    """The candidate schedule variants (benchmarks/tune.py --what=variants) stay within
    the accuracy bar and keep decode rows equal to prefill rows here; their invariance on
    the GPU is what the tuning run measures before one is adopted."""
    from jaxattn import invariance
    old = (schedule.SOFTMAX_EXP_BASE, schedule.ROWSUM)
    schedule.SOFTMAX_EXP_BASE, schedule.ROWSUM = base, rowsum
    jax.clear_caches()
    try:
        q, k, v = rand_qkv(1, 4, 2, 150, 150, 64, jnp.bfloat16)
        out, lse = _forward(q, k, v)
        ref, ref_lse = reference.forward_fp32_with_lse(q, k, v)
        assert rel_err(out, ref) < 3e-2
        assert float(jnp.max(jnp.abs(lse - ref_lse))) < 2e-2
        op = jaxattn_get_op("attention", backend="pallas")
        p = invariance.Problem(batch=1, num_q_heads=4, num_kv_heads=2, seq_len=130,
                               head_dim=64)
        assert all(r.equal for r in invariance.check_decode(op, p, [0, 64, 129]))
    finally:
        schedule.SOFTMAX_EXP_BASE, schedule.ROWSUM = old
        jax.clear_caches()


@pytest.mark.parametrize("base,rowsum", CANDIDATES)
def test_schedule_candidates_are_accurate_and_keep_a_decode_row(base, rowsum):
    """The default run's check of each candidate (the full one above is ``-m slow``): one
    causal prefill of two blocks within the accuracy bar, and its last row equal to a
    decode step in bits."""
    old = (schedule.SOFTMAX_EXP_BASE, schedule.ROWSUM)
    schedule.SOFTMAX_EXP_BASE, schedule.ROWSUM = base, rowsum
    jax.clear_caches()
    try:
        q, k, v = rand_qkv(1, 4, 2, 70, 70, 64, jnp.bfloat16)
        out, lse = _forward(q, k, v)
        assert rel_err(out, reference.forward_fp32(q, k, v)) < 3e-2
        o1, l1 = _forward(q[:, :, 69:], k, v)
        assert bits_equal(o1, out[:, :, 69:]) and bits_equal(l1, lse[:, :, 69:])
    finally:
        schedule.SOFTMAX_EXP_BASE, schedule.ROWSUM = old
        jax.clear_caches()


def test_pairwise_rowsum_is_the_fixed_tree_in_bits():
    """common.pairwise_rowsum adds column pairs (2c, 2c+1) level by level: its bits
    equal that tree computed in NumPy fp32, for any number of rows."""
    from jaxattn.backends.common import pairwise_rowsum

    x = np.asarray(jax.random.uniform(jax.random.PRNGKey(5), (37, 64)), np.float32)
    want = x.copy()
    while want.shape[1] > 1:
        want = want[:, 0::2] + want[:, 1::2]
    for rows in (37, 16, 1):
        got = np.asarray(jax.jit(pairwise_rowsum)(jnp.asarray(x[:rows])))
        assert np.array_equal(got.view(np.int32), want[:rows, 0].view(np.int32))
    assert np.allclose(want[:, 0], x.astype(np.float64).sum(axis=1), rtol=1e-6)


def test_rowsum_candidates_lower_to_triton_for_cuda_without_a_gpu():
    """The tuning candidates (reshape-based tree, vector reduction) lower for CUDA."""
    q = jax.ShapeDtypeStruct((2, 4, 40, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 2, 1100, 64), jnp.bfloat16)
    old = schedule.ROWSUM
    try:
        for rowsum in ("tree", "reduce32"):
            schedule.ROWSUM = rowsum
            jax.clear_caches()
            fn = functools.partial(pt.forward, causal=True, scale=0.125, interpret=False)
            text = jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
            assert "__gpu$xla.gpu.triton" in text, rowsum
    finally:
        schedule.ROWSUM = old
        jax.clear_caches()


@pytest.mark.parametrize("sq", [1, 40])
def test_every_kernel_lowers_to_triton_for_cuda_without_a_gpu(sq):
    """The compiled (not interpreted) Pallas path, lowered for CUDA on any machine:
    forward with mask and per-sequence offsets on both launch paths, the paged kernels
    (their page arithmetic once failed to lower inside nested loops: "AssertionError:
    ('i32', 'i1')" from jnp's remainder) for pages of 128 and 16 keys in both layouts,
    and the backward."""
    bf = jnp.bfloat16
    q = jax.ShapeDtypeStruct((2, 4, sq, 64), bf)
    kv = jax.ShapeDtypeStruct((2, 2, 1100, 64), bf)
    mask = jax.ShapeDtypeStruct((2, 1100), jnp.bool_)
    offs = jax.ShapeDtypeStruct((2,), jnp.int32)
    pages = jax.ShapeDtypeStruct((20, 2, 128, 64), bf)
    table = jax.ShapeDtypeStruct((2, 9), jnp.int32)
    kw = dict(causal=True, scale=0.125, interpret=False)

    def fwd_bwd(q, k, v, m, o):
        outs = [pt.forward(q, k, v, m, o, path=p, **kw) for p in ("prefill", "split")]
        for order in ("ascending", "descending", "heavy_first"):
            outs.append(pt.forward(q, k, v, None, o, path="prefill",
                                   config=pt.ForwardConfig(tile_order=order), **kw))
        grads = pv.backward(q, k, v, m, *outs[0], outs[0][0], outs[0][1], o, **kw)
        return outs, grads

    def paged_fwd(q, kp, vp, t, lens):
        return [pt.paged_forward(q, kp, vp, t, lens, path=p, config=cfg, **kw)
                for p in ("prefill", "split")
                for cfg in (pt.ForwardConfig(tile_order="heavy_first"), None)]

    # Pages of 16 keys (each block's rows gathered from four pages) in both layouts,
    # and pages of 128 in vLLM's NHD layout (a strided slice of one page).
    nhd128 = jax.ShapeDtypeStruct((20, 128, 2, 64), bf)
    hnd16 = jax.ShapeDtypeStruct((150, 2, 16, 64), bf)
    nhd16 = jax.ShapeDtypeStruct((150, 16, 2, 64), bf)
    table16 = jax.ShapeDtypeStruct((2, 70), jnp.int32)

    def paged_layouts(q, p128, h16, n16, t, t16, lens):
        outs = [pt.paged_forward(q, p128, p128, t, lens, layout="NHD", **kw)]
        for layout, pg in (("HND", h16), ("NHD", n16)):
            outs += [pt.paged_forward(q, pg, pg, t16, lens, path=p, layout=layout, **kw)
                     for p in ("prefill", "split")]
        return outs

    for fn, args in ((fwd_bwd, (q, kv, kv, mask, offs)),
                     (paged_fwd, (q, pages, pages, table, offs)),
                     (paged_layouts, (q, nhd128, hnd16, nhd16, table, table16, offs))):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") >= 2, text[:1000]
