"""The backends of ``"attention"``, registered with :mod:`jaxattn.registry`.

GPU priority: ``pallas`` (Triton lowering, sm80+), then ``reference``. CPU: ``reference``
only; ``backend="pallas"`` on a CPU runs the same kernels in interpret mode (slow; for
tests).
"""

from __future__ import annotations

import jax

from jaxattn import reference
from jaxattn.kernels import pallas_triton, pallas_triton_vjp
from jaxattn.registry import Backend, register
from jaxattn.validation import Dims, resolve_scale


def _reference_forward_with_lse(q, k, v, *, causal, scale, key_padding_mask):
    return reference.forward_with_lse(q, k, v, causal=causal, scale=scale,
                                      key_padding_mask=key_padding_mask)


def _pallas_forward_with_lse(q, k, v, *, causal, scale, key_padding_mask):
    interpret = jax.default_backend() == "cpu"
    return pallas_triton_vjp.attention(q, k, v, key_padding_mask, bool(causal),
                                       resolve_scale(scale, q.shape[-1]), interpret)


def _pallas_available() -> str | None:
    platform = jax.default_backend()
    if platform == "cpu":
        return None  # interpret mode
    if platform != "gpu" and platform != "cuda":
        return f"the Pallas Triton kernels need an NVIDIA GPU, the platform is {platform!r}"
    cc = getattr(jax.devices()[0], "compute_capability", None)
    try:
        major = int(str(cc).split(".")[0])
    except ValueError:
        return f"unknown compute capability {cc!r}"
    if major < 8:
        return f"needs compute capability >= 8.0 (bf16 matrix units), got {cc}"
    return None


def _pallas_unsupported(dims: Dims) -> str | None:
    return pallas_triton.check_supported(dims.head_dim)


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
