"""Input validation shared by every backend (DESIGN.md section 3)."""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

#: Dtypes every backend accepts for q, k and v.
SUPPORTED_DTYPES: tuple[np.dtype, ...] = (
    np.dtype(jnp.bfloat16),
    np.dtype(jnp.float16),
    np.dtype(jnp.float32),
)


class Dims(NamedTuple):
    """Static dimensions of one attention call, after validation."""

    batch: int
    num_q_heads: int
    num_kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: np.dtype

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.num_q_heads // self.num_kv_heads


def _shape(x: Any) -> tuple[int, ...] | None:
    shape = getattr(x, "shape", None)
    return None if shape is None else tuple(shape)


def validate_inputs(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: Any = True,
    scale: Any = None,
    key_padding_mask: Any = None,
) -> Dims:
    """Check q, k, v, the mask and the scalar options against the tensor contract.

    Args:
      q: ``[B, Hq, Sq, D]``.
      k: ``[B, Hkv, Skv, D]``.
      v: ``[B, Hkv, Skv, D]``.
      causal: a Python bool.
      scale: ``None`` or a finite real number (used verbatim, 0.0 included).
      key_padding_mask: ``None`` or ``[B, Skv]`` bool, True = keep.

    Returns:
      The validated :class:`Dims`.

    Raises:
      ValueError: wrong rank, mismatched batch / head dim / KV shapes, ``Hq % Hkv != 0``,
        a mask of the wrong shape, a non-finite scale.
      TypeError: an unsupported or mismatched dtype, a mask that is not bool, a causal
        flag that is not a bool, a scale that is not a real number.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        shape = _shape(x)
        if shape is None:
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if len(shape) != 4:
            raise ValueError(
                f"{name} must have rank 4 ([B, H, S, D]), got shape {shape} (rank {len(shape)})"
            )
        dtype = np.dtype(x.dtype)
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name} has unsupported dtype {dtype}; supported: "
                f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must share one dtype, got q {np.dtype(q.dtype)}, "
            f"k {np.dtype(k.dtype)}, v {np.dtype(v.dtype)}"
        )
    b, hq, sq, d = q.shape
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
    bk, hkv, skv, dk = k.shape
    if bk != b:
        raise ValueError(f"batch mismatch: q has B={b} (shape {q.shape}), k has B={bk} "
                         f"(shape {k.shape})")
    if dk != d:
        raise ValueError(f"head-dim mismatch: q has D={d} (shape {q.shape}), k has D={dk} "
                         f"(shape {k.shape})")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"Hq must be a multiple of Hkv: Hq={hq} is not divisible by Hkv={hkv} (q has "
            f"shape {tuple(q.shape)}, k has shape {tuple(k.shape)})"
        )
    if d == 0:
        raise ValueError(f"head dim D must be positive, got q shape {q.shape}")
    if key_padding_mask is not None:
        mshape = _shape(key_padding_mask)
        if mshape is None:
            raise TypeError(
                f"key_padding_mask must be an array, got {type(key_padding_mask).__name__}"
            )
        if np.dtype(key_padding_mask.dtype) != np.dtype(bool):
            raise TypeError(
                f"key_padding_mask must be bool (True = keep), got dtype "
                f"{np.dtype(key_padding_mask.dtype)}"
            )
        if mshape != (b, skv):
            raise ValueError(
                f"key_padding_mask must have shape [B, Skv] = {(b, skv)}, got {mshape}"
            )
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is not None:
        if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale must be None or a real number, got {type(scale).__name__}")
        if not math.isfinite(float(scale)):
            raise ValueError(f"scale must be finite, got {scale}")
    return Dims(b, hq, hkv, sq, skv, d, np.dtype(q.dtype))


def as_bhsd(x) -> jax.ShapeDtypeStruct:
    """A ``[B, S, H, D]`` array's shape and dtype viewed as ``[B, H, S, D]`` (JAX's
    layout checked by :func:`validate_inputs`, which reads the contract's layout)."""
    b, s, h, d = x.shape
    return jax.ShapeDtypeStruct((b, h, s, d), x.dtype)


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """``None`` -> ``1/sqrt(D)``; an explicit value, 0.0 included, verbatim."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
