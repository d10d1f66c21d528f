"""The ``"reference"`` backend: :mod:`jaxattn.reference` (plain ``jax.numpy``, fp32
softmax) behind the backend interface.

It runs everywhere and is the CPU's automatic choice. It does not follow the blocked
schedule, so it promises the first two rows of the invariance matrix only (a row alone
vs in a batch, run to run); its paged path gathers the pages, and its CP path has one
partial state per key range, folded by :func:`jaxattn.merge.fold`.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxattn import reference
from jaxattn.backends.base import Backend


def _positions(q, k, causal_offsets):
    """Query and key positions ``([B, Sq], [B, Skv])`` int32 for per-sequence offsets
    (query 0 sits at ``causal_offsets[b]`` when key 0 sits at 0), or (None, None)."""
    if causal_offsets is None:
        return None, None
    b, sq, skv = q.shape[0], q.shape[2], k.shape[2]
    q_pos = jnp.asarray(causal_offsets, jnp.int32)[:, None] + jnp.arange(sq, dtype=jnp.int32)
    k_pos = jnp.broadcast_to(jnp.arange(skv, dtype=jnp.int32), (b, skv))
    return q_pos, k_pos


def _call(fn, q, k, v, *, causal, scale, key_padding_mask=None, causal_offsets=None):
    q_pos, k_pos = _positions(q, k, causal_offsets if causal else None)
    return fn(q, k, v, causal=causal, scale=scale, key_padding_mask=key_padding_mask,
              query_positions=q_pos, key_positions=k_pos)


class ReferenceBackend(Backend):
    name = "reference"
    description = "pure jax.numpy, fp32 softmax; ground truth"
    platforms = ("cpu", "gpu", "tpu")
    priority = {"cpu": 0, "gpu": 100, "tpu": 0}
    follows_schedule = False

    def forward_with_lse(self, q, k, v, **kw):
        return _call(reference.forward_with_lse, q, k, v, **kw)

    def forward_fp32_with_lse(self, q, k, v, **kw):
        return _call(reference.forward_fp32_with_lse, q, k, v, **kw)

    def split_states(self, q, k, v, key_padding_mask, causal_offsets, *, causal, scale):
        """One state over the whole key range (the reference has no splits)."""
        if k.shape[2] == 0:
            b, hq, sq, d = q.shape
            return (jnp.zeros((1, b, hq, sq, d), jnp.float32),
                    jnp.full((1, b, hq, sq), -jnp.inf, jnp.float32))
        out, lse = self.forward_with_lse(q, k, v, causal=causal, scale=scale,
                                         key_padding_mask=key_padding_mask,
                                         causal_offsets=causal_offsets)
        return out.astype(jnp.float32)[None], lse[None]


BACKEND = ReferenceBackend()
