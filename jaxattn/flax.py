"""Flax's ``attention_fn`` on jaxattn's kernels (no Flax import here: the function is
plain JAX, Flax calls it).

``flax.nnx.MultiHeadAttention(..., attention_fn=jaxattn.flax.dot_product_attention)``
and ``flax.linen.MultiHeadDotProductAttention(..., attention_fn=...)`` call it with
Flax's ``dot_product_attention`` arguments on ``[batch..., length, heads, head_dim]``
arrays; it runs :func:`jaxattn.nn.dot_product_attention` (JAX's layout, read in place
where the backend can). Flax's causal masks are dense boolean arrays, which jaxattn does
not take: ask for causality by name instead, ``is_causal=True`` in the call of an nnx
module (nnx passes it through), or :func:`attention_fn` with ``is_causal=True`` for a
linen module, and leave ``mask`` None.

Refused with a ValueError naming the argument: a ``mask`` or ``bias``, dropout (a
``dropout_rate`` above 0 unless ``deterministic=True``: dropout would make the result
random), ``module`` (sowing the attention weights: jaxattn never forms them) and a
``precision`` other than None / DEFAULT (the kernels' products are fixed).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from jaxattn import nn

__all__ = ["attention_fn", "dot_product_attention"]


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                          dropout_rng=None, dropout_rate=0.0, deterministic=False,
                          dtype=None, precision=None, module=None, promote_dtype=None,
                          is_causal=False, *, implementation: str | None = None):
    """Flax's ``dot_product_attention`` signature on :func:`jaxattn.nn.
    dot_product_attention`. ``query [batch..., T, N, H]``, ``key, value [batch..., S,
    K, H]`` (any number of batch dims, none included); ``dtype``: the inputs are cast to
    it (or to their promoted dtype, as Flax does); ``implementation``: a jaxattn
    backend name or None."""
    del broadcast_dropout, dropout_rng  # dropout is refused below
    if dropout_rate and not deterministic:
        raise ValueError(f"dropout_rate={dropout_rate}: jaxattn has no attention dropout "
                         f"(pass deterministic=True or dropout_rate=0)")
    if module is not None:
        raise ValueError("module: jaxattn never forms the attention weights, so there is "
                         "nothing to sow (sow_weights=False)")
    if precision not in (None, lax.Precision.DEFAULT, "default"):
        raise ValueError(f"precision={precision!r}: jaxattn's kernels have fixed products "
                         f"(None or DEFAULT)")
    if promote_dtype is not None:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
    else:
        dt = dtype or jnp.result_type(query, key, value)
        query, key, value = (jnp.asarray(x, dt) for x in (query, key, value))
    batch = query.shape[:-3]
    if key.shape[:-3] != batch or value.shape[:-3] != batch:
        raise ValueError(f"query, key and value must share their batch dims, got "
                         f"{query.shape}, {key.shape}, {value.shape}")
    flat = len(batch) != 1

    def four(x):
        return x.reshape(math.prod(batch), *x.shape[-3:]) if flat else x

    out = nn.dot_product_attention(four(query), four(key), four(value), bias, mask,
                                   is_causal=bool(is_causal), implementation=implementation)
    return out.reshape(query.shape) if flat else out


def attention_fn(*, is_causal: bool = False, implementation: str | None = None):
    """A Flax ``attention_fn`` with causality (and the backend) fixed: for linen's
    ``MultiHeadDotProductAttention``, which passes no ``is_causal``. A call's own
    ``is_causal=True`` (nnx passes one, False by default) adds to it, never removes it."""
    fixed = bool(is_causal)

    def fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
           dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
           precision=None, module=None, promote_dtype=None, is_causal=False):
        return dot_product_attention(
            query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
            deterministic, dtype, precision, module, promote_dtype,
            is_causal=fixed or bool(is_causal), implementation=implementation)

    return fn
