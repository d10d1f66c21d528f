"""Pallas (Triton lowering) attention forward: prefill, split-KV decode, combine.

The canonical schedule of DESIGN.md section 4, as three kernels:

* ``_prefill_kernel``: one program per (row tile, batch, KV head). It walks the splits
  of ``SPLIT`` keys in ascending order; inside a split it folds ``BLOCK_N`` blocks by
  online softmax, then finalises the split and merges it into the running state with
  :func:`jaxattn.merge.merge`.
* ``_split_kernel`` + ``_combine_kernel``: split-KV parallelism for decode and short
  query chunks. One program per (row tile, split, batch, KV head) writes the split's
  partial state; the combine kernel folds the splits in ascending order with the same
  merge. The number of splits follows from Skv and the fixed ``SPLIT``; it is never a
  tuning knob.

Both paths run the same operations per row, so which one serves a call (a speed
heuristic on the amount of row parallelism) does not change the bits.

Layout: the ``g = Hq // Hkv`` query heads of one KV head are stacked as the rows of one
tile (``q`` viewed as ``[B, Hkv, g * Sq, D]``, a free reshape; row ``r`` is query
``r % Sq`` of head ``r // Sq``), so a KV head's query heads share one pass over K and V
when ``g * Sq`` fits a tile (decode, short chunks) and read the same K/V blocks, from
L2, when it does not.

Blocks that every row of a tile sees whole (no padding mask, inside Skv, below the
causal diagonal of the tile's earliest row) skip the masking work; ``where`` with an
all-true mask is the identity, so the bits are those of the masked path.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxattn import schedule
from jaxattn.backends.base import check_page_layout
from jaxattn.backends.common import (
    NEG_INF,
    head_dim_reason,
    natural_max,
    next_pow2,
    online_softmax_step,
    pad_head_dim,
    padded_head_dim,
    precision_for,
)
from jaxattn.merge import finalize, merge


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """Launch parameters of the forward kernels. None of them changes the bits."""

    block_m: int = 128
    num_warps: int = 8
    num_stages: int = 3
    decode_num_warps: int = 4
    decode_num_stages: int = 3
    #: Below this many (row tile, batch, KV head) programs, and with more than one
    #: split, the split-parallel path is used.
    split_parallel_below: int = 264

    #: Launch order of the causal prefill's row tiles: "ascending" (the grid is
    #: ``(tile, b, h)``), "descending" (the same grid, tiles reversed: each KV head's
    #: longest tiles first), "heavy_first" (the grid is ``(b, h, rank)``: every head's
    #: last tile, then every head's second to last, ...), so that short tiles fill the
    #: tail of the grid instead of long ones; or "auto": "heavy_first" while the K and V
    #: of the call fit ``heavy_first_max_kv_bytes`` (heavy-first runs every KV head at
    #: once, so its keys must stay in L2), else "descending". H200, 2026-11-29, causal
    #: bf16 Hq=32 Hkv=8 D=128 (``python -m benchmarks.tune --what=launch``, TFLOP/s of
    #: ascending / descending / heavy_first): B=2 S=4096 300.2 / 302.7 / 322.5; B=8
    #: S=4096 328.9 / 329.9 / 317.7; B=2 S=16384 360.2 / 363.8 / 362.8.
    tile_order: str = "auto"
    heavy_first_max_kv_bytes: int = 48 << 20

    #: Send blocks that every row sees whole through the unmasked step. None: on the
    #: GPU, not in interpret mode (XLA:CPU would change a dot's summation order between
    #: the two steps; Triton does not). True in interpret mode checks its values only.
    whole_blocks: bool | None = None

    def __post_init__(self):
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"block_m must be a power of two >= 16, got {self.block_m}")
        if self.tile_order not in ("auto", "ascending", "descending", "heavy_first"):
            raise ValueError("tile_order must be 'auto', 'ascending', 'descending' or "
                             f"'heavy_first', got {self.tile_order!r}")


def forward_config(head_dim: int) -> ForwardConfig:
    """Default launch parameters for a head dim (H200 sweep of 2026-11-29, D=128:
    benchmarks/tune.py; see docs/notes.md)."""
    if head_dim > 128:
        return ForwardConfig(block_m=64, num_warps=4, num_stages=2)
    return ForwardConfig()


def _compiler_params(num_warps: int, num_stages: int):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _split_refs(refs, has_mask: bool, has_offsets: bool):
    """(mask_ref or None, offsets_ref or None, the remaining refs)."""
    refs = list(refs)
    mask_ref = refs.pop(0) if has_mask else None
    off_ref = refs.pop(0) if has_offsets else None
    return mask_ref, off_ref, refs


class _KV(NamedTuple):
    """Where a program's keys live. ``load(ref, start, ok=None)`` is the ``[BLOCK_N,
    D]`` block of keys ``[start, start + BLOCK_N)`` of this program's sequence and KV
    head (the rows where ``ok`` is False read as zeros: NaN or inf in padding cannot
    leak through 0 * x): a slice of the contiguous ``[Skv, D]`` block, a slice of one
    page of a paged cache, or rows gathered from several pages."""

    k_ref: Any
    v_ref: Any
    mask_ref: Any
    kv_len: Any  # a Python int (contiguous) or this sequence's length (paged)
    load: Callable


def _load_view(view, ok):
    return view[...] if ok is None else plgpu.load(view, mask=ok[:, None], other=0.0)


def _kv_source(k_ref, v_ref, mask_ref, paged_refs, kv_len: int, page_size: int | None,
               b, h, page_layout: str = "HND") -> _KV:
    """``b``, ``h``: this program's sequence and KV head. A paged block is the same
    ``BLOCK_N`` keys in the same order whatever the page size and layout (the reduction
    order never changes): one page's slice where pages are multiples of ``BLOCK_N``, else
    each row from its own page (a gather)."""
    bn = schedule.BLOCK_N
    if page_size is None:
        return _KV(k_ref, v_ref, mask_ref, kv_len,
                   lambda ref, start, ok=None: _load_view(ref.at[pl.ds(start, bn), :], ok))
    table_ref, lens_ref = paged_refs
    num_pages, max_pages = k_ref.shape[0], table_ref.shape[1]
    nhd = page_layout == "NHD"
    size = jnp.int32(page_size)
    # lax.div / lax.rem, not // and %: indices are >= 0, and jnp's floor/remainder
    # wrappers (a select on the divisor) fail to lower inside nested loops on JAX 0.11's
    # Triton lowering ("AssertionError: ('i32', 'i1')", seen on the H200). The clips
    # only keep a bad table entry (or rows past the table) from reading outside.

    def page_of(logical):
        return jnp.clip(table_ref[b, jnp.minimum(logical, max_pages - 1)], 0, num_pages - 1)

    if page_size % bn == 0:  # a block never straddles two pages
        def load(ref, start, ok=None):
            start = jnp.asarray(start, jnp.int32)
            page, slot = page_of(jax.lax.div(start, size)), jax.lax.rem(start, size)
            view = (ref.at[page, pl.ds(slot, bn), h, :] if nhd
                    else ref.at[page, h, pl.ds(slot, bn), :])
            return _load_view(view, ok)
    else:
        def load(ref, start, ok=None):
            rows = jnp.asarray(start, jnp.int32) + jnp.arange(bn, dtype=jnp.int32)
            page, slot = page_of(jax.lax.div(rows, size)), jax.lax.rem(rows, size)
            x = ref[page, slot, h, :] if nhd else ref[page, h, slot, :]
            return x if ok is None else jnp.where(ok[:, None], x, jnp.zeros((), x.dtype))

    return _KV(k_ref, v_ref, None, lens_ref[b], load)


def _causal_offset(off_ref, q_len: int, kv_len: int, b):
    """Position of query 0 minus position of key 0: ``Skv - Sq`` unless given per
    sequence (context parallelism: global positions of a shard)."""
    return kv_len - q_len if off_ref is None else off_ref[b]


def _prefill_program(order: str, n_tiles: int, tiles_per_head: int | None, group: int):
    """(row tile, sequence, KV head) of this prefill program (``ForwardConfig.tile_order``).

    The grid is ``(tile, b, h)``, the tiles reversed for "descending". For
    "heavy_first" it is ``(b, h, rank)``: the rank is the slowest launch axis, and rank r
    is tile ``T - 1 - r // g`` of query head ``r % g`` of the KV head (``T`` tiles per
    head), so every head's longest causal tiles are launched first; when tiles straddle
    heads, simply the tiles in reverse.
    """
    if order == "ascending":
        return pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if order == "descending":
        return n_tiles - 1 - pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rank = pl.program_id(2)
    if tiles_per_head is None:
        tile = n_tiles - 1 - rank
    else:
        tile = (rank % group) * tiles_per_head + (tiles_per_head - 1 - rank // group)
    return tile, pl.program_id(0), pl.program_id(1)


def _row_tile(q_ref, tile, block_m: int, rows: int, q_len: int, offset):
    """Rows of tile ``tile``: validity, causal position limit, and the q tile."""
    row_ids = tile * block_m + jnp.arange(block_m, dtype=jnp.int32)
    row_ok = row_ids < rows
    # Key j is visible to row r iff j <= (r mod Sq) + offset.
    limit = row_ids % q_len + offset
    q = plgpu.load(q_ref.at[pl.ds(tile * block_m, block_m), :], mask=row_ok[:, None],
                   other=0.0)
    return row_ok, limit, q


def _block_bounds(row_ok, limit, *, causal: bool, kv_len, has_mask: bool):
    """(blocks seen whole by every row, blocks seen by any row) of the tile.

    One rule for every mask: row r sees keys up to its limit, ``Skv - 1`` without
    ``causal``, and the bounds come from the tile's valid rows either way. (Bounds that
    are constants without ``causal`` let XLA:CPU unroll a one-block loop in interpret
    mode and compile that block's arithmetic in another fusion, with other fp32 bits
    than the causal call of the same keys.)"""
    bn = schedule.BLOCK_N
    total = (kv_len + bn - 1) // bn
    full = 0 if has_mask else kv_len // bn
    if not causal:
        limit = jnp.full(limit.shape, kv_len - 1, jnp.int32)
    last = jnp.max(jnp.where(row_ok, limit, -1))
    first = jnp.min(jnp.where(row_ok, limit, kv_len))
    hi = jnp.clip(jnp.where(last < 0, 0, last // bn + 1), 0, total)
    full = jnp.clip(jnp.where(first < 0, 0, (first + 1) // bn), 0, full)
    return full.astype(jnp.int32), hi.astype(jnp.int32)


def _fold_blocks(lo, mid, hi, q, kv: _KV, limit, *, causal, scale, precision,
                 whole_blocks, init=None, raw=False):
    """Online softmax over key blocks [lo, hi) of one split (blocks below ``mid`` are
    seen whole by every row); returns the split's partial state, or with ``raw`` the
    running ``(acc, m, l)`` itself. ``init``: the running state to continue (the keys
    before ``lo`` of the same split, folded by an earlier call), else the empty state.

    ``whole_blocks=False`` sends every block through the masked step. Interpret mode
    uses it: XLA:CPU fuses the masking selects into its dot emitters and so changes a
    dot's summation order between the two steps, which Triton on the GPU does not.
    """
    bn = schedule.BLOCK_N
    m_rows, head_dim = q.shape
    mask_ref, kv_len = kv.mask_ref, kv.kv_len

    def whole(j, carry):
        k = kv.load(kv.k_ref, j * bn)
        v = kv.load(kv.v_ref, j * bn)
        return online_softmax_step(*carry, q, k, v, None, scale=scale, precision=precision)

    def masked(j, carry):
        start = j * bn
        cols = start + jnp.arange(bn, dtype=jnp.int32)
        ok = cols < kv_len
        if mask_ref is not None:
            ok = ok & (plgpu.load(mask_ref.at[pl.ds(start, bn)], mask=ok, other=0) != 0)
        # Keys not kept load as zeros: NaN or inf in padding cannot leak through 0 * x.
        k = kv.load(kv.k_ref, start, ok)
        v = kv.load(kv.v_ref, start, ok)
        visible = jnp.broadcast_to(ok[None, :], (m_rows, bn))
        if causal:
            visible = visible & (cols[None, :] <= limit[:, None])
        return online_softmax_step(*carry, q, k, v, visible, scale=scale,
                                   precision=precision)

    if init is None:
        init = (jnp.zeros((m_rows, head_dim), jnp.float32),
                jnp.full((m_rows,), NEG_INF, jnp.float32),
                jnp.zeros((m_rows,), jnp.float32))
    # (A static length below BLOCK_N has no whole block; its loop is not even traced.)
    if whole_blocks and mask_ref is None and not (isinstance(kv_len, int) and kv_len < bn):
        mid = jnp.clip(mid, lo, hi)
        carry = jax.lax.fori_loop(lo, mid, whole, init)
    else:
        mid, carry = lo, init
    acc, m, l = jax.lax.fori_loop(mid, hi, masked, carry)
    return (acc, m, l) if raw else finalize(acc, natural_max(m), l)


def _prefill_kernel(q_ref, k_ref, v_ref, *refs, has_mask, has_offsets, causal, scale, q_len,
                    kv_len, rows, block_m, precision, whole_blocks, page_size, tile_order,
                    page_layout):
    mask_ref, off_ref, refs = _split_refs(refs, has_mask, has_offsets)
    n_tiles = pl.cdiv(rows, block_m)
    tile, b, h = _prefill_program(tile_order, n_tiles,
                                  q_len // block_m if q_len % block_m == 0 else None,
                                  rows // q_len)
    kv = _kv_source(k_ref, v_ref, mask_ref, refs[:2], kv_len, page_size, b, h, page_layout)
    o_ref, lse_ref = refs[-2:]
    row_ok, limit, q = _row_tile(q_ref, tile, block_m, rows, q_len,
                                 _causal_offset(off_ref, q_len, kv.kv_len, b))
    full, hi = _block_bounds(row_ok, limit, causal=causal, kv_len=kv.kv_len,
                             has_mask=has_mask)
    per_split = schedule.BLOCKS_PER_SPLIT
    n_splits = (hi + per_split - 1) // per_split

    def split_body(si, state):
        lo = si * per_split
        part = _fold_blocks(lo, full, jnp.minimum(lo + per_split, hi), q, kv, limit,
                            causal=causal, scale=scale, precision=precision,
                            whole_blocks=whole_blocks)
        return merge(*state, *part)

    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((block_m,), NEG_INF, jnp.float32))
    out, lse = jax.lax.fori_loop(0, n_splits, split_body, init)
    sl = pl.ds(tile * block_m, block_m)
    plgpu.store(o_ref.at[sl, :], out.astype(o_ref.dtype), mask=row_ok[:, None])
    plgpu.store(lse_ref.at[sl], lse, mask=row_ok)


def _split_kernel(q_ref, k_ref, v_ref, *refs, has_mask, has_offsets, causal, scale, q_len,
                  kv_len, rows, block_m, n_splits, precision, whole_blocks, page_size,
                  page_layout):
    mask_ref, off_ref, refs = _split_refs(refs, has_mask, has_offsets)
    b, h = pl.program_id(1), pl.program_id(2)
    kv = _kv_source(k_ref, v_ref, mask_ref, refs[:2], kv_len, page_size, b, h, page_layout)
    o_ref, lse_ref = refs[-2:]
    pid = pl.program_id(0)
    tile = pid // n_splits
    si = pid % n_splits
    row_ok, limit, q = _row_tile(q_ref, tile, block_m, rows, q_len,
                                 _causal_offset(off_ref, q_len, kv.kv_len, b))
    full, hi = _block_bounds(row_ok, limit, causal=causal, kv_len=kv.kv_len,
                             has_mask=has_mask)
    lo = si * schedule.BLOCKS_PER_SPLIT
    end = jnp.maximum(jnp.minimum(lo + schedule.BLOCKS_PER_SPLIT, hi), lo)
    out, lse = _fold_blocks(lo, full, end, q, kv, limit, causal=causal, scale=scale,
                            precision=precision, whole_blocks=whole_blocks)
    sl = pl.ds(tile * block_m, block_m)
    plgpu.store(o_ref.at[si, sl, :], out, mask=row_ok[:, None])
    plgpu.store(lse_ref.at[si, sl], lse, mask=row_ok)


def _segment_kernel(q_ref, k_ref, v_ref, *refs, has_mask, has_offsets, has_carry, finish,
                    causal, scale, q_len, kv_len, rows, block_m, precision, whole_blocks):
    """One program per (row tile, batch, KV head): the keys of one piece of a split,
    folded on from the running state ``(acc, m, l)`` of the split's earlier keys
    (``has_carry``), written as the split's partial state (``finish``) or as the running
    state for the next piece."""
    mask_ref, off_ref, refs = _split_refs(refs, has_mask, has_offsets)
    b, h = pl.program_id(1), pl.program_id(2)
    kv = _kv_source(k_ref, v_ref, mask_ref, (), kv_len, None, b, h)
    tile = pl.program_id(0)
    row_ok, limit, q = _row_tile(q_ref, tile, block_m, rows, q_len,
                                 _causal_offset(off_ref, q_len, kv_len, b))
    full, hi = _block_bounds(row_ok, limit, causal=causal, kv_len=kv_len, has_mask=has_mask)
    sl = pl.ds(tile * block_m, block_m)
    init = None
    if has_carry:
        acc_ref, m_ref, l_ref, *refs = refs
        init = (plgpu.load(acc_ref.at[sl, :], mask=row_ok[:, None], other=0.0),
                plgpu.load(m_ref.at[sl], mask=row_ok, other=NEG_INF),
                plgpu.load(l_ref.at[sl], mask=row_ok, other=0.0))
    state = _fold_blocks(0, full, hi, q, kv, limit, causal=causal, scale=scale,
                         precision=precision, whole_blocks=whole_blocks, init=init,
                         raw=not finish)
    for ref, x in zip(refs, state, strict=True):
        if x.ndim == 2:
            plgpu.store(ref.at[sl, :], x, mask=row_ok[:, None])
        else:
            plgpu.store(ref.at[sl], x, mask=row_ok)


def _combine_kernel(o_parts_ref, lse_parts_ref, o_ref, lse_ref, *, rows, block_m, n_splits):
    tile = pl.program_id(0)
    row_ok = tile * block_m + jnp.arange(block_m, dtype=jnp.int32) < rows
    sl = pl.ds(tile * block_m, block_m)
    head_dim = o_ref.shape[-1]

    def body(si, state):
        o_s = plgpu.load(o_parts_ref.at[si, sl, :], mask=row_ok[:, None], other=0.0)
        lse_s = plgpu.load(lse_parts_ref.at[si, sl], mask=row_ok, other=NEG_INF)
        return merge(*state, o_s, lse_s)

    init = (jnp.zeros((block_m, head_dim), jnp.float32),
            jnp.full((block_m,), NEG_INF, jnp.float32))
    out, lse = jax.lax.fori_loop(0, n_splits, body, init)
    plgpu.store(o_ref.at[sl, :], out.astype(o_ref.dtype), mask=row_ok[:, None])
    plgpu.store(lse_ref.at[sl], lse, mask=row_ok)


def check_supported(head_dim: int) -> str | None:
    """Why these kernels cannot serve a head dim, or None (any D from 1 to 256: a D
    that is not one of :data:`jaxattn.backends.common.KERNEL_HEAD_DIMS` runs zero-padded
    to the next one)."""
    return head_dim_reason(head_dim, "the Pallas kernels")


def _pad_qkv(q, k, v):
    """(the kernel head dim, q, k, v zero-padded to it)."""
    dp = padded_head_dim(q.shape[-1])
    return dp, pad_head_dim(q, dp), pad_head_dim(k, dp), pad_head_dim(v, dp)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "interpret", "config"))
def split_partials(q, k, v, key_padding_mask=None, causal_offsets=None, *, causal: bool,
                   scale: float, interpret: bool, config: ForwardConfig | None = None):
    """Per-split partial states ``(out [B, Hkv, n_splits, g*Sq, D], lse [..., g*Sq])``.

    The split-parallel path without its combine; the states are in ascending split
    order and fold, by :func:`jaxattn.merge.merge`, to :func:`forward`'s result.
    """
    d = q.shape[-1]
    _, q, k, v = _pad_qkv(q, k, v)
    out, lse = _forward(q, k, v, key_padding_mask, causal_offsets, causal=causal,
                        scale=scale, interpret=interpret, path="split", config=config,
                        partials=True)
    return out[..., :d], lse


def _mask_offset_inputs(key_padding_mask, causal_offsets, *, causal: bool, b: int,
                        skv: int):
    """The kernels' optional inputs after q, k, v: ``(in_specs, args, has_mask,
    has_offsets)`` for the key mask (``[B, Skv]`` as int32) and the per-sequence causal
    offsets (``[B]`` int32, causal only), on a ``(tile, batch, KV head)`` grid."""
    in_specs, args = [], []
    has_mask = key_padding_mask is not None
    if has_mask:
        in_specs.append(pl.BlockSpec((None, skv), lambda i, bi, hi: (bi, 0)))
        args.append(key_padding_mask.astype(jnp.int32))
    has_offsets = causal and causal_offsets is not None
    if has_offsets:
        in_specs.append(pl.BlockSpec((b,), lambda i, bi, hi: (0,)))
        args.append(jnp.asarray(causal_offsets, jnp.int32).reshape(b))
    return in_specs, args, has_mask, has_offsets


def _split_launch(cfg: ForwardConfig, rows: int) -> tuple[int, int, int]:
    """``(block_m, warps, stages)`` of the split-parallel path's programs for ``rows``
    query rows per KV head (small tiles for decode rows)."""
    bm = min(cfg.block_m, max(16, next_pow2(rows)))
    if bm <= 32:
        return bm, cfg.decode_num_warps, cfg.decode_num_stages
    return bm, cfg.num_warps, cfg.num_stages


@functools.partial(jax.jit, static_argnames=("causal", "scale", "interpret", "finish",
                                             "config"))
def split_segment(q, k, v, key_padding_mask=None, causal_offsets=None, carry=None, *,
                  causal: bool, scale: float, interpret: bool, finish: bool,
                  config: ForwardConfig | None = None):
    """Keys ``k, v`` that lie inside one SPLIT (its start, or the keys after an earlier
    piece of it), folded on from that earlier piece's running state ``carry`` exactly
    as one kernel folds the whole split: with ``finish``, the split's partial state
    ``(out [B, Hkv, 1, g*Sq, D], lse [B, Hkv, 1, g*Sq])`` as :func:`split_partials`
    gives it; else the running state ``(acc [B, Hkv, g*Sq, D], m, l [B, Hkv, g*Sq])``
    (fp32, m in the kernels' base) for the next piece.

    Pieces cut at multiples of ``BLOCK_N`` fold the split's blocks in the one call's
    order, so the finished state has the one call's bits (context parallelism across a
    cut inside a split)."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    dp, q, k, v = _pad_qkv(q, k, v)
    if skv > schedule.SPLIT:
        raise ValueError(f"a split segment holds at most SPLIT = {schedule.SPLIT} keys, got "
                         f"{skv}")
    g = hq // hkv
    rows = g * sq
    cfg = config or forward_config(dp)
    bm, warps, stages = _split_launch(cfg, rows)
    per_head = lambda blk: pl.BlockSpec((None, None, *blk), lambda i, bi, hi: (bi, hi, 0, 0))
    row_spec = pl.BlockSpec((None, None, rows), lambda i, bi, hi: (bi, hi, 0))
    extra_specs, extra_args, has_mask, has_offsets = _mask_offset_inputs(
        key_padding_mask, causal_offsets, causal=causal, b=b, skv=skv)
    in_specs = [per_head((rows, dp)), per_head((skv, dp)), per_head((skv, dp)), *extra_specs]
    args = [q.reshape(b, hkv, rows, dp), k, v, *extra_args]
    if carry is not None:
        acc, m, l = carry
        in_specs += [per_head((rows, dp)), row_spec, row_spec]
        args += [pad_head_dim(acc, dp), m, l]
    state_shapes = [jax.ShapeDtypeStruct((b, hkv, rows, dp), jnp.float32),
                    jax.ShapeDtypeStruct((b, hkv, rows), jnp.float32)]
    if not finish:
        state_shapes.append(jax.ShapeDtypeStruct((b, hkv, rows), jnp.float32))
    state = pl.pallas_call(
        functools.partial(
            _segment_kernel, has_mask=has_mask, has_offsets=has_offsets,
            has_carry=carry is not None, finish=finish, causal=causal, scale=scale,
            q_len=sq, kv_len=skv, rows=rows, block_m=bm,
            precision=precision_for(q.dtype),
            whole_blocks=(not interpret) if cfg.whole_blocks is None else cfg.whole_blocks),
        grid=(pl.cdiv(rows, bm), b, hkv),
        in_specs=in_specs,
        out_specs=[per_head((rows, dp))] + [row_spec] * (len(state_shapes) - 1),
        out_shape=state_shapes,
        compiler_params=_compiler_params(warps, stages),
        interpret=interpret,
        name="jaxattn_split_segment",
    )(*args)
    if finish:
        out, lse = state
        return out[:, :, None, :, :d], lse[:, :, None]
    acc, m, l = state
    return acc[..., :d], m, l


