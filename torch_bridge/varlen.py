"""Packed sequences from PyTorch: :func:`varlen_attention`, FlashAttention's
``flash_attn_varlen_func`` signature on :func:`jaxattn.varlen.attention`.

    from torch_bridge import varlen_attention
    out = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, causal=True)       # q [Tq, Hq, D], k/v [Tk, Hkv, D]

verl and OpenRLHF call ``flash_attn_varlen_func`` with these names and this layout, so the
swap is an import. Every token's output and gradients equal its sequence computed alone
by ``torch_bridge.get_op("attention")`` (and by :func:`jaxattn.attention`) in raw bits,
with the deterministic backward. Conversion only: the math is :mod:`jaxattn.varlen`.

Compiles: the packed token counts and the sequence count are padded to their buckets
(:func:`jaxattn.schedule.bucket_length`: the tokens are copied to the bucket's length, the
extra sequences are empty), and ``max_seqlen_*`` too, so a training run compiles once per
bucket, not once per batch composition.
"""

from __future__ import annotations

import functools

import torch

from jaxattn import platform as _jplatform
from jaxattn import registry
from jaxattn import varlen as jvarlen
from jaxattn.schedule import bucket_length
from jaxattn.validation import resolve_scale
from torch_bridge import bridge

__all__ = ["varlen_attention"]


def _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
           window_size, softcap, alibi_slopes, causal):
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
                    ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an int32 (or int64) tensor, got {t.dtype}")
    for name, x in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_floating_point():
            continue
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ValueError(f"{name} must be a non-negative int, got {x!r}")
    if dropout_p != 0:
        raise ValueError(f"dropout_p must be 0: jaxattn has no attention dropout (got "
                         f"{dropout_p})")
    if tuple(window_size) != (-1, -1):
        raise ValueError(f"window_size must be (-1, -1): jaxattn has no sliding window (got "
                         f"{tuple(window_size)})")
    if softcap != 0:
        raise ValueError(f"softcap must be 0: jaxattn has no logit soft-capping (got {softcap})")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes must be None: jaxattn has no ALiBi bias")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    bridge._check_same_device({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q,
                               "cu_seqlens_k": cu_seqlens_k})
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in bridge._DTYPES:
            raise TypeError(f"{name} has unsupported dtype {t.dtype}")
    jvarlen.validate(bridge._Meta(q), bridge._Meta(k), bridge._Meta(v),
                     bridge._Meta(cu_seqlens_q), bridge._Meta(cu_seqlens_k), causal=causal)


def _as_int(x) -> int:
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def _pad_tokens(t: torch.Tensor, n: int) -> torch.Tensor:
    return bridge._pad(t, 0, n)


def _pad_cu(cu: torch.Tensor, n: int) -> torch.Tensor:
    """``cu`` as int32 with ``n + 1`` entries: the last value repeated (empty sequences)."""
    cu = cu.to(torch.int32)
    if cu.shape[0] == n + 1:
        return cu
    return torch.cat([cu, cu[-1:].expand(n + 1 - cu.shape[0])])


@functools.cache
def _resolved(backend: str | None, platform: str) -> str:
    with _jplatform.use(platform):
        return registry.resolve("attention", backend, platform).name


class _Varlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, opts):
        backend, causal, scale, rows_q, rows_k, platform = opts
        tq, tk = q.shape[0], k.shape[0]
        bq, bk = bucket_length(max(tq, 1)), bucket_length(max(tk, 1))
        n = bucket_length(max(cu_q.shape[0] - 1, 1))
        be = registry.backend(backend)
        with _jplatform.use(platform):
            args = bridge._to_jax_all(_pad_tokens(q, bq), _pad_tokens(k, bk),
                                      _pad_tokens(v, bk), _pad_cu(cu_q, n), _pad_cu(cu_k, n))
            out, lse = jvarlen.forward(*args, backend=be, causal=causal, scale=scale,
                                       rows_q=rows_q, rows_k=rows_k)
            out = bridge._to_torch(out, platform)
            lse = bridge._to_torch(lse, platform)
        out = bridge._unpad(out, 0, tq)
        lse = lse[:, :tq].contiguous() if lse.shape[1] != tq else lse
        ctx.save_for_backward(q, k, v, cu_q, cu_k, out, lse)
        ctx.opts = opts
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, cu_q, cu_k, out, lse = ctx.saved_tensors
        backend, causal, scale, rows_q, rows_k, platform = ctx.opts
        if not any(ctx.needs_input_grad[:3]):
            return (None,) * 6
        tq, tk = q.shape[0], k.shape[0]
        bq, bk = bucket_length(max(tq, 1)), bucket_length(max(tk, 1))
        n = bucket_length(max(cu_q.shape[0] - 1, 1))
        d_out = torch.zeros_like(out) if d_out is None else d_out.contiguous()
        d_lse = torch.zeros_like(lse) if d_lse is None else d_lse.contiguous()
        be = registry.backend(backend)
        with _jplatform.use(platform):
            args = bridge._to_jax_all(
                _pad_tokens(q, bq), _pad_tokens(k, bk), _pad_tokens(v, bk), _pad_cu(cu_q, n),
                _pad_cu(cu_k, n), _pad_tokens(out, bq), bridge._pad(lse, 1, bq, float("inf")),
                _pad_tokens(d_out, bq), bridge._pad(d_lse, 1, bq))
            dq, dk, dv = jvarlen.backward(*args, backend=be, causal=causal, scale=scale,
                                          rows_q=rows_q, rows_k=rows_k)
            dq, dk, dv = (bridge._to_torch(x, platform) for x in (dq, dk, dv))
        grads = (bridge._unpad(dq, 0, tq), bridge._unpad(dk, 0, tk), bridge._unpad(dv, 0, tk))
        return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:3],
                                                          strict=True)), None, None, None)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     dropout_p: float = 0.0, softmax_scale: float | None = None,
                     causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                     alibi_slopes=None, deterministic: bool = False,
                     return_attn_probs: bool = False, *, backend: str | None = None):
    """``flash_attn_varlen_func`` on jaxattn: packed ``q [Tq, Hq, D]``, ``k, v [Tk, Hkv,
    D]`` (bf16, fp16 or fp32 torch tensors on one device), ``cu_seqlens_* [N + 1]`` int32,
    ``max_seqlen_*`` ints (upper bounds of the sequence lengths).

    ``causal`` defaults to False as FlashAttention's; True is the bottom-right rule per
    sequence. ``dropout_p``, ``window_size``, ``softcap`` and ``alibi_slopes`` must keep
    their defaults (ValueError otherwise); ``deterministic`` is accepted and always holds.
    Returns ``out [Tq, Hq, D]``, or with ``return_attn_probs`` FlashAttention's triple
    ``(out, softmax_lse [Hq, Tq] fp32, None)`` (no probabilities are formed).
    Differentiable: the backward is jaxattn's deterministic one, from the saved
    residuals. ``backend``: as :func:`torch_bridge.get_op`.
    """
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
           window_size, softcap, alibi_slopes, causal)
    del deterministic  # always deterministic
    platform = bridge._platform(q)
    name = _resolved(backend, platform)
    rows_q = bucket_length(max(_as_int(max_seqlen_q), 1))
    rows_k = bucket_length(max(_as_int(max_seqlen_k), 1))
    opts = (name, bool(causal), resolve_scale(softmax_scale, q.shape[-1]), rows_q, rows_k,
            platform)
    out, lse = _Varlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, opts)
    return (out, lse, None) if return_attn_probs else out
