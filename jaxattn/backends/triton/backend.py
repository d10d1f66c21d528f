"""The ``"triton"`` backend: the canonical schedule in raw Triton
(:mod:`jaxattn.backends.triton.kernels`), called through jax-triton on a GPU and run in
Triton's interpreter on a CPU (:mod:`jaxattn.backends.triton.launch`).

An optional dependency (the ``triton`` extra). On a GPU it is registered after
``pallas``: chosen automatically only where the Pallas backend is unavailable. Paths:
attention and its backward, paged KV (the pages gathered into a copy first); no CP (the
per-range backward has no Triton kernels).
"""

from __future__ import annotations

from jaxattn.backends.base import Backend
from jaxattn.backends.pallas.backend import nvidia_gpu_reason
from jaxattn.backends.triton import launch


def _platform() -> str:
    from jaxattn import platform
    return platform.current()


class TritonBackend(Backend):
    name = "triton"
    description = ("raw Triton kernels (jax-triton; Triton's interpreter on a CPU) on the "
                   "canonical schedule")
    platforms = ("gpu", "cpu")
    priority = {"gpu": 20}  # after pallas
    paths = frozenset(("attention", "backward", "paged", "varlen"))

    def available(self) -> str | None:
        platform = _platform()
        if platform not in ("cpu", "gpu"):
            return (f"the raw Triton kernels run on a GPU or a CPU, the platform is "
                    f"{platform!r}")
        reason = launch.unavailable_reason(platform)
        if reason is None and platform == "gpu":
            reason = nvidia_gpu_reason("the raw Triton kernels")
        return reason

    def unsupported(self, dims, path="attention", *, page_size=None):
        return (super().unsupported(dims, path, page_size=page_size)
                or launch.check_supported(dims.head_dim))

    def forward_with_lse(self, q, k, v, *, causal, scale, key_padding_mask=None,
                         causal_offsets=None):
        return launch.attention(q, k, v, key_padding_mask, causal_offsets, bool(causal),
                                float(scale))

    def backward(self, q, k, v, key_padding_mask, out, lse, d_out, d_lse, *, causal, scale,
                 causal_offsets=None):
        return launch.backward(q, k, v, key_padding_mask, out, lse, d_out.astype(out.dtype),
                               d_lse, causal_offsets, causal=bool(causal), scale=float(scale))


BACKEND = TritonBackend()
