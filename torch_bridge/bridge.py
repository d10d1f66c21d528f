"""Implementation of :mod:`torch_bridge` (conversion, caching, autograd plumbing)."""

from __future__ import annotations

import functools
import os
from typing import Any

# JAX and torch share one GPU in one process: JAX must not take 75% of the memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import jaxattn  # noqa: E402
from jaxattn import cp as jcp  # noqa: E402
from jaxattn import registry  # noqa: E402
from jaxattn.validation import resolve_scale  # noqa: E402

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_OPS = ("attention", "cp_attention")

#: Counts traces of the bridge's JAX functions (a test proves repeated calls reuse them).
TRACE_COUNT = {"n": 0}


def op_names() -> tuple[str, ...]:
    return _OPS


# ----------------------------------------------------------------------------- transfer

def _platform(t: torch.Tensor) -> str:
    if t.device.type == "cuda":
        return "gpu"
    if t.device.type == "cpu":
        return "cpu"
    raise ValueError(f"unsupported device {t.device}; jaxattn's torch bridge takes CPU or "
                     f"CUDA tensors")


def _check_same_device(named: dict[str, torch.Tensor | None]) -> torch.device:
    """All tensors on one device (plain Python on tensor metadata: torch.compile traces it)."""
    tensors = {k: t for k, t in named.items() if t is not None}
    devices = {str(t.device) for t in tensors.values()}
    if len(devices) != 1:
        got = ", ".join(f"{k} on {t.device}" for k, t in tensors.items())
        raise ValueError(f"all tensors must be on one device, got {got}")
    return next(iter(tensors.values())).device


def _check_platform(t: torch.Tensor) -> None:
    """The tensors' device type is JAX's platform: the bridge never copies across."""
    jax_platform = registry.current_platform()
    if _platform(t) != jax_platform:
        raise ValueError(f"tensors are on {t.device} but JAX runs on {jax_platform!r}: the "
                         f"bridge never copies to another device; move the tensors or run "
                         f"JAX on that platform")


def to_jax(t: torch.Tensor) -> jax.Array:
    """A torch tensor as a JAX array, without a copy when the tensor is contiguous.

    Copies (documented): a non-contiguous tensor is made contiguous first. On CUDA the
    DLPack exchange passes JAX's stream, and torch makes it wait for its current stream.
    """
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return jax.dlpack.from_dlpack(t)


def to_torch(x: jax.Array) -> torch.Tensor:
    """A JAX array as a torch tensor, without a copy. Waits for the array first, so torch
    work on any stream reads finished data."""
    x.block_until_ready()
    return torch.from_dlpack(x)


def _mask_to_jax(mask: torch.Tensor | None) -> jax.Array | None:
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must be a bool tensor (True = keep), got {mask.dtype}")
    # Copied: bool travels as uint8 (a [B, Skv] tensor), turned back into bool in JAX.
    return to_jax(mask.to(torch.uint8))


def _offsets_to_jax(x) -> jax.Array | None:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        if x.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"position offsets must be an int tensor, got {x.dtype}")
        return to_jax(x.to(torch.int32))  # copied: int64 -> int32
    return jnp.asarray(x, jnp.int32)


# ------------------------------------------------------------------------ jax functions

@functools.cache
def _jax_forward(op_name: str, backend: str, causal: bool, scale: float | None,
                 cp_world_size: int, kv_chunk_size: int | None):
    """Jitted ``(q, k, v, mask_u8, qo, ko) -> (out, lse)``, one per option set (jax.jit
    then caches per shape and dtype)."""
    def fn(q, k, v, mask, qo, ko):
        TRACE_COUNT["n"] += 1
        m = None if mask is None else mask != 0
        if op_name == "attention":
            return jaxattn.get_op("attention", backend=backend).forward_with_lse(
                q, k, v, causal=causal, scale=scale, key_padding_mask=m)
        return jcp.forward_with_lse(q, k, v, causal=causal, scale=scale, key_padding_mask=m,
                                    query_position_offsets=qo, key_position_offsets=ko,
                                    cp_world_size=cp_world_size, kv_chunk_size=kv_chunk_size,
                                    backend=backend)
    return jax.jit(fn)


