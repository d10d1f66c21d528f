"""Context parallelism: partial states, the global-order merge, CP attention.

DESIGN.md section 5. Two ways to run attention over a sequence cut into shards:

* :func:`forward` / :func:`forward_with_lse` / :func:`forward_fp32` /
  :func:`forward_fp32_with_lse` (the seed contract, one device): queries and keys are cut
  into ``cp_world_size`` shards, each shard's keys into ranges of ``kv_chunk_size``;
  each query shard folds its key ranges in ascending global key order onto one running
  fp32 state ``(out, lse)``, as the one call's kernel folds its splits (the backend's
  ``fold_on``: one launch per range, the state carried between launches); the backward
  is the backend's ``backward_over_ranges``. A range that starts or ends inside a
  ``SPLIT`` continues the kernels' running online-softmax state across the cut
  (``split_segment``), so when every range starts on a multiple of ``BLOCK_N`` the bits
  equal the single call's. :class:`PartialState` and :func:`merge_partial_states` are
  the order-free merge of normalised states (ascending global key order, whatever
  order they arrive in), for states computed elsewhere.
* :func:`sharded_attention` (a mesh, ``jax.shard_map``): q, k and v sharded along the
  sequence over a mesh axis. K and V are all-gathered, so every device computes its own
  query rows over all keys with the kernels of the backend :func:`jaxattn.attention`
  picks (a backend with the "cp_mesh" path; ``mosaic`` on sm90): equal in bits to
  ``jaxattn.attention`` with that backend on one device whatever the shard boundaries
  (shards must start on multiples of the backward's 64-row block for the backward
  bits). See docs/cp.md for the collectives and bytes.

Positions are global: query i of a sequence sits at ``query_position_offsets[b] + i``
(default ``Skv - Sq``), key j at ``key_position_offsets[b] + j`` (default 0), and the
causal rule compares them. Key ranges ``[start, end)`` index the key array as passed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxattn import registry, schedule
from jaxattn.backends.base import Backend
from jaxattn.merge import fold
from jaxattn.validation import resolve_scale, validate_inputs

_NEG_INF = float("-inf")


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class PartialState:
    """Attention over the contiguous key range ``[start, end)``.

    Attributes:
      out: ``[B, Hq, Sq, D]`` fp32, normalised over the range's visible keys (0 if none).
      lse: ``[B, Hq, Sq]`` fp32 natural-log sum-exp (``-inf`` if none).
      start, end: the key range (static ints); ``start == end`` is an empty range.
    """

    out: jax.Array
    lse: jax.Array
    start: int
    end: int

    def tree_flatten(self):
        return (self.out, self.lse), (self.start, self.end)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @classmethod
    def empty(cls, shape: tuple[int, int, int, int], at: int = 0) -> PartialState:
        """The empty state ``(0, -inf)`` over ``[at, at)`` for an output ``shape``."""
        return cls(jnp.zeros(shape, jnp.float32), jnp.full(shape[:3], _NEG_INF, jnp.float32),
                   at, at)


def merge_partial_states(states: Sequence[PartialState], fold_fn=fold) -> PartialState:
    """Fold partial states in ascending key order (:func:`jaxattn.merge.fold`: ``lax.scan``
    over :func:`jaxattn.merge.merge`; ``fold_fn``, with the same signature, in its place:
    the ``"mosaic"`` backend's :func:`jaxattn.backends.mosaic.forward.fold_partials`).

    The states may come in any order; they must tile one contiguous key range with no
    gap and no overlap (empty ranges are allowed anywhere inside it).

    Raises:
      ValueError: no states, mismatched shapes, a gap or an overlap between ranges.
    """
    if not states:
        raise ValueError("merge_partial_states needs at least one state")
    shapes = {(tuple(s.out.shape), tuple(s.lse.shape)) for s in states}
    if len(shapes) != 1:
        raise ValueError(f"partial states have different shapes: {sorted(shapes)}")
    for s in states:
        if s.end < s.start:
            raise ValueError(f"invalid key range [{s.start}, {s.end})")
    ordered = sorted(states, key=lambda s: (s.start, s.end))
    nonempty = [s for s in ordered if s.end > s.start]
    for a, b in zip(nonempty, nonempty[1:], strict=False):
        if b.start > a.end:
            raise ValueError(f"gap in key ranges: [{a.start}, {a.end}) then "
                             f"[{b.start}, {b.end}) leaves keys {a.end}..{b.start - 1} out")
        if b.start < a.end:
            raise ValueError(f"overlapping key ranges: [{a.start}, {a.end}) and "
                             f"[{b.start}, {b.end})")
    start = nonempty[0].start if nonempty else ordered[0].start
    end = nonempty[-1].end if nonempty else ordered[0].end
    if not nonempty:
        return ordered[0]
    out, lse = fold_fn(jnp.stack([s.out for s in nonempty]),
                       jnp.stack([s.lse for s in nonempty]))
    return PartialState(out, lse, start, end)


def _offsets(arg, default: int, b: int, name: str) -> jax.Array:
    if arg is None:
        return jnp.full((b,), default, jnp.int32)
    arr = jnp.asarray(arg)
    if arr.shape != (b,) or not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"{name} must be an int array of shape [B] = ({b},), got "
                         f"shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(jnp.int32)


def _ranges(n: int, world: int, chunk: int | None) -> list[tuple[int, int]]:
    """Shard ``n`` items over ``world`` shards, then cut each shard into chunks."""
    shard = -(-n // world) if n else 0
    out = []
    for w in range(world):
        a, b = min(w * shard, n), min((w + 1) * shard, n)
        step = chunk or max(b - a, 1)
        out += [(c, min(c + step, b)) for c in range(a, b, step)] or [(a, a)]
    return out


def _check_cp_args(cp_world_size, kv_chunk_size):
    if isinstance(cp_world_size, bool) or not isinstance(cp_world_size, (int, np.integer)) \
            or cp_world_size < 1:
        raise ValueError(f"cp_world_size must be a positive int, got {cp_world_size!r}")
    if kv_chunk_size is not None and (isinstance(kv_chunk_size, bool) or not isinstance(
            kv_chunk_size, (int, np.integer)) or kv_chunk_size < 1):
        raise ValueError(f"kv_chunk_size must be None or a positive int, got {kv_chunk_size!r}")


def _split_end(x: int, n: int) -> int:
    """Where the SPLIT of the one call over ``n`` keys that holds key ``x`` ends."""
    return min((x // schedule.SPLIT + 1) * schedule.SPLIT, n)


def _pieces(a: int, e: int, n: int) -> list[tuple[int, int, bool]]:
    """Keys ``[a, e)`` of ``n`` cut where a SPLIT of the one call (``[i * SPLIT, min((i +
    1) * SPLIT, n))``) ends: ``(start, end, whole)``, ``whole`` for a run of complete
    splits (the backend's ``split_states``), else a piece of one split."""
    out, x = [], a
    while x < e:
        if x % schedule.SPLIT == 0 and _split_end(x, n) <= e:
            y = x
            while y < e and _split_end(y, n) <= e:
                y = _split_end(y, n)
            out.append((x, y, True))
        else:
            y = min(e, _split_end(x, n))
            out.append((x, y, False))
        x = y
    return out


def _forward_states(be: Backend, q, k, v, mask, qo, ko, *, causal, scale, cp_world_size,
                    kv_chunk_size, static_offset=None):
    """(out in q's dtype, lse) of every query shard over its key ranges, folded per query
    shard in ascending global key order, as the one call folds its splits.

    A run of whole splits inside a range is folded onto the shard's running state by
    ``be.fold_on`` (one launch: the Mosaic kernel loads the state and stores the folded
    one; the shard's first launch loads none, its last stores the output as the single
    call does). Where a range starts or ends inside a split and the backend carries the
    running state (``carries_split_state``), the split's pieces are folded on from range
    to range in ascending order (``split_segment``), as one kernel folds the split, and
    the finished split is merged into the shard's state (``be.merge_into``); otherwise
    each piece is folded as a state of its own. ``static_offset``: the position of query
    0 minus that of key 0 when every sequence's is the same and known when tracing (the
    default offsets); causal key runs that no row of a shard sees are then not launched
    (folding their empty states would give the same bits back), and each launch gets its
    offset as a Python int (the kernel's static offset: no rows placed per sequence)."""
    b, hq, sq, d = q.shape
    skv = k.shape[2]
    outs, lses = [], []
    ranges = _ranges(skv, cp_world_size, kv_chunk_size)
    if static_offset is not None and sq and all(
            x % schedule.SPLIT == 0 and (y % schedule.SPLIT == 0 or y == skv)
            for x, y in ranges if y > x):
        return _range_major_states(be, q, k, v, mask, causal=causal, scale=scale,
                                   shards=_ranges(sq, cp_world_size, None),
                                   ranges=[(x, y) for x, y in ranges if y > x],
                                   static_offset=static_offset)
    for qa, qb in _ranges(sq, cp_world_size, None):
        if qb == qa:
            continue
        qs = q[:, :, qa:qb]
        plan, open_split = [], False  # the pieces launched, in key order
        for a, e in ranges:
            for x, y, whole in _pieces(a, e, skv) if be.carries_split_state else [(a, e, True)]:
                if (not open_split and causal and static_offset is not None
                        and qb - 1 + static_offset < x):
                    continue  # no row of the shard sees a key of [x, y) (nor later keys)
                plan.append((x, y, whole))
                if not whole:
                    open_split = y != _split_end(x, skv)
        state, carry, result = None, None, None
        for i, (x, y, whole) in enumerate(plan):
            ms = None if mask is None else mask[:, x:y]
            kx, vx = k[:, :, x:y], v[:, :, x:y]
            if whole and static_offset is not None:  # the same for every sequence
                off = static_offset + qa - x
            else:
                off = (qo + qa) - (ko + x)
            if whole:
                last = i == len(plan) - 1
                res = be.fold_on(state, qs, kx, vx, ms, off, causal=causal, scale=scale,
                                 finish=last)
                result, state = (res, None) if last else (None, res)
                continue
            if (x % schedule.SPLIT != 0) != (carry is not None):  # pieces in key order
                raise AssertionError(f"piece [{x}, {y}) of a split and the running "
                                     f"state of its earlier keys disagree")
            finish = y == _split_end(x, skv)
            res = be.split_segment(qs, kx, vx, ms, off, carry, causal=causal,
                                   scale=scale, finish=finish)
            carry = None if finish else res
            if finish:
                state = be.merge_into(state, *res)
        if result is None and state is None:  # no key visible to any row
            result = (jnp.zeros(qs.shape, q.dtype),
                      jnp.full(qs.shape[:3], -jnp.inf, jnp.float32))
        elif result is None:
            result = be.finish_state(state, q.dtype)
        outs.append(result[0])
        lses.append(result[1])
    if not outs:
        return jnp.zeros(q.shape, q.dtype), jnp.zeros((b, hq, 0), jnp.float32)
    return jnp.concatenate(outs, axis=2), jnp.concatenate(lses, axis=2)


def _range_major_states(be: Backend, q, k, v, mask, *, causal, scale, shards, ranges,
                        static_offset):
    """:func:`_forward_states` where every key range is a run of whole SPLITs and the
    offsets are the defaults, range-major: one launch per key range over every query
    shard that sees it (``be.fold_window``), each shard's ranges still folded in
    ascending order, so each row's bits are those of the shard-major loop. The shards
    that see a range are a contiguous run of rows (all of them, or a suffix when
    causal), those that see the next range a suffix of that run: each launch loads the
    state of exactly its rows, finishes the rows whose last range it is (a prefix) and
    hands the others' state to the next launch, with no copy in between."""
    b, hq, sq, d = q.shape
    shards = [(qa, qb) for qa, qb in shards if qb > qa]

    def sees(shard, x):  # some row of the shard sees key x
        return not causal or shard[1] - 1 + static_offset >= x

    cur = [s for s in shards if ranges and sees(s, ranges[0][0])]
    outs, lses = [], []
    if cur and cur[0][0] > 0:  # rows before them see no key
        outs.append(jnp.zeros((b, hq, cur[0][0], d), q.dtype))
        lses.append(jnp.full((b, hq, cur[0][0]), -jnp.inf, jnp.float32))
    state = None
    for t, (x, y) in enumerate(ranges):
        if not cur:
            break
        nxt = [s for s in cur if t + 1 < len(ranges) and sees(s, ranges[t + 1][0])]
        if cur[len(cur) - len(nxt):] != nxt:
            raise AssertionError(f"the shards that see keys from {ranges[t + 1][0]} on "
                                 f"are not a suffix of those that see [{x}, {y})")
        r0, r1 = cur[0][0], cur[-1][1]
        fin = (nxt[0][0] if nxt else r1) - r0
        done, state = be.fold_window(state, q, k, v, mask, rows=(r0, r1), keys=(x, y),
                                     finish_rows=fin, offset=static_offset + r0 - x,
                                     causal=causal, scale=scale)
        if done is not None:
            outs.append(done[0])
            lses.append(done[1])
        cur = nxt
    if not outs:  # no row sees a key
        return (jnp.zeros(q.shape, q.dtype), jnp.full(q.shape[:3], -jnp.inf, jnp.float32))
    return jnp.concatenate(outs, axis=2), jnp.concatenate(lses, axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _cp_attention(q, k, v, mask, qo, ko, be, causal, scale, cp_world_size, kv_chunk_size,
                  static_offset):
    out, lse = _forward_states(be, q, k, v, mask, qo, ko, causal=causal, scale=scale,
                               cp_world_size=cp_world_size, kv_chunk_size=kv_chunk_size,
                               static_offset=static_offset)
    return out, lse


def _cp_attention_fwd(q, k, v, mask, qo, ko, be, causal, scale, cp_world_size,
                      kv_chunk_size, static_offset):
    out, lse = _cp_attention(q, k, v, mask, qo, ko, be, causal, scale, cp_world_size,
                             kv_chunk_size, static_offset)
    return (out, lse), (q, k, v, mask, qo, ko, out, lse)


def _cp_attention_bwd(be, causal, scale, cp_world_size, kv_chunk_size, static_offset, res,
                      cts):
    """The backend's backward over the key ranges in ascending global order (dK and dV
    per range, dQ continued from range to range), from the global lse."""
    q, k, v, mask, qo, ko, out, lse = res
    d_out, d_lse = cts
    ranges = _ranges(k.shape[2], cp_world_size, kv_chunk_size)
    dq, dk, dv = be.backward_over_ranges(q, k, v, mask, out, lse, d_out.astype(out.dtype),
                                         d_lse, ranges=ranges, offsets=qo - ko,
                                         causal=causal, scale=scale)
    return dq, dk, dv, None, None, None


_cp_attention.defvjp(_cp_attention_fwd, _cp_attention_bwd)


def _cp(q, k, v, *, causal, scale, key_padding_mask, query_position_offsets,
        key_position_offsets, cp_world_size, kv_chunk_size, fp32, backend):
    dims = validate_inputs(q, k, v, causal=causal, scale=scale,
                           key_padding_mask=key_padding_mask)
    _check_cp_args(cp_world_size, kv_chunk_size)
    be = registry.resolve("cp_attention", backend)
    if fp32:
        dims = dims._replace(dtype=np.dtype(np.float32))
    reason = be.unsupported(dims, "cp")
    if reason is not None:
        raise ValueError(f"backend {be.name!r} cannot serve this call: {reason}")
    qo = _offsets(query_position_offsets, dims.kv_len - dims.q_len, dims.batch,
                  "query_position_offsets")
    ko = _offsets(key_position_offsets, 0, dims.batch, "key_position_offsets")
    if fp32:
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    # The default offsets are the same for every sequence and known now.
    static_offset = (dims.kv_len - dims.q_len if query_position_offsets is None
                     and key_position_offsets is None else None)
    return _cp_attention(q, k, v, key_padding_mask, qo, ko, be.serving(q.dtype), bool(causal),
                         resolve_scale(scale, dims.head_dim), int(cp_world_size),
                         kv_chunk_size, static_offset)


def forward_with_lse(q, k, v, *, causal=True, scale=None, key_padding_mask=None,
                     query_position_offsets=None, key_position_offsets=None, cp_world_size=1,
                     kv_chunk_size=None, backend=None):
    """CP attention: ``(out [B, Hq, Sq, D] q.dtype, lse [B, Hq, Sq] fp32)``.

    Args:
      q, k, v, causal, scale, key_padding_mask: as :func:`jaxattn.attention`.
      query_position_offsets: ``[B]`` int, global position of query 0 (default Skv - Sq).
      key_position_offsets: ``[B]`` int, global position of key 0 (default 0).
      cp_world_size: number of shards of queries and keys (simulated on one device).
      kv_chunk_size: keys per partial-state range inside a shard (default: the shard).
      backend: None (platform priority), "mosaic" (sm90), "pallas" or "reference".
    """
    return _cp(q, k, v, causal=causal, scale=scale, key_padding_mask=key_padding_mask,
               query_position_offsets=query_position_offsets,
               key_position_offsets=key_position_offsets, cp_world_size=cp_world_size,
               kv_chunk_size=kv_chunk_size, fp32=False, backend=backend)


def forward(q, k, v, **kwargs):
    """CP attention output (see :func:`forward_with_lse`)."""
    return forward_with_lse(q, k, v, **kwargs)[0]


def forward_fp32_with_lse(q, k, v, *, causal=True, scale=None, key_padding_mask=None,
                          query_position_offsets=None, key_position_offsets=None,
                          cp_world_size=1, kv_chunk_size=None, backend=None):
    """CP attention on fp32-upcast inputs: fp32 ``(out, lse)``."""
    return _cp(q, k, v, causal=causal, scale=scale, key_padding_mask=key_padding_mask,
               query_position_offsets=query_position_offsets,
               key_position_offsets=key_position_offsets, cp_world_size=cp_world_size,
               kv_chunk_size=kv_chunk_size, fp32=True, backend=backend)


def forward_fp32(q, k, v, **kwargs):
    """fp32 CP attention output (see :func:`forward_fp32_with_lse`)."""
    return forward_fp32_with_lse(q, k, v, **kwargs)[0]


# --------------------------------------------------------------------------- on a mesh

def _chunks(n: int, s: int, load_balance: bool) -> list[list[int]]:
    """Per device, the global sequence chunks it holds (chunk size s // n, or s // 2n)."""
    if not load_balance:
        return [[i] for i in range(n)]
    return [[i, 2 * n - 1 - i] for i in range(n)]


def _layout(n: int, s: int, load_balance: bool):
    """(permutation putting each device's chunks together, chunk length, chunks)."""
    chunks = _chunks(n, s, load_balance)
    per = len(chunks[0])
    c = s // (n * per)
    perm = np.concatenate([np.arange(j * c, (j + 1) * c) for dev in chunks for j in dev])
    return perm, c, chunks


def device_chunks(chunks: list[list[int]], c: int, i) -> list[tuple[slice, jax.Array]]:
    """Device ``i``'s chunks of the sharded sequence: (slice of its local rows, global
    position of the chunk's first row), for :func:`mesh_forward` and :func:`mesh_backward`.
    ``i`` is the device's index on the mesh axis (traced inside ``shard_map``)."""
    starts = jnp.asarray([[j * c for j in dev] for dev in chunks], jnp.int32)[i]
    return [(slice(t * c, (t + 1) * c), starts[t]) for t in range(len(chunks[0]))]


def mesh_forward(be: Backend, q_l, k_all, v_all, m_all, own, *, causal: bool, scale: float):
    """One device's forward on the mesh: its own query rows ``q_l`` (the chunks ``own``
    of :func:`device_chunks`) over all the keys, gathered in natural order. Returns
    ``(out, lse)`` of its rows; the rows of a chunk are placed by their global position,
    so no reduction depends on the device count."""
    b = q_l.shape[0]
    outs = [be.forward_with_lse(q_l[:, :, sl], k_all, v_all, key_padding_mask=m_all,
                                causal_offsets=jnp.full((b,), st), causal=causal,
                                scale=scale)
            for sl, st in own]
    return (jnp.concatenate([o for o, _ in outs], 2),
            jnp.concatenate([l_ for _, l_ in outs], 2))


def mesh_backward(be: Backend, q_l, k_l, v_l, m_l, do_l, lse_l, dl_l, own, *, q_all,
                  do_all, lse_all, delta_all, k_all, v_all, m_all, causal: bool,
                  scale: float):
    """One device's backward on the mesh: dK and dV of its own keys over every query
    (``*_all``: gathered in natural order, with their final lse and delta), dQ of its own
    queries over every key. Returns ``(dq, dk, dv)`` of its chunks ``own``."""
    b = q_l.shape[0]
    kw = dict(causal=causal, scale=scale)
    dks, dvs, dqs = [], [], []
    for sl, st in own:
        ms = None if m_l is None else m_l[:, sl]
        dk, dv = be.key_gradients(q_all, k_l[:, :, sl], v_l[:, :, sl], ms, do_all, lse_all,
                                  delta_all, causal_offsets=jnp.full((b,), -st), **kw)
        dq = be.query_gradients(q_l[:, :, sl], k_all, v_all, m_all, do_l[:, :, sl],
                                lse_l[:, :, sl], dl_l[:, :, sl],
                                causal_offsets=jnp.full((b,), st), **kw)
        dks.append(dk)
        dvs.append(dv)
        dqs.append(dq)
    return tuple(jnp.concatenate(x, 2) for x in (dqs, dks, dvs))


def sharded_attention(q, k, v, *, mesh, axis_name: str, causal: bool = True,
                      scale: float | None = None, key_padding_mask=None,
                      load_balance: bool = False, return_lse: bool = False,
                      backend: str | Backend | None = None):
    """Attention over q, k, v sharded along the sequence on ``mesh[axis_name]``.

    Args:
      q: ``[B, Hq, S, D]``; k, v: ``[B, Hkv, S, D]`` (self-attention, Sq == Skv == S);
        S must divide into ``n`` equal shards (``2n`` chunks with ``load_balance``).
      mesh, axis_name: the mesh and the axis that shards the sequence.
      load_balance: for causal attention, device i holds chunks i and 2n-1-i of the
        sequence instead of chunk i (the caller passes natural order; the permutation is
        applied here). It balances the causal work and never changes the bits.
      backend: None (the backend :func:`jaxattn.attention` picks on the inputs'
        platform: ``mosaic`` on sm90, the reference on a CPU) or a backend name or
        object; it must have the "cp_mesh" path (the reference, ``pallas`` and
        ``mosaic`` have it).

    Forward: each device all-gathers K and V and computes its own query rows over all
    keys with the backend's forward. Backward: each device all-gathers q, dO, lse and delta
    (and K, V), computes dK and dV of its own keys over every query and dQ of its own
    queries over every key. No reduction crosses devices, so with a kernel backend
    forward and backward give the bits of ``jaxattn.attention`` with that backend on one
    device when chunk boundaries fall on multiples of 64 (the backward's block) -- and,
    for the forward, always. The reference's mesh gradients agree with its one-device
    gradients within rounding.
    """
    from jax.sharding import PartitionSpec as P

    dims = validate_inputs(q, k, v, causal=causal, scale=scale,
                           key_padding_mask=key_padding_mask)
    if dims.q_len != dims.kv_len:
        raise ValueError(f"sharded_attention is self-attention: Sq ({dims.q_len}) must "
                         f"equal Skv ({dims.kv_len})")
    be = registry.resolve("attention", backend)
    reason = be.unsupported(dims, "cp_mesh")
    if reason is not None:
        raise ValueError(f"backend {be.name!r} cannot serve this call: {reason}")
    be = be.serving(dims.dtype)
    n = mesh.shape[axis_name]
    s = dims.q_len
    parts = n * (2 if load_balance else 1)
    if s % parts:
        raise ValueError(f"sequence length {s} must divide into {parts} equal chunks "
                         f"({n} devices{', load-balanced' if load_balance else ''})")
    sc = resolve_scale(scale, dims.head_dim)
    perm, c, chunks = _layout(n, s, load_balance)
    inv = np.argsort(perm)
    has_mask = key_padding_mask is not None
    seq = P(None, None, axis_name, None)
    vec = P(None, None, axis_name)
    mspec = P(None, axis_name)
    b = dims.batch
    kw = dict(causal=bool(causal), scale=sc)

    def gather(x, axis):
        full = lax.all_gather(x, axis_name, axis=axis, tiled=True)
        return jnp.take(full, inv, axis=axis) if load_balance else full

    def fwd_local(q_l, k_l, v_l, m_l):
        own = device_chunks(chunks, c, lax.axis_index(axis_name))
        return mesh_forward(be, q_l, gather(k_l, 2), gather(v_l, 2),
                            gather(m_l, 1) if has_mask else None, own, **kw)

    def bwd_local(q_l, k_l, v_l, m_l, out_l, lse_l, do_l, dlse_l):
        own = device_chunks(chunks, c, lax.axis_index(axis_name))
        dl_l = be.delta(out_l, do_l, dlse_l)
        gathered = dict(q_all=gather(q_l, 2), do_all=gather(do_l.astype(q_l.dtype), 2),
                        lse_all=gather(lse_l, 2), delta_all=gather(dl_l, 2),
                        k_all=gather(k_l, 2), v_all=gather(v_l, 2),
                        m_all=gather(m_l, 1) if has_mask else None)
        return mesh_backward(be, q_l, k_l, v_l, m_l if has_mask else None, do_l, lse_l,
                             dl_l, own, **gathered, **kw)

    mask_in = key_padding_mask if has_mask else jnp.zeros((b, s), bool)
    fwd_map = jax.shard_map(fwd_local, mesh=mesh, in_specs=(seq, seq, seq, mspec),
                            out_specs=(seq, vec), check_vma=False)
    bwd_map = jax.shard_map(bwd_local, mesh=mesh,
                            in_specs=(seq, seq, seq, mspec, seq, vec, seq, vec),
                            out_specs=(seq, seq, seq), check_vma=False)

    @jax.custom_vjp
    def attn(q, k, v, m):
        return fwd_map(q, k, v, m)

    def attn_fwd(q, k, v, m):
        out, lse = fwd_map(q, k, v, m)
        return (out, lse), (q, k, v, m, out, lse)

    def attn_bwd(res, cts):
        q, k, v, m, out, lse = res
        d_out, d_lse = cts
        dq, dk, dv = bwd_map(q, k, v, m, out, lse, d_out, d_lse)
        return dq, dk, dv, None

    attn.defvjp(attn_fwd, attn_bwd)
    if load_balance:
        q, k, v = (jnp.take(x, perm, axis=2) for x in (q, k, v))
        mask_in = jnp.take(mask_in, perm, axis=1)
    out, lse = attn(q, k, v, mask_in)
    if load_balance:
        out, lse = jnp.take(out, inv, axis=2), jnp.take(lse, inv, axis=2)
    return (out, lse) if return_lse else out


class CPAttentionOp(registry.AttentionOp):
    """The ``"cp_attention"`` op (this module's CP reference contract)
    bound to one backend: every entry takes the attention arguments plus
    ``query_position_offsets`` / ``key_position_offsets`` (``[B]`` int, global positions
    of query 0 and key 0), ``cp_world_size`` and ``kv_chunk_size``."""

    path = "cp"

    def forward_with_lse(self, q, k, v, *, causal: bool = True, scale: float | None = None,
                         key_padding_mask=None, query_position_offsets=None,
                         key_position_offsets=None, cp_world_size: int = 1,
                         kv_chunk_size: int | None = None) -> tuple[jax.Array, jax.Array]:
        """``(out [B, Hq, Sq, D] in q.dtype, lse [B, Hq, Sq] fp32)``."""
        return forward_with_lse(
            q, k, v, causal=causal, scale=scale, key_padding_mask=key_padding_mask,
            query_position_offsets=query_position_offsets,
            key_position_offsets=key_position_offsets, cp_world_size=cp_world_size,
            kv_chunk_size=kv_chunk_size, backend=self._backend)

    def forward(self, q, k, v, **kwargs) -> jax.Array:
        """``out [B, Hq, Sq, D]`` in ``q.dtype``."""
        return self.forward_with_lse(q, k, v, **kwargs)[0]

    __call__ = forward

    def forward_fp32_with_lse(self, q, k, v, *, causal: bool = True,
                              scale: float | None = None, key_padding_mask=None,
                              query_position_offsets=None, key_position_offsets=None,
                              cp_world_size: int = 1,
                              kv_chunk_size: int | None = None) -> tuple[jax.Array, jax.Array]:
        """fp32 inputs, fp32 ``(out, lse)``."""
        return forward_fp32_with_lse(
            q, k, v, causal=causal, scale=scale, key_padding_mask=key_padding_mask,
            query_position_offsets=query_position_offsets,
            key_position_offsets=key_position_offsets, cp_world_size=cp_world_size,
            kv_chunk_size=kv_chunk_size, backend=self._backend)

    def forward_fp32(self, q, k, v, **kwargs) -> jax.Array:
        """fp32 inputs, fp32 ``out``."""
        return self.forward_fp32_with_lse(q, k, v, **kwargs)[0]


registry.register_op("cp_attention", CPAttentionOp)