@functools.partial(jax.jit, static_argnames=("causal", "scale", "interpret", "path",
                                             "config"))
def forward(q, k, v, key_padding_mask=None, causal_offsets=None, *, causal: bool,
            scale: float, interpret: bool, path: str | None = None,
            config: ForwardConfig | None = None):
    """Attention forward on the canonical schedule.

    Args:
      q: ``[B, Hq, Sq, D]``; k, v: ``[B, Hkv, Skv, D]``; key_padding_mask: ``[B, Skv]``
        bool or None; scale: the resolved scale.
      causal_offsets: ``[B]`` int or None: position of query 0 minus position of key 0
        per sequence (default ``Skv - Sq``); key j is visible to query i iff
        ``j <= i + offset``.
      path: ``None`` (choose by row parallelism), ``"prefill"`` or ``"split"``; every
        choice gives the same bits.
      config: launch parameters (default :func:`forward_config`); they never change the
        bits.

    Returns:
      ``(out [B, Hq, Sq, D] q.dtype, lse [B, Hq, Sq] fp32)``. Any D from 1 to 256: the
      kernels run zero-padded to the next of ``KERNEL_HEAD_DIMS``.
    """
    d = q.shape[-1]
    _, q, k, v = _pad_qkv(q, k, v)
    out, lse = _forward(q, k, v, key_padding_mask, causal_offsets, causal=causal,
                        scale=scale, interpret=interpret, path=path, config=config,
                        partials=False)
    return out[..., :d], lse


