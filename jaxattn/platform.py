"""The JAX platform a call runs on: JAX's default, or the one a caller's arrays live on.

The torch bridge runs CPU tensors on JAX's CPU device even on a GPU host (the device
follows the inputs). While it traces such a call it enters :func:`use` ("cpu"), and every
backend's choice that depends on the platform (interpret mode on a CPU, availability)
reads :func:`current` instead of ``jax.default_backend()``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

_OVERRIDE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxattn_platform", default=None)


def normalize(platform: str) -> str:
    """"gpu" for CUDA and ROCm, else JAX's name ("cpu", "tpu")."""
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


def current() -> str:
    """The platform of the call being traced: "cpu", "gpu" or "tpu"."""
    p = _OVERRIDE.get()
    return p if p is not None else normalize(jax.default_backend())


@contextlib.contextmanager
def use(platform: str) -> Iterator[None]:
    """Trace and run the calls inside on ``platform`` ("cpu", "gpu", "tpu")."""
    token = _OVERRIDE.set(normalize(platform))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)
