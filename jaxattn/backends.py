"""The backends of ``"attention"``, registered with :mod:`jaxattn.registry`.

GPU priority: ``mosaic`` (Mosaic GPU: available on sm90 only, where it serves every call
``pallas`` serves: :mod:`jaxattn.kernels.mosaic_backend`), then ``pallas`` (Triton
lowering, sm80+), then ``triton`` (the same schedule in raw Triton through jax-triton; an
optional dependency), then ``reference``. The choice depends on the GPU's capability,
never on a call's shapes. CPU: ``reference`` only; ``backend="pallas"`` on a CPU runs the
same kernels in interpret mode and ``backend="triton"`` runs its kernels in Triton's
interpreter (slow; for tests).
"""

from __future__ import annotations

import jax

from jaxattn import reference
from jaxattn.kernels import mosaic_backend, pallas_triton, pallas_triton_vjp, triton_backend
from jaxattn.registry import Backend, current_platform, register
from jaxattn.validation import Dims, resolve_scale


def _reference_forward_with_lse(q, k, v, *, causal, scale, key_padding_mask):
    return reference.forward_with_lse(q, k, v, causal=causal, scale=scale,
                                      key_padding_mask=key_padding_mask)


def _pallas_forward_with_lse(q, k, v, *, causal, scale, key_padding_mask):
    interpret = jax.default_backend() == "cpu"
    return pallas_triton_vjp.attention(q, k, v, key_padding_mask, bool(causal),
                                       resolve_scale(scale, q.shape[-1]), interpret)


def _nvidia_gpu_reason(what: str) -> str | None:
    """Why this process's GPU cannot run Triton kernels on the canonical schedule."""
    platform = jax.default_backend()
    if platform != "gpu" and platform != "cuda":
        return f"{what} need an NVIDIA GPU, the platform is {platform!r}"
    cc = getattr(jax.devices()[0], "compute_capability", None)
    try:
        major = int(str(cc).split(".")[0])
    except ValueError:
        return f"unknown compute capability {cc!r}"
    if major < 8:
        return f"needs compute capability >= 8.0 (bf16 matrix units), got {cc}"
    return None


def _pallas_available() -> str | None:
    if jax.default_backend() == "cpu":
        return None  # interpret mode
    return _nvidia_gpu_reason("the Pallas Triton kernels")


def _pallas_unsupported(dims: Dims) -> str | None:
    return pallas_triton.check_supported(dims.head_dim)


def _triton_forward_with_lse(q, k, v, *, causal, scale, key_padding_mask):
    return triton_backend.attention(q, k, v, key_padding_mask, bool(causal),
                                    resolve_scale(scale, q.shape[-1]))


def _triton_available() -> str | None:
    platform = current_platform()
    if platform not in ("cpu", "gpu"):
        return f"the raw Triton kernels run on a GPU or a CPU, the platform is {platform!r}"
    reason = triton_backend.unavailable_reason(platform)
    if reason is None and platform == "gpu":
        reason = _nvidia_gpu_reason("the raw Triton kernels")
    return reason


def _triton_unsupported(dims: Dims) -> str | None:
    return triton_backend.check_supported(dims.head_dim)


def _mosaic_forward_with_lse(q, k, v, *, causal, scale, key_padding_mask):
    return mosaic_backend.attention(q, k, v, key_padding_mask, causal=bool(causal),
                                    scale=resolve_scale(scale, q.shape[-1]))


def _mosaic_unsupported(dims: Dims) -> str | None:
    return mosaic_backend.check_supported(dims.head_dim, dims.dtype)


register("attention", Backend(
    name="reference",
    platforms=("cpu", "gpu", "tpu"),
    priority={"cpu": 0, "gpu": 100, "tpu": 0},
    forward_with_lse=_reference_forward_with_lse,
    description="pure jax.numpy, fp32 softmax; ground truth",
))

register("attention", Backend(
    name="pallas",
    platforms=("gpu", "cpu"),
    priority={"gpu": 10},
    forward_with_lse=_pallas_forward_with_lse,
    available=_pallas_available,
    unsupported=_pallas_unsupported,
    description="Pallas kernels (Triton lowering) on the canonical schedule",
))

register("attention", Backend(
    name="triton",
    platforms=("gpu", "cpu"),
    priority={"gpu": 20},  # after pallas: chosen automatically only where pallas is not
    forward_with_lse=_triton_forward_with_lse,
    available=_triton_available,
    unsupported=_triton_unsupported,
    description="raw Triton kernels (jax-triton; Triton's interpreter on a CPU) on the "
                "canonical schedule",
))

register("attention", Backend(
    name="mosaic",
    platforms=("gpu",),
    priority={"gpu": 5},  # before pallas wherever available (sm90)
    forward_with_lse=_mosaic_forward_with_lse,
    available=mosaic_backend.unavailable_reason,
    unsupported=_mosaic_unsupported,
    description="Pallas Mosaic GPU kernels (Hopper: wgmma, TMA) on the canonical schedule; "
                "bf16/fp16 (fp32 on the Pallas kernels)",
))
