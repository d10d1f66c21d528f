"""Paged KV cache: attention that reads pages in place, and helpers to fill the cache.

Layouts: ``k_pages, v_pages: [num_pages, Hkv, page_size, D]`` (``layout="HND"``, the
default) or ``[num_pages, page_size, Hkv, D]`` (``"NHD"``, vLLM's and FlashInfer's
default), any ``page_size`` (1 included); a ``block_table [B, max_pages]`` int maps
logical page p of sequence b to a physical page; ``seq_lens [B]`` int counts each
sequence's keys. The queries ``[B, Hq, Sq, D]``
are the last ``Sq`` tokens of each sequence (decode: Sq = 1; chunked prefill: a chunk),
so query i of sequence b sits at position ``seq_lens[b] - Sq + i`` and the causal rule
is the one of the tensor contract.

Each backend serves the path through its ``paged_forward``
(:mod:`jaxattn.backends.base`): the Pallas kernels read the pages in place (no gather
into a contiguous copy), one ``BLOCK_N`` block of 64 keys at a time, the same keys in
the same order as contiguous KV whatever the page size and layout (a block is one
page's slice where the page size is a multiple of 64, else each row is read from its
own page), so the result equals contiguous KV in bits for any page table. The mosaic kernels
(bf16/fp16) read causal calls' pages in place too, where the page size is 8, 16, 32 or a
multiple of 64 (a block is one TMA box of one page, or one box per page). The triton and
reference backends, and mosaic's other calls, gather the pages into contiguous K and V
first (a copy) and run their forward with per-sequence causal offsets; the triton and
mosaic results equal their contiguous calls in bits. A backend without a paged path
raises (no silent fallback to another backend).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import registry
from jaxattn.backends.base import PAGE_LAYOUTS as LAYOUTS  # noqa: F401 (public)
from jaxattn.backends.base import check_page_layout, gather_pages, page_dims
from jaxattn.validation import SUPPORTED_DTYPES, Dims, resolve_scale


def _is_concrete(x) -> bool:
    """An array whose values can be read here (not a tracer, not a shape-only stand-in
    such as the torch bridge's)."""
    return isinstance(x, (np.ndarray, jax.Array)) and not isinstance(x, jax.core.Tracer)


def validate(q, k_pages, v_pages, block_table, seq_lens, layout: str = "HND") -> Dims:
    """Check shapes, dtypes and, when the values are concrete (not traced), page ids and
    lengths. Raises ValueError / TypeError naming what it got; returns the call's
    :class:`~jaxattn.validation.Dims` (``kv_len``: the block table's capacity)."""
    check_page_layout(layout)
    if q.ndim != 4:
        raise ValueError(f"q must have rank 4 ([B, Hq, Sq, D]), got shape {q.shape}")
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if x.ndim != 4:
            want = ("[num_pages, page_size, Hkv, D]" if layout == "NHD"
                    else "[num_pages, Hkv, page_size, D]")
            raise ValueError(f"{name} must have rank 4 ({want}, layout={layout!r}), got "
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
    num_pages, hkv, page_size, dk = page_dims(k_pages, layout)
    if page_size == 0:
        raise ValueError(f"page_size must be positive, got k_pages of shape {k_pages.shape} "
                         f"(layout={layout!r})")
    if dk != d:
        raise ValueError(f"head-dim mismatch: q has D={d}, k_pages has D={dk}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"Hq must be a multiple of Hkv: Hq={hq} (q) is not divisible by "
                         f"Hkv={hkv} (the pages)")
    if block_table.ndim != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table must have shape [B, max_pages] with B={b}, got "
                         f"{block_table.shape}")
    if seq_lens.shape != (b,):
        raise ValueError(f"seq_lens must have shape [B] = ({b},), got {seq_lens.shape}")
    for name, x in (("block_table", block_table), ("seq_lens", seq_lens)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {x.dtype}")
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
    return Dims(b, hq, hkv, q.shape[2], capacity, d, np.dtype(q.dtype))


def gather(pages, block_table, layout: str = "HND"):
    """Contiguous ``[B, Hkv, max_pages * page_size, D]`` keys or values from pages."""
    check_page_layout(layout)
    return gather_pages(pages, block_table, layout)


def attention(q, k_pages, v_pages, block_table, seq_lens, *, causal: bool = True,
              scale: float | None = None, return_lse: bool = False,
              backend: str | None = None, layout: str = "HND"):
    """Attention of the last ``Sq`` tokens of each sequence against its paged KV.

    ``layout``: ``"HND"`` (``[num_pages, Hkv, page_size, D]``) or ``"NHD"``
    (``[num_pages, page_size, Hkv, D]``). Returns ``out [B, Hq, Sq, D]`` (and ``lse [B,
    Hq, Sq]`` fp32 with ``return_lse``). Forward only (rollout); train through
    :func:`jaxattn.attention`.
    """
    be = registry.resolve("attention", backend)
    dims = validate(q, k_pages, v_pages, block_table, seq_lens, layout)
    reason = be.unsupported(dims, "paged", page_size=page_dims(k_pages, layout)[2])
    if reason is not None:
        raise ValueError(f"backend {be.name!r} cannot serve this call: {reason}")
    out, lse = be.paged_forward(q, k_pages, v_pages, jnp.asarray(block_table, jnp.int32),
                                jnp.asarray(seq_lens, jnp.int32), causal=bool(causal),
                                scale=resolve_scale(scale, q.shape[-1]), layout=layout)
    return (out, lse) if return_lse else out


def write(k_pages, v_pages, block_table, seq_lens, k_new, v_new, layout: str = "HND"):
    """Append ``k_new, v_new [B, Hkv, T, D]`` after each sequence's ``seq_lens[b]`` keys.

    Returns ``(k_pages, v_pages, seq_lens + T)``; the pages the new tokens land on must
    already be in ``block_table``. Functional: the inputs are not modified.
    """
    b, hkv, t, d = k_new.shape
    page_size = page_dims(k_pages, layout)[2]
    pos = seq_lens[:, None] + jnp.arange(t)[None, :]  # [B, T]
    page = jnp.take_along_axis(block_table, pos // page_size, axis=1)  # [B, T]
    slot = pos % page_size
    pg = jnp.broadcast_to(page[:, None, :], (b, hkv, t))
    sl = jnp.broadcast_to(slot[:, None, :], (b, hkv, t))
    hd = jnp.broadcast_to(jnp.arange(hkv)[None, :, None], (b, hkv, t))
    if layout == "NHD":
        k_pages = k_pages.at[pg, sl, hd].set(k_new)
        v_pages = v_pages.at[pg, sl, hd].set(v_new)
    else:
        k_pages = k_pages.at[pg, hd, sl].set(k_new)
        v_pages = v_pages.at[pg, hd, sl].set(v_new)
    return k_pages, v_pages, seq_lens + t
