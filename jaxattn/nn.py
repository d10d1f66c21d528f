"""``jax.nn.dot_product_attention``'s signature and semantics on jaxattn's kernels.

:func:`dot_product_attention` is a drop-in for ``jax.nn.dot_product_attention``: the
same arguments, JAX's ``[B, T, N, H]`` layout in and out (``[T, N, H]`` too), read and
written in place by the kernels of backends that can (``"mosaic"``: each tile a strided
TMA box, forward and backward; other backends transpose, as their kernels take ``[B,
H, S, D]``). Its bits are those of :func:`jaxattn.attention` on the transposed inputs
(with jax.nn's causal rule mapped, below), so every row of the invariance matrix holds.

Where the semantics differ from :func:`jaxattn.attention`:

* ``is_causal`` is jax.nn's rule: query i sees key j iff ``j <= i`` (top-left
  aligned). jaxattn's ``causal`` aligns the last query with the last key (``j <= i +
  Skv - Sq``); the two agree when ``Sq == Skv`` and differ otherwise (a chunk of
  queries against a longer cache needs jaxattn's rule: :func:`jaxattn.attention`).
* ``key_value_seq_lengths``: keys at and past ``key_value_seq_lengths[b]`` are dropped
  (padding; they may hold anything, NaN included). ``query_seq_lengths``: rows at and
  past ``query_seq_lengths[b]`` are padding: their output is 0 (as jax.nn gives) and
  their gradients are 0, whatever they hold.
* A row that sees no key (``key_value_seq_lengths[b] == 0``) gives 0; jax.nn's XLA
  implementation gives the mean of the values there (its mask is a large negative
  number, not -inf).
* ``bias``, a dense ``mask`` and ``local_window_size`` are refused (ValueError naming
  the argument): jaxattn serves causal and padding masks on its fixed schedule only.
* ``implementation``: None (the registry's choice, as :func:`jaxattn.attention`) or a
  jaxattn backend name; jax.nn's ``"xla"`` and ``"cudnn"`` are refused (they are
  jax.nn's own implementations, other bits).
* ``return_residual``: the lse ``[B, T, N]`` in the inputs' dtype, as jax.nn returns it
  (``jaxattn.attention(..., return_lse=True)`` gives it in fp32).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxattn import registry
from jaxattn.validation import as_bhsd, resolve_scale, validate_inputs

__all__ = ["dot_product_attention"]

#: jax.nn's own implementations, which jaxattn does not run.
JAX_IMPLEMENTATIONS = ("xla", "cudnn")


def _refuse(name: str, value, why: str) -> None:
    if value is not None:
        raise ValueError(f"{name}: {why}; got {type(value).__name__}"
                         f"{' ' + str(tuple(value.shape)) if hasattr(value, 'shape') else ''}")


def _lengths(name: str, x, b: int):
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.shape != (b,) or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be int32 of shape [B] = ({b},), got {x.dtype} "
                         f"{tuple(x.shape)}")
    return x.astype(jnp.int32)


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal: bool = False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None,
                          implementation: str | None = None, return_residual: bool = False):
    """``jax.nn.dot_product_attention`` on jaxattn's deterministic, batch-invariant kernels.

    Args:
      query: ``[B, T, N, H]`` (or ``[T, N, H]``) bf16, fp16 or fp32.
      key, value: ``[B, S, K, H]`` (or ``[S, K, H]``), the query's dtype; ``N % K == 0``
        (GQA: query head n reads KV head ``n // (N // K)``).
      bias, mask: must be None (ValueError otherwise): jaxattn serves causal and padding
        masks only (``is_causal``, ``key_value_seq_lengths``, ``query_seq_lengths``).
      scale: None -> ``1/sqrt(H)``; an explicit value verbatim.
      is_causal: query i sees key j iff ``j <= i`` (jax.nn's top-left rule).
      query_seq_lengths: int ``[B]``: rows from ``query_seq_lengths[b]`` on are padding
        (output 0, gradients 0).
      key_value_seq_lengths: int ``[B]``: keys from ``key_value_seq_lengths[b]`` on are
        dropped.
      local_window_size: must be None (ValueError otherwise).
      implementation: None (the registry's default backend: ``"mosaic"`` on sm90) or a
        jaxattn backend name (``"mosaic"``, ``"pallas"``, ``"triton"``, ``"reference"``).
      return_residual: also return the logsumexp ``[B, T, N]`` in the inputs' dtype.

    Returns:
      The output, the query's shape and dtype; with ``return_residual``, ``(output,
      lse)``.
    """
    _refuse("bias", bias, "jaxattn serves no additive bias (its kernels' fixed schedule "
            "has causal and padding masks only)")
    _refuse("mask", mask, "jaxattn serves no dense mask; pass is_causal=True and/or "
            "key_value_seq_lengths / query_seq_lengths for causal and padding masks")
    if local_window_size is not None:
        raise ValueError(f"local_window_size: jaxattn serves no sliding window; got "
                         f"{local_window_size!r}")
    if implementation in JAX_IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} is jax.nn's own; jaxattn takes "
                         f"None or a backend name: "
                         f"{', '.join(registry.backend_names('attention'))}")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    ranks = {query.ndim, key.ndim, value.ndim}
    if len(ranks) != 1 or query.ndim not in (3, 4):
        raise ValueError(f"query, key and value must all be [B, T, N, H] or all [T, N, H]; "
                         f"got shapes {query.shape}, {key.shape}, {value.shape}")
    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = (x[None] for x in (query, key, value))
    b, t, n, h = query.shape
    s = key.shape[1]
    if key.shape != value.shape:
        raise ValueError(f"key and value must have the same shape [B, S, K, H], got "
                         f"{key.shape} and {value.shape}")
    if key.shape[0] != b or key.shape[3] != h:
        raise ValueError(f"key must be [B, S, K, H] with query's B={b} and H={h}, got "
                         f"{key.shape} (query {query.shape})")
    # The contract's checks (dtypes, N % K, the scale) on the [B, H, S, D] view.
    dims = validate_inputs(*(as_bhsd(x) for x in (query, key, value)),
                           causal=bool(is_causal), scale=scale)
    q_len = _lengths("query_seq_lengths", query_seq_lengths, b)
    kv_len = _lengths("key_value_seq_lengths", key_value_seq_lengths, b)
    be = registry.resolve("attention", implementation)
    reason = be.unsupported(dims, "attention")
    if reason is not None:
        raise ValueError(f"backend {be.name!r} cannot serve this call: {reason}")
    keep = None if kv_len is None else jnp.arange(s)[None, :] < kv_len[:, None]
    # jax.nn's causal rule is top-left: offset 0 for every sequence (bottom-right, the
    # kernels' static rule, is the same when T == S).
    offsets = jnp.zeros((b,), jnp.int32) if is_causal and t != s else None
    rows = None
    if q_len is not None:  # padding rows: zeroed in (finite) and out
        rows = (jnp.arange(t)[None, :] < q_len[:, None])[:, :, None, None]
        query = jnp.where(rows, query, jnp.zeros((), query.dtype))
    out, lse = be.forward_with_lse_btnh(query, key, value, causal=bool(is_causal),
                                        scale=resolve_scale(scale, h),
                                        key_padding_mask=keep, causal_offsets=offsets)
    if rows is not None:
        out = jnp.where(rows, out, jnp.zeros((), out.dtype))
        lse = jnp.where(jnp.swapaxes(rows[..., 0], 1, 2), lse, -jnp.inf)
    if unbatched:
        out, lse = out[0], lse[0]
    if not return_residual:
        return out
    return out, jnp.swapaxes(lse, -1, -2).astype(out.dtype)
