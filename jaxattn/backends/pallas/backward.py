"""Pallas (Triton lowering) attention backward, and the custom VJP that ties it to
:mod:`jaxattn.backends.pallas.forward`.

Deterministic by construction (DESIGN.md section 4), with no atomics:

* ``_delta_kernel``: ``delta = rowsum(dO * O) - dlse`` per query row, in a kernel of
  fixed tile shape (the ``- dlse`` term carries a cotangent of the returned lse).
* ``_dkdv_kernel``: one program per (KV block, batch, KV head). It loops over the
  group's query heads in ascending order and, for each, over query blocks in ascending
  order, accumulating dK and dV in registers.
* ``_dq_kernel``: one program per (query block, batch, query head), looping over KV
  blocks in ascending order.

Probabilities are recomputed from the final lse, ``p = exp(s - lse)``; rows with no
visible key (lse = -inf) and masked keys give p = 0 exactly, hence zero gradients.
Query blocks are aligned per head from query 0 and KV blocks from key 0, so a tail-padded
batch (zero cotangent on padded rows) accumulates the same products plus exact zeros.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxattn.backends.common import NEG_INF, dot, pad_head_dim, padded_head_dim, precision_for
from jaxattn.backends.pallas import forward as pallas_triton

POS_INF = float("inf")


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Tile sizes of the backward. Fixed per head dim: they set the accumulation order
    of dQ (KV block size) and dK/dV (query block size), so they never follow Sq or Skv."""

    block_q: int = 64
    block_kv: int = 64
    delta_block: int = 64
    num_warps: int = 4
    num_stages: int = 2

    #: Send blocks that every row sees whole through the unmasked step. None: on the
    #: GPU, not in interpret mode (XLA:CPU would change a dot's summation order between
    #: the two steps; Triton does not). True in interpret mode checks its values only.
    whole_blocks: bool | None = None

    def __post_init__(self):
        for name in ("block_q", "block_kv", "delta_block"):
            val = getattr(self, name)
            if val < 16 or val & (val - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {val}")


def backward_config(head_dim: int) -> BackwardConfig:
    """Default backward tiles for a head dim."""
    if head_dim > 128:
        return BackwardConfig(block_q=32, block_kv=32, num_warps=4)
    return BackwardConfig()


def _params(cfg: BackwardConfig):
    return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _delta_kernel(o_ref, do_ref, dlse_ref, delta_ref, *, q_len, block):
    tile = pl.program_id(0)
    rows = tile * block + jnp.arange(block, dtype=jnp.int32)
    ok = rows < q_len
    sl = pl.ds(tile * block, block)
    o = plgpu.load(o_ref.at[sl, :], mask=ok[:, None], other=0.0).astype(jnp.float32)
    do = plgpu.load(do_ref.at[sl, :], mask=ok[:, None], other=0.0).astype(jnp.float32)
    dlse = plgpu.load(dlse_ref.at[sl], mask=ok, other=0.0)
    plgpu.store(delta_ref.at[sl], jnp.sum(o * do, axis=1) - dlse, mask=ok)


def _probs_t(k, q, lse, visible_t, scale, precision):
    """``p^T [N, M] = exp(k q^T * scale - lse)``, exactly 0 where not visible
    (``visible_t=None``: every pair is visible)."""
    s_t = dot(k, q, trans_b=True, precision=precision) * scale
    if visible_t is not None:
        s_t = jnp.where(visible_t, s_t, NEG_INF)
    lse_safe = jnp.where(lse == NEG_INF, POS_INF, lse)
    return jnp.exp(s_t - lse_safe[None, :])


def _key_ok(mask_ref, start, block, kv_len):
    cols = start + jnp.arange(block, dtype=jnp.int32)
    ok = cols < kv_len
    if mask_ref is not None:
        ok = ok & (plgpu.load(mask_ref.at[pl.ds(start, block)], mask=ok, other=0) != 0)
    return cols, ok


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, has_mask,
                 has_offsets, causal, scale, q_len, kv_len, group, block_q, block_kv, precision,
                 whole_blocks):
    mask_ref, off_ref, (dk_ref, dv_ref) = pallas_triton._split_refs(refs, has_mask,
                                                                    has_offsets)
    kb = pl.program_id(0)
    start = kb * block_kv
    cols, ok = _key_ok(mask_ref, start, block_kv, kv_len)
    ksl = pl.ds(start, block_kv)
    k = plgpu.load(k_ref.at[ksl, :], mask=ok[:, None], other=0.0)
    v = plgpu.load(v_ref.at[ksl, :], mask=ok[:, None], other=0.0)
    head_dim = k.shape[1]
    offset = pallas_triton._causal_offset(off_ref, q_len, kv_len, pl.program_id(1))
    n_qblocks = pl.cdiv(q_len, block_q)
    # Query blocks [first, n) hold a row that sees this KV block; those in [mid, last)
    # see it whole (every row valid and past the diagonal, every key kept).
    if causal:
        first_row = start - offset
        first = jnp.clip(jnp.where(first_row < 0, 0, first_row // block_q), 0, n_qblocks)
        mid_row = start + block_kv - 1 - offset
        mid = jnp.where(mid_row <= 0, 0, (mid_row + block_q - 1) // block_q)
    else:
        first = mid = jnp.int32(0)
    if whole_blocks and mask_ref is None:
        keys_whole = start + block_kv <= kv_len
        mid = jnp.clip(mid, first, n_qblocks)
        last = jnp.where(keys_whole, jnp.maximum(q_len // block_q, mid), mid)
        mid = jnp.where(keys_whole, mid, n_qblocks)
        last = jnp.where(keys_whole, last, n_qblocks)
    else:
        mid = last = jnp.int32(n_qblocks)

    def q_body(qb, carry, h, masked):
        dk, dv = carry
        qsl = pl.ds(qb * block_q, block_q)
        if masked:
            rows = qb * block_q + jnp.arange(block_q, dtype=jnp.int32)
            row_ok = rows < q_len
            q = plgpu.load(q_ref.at[h, qsl, :], mask=row_ok[:, None], other=0.0)
            do = plgpu.load(do_ref.at[h, qsl, :], mask=row_ok[:, None], other=0.0)
            lse = plgpu.load(lse_ref.at[h, qsl], mask=row_ok, other=NEG_INF)
            delta = plgpu.load(delta_ref.at[h, qsl], mask=row_ok, other=0.0)
            visible_t = ok[:, None] & row_ok[None, :]
            if causal:
                visible_t = visible_t & (cols[:, None] <= rows[None, :] + offset)
        else:
            q, do = q_ref[h, qsl, :], do_ref[h, qsl, :]
            lse, delta = lse_ref[h, qsl], delta_ref[h, qsl]
            visible_t = None
        p_t = _probs_t(k, q, lse, visible_t, scale, precision)
        dv = dv + dot(p_t.astype(do.dtype), do, precision=precision)
        dp_t = dot(v, do, trans_b=True, precision=precision)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = dk + dot(ds_t.astype(q.dtype), q, precision=precision)
        return dk, dv

    def head_body(h, carry):
        # Ascending query blocks; the whole/masked split changes no bits.
        carry = jax.lax.fori_loop(first, mid, functools.partial(q_body, h=h, masked=True),
                                  carry)
        if whole_blocks and mask_ref is None and q_len >= block_q:
            carry = jax.lax.fori_loop(mid, last,
                                      functools.partial(q_body, h=h, masked=False), carry)
        return jax.lax.fori_loop(jnp.maximum(last, first), n_qblocks,
                                 functools.partial(q_body, h=h, masked=True), carry)

    zeros = jnp.zeros((block_kv, head_dim), jnp.float32)
    dk, dv = jax.lax.fori_loop(0, group, head_body, (zeros, zeros))
    in_range = (cols < kv_len)[:, None]
    plgpu.store(dk_ref.at[ksl, :], (dk * scale).astype(dk_ref.dtype), mask=in_range)
    plgpu.store(dv_ref.at[ksl, :], dv.astype(dv_ref.dtype), mask=in_range)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, has_mask, has_offsets,
               has_acc, causal, scale, q_len, kv_len, block_q, block_kv, precision,
               whole_blocks):
    mask_ref, off_ref, refs = pallas_triton._split_refs(refs, has_mask, has_offsets)
    acc_ref = refs[0] if has_acc else None
    dq_ref = refs[-1]
    qb = pl.program_id(0)
    rows = qb * block_q + jnp.arange(block_q, dtype=jnp.int32)
    row_ok = rows < q_len
    qsl = pl.ds(qb * block_q, block_q)
    q = plgpu.load(q_ref.at[qsl, :], mask=row_ok[:, None], other=0.0)
    do = plgpu.load(do_ref.at[qsl, :], mask=row_ok[:, None], other=0.0)
    lse = plgpu.load(lse_ref.at[qsl], mask=row_ok, other=NEG_INF)
    delta = plgpu.load(delta_ref.at[qsl], mask=row_ok, other=0.0)
    offset = pallas_triton._causal_offset(off_ref, q_len, kv_len, pl.program_id(1))
    limit = rows + offset
    n_kv = pl.cdiv(kv_len, block_kv)
    full = 0 if (has_mask or not whole_blocks) else kv_len // block_kv
    if causal:
        last_lim = jnp.max(jnp.where(row_ok, limit, -1))
        hi = jnp.clip(jnp.where(last_lim < 0, 0, last_lim // block_kv + 1), 0, n_kv)
        first_lim = qb * block_q + offset
        full = jnp.clip(jnp.where(first_lim < 0, 0, (first_lim + 1) // block_kv), 0, full)
    else:
        hi = jnp.int32(n_kv)
        full = jnp.int32(full)
    lse_safe = jnp.where(lse == NEG_INF, POS_INF, lse)

    def body(j, dq, masked):
        start = j * block_kv
        ksl = pl.ds(start, block_kv)
        if masked:
            cols, ok = _key_ok(mask_ref, start, block_kv, kv_len)
            k = plgpu.load(k_ref.at[ksl, :], mask=ok[:, None], other=0.0)
            v = plgpu.load(v_ref.at[ksl, :], mask=ok[:, None], other=0.0)
        else:
            k, v = k_ref[ksl, :], v_ref[ksl, :]
        s = dot(q, k, trans_b=True, precision=precision) * scale
        if masked:
            visible = ok[None, :] & row_ok[:, None]
            if causal:
                visible = visible & (cols[None, :] <= limit[:, None])
            s = jnp.where(visible, s, NEG_INF)
        p = jnp.exp(s - lse_safe[:, None])
        dp = dot(do, v, trans_b=True, precision=precision)
        ds = p * (dp - delta[:, None])
        return dq + dot(ds.astype(k.dtype), k, precision=precision)

    if acc_ref is None:
        dq = jnp.zeros(q.shape, jnp.float32)
    else:  # continue the accumulation of earlier key ranges (context parallelism)
        dq = plgpu.load(acc_ref.at[qsl, :], mask=row_ok[:, None], other=0.0)
    if whole_blocks and not has_mask and kv_len >= block_kv:
        full = jnp.minimum(full, hi)
        dq = jax.lax.fori_loop(0, full, functools.partial(body, masked=False), dq)
    else:
        full = jnp.int32(0)
    dq = jax.lax.fori_loop(full, hi, functools.partial(body, masked=True), dq)
    # Unscaled fp32 accumulator: the caller scales and casts after the last key range.
    plgpu.store(dq_ref.at[qsl, :], dq, mask=row_ok[:, None])


def _head(blk):
    return pl.BlockSpec((None, None, *blk), lambda i, bi, hi: (bi, hi, 0, 0))


def _head_vec(n):
    return pl.BlockSpec((None, None, n), lambda i, bi, hi: (bi, hi, 0))


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def delta(out, d_out, d_lse, *, interpret: bool, config: BackwardConfig | None = None):
    """``rowsum(dO * O) - dlse`` per query row, fp32 ``[B, Hq, Sq]``, in a Pallas kernel
    (any head dim: zero columns, as the forward pads them, add exact zeros)."""
    dp = padded_head_dim(out.shape[-1])
    out, d_out = pad_head_dim(out, dp), pad_head_dim(d_out, dp)
    b, hq, sq, d = out.shape
    cfg = config or backward_config(d)
    d_lse = jnp.zeros((b, hq, sq), jnp.float32) if d_lse is None else d_lse.astype(
        jnp.float32)
    return pl.pallas_call(
        functools.partial(_delta_kernel, q_len=sq, block=cfg.delta_block),
        grid=(pl.cdiv(sq, cfg.delta_block), b, hq),
        in_specs=[_head((sq, d)), _head((sq, d)), _head_vec(sq)],
        out_specs=_head_vec(sq),
        out_shape=jax.ShapeDtypeStruct((b, hq, sq), jnp.float32),
        compiler_params=_params(cfg),
        interpret=interpret,
        name="jaxattn_bwd_delta",
    )(out, d_out.astype(out.dtype), d_lse)


def _common(q, k, key_padding_mask, causal_offsets, causal, scale, interpret, config):
    """Shapes, tiles, the optional mask/offset operands and the static kernel options
    shared by the dK/dV and dQ launches."""
    b, hq, sq, d = q.shape
    skv = k.shape[2]
    cfg = config or backward_config(d)
    has_mask = key_padding_mask is not None
    has_offsets = causal and causal_offsets is not None
    extra_specs, extra_args = [], []
    if has_mask:
        extra_specs.append(pl.BlockSpec((None, skv), lambda i, bi, hi: (bi, 0)))
        extra_args.append(key_padding_mask.astype(jnp.int32))
    if has_offsets:
        extra_specs.append(pl.BlockSpec((b,), lambda i, bi, hi: (0,)))
        extra_args.append(jnp.asarray(causal_offsets, jnp.int32).reshape(b))
    static = dict(has_mask=has_mask, has_offsets=has_offsets, causal=causal, scale=scale,
                  q_len=sq, kv_len=skv, block_q=cfg.block_q, block_kv=cfg.block_kv,
                  precision=precision_for(q.dtype),
                  whole_blocks=(not interpret) if cfg.whole_blocks is None
                  else cfg.whole_blocks)
    return (b, hq, sq, d, k.shape[1], skv, hq // k.shape[1], cfg), extra_specs, extra_args, \
        static


@functools.partial(jax.jit, static_argnames=("causal", "scale", "interpret", "config"))
def dkdv(q, k, v, d_out, lse, delta_, key_padding_mask=None, causal_offsets=None, *,
         causal: bool, scale: float, interpret: bool, config: BackwardConfig | None = None):
    """dK, dV of the keys in ``k``/``v`` from every query row, given the final lse and
    delta of those rows: ``([B, Hkv, Skv, D], [B, Hkv, Skv, D])`` in k's dtype."""
    d_real = q.shape[-1]
    dp = padded_head_dim(d_real)
    q, k, v, d_out = (pad_head_dim(x, dp) for x in (q, k, v, d_out))
    (b, hq, sq, d, hkv, skv, g, cfg), specs, args, static = _common(
        q, k, key_padding_mask, causal_offsets, causal, scale, interpret, config)
    group = lambda blk: pl.BlockSpec((None, g, *blk), lambda i, bi, hi: (bi, hi, 0, 0))
    group_vec = pl.BlockSpec((None, g, sq), lambda i, bi, hi: (bi, hi, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, group=g, **static),
        grid=(pl.cdiv(skv, cfg.block_kv), b, hkv),
        in_specs=[group((sq, d)), _head((skv, d)), _head((skv, d)), group((sq, d)),
                  group_vec, group_vec, *specs],
        out_specs=[_head((skv, d)), _head((skv, d))],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_params(cfg),
        interpret=interpret,
        name="jaxattn_bwd_dkdv",
    )(q, k, v, d_out.astype(q.dtype), lse, delta_, *args)
    return dk[..., :d_real], dv[..., :d_real]


@functools.partial(jax.jit, static_argnames=("causal", "scale", "interpret", "config"))
def dq_accumulate(q, k, v, d_out, lse, delta_, key_padding_mask=None, causal_offsets=None,
                  acc=None, *, causal: bool, scale: float, interpret: bool,
                  config: BackwardConfig | None = None):
    """The unscaled fp32 dQ accumulator after the keys in ``k``/``v``, continuing ``acc``
    (the accumulator after all earlier keys, or None). ``dq = (acc * scale)`` cast to
    q's dtype after the last key range; folding key ranges in ascending order this way
    gives the bits of one call over all keys when ranges start on KV-block boundaries."""
    d_real = q.shape[-1]
    dp = padded_head_dim(d_real)
    q, k, v, d_out = (pad_head_dim(x, dp) for x in (q, k, v, d_out))
    acc = None if acc is None else pad_head_dim(acc, dp)
    (b, hq, sq, d, hkv, skv, g, cfg), specs, args, static = _common(
        q, k, key_padding_mask, causal_offsets, causal, scale, interpret, config)
    acc_specs, acc_args = ([_head((sq, d))], [acc]) if acc is not None else ([], [])
    kv_head = lambda blk: pl.BlockSpec((None, None, *blk),
                                       lambda i, bi, hi: (bi, hi // g, 0, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, has_acc=acc is not None, **static),
        grid=(pl.cdiv(sq, cfg.block_q), b, hq),
        in_specs=[_head((sq, d)), kv_head((skv, d)), kv_head((skv, d)), _head((sq, d)),
                  _head_vec(sq), _head_vec(sq), *specs, *acc_specs],
        out_specs=_head((sq, d)),
        out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32),
        compiler_params=_params(cfg),
        interpret=interpret,
        name="jaxattn_bwd_dq",
    )(q, k, v, d_out.astype(q.dtype), lse, delta_, *args, *acc_args)
    return dq[..., :d_real]


@functools.partial(jax.jit, static_argnames=("causal", "scale", "interpret", "config"))
def backward(q, k, v, key_padding_mask, out, lse, d_out, d_lse, causal_offsets=None, *,
             causal: bool, scale: float, interpret: bool,
             config: BackwardConfig | None = None):
    """Gradients ``(dq, dk, dv)`` of the forward, given cotangents of out and lse.

    ``config`` (default :func:`backward_config`) sets the tiles, hence the accumulation
    order: keep one config per head dim for results to stay comparable run to run.
    """
    sq, skv = q.shape[2], k.shape[2]
    if sq == 0 or skv == 0:
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    kw = dict(causal=causal, scale=scale, interpret=interpret, config=config)
    dl = delta(out, d_out, d_lse, interpret=interpret, config=config)
    dk, dv = dkdv(q, k, v, d_out, lse, dl, key_padding_mask, causal_offsets, **kw)
    acc = dq_accumulate(q, k, v, d_out, lse, dl, key_padding_mask, causal_offsets, **kw)
    return (acc * scale).astype(q.dtype), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def attention(q, k, v, key_padding_mask, causal_offsets, causal: bool, scale: float,
              interpret: bool):
    """``(out, lse)`` through the Pallas forward, differentiable by the Pallas backward.
    ``causal_offsets``: ``[B]`` int or None (see :func:`forward.forward`)."""
    return pallas_triton.forward(q, k, v, key_padding_mask, causal_offsets, causal=causal,
                                 scale=scale, interpret=interpret)


def _attention_fwd(q, k, v, key_padding_mask, causal_offsets, causal, scale, interpret):
    out, lse = pallas_triton.forward(q, k, v, key_padding_mask, causal_offsets, causal=causal,
                                     scale=scale, interpret=interpret)
    return (out, lse), (q, k, v, key_padding_mask, causal_offsets, out, lse)


def _attention_bwd(causal, scale, interpret, residuals, cotangents):
    q, k, v, key_padding_mask, causal_offsets, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dk, dv = backward(q, k, v, key_padding_mask, out, lse, d_out.astype(out.dtype),
                          d_lse, causal_offsets, causal=causal, scale=scale,
                          interpret=interpret)
    return dq, dk, dv, None, None


attention.defvjp(_attention_fwd, _attention_bwd)
