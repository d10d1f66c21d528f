"""The ``"mosaic"`` backend: the Mosaic GPU (Hopper) forward and backward
(:mod:`jaxattn.kernels.mosaic_fwd`, :mod:`jaxattn.kernels.mosaic_bwd`) behind the
registry's ``forward_with_lse`` contract, differentiable through ``jax.custom_vjp``.

On an sm90 GPU the registry chooses it before ``"pallas"`` (issue 8): it serves every
call the ``"pallas"`` backend serves. What it serves (:func:`check_supported`, raised as
ValueError by the op otherwise):

* bf16 or fp16 inputs on the Mosaic GPU kernels (the wgmma operand types);
* fp32 inputs on the Pallas backend's kernels (Hopper's wgmma has no fp32 product, only
  tf32): every fp32 path of this backend (forward, backward, paged KV, CP) is the
  ``"pallas"`` backend's, so fp32 keeps that backend's invariance matrix, and
  ``forward_fp32`` (which upcasts) is the Pallas backend's fp32 result. The head dims
  are then the Pallas kernels' (1 to 256, zero-padded to a power of two from 16);
* bf16/fp16 head dims 1 to 256: D < 64 runs zero-padded to 64, 64 < D < 128 to 128,
  128 < D < 256 to 256. The padding adds exact zeros to every dot product, and a given
  D always runs the same padded kernel, so the invariance matrix is unaffected; the
  scale is that of the real D;
* any B, Hq, Hkv with Hq a multiple of Hkv, any Sq and Skv (padded inside the kernels;
  Sq = 0 or Skv = 0 are answered without a kernel: no rows, or rows with no visible
  key: 0 and lse = -inf), causal or not, with or without a key padding mask;
* an NVIDIA GPU of compute capability 9.0 (wgmma and TMA as sm90a has them).

Paged KV (:mod:`jaxattn.paged`): the pages are gathered into contiguous K and V and
:func:`paged_forward` runs the forward with per-sequence causal offsets (``seq_lens -
Sq``) and the keys past each sequence's length dropped, so a row's bits are those of
its contiguous call. CP (:mod:`jaxattn.cp`, ``backend="mosaic"``): :func:`cp_attention`
folds each key range's per-SPLIT partial states and runs the backward per key range.

The Mosaic modules are imported on first use, so importing jaxattn never depends on
``jax.experimental.pallas.mosaic_gpu``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.kernels import pallas_triton, pallas_triton_vjp
from jaxattn.kernels.common import pad_head_dim, padded_head_dim

#: Head dims the kernels take natively; others are zero-padded to the next one.
NATIVE_HEAD_DIMS = (64, 128, 256)
#: The dtypes of the Mosaic GPU kernels.
DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def on_pallas(dtype) -> bool:
    """Whether this backend serves a call of ``dtype`` on the Pallas backend's kernels
    (fp32: Hopper's wgmma has no fp32 product)."""
    return np.dtype(dtype) == np.dtype(jnp.float32)


def backend_for(name: str, dtype) -> str:
    """The backend whose kernels serve a call that backend ``name`` was asked for:
    ``"pallas"`` for this backend's fp32 calls (:func:`on_pallas`), else ``name``."""
    return "pallas" if name == "mosaic" and on_pallas(dtype) else name


def check_supported(head_dim: int, dtype) -> str | None:
    """Why this backend cannot serve a call of this head dim and dtype, or None."""
    if on_pallas(dtype):
        reason = pallas_triton.check_supported(head_dim)
        return None if reason is None else f"fp32 runs the Pallas kernels: {reason}"
    if np.dtype(dtype) not in DTYPES:
        return (f"dtype {np.dtype(dtype).name} is not supported by the Mosaic GPU kernels "
                f"(bf16 or fp16; fp32 on the Pallas kernels)")
    if not 1 <= head_dim <= NATIVE_HEAD_DIMS[-1]:
        return (f"head dim D={head_dim} is not supported by the Mosaic GPU kernels "
                f"(1 to {NATIVE_HEAD_DIMS[-1]})")
    return None


def unavailable_reason() -> str | None:
    """Why this process cannot run the Mosaic GPU kernels, or None."""
    platform = jax.default_backend()
    if platform not in ("gpu", "cuda"):
        return (f"the Mosaic GPU kernels need an NVIDIA Hopper GPU (sm90), the platform is "
                f"{platform!r} (their interpret-mode tests: tests/test_mosaic_*.py)")
    cc = str(getattr(jax.devices()[0], "compute_capability", ""))
    if cc != "9.0":
        return f"the Mosaic GPU kernels need compute capability 9.0 (sm90a), got {cc!r}"
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the installed JAX
        return f"jax.experimental.pallas.mosaic_gpu does not import: {e}"
    return None


def _padded_head_dim(d: int) -> int:
    return padded_head_dim(d, NATIVE_HEAD_DIMS)


def _refuse_unsupported(q) -> None:
    """Raise :func:`check_supported`'s reason (ValueError), if any."""
    reason = check_supported(q.shape[-1], q.dtype)
    if reason is not None:
        raise ValueError(reason)


def _is_empty(q, k) -> bool:
    """No rows, or rows that see no key: answered without a kernel."""
    return 0 in (*q.shape[:3], k.shape[2])


def _served(q, k, v, run):
    """The Mosaic entries' common frame: refuse what the kernels do not serve, answer
    empty calls without a kernel (0 and -inf, zero gradients), zero-pad the head dim to
    a native one, ``run(q, k, v) -> (out, lse)`` and cut the output back to D."""
    _refuse_unsupported(q)
    if on_pallas(q.dtype):
        raise ValueError("fp32 runs the Pallas kernels, not this entry (an internal error)")
    b, hq, sq, d = q.shape
    if _is_empty(q, k):
        return jnp.zeros(q.shape, q.dtype), jnp.full((b, hq, sq), -jnp.inf, jnp.float32)
    dp = _padded_head_dim(d)
    out, lse = run(*(pad_head_dim(x, dp) for x in (q, k, v)))
    return out[..., :d], lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _core(q, k, v, key_padding_mask, causal, scale, interpret, fwd_config, bwd_config):
    from jaxattn.kernels import mosaic_fwd
    return mosaic_fwd.forward(q, k, v, causal=causal, scale=scale, interpret=interpret,
                              config=fwd_config, key_padding_mask=key_padding_mask)


def _core_fwd(q, k, v, key_padding_mask, causal, scale, interpret, fwd_config, bwd_config):
    out, lse = _core(q, k, v, key_padding_mask, causal, scale, interpret, fwd_config,
                     bwd_config)
    return (out, lse), (q, k, v, key_padding_mask, out, lse)


def _core_bwd(causal, scale, interpret, fwd_config, bwd_config, residuals, cotangents):
    from jaxattn.kernels import mosaic_bwd
    q, k, v, key_padding_mask, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dk, dv = mosaic_bwd.backward(q, k, v, out, lse, d_out.astype(out.dtype), d_lse,
                                     causal=causal, scale=scale, interpret=interpret,
                                     config=bwd_config, key_padding_mask=key_padding_mask)
    return dq, dk, dv, None


_core.defvjp(_core_fwd, _core_bwd)


def attention(q, k, v, key_padding_mask=None, *, causal: bool, scale: float,
              interpret=False, fwd_config=None, bwd_config=None):
    """``(out [B, Hq, Sq, D] q.dtype, lse [B, Hq, Sq] fp32)``, differentiable (the
    Mosaic backward; dK/dV and dQ kernels). ``interpret`` and the configs are for tests
    (Mosaic GPU interpret mode on a CPU with one-warpgroup configurations). fp32: the
    Pallas backend's kernels (interpreted on a CPU)."""
    if on_pallas(q.dtype):
        _refuse_unsupported(q)
        return pallas_triton_vjp.attention(q, k, v, key_padding_mask, bool(causal),
                                           float(scale), jax.default_backend() == "cpu")
    return _served(q, k, v, lambda q, k, v: _core(
        q, k, v, key_padding_mask, bool(causal), float(scale), interpret, fwd_config,
        bwd_config))


def backward(q, k, v, key_padding_mask, out, lse, d_out, d_lse, *, causal: bool,
             scale: float, interpret=False, bwd_config=None):
    """``(dq, dk, dv)`` from the forward's residuals ``(out, lse)`` of :func:`attention`
    and the cotangents ``d_out``, ``d_lse``: the backward :func:`attention`'s custom VJP
    runs, without recomputing the forward (for callers that keep the residuals, as the
    torch bridge does), and the same bits. The head dim is zero-padded as the forward
    pads it (the forward's padded output columns are exact zeros); fp32: the Pallas
    backend's backward. Empty calls give zero gradients."""
    _refuse_unsupported(q)
    d_out = d_out.astype(out.dtype)
    if on_pallas(q.dtype):
        return pallas_triton_vjp.backward(q, k, v, key_padding_mask, out, lse, d_out, d_lse,
                                          causal=causal, scale=scale,
                                          interpret=jax.default_backend() == "cpu")
    if _is_empty(q, k):
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    from jaxattn.kernels import mosaic_bwd
    d = q.shape[-1]
    dp = _padded_head_dim(d)
    q_, k_, v_, out_, d_out_ = (pad_head_dim(x, dp) for x in (q, k, v, out, d_out))
    grads = mosaic_bwd.backward(q_, k_, v_, out_, lse, d_out_, d_lse, causal=causal,
                                scale=scale, interpret=interpret, config=bwd_config,
                                key_padding_mask=key_padding_mask)
    return tuple(g[..., :d] for g in grads)


def paged_forward(q, k, v, keep, causal_offsets, *, causal: bool, scale: float,
                  interpret=False, fwd_config=None):
    """Forward only (rollout) over contiguous ``k, v [B, Hkv, cap, D]`` gathered from a
    paged cache: ``keep [B, cap]`` drops the keys past each sequence's length (whatever
    they hold) and row i of sequence b sees key j iff ``j <= i + causal_offsets[b]``
    when causal. ``(out, lse)`` as :func:`attention`."""
    from jaxattn.kernels import mosaic_fwd
    return _served(q, k, v, lambda q, k, v: mosaic_fwd.forward(
        q, k, v, causal=bool(causal), scale=float(scale), interpret=interpret,
        config=fwd_config, key_padding_mask=keep,
        causal_offsets=causal_offsets if causal else None))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11, 12))
