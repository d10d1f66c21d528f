"""Packed sequences (varlen): FlashAttention's ``cu_seqlens`` layout, in the bits of each
sequence alone.

RL trainers remove padding and pack a batch's sequences end to end (verl and OpenRLHF
call ``flash_attn_varlen_func``; HF transformers packs by ``position_ids``):
``q [Tq, Hq, D]`` and ``k, v [Tk, Hkv, D]`` hold the tokens of every sequence, sequence
n's queries at ``cu_seqlens_q[n] .. cu_seqlens_q[n+1] - 1`` and its keys likewise. Each
sequence attends to its own keys only, with the bottom-right causal rule of
:func:`jaxattn.attention` (its queries are the last ``len_q`` of its ``len_k`` keys).

Every token's ``out``, ``lse`` and gradients equal in raw bits the same sequence computed
alone by :func:`jaxattn.attention` with the same backend (a kernel backend, which follows
the schedule): the backend's ``varlen_forward`` aligns each sequence's key blocks to its
own first key (:mod:`jaxattn.layout`). Under ``jax.jit`` the lengths are run-time values:
one compile serves every packing of the same token counts, sequence count and
capacities.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import registry
from jaxattn.schedule import bucket_length
from jaxattn.validation import SUPPORTED_DTYPES, Dims, resolve_scale, validate_inputs

__all__ = ["attention", "backward", "capacity", "forward", "guard", "validate"]


def _concrete(x) -> bool:
    """Whether ``x``'s values can be read now (not traced, not metadata only)."""
    return isinstance(x, (np.ndarray, jax.Array)) and not isinstance(x, jax.core.Tracer)