@functools.cache
def _jax_backward(op_name: str, backend: str, causal: bool, scale: float | None,
                  cp_world_size: int, kv_chunk_size: int | None):
    """Jitted backward. The attention op runs its backend's backward from the saved
    residuals (q, k, v, out, lse): for the kernel backends the same function their
    ``jax.custom_vjp`` calls, with no recomputed forward. The CP op takes ``jax.vjp``
    of the jitted forward (which recomputes it)."""
    fwd = _jax_forward(op_name, backend, causal, scale, cp_world_size, kv_chunk_size)
    if op_name == "attention":
        be = registry.resolve("attention", backend)

        def bwd(q, k, v, mask, qo, ko, out, lse, d_out, d_lse):
            TRACE_COUNT["n"] += 1
            m = None if mask is None else mask != 0
            return be.backward(q, k, v, m, out, lse, d_out, d_lse, causal=causal,
                               scale=resolve_scale(scale, q.shape[-1]))
    else:
        def bwd(q, k, v, mask, qo, ko, out, lse, d_out, d_lse):
            TRACE_COUNT["n"] += 1
            _, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, mask, qo, ko), q, k, v)
            return vjp((d_out.astype(out.dtype), d_lse))
    return jax.jit(bwd)


# ------------------------------------------------------------------------ custom op

def _options(causal: bool, scale: float | None, cp_world_size: int,
             kv_chunk_size: int | None):
    return (bool(causal), None if scale is None else float(scale), int(cp_world_size),
            None if kv_chunk_size is None or kv_chunk_size < 0 else int(kv_chunk_size))


@torch.library.custom_op("jaxattn::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None, qo: torch.Tensor | None, ko: torch.Tensor | None,
                  op_name: str, backend: str, causal: bool, scale: float | None,
                  cp_world_size: int, kv_chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_platform(q)
    opts = _options(causal, scale, cp_world_size, kv_chunk_size)
    fn = _jax_forward(op_name, backend, *opts)
    out, lse = fn(to_jax(q), to_jax(k), to_jax(v), _mask_to_jax(mask), _offsets_to_jax(qo),
                  _offsets_to_jax(ko))
    return to_torch(out), to_torch(lse)


@_attention_op.register_fake
def _attention_fake(q, k, v, mask, qo, ko, op_name, backend, causal, scale, cp_world_size,
                    kv_chunk_size):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("jaxattn::attention_backward", mutates_args=())
def _attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor | None, qo: torch.Tensor | None,
                           ko: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
                           d_out: torch.Tensor, d_lse: torch.Tensor, op_name: str,
                           backend: str, causal: bool, scale: float | None, cp_world_size: int,
                           kv_chunk_size: int) -> tuple[torch.Tensor, torch.Tensor,
                                                        torch.Tensor]:
    opts = _options(causal, scale, cp_world_size, kv_chunk_size)
    fn = _jax_backward(op_name, backend, *opts)
    dq, dk, dv = fn(to_jax(q), to_jax(k), to_jax(v), _mask_to_jax(mask), _offsets_to_jax(qo),
                    _offsets_to_jax(ko), to_jax(out), to_jax(lse), to_jax(d_out),
                    to_jax(d_lse))
    return to_torch(dq), to_torch(dk), to_torch(dv)


@_attention_backward_op.register_fake
def _attention_backward_fake(q, k, v, mask, qo, ko, out, lse, d_out, d_lse, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, qo, ko, *opts = inputs
    out, lse = output
    # Residuals: the inputs and the two outputs, all by reference (no copies).
    ctx.save_for_backward(q, k, v, mask, qo, ko, out, lse)
    ctx.opts = opts


def _backward(ctx, d_out, d_lse):
    q, k, v, mask, qo, ko, out, lse = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]
    if not any(needs):
        return (None,) * 12
    if d_out is None:
        d_out = torch.zeros_like(out)
    if d_lse is None:
        d_lse = torch.zeros_like(lse)
    dq, dk, dv = _attention_backward_op(q, k, v, mask, qo, ko, out, lse,
                                        d_out.contiguous(), d_lse.contiguous(), *ctx.opts)
    grads = [g if need else None for g, need in zip((dq, dk, dv), needs, strict=True)]
    return (*grads, *([None] * 9))


