"""Implementation of :mod:`torch_bridge` (conversion, caching, autograd plumbing)."""

from __future__ import annotations

import functools
import os
from typing import Any

# JAX and torch share one GPU in one process: JAX must not take 75% of the memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import jaxattn  # noqa: E402
import jaxattn.validation  # noqa: E402
from jaxattn import cp as jcp  # noqa: E402
from jaxattn import layout as jlayout  # noqa: E402
from jaxattn import platform as _jplatform  # noqa: E402
from jaxattn import registry  # noqa: E402
from jaxattn.schedule import bucket_length  # noqa: E402
from jaxattn.validation import resolve_scale  # noqa: E402

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: Counts traces of the bridge's JAX functions (a test proves repeated calls reuse them).
TRACE_COUNT = {"n": 0}
#: What each trace of a bucketed function was for: (direction, backend, causal, scale,
#: platform, q shape, k shape, whether a mask was passed).
TRACES: list[tuple] = []


# ----------------------------------------------------------------------------- transfer

_NP_DTYPES = {torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16,
              torch.float32: jnp.float32, torch.bool: jnp.bool_, torch.int32: jnp.int32,
              torch.int64: jnp.int64}


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


def to_jax(t: torch.Tensor) -> jax.Array:
    """A torch tensor as a JAX array on the tensor's device, without a copy when the
    tensor is contiguous.

    Copies (documented): a non-contiguous tensor is made contiguous first. On CUDA, JAX's
    stream waits for torch's current stream (an event, no host wait) before JAX reads it.
    """
    return _IMPORT.all(t)[0]


def _to_jax_all(*ts):
    """Several tensors of one call as JAX arrays (None stays None), ordered after torch's
    current stream by one event for all of them."""
    return _IMPORT.all(*ts)


class _Importer:
    """torch -> JAX through DLPack: what ``jax.dlpack.from_dlpack`` does, with its
    per-call Python (the device and stream lookup, a dtype canonicalisation that is a
    no-op for the bridge's dtypes) done once per torch device, and one stream ordering
    per call instead of one per tensor: a reused event recorded on torch's current
    stream, which JAX's stream waits for; the tensors are then exported without a
    synchronisation of their own (DLPack's ``stream=-1``). The first import checks the
    fast path against ``jax.dlpack.from_dlpack`` (same buffer, dtype, shape, device); if
    this jaxlib's internals differ, every import takes ``jax.dlpack.from_dlpack``."""

    def __init__(self):
        self._targets: dict[tuple[str, int], tuple] = {}
        self._fast: bool | None = None

    def target(self, device: torch.device):
        """``(jax device, JAX's stream or None, DLPack device type, torch's view of
        JAX's stream or None, a reusable event or None)`` for a torch device."""
        key = (device.type, device.index or 0)
        hit = self._targets.get(key)
        if hit is None:
            from jax._src import xla_bridge
            cuda = device.type == "cuda"
            dev_id = (device.index or torch.cuda.current_device()) if cuda else 0
            jdev = xla_bridge.get_backend("cuda" if cuda else "cpu") \
                .device_from_local_hardware_id(dev_id)
            stream = ext = event = None
            if cuda:
                stream = jdev.get_stream_for_external_ready_events()
                ext = torch.cuda.ExternalStream(stream, device=device)
                event = torch.cuda.Event()
            hit = self._targets[key] = (jdev, stream, 2 if cuda else 1, ext, event)
        return hit

    def _import_fast(self, t: torch.Tensor, stream, jdev, dl_type) -> jax.Array:
        from jax._src.lib import _jax, jaxlib_extension_version
        capsule = t.__dlpack__(stream=-1 if stream is not None else None)
        if jaxlib_extension_version >= 467:
            return _jax.dlpack_managed_tensor_to_buffer(capsule, jdev, stream, None, dl_type)
        return _jax.dlpack_managed_tensor_to_buffer(capsule, jdev, stream, None)

    def _first(self, t, stream, jdev, dl_type):
        try:
            x = self._import_fast(t, stream, jdev, dl_type)
            ref = jax.dlpack.from_dlpack(t)
            self._fast = (isinstance(x, jax.Array) and x.dtype == ref.dtype
                          and x.shape == ref.shape and x.devices() == ref.devices()
                          and x.unsafe_buffer_pointer() == ref.unsafe_buffer_pointer())
        except Exception:
            self._fast = False
        return x if self._fast else jax.dlpack.from_dlpack(t)

    def all(self, *ts):
        # Contiguous copies first: they are torch work on torch's stream that JAX reads,
        # so the event below must come after them (recorded before them, JAX's kernels
        # could read a copy's memory before the copy wrote it).
        ts = [None if t is None else t.detach().contiguous() for t in ts]
        present = [t for t in ts if t is not None]
        if not present:
            return ts
        jdev, stream, dl_type, ext, event = self.target(present[0].device)
        if event is not None:  # JAX's stream waits for everything torch queued so far
            event.record(torch.cuda.current_stream(present[0].device))
            ext.wait_event(event)
        out = []
        for t in ts:
            if t is None:
                out.append(None)
                continue
            if self._fast:
                out.append(self._import_fast(t, stream, jdev, dl_type))
            elif self._fast is None:
                out.append(self._first(t, stream, jdev, dl_type))
            else:
                out.append(jax.dlpack.from_dlpack(t))
        return out


