"""The canonical schedule (DESIGN.md section 4) written directly in Triton.

These kernels mirror the Pallas kernels of :mod:`jaxattn.backends.pallas.forward` and
:mod:`jaxattn.backends.pallas.backward` operation for operation: the same tiles, the same
``BLOCK_N`` / ``SPLIT`` walk, the same online-softmax step as
:func:`jaxattn.backends.common.online_softmax_step`, the same finalize and merge as
:mod:`jaxattn.merge`, the same backward loops. :mod:`jaxattn.backends.triton.launch` calls
them through ``jax_triton.triton_call`` on the GPU and through Triton's interpreter on a
CPU.

Forward:

* ``fwd_prefill_kernel``: one program per (row tile, batch, KV head). Row ``r`` of a tile
  is query ``r % Sq`` of the KV head's query head ``r // Sq`` (the group's heads stacked,
  as in the Pallas kernel). It walks the splits of ``SPLIT`` keys in ascending order;
  inside a split it folds ``BLOCK_N`` key blocks in ascending order by online softmax
  (running max m, running sum l, unnormalised accumulator, all fp32), finalises the split
  and merges it into the running state with the one merge.
* ``fwd_split_kernel`` + ``fwd_combine_kernel``: split-KV parallelism. One program per
  (row tile x split, batch, KV head) writes the split's partial state; the combine kernel
  folds the splits in ascending order with the same merge. Per row, the same operations
  as the prefill kernel.

Backward (no atomics; every accumulation has a fixed order):

* ``bwd_delta_kernel``: ``delta = rowsum(dO * O) - dlse`` per query row.
* ``bwd_dkdv_kernel``: one program per (KV block, batch, KV head): over the group's query
  heads in ascending order and, for each, over query blocks in ascending order.
* ``bwd_dq_kernel``: one program per (query block, batch, query head): over KV blocks in
  ascending order; it writes the unscaled fp32 accumulator (the caller scales and casts).

Masking: keys past ``Skv`` or dropped by the padding mask load as zeros and get score
``-inf``; the causal rule is ``key <= query + offset`` with ``offset = Skv - Sq`` or a
per-sequence offset. A row with no visible key ends with ``l == 0``: out 0, lse ``-inf``,
zero gradients, never NaN. No reduction order depends on B, Sq or Skv: those only set
the grid and the loop bounds.

Math functions follow what the Pallas Triton lowering emits, so both backends compile to
the same operations: ``exp``/``log`` are libdevice's ``__nv_expf``/``__nv_logf`` (what
``jnp.exp``/``jnp.log`` lower to), not Triton's ``tl.exp``, whose fp32 form is the
approximate ``ex2.approx`` instruction; fp32 dots use ``input_precision="ieee"``
(``Precision.HIGHEST``); max is ``maxnumf``.

``INTERPRET`` (a constexpr) selects what Triton's CPU interpreter, which computes with
NumPy, needs instead:

* exp/log through ``tl.exp``/``tl.log`` (libdevice has no interpreter form);
* a dot as its fp32 products summed over K in ascending order (``tl.reduce``, a NumPy
  sum along that axis). The interpreter's ``tl.dot`` multiplies the raw uint16 bits of
  bf16 tiles, and for other dtypes it is a BLAS matmul whose bits for a row change with
  the row's position in the tile, which would break the row invariance the tests check
  (on the GPU the matrix unit gives a row the same bits in any tile, DESIGN.md 4). bf16
  operands are upcast exactly by bit arithmetic; products of 16-bit inputs are exact in
  fp32 and the sums are fp32, as on the matrix unit, in another (fixed) order;
* fp32 -> bf16 rounded to nearest even by bit arithmetic (the interpreter's conversion
  truncates). fp16 conversions are NumPy's, already round-to-nearest-even.

So the interpreter checks the schedule, the masking and every invariance on a CPU, but
its bits are not the GPU's.

The kernels call Triton builtins and each other only, never ``@triton.jit`` functions of
``triton.language`` such as ``tl.zeros`` or ``tl.max`` (``tl.reduce`` with Triton's own
combine functions instead): :func:`interpreted` builds interpreter copies of this module's
kernels after Triton's library was compiled as ordinary JIT functions, and those cannot
be called from interpreted code.
"""

import functools
import types

import triton
import triton.language as tl
from triton.language.extra import libdevice

