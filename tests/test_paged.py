"""Paged KV cache: read in place by the kernels, equal in bits to contiguous KV for any
page table, any page size (a block of 64 keys from one page or from several) and both
layouts (HND, vLLM's NHD); clear errors otherwise."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ragged_cache, rand_qkv, rel_err

import jaxattn
from jaxattn import invariance, paged
from jaxattn.invariance import bits_equal

P = invariance.Problem(batch=3, num_q_heads=4, num_kv_heads=2, seq_len=150, head_dim=64)


@pytest.mark.parametrize("page_sizes", [
    [1, 128],  # token-granular; two blocks per page (16 and 64: test_backends' row)
    pytest.param([32, 48, 256], marks=pytest.mark.slow)])
def test_paged_decode_and_chunks_equal_contiguous_in_bits(page_sizes):
    """Decode steps (both sides of a block edge) and a chunk, both layouts, NaN in every
    unused page and slot, a shuffled page table: the contiguous rows' bits."""
    op = jaxattn.get_op("attention", backend="pallas")
    res = invariance.check_paged(op, P, page_sizes, steps=[0, 63, 64, 149])
    assert all(r.equal for r in res), res


def test_paged_over_more_than_one_split_and_ragged_lengths():
    """Sequences of different lengths in one batch, one longer than SPLIT."""
    s = jaxattn.SPLIT + 90
    q, k, v = rand_qkv(3, 4, 2, s, s, 64, jnp.bfloat16)
    lens = np.array([s, 700, 5])
    ps, max_pages = 128, -(-s // 128)
    num_pages = 3 * max_pages
    table = np.random.default_rng(1).permutation(num_pages).reshape(3, max_pages)
    kp = jnp.full((num_pages, 2, ps, 64), jnp.nan, jnp.bfloat16)
    vp = jnp.full((num_pages, 2, ps, 64), jnp.nan, jnp.bfloat16)
    for b in range(3):
        kb = paged.write(kp, vp, jnp.asarray(table[b:b + 1]), jnp.zeros((1,), jnp.int32),
                         k[b:b + 1, :, :lens[b]], v[b:b + 1, :, :lens[b]])
        kp, vp = kb[0], kb[1]
    sq = 3
    qs = jnp.stack([q[b, :, lens[b] - sq:lens[b]] for b in range(3)])
    for path in ("prefill", "split"):
        out, lse = jaxattn.backends.pallas.forward.paged_forward(
            qs, kp, vp, jnp.asarray(table, jnp.int32), jnp.asarray(lens, jnp.int32),
            causal=True, scale=0.125, interpret=jax.default_backend() == "cpu", path=path)
        for b in range(3):
            o, l = jaxattn.attention(qs[b:b + 1], k[b:b + 1, :, :lens[b]], v[b:b + 1, :, :lens[b]],
                                     scale=0.125, return_lse=True, backend="pallas")
            assert bits_equal(out[b:b + 1], o) and bits_equal(lse[b:b + 1], l), (path, b)
        assert not np.isnan(np.asarray(out, np.float32)).any()


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_reference_backend_reads_any_page_size(layout):
    p = dataclasses.replace(P, batch=2)
    q, k, v = invariance.random_qkv(p)
    table = jnp.asarray(np.arange(2 * 6)[::-1].reshape(2, 6).astype(np.int32))
    shape = (12, 30, 2, 64) if layout == "NHD" else (12, 2, 30, 64)
    kp = jnp.full(shape, jnp.nan, k.dtype)
    vp = jnp.full(shape, jnp.nan, v.dtype)
    kp, vp, lens = paged.write(kp, vp, table, jnp.zeros((2,), jnp.int32), k[:, :, :120],
                               v[:, :, :120], layout=layout)
    out = paged.attention(q[:, :, 110:120], kp, vp, table, lens, backend="reference",
                          layout=layout)
    ref = jaxattn.reference.forward_fp32(q[:, :, 110:120], k[:, :, :120], v[:, :, :120])
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert rel_err(out, ref) < 3e-2
    np.testing.assert_array_equal(paged.gather(kp, table, layout)[:, :, :120], k[:, :, :120])


def test_write_appends_without_touching_inputs():
    kp = jnp.zeros((4, 1, 64, 16), jnp.float32)
    table = jnp.array([[2, 0]], jnp.int32)
    new = jnp.arange(1 * 1 * 70 * 16, dtype=jnp.float32).reshape(1, 1, 70, 16) + 1
    k2, _, lens = paged.write(kp, kp, table, jnp.array([0]), new, new)
    assert int(lens[0]) == 70 and float(jnp.abs(kp).sum()) == 0
    np.testing.assert_array_equal(k2[2, 0], new[0, 0, :64])
    np.testing.assert_array_equal(k2[0, 0, :6], new[0, 0, 64:])
    np.testing.assert_array_equal(paged.gather(k2, table)[0, :, :70], new[0])


def test_errors():
    q, k, v = rand_qkv(2, 4, 2, 1, 8, 64)
    kp = jnp.zeros((5, 2, 64, 64))
    table = jnp.array([[0, 1], [2, 3]], jnp.int32)
    lens = jnp.array([70, 10], jnp.int32)
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = 9 is not a page id in \[0, 5\)"):
        paged.attention(q, kp, kp, table.at[0, 1].set(9), lens)
    with pytest.raises(ValueError, match=r"seq_lens must lie in \[0, max_pages \* page_size\] "
                                         r"= \[0, 128\]"):
        paged.attention(q, kp, kp, table, jnp.array([200, 1], jnp.int32))
    with pytest.raises(ValueError, match=r"block_table must have shape \[B, max_pages\]"):
        paged.attention(q, kp, kp, table[:1], lens)
    with pytest.raises(ValueError, match=r"seq_lens must have shape \[B\]"):
        paged.attention(q, kp, kp, table, lens[:1])
    with pytest.raises(TypeError, match="share one dtype"):
        paged.attention(q.astype(jnp.bfloat16), kp, kp, table, lens)
    with pytest.raises(ValueError, match="Hq must be a multiple of Hkv"):
        paged.attention(q, jnp.zeros((5, 3, 64, 64)), jnp.zeros((5, 3, 64, 64)), table, lens)
    with pytest.raises(ValueError, match="layout must be 'HND'"):
        paged.attention(q, kp, kp, table, lens, layout="bshd")
    # NHD reads [num_pages, page_size, Hkv, D]: the same array is 64 heads of 2 keys there.
    with pytest.raises(ValueError, match="Hq must be a multiple of Hkv: Hq=4 .* Hkv=64"):
        paged.attention(q, kp, kp, table, lens, layout="NHD")
    # A backend with no paged path raises instead of handing the call to another backend.
    from jaxattn import registry
    registry.register(registry.FunctionBackend("no_paged", jaxattn.reference.forward_with_lse))
    try:
        with pytest.raises(ValueError, match="'no_paged' has no paged path"):
            paged.attention(q, kp, kp, table, lens, backend="no_paged")
    finally:
        registry.unregister("no_paged")
    # An unused table entry may hold anything (here -1): only used pages are checked.
    out = paged.attention(q, kp + 1.0, kp + 1.0, table.at[1, 1].set(-1), lens)
    assert not np.isnan(np.asarray(out)).any()


def test_head_dims_the_kernels_are_not_compiled_for():
    """D=80 (padded to 128 inside): a paged decode row and chunk equal contiguous KV in
    bits (the pages are padded too: a copy)."""
    op = jaxattn.get_op("attention", backend="pallas")
    p = dataclasses.replace(P, batch=2, seq_len=100, head_dim=80)
    res = invariance.check_paged(op, p, [64], steps=[0, 99])
    assert all(r.equal for r in res), res


# ------------------------------------------------------------ the Mosaic kernel, in place

def test_mosaic_reads_pages_in_place_without_a_gather():
    """The Mosaic backend's paged call, lowered for CUDA on this machine: its kernel reads
    the pages (no XLA gather of the cache, no copy of it) for page sizes of a multiple of
    64 keys and of 8, 16, 32, both layouts, and a decode step is its kernels alone (no
    XLA op on the table or the lengths: the kernel clamps the entries it reads); other
    page sizes gather first."""
    from mosaic_support import missing_api

    from jaxattn.backends.mosaic import backend as mb
    if (why := missing_api(("load", "Layout"))) is not None:
        pytest.skip(why)
    be = mb.MosaicBackend()
    q = jax.ShapeDtypeStruct((4, 32, 1, 128), jnp.bfloat16)
    lens = jax.ShapeDtypeStruct((4,), jnp.int32)
    for ps, layout, in_place in [(16, "NHD", True), (128, "HND", True), (8, "HND", True),
                                 (48, "HND", False)]:
        shape = (300, ps, 8, 128) if layout == "NHD" else (300, 8, ps, 128)
        kp = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        table = jax.ShapeDtypeStruct((4, 4096 // ps + 1), jnp.int32)
        text = jax.jit(lambda q, kp, vp, t, n, layout=layout: be.paged_forward(
            q, kp, vp, t, n, causal=True, scale=0.1, layout=layout)).trace(
            q, kp, kp, table, lens).lower(lowering_platforms=("cuda",)).as_text()
        assert "custom_call @mosaic_gpu" in text, (ps, layout)
        assert ("gather" not in text) == in_place, (ps, layout)
        if in_place:  # a decode step is its kernels: the table and lengths as passed
            ops = {line.split(" = ")[1].split(" ")[0] for line in text.splitlines()
                   if " = stablehlo." in line}
            assert ops <= {"stablehlo.custom_call", "stablehlo.reshape"}, (ps, ops)


# Interpret mode runs about a second per kernel here: one page size in the default run
# (CI time), the others with -m slow; the H200 runs every one natively (below).
@pytest.mark.parametrize("ps,layout", [(16, "NHD"), pytest.param(8, "HND", marks=pytest.mark.slow),
                                       pytest.param(64, "HND", marks=pytest.mark.slow),
                                       pytest.param(128, "NHD", marks=pytest.mark.slow)])
def test_mosaic_paged_in_place_equals_contiguous(ps, layout):
    """Mosaic interpret mode (or the GPU): ragged lengths across a block edge, NaN in
    every unused slot and page, table entries past each sequence's pages out of range
    (-7 and 10**6: the kernel clamps what it reads), a table width that is not whole
    key blocks of small pages, decode and a chunk of 3 queries: each row's bits are
    those of its sequence's contiguous call, and nothing is NaN."""
    from mosaic_support import missing_interpret

    from jaxattn.backends.mosaic import forward as mf
    on_gpu = jax.default_backend() != "cpu"
    why = None if on_gpu else missing_interpret(("load", "Layout"))
    if why is not None:
        pytest.skip(why)
    if on_gpu:
        from jaxattn.backends.mosaic import backend as mb
        if mb.unavailable_reason() is not None:
            pytest.skip(mb.unavailable_reason())
    kw = dict(interpret=not on_gpu,
              config=None if on_gpu else mf.MosaicConfig(compute_wgs=1, block_m=64))
    lens = np.array([130, 37])
    q, k, v = rand_qkv(2, 2, 1, 3, 130, 64, jnp.bfloat16,
                       seed=int(np.random.default_rng().integers(2**16)))
    kp, vp, table = ragged_cache(layout, ps, lens, k, v)
    junk = np.asarray(table).copy()
    for b, n in enumerate(lens):
        unused = junk[b, -(-n // ps):]
        unused[:] = np.resize([-7, 10**6], unused.shape)
    table = jnp.asarray(junk)
    for sq in (1, 3):
        out, lse = mf.paged_forward(q[:, :, :sq], kp, vp, table, jnp.asarray(lens, jnp.int32),
                                    scale=0.125, layout=layout, **kw)
        assert not np.isnan(np.asarray(out, np.float32)).any()
        for b, n in enumerate(lens):
            o, l = mf.forward(q[b:b + 1, :, :sq], k[b:b + 1, :, :n], v[b:b + 1, :, :n],
                              causal=True, scale=0.125, **kw)
            assert bits_equal(out[b:b + 1], o) and bits_equal(lse[b:b + 1], l), (sq, b)


@pytest.mark.gpu
def test_mosaic_paged_in_place_every_page_size_on_gpu():
    """On the GPU, the registry's default (mosaic on sm90) at Qwen3-8B heads over more
    than one SPLIT (the split decode's path too): every page size it reads in place and
    one it gathers (48), both layouts, decode steps on both sides of block and split
    edges and a chunk, NaN in unused slots and pages: the contiguous prefill rows' bits
    (the matrix's paged row)."""
    op = jaxattn.get_op("attention")
    p = invariance.Problem(batch=2, num_q_heads=32, num_kv_heads=8, seq_len=1100,
                           head_dim=128)
    res = invariance.check_paged(op, p, [8, 16, 32, 48, 64, 128, 256],
                                 steps=[0, 63, 64, 1023, 1024, 1099])
    assert all(r.equal for r in res), res
    for ps, layout in [(16, "NHD"), (64, "HND"), (256, "NHD")]:
        test_mosaic_paged_in_place_equals_contiguous(ps, layout)  # ragged, both paths