_LENGTHS: dict[tuple, jax.Array] = {}


def _lengths(device: torch.device, sq: int, skv: int) -> jax.Array:
    """``[n_q, n_kv]`` int32 on the call's JAX device: one small transfer per distinct
    pair (the layers of one decode step share it), cached."""
    key = (device.type, device.index, sq, skv)
    x = _LENGTHS.get(key)
    if x is None:
        if len(_LENGTHS) > 256:
            _LENGTHS.clear()
        x = _LENGTHS[key] = jax.device_put(np.array([sq, skv], np.int32),
                                           _IMPORT.target(device)[0])
    return x


_IMPORT = _Importer()


def to_torch(x: jax.Array) -> torch.Tensor:
    """A JAX array as a torch tensor, without a copy and without a host wait: on CUDA,
    ``torch.from_dlpack`` passes torch's current stream, and JAX makes that stream wait
    for the array (an event). A CPU array is waited for on the host."""
    return _to_torch(x, _jplatform.normalize(next(iter(x.devices())).platform))


def _to_torch(x: jax.Array, platform: str) -> torch.Tensor:
    if platform == "cpu":
        x.block_until_ready()
    return torch.from_dlpack(x)


def _mask_u8(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Copied: bool travels as uint8 (a [B, Skv] tensor), turned back into bool in JAX."""
    return None if mask is None else mask.to(torch.uint8)


def _offsets_i32(x: torch.Tensor | None) -> torch.Tensor | None:
    """Offsets travel as int32 (copied from int64)."""
    return None if x is None else x.to(torch.int32)


def _pad(t: torch.Tensor | None, dim: int, size: int, value=0) -> torch.Tensor | None:
    """``t`` padded with ``value`` along ``dim`` to ``size`` (a copy), or ``t`` itself."""
    if t is None or t.shape[dim] == size:
        return t
    pad = [0, 0] * (t.ndim - 1 - dim) + [0, size - t.shape[dim]]
    if t.dtype == torch.bool:
        return torch.nn.functional.pad(t.to(torch.uint8), pad, value=int(value)).bool()
    return torch.nn.functional.pad(t, pad, value=value)


def _unpad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    return t if t.shape[dim] == size else t.narrow(dim, 0, size).contiguous()


# ------------------------------------------------------------------------ jax functions

def _visible(causal: bool, mask, n_q, n_kv, batch: int, skv: int):
    """Causal offsets and key mask of a call padded to its buckets: ``n_q`` queries and
    ``n_kv`` keys are real (run-time int32 scalars). A causal call keeps its bottom-right
    rule (offset ``n_kv - n_q``), under which no real row sees a padded key. A
    non-causal call is the causal call with offset ``n_kv - 1`` (every real key visible
    to every row: the battery shows a flag that hides no key changes no bit) with the
    padded keys masked, so the blocks past ``n_kv`` are skipped there too."""
    if causal:
        return jnp.full((batch,), n_kv - n_q, jnp.int32), mask
    keep = jnp.broadcast_to(jnp.arange(skv)[None, :] < n_kv, (batch, skv))
    return jnp.full((batch,), n_kv - 1, jnp.int32), keep if mask is None else keep & mask


@functools.cache
def _jax_forward(op_name: str, backend: str, causal: bool, scale: float | None,
                 cp_world_size: int, kv_chunk_size: int | None, platform: str):
    """Jitted ``(q, k, v, mask_u8, qo, ko) -> (out, lse)`` at the exact shapes, one per
    option set and platform (jax.jit then caches per shape and dtype): the reference
    backend's and the CP op's calls."""
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
def _jax_bucketed_forward(backend: str, causal: bool, scale: float | None, platform: str):
    """Jitted ``(q, k, v, mask_u8, [n_q, n_kv]) -> (out, lse)`` on inputs padded to their
    buckets (:func:`jaxattn.schedule.bucket_length`), the true lengths at run time (one
    int32 pair): one trace per bucket, not per length."""
    be = registry.backend(backend)

    def fn(q, k, v, mask, lengths):
        n_q, n_kv = lengths[0], lengths[1]
        TRACE_COUNT["n"] += 1
        TRACES.append(("forward", backend, causal, scale, platform, q.shape, k.shape,
                       mask is not None))
        m = None if mask is None else mask != 0
        jaxattn.validation.validate_inputs(q, k, v, causal=causal, scale=scale,
                                           key_padding_mask=m)
        offsets, keep = _visible(causal, m, n_q, n_kv, q.shape[0], k.shape[2])
        kw = dict(causal=True, scale=resolve_scale(scale, q.shape[-1]), causal_offsets=offsets)
        if keep is None:
            return be.forward_with_lse(q, k, v, **kw)
        return jlayout.aligned_forward(be, q, k, v, key_padding_mask=keep, **kw)
    return jax.jit(fn)


@functools.cache
def _jax_backward(op_name: str, backend: str, causal: bool, scale: float | None,
                  cp_world_size: int, kv_chunk_size: int | None, platform: str):
    """Jitted backward at the exact shapes. The attention op runs its backend's backward
    from the saved residuals (q, k, v, out, lse); the CP op takes ``jax.vjp`` of the
    jitted forward (which recomputes it)."""
    fwd = _jax_forward(op_name, backend, causal, scale, cp_world_size, kv_chunk_size, platform)
    if op_name == "attention":
        be = registry.backend(backend)

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


@functools.cache
def _jax_bucketed_backward(backend: str, causal: bool, scale: float | None,
                           platform: str):
    """The backward of :func:`_jax_bucketed_forward` from its padded residuals (padded
    query rows carry a zero cotangent and lse = +inf, so they add exact zeros)."""
    be = registry.backend(backend)

    def bwd(q, k, v, mask, lengths, out, lse, d_out, d_lse):
        n_q, n_kv = lengths[0], lengths[1]
        TRACE_COUNT["n"] += 1
        TRACES.append(("backward", backend, causal, scale, platform, q.shape, k.shape,
                       mask is not None))
        m = None if mask is None else mask != 0
        offsets, keep = _visible(causal, m, n_q, n_kv, q.shape[0], k.shape[2])
        # Not causal: the forward's causal-with-offset call has the non-causal forward's
        # bits but not its backward's (the Mosaic kernels place rows by causal
        # position), so the backward is the non-causal one with the padded keys masked.
        kw = dict(causal=causal, scale=resolve_scale(scale, q.shape[-1]),
                  causal_offsets=offsets if causal else None)
        if keep is None:
            return be.backward(q, k, v, keep, out, lse, d_out, d_lse, **kw)
        return jlayout.aligned_backward(be, q, k, v, keep, out, lse, d_out, d_lse, **kw)
    return jax.jit(bwd)


def _bucketed(op_name: str, backend: str) -> bool:
    """Calls are padded to buckets where that keeps the bits: the attention op on a
    backend that follows the schedule (tail padding is a row of its invariance matrix).
    The reference backend and the CP op run at the exact shapes."""
    return op_name == "attention" and registry.backend(backend).follows_schedule


# ------------------------------------------------------------------------ custom op

def _forward_impl(q, k, v, mask, qo, ko, op_name, backend, causal, scale, cp_world_size,
                  kv_chunk_size, need_lse=True):
    """The forward on torch tensors: ``(out, lse)`` (what both the custom op and the eager
    autograd function run); ``lse`` is None without ``need_lse`` (a call that returns
    only ``out`` and keeps no residuals: one export less, about 15 us on the H200)."""
    platform = _platform(q)
    kvcs = None if kv_chunk_size < 0 else kv_chunk_size
    with _jplatform.use(platform):
        if _bucketed(op_name, backend):
            sq, skv = q.shape[2], k.shape[2]
            bq, bkv = bucket_length(sq), bucket_length(skv)
            fn = _jax_bucketed_forward(backend, causal, scale, platform)
            out, lse = fn(*_to_jax_all(_pad(q, 2, bq), _pad(k, 2, bkv), _pad(v, 2, bkv),
                                       _mask_u8(_pad(mask, 1, bkv, False))),
                          _lengths(q.device, sq, skv))
            return (_unpad(_to_torch(out, platform), 2, sq),
                    _unpad(_to_torch(lse, platform), 2, sq) if need_lse else None)
        fn = _jax_forward(op_name, backend, causal, scale, cp_world_size, kvcs, platform)
        out, lse = fn(*_to_jax_all(q, k, v, _mask_u8(mask), _offsets_i32(qo),
                                   _offsets_i32(ko)))
        return _to_torch(out, platform), _to_torch(lse, platform) if need_lse else None


@torch.library.custom_op("jaxattn::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None, qo: torch.Tensor | None, ko: torch.Tensor | None,
                  op_name: str, backend: str, causal: bool, scale: float | None,
                  cp_world_size: int, kv_chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_impl(q, k, v, mask, qo, ko, op_name, backend, causal, scale,
                         cp_world_size, kv_chunk_size)


@_attention_op.register_fake
def _attention_fake(q, k, v, mask, qo, ko, op_name, backend, causal, scale, cp_world_size,
                    kv_chunk_size):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _backward_impl(q, k, v, mask, qo, ko, out, lse, d_out, d_lse, op_name, backend, causal,
                   scale, cp_world_size, kv_chunk_size):
    """The backward on torch tensors: ``(dq, dk, dv)``."""
    platform = _platform(q)
    kvcs = None if kv_chunk_size < 0 else kv_chunk_size
    with _jplatform.use(platform):
        if _bucketed(op_name, backend):
            sq, skv = q.shape[2], k.shape[2]
            bq, bkv = bucket_length(sq), bucket_length(skv)
            fn = _jax_bucketed_backward(backend, causal, scale, platform)
            args = _to_jax_all(_pad(q, 2, bq), _pad(k, 2, bkv), _pad(v, 2, bkv),
                               _mask_u8(_pad(mask, 1, bkv, False)), _pad(out, 2, bq),
                               _pad(lse, 2, bq, float("inf")), _pad(d_out, 2, bq),
                               _pad(d_lse, 2, bq))
            dq, dk, dv = fn(*args[:4], _lengths(q.device, sq, skv), *args[4:])
            return (_unpad(_to_torch(dq, platform), 2, sq),
                    _unpad(_to_torch(dk, platform), 2, skv),
                    _unpad(_to_torch(dv, platform), 2, skv))
        fn = _jax_backward(op_name, backend, causal, scale, cp_world_size, kvcs, platform)
        dq, dk, dv = fn(*_to_jax_all(q, k, v, _mask_u8(mask), _offsets_i32(qo),
                                     _offsets_i32(ko), out, lse, d_out, d_lse))
        return _to_torch(dq, platform), _to_torch(dk, platform), _to_torch(dv, platform)


@torch.library.custom_op("jaxattn::attention_backward", mutates_args=())
def _attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor | None, qo: torch.Tensor | None,
                           ko: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
                           d_out: torch.Tensor, d_lse: torch.Tensor, op_name: str,
                           backend: str, causal: bool, scale: float | None, cp_world_size: int,
                           kv_chunk_size: int) -> tuple[torch.Tensor, torch.Tensor,
                                                        torch.Tensor]:
    return _backward_impl(q, k, v, mask, qo, ko, out, lse, d_out, d_lse, op_name, backend,
                          causal, scale, cp_world_size, kv_chunk_size)


@_attention_backward_op.register_fake
def _attention_backward_fake(q, k, v, mask, qo, ko, out, lse, d_out, d_lse, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, qo, ko, *opts = inputs
    out, lse = output
    # Residuals: the inputs and the two outputs, all by reference (no copies).
    ctx.save_for_backward(q, k, v, mask, qo, ko, out, lse)
    ctx.opts = opts


def _gradients(ctx, d_out, d_lse, run):
    """The autograd backward both paths share: ``run`` (the backward custom op, or its
    implementation outside ``torch.compile``) on the saved residuals; gradients only for
    the inputs that need them, None for the 9 other arguments."""
    q, k, v, mask, qo, ko, out, lse = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]
    if not any(needs):
        return (None,) * 12
    if d_out is None:
        d_out = torch.zeros_like(out)
    if d_lse is None:
        d_lse = torch.zeros_like(lse)
    dq, dk, dv = run(q, k, v, mask, qo, ko, out, lse, d_out.contiguous(), d_lse.contiguous(),
                     *ctx.opts)
    grads = [g if need else None for g, need in zip((dq, dk, dv), needs, strict=True)]
    return (*grads, *([None] * 9))


def _backward(ctx, d_out, d_lse):
    return _gradients(ctx, d_out, d_lse, _attention_backward_op)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The same forward and backward outside ``torch.compile``, without the custom op's
    Python dispatch (about 100 us a call on a CPU host); ``torch.compile`` traces the
    custom op instead (:meth:`TorchOp._run`)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, qo, ko, *opts):
        out, lse = _forward_impl(q, k, v, mask, qo, ko, *opts)
        _setup_context(ctx, (q, k, v, mask, qo, ko, *opts), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        return _gradients(ctx, d_out, d_lse, _backward_impl)


# ------------------------------------------------------------------------ validation

class _Meta:
    """A tensor's shape and dtype as jaxattn's validation reads them (no conversion, and
    no values read: integer tensors such as lengths and tables stay on the device, where
    reading them would wait for the GPU)."""

    __slots__ = ("shape", "dtype")

    def __init__(self, t: torch.Tensor):
        self.shape = tuple(t.shape)
        self.dtype = _NP_DTYPES[t.dtype]

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


#: Argument signatures that passed :func:`_validate` (shapes, dtypes, option values and
#: their types): a repeated call's checks are one set lookup.
_VALID: set[tuple] = set()


def _validate(op_name: str, q, k, v, *, causal, scale, key_padding_mask,
              query_position_offsets, key_position_offsets, cp_world_size,
              kv_chunk_size) -> None:
    """Every argument checked for type and value before anything is converted; each
    error names the argument and what it got (jaxattn's own validation on the tensors'
    metadata, so the messages are the JAX op's). A signature that passed once is not
    checked again."""
    key = None
    if (query_position_offsets is None and key_position_offsets is None
            and not torch.compiler.is_compiling()
            and all(isinstance(t, torch.Tensor) for t in (q, k, v))
            and (key_padding_mask is None or isinstance(key_padding_mask, torch.Tensor))):
        key = (op_name, q.shape, q.dtype, q.device, k.shape, k.dtype, k.device, v.shape,
               v.dtype, v.device, None if key_padding_mask is None else
               (key_padding_mask.shape, key_padding_mask.dtype, key_padding_mask.device),
               type(causal), causal, type(scale), type(cp_world_size), cp_world_size,
               type(kv_chunk_size), kv_chunk_size)
        try:
            key = key + (scale,) if scale is None or hash(scale) is not None else None
        except TypeError:
            key = None
        if key is not None and key in _VALID:
            return
    _validate_all(op_name, q, k, v, causal=causal, scale=scale,
                  key_padding_mask=key_padding_mask,
                  query_position_offsets=query_position_offsets,
                  key_position_offsets=key_position_offsets, cp_world_size=cp_world_size,
                  kv_chunk_size=kv_chunk_size)
    if key is not None and len(_VALID) < 4096:
        _VALID.add(key)


def _validate_all(op_name: str, q, k, v, *, causal, scale, key_padding_mask,
                  query_position_offsets, key_position_offsets, cp_world_size,
                  kv_chunk_size) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has unsupported dtype {t.dtype}; supported: "
                            f"{', '.join(str(d) for d in _DTYPES)}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor):
            raise TypeError(f"key_padding_mask must be None or a bool torch.Tensor, got "
                            f"{type(key_padding_mask).__name__}")
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be a bool tensor (True = keep), got "
                            f"{key_padding_mask.dtype}")
    jaxattn.validation.validate_inputs(
        _Meta(q), _Meta(k), _Meta(v), causal=causal, scale=scale,
        key_padding_mask=None if key_padding_mask is None else _Meta(key_padding_mask))
    if op_name == "attention":
        if (query_position_offsets is not None or key_position_offsets is not None
                or not (_is_int(cp_world_size) and cp_world_size == 1)
                or kv_chunk_size is not None):
            raise TypeError("position offsets, cp_world_size and kv_chunk_size belong to "
                            "the 'cp_attention' op")
        return
    if not _is_int(cp_world_size) or cp_world_size < 1:
        raise (TypeError if not _is_int(cp_world_size) else ValueError)(
            f"cp_world_size must be a positive int, got {cp_world_size!r}")
    if kv_chunk_size is not None and (not _is_int(kv_chunk_size) or kv_chunk_size < 1):
        raise (TypeError if not _is_int(kv_chunk_size) else ValueError)(
            f"kv_chunk_size must be None or a positive int, got {kv_chunk_size!r}")
    b = q.shape[0]
    for name, x in (("query_position_offsets", query_position_offsets),
                    ("key_position_offsets", key_position_offsets)):
        if x is None:
            continue
        if isinstance(x, torch.Tensor):
            if x.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"{name} must be an int tensor, got {x.dtype}")
            shape = tuple(x.shape)
        elif _is_int(x):
            shape = ()
        elif isinstance(x, (list, tuple, np.ndarray)):
            arr = np.asarray(x)
            if arr.dtype.kind not in "iu":
                raise TypeError(f"{name} must hold ints, got {x!r}")
            shape = arr.shape
        else:
            raise TypeError(f"{name} must be None, an int, a sequence of ints or an int "
                            f"tensor, got {type(x).__name__}")
        if shape not in ((), (b,)):
            raise ValueError(f"{name} must be a scalar or have shape [B] = ({b},), got "
                             f"{shape}")


# ------------------------------------------------------------------------------ the op

class TorchOp:
    """A jaxattn op for torch tensors in the layout of the tensor contract.

    The device follows the inputs: CUDA tensors run on JAX's GPU, CPU tensors on JAX's
    CPU device (also on a GPU host), each through the backend chosen for that platform
    (or the one named, which must run there)."""

    def __init__(self, op_name: str, backend: str | None = None):
        self.op_name = op_name
        self._requested = backend
        self._by_platform: dict[str, str] = {}
        # Resolved once per platform: the call path stays plain Python + torch, which
        # torch.compile traces (the JAX work happens inside the custom op).
        self._backend = self._resolve(registry.current_platform())

    def _resolve(self, platform: str) -> str:
        return resolve_backend(self._by_platform, self.op_name, self._requested, platform)

    @property
    def backend(self) -> str:
        """The jaxattn backend that serves this op on JAX's platform."""
        return self._backend

    def __repr__(self) -> str:
        return f"TorchOp(op={self.op_name!r}, backend={self.backend!r})"

    def _run(self, q, k, v, *, causal=True, scale=None, key_padding_mask=None,
             query_position_offsets=None, key_position_offsets=None, cp_world_size=1,
             kv_chunk_size=None, fp32=False,
             need_lse=True) -> tuple[torch.Tensor, torch.Tensor | None]:
        _validate(self.op_name, q, k, v, causal=causal, scale=scale,
                  key_padding_mask=key_padding_mask,
                  query_position_offsets=query_position_offsets,
                  key_position_offsets=key_position_offsets, cp_world_size=cp_world_size,
                  kv_chunk_size=kv_chunk_size)
        qo = _as_offsets(query_position_offsets, q)
        ko = _as_offsets(key_position_offsets, q)
        _check_same_device({"q": q, "k": k, "v": v, "key_padding_mask": key_padding_mask,
                            "query_position_offsets": qo, "key_position_offsets": ko})
        backend = self._resolve(_platform(q))
        if fp32:
            q, k, v = q.float(), k.float(), v.float()
        args = (q, k, v, key_padding_mask, qo, ko, self.op_name, backend, bool(causal),
                None if scale is None else float(scale), int(cp_world_size),
                -1 if kv_chunk_size is None else int(kv_chunk_size))
        if torch.compiler.is_compiling():
            return _attention_op(*args)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                        or v.requires_grad):
            return _EagerAttention.apply(*args)
        return _forward_impl(*args, need_lse=need_lse)

    def forward_with_lse(self, q, k, v, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, Hq, Sq, D] q.dtype, lse [B, Hq, Sq] fp32)``; differentiable."""
        return self._run(q, k, v, **kwargs)

    def forward(self, q, k, v, **kwargs) -> torch.Tensor:
        """``out [B, Hq, Sq, D]`` in q's dtype; differentiable."""
        return self._run(q, k, v, need_lse=False, **kwargs)[0]

    __call__ = forward

    def forward_fp32(self, q, k, v, **kwargs) -> torch.Tensor:
        """Inputs upcast to fp32 (a copy), fp32 ``out``."""
        return self._run(q, k, v, fp32=True, need_lse=False, **kwargs)[0]

    def forward_fp32_with_lse(self, q, k, v, **kwargs):
        """Inputs upcast to fp32 (a copy), fp32 ``(out, lse)``."""
        return self._run(q, k, v, fp32=True, **kwargs)


