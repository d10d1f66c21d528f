"""The op registry: named ops, the backends that serve them, platform-priority dispatch.

DESIGN.md section 2. One table of backends (:class:`jaxattn.backends.base.Backend`
objects, one per name) serves every op; an op names the path it needs ("attention" for
``"attention"``, "cp" for ``"cp_attention"``), and a backend serves the op when its
declared ``paths`` hold that path. Resolution looks at the platform, the availability and
the declared paths only, never at shapes: a backend that cannot serve a call raises
instead of handing it to another backend, since that would change the bits.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxattn import layout
from jaxattn import platform as _platform
from jaxattn.backends import builtin
from jaxattn.backends.base import Backend, FunctionBackend
from jaxattn.validation import resolve_scale, validate_inputs

__all__ = ["AttentionOp", "Backend", "FunctionBackend", "backend",
           "backend_names", "current_platform", "get_op", "op_names", "register", "resolve",
           "register_op", "unregister"]

_BACKENDS: dict[str, Backend] = {}


def register(be: Backend) -> None:
    """Register ``be`` (replacing a backend of the same name)."""
    if not isinstance(be, Backend):
        raise TypeError(f"register takes a jaxattn.backends.base.Backend, got "
                        f"{type(be).__name__}")
    _BACKENDS[be.name] = be


def unregister(name: str) -> None:
    """Remove the backend ``name`` (tests that register a stand-in)."""
    _BACKENDS.pop(name, None)


def backend(name: str) -> Backend:
    """The registered backend object ``name``."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; registered: "
                         f"{', '.join(sorted(_BACKENDS))}") from None


class AttentionOp:
    """The ``"attention"`` op bound to one backend.

    ``op(q, k, v, ...)`` is ``op.forward``; ``forward_fp32`` upcasts the inputs to fp32
    and runs the same backend (for the reference backend that is the fp32 ground
    truth); ``forward_with_lse`` also returns the fp32 natural-log lse ``[B, Hq, Sq]``.
    """

    #: The backend path this op needs.
    path = "attention"

    def __init__(self, op_name: str, be: Backend):
        self.op_name = op_name
        self._backend = be

    @property
    def backend(self) -> str:
        """Name of the backend that serves this op."""
        return self._backend.name

    @property
    def backend_object(self) -> Backend:
        """The backend object that serves this op (its interface methods)."""
        return self._backend

    def __repr__(self) -> str:
        return f"{type(self).__name__}(op={self.op_name!r}, backend={self.backend!r})"

    def _check(self, q, k, v, kwargs: dict[str, Any], path: str | None = None) -> None:
        dims = validate_inputs(q, k, v, causal=kwargs.get("causal", True),
                               scale=kwargs.get("scale"),
                               key_padding_mask=kwargs.get("key_padding_mask"))
        reason = self._backend.unsupported(dims, path or self.path)
        if reason is not None:
            raise ValueError(f"backend {self.backend!r} cannot serve this call: {reason}")

    def _forward(self, q, k, v, *, causal, scale, key_padding_mask, fp32: bool):
        kw = dict(causal=causal, scale=scale, key_padding_mask=key_padding_mask)
        self._check(q, k, v, kw)
        be = self._backend
        kw = dict(causal=bool(causal), scale=resolve_scale(scale, q.shape[-1]),
                  key_padding_mask=key_padding_mask)
        if key_padding_mask is not None and be.follows_schedule:
            # Left padding: blocks aligned to each sequence's first valid key (bits of
            # the sequence alone; jaxattn.layout).
            if fp32:
                q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
            return layout.aligned_forward(be, q, k, v, **kw)
        if fp32:
            return be.forward_fp32_with_lse(q, k, v, **kw)
        return be.forward_with_lse(q, k, v, **kw)

    def forward_with_lse(self, q, k, v, *, causal: bool = True, scale: float | None = None,
                         key_padding_mask=None) -> tuple[jax.Array, jax.Array]:
        """``(out [B, Hq, Sq, D] in q.dtype, lse [B, Hq, Sq] fp32)``. With a
        ``key_padding_mask`` on a backend that follows the schedule, each sequence's key
        blocks start at its first kept key (:func:`jaxattn.layout.aligned_forward`), so a
        left-padded sequence gets the bits it has alone."""
        return self._forward(q, k, v, causal=causal, scale=scale,
                             key_padding_mask=key_padding_mask, fp32=False)

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
        return self._forward(q, k, v, causal=causal, scale=scale,
                             key_padding_mask=key_padding_mask, fp32=True)

    def forward_fp32(self, q, k, v, *, causal: bool = True, scale: float | None = None,
                     key_padding_mask=None) -> jax.Array:
        """fp32 inputs, fp32 ``out``."""
        return self.forward_fp32_with_lse(q, k, v, causal=causal, scale=scale,
                                          key_padding_mask=key_padding_mask)[0]


