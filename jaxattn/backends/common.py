"""Pieces shared by the Pallas kernels: tile dot products and the online-softmax step.

Every forward kernel calls :func:`online_softmax_step` for each ``BLOCK_N`` block and
:func:`jaxattn.merge.finalize` / :func:`jaxattn.merge.merge` at split boundaries, so a
query row sees the same floating-point operations whichever kernel (and tile height)
computes it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxattn import schedule

NEG_INF = float("-inf")
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

#: Columns of the all-ones operand that turns a row sum into a matrix product. The
#: row sum of the probabilities is taken on the matrix unit (max over identical
#: columns) because a vector reduction's order follows the register layout, which
#: changes with the tile shape; a matrix-unit row is the same for every tile height.
ROWSUM_COLS = 16


def dot(a: jax.Array, b: jax.Array, *, trans_b: bool = False,
        precision: lax.Precision | None = None) -> jax.Array:
    """``a @ b`` (or ``a @ b.T``) of 2-D tiles, fp32 accumulation."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision,
                           preferred_element_type=jnp.float32)


def precision_for(dtype) -> lax.Precision | None:
    """fp32 inputs multiply in true fp32 (no tf32); 16-bit inputs use the default."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def rowsum(p32: jax.Array, p: jax.Array, precision: lax.Precision | None) -> jax.Array:
    """Row sums of a block's probabilities, ``p32`` (fp32) or ``p`` (``p32`` cast to
    the input dtype), as ``schedule.ROWSUM`` says: on the matrix unit over ``p`` ("mma",
    see ROWSUM_COLS), a vector reduction over ``p`` ("reduce"), or over ``p32``
    ("reduce32"), or the fixed pairwise tree over ``p32`` ("tree",
    :func:`pairwise_rowsum`). The last two are tuning candidates of the Pallas kernels
    only."""
    if schedule.ROWSUM == "reduce":
        return jnp.sum(p.astype(jnp.float32), axis=1)
    if schedule.ROWSUM == "reduce32":
        return jnp.sum(p32, axis=1)
    if schedule.ROWSUM == "tree":
        return pairwise_rowsum(p32)
    ones = jnp.ones((p.shape[1], ROWSUM_COLS), dtype=p.dtype)
    return jnp.max(dot(p, ones, precision=precision), axis=1)


def pairwise_rowsum(x: jax.Array) -> jax.Array:
    """Row sums of a ``[M, N]`` tile (N a power of two) by a fixed binary tree: at each
    level column pairs (2c, 2c+1) are added.

    One addition of two numbers has one result whatever the register layout, so every
    level, and the whole sum, is the same for every tile height;
    a plain vector reduction's order follows the layout instead (``"reduce32"``). A
    tuning candidate (``schedule.ROWSUM = "tree"``) of the Pallas kernels only."""
    m_rows, n = x.shape
    while n > 1:
        n //= 2
        # An explicit split and add, not a sum over the pair axis: XLA would merge
        # consecutive reductions into one reduction of its own order.
        even, odd = jnp.split(x.reshape(m_rows, n, 2), 2, axis=2)
        x = (even + odd).reshape(m_rows, n)
    return x.reshape(m_rows)


def natural_max(m: jax.Array) -> jax.Array:
    """The running max of :func:`online_softmax_step` in natural-log units."""
    return m * LN2 if schedule.SOFTMAX_EXP_BASE == "2" else m


def online_softmax_step(acc: jax.Array, m: jax.Array, l: jax.Array, q: jax.Array,
                        k: jax.Array, v: jax.Array, visible: jax.Array, *, scale: float,
                        precision: lax.Precision | None):
    """Fold one block of keys into the running state (FlashAttention-2, eqs. for m, l, O).

    Args:
      acc: ``[M, D]`` fp32 unnormalised output.
      m: ``[M]`` fp32 running max (``-inf`` before any visible key).
      l: ``[M]`` fp32 running sum of exp(s - m).
      q: ``[M, D]`` input dtype.
      k, v: ``[N, D]`` input dtype, zero where not visible to any row.
      visible: ``[M, N]`` bool, or None when every key of the block is visible to every
        row (the unmasked fast path; ``where`` with an all-true mask is the identity, so
        both paths give the same bits).

    A block with no visible key leaves (acc, m, l) unchanged bit for bit while m is
    finite (alpha = exp(0) = 1, p = 0), so skipping such blocks changes nothing.

    With ``schedule.SOFTMAX_EXP_BASE == "2"`` scores are pre-scaled by log2(e) and m is
    in log2 units (:func:`natural_max` converts it back).
    """
    base2 = schedule.SOFTMAX_EXP_BASE == "2"
    exp = jnp.exp2 if base2 else jnp.exp
    s = dot(q, k, trans_b=True, precision=precision) * (scale * LOG2E if base2 else scale)
    if visible is not None:
        s = jnp.where(visible, s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
    alpha = exp(m - m_safe)
    p32 = exp(s - m_safe[:, None])
    p = p32.astype(v.dtype)
    l_new = l * alpha + rowsum(p32, p, precision)
    acc_new = acc * alpha[:, None] + dot(p, v, precision=precision)
    return acc_new, m_new, l_new


#: Head dims the Pallas and Triton kernels are compiled for. Any D from 1 to
#: ``MAX_HEAD_DIM`` runs zero-padded to the next of these: a zero column adds an exact
#: zero to every score and output, and a given D always runs the same padded kernel, so
#: the invariance matrix holds for every D (the scale stays that of the real D).
KERNEL_HEAD_DIMS: tuple[int, ...] = (16, 32, 64, 128, 256)
MAX_HEAD_DIM = 256


def head_dim_reason(head_dim: int, what: str) -> str | None:
    """Why ``what`` (the kernels' name, for the message) cannot serve ``head_dim``, or
    None for every D from 1 to :data:`MAX_HEAD_DIM`."""
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        return f"head dim D={head_dim} is not supported by {what} (1 to {MAX_HEAD_DIM})"
    return None


def padded_head_dim(head_dim: int, native: tuple[int, ...] = KERNEL_HEAD_DIMS) -> int:
    """The kernel head dim that serves ``head_dim``: the smallest of ``native`` that holds
    it."""
    return next(n for n in native if head_dim <= n)


def pad_head_dim(x: jax.Array, dp: int) -> jax.Array:
    """``x [..., D]`` with ``dp - D`` zero columns appended (``x`` itself when
    ``D == dp``)."""
    d = x.shape[-1]
    return x if d == dp else jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, dp - d),))


def next_pow2(x: int) -> int:
    """Smallest power of two >= max(x, 1)."""
    return 1 << max(int(x) - 1, 0).bit_length()