@functools.partial(jax.jit, static_argnames=("causal", "scale", "interpret", "path",
                                             "config", "layout"))
def paged_forward(q, k_pages, v_pages, block_table, seq_lens, *, causal: bool, scale: float,
                  interpret: bool, path: str | None = None,
                  config: ForwardConfig | None = None, layout: str = "HND"):
    """Attention of the last ``Sq`` tokens of each sequence against a paged KV cache,
    read in place by the kernels (no gather into a contiguous copy).

    Args:
      q: ``[B, Hq, Sq, D]``: the queries of tokens ``seq_lens[b] - Sq .. seq_lens[b] - 1``.
      k_pages, v_pages: ``[num_pages, Hkv, page_size, D]`` (``layout="HND"``) or
        ``[num_pages, page_size, Hkv, D]`` (``"NHD"``); any ``page_size`` (a key block
        of ``BLOCK_N`` keys is one page's slice where ``page_size`` is a multiple of it,
        else its rows are gathered from their pages: the same keys in the same order).
      block_table: ``[B, max_pages]`` int32: logical page p of sequence b is physical
        page ``block_table[b, p]``.
      seq_lens: ``[B]`` int32 keys per sequence (at most ``max_pages * page_size``).

    Returns ``(out, lse)`` equal in bits to :func:`forward` on the contiguous keys. A
    head dim the kernels are not compiled for pads the pages too (a copy of the cache).
    """
    check_page_layout(layout)
    d = q.shape[-1]
    _, q, k_pages, v_pages = _pad_qkv(q, k_pages, v_pages)
    out, lse = _forward(q, k_pages, v_pages, None, None, causal=causal, scale=scale,
                        interpret=interpret, path=path, config=config, partials=False,
                        paged=(block_table, seq_lens), page_layout=layout)
    return out[..., :d], lse