#: Every op: its class (whose ``path`` is the backend path it needs).
OPS: dict[str, type[AttentionOp]] = {"attention": AttentionOp}


def register_op(name: str, cls: type[AttentionOp]) -> None:
    """Add the op ``name`` (an :class:`AttentionOp` subclass whose ``path`` names the
    backend path it needs). The ops' modules call it (``"cp_attention"``: :mod:`jaxattn.cp`,
    imported by ``import jaxattn``), so the registry imports no op."""
    OPS[name] = cls


def op_names() -> tuple[str, ...]:
    """Names of the registered ops."""
    return tuple(sorted(OPS))


def _op_class(op_name: str) -> type[AttentionOp]:
    try:
        return OPS[op_name]
    except KeyError:
        raise KeyError(f"unknown op {op_name!r}; known ops: {', '.join(op_names())}") from None


def backend_names(op_name: str = "attention") -> tuple[str, ...]:
    """Names of the backends that serve ``op_name`` (declare its path)."""
    path = _op_class(op_name).path
    return tuple(sorted(n for n, b in _BACKENDS.items() if path in b.paths))


def current_platform() -> str:
    """The platform of the call: JAX's default ("cpu", "gpu" for CUDA or ROCm, "tpu"),
    or the one :func:`jaxattn.platform.use` names while a caller traces on it."""
    return _platform.current()


def resolve(op_name: str = "attention", backend: str | Backend | None = None,
            platform: str | None = None) -> Backend:
    """The backend object for ``op_name`` on ``platform`` (default: JAX's default).

    An explicit ``backend`` (a registered name, or a backend object) must serve the op,
    be available and run on the platform, or this raises; it is never replaced by
    another. Without one, the available backend with the best priority on the platform
    among those that serve the op wins.
    """
    path = _op_class(op_name).path
    platform = platform or current_platform()
    if backend is not None:
        chosen = backend if isinstance(backend, Backend) else None
        if chosen is None:
            if backend not in _BACKENDS:
                raise ValueError(f"unknown backend {backend!r} for op {op_name!r}; "
                                 f"registered: {', '.join(sorted(_BACKENDS))}")
            chosen = _BACKENDS[backend]
        if path not in chosen.paths:
            raise ValueError(f"backend {chosen.name!r} does not serve op {op_name!r} (it has "
                             f"no {path} path; backends that do: "
                             f"{', '.join(backend_names(op_name))})")
        if platform not in chosen.platforms:
            raise ValueError(f"backend {chosen.name!r} does not run on platform "
                             f"{platform!r} (runs on: {', '.join(chosen.platforms)})")
        reason = chosen.available()
        if reason is not None:
            raise RuntimeError(f"backend {chosen.name!r} is unavailable: {reason}")
        return chosen
    candidates = sorted((b.priority[platform], b.name) for b in _BACKENDS.values()
                        if path in b.paths and platform in b.priority
                        and b.available() is None)
    if not candidates:
        raise RuntimeError(f"no backend of op {op_name!r} is available on {platform!r}")
    return _BACKENDS[candidates[0][1]]


def get_op(name: str = "attention", *, backend: str | Backend | None = None,
           platform: str | None = None) -> AttentionOp:
    """The op ``name`` bound to a backend chosen by platform priority (or ``backend``).

    On a GPU: the Mosaic GPU kernels where available (sm90), then the Pallas kernels,
    then the reference. On a CPU: the reference (``backend="pallas"`` runs the kernels in
    interpret mode, for tests). Ops: ``"attention"`` (:class:`AttentionOp`) and
    ``"cp_attention"`` (:class:`jaxattn.cp.CPAttentionOp`, the same entries with the CP arguments of
    :mod:`jaxattn.cp`).
    """
    return _op_class(name)(name, resolve(name, backend, platform))


for _be in builtin():
    register(_be)
