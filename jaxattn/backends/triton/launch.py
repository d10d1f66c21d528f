"""The raw Triton backend: the kernels of :mod:`jaxattn.backends.triton.kernels` called
from JAX, and the ``jax.custom_vjp`` that ties forward and backward together.

On a GPU the kernels launch through ``jax_triton.triton_call`` (compiled by the ``triton``
package, not by XLA's copy of Triton as the Pallas kernels are). On a CPU they run in
Triton's interpreter (NumPy) on CPU torch tensors, called through ``jax.pure_callback``
with declared output shapes, so ``backend="triton"`` and its gradient work under
``jax.jit`` on a CPU exactly as ``backend="pallas"`` does in interpret mode. The
interpreter is for tests: it is slow, and it runs one launch at a time.

Launch shapes and tiles are those of the Pallas backend (:func:`pallas_triton.forward_config`,
:func:`pallas_triton_vjp.backward_config`) and every kernel follows the same schedule, so
the two backends run the same floating-point operations per row; whether they also give
the same bits depends on the two Triton compilers (see docs/kernels.md).

Optional dependencies: ``triton`` (both places), ``jax-triton`` (GPU), ``torch`` (CPU
interpreter). None of them is imported until a kernel runs; :func:`unavailable_reason`
says what is missing.
"""

from __future__ import annotations

import functools
import importlib.util
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import platform as _platform
from jaxattn import schedule
from jaxattn.backends.common import (
    LOG2E,
    NEG_INF,
    head_dim_reason,
    next_pow2,
    pad_head_dim,
    padded_head_dim,
)
from jaxattn.backends.pallas import backward as pv
from jaxattn.backends.pallas import forward as pt

#: Let the compiler contract a multiply and an add into an FMA (Triton's default, and
#: jax-triton's) or not. Off: on the H200 (2026-11-29, JAX 0.11.2, triton 3.6,
#: jax-triton 0.3.1; tests/test_triton.py::test_bits_beside_the_pallas_backend, bf16
#: B=2 Hq=8 Hkv=2 S=300 D=128) the kernels then gave the Pallas backend's bits exactly
#: (out, lse, dQ, dK, dV; causal and not), which XLA's Triton pipeline compiles without
#: contraction; with it on, up to 1151 of 4800 lse values differed in the last bits.
ENABLE_FP_FUSION = False

#: The interpreter keeps global state (grid position, patched ``triton.language``): one
#: launch at a time, whatever thread XLA runs a callback on.
_INTERPRETER_LOCK = threading.Lock()


def check_supported(head_dim: int) -> str | None:
    """Why these kernels cannot serve a head dim, or None (any D from 1 to 256, run
    zero-padded to the next of ``KERNEL_HEAD_DIMS`` as the Pallas kernels run it)."""
    return head_dim_reason(head_dim, "the Triton kernels")


def unavailable_reason(platform: str) -> str | None:
    """What this process lacks to run the kernels on ``platform`` ("gpu" or "cpu").

    Looks the packages up without importing them: the registry asks on every automatic
    resolution, and importing jax_triton has side effects (it clears
    ``TRITON_CACHE_DIR`` for the process), so that waits for the first launch.
    """
    install = "pip install 'jaxattn[triton]'"
    if importlib.util.find_spec("triton") is None:
        return f"the raw Triton backend needs the triton package ({install})"
    if platform == "cpu":
        if importlib.util.find_spec("torch") is None:
            return "on a CPU the raw Triton backend runs Triton's interpreter, which needs torch"
        return None
    if importlib.util.find_spec("jax_triton") is None:
        return f"the raw Triton backend needs jax-triton on a GPU ({install})"
    return None


def _interpret() -> bool:
    return _platform.current() == "cpu"


# -------------------------------------------------------------------------- launching

def _torch_dtype(dtype):
    import torch
    return {np.dtype(jnp.bfloat16): torch.bfloat16, np.dtype(jnp.float16): torch.float16,
            np.dtype(jnp.float32): torch.float32, np.dtype(jnp.int32): torch.int32}[
                np.dtype(dtype)]