def _heavy_first_spec(spec: pl.BlockSpec) -> pl.BlockSpec:
    """``spec`` for the ``(b, h, rank)`` grid of the heavy-first prefill (no spec here
    depends on the row tile: each program reads its KV head's whole rows)."""
    index_map = spec.index_map
    return pl.BlockSpec(spec.block_shape, lambda bi, hi, _: index_map(0, bi, hi))


def _forward(q, k, v, key_padding_mask, causal_offsets, *, causal, scale, interpret, path,
             config, partials, paged=None, page_layout="HND"):
    b, hq, sq, d = q.shape
    hkv = k.shape[2] if paged is not None and page_layout == "NHD" else k.shape[1]
    if paged is None:
        skv, page_size = k.shape[2], None
    else:  # capacity of the block table; each sequence's own length comes from seq_lens
        page_size = k.shape[1] if page_layout == "NHD" else k.shape[2]
        skv = paged[0].shape[1] * page_size
    g = hq // hkv
    rows = g * sq
    n_splits = schedule.num_splits(skv)
    if sq == 0 or skv == 0:
        if partials:
            return (jnp.zeros((b, hkv, n_splits, rows, d), jnp.float32),
                    jnp.full((b, hkv, n_splits, rows), NEG_INF, jnp.float32))
        return (jnp.zeros(q.shape, q.dtype), jnp.full((b, hq, sq), NEG_INF, jnp.float32))
    cfg = config or forward_config(d)
    precision = precision_for(q.dtype)
    qf = q.reshape(b, hkv, rows, d)
    if path is None:
        use_split = (n_splits > 1 and
                     pl.cdiv(rows, cfg.block_m) * b * hkv < cfg.split_parallel_below)
        path = "split" if use_split else "prefill"
    if path not in ("prefill", "split"):
        raise ValueError(f"path must be None, 'prefill' or 'split', got {path!r}")

    per_head = lambda blk: pl.BlockSpec((None, None, *blk), lambda i, bi, hi: (bi, hi, 0, 0))
    if paged is None:
        in_specs = [per_head((rows, d)), per_head((skv, d)), per_head((skv, d))]
    else:
        whole = pl.BlockSpec(k.shape, lambda i, bi, hi: (0, 0, 0, 0))
        in_specs = [per_head((rows, d)), whole, whole]
    extra_specs, extra_args, has_mask, has_offsets = _mask_offset_inputs(
        key_padding_mask, causal_offsets, causal=causal, b=b, skv=skv)
    in_specs += extra_specs
    args = [qf, k, v, *extra_args]
    if paged is not None:
        table, lens = paged
        in_specs += [pl.BlockSpec(table.shape, lambda i, bi, hi: (0, 0)),
                     pl.BlockSpec((b,), lambda i, bi, hi: (0,))]
        args += [table.astype(jnp.int32), lens.astype(jnp.int32)]
    static = dict(has_mask=has_mask, has_offsets=has_offsets, causal=causal, scale=scale,
                  q_len=sq, kv_len=skv, rows=rows, precision=precision, page_size=page_size,
                  page_layout=page_layout,
                  whole_blocks=(not interpret) if cfg.whole_blocks is None
                  else cfg.whole_blocks)
    out_shapes = [jax.ShapeDtypeStruct((b, hkv, rows, d), q.dtype),
                  jax.ShapeDtypeStruct((b, hkv, rows), jnp.float32)]
    lse_spec = pl.BlockSpec((None, None, rows), lambda i, bi, hi: (bi, hi, 0))

    if path == "prefill":
        bm = cfg.block_m
        order = cfg.tile_order if causal else "ascending"
        if order == "auto":
            kv_bytes = 2 * k.size * k.dtype.itemsize
            order = ("heavy_first" if kv_bytes <= cfg.heavy_first_max_kv_bytes
                     else "descending")
        grid = (pl.cdiv(rows, bm), b, hkv)
        out_specs = [per_head((rows, d)), lse_spec]
        if order == "heavy_first":  # the grid is (b, h, rank); the index maps take (tile, b, h)
            grid = (b, hkv, grid[0])
            in_specs = [_heavy_first_spec(spec) for spec in in_specs]
            out_specs = [_heavy_first_spec(spec) for spec in out_specs]
        out, lse = pl.pallas_call(
            functools.partial(_prefill_kernel, block_m=bm, tile_order=order, **static),
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shapes,
            compiler_params=_compiler_params(cfg.num_warps, cfg.num_stages),
            interpret=interpret,
            name="jaxattn_prefill",
        )(*args)
        return out.reshape(b, hq, sq, d), lse.reshape(b, hq, sq)

    bm, warps, stages = _split_launch(cfg, rows)
    tiles = pl.cdiv(rows, bm)
    parts_spec = pl.BlockSpec((None, None, n_splits, rows, d),
                              lambda i, bi, hi: (bi, hi, 0, 0, 0))
    parts_lse_spec = pl.BlockSpec((None, None, n_splits, rows),
                                  lambda i, bi, hi: (bi, hi, 0, 0))
    o_parts, lse_parts = pl.pallas_call(
        functools.partial(_split_kernel, block_m=bm, n_splits=n_splits, **static),
        grid=(tiles * n_splits, b, hkv),
        in_specs=in_specs,
        out_specs=[parts_spec, parts_lse_spec],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, n_splits, rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, n_splits, rows), jnp.float32)],
        compiler_params=_compiler_params(warps, stages),
        interpret=interpret,
        name="jaxattn_split",
    )(*args)
    if partials:
        return o_parts, lse_parts
    out, lse = pl.pallas_call(
        functools.partial(_combine_kernel, rows=rows, block_m=bm, n_splits=n_splits),
        grid=(tiles, b, hkv),
        in_specs=[parts_spec, parts_lse_spec],
        out_specs=[per_head((rows, d)), lse_spec],
        out_shape=out_shapes,
        compiler_params=_compiler_params(warps, 1),
        interpret=interpret,
        name="jaxattn_combine",
    )(o_parts, lse_parts)
    return out.reshape(b, hq, sq, d), lse.reshape(b, hq, sq)
