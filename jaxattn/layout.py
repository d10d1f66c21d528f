"""Where a sequence's rows sit: left-padding alignment and packed (varlen) sequences.

The canonical schedule (:mod:`jaxattn.schedule`) aligns key blocks to key 0 of the key
array, and the backward kernels group query rows into blocks from row 0 of each head. A
sequence therefore gets the bits it has alone exactly when its first valid key sits at
key 0 and its first real query row at a multiple of the query block (64 rows), with only
padding after it: the tail-padding row of the invariance matrix. This module moves rows
into that place and back, with gathers whose gradients are the inverse gathers (exact:
each row moves, none is summed):

* :func:`aligned_forward` / :func:`aligned_backward`: a key padding mask whose first True
  is at key ``f > 0`` (left padding, as Hugging Face ``generate`` builds it) has its keys
  moved ``f`` to the left, and its queries so that the first query that sees a key starts
  at a multiple of 64; the per-sequence causal offsets are adjusted to keep the causal
  rule. A left-padded sequence then equals itself alone in raw bits, forward and
  backward. Masks with holes after the first valid key keep the holes (within rounding
  of a sequence without them, as before).
* :func:`varlen_plan`, :func:`pad_packed`, :func:`pack_padded`: packed sequences
  (FlashAttention's ``cu_seqlens`` layout) placed one per batch row: keys from key 0, the
  queries ending in the row's last 64-row block (so the query rows before them see no key
  and cost no work in causal self-attention), with the per-sequence causal offsets that
  keep the bottom-right causal rule of each sequence.

The moves are copies (one gather each way); a backend with native kernels for these
layouts can serve them in place behind the same interface.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

#: Query rows per backward query block of every kernel backend (the Pallas and Triton
#: kernels' ``block_q``, 64 or 32, and the Mosaic kernels' ``BLOCK_Q``): real query rows
#: start at a multiple of it, as they do alone.
QUERY_ALIGN = 64


# ------------------------------------------------------------------------- row shifts

def shift_rows(x: jax.Array, shift: jax.Array, *, axis: int, fill=0) -> jax.Array:
    """``y[b, ..., t, ...] = x[b, ..., t + shift[b], ...]`` along ``axis`` (batch on axis
    0), ``fill`` where ``t + shift[b]`` falls outside the axis. Not differentiable (see
    :func:`shifted`)."""
    n = x.shape[axis]
    shape = [1] * x.ndim
    shape[0], shape[axis] = x.shape[0], n
    src = (jnp.arange(n, dtype=jnp.int32)[None, :] + shift.astype(jnp.int32)[:, None])
    src = src.reshape(shape)
    inside = (src >= 0) & (src < n)
    got = jnp.take_along_axis(x, jnp.clip(src, 0, max(n - 1, 0)), axis=axis)
    return jnp.where(inside, got, jnp.asarray(fill, x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def shifted(x: jax.Array, shift: jax.Array, axis: int, fill: float) -> jax.Array:
    """:func:`shift_rows`, differentiable: the gradient is the cotangent shifted back
    (rows that fell off get zero), a gather, so it is exact."""
    return shift_rows(x, shift, axis=axis, fill=fill)


def _shifted_fwd(x, shift, axis, fill):
    return shift_rows(x, shift, axis=axis, fill=fill), shift


def _shifted_bwd(axis, fill, shift, ct):
    return shift_rows(ct, -shift, axis=axis), None


shifted.defvjp(_shifted_fwd, _shifted_bwd)


def first_kept(key_padding_mask: jax.Array) -> jax.Array:
    """``[B]`` int32: the first True of each row of a ``[B, Skv]`` mask (0 for a row with
    none, or no keys at all)."""
    if key_padding_mask.shape[1] == 0:
        return jnp.zeros(key_padding_mask.shape[:1], jnp.int32)
    return jnp.argmax(key_padding_mask, axis=1).astype(jnp.int32)


class Alignment(NamedTuple):
    """How :func:`aligned_forward` moves one call: keys ``key_shift`` to the left, queries
    ``query_shift`` to the left, and the causal offsets that keep the rule."""

    key_shift: jax.Array  # [B] int32
    query_shift: jax.Array  # [B] int32
    causal_offsets: jax.Array | None  # [B] int32, None when not causal


def alignment(key_padding_mask, q_len: int, kv_len: int, *, causal: bool,
              causal_offsets=None) -> Alignment:
    """The move of :func:`aligned_forward` for a mask ``[B, Skv]``.

    Keys move by ``f``, the mask's first True. Causal: query i sits at key position
    ``i + offset``; the first ``f_q = clip(f - offset, 0, Sq)`` queries precede the first
    valid key (padding rows, which see nothing). The queries move by ``f_q mod 64``, so
    the first real row lands on a multiple of 64 with only padding rows before it, and
    the offset becomes ``offset - f + f_q mod 64``. Not causal: only the keys move."""
    f = first_kept(key_padding_mask)
    if not causal:
        return Alignment(f, jnp.zeros_like(f), None)
    off = (jnp.full(f.shape, kv_len - q_len, jnp.int32) if causal_offsets is None
           else jnp.asarray(causal_offsets, jnp.int32))
    fq = jnp.clip(f - off, 0, q_len)
    s = fq % QUERY_ALIGN
    return Alignment(f, s, off - f + s)


def aligned_forward(be, q, k, v, *, causal: bool, scale: float, key_padding_mask,
                    causal_offsets=None):
    """``be.forward_with_lse`` with left padding aligned away (module docstring);
    differentiable, the same ``(out, lse)`` layout as the call it replaces."""
    a = alignment(key_padding_mask, q.shape[2], k.shape[2], causal=causal,
                  causal_offsets=causal_offsets)
    out, lse = be.forward_with_lse(
        shifted(q, a.query_shift, 2, 0.0), shifted(k, a.key_shift, 2, 0.0),
        shifted(v, a.key_shift, 2, 0.0), causal=causal, scale=scale,
        key_padding_mask=shift_rows(key_padding_mask, a.key_shift, axis=1, fill=False),
        causal_offsets=a.causal_offsets)
    # The rows shifted in at the front are padding rows, which see no key: (0, -inf).
    back = -a.query_shift
    return shifted(out, back, 2, 0.0), shifted(lse, back, 2, -jnp.inf)


def aligned_backward(be, q, k, v, key_padding_mask, out, lse, d_out, d_lse, *, causal: bool,
                     scale: float, causal_offsets=None):
    """``be.backward`` from the residuals of :func:`aligned_forward`'s layout-preserving
    result: the residuals are moved as the forward moved its inputs (moved-in query rows
    get a zero cotangent and lse = +inf, so they add exact zeros) and the gradients moved
    back."""
    a = alignment(key_padding_mask, q.shape[2], k.shape[2], causal=causal,
                  causal_offsets=causal_offsets)
    s, f = a.query_shift, a.key_shift
    dq, dk, dv = be.backward(
        shift_rows(q, s, axis=2), shift_rows(k, f, axis=2), shift_rows(v, f, axis=2),
        shift_rows(key_padding_mask, f, axis=1, fill=False), shift_rows(out, s, axis=2),
        shift_rows(lse, s, axis=2, fill=jnp.inf), shift_rows(d_out, s, axis=2),
        None if d_lse is None else shift_rows(d_lse, s, axis=2),
        causal=causal, scale=scale, causal_offsets=a.causal_offsets)
    return shift_rows(dq, -s, axis=2), shift_rows(dk, -f, axis=2), shift_rows(dv, -f, axis=2)


# ------------------------------------------------------------------- packed sequences

class VarlenPlan(NamedTuple):
    """Where each packed sequence sits in the padded ``[N, H, L, D]`` layout."""

    len_q: jax.Array  # [N] int32
    len_k: jax.Array  # [N] int32
    q_start: jax.Array  # [N] int32: the padded row of the sequence's first query
    causal_offsets: jax.Array  # [N] int32 (the kernels' call is always causal)
    key_padding_mask: jax.Array | None  # [N, Lk] bool, or None (causal)
    fits: jax.Array  # [N] bool: the sequence fits the capacities


def varlen_plan(cu_seqlens_q, cu_seqlens_k, rows_q: int, rows_k: int, *,
                causal: bool) -> VarlenPlan:
    """The padded layout of packed sequences with ``rows_q`` query rows and ``rows_k``
    keys per sequence (static capacities).

    Keys sit at ``[0, len_k)``. Queries sit at ``[q_start, q_start + len_q)`` with
    ``q_start = rows_q - roundup(len_q, 64)`` (0 when that is negative), so the first
    real row is on a multiple of 64 and fewer than 64 padding rows follow it. Causal: the
    offset ``len_k - len_q - q_start`` keeps each sequence's bottom-right rule, and the
    rows before ``q_start`` see no key in self-attention (``len_q == len_k``). Not
    causal: the call is the causal call with offset ``len_k - 1 - q_start`` (every real
    row sees every real key: a flag that hides no key changes no bit) and the keys past
    ``len_k`` masked, so the blocks past them are skipped."""
    len_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).astype(jnp.int32)
    len_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).astype(jnp.int32)
    up = -(-len_q // QUERY_ALIGN) * QUERY_ALIGN
    q_start = jnp.maximum(rows_q - up, 0).astype(jnp.int32)
    if causal:
        offsets, mask = len_k - len_q - q_start, None
    else:
        offsets = len_k - 1 - q_start
        mask = jnp.arange(rows_k, dtype=jnp.int32)[None, :] < len_k[:, None]
    fits = (len_q <= rows_q) & (len_k <= rows_k)
    return VarlenPlan(len_q, len_k, q_start, offsets.astype(jnp.int32), mask, fits)


def _pad_packed(x, cu, start, rows: int, fill):
    t = x.shape[0]
    n = cu.shape[0] - 1
    i = jnp.arange(rows, dtype=jnp.int32)[None, :]  # [1, L]
    length = (cu[1:] - cu[:-1]).astype(jnp.int32)[:, None]
    tok = cu[:-1].astype(jnp.int32)[:, None] + i - start[:, None]  # [N, L]
    valid = (i >= start[:, None]) & (i < start[:, None] + length)
    got = jnp.take(x, jnp.clip(tok, 0, max(t - 1, 0)).reshape(-1), axis=0)
    got = got.reshape(n, rows, *x.shape[1:])
    valid = valid.reshape(n, rows, *([1] * (x.ndim - 1)))
    return jnp.where(valid, got, jnp.asarray(fill, x.dtype))


def _token_rows(cu, start, total: int):
    """For each packed token: its sequence, its padded row, and whether it belongs to a
    sequence (tokens past ``cu[-1]`` do not)."""
    n = cu.shape[0] - 1
    t = jnp.arange(total, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu.astype(jnp.int32), t, side="right") - 1, 0, n - 1)
    row = t - cu[seq].astype(jnp.int32) + start[seq]
    return seq, row, t < cu[n]


def _pack_padded(xp, cu, start, total: int, fill):
    rows = xp.shape[1]
    seq, row, inside = _token_rows(cu, start, total)
    got = xp[seq, jnp.clip(row, 0, rows - 1)]
    inside = (inside & (row < rows)).reshape(total, *([1] * (xp.ndim - 2)))
    return jnp.where(inside, got, jnp.asarray(fill, xp.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def pad_packed(x, cu, start, rows: int):
    """Packed ``x [T, ...]`` as ``[N, rows, ...]``: sequence n's tokens ``cu[n] ..
    cu[n+1] - 1`` at rows ``start[n] ..``, zeros elsewhere. Differentiable; its gradient
    is :func:`pack_padded` of the cotangent (exact)."""
    return _pad_packed(x, cu, start, rows, 0)


def _pad_fwd(x, cu, start, rows):
    return _pad_packed(x, cu, start, rows, 0), (cu, start, x.shape[0])


def _pad_bwd(rows, res, ct):
    cu, start, total = res
    return _pack_padded(ct, cu, start, total, 0), None, None


pad_packed.defvjp(_pad_fwd, _pad_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def pack_padded(xp, cu, start, total: int):
    """The inverse of :func:`pad_packed`: ``[N, rows, ...]`` back to packed ``[T, ...]``
    (zeros for tokens past ``cu[-1]``). Differentiable; its gradient is
    :func:`pad_packed` of the cotangent (exact)."""
    return _pack_padded(xp, cu, start, total, 0)


def _pack_fwd(xp, cu, start, total):
    return _pack_padded(xp, cu, start, total, 0), (cu, start, xp.shape[1])


def _pack_bwd(total, res, ct):
    cu, start, rows = res
    return _pad_packed(ct, cu, start, rows, 0), None, None


pack_padded.defvjp(_pack_fwd, _pack_bwd)


def pad_packed_values(x, cu, start, rows: int, fill) -> jax.Array:
    """:func:`pad_packed` with another ``fill`` (not differentiable): the lse residual
    with +inf in its padding rows."""
    return _pad_packed(x, cu, start, rows, fill)


def pack_padded_values(xp, cu, start, total: int, fill) -> jax.Array:
    """:func:`pack_padded` with another ``fill`` (not differentiable)."""
    return _pack_padded(xp, cu, start, total, fill)
