"""The reference attention: plain ``jax.numpy``, the ground truth of the library.

``forward_fp32`` / ``forward_fp32_with_lse`` upcast to fp32 and compute every matmul at
``precision=HIGHEST`` whatever the caller's ambient ``jax.default_matmul_precision``.
``forward`` / ``forward_with_lse`` keep the input dtype at the matmul inputs (fp32
accumulation, fp32 softmax) and return the input dtype. Everything here is jittable and
differentiable; rows with no visible key give ``out = 0``, ``lse = -inf`` and zero
gradients, never NaN.

This backend promises the first two rows of the invariance matrix (a sequence alone vs
inside a batch, run to run); it does not follow the blocked schedule of
:mod:`jaxattn.schedule`, so its bits differ from the kernels' (tolerance, not bits).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxattn.validation import resolve_scale, validate_inputs

_NEG_INF = float("-inf")


def visibility(
    q_len: int,
    kv_len: int,
    *,
    causal: bool,
    key_padding_mask: jax.Array | None,
    batch: int,
    query_positions: jax.Array | None = None,
    key_positions: jax.Array | None = None,
) -> jax.Array:
    """Boolean ``[B, 1, Sq, Skv]``: may query i attend to key j.

    Causal rule: key j is visible to query i iff ``pos_k(j) <= pos_q(i)`` where by
    default ``pos_q(i) = i + (Skv - Sq)`` and ``pos_k(j) = j`` (one rule for prefill,
    chunked prefill and decode). ``query_positions`` / ``key_positions`` (``[B, Sq]`` /
    ``[B, Skv]`` int) override the positions for context parallelism.
    """
    if query_positions is None:
        query_positions = jnp.broadcast_to(
            jnp.arange(q_len, dtype=jnp.int32) + (kv_len - q_len), (batch, q_len))
    if key_positions is None:
        key_positions = jnp.broadcast_to(jnp.arange(kv_len, dtype=jnp.int32), (batch, kv_len))
    visible = jnp.ones((batch, 1, q_len, kv_len), dtype=bool)
    if causal:
        visible = visible & (key_positions[:, None, None, :] <= query_positions[:, None, :, None])
    if key_padding_mask is not None:
        visible = visible & key_padding_mask[:, None, None, :]
    return visible


def _attend_one(q, k, v, visible, *, scale, precision, p_dtype):
    """One sequence: q ``[Hq, Sq, D]``, k/v ``[Hkv, Skv, D]``, visible ``[1, Sq, Skv]``."""
    hq, sq, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    # fp32 for every public dtype; float64 inputs (tests only) stay float64.
    acc_t = jnp.promote_types(q.dtype, jnp.float32)
    qg = q.reshape(hkv, g, sq, d)
    # Keys no query sees are zeroed, so padding holding NaN or inf cannot leak through
    # 0 * NaN in the matmuls.
    seen = jnp.any(visible, axis=1)[:, :, None]  # [1, Skv, 1]
    k = jnp.where(seen, k, jnp.zeros((), k.dtype))
    v = jnp.where(seen, v, jnp.zeros((), v.dtype))
    s = jnp.einsum("hgqd,hkd->hgqk", qg, k, precision=precision,
                   preferred_element_type=acc_t) * jnp.asarray(scale, acc_t)
    vis = visible[:, None]  # [1, 1, Sq, Skv]
    s = jnp.where(vis, s, _NEG_INF)
    m = lax.stop_gradient(jnp.max(s, axis=-1, initial=_NEG_INF, keepdims=True))
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(vis, jnp.exp(s - m_safe), 0.0)
    l = jnp.sum(p, axis=-1)
    acc = jnp.einsum("hgqk,hkd->hgqd", p.astype(p_dtype), v, precision=precision,
                     preferred_element_type=acc_t)
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    out = jnp.where(empty[..., None], 0.0, acc / l_safe[..., None])
    lse = jnp.where(empty, _NEG_INF, m_safe[..., 0] + jnp.log(l_safe))
    return out.reshape(hq, sq, d), lse.reshape(hq, sq)


def _map(fn, xs):
    """``lax.map`` over the batch. XLA drops a loop of one trip and compiles its body in
    another context (seen on the H200: other bits than inside a batch), so a batch of one
    runs as two identical trips."""
    if xs[0].shape[0] == 1:
        outs = lax.map(lambda a: fn(*a), tuple(jnp.concatenate([x, x], axis=0) for x in xs))
        return jax.tree_util.tree_map(lambda y: y[:1], outs)
    return lax.map(lambda a: fn(*a), xs)


def _attend(q, k, v, *, scale, visible, precision, p_dtype):
    """Softmax attention with GQA on ``[B, H, S, D]``; returns fp32 (out, lse).

    The batch is walked by a loop whose body is one sequence, forward and backward (the
    VJP recomputes the sequence's forward inside its own loop rather than slicing
    residuals stacked over the batch): every sequence runs the same compiled
    computation whatever B is, which keeps its bits alone or inside any batch.
    """
    fn = functools.partial(_attend_one, scale=scale, precision=precision, p_dtype=p_dtype)

    @jax.custom_vjp
    def mapped(q, k, v, visible):
        return _map(fn, (q, k, v, visible))

    def mapped_fwd(q, k, v, visible):
        return _map(fn, (q, k, v, visible)), (q, k, v, visible)

    def mapped_bwd(res, cts):
        def one(q1, k1, v1, vis1, d_out, d_lse):
            _, vjp = jax.vjp(lambda a, b, c: fn(a, b, c, vis1), q1, k1, v1)
            return vjp((d_out, d_lse))
        dq, dk, dv = _map(one, (*res, *cts))
        return dq, dk, dv, None

    mapped.defvjp(mapped_fwd, mapped_bwd)
    return mapped(q, k, v, visible)


def forward_fp32_with_lse(q, k, v, *, causal=True, scale=None, key_padding_mask=None,
                          query_positions=None, key_positions=None):
    """fp32 ground truth: returns ``(out [B, Hq, Sq, D] fp32, lse [B, Hq, Sq] fp32)``.

    Inputs are upcast to fp32 and every matmul runs at ``precision=HIGHEST`` regardless
    of the ambient default matmul precision.
    """
    dims = validate_inputs(q, k, v, causal=causal, scale=scale,
                           key_padding_mask=key_padding_mask)
    return _forward_jit(q, k, v, key_padding_mask, query_positions, key_positions,
                        causal=causal, scale=resolve_scale(scale, dims.head_dim), fp32=True)


def forward_fp32(q, k, v, *, causal=True, scale=None, key_padding_mask=None):
    """fp32 ground truth output ``[B, Hq, Sq, D]`` fp32 (see :func:`forward_fp32_with_lse`)."""
    return forward_fp32_with_lse(q, k, v, causal=causal, scale=scale,
                                 key_padding_mask=key_padding_mask)[0]


def forward_with_lse(q, k, v, *, causal=True, scale=None, key_padding_mask=None,
                     query_positions=None, key_positions=None):
    """Input-dtype path: returns ``(out [B, Hq, Sq, D] in q.dtype, lse [B, Hq, Sq] fp32)``.

    Matmul inputs stay in the input dtype (probabilities are cast to it before P @ V),
    accumulation and softmax are fp32, at the caller's ambient matmul precision for 16-bit
    inputs and at ``HIGHEST`` for fp32 inputs.
    """
    dims = validate_inputs(q, k, v, causal=causal, scale=scale,
                           key_padding_mask=key_padding_mask)
    return _forward_jit(q, k, v, key_padding_mask, query_positions, key_positions,
                        causal=causal, scale=resolve_scale(scale, dims.head_dim), fp32=False)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "fp32"))
def _forward_jit(q, k, v, key_padding_mask, query_positions, key_positions, *, causal,
                 scale, fp32):
    """The two forwards' one program: jitted, so that an eager call compiles one
    computation per shape instead of an XLA computation per operation (four times the
    compile time on a CPU). Inside a caller's jit it is inlined (the same program as
    before: XLA inlines the nested call). The ambient matmul precision is part of
    jit's cache key."""
    batch, _, q_len, _ = q.shape
    vis = visibility(q_len, k.shape[2], causal=causal, batch=batch,
                     key_padding_mask=key_padding_mask,
                     query_positions=query_positions, key_positions=key_positions)
    if fp32:  # upcast; every matmul at HIGHEST whatever the ambient precision
        f32 = jnp.float32
        return _attend(q.astype(f32), k.astype(f32), v.astype(f32), scale=scale,
                       visible=vis, precision=lax.Precision.HIGHEST, p_dtype=f32)
    # fp32 inputs multiply in true fp32 (as the kernels do), not in the GPU's tf32.
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    out, lse = _attend(q, k, v, scale=scale, visible=vis, precision=precision,
                       p_dtype=q.dtype)
    return out.astype(q.dtype), lse


def forward(q, k, v, *, causal=True, scale=None, key_padding_mask=None):
    """Input-dtype path output ``[B, Hq, Sq, D]`` in ``q.dtype``."""
    return forward_with_lse(q, k, v, causal=causal, scale=scale,
                            key_padding_mask=key_padding_mask)[0]