def resolve_backend(cache: dict[str, str], op_name: str, requested: str | None,
                    platform: str) -> str:
    """The jaxattn backend of ``op_name`` (``requested``, or the platform's first) for
    tensors on ``platform``, remembered in ``cache`` (one per platform). Raises where
    this JAX has no devices of the tensors' platform: the bridge never copies to
    another device."""
    name = cache.get(platform)
    if name is None:
        if platform != registry.current_platform() and not _jax_has(platform):
            raise ValueError(
                f"the tensors are on {'CUDA' if platform == 'gpu' else platform} but "
                f"this JAX has no {platform!r} devices (for CUDA tensors install "
                f"jax[cuda12] or jax[cuda13]); the bridge never copies to another "
                f"device")
        with _jplatform.use(platform):
            name = registry.resolve(op_name, requested, platform).name
        cache[platform] = name
    return name


def _jax_has(platform: str) -> bool:
    try:
        return bool(jax.devices("cuda" if platform == "gpu" else platform))
    except RuntimeError:
        return False


def _as_offsets(x: Any, like: torch.Tensor) -> torch.Tensor | None:
    """Offsets as a tensor: a tensor stays as given (it must be on q's device); Python or
    NumPy integers become an int32 tensor on q's device."""
    if x is None or isinstance(x, torch.Tensor):
        return x
    return torch.as_tensor(x, dtype=torch.int32, device=like.device)