def _cp_core(q, k, v, mask, qo, ko, causal, scale, cp_world_size, kv_chunk_size, interpret,
             fwd_config, bwd_config):
    # Every (query shard, key range) pair's per-SPLIT partial states, folded in global
    # key order by jaxattn.cp's one ring loop.
    from jaxattn import cp
    out, lse = cp._forward_states(q, k, v, mask, qo, ko, causal=causal, scale=scale,
                                  backend="mosaic", cp_world_size=cp_world_size,
                                  kv_chunk_size=kv_chunk_size, fp32=False,
                                  interpret=interpret, mosaic_config=fwd_config)
    return out.astype(q.dtype), lse


def _cp_core_fwd(q, k, v, mask, qo, ko, causal, scale, cp_world_size, kv_chunk_size,
                 interpret, fwd_config, bwd_config):
    out, lse = _cp_core(q, k, v, mask, qo, ko, causal, scale, cp_world_size, kv_chunk_size,
                        interpret, fwd_config, bwd_config)
    return (out, lse), (q, k, v, mask, qo, ko, out, lse)


def _cp_core_bwd(causal, scale, cp_world_size, kv_chunk_size, interpret, fwd_config,
                 bwd_config, res, cts):
    """dK/dV per key range and dQ continued across the ranges in ascending order
    (:func:`mosaic_bwd.backward_over_ranges`); ranges that do not start on multiples of
    128 keys (an unaligned ``kv_chunk_size``, whose bits CP does not promise) are taken
    as one range."""
    from jaxattn import cp
    from jaxattn.kernels import mosaic_bwd
    q, k, v, mask, qo, ko, out, lse = res
    d_out, d_lse = cts
    skv = k.shape[2]
    ranges = [(a, e) for a, e in cp._ranges(skv, cp_world_size, kv_chunk_size) if e > a]
    if any(a % (2 * mosaic_bwd.BLOCK_KV) for a, _ in ranges):
        ranges = [(0, skv)]
    offsets = qo - ko if causal else jnp.zeros_like(qo)
    dq, dk, dv = mosaic_bwd.backward_over_ranges(
        q, k, v, out, lse, d_out.astype(out.dtype), d_lse, ranges=ranges, offsets=offsets,
        causal=causal, scale=scale, interpret=interpret, config=bwd_config,
        key_padding_mask=mask)
    return dq, dk, dv, None, None, None


_cp_core.defvjp(_cp_core_fwd, _cp_core_bwd)


def cp_attention(q, k, v, key_padding_mask, query_offsets, key_offsets, *, causal: bool,
                 scale: float, cp_world_size: int, kv_chunk_size=None, interpret=False,
                 fwd_config=None, bwd_config=None):
    """:mod:`jaxattn.cp`'s one-device CP over the Mosaic kernels: ``(out, lse)``,
    differentiable. ``query_offsets`` / ``key_offsets``: ``[B]`` int, global positions
    of query 0 and key 0. Equal in bits to :func:`attention` when every key range starts
    on a ``SPLIT`` boundary (the per-split partial states are the ones the forward folds
    in its kernel; dQ goes on from range to range)."""
    qo = jnp.asarray(query_offsets, jnp.int32)
    ko = jnp.asarray(key_offsets, jnp.int32)
    return _served(q, k, v, lambda q, k, v: _cp_core(
        q, k, v, key_padding_mask, qo, ko, bool(causal), float(scale), int(cp_world_size),
        kv_chunk_size, interpret, fwd_config, bwd_config))