_NEG_INF = tl.constexpr(float("-inf"))
_POS_INF = tl.constexpr(float("inf"))
_LN2 = tl.constexpr(0.6931471805599453)
#: Columns of the all-ones operand of the matrix-unit row sum (common.ROWSUM_COLS).
_ROWSUM_COLS = tl.constexpr(16)


# ------------------------------------------------------------------------ elementwise

@triton.jit
def _f32(x, INTERPRET: tl.constexpr):
    """x as fp32 (exact)."""
    if INTERPRET and x.dtype == tl.bfloat16:
        bits = x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        return bits.to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _cast(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 x as DTYPE, rounded to nearest even."""
    if DTYPE == tl.float32:
        return x
    if INTERPRET and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        hi = tl.where(is_nan, (bits >> 16) | 0x40, rounded)
        return hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _exp(x, EXP2: tl.constexpr, INTERPRET: tl.constexpr):
    """exp (or exp2 with EXP2) of fp32 x: libdevice, as the Pallas lowering emits."""
    if INTERPRET:
        if EXP2:
            return tl.exp2(x)
        return tl.exp(x)
    if EXP2:
        return libdevice.exp2(x)
    return libdevice.exp(x)


@triton.jit
def _log(x, INTERPRET: tl.constexpr):
    """Natural log of fp32 x: libdevice, as the Pallas lowering emits."""
    if INTERPRET:
        return tl.log(x)
    return libdevice.log(x)


@triton.jit
def _rmax(x, AXIS: tl.constexpr):
    """Max over AXIS (maxnumf; exact, so its order does not matter)."""
    return tl.reduce(x, AXIS, tl.standard._elementwise_max)


@triton.jit
def _rmin(x, AXIS: tl.constexpr):
    return tl.reduce(x, AXIS, tl.standard._elementwise_min)


@triton.jit
def _rsum(x, AXIS: tl.constexpr):
    """Sum over AXIS; its order follows the tile's register layout (the delta kernel's
    fixed tile, as in the Pallas kernel)."""
    return tl.reduce(x, AXIS, tl.standard._sum_combine)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """``a @ b`` of 2-D tiles, fp32 accumulation (common.dot); IEEE: fp32 inputs
    multiply in true fp32 (no tf32). Interpreted: the fp32 products summed over K in
    ascending order, the same for every row whatever the tile (see the module notes)."""
    if INTERPRET:
        prod = _f32(a, INTERPRET)[:, :, None] * _f32(b, INTERPRET)[None, :, :]
        return _rsum(prod, 1)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _rowsum(p, ROWSUM_MMA: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """Row sums of a ``[M, N]`` probability tile (common.rowsum): on the matrix unit
    (max over the identical columns of ``p @ ones``) or as a vector reduction."""
    if ROWSUM_MMA:
        if INTERPRET:  # the dot upcasts p to fp32 anyway
            ones = tl.full((p.shape[1], _ROWSUM_COLS), 1.0, tl.float32)
        else:
            ones = tl.full((p.shape[1], _ROWSUM_COLS), 1.0, p.dtype)
        return _rmax(_dot(p, ones, IEEE, INTERPRET), 1)
    return _rsum(_f32(p, INTERPRET), 1)


# ------------------------------------------------------------------ states and merge

@triton.jit
def _finalize(acc, m, l, INTERPRET: tl.constexpr):
    """Online-softmax state -> partial state ``(out, lse)`` (merge.finalize); ``(0,
    -inf)`` where no key was visible."""
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    out = tl.where(empty[:, None], 0.0, acc / l_safe[:, None])
    lse = tl.where(empty, _NEG_INF, m + _log(l_safe, INTERPRET))
    return out, lse


@triton.jit
def _merge(out_l, lse_l, out_r, lse_r, INTERPRET: tl.constexpr):
    """The one merge of two partial states, left keys before right keys (merge.merge):
    a ``-inf`` side gets weight exactly 0 and the other side comes back bit for bit."""
    m = tl.maximum(lse_l, lse_r)
    m_safe = tl.where(m == _NEG_INF, 0.0, m)
    w_l = _exp(lse_l - m_safe, False, INTERPRET)
    w_r = _exp(lse_r - m_safe, False, INTERPRET)
    total = w_l + w_r
    total_safe = tl.where(total == 0.0, 1.0, total)
    lse = m_safe + _log(total_safe, INTERPRET)
    a_l = (w_l / total_safe)[:, None]
    a_r = (w_r / total_safe)[:, None]
    out = out_l * a_l + out_r * a_r
    left_empty = lse_l == _NEG_INF
    right_empty = lse_r == _NEG_INF
    out = tl.where(right_empty[:, None], out_l, tl.where(left_empty[:, None], out_r, out))
    lse = tl.where(right_empty, lse_l, tl.where(left_empty, lse_r, lse))
    return out, lse


# --------------------------------------------------------------------------- forward

@triton.jit
def _key_ok(mask_base, cols, kv_len, HAS_MASK: tl.constexpr):
    """Keys ``cols`` that exist (``< kv_len``) and that the padding mask keeps."""
    ok = cols < kv_len
    if HAS_MASK:
        ok = ok & (tl.load(mask_base + cols, mask=ok, other=0) != 0)
    return ok


@triton.jit
def _softmax_step(acc, m, l, q, k_base, v_base, mask_base, start, kv_len, limit, scale,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, EXP2: tl.constexpr,
                  ROWSUM_MMA: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """Fold keys ``[start, start + BLOCK_N)`` into the running state
    (common.online_softmax_step). ``MASKED=False``: every row sees every key of the block
    (no load mask, no select; the select with an all-true mask is the identity)."""
    cols = start + tl.arange(0, BLOCK_N)
    offs = cols[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    if MASKED:
        ok = _key_ok(mask_base, cols, kv_len, HAS_MASK)
        # Keys not kept load as zeros: NaN or inf in padding cannot leak through 0 * x.
        k = tl.load(k_base + offs, mask=ok[:, None], other=0.0)
        v = tl.load(v_base + offs, mask=ok[:, None], other=0.0)
    else:
        k = tl.load(k_base + offs)
        v = tl.load(v_base + offs)
    s = _dot(q, tl.trans(k), IEEE, INTERPRET) * scale
    if MASKED:
        visible = ok[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= limit[:, None])
        s = tl.where(visible, s, _NEG_INF)
    m_new = tl.maximum(m, _rmax(s, 1))
    m_safe = tl.where(m_new == _NEG_INF, 0.0, m_new)
    alpha = _exp(m - m_safe, EXP2, INTERPRET)
    p = _cast(_exp(s - m_safe[:, None], EXP2, INTERPRET), v.dtype, INTERPRET)
    l_new = l * alpha + _rowsum(p, ROWSUM_MMA, IEEE, INTERPRET)
    acc_new = acc * alpha[:, None] + _dot(p, v, IEEE, INTERPRET)
    return acc_new, m_new, l_new


@triton.jit
def _fold_blocks(lo, mid, hi, q, k_base, v_base, mask_base, kv_len, limit, scale,
                 CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, WHOLE_BLOCKS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 EXP2: tl.constexpr, ROWSUM_MMA: tl.constexpr, IEEE: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """Online softmax over key blocks ``[lo, hi)`` of one split, ascending; blocks below
    ``mid`` are seen whole by every row of the tile. Returns the split's partial state."""
    acc = tl.full((BLOCK_M, HEAD_DIM), 0.0, tl.float32)
    m = tl.full((BLOCK_M,), _NEG_INF, tl.float32)
    l = tl.full((BLOCK_M,), 0.0, tl.float32)
    if WHOLE_BLOCKS and not HAS_MASK:
        mid = tl.minimum(tl.maximum(mid, lo), hi)
        for j in range(lo, mid):
            acc, m, l = _softmax_step(acc, m, l, q, k_base, v_base, mask_base, j * BLOCK_N,
                                      kv_len, limit, scale, False, CAUSAL, HAS_MASK, BLOCK_N,
                                      HEAD_DIM, EXP2, ROWSUM_MMA, IEEE, INTERPRET)
    else:
        mid = lo
    for j in range(mid, hi):
        acc, m, l = _softmax_step(acc, m, l, q, k_base, v_base, mask_base, j * BLOCK_N,
                                  kv_len, limit, scale, True, CAUSAL, HAS_MASK, BLOCK_N,
                                  HEAD_DIM, EXP2, ROWSUM_MMA, IEEE, INTERPRET)
    if EXP2:
        m = m * _LN2  # common.natural_max
    return _finalize(acc, m, l, INTERPRET)