def _check_cu(name: str, cu, total: int) -> None:
    shape = getattr(cu, "shape", None)
    if shape is None:
        raise TypeError(f"{name} must be an int array, got {type(cu).__name__}")
    if len(shape) != 1 or shape[0] < 1:
        raise ValueError(f"{name} must have shape [N + 1] (N sequences), got {tuple(shape)}")
    if not jnp.issubdtype(cu.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {cu.dtype}")
    if _concrete(cu):
        c = np.asarray(cu)
        if c[0] != 0:
            raise ValueError(f"{name}[0] must be 0, got {int(c[0])}")
        if (np.diff(c) < 0).any():
            i = int(np.argmax(np.diff(c) < 0))
            raise ValueError(f"{name} must be non-decreasing, got {name}[{i}] = {int(c[i])} > "
                             f"{name}[{i + 1}] = {int(c[i + 1])}")
        if c[-1] > total:
            raise ValueError(f"{name}[-1] = {int(c[-1])} exceeds the {total} packed tokens")


def validate(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=True, scale=None) -> Dims:
    """Check the packed arrays and ``cu_seqlens`` (values too, where they are concrete).
    Raises ValueError / TypeError naming the argument and what it got; returns the
    :class:`~jaxattn.validation.Dims` of the padded call (``batch``: the sequence count,
    ``q_len``/``kv_len``: the packed token counts)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        shape = getattr(x, "shape", None)
        if shape is None:
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if len(shape) != 3:
            raise ValueError(f"{name} must have rank 3 ([T, H, D], packed tokens), got shape "
                             f"{tuple(shape)}")
        if np.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has unsupported dtype {np.dtype(x.dtype)}")
    _check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    _check_cu("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of "
                         f"sequences, got shapes {tuple(cu_seqlens_q.shape)} and "
                         f"{tuple(cu_seqlens_k.shape)}")
    n = cu_seqlens_q.shape[0] - 1
    # The [B, H, S, D] contract's checks on the packed arrays seen as one batch row.
    dims = validate_inputs(_Meta(q), _Meta(k), _Meta(v), causal=causal, scale=scale)
    return Dims(n, dims.num_q_heads, dims.num_kv_heads, q.shape[0], k.shape[0],
                dims.head_dim, dims.dtype)


class _Meta:
    """A packed ``[T, H, D]`` array's shape and dtype as ``[1, H, T, D]`` (no copy)."""

    __slots__ = ("shape", "dtype")

    def __init__(self, x):
        t, h, d = x.shape
        self.shape = (1, h, t, d)
        self.dtype = x.dtype


def capacity(max_seqlen: int | None, cu_seqlens, total: int, name: str) -> int:
    """The rows per sequence of the padded layout: ``max_seqlen`` (or, where it is None,
    the longest sequence when ``cu_seqlens`` is concrete, else the packed token count
    ``total``, which always fits) rounded up to its bucket
    (:func:`jaxattn.schedule.bucket_length`), so calls compile once per bucket."""
    if max_seqlen is None:
        if _concrete(cu_seqlens):
            c = np.asarray(cu_seqlens)
            max_seqlen = int(np.diff(c).max()) if c.size > 1 else 0
        else:
            max_seqlen = total
    elif isinstance(max_seqlen, (bool, np.bool_)) or not isinstance(
            max_seqlen, (int, np.integer)) or max_seqlen < 0:
        raise ValueError(f"{name} must be None or a non-negative int, got {max_seqlen!r}")
    elif _concrete(cu_seqlens):
        c = np.asarray(cu_seqlens)
        longest = int(np.diff(c).max()) if c.size > 1 else 0
        if longest > max_seqlen:
            raise ValueError(f"{name} = {max_seqlen} but a sequence has {longest} tokens")
    return bucket_length(max(int(max_seqlen), 1))


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal: bool = True,
              scale: float | None = None, max_seqlen_q: int | None = None,
              max_seqlen_k: int | None = None, return_lse: bool = False,
              backend: str | None = None):
    """Attention of packed sequences, each against its own keys.

    Args:
      q: ``[Tq, Hq, D]`` packed query tokens; k, v: ``[Tk, Hkv, D]`` packed keys and
        values; bf16, fp16 or fp32, one dtype; ``Hq % Hkv == 0``.
      cu_seqlens_q, cu_seqlens_k: ``[N + 1]`` int, cumulative token counts from 0
        (non-decreasing; empty sequences allowed; tokens past ``cu_seqlens_q[-1]`` get 0
        and -inf). Run-time values under ``jax.jit``.
      causal: per sequence, key j is visible to query i iff ``j <= i + (len_k - len_q)``
        (decode and chunked prefill rows included); else every key of the sequence.
      scale: None -> ``1/sqrt(D)``; any explicit value verbatim.
      max_seqlen_q, max_seqlen_k: static upper bounds on the sequence lengths (as
        FlashAttention's), rounded up to their bucket. None: the longest sequence when
        ``cu_seqlens`` is concrete, else the packed token count (always enough, but it
        sizes the padded layout ``N x T``: pass a bound under ``jax.jit``). A sequence
        longer than its bound gets NaN (run-time values cannot raise).
      return_lse: also return the fp32 natural-log lse ``[Hq, Tq]`` (FlashAttention's
        ``softmax_lse`` layout).
      backend: as :func:`jaxattn.attention`.

    Returns:
      ``out [Tq, Hq, D]`` in q's dtype, or ``(out, lse)``. Differentiable (``jax.grad``,
      through lse too); the backward is the backend's deterministic one.
    """
    be = registry.resolve("attention", backend)
    dims = validate(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, scale=scale)
    rows_q = capacity(max_seqlen_q, cu_seqlens_q, q.shape[0], "max_seqlen_q")
    rows_k = capacity(max_seqlen_k, cu_seqlens_k, k.shape[0], "max_seqlen_k")
    reason = be.unsupported(dims._replace(q_len=rows_q, kv_len=rows_k), "varlen")
    if reason is not None:
        raise ValueError(f"backend {be.name!r} cannot serve this call: {reason}")
    out, lse = forward(q, k, v, jnp.asarray(cu_seqlens_q, jnp.int32),
                       jnp.asarray(cu_seqlens_k, jnp.int32), backend=be, causal=causal,
                       scale=resolve_scale(scale, q.shape[-1]), rows_q=rows_q, rows_k=rows_k)
    return (out, lse) if return_lse else out