def _to_torch(x: np.ndarray):
    """A CPU torch tensor holding a copy of ``x`` (the interpreter writes every tensor
    argument back after a launch, so JAX's buffers are never handed to it)."""
    import torch
    x = np.asarray(x)
    if x.dtype == np.dtype(jnp.bfloat16):  # NumPy's bf16 (ml_dtypes) is unknown to torch
        return torch.from_numpy(np.array(x.view(np.int16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(x))


def _to_numpy(t, dtype) -> np.ndarray:
    import torch
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jnp.bfloat16)
    return t.numpy().astype(dtype, copy=False)


def _launch(name: str, grid: tuple[int, ...], inputs, scalars, out_shapes, *,
            num_warps: int, num_stages: int, interpret: bool, fp_fusion: bool,
            **constexprs):
    """Run kernel ``name`` of :mod:`triton_kernels` on ``grid``.

    The kernel's arguments are ``*inputs`` (arrays), ``*scalars`` (Python ints/floats),
    then one pointer per output (jax-triton appends them after the positional
    arguments), then ``constexprs`` by name. Returns the outputs, a list.
    """
    from jaxattn.backends.triton import kernels as tk

    constexprs = dict(constexprs, INTERPRET=interpret)
    if not interpret:
        import jax_triton as jt
        # jax-triton types a Python float as fp64 (Triton's own launcher, and so the
        # interpreter, as fp32): hand it fp32 so the kernels compute what they say.
        scalars = [np.float32(x) if isinstance(x, float) else x for x in scalars]
        outs = jt.triton_call(*inputs, *scalars, kernel=getattr(tk, name),
                              out_shape=out_shapes, grid=grid, num_warps=num_warps,
                              num_stages=num_stages, enable_fp_fusion=fp_fusion,
                              name=f"jaxattn_triton_{name}", **constexprs)
        return list(outs)

    kernel = getattr(tk.interpreted(), name)

    def host(*arrays):
        import torch
        with _INTERPRETER_LOCK:
            args = [_to_torch(a) for a in arrays]
            outs = [torch.zeros(s.shape, dtype=_torch_dtype(s.dtype)) for s in out_shapes]
            kernel[grid](*args, *scalars, *outs, **constexprs)
            return tuple(_to_numpy(o, s.dtype) for o, s in zip(outs, out_shapes, strict=True))

    return list(jax.pure_callback(host, tuple(out_shapes), *inputs))


def _schedule_constexprs(dtype) -> dict:
    """The schedule's constants (read when traced, so a patched schedule is honoured)."""
    return dict(BLOCK_N=schedule.BLOCK_N, BLOCKS_PER_SPLIT=schedule.BLOCKS_PER_SPLIT,
                EXP2=schedule.SOFTMAX_EXP_BASE == "2", ROWSUM_MMA=schedule.ROWSUM == "mma",
                IEEE=bool(jnp.dtype(dtype) == jnp.float32))


def _optional_operands(key_padding_mask, causal_offsets, b, causal):
    """The mask and offsets operands (an unread 1-element stand-in when absent: a
    kernel's signature does not change with them) and their flags."""
    has_mask = key_padding_mask is not None
    has_offsets = causal and causal_offsets is not None
    dummy = jnp.zeros((1,), jnp.int32)
    mask = key_padding_mask.astype(jnp.int32) if has_mask else dummy
    offsets = jnp.asarray(causal_offsets, jnp.int32).reshape(b) if has_offsets else dummy
    return mask, offsets, dict(HAS_MASK=has_mask, HAS_OFFSETS=has_offsets)


def _whole_blocks(flag: bool | None) -> bool:
    # The interpreter's dot is a NumPy matmul whatever the masking around it, so unlike
    # Pallas interpret mode (XLA:CPU) the whole-block fast path keeps the bits there too.
    return True if flag is None else bool(flag)


# --------------------------------------------------------------------------- forward

@functools.partial(jax.jit, static_argnames=("causal", "scale", "path", "config",
                                             "enable_fp_fusion"))
def forward(q, k, v, key_padding_mask=None, causal_offsets=None, *, causal: bool,
            scale: float, path: str | None = None, config: pt.ForwardConfig | None = None,
            enable_fp_fusion: bool | None = None):
    """Attention forward on the canonical schedule, in raw Triton.

    Args:
      q: ``[B, Hq, Sq, D]``; k, v: ``[B, Hkv, Skv, D]``; key_padding_mask: ``[B, Skv]``
        bool or None; scale: the resolved scale.
      causal_offsets: ``[B]`` int or None: position of query 0 minus position of key 0
        per sequence (default ``Skv - Sq``); key j is visible to query i iff
        ``j <= i + offset``.
      path: ``None`` (choose by row parallelism, as the Pallas backend does),
        ``"prefill"`` or ``"split"``; every choice gives the same bits.
      config: launch parameters (default :func:`pallas_triton.forward_config`, the Pallas
        backend's); they never change the bits.
      enable_fp_fusion: FMA contraction (default :data:`ENABLE_FP_FUSION`).

    Returns:
      ``(out [B, Hq, Sq, D] q.dtype, lse [B, Hq, Sq] fp32)``.
    """
    d = q.shape[-1]
    dp = padded_head_dim(d)
    out, lse = _forward(*(pad_head_dim(x, dp) for x in (q, k, v)), key_padding_mask,
                        causal_offsets, causal=causal, scale=scale, path=path, config=config,
                        enable_fp_fusion=enable_fp_fusion, partials=False)
    return out[..., :d], lse


@functools.partial(jax.jit, static_argnames=("causal", "scale", "config", "enable_fp_fusion"))
def split_partials(q, k, v, key_padding_mask=None, causal_offsets=None, *, causal: bool,
                   scale: float, config: pt.ForwardConfig | None = None,
                   enable_fp_fusion: bool | None = None):
    """Per-split partial states ``(out [B, Hkv, n_splits, g*Sq, D], lse [..., g*Sq])``,
    fp32, in ascending split order: the split-parallel path without its combine (as
    :func:`pallas_triton.split_partials`)."""
    d = q.shape[-1]
    dp = padded_head_dim(d)
    out, lse = _forward(*(pad_head_dim(x, dp) for x in (q, k, v)), key_padding_mask,
                        causal_offsets, causal=causal, scale=scale, path="split",
                        config=config, enable_fp_fusion=enable_fp_fusion, partials=True)
    return out[..., :d], lse


def _forward(q, k, v, key_padding_mask, causal_offsets, *, causal, scale, path, config,
             enable_fp_fusion, partials):
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    g = hq // hkv
    rows = g * sq
    n_splits = schedule.num_splits(skv)
    if sq == 0 or skv == 0:
        if partials:
            return (jnp.zeros((b, hkv, n_splits, rows, d), jnp.float32),
                    jnp.full((b, hkv, n_splits, rows), NEG_INF, jnp.float32))
        return jnp.zeros(q.shape, q.dtype), jnp.full((b, hq, sq), NEG_INF, jnp.float32)
    cfg = config or pt.forward_config(d)
    fusion = ENABLE_FP_FUSION if enable_fp_fusion is None else enable_fp_fusion
    if path is None:
        tiles = -(-rows // cfg.block_m)
        path = "split" if n_splits > 1 and tiles * b * hkv < cfg.split_parallel_below \
            else "prefill"
    if path not in ("prefill", "split"):
        raise ValueError(f"path must be None, 'prefill' or 'split', got {path!r}")
    mask, offsets, flags = _optional_operands(key_padding_mask, causal_offsets, b, causal)
    static = dict(GROUP=g, HEAD_DIM=d, CAUSAL=bool(causal),
                  WHOLE_BLOCKS=_whole_blocks(cfg.whole_blocks), **flags,
                  **_schedule_constexprs(q.dtype))
    run_scale = float(scale) * LOG2E if static["EXP2"] else float(scale)
    inputs = [q.reshape(b, hkv, rows, d), k, v, mask, offsets]
    out_shapes = [jax.ShapeDtypeStruct((b, hkv, rows, d), q.dtype),
                  jax.ShapeDtypeStruct((b, hkv, rows), jnp.float32)]
    launch = functools.partial(_launch, interpret=_interpret(), fp_fusion=fusion)

    if path == "prefill":
        bm = cfg.block_m
        out, lse = launch("fwd_prefill_kernel", (-(-rows // bm), b, hkv), inputs,
                          [run_scale, sq, skv], out_shapes, num_warps=cfg.num_warps,
                          num_stages=cfg.num_stages, BLOCK_M=bm, **static)
        return out.reshape(b, hq, sq, d), lse.reshape(b, hq, sq)

    bm = min(cfg.block_m, max(16, next_pow2(rows)))
    tiles = -(-rows // bm)
    warps, stages = ((cfg.decode_num_warps, cfg.decode_num_stages) if bm <= 32
                     else (cfg.num_warps, cfg.num_stages))
    o_parts, lse_parts = launch(
        "fwd_split_kernel", (tiles * n_splits, b, hkv), inputs, [run_scale, sq, skv, n_splits],
        [jax.ShapeDtypeStruct((b, hkv, n_splits, rows, d), jnp.float32),
         jax.ShapeDtypeStruct((b, hkv, n_splits, rows), jnp.float32)],
        num_warps=warps, num_stages=stages, BLOCK_M=bm, **static)
    if partials:
        return o_parts, lse_parts
    out, lse = launch("fwd_combine_kernel", (tiles, b, hkv), [o_parts, lse_parts],
                      [rows, n_splits], out_shapes, num_warps=warps, num_stages=1,
                      HEAD_DIM=d, BLOCK_M=bm)
    return out.reshape(b, hq, sq, d), lse.reshape(b, hq, sq)


# -------------------------------------------------------------------------- backward

@functools.partial(jax.jit, static_argnames=("causal", "scale", "config", "enable_fp_fusion"))
def backward(q, k, v, key_padding_mask, out, lse, d_out, d_lse, causal_offsets=None, *,
             causal: bool, scale: float, config: pv.BackwardConfig | None = None,
             enable_fp_fusion: bool | None = None):
    """Gradients ``(dq, dk, dv)`` of :func:`forward`, given cotangents of out and lse.

    The Pallas backward's tiles (:func:`pallas_triton_vjp.backward_config`) set the
    accumulation order: dK/dV over query blocks of ``block_q`` rows, dQ over KV blocks
    of ``block_kv`` keys. Any head dim: the kernels run zero-padded as the forward's.
    """
    d_real = q.shape[-1]
    dp = padded_head_dim(d_real)
    q, k, v, out, d_out = (pad_head_dim(x, dp) for x in (q, k, v, out, d_out))
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    if sq == 0 or skv == 0:
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    cfg = config or pv.backward_config(d)
    interpret = _interpret()
    fusion = ENABLE_FP_FUSION if enable_fp_fusion is None else enable_fp_fusion
    launch = functools.partial(_launch, interpret=interpret, fp_fusion=fusion,
                               num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    d_out = d_out.astype(q.dtype)
    d_lse = (jnp.zeros((b, hq, sq), jnp.float32) if d_lse is None
             else d_lse.astype(jnp.float32))
    (delta,) = launch("bwd_delta_kernel", (-(-sq // cfg.delta_block), b, hq),
                      [out, d_out, d_lse], [sq], [jax.ShapeDtypeStruct((b, hq, sq),
                                                                       jnp.float32)],
                      HEAD_DIM=d, BLOCK=cfg.delta_block)
    mask, offsets, flags = _optional_operands(key_padding_mask, causal_offsets, b, causal)
    static = dict(GROUP=hq // hkv, HEAD_DIM=d, BLOCK_Q=cfg.block_q, BLOCK_KV=cfg.block_kv,
                  CAUSAL=bool(causal), WHOLE_BLOCKS=_whole_blocks(cfg.whole_blocks),
                  IEEE=bool(jnp.dtype(q.dtype) == jnp.float32), **flags)
    inputs = [q, k, v, d_out, lse, delta, mask, offsets]
    scalars = [float(scale), sq, skv]
    dk, dv = launch("bwd_dkdv_kernel", (-(-skv // cfg.block_kv), b, hkv), inputs, scalars,
                    [jax.ShapeDtypeStruct(k.shape, k.dtype),
                     jax.ShapeDtypeStruct(v.shape, v.dtype)], **static)
    (acc,) = launch("bwd_dq_kernel", (-(-sq // cfg.block_q), b, hq), inputs, scalars,
                    [jax.ShapeDtypeStruct(q.shape, jnp.float32)], **static)
    return ((acc * scale).astype(q.dtype)[..., :d_real], dk[..., :d_real],
            dv[..., :d_real])


# ------------------------------------------------------------------------ custom VJP

@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def attention(q, k, v, key_padding_mask, causal_offsets, causal: bool, scale: float):
    """``(out, lse)`` through the Triton forward, differentiable by the Triton backward.
    ``causal_offsets``: ``[B]`` int or None (see :func:`forward`)."""
    return forward(q, k, v, key_padding_mask, causal_offsets, causal=causal, scale=scale)


def _attention_fwd(q, k, v, key_padding_mask, causal_offsets, causal, scale):
    out, lse = forward(q, k, v, key_padding_mask, causal_offsets, causal=causal, scale=scale)
    return (out, lse), (q, k, v, key_padding_mask, causal_offsets, out, lse)


def _attention_bwd(causal, scale, residuals, cotangents):
    q, k, v, key_padding_mask, causal_offsets, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dk, dv = backward(q, k, v, key_padding_mask, out, lse, d_out.astype(out.dtype),
                          d_lse, causal_offsets, causal=causal, scale=scale)
    return dq, dk, dv, None, None


attention.defvjp(_attention_fwd, _attention_bwd)