@triton.jit
def _tile_setup(q_ptr, k_ptr, v_ptr, mask_ptr, off_ptr, q_len, kv_len, tile,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
                HAS_OFFSETS: tl.constexpr):
    """This program's sequence and KV head: base pointers, the row tile (validity,
    causal limit, q) and the key blocks (seen whole by every row, seen by any row)."""
    b = tl.program_id(1)
    bh = (b * tl.num_programs(2) + tl.program_id(2)).to(tl.int64)
    rows = GROUP * q_len
    k_base = k_ptr + bh * kv_len * HEAD_DIM
    v_base = v_ptr + bh * kv_len * HEAD_DIM
    mask_base = mask_ptr + b.to(tl.int64) * kv_len
    if HAS_OFFSETS:
        offset = tl.load(off_ptr + b)
    else:
        offset = kv_len - q_len
    row_ids = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = row_ids < rows
    # Key j is visible to row r iff j <= (r mod Sq) + offset.
    limit = row_ids % q_len + offset
    q_offs = row_ids[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    q = tl.load(q_ptr + bh * rows * HEAD_DIM + q_offs, mask=row_ok[:, None], other=0.0)
    # Blocks [0, full) are seen whole by every row, blocks [0, hi) by some row.
    total = (kv_len + BLOCK_N - 1) // BLOCK_N
    if HAS_MASK:
        full = 0
    else:
        full = kv_len // BLOCK_N
    if CAUSAL:
        last = _rmax(tl.where(row_ok, limit, -1), 0)
        first = _rmin(tl.where(row_ok, limit, kv_len), 0)
        hi = tl.minimum(tl.maximum(tl.where(last < 0, 0, last // BLOCK_N + 1), 0), total)
        full = tl.minimum(tl.maximum(tl.where(first < 0, 0, (first + 1) // BLOCK_N), 0), full)
    else:
        hi = total
    return bh, rows, k_base, v_base, mask_base, row_ids, row_ok, limit, q, full, hi


@triton.jit
def fwd_prefill_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, off_ptr, scale, q_len, kv_len,
                       o_ptr, lse_ptr,
                       GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr,
                       CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
                       HAS_OFFSETS: tl.constexpr, WHOLE_BLOCKS: tl.constexpr,
                       EXP2: tl.constexpr, ROWSUM_MMA: tl.constexpr, IEEE: tl.constexpr,
                       INTERPRET: tl.constexpr):
    """Grid (row tiles, B, Hkv). q ``[B, Hkv, G*Sq, D]``, k/v ``[B, Hkv, Skv, D]``, mask
    ``[B, Skv]`` int32, offsets ``[B]`` int32 -> out ``[B, Hkv, G*Sq, D]`` (q's dtype),
    lse ``[B, Hkv, G*Sq]`` fp32. Splits ascending, each folded by :func:`_fold_blocks`
    and merged into the running state."""
    bh, rows, k_base, v_base, mask_base, row_ids, row_ok, limit, q, full, hi = _tile_setup(
        q_ptr, k_ptr, v_ptr, mask_ptr, off_ptr, q_len, kv_len, tl.program_id(0), GROUP,
        HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, HAS_MASK, HAS_OFFSETS)
    n_splits = (hi + BLOCKS_PER_SPLIT - 1) // BLOCKS_PER_SPLIT
    out = tl.full((BLOCK_M, HEAD_DIM), 0.0, tl.float32)
    lse = tl.full((BLOCK_M,), _NEG_INF, tl.float32)
    for si in range(0, n_splits):
        lo = si * BLOCKS_PER_SPLIT
        part_out, part_lse = _fold_blocks(
            lo, full, tl.minimum(lo + BLOCKS_PER_SPLIT, hi), q, k_base, v_base, mask_base,
            kv_len, limit, scale, CAUSAL, HAS_MASK, WHOLE_BLOCKS, BLOCK_M, BLOCK_N, HEAD_DIM,
            EXP2, ROWSUM_MMA, IEEE, INTERPRET)
        out, lse = _merge(out, lse, part_out, part_lse, INTERPRET)
    o_offs = row_ids[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o_base = o_ptr + bh * rows * HEAD_DIM
    tl.store(o_base + o_offs, _cast(out, o_ptr.dtype.element_ty, INTERPRET),
             mask=row_ok[:, None])
    tl.store(lse_ptr + bh * rows + row_ids, lse, mask=row_ok)


@triton.jit
def fwd_split_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, off_ptr, scale, q_len, kv_len, n_splits,
                     o_parts_ptr, lse_parts_ptr,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr,
                     CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                     WHOLE_BLOCKS: tl.constexpr, EXP2: tl.constexpr, ROWSUM_MMA: tl.constexpr,
                     IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """Grid (row tiles x splits, B, Hkv): the partial state of one split of one row tile,
    fp32 ``[B, Hkv, n_splits, G*Sq, D]`` and ``[B, Hkv, n_splits, G*Sq]``."""
    pid = tl.program_id(0)
    tile = pid // n_splits
    si = pid % n_splits
    bh, rows, k_base, v_base, mask_base, row_ids, row_ok, limit, q, full, hi = _tile_setup(
        q_ptr, k_ptr, v_ptr, mask_ptr, off_ptr, q_len, kv_len, tile, GROUP, HEAD_DIM,
        BLOCK_M, BLOCK_N, CAUSAL, HAS_MASK, HAS_OFFSETS)
    lo = si * BLOCKS_PER_SPLIT
    end = tl.maximum(tl.minimum(lo + BLOCKS_PER_SPLIT, hi), lo)
    out, lse = _fold_blocks(lo, full, end, q, k_base, v_base, mask_base, kv_len, limit,
                            scale, CAUSAL, HAS_MASK, WHOLE_BLOCKS, BLOCK_M, BLOCK_N, HEAD_DIM,
                            EXP2, ROWSUM_MMA, IEEE, INTERPRET)
    part = bh * n_splits + si
    o_offs = row_ids[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    tl.store(o_parts_ptr + part * rows * HEAD_DIM + o_offs, out, mask=row_ok[:, None])
    tl.store(lse_parts_ptr + part * rows + row_ids, lse, mask=row_ok)


@triton.jit
def fwd_combine_kernel(o_parts_ptr, lse_parts_ptr, rows, n_splits, o_ptr, lse_ptr,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                       INTERPRET: tl.constexpr):
    """Grid (row tiles, B, Hkv): fold the splits' partial states in ascending order with
    the one merge; out in o's dtype, lse fp32."""
    tile = tl.program_id(0)
    bh = (tl.program_id(1) * tl.num_programs(2) + tl.program_id(2)).to(tl.int64)
    row_ids = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = row_ids < rows
    o_offs = row_ids[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    out = tl.full((BLOCK_M, HEAD_DIM), 0.0, tl.float32)
    lse = tl.full((BLOCK_M,), _NEG_INF, tl.float32)
    for si in range(0, n_splits):
        part = bh * n_splits + si
        o_s = tl.load(o_parts_ptr + part * rows * HEAD_DIM + o_offs, mask=row_ok[:, None],
                      other=0.0)
        lse_s = tl.load(lse_parts_ptr + part * rows + row_ids, mask=row_ok, other=_NEG_INF)
        out, lse = _merge(out, lse, o_s, lse_s, INTERPRET)
    tl.store(o_ptr + bh * rows * HEAD_DIM + o_offs,
             _cast(out, o_ptr.dtype.element_ty, INTERPRET), mask=row_ok[:, None])
    tl.store(lse_ptr + bh * rows + row_ids, lse, mask=row_ok)


# -------------------------------------------------------------------------- backward

@triton.jit
def bwd_delta_kernel(o_ptr, do_ptr, dlse_ptr, q_len, delta_ptr,
                     HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """Grid (row blocks, B, Hq): ``delta = rowsum(dO * O) - dlse`` in fp32, ``[B, Hq, Sq]``
    (the ``- dlse`` term carries a cotangent of the returned lse)."""
    bh = (tl.program_id(1) * tl.num_programs(2) + tl.program_id(2)).to(tl.int64)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < q_len
    offs = bh * q_len * HEAD_DIM + rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o = _f32(tl.load(o_ptr + offs, mask=ok[:, None], other=0.0), INTERPRET)
    do = _f32(tl.load(do_ptr + offs, mask=ok[:, None], other=0.0), INTERPRET)
    dlse = tl.load(dlse_ptr + bh * q_len + rows, mask=ok, other=0.0)
    tl.store(delta_ptr + bh * q_len + rows, _rsum(o * do, 1) - dlse, mask=ok)


@triton.jit
def _dkdv_step(dk, dv, k, v, ok, cols, q_base, do_base, lse_base, delta_base, qb, q_len,
               offset, scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, IEEE: tl.constexpr,
               INTERPRET: tl.constexpr):
    """Add query block ``qb``'s contribution to this KV block's dK, dV (transposed tiles:
    ``p^T = exp(K Q^T * scale - lse)``, exactly 0 where not visible)."""
    rows = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs = rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    if MASKED:
        row_ok = rows < q_len
        q = tl.load(q_base + offs, mask=row_ok[:, None], other=0.0)
        do = tl.load(do_base + offs, mask=row_ok[:, None], other=0.0)
        lse = tl.load(lse_base + rows, mask=row_ok, other=_NEG_INF)
        delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
    else:
        q = tl.load(q_base + offs)
        do = tl.load(do_base + offs)
        lse = tl.load(lse_base + rows)
        delta = tl.load(delta_base + rows)
    s_t = _dot(k, tl.trans(q), IEEE, INTERPRET) * scale
    if MASKED:
        visible_t = ok[:, None] & row_ok[None, :]
        if CAUSAL:
            visible_t = visible_t & (cols[:, None] <= rows[None, :] + offset)
        s_t = tl.where(visible_t, s_t, _NEG_INF)
    lse_safe = tl.where(lse == _NEG_INF, _POS_INF, lse)
    p_t = _exp(s_t - lse_safe[None, :], False, INTERPRET)
    dv = dv + _dot(_cast(p_t, do.dtype, INTERPRET), do, IEEE, INTERPRET)
    dp_t = _dot(v, tl.trans(do), IEEE, INTERPRET)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = dk + _dot(_cast(ds_t, q.dtype, INTERPRET), q, IEEE, INTERPRET)
    return dk, dv


@triton.jit
def bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, mask_ptr, off_ptr,
                    scale, q_len, kv_len, dk_ptr, dv_ptr,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_KV: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
                    HAS_OFFSETS: tl.constexpr, WHOLE_BLOCKS: tl.constexpr,
                    IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """Grid (KV blocks, B, Hkv): dK, dV ``[B, Hkv, Skv, D]`` (k's dtype) of one KV block,
    accumulated over the group's query heads ascending, then query blocks ascending."""
    b = tl.program_id(1)
    h_kv = tl.program_id(2)
    bh = (b * tl.num_programs(2) + h_kv).to(tl.int64)
    start = tl.program_id(0) * BLOCK_KV
    cols = start + tl.arange(0, BLOCK_KV)
    mask_base = mask_ptr + b.to(tl.int64) * kv_len
    ok = _key_ok(mask_base, cols, kv_len, HAS_MASK)
    kv_offs = bh * kv_len * HEAD_DIM + cols[:, None] * HEAD_DIM + \
        tl.arange(0, HEAD_DIM)[None, :]
    k = tl.load(k_ptr + kv_offs, mask=ok[:, None], other=0.0)
    v = tl.load(v_ptr + kv_offs, mask=ok[:, None], other=0.0)
    if HAS_OFFSETS:
        offset = tl.load(off_ptr + b)
    else:
        offset = kv_len - q_len
    n_qblocks = (q_len + BLOCK_Q - 1) // BLOCK_Q
    # Query blocks [first, n) hold a row that sees this KV block; those in [mid, last)
    # see it whole (every row valid and past the diagonal, every key kept).
    if CAUSAL:
        first_row = start - offset
        first = tl.minimum(tl.maximum(tl.where(first_row < 0, 0, first_row // BLOCK_Q), 0),
                           n_qblocks)
        mid_row = start + BLOCK_KV - 1 - offset
        mid = tl.where(mid_row <= 0, 0, (mid_row + BLOCK_Q - 1) // BLOCK_Q)
    else:
        first = 0
        mid = 0
    if WHOLE_BLOCKS and not HAS_MASK:
        keys_whole = start + BLOCK_KV <= kv_len
        mid = tl.minimum(tl.maximum(mid, first), n_qblocks)
        last = tl.where(keys_whole, tl.maximum(q_len // BLOCK_Q, mid), mid)
        mid = tl.where(keys_whole, mid, n_qblocks)
        last = tl.where(keys_whole, last, n_qblocks)
    else:
        mid = n_qblocks
        last = n_qblocks
    dk = tl.full((BLOCK_KV, HEAD_DIM), 0.0, tl.float32)
    dv = tl.full((BLOCK_KV, HEAD_DIM), 0.0, tl.float32)
    for hh in range(0, GROUP):
        qh = (b * tl.num_programs(2) * GROUP + h_kv * GROUP + hh).to(tl.int64)
        q_base = q_ptr + qh * q_len * HEAD_DIM
        do_base = do_ptr + qh * q_len * HEAD_DIM
        lse_base = lse_ptr + qh * q_len
        delta_base = delta_ptr + qh * q_len
        # Ascending query blocks; the whole/masked split changes no bits.
        for qb in range(first, mid):
            dk, dv = _dkdv_step(dk, dv, k, v, ok, cols, q_base, do_base, lse_base,
                                delta_base, qb, q_len, offset, scale, True, CAUSAL, HEAD_DIM,
                                BLOCK_Q, IEEE, INTERPRET)
        if WHOLE_BLOCKS and not HAS_MASK:
            for qb in range(mid, last):
                dk, dv = _dkdv_step(dk, dv, k, v, ok, cols, q_base, do_base, lse_base,
                                    delta_base, qb, q_len, offset, scale, False, CAUSAL,
                                    HEAD_DIM, BLOCK_Q, IEEE, INTERPRET)
        for qb in range(tl.maximum(last, first), n_qblocks):
            dk, dv = _dkdv_step(dk, dv, k, v, ok, cols, q_base, do_base, lse_base,
                                delta_base, qb, q_len, offset, scale, True, CAUSAL, HEAD_DIM,
                                BLOCK_Q, IEEE, INTERPRET)
    in_range = (cols < kv_len)[:, None]
    tl.store(dk_ptr + kv_offs, _cast(dk * scale, dk_ptr.dtype.element_ty, INTERPRET),
             mask=in_range)
    tl.store(dv_ptr + kv_offs, _cast(dv, dv_ptr.dtype.element_ty, INTERPRET), mask=in_range)


@triton.jit
def _dq_step(dq, q, do, lse_safe, delta, row_ok, limit, k_base, v_base, mask_base, start,
             kv_len, scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
             HAS_MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_KV: tl.constexpr,
             IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """Add keys ``[start, start + BLOCK_KV)``'s contribution to this query block's dQ."""
    cols = start + tl.arange(0, BLOCK_KV)
    offs = cols[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    if MASKED:
        ok = _key_ok(mask_base, cols, kv_len, HAS_MASK)
        k = tl.load(k_base + offs, mask=ok[:, None], other=0.0)
        v = tl.load(v_base + offs, mask=ok[:, None], other=0.0)
    else:
        k = tl.load(k_base + offs)
        v = tl.load(v_base + offs)
    s = _dot(q, tl.trans(k), IEEE, INTERPRET) * scale
    if MASKED:
        visible = ok[None, :] & row_ok[:, None]
        if CAUSAL:
            visible = visible & (cols[None, :] <= limit[:, None])
        s = tl.where(visible, s, _NEG_INF)
    p = _exp(s - lse_safe[:, None], False, INTERPRET)
    dp = _dot(do, tl.trans(v), IEEE, INTERPRET)
    ds = p * (dp - delta[:, None])
    return dq + _dot(_cast(ds, k.dtype, INTERPRET), k, IEEE, INTERPRET)


@triton.jit
def bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, mask_ptr, off_ptr,
                  scale, q_len, kv_len, dq_ptr,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
                  BLOCK_KV: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
                  HAS_OFFSETS: tl.constexpr, WHOLE_BLOCKS: tl.constexpr, IEEE: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """Grid (query blocks, B, Hq): the unscaled fp32 dQ accumulator ``[B, Hq, Sq, D]`` of
    one query block, over KV blocks ascending (the caller scales and casts)."""
    b = tl.program_id(1)
    h = tl.program_id(2)
    bh = (b * tl.num_programs(2) + h).to(tl.int64)
    bh_kv = (b * (tl.num_programs(2) // GROUP) + h // GROUP).to(tl.int64)
    qb = tl.program_id(0)
    rows = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_ok = rows < q_len
    offs = bh * q_len * HEAD_DIM + rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    q = tl.load(q_ptr + offs, mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptr + offs, mask=row_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + bh * q_len + rows, mask=row_ok, other=_NEG_INF)
    delta = tl.load(delta_ptr + bh * q_len + rows, mask=row_ok, other=0.0)
    if HAS_OFFSETS:
        offset = tl.load(off_ptr + b)
    else:
        offset = kv_len - q_len
    limit = rows + offset
    n_kv = (kv_len + BLOCK_KV - 1) // BLOCK_KV
    if HAS_MASK or not WHOLE_BLOCKS:
        full = 0
    else:
        full = kv_len // BLOCK_KV
    if CAUSAL:
        last_lim = _rmax(tl.where(row_ok, limit, -1), 0)
        hi = tl.minimum(tl.maximum(tl.where(last_lim < 0, 0, last_lim // BLOCK_KV + 1), 0),
                        n_kv)
        first_lim = qb * BLOCK_Q + offset
        full = tl.minimum(tl.maximum(tl.where(first_lim < 0, 0, (first_lim + 1) // BLOCK_KV),
                                     0), full)
    else:
        hi = n_kv
    lse_safe = tl.where(lse == _NEG_INF, _POS_INF, lse)
    k_base = k_ptr + bh_kv * kv_len * HEAD_DIM
    v_base = v_ptr + bh_kv * kv_len * HEAD_DIM
    mask_base = mask_ptr + b.to(tl.int64) * kv_len
    dq = tl.full((BLOCK_Q, HEAD_DIM), 0.0, tl.float32)
    if WHOLE_BLOCKS and not HAS_MASK:
        full = tl.minimum(full, hi)
        for j in range(0, full):
            dq = _dq_step(dq, q, do, lse_safe, delta, row_ok, limit, k_base, v_base,
                          mask_base, j * BLOCK_KV, kv_len, scale, False, CAUSAL, HAS_MASK,
                          HEAD_DIM, BLOCK_KV, IEEE, INTERPRET)
    else:
        full = 0
    for j in range(full, hi):
        dq = _dq_step(dq, q, do, lse_safe, delta, row_ok, limit, k_base, v_base, mask_base,
                      j * BLOCK_KV, kv_len, scale, True, CAUSAL, HAS_MASK, HEAD_DIM,
                      BLOCK_KV, IEEE, INTERPRET)
    tl.store(dq_ptr + offs, dq, mask=row_ok[:, None])


# ----------------------------------------------------------------------- interpreter

KERNELS = ("fwd_prefill_kernel", "fwd_split_kernel", "fwd_combine_kernel",
           "bwd_delta_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel")


def _fix_interpreter_index() -> None:
    """Triton <= 3.6's interpreter turns a loop bound into an int with ``int(array)`` of a
    1-element array, which NumPy >= 2.4 refuses (triton-lang/triton#9171, fixed upstream
    by #9172): make ``tensor.__index__`` take the element explicitly, inside the
    interpreter's own patch scope (restored after every launch like its other patches)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_jaxattn_index_fix", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._jaxattn_index_fix = True
    interpreter._patch_lang_tensor = patch_lang_tensor


@functools.cache
def interpreted() -> types.SimpleNamespace:
    """This module's kernels as Triton interpreter functions (NumPy on the CPU), launched
    as ``kernel[grid](*torch_cpu_tensors, *scalars, **constexprs)``.

    The copies live in a namespace of their own in which every ``@triton.jit`` function of
    this module is replaced by its interpreted copy, so a kernel's calls to the helpers
    are interpreted too; the compiled kernels of the module are left as they are.
    """
    from triton.runtime.interpreter import InterpretedFunction

    _fix_interpreter_index()
    namespace = dict(globals())
    for name, value in globals().items():
        fn = getattr(value, "fn", None)
        if not isinstance(value, (triton.runtime.jit.JITFunction, InterpretedFunction)) or (
                getattr(fn, "__module__", None) != __name__):
            continue
        copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__,
                                  fn.__closure__)
        copy.__annotations__ = dict(fn.__annotations__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        copy.__module__ = fn.__module__
        copy.__qualname__ = fn.__qualname__
        copy.__doc__ = fn.__doc__
        namespace[name] = InterpretedFunction(copy)
    return types.SimpleNamespace(**{name: namespace[name] for name in KERNELS})
