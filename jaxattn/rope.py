"""Qwen3 rotary position embedding (the reference the harness attributes drift to).

Rotate-half convention (Hugging Face Qwen3/Llama): with ``inv_freq[i] =
theta ** (-2i / rotary_dim)`` and ``angle = position * inv_freq`` duplicated to
``rotary_dim``, the first ``rotary_dim`` features become
``x * cos(angle) + rotate_half(x) * sin(angle)`` where ``rotate_half([x1, x2]) =
[-x2, x1]``; the remaining features pass through. All math is fp32; the cast point is
the output (``ROPE_CAST_AT = "output"``): one rounding to the input dtype at the end.
Hugging Face instead casts cos/sin to the input dtype first, so bf16 results can differ
from it in the last bit; the cast point is recorded in every provenance report.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DEFAULT_THETA = 1_000_000.0
ROPE_CAST_AT = "output"


def _angles(position_ids, rotary_dim: int, theta: float, batch: int, seq: int):
    pos = jnp.asarray(position_ids)
    if pos.ndim == 1 and pos.shape[0] == seq:
        pos = jnp.broadcast_to(pos[None], (batch, seq))
    if pos.shape != (batch, seq):
        raise ValueError(f"position_ids must have shape [B, S] = {(batch, seq)} or [S], got "
                         f"{jnp.shape(position_ids)}")
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    ang = pos.astype(jnp.float32)[..., None] * inv_freq  # [B, S, rd/2]
    ang = jnp.concatenate([ang, ang], axis=-1)[:, None]  # [B, 1, S, rd]
    return jnp.cos(ang), jnp.sin(ang)


def forward_fp32(x: jax.Array, position_ids, *, theta: float = DEFAULT_THETA,
                 rotary_dim: int | None = None) -> jax.Array:
    """RoPE of ``x [B, H, S, D]`` at ``position_ids [B, S]`` or ``[S]``, fp32 result."""
    if x.ndim != 4:
        raise ValueError(f"x must have rank 4 ([B, H, S, D]), got shape {x.shape}")
    d = x.shape[-1]
    rd = d if rotary_dim is None else int(rotary_dim)
    if rd <= 0 or rd > d or rd % 2:
        raise ValueError(f"rotary_dim must be even and in (0, D={d}], got {rotary_dim}")
    cos, sin = _angles(position_ids, rd, float(theta), x.shape[0], x.shape[2])
    xf = x.astype(jnp.float32)
    rot, rest = xf[..., :rd], xf[..., rd:]
    half = rd // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return jnp.concatenate([rot * cos + rotated * sin, rest], axis=-1)


def forward(x: jax.Array, position_ids, *, theta: float = DEFAULT_THETA,
            rotary_dim: int | None = None) -> jax.Array:
    """RoPE in fp32, cast once to ``x.dtype`` (see ``ROPE_CAST_AT``)."""
    return forward_fp32(x, position_ids, theta=theta, rotary_dim=rotary_dim).astype(x.dtype)


def provenance(position_ids, *, theta: float = DEFAULT_THETA, rotary_dim: int | None,
               head_dim: int, output_dtype) -> dict:
    """What a RoPE application was: JSON-compatible."""
    pos = jnp.asarray(position_ids)
    return {"position_ids_shape": list(pos.shape),
            "position_range": [int(pos.min()), int(pos.max())] if pos.size else [],
            "rope_theta": float(theta), "rotary_dim": int(rotary_dim or head_dim),
            "rope_cast_at": ROPE_CAST_AT, "rope_output_dtype": str(jnp.dtype(output_dtype)),
            "convention": "rotate_half"}
