"""The ``"reference"`` backend: :mod:`jaxattn.reference` (plain ``jax.numpy``, fp32
softmax) behind the backend interface.

It runs everywhere and is the CPU's automatic choice. It does not follow the blocked
schedule, so it promises the first two rows of the invariance matrix only (a row alone
vs in a batch, run to run); its paged path gathers the pages, its CP path has one
partial state per key range, folded by :func:`jaxattn.merge.fold`, and its mesh path
("cp_mesh") forms each device's gradients from the global lse in plain fp32 ``jax.numpy``
(within rounding of its one-device gradients, not in bits).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

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


def _probabilities(q, k, key_padding_mask, lse, *, causal, scale, causal_offsets):
    """fp32 ``P = exp(S * scale - lse)`` ``[B, Hkv, G, Sq, Skv]`` from the final lse (0
    where a key is hidden or a row sees none), with the fp32 q and k."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.astype(jnp.float32).reshape(b, hkv, g, sq, d)
    s = jnp.einsum("bhgqd,bhkd->bhgqk", qg, k.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST) * scale
    offs = (jnp.full((b,), skv - sq, jnp.int32) if causal_offsets is None
            else jnp.asarray(causal_offsets, jnp.int32))
    visible = reference.visibility(sq, skv, causal=causal, key_padding_mask=key_padding_mask,
                                   batch=b, query_positions=offs[:, None] + jnp.arange(sq),
                                   key_positions=None)[:, :, None]
    lse_g = lse.reshape(b, hkv, g, sq)[..., None]
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse_g), lse_g, 0.0))
    return jnp.where(visible & jnp.isfinite(lse_g), p, 0.0), qg


def _score_gradients(q, k, v, key_padding_mask, d_out, lse, delta, *, causal, scale,
                     causal_offsets):
    """``(P, dS, q [B, Hkv, G, Sq, D], dO)`` in fp32: ``dS = P * (dO V^T - delta)``."""
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    p, qg = _probabilities(q, k, key_padding_mask, lse, causal=causal, scale=scale,
                           causal_offsets=causal_offsets)
    dog = d_out.astype(jnp.float32).reshape(b, hkv, hq // hkv, sq, d)
    dp = jnp.einsum("bhgqd,bhkd->bhgqk", dog, v.astype(jnp.float32),
                    precision=lax.Precision.HIGHEST)
    ds = p * (dp - delta.reshape(b, hkv, hq // hkv, sq)[..., None])
    return p, ds, qg, dog


class ReferenceBackend(Backend):
    name = "reference"
    description = "pure jax.numpy, fp32 softmax; ground truth"
    platforms = ("cpu", "gpu", "tpu")
    priority = {"cpu": 0, "gpu": 100, "tpu": 0}
    follows_schedule = False
    paths = frozenset(("attention", "backward", "cp", "cp_mesh", "paged", "varlen"))

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

    # The mesh path: each device's gradients from the global lse and delta.
    def delta(self, out, d_out, d_lse):
        dl = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1)
        return dl if d_lse is None else dl - d_lse.astype(jnp.float32)

    def key_gradients(self, q, k, v, key_padding_mask, d_out, lse, delta, *, causal, scale,
                      causal_offsets):
        p, ds, qg, dog = _score_gradients(q, k, v, key_padding_mask, d_out, lse, delta,
                                          causal=causal, scale=scale,
                                          causal_offsets=causal_offsets)
        hi = lax.Precision.HIGHEST
        dk = jnp.einsum("bhgqk,bhgqd->bhkd", ds, qg, precision=hi) * scale
        dv = jnp.einsum("bhgqk,bhgqd->bhkd", p, dog, precision=hi)
        return dk.astype(k.dtype), dv.astype(v.dtype)

    def query_gradients(self, q, k, v, key_padding_mask, d_out, lse, delta, *, causal,
                        scale, causal_offsets):
        _, ds, _, _ = _score_gradients(q, k, v, key_padding_mask, d_out, lse, delta,
                                       causal=causal, scale=scale,
                                       causal_offsets=causal_offsets)
        dq = jnp.einsum("bhgqk,bhkd->bhgqd", ds, k.astype(jnp.float32),
                        precision=lax.Precision.HIGHEST) * scale
        return dq.reshape(q.shape).astype(q.dtype)


BACKEND = ReferenceBackend()
