"""The one merge of two attention partial states (DESIGN.md sections 4 and 5).

A partial state over a contiguous key range is ``(out, lse)``: ``out`` the fp32 softmax
average of V over the visible keys of the range, ``lse`` the fp32 natural-log sum of
exp(scores) over them. An empty range is ``(0, -inf)``.

:func:`merge` is the only function in the library that combines two states. The Pallas
kernels trace this same function inside their bodies (the split fold of the prefill
kernel, the combine kernel of split-KV decode), so every path runs the same sequence of
floating-point operations. It uses ``exp``/``log`` (never ``exp2``, whose GPU
instruction is approximate) and guards non-finite lse: a ``-inf`` side gets weight
exactly zero and the other side's bits come back unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = float("-inf")


def merge(
    out_left: jax.Array, lse_left: jax.Array, out_right: jax.Array, lse_right: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Merge the partial state of a key range with that of the range right after it.

    Args:
      out_left: ``[..., D]`` fp32, normalised output over the left (earlier) keys.
      lse_left: ``[...]`` fp32 natural-log sum-exp over the left keys (``-inf``: empty).
      out_right: ``[..., D]`` fp32, the same over the right (later) keys.
      lse_right: ``[...]`` fp32.

    Returns:
      ``(out, lse)`` over the union of the two ranges. When one side is empty
      (``lse == -inf``) the other side is returned bit for bit.
    """
    m = jnp.maximum(lse_left, lse_right)
    m_safe = jnp.where(m == _NEG_INF, 0.0, m)
    w_left = jnp.exp(lse_left - m_safe)
    w_right = jnp.exp(lse_right - m_safe)
    total = w_left + w_right
    total_safe = jnp.where(total == 0.0, 1.0, total)
    lse = m_safe + jnp.log(total_safe)
    a_left = (w_left / total_safe)[..., None]
    a_right = (w_right / total_safe)[..., None]
    out = out_left * a_left + out_right * a_right
    left_empty = lse_left == _NEG_INF
    right_empty = lse_right == _NEG_INF
    out = jnp.where(right_empty[..., None], out_left,
                    jnp.where(left_empty[..., None], out_right, out))
    lse = jnp.where(right_empty, lse_left, jnp.where(left_empty, lse_right, lse))
    return out, lse


def finalize(acc: jax.Array, m: jax.Array, l: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Turn an online-softmax accumulator into a partial state.

    Args:
      acc: ``[..., D]`` fp32 unnormalised sum of p * v.
      m: ``[...]`` fp32 running max of the scores (``-inf`` when nothing was visible).
      l: ``[...]`` fp32 running sum of exp(score - m).

    Returns:
      ``(out, lse)``; ``(0, -inf)`` where no key was visible (``l == 0``).
    """
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    out = jnp.where(empty[..., None], 0.0, acc / l_safe[..., None])
    lse = jnp.where(empty, _NEG_INF, m + jnp.log(l_safe))
    return out, lse


def fold(outs: jax.Array, lses: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Fold partial states stacked on the leading axis (in that order, ascending key
    ranges) into one, left to right with ``lax.scan`` over :func:`merge`, starting from
    the empty state."""
    init = (jnp.zeros_like(outs[0]), jnp.full_like(lses[0], _NEG_INF))
    state, _ = jax.lax.scan(lambda acc, x: (merge(*acc, *x), None), init, (outs, lses))
    return state