_attention_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------ the op

class TorchOp:
    """A jaxattn op for torch tensors in the layout of the tensor contract."""

    def __init__(self, op_name: str, backend: str | None = None):
        self.op_name = op_name
        # Resolved once, here: the call path stays plain Python + torch, which
        # torch.compile traces (the JAX work happens inside the custom op).
        self._backend = registry.resolve(op_name, backend).name

    @property
    def backend(self) -> str:
        """The jaxattn backend that serves this op on JAX's platform."""
        return self._backend

    def __repr__(self) -> str:
        return f"TorchOp(op={self.op_name!r}, backend={self.backend!r})"

    def _run(self, q, k, v, *, causal=True, scale=None, key_padding_mask=None,
             query_position_offsets=None, key_position_offsets=None, cp_world_size=1,
             kv_chunk_size=None, fp32=False) -> tuple[torch.Tensor, torch.Tensor]:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in _DTYPES:
                raise TypeError(f"{name} has unsupported dtype {t.dtype}; supported: "
                                f"{', '.join(str(d) for d in _DTYPES)}")
        if self.op_name == "attention" and (query_position_offsets is not None or
                                            key_position_offsets is not None or
                                            cp_world_size != 1 or kv_chunk_size is not None):
            raise TypeError("position offsets, cp_world_size and kv_chunk_size belong to "
                            "the 'cp_attention' op")
        qo = _as_offsets(query_position_offsets, q)
        ko = _as_offsets(key_position_offsets, q)
        _check_same_device({"q": q, "k": k, "v": v, "key_padding_mask": key_padding_mask,
                            "query_position_offsets": qo, "key_position_offsets": ko})
        if fp32:
            q, k, v = q.float(), k.float(), v.float()
        # Devices, shapes and dtypes are checked inside the op (jaxattn's one validation).
        return _attention_op(q, k, v, key_padding_mask, qo, ko, self.op_name, self.backend,
                             bool(causal), None if scale is None else float(scale),
                             int(cp_world_size), -1 if kv_chunk_size is None
                             else int(kv_chunk_size))

    def forward_with_lse(self, q, k, v, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, Hq, Sq, D] q.dtype, lse [B, Hq, Sq] fp32)``; differentiable."""
        return self._run(q, k, v, **kwargs)

    def forward(self, q, k, v, **kwargs) -> torch.Tensor:
        """``out [B, Hq, Sq, D]`` in q's dtype; differentiable."""
        return self._run(q, k, v, **kwargs)[0]

    __call__ = forward

    def forward_fp32(self, q, k, v, **kwargs) -> torch.Tensor:
        """Inputs upcast to fp32 (a copy), fp32 ``out``."""
        return self._run(q, k, v, fp32=True, **kwargs)[0]

    def forward_fp32_with_lse(self, q, k, v, **kwargs):
        """Inputs upcast to fp32 (a copy), fp32 ``(out, lse)``."""
        return self._run(q, k, v, fp32=True, **kwargs)


def _as_offsets(x: Any, like: torch.Tensor) -> torch.Tensor | None:
    """Offsets as a tensor: a tensor stays as given (it must be on q's device); Python or
    NumPy integers become an int32 tensor on q's device."""
    if x is None or isinstance(x, torch.Tensor):
        return x
    return torch.as_tensor(x, dtype=torch.int32, device=like.device)


def get_op(name: str = "attention", *, backend: str | None = None) -> TorchOp:
    """The op ``name`` ("attention" or "cp_attention") for torch tensors.

    Raises:
      KeyError: an unknown name (the message lists the known ones).
    """
    if name not in _OPS:
        raise KeyError(f"unknown op {name!r}; known ops: {', '.join(_OPS)}")
    return TorchOp(name, backend)