def guard(cu_seqlens_q, cu_seqlens_k, rows_q: int, rows_k: int, tq: int, tk: int):
    """``[Tq]`` bool, per packed query token: its sequence fits the capacities and the
    ``cu_seqlens`` are well formed (checked at run time, where values may be traced)."""
    def ok_cu(cu, total):
        return (cu[0] == 0) & jnp.all(cu[1:] >= cu[:-1]) & (cu[-1] <= total)

    lq = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    lk = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    fits = (lq <= rows_q) & (lk <= rows_k)
    t = jnp.arange(tq, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_seqlens_q, t, side="right") - 1, 0,
                   max(cu_seqlens_q.shape[0] - 2, 0))
    good = ok_cu(cu_seqlens_q, tq) & ok_cu(cu_seqlens_k, tk)
    return good & (fits[seq] if fits.shape[0] else jnp.ones((tq,), bool))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _core(q, k, v, cu_q, cu_k, be, causal, scale, rows_q, rows_k):
    """The backend's varlen forward; its gradients are the backend's ``varlen_backward``
    from the residuals (the same backward the torch bridge runs)."""
    return be.varlen_forward(q, k, v, cu_q, cu_k, causal=causal, scale=scale,
                             max_seqlen_q=rows_q, max_seqlen_k=rows_k)


def _core_fwd(q, k, v, cu_q, cu_k, be, causal, scale, rows_q, rows_k):
    out, lse = _core(q, k, v, cu_q, cu_k, be, causal, scale, rows_q, rows_k)
    return (out, lse), (q, k, v, cu_q, cu_k, out, lse)


def _core_bwd(be, causal, scale, rows_q, rows_k, res, cts):
    q, k, v, cu_q, cu_k, out, lse = res
    d_out, d_lse = cts
    dq, dk, dv = be.varlen_backward(q, k, v, cu_q, cu_k, out, lse, d_out, d_lse,
                                    causal=causal, scale=scale, max_seqlen_q=rows_q,
                                    max_seqlen_k=rows_k)
    return dq, dk, dv, None, None


_core.defvjp(_core_fwd, _core_bwd)


@functools.partial(jax.jit, static_argnums=(5, 6, 7, 8, 9))
def _varlen(q, k, v, cu_q, cu_k, be, causal, scale, rows_q, rows_k):
    tq, hq, d = q.shape
    if cu_q.shape[0] == 1 or tq == 0 or k.shape[0] == 0:  # nothing any row can see
        return jnp.zeros(q.shape, q.dtype), jnp.full((hq, tq), -jnp.inf, jnp.float32)
    out, lse = _core(q, k, v, cu_q, cu_k, be, causal, scale, rows_q, rows_k)
    ok = guard(cu_q, cu_k, rows_q, rows_k, tq, k.shape[0])
    out = jnp.where(ok[:, None, None], out, jnp.asarray(jnp.nan, out.dtype))
    lse = jnp.where(ok[:, None], lse, jnp.nan)
    return out, lse.T


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, backend, causal: bool, scale: float,
            rows_q: int, rows_k: int):
    """:func:`attention` after validation: ``(out [Tq, Hq, D], lse [Hq, Tq])`` with
    resolved arguments (a backend object, the scale, the padded layout's capacities)."""
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, backend, bool(causal), float(scale),
                   int(rows_q), int(rows_k))


@functools.partial(jax.jit, static_argnums=(9, 10, 11, 12, 13))
def _varlen_backward(q, k, v, cu_q, cu_k, out, lse, d_out, d_lse, be, causal, scale, rows_q,
                     rows_k):
    if cu_q.shape[0] == 1 or q.shape[0] == 0 or k.shape[0] == 0:
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    return be.varlen_backward(q, k, v, cu_q, cu_k, out, lse.T, d_out,
                              None if d_lse is None else d_lse.T, causal=causal, scale=scale,
                              max_seqlen_q=rows_q, max_seqlen_k=rows_k)


def backward(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, d_out, d_lse, *, backend,
             causal: bool, scale: float, rows_q: int, rows_k: int):
    """``(dq, dk, dv)`` of :func:`forward` from its residuals ``out [Tq, Hq, D]``, ``lse
    [Hq, Tq]`` and the cotangents (``d_lse`` may be None), without recomputing the
    forward: the backend's ``varlen_backward`` (the torch bridge's autograd). The same
    bits as ``jax.grad`` of :func:`attention`."""
    return _varlen_backward(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, d_out, d_lse,
                            backend, bool(causal), float(scale), int(rows_q), int(rows_k))
