"""The op registry: named ops, their backends, and platform-priority dispatch.

DESIGN.md section 2. Each backend declares the platforms it runs on, the platforms
where it may be chosen automatically (with a priority), and a capability check.
Resolution looks at the platform and the declared capability only, never at shapes: a
backend that cannot serve a call raises instead of handing it to another backend, since
that would change the bits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax

from jaxattn.validation import Dims, validate_inputs

#: forward_with_lse(q, k, v, *, causal, scale, key_padding_mask) -> (out, lse)
ForwardWithLse = Callable[..., tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation of an op.

    Attributes:
      name: backend name ("reference", "pallas", ...).
      platforms: JAX platforms it can run on ("cpu", "gpu").
      priority: per platform, the rank for automatic selection (lower first); a
        platform absent here is never chosen automatically (explicit ``backend=`` only).
      forward_with_lse: the implementation, ``(q, k, v, **kw) -> (out, lse)``.
      available: ``() -> None`` when usable in this process, else the reason it is not.
      unsupported: ``(dims) -> None`` when the backend serves these shapes and dtype,
        else the reason (raised as ValueError, never silently routed elsewhere).
      description: one line for ``repr`` and reports.
    """

    name: str
    platforms: tuple[str, ...]
    priority: Mapping[str, int]
    forward_with_lse: ForwardWithLse
    available: Callable[[], str | None] = lambda: None
    unsupported: Callable[[Dims], str | None] = lambda dims: None
    description: str = ""


_REGISTRY: dict[str, dict[str, Backend]] = {}


def register(op_name: str, backend: Backend) -> None:
    """Register ``backend`` for op ``op_name`` (replacing one of the same name)."""
    _REGISTRY.setdefault(op_name, {})[backend.name] = backend


def op_names() -> tuple[str, ...]:
    """Names of the registered ops."""
    return tuple(sorted(_REGISTRY))


def backend_names(op_name: str = "attention") -> tuple[str, ...]:
    """Names of the backends registered for ``op_name``."""
    return tuple(sorted(_backends(op_name)))


def _backends(op_name: str) -> dict[str, Backend]:
    try:
        return _REGISTRY[op_name]
    except KeyError:
        raise KeyError(f"unknown op {op_name!r}; known ops: {', '.join(op_names())}") from None


def current_platform() -> str:
    """The default JAX platform: "cpu", "gpu" (CUDA or ROCm) or "tpu"."""
    platform = jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


class AttentionOp:
    """An attention op bound to one backend.

    ``op(q, k, v, ...)`` is ``op.forward``; ``forward_fp32`` upcasts the inputs to fp32
    and runs the same backend (for the reference backend that is the fp32 ground
    truth); ``forward_with_lse`` also returns the fp32 natural-log lse ``[B, Hq, Sq]``.
    """

    def __init__(self, op_name: str, backend: Backend):
        self.op_name = op_name
        self._backend = backend

    @property
    def backend(self) -> str:
        """Name of the backend that serves this op."""
        return self._backend.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(op={self.op_name!r}, backend={self.backend!r})"

    def _check(self, q, k, v, kwargs: dict[str, Any]) -> None:
        dims = validate_inputs(q, k, v, causal=kwargs.get("causal", True),
                               scale=kwargs.get("scale"),
                               key_padding_mask=kwargs.get("key_padding_mask"))
        reason = self._backend.unsupported(dims)
        if reason is not None:
            raise ValueError(f"backend {self.backend!r} cannot serve this call: {reason}")

    def forward_with_lse(self, q, k, v, *, causal: bool = True, scale: float | None = None,
                         key_padding_mask=None) -> tuple[jax.Array, jax.Array]:
        """``(out [B, Hq, Sq, D] in q.dtype, lse [B, Hq, Sq] fp32)``."""
        kw = dict(causal=causal, scale=scale, key_padding_mask=key_padding_mask)
        self._check(q, k, v, kw)
        return self._backend.forward_with_lse(q, k, v, **kw)

    def forward(self, q, k, v, *, causal: bool = True, scale: float | None = None,
                key_padding_mask=None) -> jax.Array:
        """``out [B, Hq, Sq, D]`` in ``q.dtype``."""
        return self.forward_with_lse(q, k, v, causal=causal, scale=scale,
                                     key_padding_mask=key_padding_mask)[0]

    __call__ = forward

    def forward_fp32_with_lse(self, q, k, v, *, causal: bool = True,
                              scale: float | None = None,
                              key_padding_mask=None) -> tuple[jax.Array, jax.Array]:
        """fp32 inputs, fp32 ``(out, lse)``."""
        kw = dict(causal=causal, scale=scale, key_padding_mask=key_padding_mask)
        self._check(q, k, v, kw)
        if self._backend.name == "reference":
            from jaxattn import reference
            return reference.forward_fp32_with_lse(q, k, v, **kw)
        f32 = jax.numpy.float32
        return self._backend.forward_with_lse(q.astype(f32), k.astype(f32), v.astype(f32), **kw)

    def forward_fp32(self, q, k, v, *, causal: bool = True, scale: float | None = None,
                     key_padding_mask=None) -> jax.Array:
        """fp32 inputs, fp32 ``out``."""
        return self.forward_fp32_with_lse(q, k, v, causal=causal, scale=scale,
                                          key_padding_mask=key_padding_mask)[0]


