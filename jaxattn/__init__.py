"""jaxattn: deterministic, batch-invariant softmax attention for JAX.

Public surface (DESIGN.md section 2):

* :func:`attention` -- the main entry, jittable and differentiable.
* :func:`dot_product_attention` -- ``jax.nn.dot_product_attention``'s signature on
  JAX's ``[B, T, N, H]`` layout (:mod:`jaxattn.nn`); :mod:`jaxattn.flax` -- Flax's
  ``attention_fn``.
* :func:`get_op` -- the registry (``get_op("attention")``, ``get_op("cp_attention")``).
* :mod:`jaxattn.reference` -- the fp32 ground truth.
* :mod:`jaxattn.schedule` -- ``BLOCK_N`` and ``SPLIT``, the canonical reduction order.
* :mod:`jaxattn.varlen` -- packed sequences (FlashAttention's ``cu_seqlens`` layout);
  :mod:`jaxattn.paged` -- a paged KV cache.
"""

from __future__ import annotations

import jax

from jaxattn import cp as _cp  # noqa: F401  (the "cp_attention" op's module)
from jaxattn import flax, nn, paged, reference, schedule, varlen
from jaxattn.merge import merge
from jaxattn.nn import dot_product_attention
from jaxattn.registry import AttentionOp, backend_names, get_op
from jaxattn.schedule import BLOCK_N, SPLIT
from jaxattn.validation import validate_inputs

__all__ = [
    "BLOCK_N", "SPLIT", "AttentionOp", "attention", "backend_names",
    "dot_product_attention", "flax", "get_op", "merge", "nn", "paged", "reference",
    "schedule", "validate_inputs", "varlen",
]
__version__ = "0.1.0"


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
              scale: float | None = None, key_padding_mask: jax.Array | None = None,
              return_lse: bool = False, backend: str | None = None):
    """Softmax attention on the canonical schedule.

    Args:
      q: ``[B, Hq, Sq, D]`` bf16, fp16 or fp32.
      k, v: ``[B, Hkv, Skv, D]``, same dtype; ``Hq % Hkv == 0`` (query head h reads KV
        head ``h // (Hq // Hkv)``).
      causal: key j is visible to query i iff ``j <= i + (Skv - Sq)``.
      scale: ``None`` -> ``1/sqrt(D)``; any explicit value (0.0 included) verbatim.
      key_padding_mask: ``[B, Skv]`` bool, True = keep. Each sequence's key blocks start
        at its first kept key, so left padding (and tail padding) keeps the bits of the
        sequence alone (docs/contract.md).
      return_lse: also return the fp32 natural-log lse ``[B, Hq, Sq]``.
      backend: ``None`` (platform priority: GPU ``"mosaic"`` on sm90, then
        ``"pallas"``, then ``"triton"``, then ``"reference"``; CPU ``"reference"``),
        ``"mosaic"`` (Hopper only), ``"pallas"``, ``"triton"`` (needs the ``triton``
        extra) or ``"reference"``. An explicit backend that cannot serve the call
        raises; it never falls back.

    Returns:
      ``out [B, Hq, Sq, D]`` in q's dtype, or ``(out, lse)`` with ``return_lse``. Rows
      with no visible key give 0 and -inf.
    """
    op = get_op("attention", backend=backend)
    out, lse = op.forward_with_lse(q, k, v, causal=causal, scale=scale,
                                   key_padding_mask=key_padding_mask)
    return (out, lse) if return_lse else out
