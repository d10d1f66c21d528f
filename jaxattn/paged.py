"""Paged KV cache: attention that reads pages in place, and helpers to fill the cache.

Layout (vLLM-style): ``k_pages, v_pages: [num_pages, Hkv, page_size, D]``; a
``block_table [B, max_pages]`` int maps logical page p of sequence b to a physical
page; ``seq_lens [B]`` int counts each sequence's keys. The queries ``[B, Hq, Sq, D]``
are the last ``Sq`` tokens of each sequence (decode: Sq = 1; chunked prefill: a chunk),
so query i of sequence b sits at position ``seq_lens[b] - Sq + i`` and the causal rule
is the one of the tensor contract.

With the Pallas backend the kernels read the pages directly (no gather into a
contiguous copy), one ``BLOCK_N`` block at a time, so the result equals contiguous KV in
bits for any page table whenever ``page_size`` is a multiple of ``BLOCK_N`` (64). Other
page sizes would split a block across two pages; the Pallas backend refuses them with a
ValueError rather than change the reduction order. The triton and reference backends
gather the pages into contiguous K and V first (a copy, off the Pallas hot path) and
accept any page size; the triton backend's result then equals its contiguous call in
bits. The mosaic backend gathers too, and runs its forward with per-sequence causal
offsets (its rows' bits are those of its contiguous call); its fp32 calls are the
Pallas backend's (in place). Any other backend raises (no silent fallback to another
backend).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import reference, schedule
from jaxattn.kernels import mosaic_backend
from jaxattn.kernels import pallas_triton as pt
from jaxattn.registry import resolve
from jaxattn.validation import SUPPORTED_DTYPES, resolve_scale

#: The backends with a paged path: pallas reads pages in place, the others gather them.
BACKENDS = ("pallas", "triton", "mosaic", "reference")


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def validate(q, k_pages, v_pages, block_table, seq_lens, *, backend: str) -> None:
    """Check shapes, dtypes, page sizes and, when the values are concrete (not traced),
    page ids and lengths. Raises ValueError / TypeError naming what it got."""
    if q.ndim != 4:
        raise ValueError(f"q must have rank 4 ([B, Hq, Sq, D]), got shape {q.shape}")
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 ([num_pages, Hkv, page_size, D]), got "
                             f"shape {x.shape}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must have the same shape, got {k_pages.shape} "
                         f"and {v_pages.shape}")
    for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if np.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has unsupported dtype {np.dtype(x.dtype)}")
    if not q.dtype == k_pages.dtype == v_pages.dtype:
        raise TypeError(f"q, k_pages and v_pages must share one dtype, got {q.dtype}, "
                        f"{k_pages.dtype}, {v_pages.dtype}")
    b, hq, _, d = q.shape
    num_pages, hkv, page_size, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"head-dim mismatch: q has D={d}, k_pages has D={dk}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"Hq must be a multiple of Hkv: q has Hq={hq}, pages have Hkv={hkv}")
    if block_table.ndim != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table must have shape [B, max_pages] with B={b}, got "
                         f"{block_table.shape}")
    if seq_lens.shape != (b,):
        raise ValueError(f"seq_lens must have shape [B] = ({b},), got {seq_lens.shape}")
    for name, x in (("block_table", block_table), ("seq_lens", seq_lens)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {x.dtype}")
    if backend == "pallas" and page_size % schedule.BLOCK_N:
        raise ValueError(
            f"page_size {page_size} is not a multiple of BLOCK_N={schedule.BLOCK_N}: a key "
            f"block would straddle two pages and the Pallas kernels would have to change "
            f"the reduction order. Use a page size that is a multiple of {schedule.BLOCK_N} "
            f"(or the reference backend, which gathers pages).")
    capacity = block_table.shape[1] * page_size
    if _is_concrete(seq_lens):
        lens = np.asarray(seq_lens)
        if (lens < 0).any() or (lens > capacity).any():
            raise ValueError(f"seq_lens must lie in [0, max_pages * page_size] = [0, "
                             f"{capacity}], got {lens.tolist()}")
        if _is_concrete(block_table):
            table = np.asarray(block_table)
            used = np.arange(table.shape[1])[None, :] * page_size < lens[:, None]
            bad = used & ((table < 0) | (table >= num_pages))
            if bad.any():
                bi, pi = map(int, np.argwhere(bad)[0])
                raise ValueError(f"block_table[{bi}, {pi}] = {int(table[bi, pi])} is not a "
                                 f"page id in [0, {num_pages})")


def gather(pages, block_table):
    """Contiguous ``[B, Hkv, max_pages * page_size, D]`` keys or values from pages."""
    g = pages[block_table]  # [B, max_pages, Hkv, page_size, D]
    b, n, h, p, d = g.shape
    return jnp.moveaxis(g, 2, 1).reshape(b, h, n * p, d)


def attention(q, k_pages, v_pages, block_table, seq_lens, *, causal: bool = True,
              scale: float | None = None, return_lse: bool = False,
              backend: str | None = None):
    """Attention of the last ``Sq`` tokens of each sequence against its paged KV.

    Returns ``out [B, Hq, Sq, D]`` (and ``lse [B, Hq, Sq]`` fp32 with ``return_lse``).
    Forward only (rollout); train through :func:`jaxattn.attention`.
    """
    # The mosaic backend's fp32 calls are the Pallas backend's.
    be = mosaic_backend.backend_for(resolve("attention", backend).name, q.dtype)
    validate(q, k_pages, v_pages, block_table, seq_lens, backend=be)
    sc = resolve_scale(scale, q.shape[-1])
    block_table = jnp.asarray(block_table, jnp.int32)
    seq_lens = jnp.asarray(seq_lens, jnp.int32)
    if be == "pallas":
        reason = pt.check_supported(q.shape[-1])
        if reason:
            raise ValueError(f"backend 'pallas' cannot serve this call: {reason}")
        out, lse = pt.paged_forward(q, k_pages, v_pages, block_table, seq_lens,
                                    causal=bool(causal), scale=sc,
                                    interpret=jax.default_backend() == "cpu")
    elif be in BACKENDS:
        # Not read in place: the pages are gathered into contiguous K, V first (a copy).
        k, v = gather(k_pages, block_table), gather(v_pages, block_table)
        cap, sq = k.shape[2], q.shape[2]
        keep = jnp.arange(cap)[None, :] < seq_lens[:, None]
        if be == "triton":
            from jaxattn.kernels import triton_backend
            reason = triton_backend.check_supported(q.shape[-1])
            if reason:
                raise ValueError(f"backend 'triton' cannot serve this call: {reason}")
            out, lse = triton_backend.forward(q, k, v, keep, seq_lens - sq,
                                              causal=bool(causal), scale=sc)
        elif be == "mosaic":
            reason = mosaic_backend.check_supported(q.shape[-1], q.dtype)
            if reason:
                raise ValueError(f"backend 'mosaic' cannot serve this call: {reason}")
            out, lse = mosaic_backend.paged_forward(q, k, v, keep, seq_lens - sq,
                                                    causal=bool(causal), scale=sc)
        else:
            q_pos = seq_lens[:, None] - sq + jnp.arange(sq)[None, :]
            k_pos = jnp.broadcast_to(jnp.arange(cap), keep.shape)
            out, lse = reference.forward_with_lse(q, k, v, causal=causal, scale=sc,
                                                  key_padding_mask=keep,
                                                  query_positions=q_pos,
                                                  key_positions=k_pos)
    else:
        raise ValueError(f"backend {be!r} has no paged KV path (pallas reads pages in "
                         f"place; triton, mosaic and reference gather them)")
    return (out, lse) if return_lse else out


def write(k_pages, v_pages, block_table, seq_lens, k_new, v_new):
    """Append ``k_new, v_new [B, Hkv, T, D]`` after each sequence's ``seq_lens[b]`` keys.

    Returns ``(k_pages, v_pages, seq_lens + T)``; the pages the new tokens land on must
    already be in ``block_table``. Functional: the inputs are not modified.
    """
    b, hkv, t, d = k_new.shape
    page_size = k_pages.shape[2]
    pos = seq_lens[:, None] + jnp.arange(t)[None, :]  # [B, T]
    page = jnp.take_along_axis(block_table, pos // page_size, axis=1)  # [B, T]
    slot = pos % page_size
    pg = jnp.broadcast_to(page[:, None, :], (b, hkv, t))
    sl = jnp.broadcast_to(slot[:, None, :], (b, hkv, t))
    hd = jnp.broadcast_to(jnp.arange(hkv)[None, :, None], (b, hkv, t))
    k_pages = k_pages.at[pg, hd, sl].set(k_new)
    v_pages = v_pages.at[pg, hd, sl].set(v_new)
    return k_pages, v_pages, seq_lens + t