class CPAttentionOp(AttentionOp):
    """The ``"cp_attention"`` op (:mod:`jaxattn.cp`, the seed's CP reference contract)
    bound to one backend: every entry takes the attention arguments plus
    ``query_position_offsets`` / ``key_position_offsets`` (``[B]`` int, global positions
    of query 0 and key 0), ``cp_world_size`` and ``kv_chunk_size``."""

    def forward_with_lse(self, q, k, v, *, causal: bool = True, scale: float | None = None,
                         key_padding_mask=None, query_position_offsets=None,
                         key_position_offsets=None, cp_world_size: int = 1,
                         kv_chunk_size: int | None = None) -> tuple[jax.Array, jax.Array]:
        """``(out [B, Hq, Sq, D] in q.dtype, lse [B, Hq, Sq] fp32)``."""
        from jaxattn import cp
        return cp.forward_with_lse(
            q, k, v, causal=causal, scale=scale, key_padding_mask=key_padding_mask,
            query_position_offsets=query_position_offsets,
            key_position_offsets=key_position_offsets, cp_world_size=cp_world_size,
            kv_chunk_size=kv_chunk_size, backend=self.backend)

    def forward(self, q, k, v, **kwargs) -> jax.Array:
        """``out [B, Hq, Sq, D]`` in ``q.dtype``."""
        return self.forward_with_lse(q, k, v, **kwargs)[0]

    __call__ = forward

    def forward_fp32_with_lse(self, q, k, v, *, causal: bool = True,
                              scale: float | None = None, key_padding_mask=None,
                              query_position_offsets=None, key_position_offsets=None,
                              cp_world_size: int = 1,
                              kv_chunk_size: int | None = None) -> tuple[jax.Array, jax.Array]:
        """fp32 inputs, fp32 ``(out, lse)``."""
        from jaxattn import cp
        return cp.forward_fp32_with_lse(
            q, k, v, causal=causal, scale=scale, key_padding_mask=key_padding_mask,
            query_position_offsets=query_position_offsets,
            key_position_offsets=key_position_offsets, cp_world_size=cp_world_size,
            kv_chunk_size=kv_chunk_size, backend=self.backend)

    def forward_fp32(self, q, k, v, **kwargs) -> jax.Array:
        """fp32 inputs, fp32 ``out``."""
        return self.forward_fp32_with_lse(q, k, v, **kwargs)[0]


#: The op class of each op name (an op without an entry is an :class:`AttentionOp`).
OP_CLASSES: dict[str, type[AttentionOp]] = {"cp_attention": CPAttentionOp}


def resolve(op_name: str = "attention", backend: str | None = None,
            platform: str | None = None) -> Backend:
    """Pick the backend for ``op_name`` on ``platform`` (default: JAX's default).

    An explicit ``backend`` must exist, be available and run on the platform, or this
    raises; it is never replaced by another. Without one, the available backend with the
    best priority on the platform wins.
    """
    backends = _backends(op_name)
    platform = platform or current_platform()
    if backend is not None:
        if backend not in backends:
            raise ValueError(f"unknown backend {backend!r} for op {op_name!r}; "
                             f"registered: {', '.join(sorted(backends))}")
        chosen = backends[backend]
        if platform not in chosen.platforms:
            raise ValueError(f"backend {backend!r} does not run on platform {platform!r} "
                             f"(runs on: {', '.join(chosen.platforms)})")
        reason = chosen.available()
        if reason is not None:
            raise RuntimeError(f"backend {backend!r} is unavailable: {reason}")
        return chosen
    candidates = sorted((b.priority[platform], b.name) for b in backends.values()
                        if platform in b.priority and b.available() is None)
    if not candidates:
        raise RuntimeError(f"no backend of op {op_name!r} is available on {platform!r}")
    return backends[candidates[0][1]]


def get_op(name: str = "attention", *, backend: str | None = None,
           platform: str | None = None) -> AttentionOp:
    """The op ``name`` bound to a backend chosen by platform priority (or ``backend``).

    On a GPU: the Mosaic GPU kernels where available (sm90), then the Pallas kernels,
    then the reference. On a CPU: the reference
    (``backend="pallas"`` runs the kernels in interpret mode, for tests). Ops:
    ``"attention"`` (:class:`AttentionOp`) and ``"cp_attention"`` (:class:`CPAttentionOp`,
    the same entries with the CP arguments of :mod:`jaxattn.cp`).
    """
    return OP_CLASSES.get(name, AttentionOp)(name, resolve(name, backend, platform))
