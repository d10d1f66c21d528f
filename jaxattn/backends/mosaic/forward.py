"""Pallas Mosaic GPU (Hopper: wgmma + TMA) attention forward (issue #8).

Registered as the ``"mosaic"`` backend through :mod:`jaxattn.backends.mosaic.backend`
(the registry's choice on sm90; docs/mosaic.md).
Developed on a CPU machine (Mosaic GPU interpret mode, lowering for CUDA) and measured
on an H200.

Scope (a subset of the tensor contract, DESIGN.md section 3): q ``[B, Hq, Sq, D]``,
k/v ``[B, Hkv, Skv, D]``, bf16 (or fp16), D in {64, 128, 256} (:data:`HEAD_DIMS`), GQA
(query head h reads KV head ``h // (Hq // Hkv)``), optional causal mask with offset
``Skv - Sq`` (or one per sequence: ``causal_offsets``), optional key padding mask, any
``Sq`` and ``Skv`` (padded internally: :func:`padding`).

Structure (FlashAttention-3's, on the canonical schedule): one CTA per (query tile,
query head, batch), heaviest causal tiles first, with ``compute_wgs`` compute
warpgroups of ``block_m`` = 64 query rows each and one producer warpgroup:

* the producer TMA-loads the K and V blocks of ``BLOCK_N`` keys into a ring of
  ``stages`` SMEM slots shared by the compute warpgroups, waiting on a "consumed"
  barrier (one arrival per compute warpgroup) before reusing a slot; ``setmaxnreg``
  moves registers from it to the compute warpgroups;
* each compute warpgroup TMA-loads its Q tile once, then walks the key blocks in
  ascending order: S = Q K^T on wgmma, the online-softmax step (same operations as
  :func:`jaxattn.backends.common.online_softmax_step`; the row max of the raw scores is
  scaled after, so ``s * scale - m`` contracts to one FMA alike on every block), the
  row sum (``rowsum``), and P V on wgmma, accumulated in place into ``acc * alpha`` or
  into a fresh accumulator (``accumulate``). Blocks every row of the warpgroup sees
  skip the causal ``where``. A shared barrier staggers the two compute warpgroups so
  that one's softmax overlaps the other's matrix products (``pingpong``); three (a
  D=64 prefill on one CTA a tile, not causal, or where :func:`c3_causal_pays`:
  :func:`auto_compute_wgs`) pass a turn round, one barrier each, so that each one's
  softmax overlaps the other two's products;
* at every ``SPLIT`` boundary (an outer loop over splits around the inner loop over
  blocks) the split's state is finalised and folded into the running state by
  :func:`kernel_finalize` / :func:`kernel_merge`: :func:`jaxattn.merge.finalize` /
  :func:`jaxattn.merge.merge` in the kernels' base 2, with the ``x[..., None]`` row
  broadcasts spelled as one ``broadcast_in_dim`` (Mosaic GPU cannot lay out an
  ``[M, 1]`` array) and the output normalised by a row reciprocal (``normalize``).

The backend's own bits (not the Pallas backend's; every path of the backend runs these
kernels): ``exp2``/``log2`` are the approximate ``ex2``/``lg2`` instructions
(``approx_math``, 10% faster on the H200), deterministic like every instruction.

Two operand modes (``gpu_operands``); the arithmetic is the same in both:

* True (the Hopper path, for the GPU and for lowering): K^T is a transposed view of
  the K slot (the slot ref's ``.transpose((1, 0))``) and P is the wgmma A operand from
  registers.
* False (the interpret-mode subset): the JAX 0.10.2 interpreter supports neither a
  transposed SMEM operand (``TransposeTransform`` has no ``indices``) nor a register A
  operand, so K is pre-transposed by XLA to ``[B, Hkv, D, Skv]`` and TMA-loaded as
  ``[D, BLOCK_N]`` tiles, and P is staged through SMEM. This path also lowers for
  CUDA, so the kernel checked in interpret mode is itself a valid Hopper kernel.

Layout hints (``plgpu.layout_cast``, ``broadcasted_iota(layout=...)``) are emitted only
when not interpreting: the interpreter has no CPU rule for ``layout_cast``, and the GPU
lowering needs them ("Failed to infer the output layout of the iota").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import heapq
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxattn import schedule
from jaxattn.backends.base import page_dims
from jaxattn.backends.common import LN2, LOG2E
from jaxattn.validation import as_bhsd

NEG_INF = float("-inf")

try:  # the view of an SMEM column tile's box as a tiled [rows, cols] tile (kv_boxes)
    from jax._src.pallas.core import TransformedRef
    from jax._src.pallas.mosaic_gpu.core import UntilingTransform
except ImportError:  # pragma: no cover - a JAX without them: K and V padded in a copy
    TransformedRef = UntilingTransform = None


def arrive_where(barrier, when=True) -> None:
    """One arrival on ``barrier`` where ``when``: a Python bool (True: arrive, False:
    nothing), or a traced one (the arrival under ``pl.when``)."""
    if when is True:
        plgpu.barrier_arrive(barrier)
    elif when is not False:
        pl.when(when)(lambda: plgpu.barrier_arrive(barrier))


def two_slot_loop(lo, hi, step, carry, first):
    """``step(t, carry, slot=...)`` for t in ``[lo, hi)`` in order, each with its slot of
    a two-slot ring as a Python int: the loop unrolled by the two slots and branched
    once on ``first`` (the slot of step ``lo``: an int, or a traced int32 0 or 1); an
    odd count's last step after the pairs. The same steps in the same order as
    ``lax.fori_loop(lo, hi, ...)`` with the slot computed per step (``static_slots``
    of the forward and the backward)."""
    def from_slot(f, carry):
        def pair(i, c):
            t = lo + 2 * i
            return step(t + 1, step(t, c, slot=f), slot=1 - f)

        carry = lax.fori_loop(0, lax.div(hi - lo, 2), pair, carry)
        return lax.cond(lax.rem(hi - lo, 2) == 1, lambda c: step(hi - 1, c, slot=f),
                        lambda c: c, carry)

    if isinstance(first, int):
        return from_slot(first, carry)
    return lax.cond(first == 0, functools.partial(from_slot, 0),
                    functools.partial(from_slot, 1), carry)


def untiled_view(ref, tiling: tuple[int, ...]):
    """``ref`` (an SMEM ref of shape ``[..., M / X, N / Y, X, Y]``) viewed as ``[..., M,
    N]`` tiled by ``tiling = (X, Y)``: ``plgpu.transform_ref(ref,
    UntilingTransform(tiling))`` of JAX 0.10, which JAX 0.11 no longer exports."""
    if not isinstance(ref, TransformedRef):
        ref = TransformedRef(ref, ())
    return TransformedRef(ref.ref, (*ref.transforms, UntilingTransform(tiling)))


#: :func:`launch`'s modes (``MosaicConfig.pdl``).
PDL_MODES = ("both", "wait", "trigger", "off")


def check_pdl(name: str, mode, *, optional: bool = False) -> None:
    """A ValueError naming ``name`` unless ``mode`` is one of :data:`PDL_MODES` (or None,
    where ``optional``)."""
    if mode not in PDL_MODES + ((None,) if optional else ()):
        raise ValueError(f"{name} must be one of {PDL_MODES}, got {mode!r}")


#: ``store_wait``'s modes (``MosaicConfig``, ``BwdConfig``).
STORE_WAITS = ("write", "read")


def check_store_wait(mode) -> None:
    """A ValueError unless ``mode`` is one of :data:`STORE_WAITS`."""
    if mode not in STORE_WAITS:
        raise ValueError(f"store_wait must be one of {STORE_WAITS}, got {mode!r}")


def wait_stores(mode: str) -> None:
    """The calling thread's TMA stores (SMEM to GMEM) awaited: until written ("write")
    or until their SMEM has been read ("read", CUTLASS's ``tma_store_wait``): enough to
    reuse the staging SMEM or to exit, as nothing in the kernel reads what it stored
    (a dependent grid's ``griddepcontrol.wait`` waits for the writes)."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=mode == "read")


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Launch parameters and the arithmetic choices of the kernel.

    Launch parameters (``block_m``, ``compute_wgs``, ``stages``, ``gpu_operands``,
    ``semantics``, ``pingpong``, ``registers``, ``registers3``, ``q_order``, ``persistent``,
    ``prefetch_q``, ``masks_in_loop``, ``fence``, ...) must not
    change the bits of a row; ``benchmarks/mosaic_gpu_check.py`` checks that on the GPU.
    ``accumulate``, ``rowsum``, ``normalize`` and ``approx_math`` change the
    floating-point operations, so they are fixed per backend, never chosen by shape.
    """

    #: Query rows per compute warpgroup (the wgmma M: 64 or 128).
    block_m: int = 64
    #: Compute warpgroups per CTA (1, 2 or 3); they share the K/V stream, so a CTA
    #: covers ``block_m * compute_wgs`` query rows of one head. A further warpgroup
    #: loads K/V. Three (FlashAttention-3's launch at D=64) take the ping-pong as a
    #: ring of turns (``pingpong``) and ``registers3``. None (the default): three for
    #: a D=64 prefill on the GPU where the grid is one CTA a tile (not persistent),
    #: the call is not causal or the persistent grid's work model says three pay
    #: (:func:`auto_compute_wgs`, :func:`c3_causal_pays`), else two (decode rows and
    #: split states take one). A launch choice: the same bits.
    compute_wgs: int | None = None
    #: K/V SMEM ring slots (TMA prefetch depth).
    stages: int = 2
    #: None: the Hopper operand path unless interpreting (see the module docstring).
    gpu_operands: bool | None = None
    #: Mosaic GPU lowering semantics, pinned: "lane" (the default of JAX 0.10.x) or
    #: "warpgroup" (the default from JAX 0.11.0). Both lower on 0.10.2; the interpreter
    #: ignores it.
    semantics: str = "lane"
    #: "inplace" (None: the default on the GPU operand path): ``acc * alpha`` is the P V
    #: wgmma's initial accumulator (FlashAttention-3); "fresh" (None in interpret mode,
    #: whose wgmma cannot accumulate into a live accumulator, and with
    #: ``gpu_operands=False``): P V goes into a fresh
    #: accumulator added to ``acc * alpha`` (the Triton kernels' order). They round
    #: differently; on the H200 "inplace" was the faster (docs/mosaic.md).
    accumulate: str | None = None
    #: Row sum of a block's probabilities: "reduce32" (default) sums the fp32
    #: probabilities in the fixed WGMMA register layout of a 64-row warpgroup tile;
    #: "mma" multiplies the bf16 probabilities by an all-ones tile on wgmma (as
    #: ``schedule.ROWSUM`` does for the Triton kernels). On the H200 "reduce32" was the
    #: faster, and its bits hold across launches with 64-row tiles (not with 128).
    rowsum: str = "reduce32"
    #: With ``rowsum="reduce32"``: take a block's row sum (and ``l``'s update) after
    #: its P V wgmma is issued, inside the product's scope, so that its cross-thread
    #: shuffles and adds run while the product does, instead of before its issue
    #: (where the H200's stall samples put 7 to 8% of the forward's key-block loop on
    #: the adds waiting for the shuffles: docs/notes.md "2026-12-05 (sixth)"). The
    #: same operations on the same values: a launch choice. None (the default): on for
    #: a prefill (not decode rows, not split states) where the grid is not persistent,
    #: off on the persistent grid (:func:`auto_late_rowsum`): on the H200 (2026-12-05,
    #: tree b3c59c7) it kept the bits and was 3 to 6% faster at S >= 8192 (D=128; 2% at
    #: D=64) but 12 to 20% slower at S=2048 (the persistent grid); by shape, on the H100
    #: (2026-12-05, tree b5a8018), 4 to 7% faster at D=128 S >= 8192 (docs/mosaic.md).
    late_rowsum: bool | None = None
    #: The running state folded across SPLITs (the merged fp32 output; its lse stays in
    #: registers) kept in SMEM instead of registers, each SPLIT merged into it
    #: :data:`SMEM_STATE_COLS` columns at a time (:meth:`_Forward.fold_in_smem`). At
    #: D=256 the state (128 registers a thread) and a SPLIT's accumulator do not fit the
    #: registers together: ptxas spills about 1.6 KB a thread from the second SPLIT on
    #: (docs/mosaic.md, "Known limits"). Its SMEM (a 64xD fp32 tile per compute
    #: warpgroup) fits beside the ring at D=256 with one compute warpgroup
    #: (``compute_wgs=1``; the lse rows then share the ring's SMEM, idle by the
    #: epilogue). For a prefill on a grid of one CTA per tile; ignored for decode rows,
    #: split or CP states and the persistent grid. The same operations on the same
    #: values (the merge is elementwise per column; the merge's FMA pinned to the
    #: registers' product, :func:`merge_apply`): a launch choice. None (the default):
    #: by shape (:func:`auto_smem_state`): at D=256 on the GPU, a prefill whose keys
    #: span more than one SPLIT runs one compute warpgroup with the SMEM state; on
    #: the H200 (2026-12-05, tree 5597bb8 + the pinned FMA) 1.08 to 1.36x the two
    #: warpgroups' TFLOP/s causal from S=2048, 1.07 to 1.15x non-causal, but 0.72x at
    #: S=1024 (one SPLIT: nothing to merge), where the two stay. False: never (two
    #: warpgroups at D=256 then spill the state).
    smem_state: bool | None = None
    #: One 64-row query tile a CTA on two compute warpgroups with two roles (where
    #: ``smem_state`` applies: a prefill on a grid of one CTA per tile whose output is
    #: not a state): warpgroup 0 computes each key block's S = Q K^T and the online
    #: softmax and hands P (in the input dtype) and the rows' rescale factors over in
    #: SMEM; warpgroup 1 runs every block's P V into the SPLIT's 64xD accumulator and
    #: hands it over at the SPLIT's end, when warpgroup 0 finalises it and merges it
    #: into the running state it holds (:class:`_PvSplitForward`). Warpgroup 0's
    #: softmax of block t + 1 then runs while warpgroup 1's P V of block t keeps the
    #: tensor cores busy, and neither warpgroup holds both a 64xD accumulator and a
    #: 64xD state (the registers' limit at D=256 that ``smem_state`` works around). Per
    #: element the operations of one warpgroup's step (S, the softmax, P's rounding,
    #: ``acc * alpha`` and the P V product, the finalize and the merge with its FMA
    #: pinned as ``smem_state``'s): a launch choice, the same bits. Not with a key
    #: mask, pages, decode rows, ``rowsum="mma"`` or ``block_m=128`` (ignored there).
    #: None (the default): off (H100, 2026-12-06: 0.61 to 0.91x the default at D=256,
    #: notes "twelfth stop"; with the late hand-over 0.70 to 1.01x, notes "thirteenth
    #: stop").
    pv_split: bool | None = None
    #: Two CTAs of a cluster run two query heads of one KV head (heads 2i and 2i + 1 of
    #: a GQA group, the same query tile and sequence: the same key blocks) and load
    #: each K and V block once between them: each producer issues half of the block's
    #: TMA copy, multicast into both CTAs' slots, and a slot is refilled once both
    #: CTAs' compute warpgroups have released it (a cluster barrier). The L2 reads of
    #: K and V halve. The same blocks in the same SMEM bytes: a launch choice. For a
    #: prefill on a grid of one CTA per tile with a producer warpgroup, an even GQA
    #: group, without pages or ``kv_boxes`` (ignored elsewhere, and in interpret mode).
    #: None (the default): on where the prefill folds its state in SMEM or the global
    #: scratch (``gmem_state``'s and ``smem_state``'s defaults: D=256 past one SPLIT;
    #: with ``gmem_state`` 1.01 to 1.14x it alone; ``pv_split=True`` keeps it too: 1.0
    #: to 1.07x ``pv_split`` alone), :func:`auto_kv_multicast`. H100, 2026-12-06
    #: (notes "thirteenth stop"): there 1.00 to 1.12x at B * S = 32k, S 2048 to
    #: 32768, causal and not (bits equal); at one SPLIT (two warpgroups) 0.95 to
    #: 1.03x, at D=128 0.87 to 1.10x, at D=64 0.93 to 0.99x: off there.
    kv_multicast: bool | None = None
    #: The running state folded across SPLITs kept in a global fp32 scratch (an output
    #: of the kernel the call drops: a slot of the CTA's rows per SM, ``[144, 128, D]``,
    #: 19 MB at D=256 whatever the tokens, the CTA's slot its SM's ``%smid``, each
    #: warpgroup its rows; applied where the kernel's SMEM leaves no room for a second
    #: CTA on the SM, :data:`GMEM_STATE_MIN_SMEM`) instead of registers or SMEM, each
    #: SPLIT's finalised state merged into it :data:`SMEM_STATE_COLS` columns at a time
    #: straight from and to the registers (``smem_state``'s merge, the same operations:
    #: a launch choice; each thread reads back only the elements it wrote; the scratch
    #: touched only between SPLITs, :meth:`_Forward.fold_in_gmem`). For D=256 with two
    #: compute warpgroups, whose states do not fit the SMEM beside their Q tiles and the
    #: ring and spill from registers: a second warpgroup's products beside the first's
    #: softmax (the one-warpgroup SMEM state's loop waits on its own wgmmas in 39% of
    #: its samples, H100, 2026-12-06). Where ``smem_state`` applies (a prefill on a grid
    #: of one CTA per tile, not a state's kernel), which it replaces; ignored elsewhere.
    #: None (the default): by shape (:func:`auto_gmem_state`): where ``smem_state``'s
    #: default would take the one-warpgroup SMEM state (D=256 on the GPU, keys past one
    #: SPLIT) and ``compute_wgs`` is 2, with ``kv_multicast``'s default on: on the H100
    #: (2026-12-06, the per-SM slots, docs/mosaic.md) 1.03 to 1.12x that launch causal
    #: (S 2048 to 16384, B * S = 32k), 1.00 to 1.09x non-causal, bits equal. False:
    #: never (then ``smem_state``'s default as before).
    gmem_state: bool | None = None
    #: With two compute warpgroups: a shared barrier staggers them so that one's softmax
    #: overlaps the other's matrix products (FlashAttention-3's ping-pong). With three:
    #: a ring of turns, one barrier a warpgroup: a warpgroup issues its products (block
    #: j's P V, then block j + 1's S) only in its turn, passed on once they are issued,
    #: so the three issue in a fixed rotation and each one's softmax overlaps the other
    #: two's products (FlashAttention-3's scheduler barriers for three MMA warpgroups).
    pingpong: bool = True
    #: With the ping-pong, at the end of each SPLIT followed by another of the item: the
    #: arrival that the next SPLIT's first S = Q K^T would make once issued is made
    #: before the SPLIT's finalise and merge instead (its wait stays after the issue).
    #: The ping-pong's barrier is a rendezvous: the other warpgroup waits for that
    #: arrival before its P V, so a merge between the two held both warpgroups (about
    #: twice the merge of idle tensor cores a SPLIT, notes "Open after 2026-12-06
    #: (fifteenth)"). Each warpgroup's arrivals and waits keep their count and order
    #: (an arrival moved earlier, after the wait before it): only the products' order
    #: between the warpgroups changes, not an operation on a value (the same bits). None
    #: (the default): on with ``gmem_state``, whose merges read and write the global
    #: scratch; off for the registers' fold. Ignored without the ping-pong.
    merge_arrive: bool | None = None
    #: With ``merge_arrive`` and ``gmem_state``: warpgroup 0's last SPLIT too. Its next
    #: ping-pong arrival (the first of the blocks only warpgroup 1 visits, or the
    #: item's closing sync) is made before its last merge, which otherwise held
    #: warpgroup 1's last P V (warpgroup 1, a phase behind, makes no arrival after its
    #: last merge: nothing to move). The same bits (as ``merge_arrive``). None (the
    #: default): on for a non-causal forward, off for a causal one: on the H100
    #: (2026-12-06, two runs, D=256 B * S = 32k, notes "seventeenth stop") non-causal
    #: 1.00 to 1.05x without it (S 2048 to 16384), causal 0.98 to 0.99x at S=2048 and
    #: 1.00 to 1.01x beyond.
    last_merge_arrive: bool | None = None
    #: ``setmaxnreg`` for (compute, producer) warpgroups with two compute warpgroups, or
    #: None to leave the allocation alone.
    registers: tuple[int, int] | None = (232, 40)
    #: ``setmaxnreg`` for (compute, producer) warpgroups with three compute warpgroups
    #: (512 threads: at most 65536 registers in all), or None to leave the launch's 128.
    registers3: tuple[int, int] | None = (160, 24)
    #: "descending": the CTAs of the last (longest causal) query tiles start first.
    q_order: str = "descending"
    #: Decode and up to ``64 / group`` queries per head (speculative verification):
    #: stack the GQA group's heads' queries as the rows of one warpgroup tile, reading
    #: K and V once per group; False pads each head's rows into a tile of its own at
    #: their prefill tile rows (``padding``). A decode row then sits
    #: at another row of its tile than in the prefill: equal bits need a matrix unit
    #: whose row results do not depend on the row's place (the Mosaic GPU interpreter's
    #: ``np.matmul`` does, by 1 ulp now and then; the H200's wgmma is checked by
    #: benchmarks/mosaic_gpu_check.py).
    stack_decode: bool = True
    #: A persistent grid of this many CTAs (0: one CTA per tile; None: the GPU's SM
    #: count where :func:`auto_persistent` says, short tiles at D <= 128, else 0). Each
    #: CTA walks its (tile, head, batch) items in the order of its row of the greedy
    #: table (:func:`persistent_schedule`), its K/V ring running on across items. The
    #: rows' operations are those of one CTA per tile: the same bits.
    persistent: int | None = None
    #: With ``persistent``: two Q buffers per compute warpgroup, and the next item's Q
    #: tile is loaded while this item runs (FlashAttention-3's persistent prologue
    #: overlap), instead of after this item's output store. The same operations.
    #: None: with a persistent grid, where the second Q buffer fits the SMEM
    #: (:func:`smem_bytes` within :data:`SMEM_LIMIT`).
    prefetch_q: bool | None = None
    #: With ``prefetch_q``, a plain prefill's output: an item's epilogue does not await
    #: its TMA stores; they are awaited before their SMEM is next written (before the Q
    #: load into that buffer two items on, before the next epilogue's lse row, at the
    #: CTA's end), so the store's read of SMEM overlaps the next item. The same stores
    #: of the same values: a launch choice.
    defer_store_wait: bool = False
    #: A plain prefill's tiles padded past the last query: a compute warpgroup whose
    #: rows are all padding visits no key block (it releases the CTA's blocks, passes
    #: its turns and stores (0, -inf), which the call drops) instead of computing rows
    #: nobody reads. Each row's operations are unchanged: a launch choice. Not with
    #: ``merge_arrive`` (the D=256 ``gmem_state`` kernel), whose arrivals assume
    #: every warpgroup has blocks. None (:func:`auto_skip_padding_rows`): for a
    #: non-causal call (H100, 2026-12-07: 1.05 to 1.11x at D=64 S=512 to 2560, notes
    #: "twenty-ninth stop"), and for a causal one of three warpgroups over at most
    #: :data:`C3_CAUSAL_SKIP_MAX_BLOCKS` key blocks (S <= 2048; past them three
    #: warpgroups at B=8 S=4096 ran 0.93 to 0.94x without it). Where it is on, the
    #: work model (:func:`c3_causal_pays`) counts a padded warpgroup free.
    skip_padding_rows: bool | None = None
    #: Decode (the stacked GQA group) over more than one SPLIT of keys: one CTA per
    #: split writes the split's partial state and :func:`fold_partials` folds them in
    #: key order (as the Pallas backend's split-KV decode), so a long cache is read by
    #: many CTAs instead of one per (batch, KV head), with ``split_decode_stages`` ring
    #: slots. The in-kernel fold merges the same states with the same operations: the
    #: same bits (a launch choice). None: split when there are fewer (batch, KV head)
    #: CTAs than :data:`SPLIT_DECODE_BELOW_CTAS` (on the H200, run of 2026-12-01, 79e97f6: B=1
    #: S=16384 43.9 against 206 us, B=8 189 against 212 us; B=32 682 against 508 us).
    split_decode: bool | None = None
    #: K/V ring slots of the split decode kernel where D <= 128 (one warpgroup: SMEM
    #: holds more slots than the prefill's; 4 against 2 on the H200 with a producer
    #: warpgroup: 40.7 against 57.2 us at B=2 Skv=4096, run of 2026-12-01, 79e97f6).
    #: None: 4 with one CTA an SM, 2 with two (``ctas_per_sm``; 2 and 3 within 2% of
    #: each other there, run of 2026-12-05, 2bf087a). A launch choice.
    split_decode_stages: int | None = None
    #: SPLITs of keys one CTA of the split decode takes, one after another (its K/V
    #: ring running on across them, Q loaded once): each split's state is computed
    #: from the empty state over the split's blocks and stored as with one split a
    #: CTA, so the bits are those of 1 (a launch choice). Fewer, longer CTAs: each
    #: CTA's prologue (Q, the first blocks' latency) and the waves' tails are paid
    #: once for several splits. The state is staged for its store in column halves
    #: beside the ring (the ring's SMEM is busy at a split's end), so the ring keeps
    #: its ``split_decode_stages`` slots where they fit. None: as many splits a CTA as
    #: fill the GPU's CTA slots (SMs x ``ctas_per_sm``) once,
    #: :func:`splits_per_cta`. 1, the default: one split a CTA (None kept the bits
    #: and gained nothing on the H200, 2026-12-05, tree 19fbbc9: 0 to 1% slower at
    #: B=8 32768 and 131072 keys). The split decode only (CP's split states keep one
    #: a CTA).
    splits_per_cta: int | None = 1
    #: CTAs of a kernel of one compute warpgroup (the decode's stacked rows, split or
    #: not; CP's split states) that should share an SM: 1, a producer warpgroup beside
    #: the compute warpgroup (150 to 216 registers a thread for 256 threads leave room
    #: for one CTA an SM); or 2, no producer warpgroup: the compute warpgroup issues
    #: each slot's next K and V loads itself, K's once its S is read, V's once its P V
    #: is, ``stages`` blocks ahead, and the ring gets the slots that fit half an SM's
    #: SMEM (:data:`SMEM_LIMIT_TWO_CTAS`: a split kernel 3 at D=128, Q's untiled
    #: landing slot sharing the last V slot's SMEM; the unsplit decode its
    #: ``stages``, 3 at most; D=256 keeps the producer), so one CTA's prologue (Q, the
    #: first blocks' latency) and epilogue (the store) overlap the other's stream, and
    #: an SM has two CTAs' loads in flight. The same blocks in the same order: a
    #: launch choice. The default, 2: 2 to 6% faster decode steps than 1 at every
    #: point measured, contiguous and paged (H200, run of 2026-12-05, 2bf087a:
    #: B=8 Skv=8192 83.1 against 78.1 us, B=1 Skv=131072 150.5 against 145.0).
    ctas_per_sm: int = 2
    #: Build the causal mask's row and column indices inside each masked block (as
    #: JAX's ``attention_mgpu``) instead of once per tile: integer ops, the same bits;
    #: the tile's index arrays then do not hold registers through the unmasked blocks.
    masks_in_loop: bool = True
    #: An optimisation barrier on the softmax's results (rescaled accumulator, row
    #: sum, row max, P) before the ping-pong hand-off, as JAX's ``attention_mgpu``
    #: (which found the order of that code to matter): scheduling only, the same bits.
    fence: bool = True
    #: An optimisation barrier on each item's block bounds (``hi``, the blocks it
    #: visits, and ``full``, those without a mask), so the compiler treats them alike
    #: whatever they were computed from: scheduling only, the same bits. Built because
    #: ptxas gives D=64's three-warpgroup main loop two forms by shape, 289 (or 285)
    #: instructions or 294 with three more uniform ops (a register swap between the
    #: P V products, in the ring's turn); with the barrier every measured shape's loop
    #: is 289 (this machine's ptxas; notes "thirty-second stop"). None (the default,
    #: :func:`auto_opaque_bounds`): on for a D=64 causal prefill on the persistent grid
    #: past :data:`OPAQUE_BOUNDS_ABOVE_BLOCKS` key blocks, where the H100 measured
    #: 1.05 to 1.07x at S=1536 and 2048, 1.01 to 1.04x at 2560 and 3072 and 1.00 to
    #: 1.02x at 4096, against 0.93x at 512 and 0.93 to 0.96x at 1024 (notes
    #: "thirty-third stop"). It does not mend ``skip_padding_rows``' causal loss past
    #: 32 blocks (0.95x with both at B=8 S=4096).
    opaque_bounds: bool | None = None
    #: A split's output normalisation: "divide" (``acc / l``, each element) or
    #: "reciprocal" (``acc * (1 / l)``: one division per row, a product per element;
    #: the split's finalize costs a division per element otherwise, every SPLIT of
    #: every row). An arithmetic choice like ``accumulate``: its own bits, fixed per
    #: backend, the same in every path (the split states CP and split decode fold are
    #: finalized by the same kernel).
    normalize: str = "reciprocal"
    #: Mosaic GPU's ``approx_math``: ``exp2`` and ``log2`` as the single
    #: ``ex2.approx.ftz.f32`` / ``lg2.approx.ftz.f32`` instructions instead of the
    #: accurate sequences. An arithmetic choice (its own bits, fixed per backend); the
    #: interpreter ignores it.
    approx_math: bool = True
    #: The fold kernel's SMEM slots per CTA (:func:`fold_partials`, :func:`fold_tiles`:
    #: split decode, CP), an even number: two halves, the states of one merged while
    #: the next ones load into the other. None: as many as :data:`FOLD_SMEM` holds, 2
    #: to 16 (:func:`fold_launch`). A launch choice: the same merges in the same order.
    fold_slots: int | None = None
    #: Columns of D per fold CTA (16, 32, ... up to D): a tile's D is folded by D /
    #: ``fold_cols`` CTAs, each the same merges on its columns (the row weights are
    #: computed alike in each). None: split D while the tiles do not fill the GPU
    #: (:func:`fold_launch`). A launch choice.
    fold_cols: int | None = None
    #: Where K and V would be padded to whole blocks in a copy (a partial last key block: 63
    #: of 64 decode steps of a growing cache, with a key padding mask, per-sequence offsets
    #: or ``[B, S, H, D]`` or without): each key block is read in place as one TMA box of 64
    #: rows by 128 bytes per column tile (``D / 64`` boxes; any first row, and past Skv
    #: TMA's zeros, as the padded copy's) into a swizzled slot that holds its column tiles
    #: one after the other. Each column tile's bytes are those of a tiled, swizzled ``[64,
    #: 64]`` slot, which the matrix products and V's zeroing read through its tiled view
    #: (``UntilingTransform((8, 64))``): S as one wgmma per column tile into the same
    #: accumulator in column order (the whole tile's product issues the same k-steps in that
    #: order), P V as one per column tile into its columns of the accumulator. On the GPU
    #: operand path, in the "lane" semantics (the "warpgroup" semantics' layout inference
    #: refuses the swizzle-only slot); the interpreter, which refuses out-of-bounds reads
    #: and transposed operands, keeps the copy, as does ``False``. On the H200 (JAX 0.11.2,
    #: 2026-12-04, notes "2026-12-04 (tenth)", us): a decode step at B=8 8193 keys 81.4
    #: against 251.7 padded (8192 keys, whole blocks: 81.1), B=1 131073 152.7 against 483.9,
    #: B=32 8193 259.9 against 923.8; a causal prefill at B=2 S=4097 0.739 against 0.764 ms.
    #: (The first build, 8-row boxes, 16 a block, took the step to 100.6 us and the prefill
    #: to 1.026 ms.) A launch choice (the same keys in the same SMEM bytes; equal bits:
    #: ``test_kv_boxes_keep_bits_on_gpu``).
    kv_boxes: bool = True
    #: A plain prefill whose query rows are padded only at their end (a partial last
    #: CTA tile, with no causal lead: ``(Skv - Sq) mod BLOCK_N == 0`` or not causal) and
    #: a multiple of 8 (the tiling of Q's SMEM, which Mosaic GPU's TMA asks of GMEM):
    #: Q read and O written in place, the last tile's rows past Sq TMA's zeros on the
    #: load and clipped on the store, instead of a copy of Q padded to the CTA's rows
    #: and the output sliced back (three warpgroups' 192-row tiles pad most S: 258 MB
    #: at B=2 S=16384 D=64). The lse stays at the tiles' rows and is sliced (4 bytes a
    #: row): a tile's lse rows are one contiguous run, which Mosaic GPU stores as a
    #: plain bulk copy clipped only at the array's end (rows past Sq would land on the
    #: next head's; seen on the H100, 2026-12-06). The same rows computed on the same
    #: values (the padding rows are zeros either way). GPU only (the interpreter keeps
    #: the copy). On the H100 (2026-12-06, notes "nineteenth stop"; bits equal):
    #: B=8 S=4200 1.11x causal and 1.04x non-causal at D=64, 1.14x causal at D=128;
    #: B=2 S=16384 D=64 1.03x causal, 1.02x non-causal.
    q_boxes: bool = True
    #: The softmax consumer's unmasked key blocks in a loop unrolled by the K/V ring's
    #: two slots, branched once a SPLIT on the slot of its first block, so each step's
    #: slot, its barriers and their phase bits are constants, instead of ``(base + t)
    #: mod 2`` and a shift of the barrier array's phase bitfield at every wait (on the
    #: H100 about 45 uniform-datapath instructions of D=64's 289 a block a warp, a
    #: dependent chain before the next block's wait: notes "eighteenth stop"). An odd
    #: count's last block runs after the pairs. Where the ring has two slots and a
    #: producer warpgroup; None: on the GPU at D=64 (the interpreter keeps the dynamic
    #: slots, fewer programs to compile), but not for three compute warpgroups on a
    #: causal prefill on the persistent grid (:func:`auto_static_slots`). The same
    #: steps in the same order: a launch choice (``test_static_slots_keep_bits_on_gpu``).
    #: ptxas (CUDA 13): D=64's loop 274 instructions a block against 292 (three
    #: warpgroups 253 against 284), no spill;
    #: D=128's 336 against 332 with spills. On the H100 (2026-12-06, docs/mosaic.md's
    #: row) D=64 causal 1.06x at B=8 S=4096 and 1.02x at B=2 S=16384, D=128 0.89 to 0.91x.
    static_slots: bool | None = None
    #: Stacked decode rows (a GQA group's queries in one 64-row tile): Q read as the
    #: free reshape ``[B, Hq * Sq, D]``, a 64-row box from the group's first row (the
    #: rows past the group are the next group's queries, or TMA's out-of-bounds zeros,
    #: and their results are never stored), instead of a copy padded to 64 rows per
    #: group (an XLA launch per decode step). The box lands in an untiled SMEM slot
    #: (any first row: Mosaic GPU addresses a tiled box in whole 8-row tiles, so one
    #: must start on the 8-row grid) and is stored from registers into the tiled Q
    #: slot, once per tile. Not with a persistent grid (which prefetches each item's Q
    #: from the padded layout). A launch choice.
    flat_q: bool = True
    #: The split decode's fold kernel stores the group's rows of the output, cast to
    #: the input dtype, and of the lse straight into ``[B, Hq, Sq, ...]`` (a box of the
    #: group's rows from an untiled SMEM tile), instead of 64-row fp32 tiles that XLA
    #: slices and casts (an XLA launch per decode step). Where the group's rows are a
    #: multiple of 4 (a 16-byte lse copy), not with ``[B, S, H, D]`` and Sq > 1. Without
    #: splits (with ``flat_q``) the decode kernel stores the group's rows itself, through
    #: its untiled Q slot, instead of the 64-row tile XLA slices. A launch choice.
    flat_out: bool = True
    #: Programmatic dependent launch (:func:`launch`), the kernels' part in it: "both"
    #: (each CTA first waits for the grids before it in the stream, before any global
    #: memory access, then lets the next kernel's launch begin: a kernel's launch and
    #: prologue overlap the tail of the one before it), "wait" (only the wait: the next
    #: kernel starts when this one ends), "trigger" (only the early start of the next
    #: one; this kernel is launched plainly, after the one before it) or "off". JAX
    #: 0.11's Pallas launches a kernel that waits with the PDL attribute; on JAX 0.10
    #: the instructions are no-ops. Not in interpret mode. A launch choice.
    pdl: str = "both"
    #: The fold kernel's part (split decode, CP), as ``pdl``; None: ``pdl``'s.
    fold_pdl: str | None = None
    #: The part of a kernel that writes split states (``split_out``: the split decode's
    #: split kernel, CP's), which the fold kernel reads next; None: ``pdl``'s without
    #: its early trigger ("both" -> "wait", "trigger" -> "off"). On the H200 (JAX
    #: 0.11.2, 2026-12-04, notes "2026-12-04 (seventh)") the fold's CTAs started early
    #: beside the split kernel's last wave cost the step 4 to 9% (B=8 32768 keys 286.5
    #: against 275.4 us, B=1 131072 169.2 against 155.7), while the next step's split
    #: kernel started during the fold gained 0 to 2%.
    split_pdl: str | None = None
    #: How a CTA awaits its epilogue's TMA stores (:func:`wait_stores`): "read" until
    #: their SMEM has been read (CUTLASS's wait: enough to reuse the SMEM or exit),
    #: "write" until written to GMEM. The same stores: a launch choice. On the H100
    #: (2026-12-07, notes "twenty-second stop") "read" ran the forward within its
    #: spread (0.99 to 1.04x) and the backward 1.01 to 1.02x at B=2 S=16384, level at
    #: B=8 S=4096, bits equal at every point; the invariance matrix's decode, paged,
    #: CP and packed rows passed with it ("twenty-third stop"): the default since.
    store_wait: str = "read"

    def __post_init__(self):
        check_store_wait(self.store_wait)
        if self.block_m not in (64, 128):
            raise ValueError(f"block_m must be 64 or 128, got {self.block_m}")
        if self.compute_wgs not in (None, 1, 2, 3):
            raise ValueError(f"compute_wgs must be None, 1, 2 or 3, got "
                             f"{self.compute_wgs}")
        for name, n in (("registers", 2), ("registers3", 3)):
            regs = getattr(self, name)
            if regs is not None and (
                    len(regs) != 2 or any(r % 8 or not 24 <= r <= 256 for r in regs)
                    or 128 * (n * regs[0] + regs[1]) > 65536):
                raise ValueError(
                    f"{name} must be None or (compute, producer) registers, multiples of "
                    f"8 in [24, 256], {n} x 128 x compute + 128 x producer <= 65536, "
                    f"got {regs!r}")
        if self.stages < 1:
            raise ValueError(f"stages must be >= 1, got {self.stages}")
        if self.semantics not in ("lane", "warpgroup"):
            raise ValueError(f"semantics must be 'lane' or 'warpgroup', got {self.semantics!r}")
        if self.accumulate not in (None, "fresh", "inplace"):
            raise ValueError(f"accumulate must be 'fresh' or 'inplace', got "
                             f"{self.accumulate!r}")
        if self.rowsum not in ("mma", "reduce32"):
            raise ValueError(f"rowsum must be 'mma' or 'reduce32', got {self.rowsum!r}")
        if self.late_rowsum and self.rowsum != "reduce32":
            raise ValueError(f"late_rowsum needs rowsum='reduce32', got {self.rowsum!r}")
        if self.persistent is not None and self.persistent < 0:
            raise ValueError(f"persistent must be >= 0 (a CTA count), got {self.persistent}")
        if self.prefetch_q and not self.persistent:
            raise ValueError("prefetch_q needs a persistent grid (persistent > 0)")
        if self.normalize not in ("divide", "reciprocal"):
            raise ValueError(f"normalize must be 'divide' or 'reciprocal', got "
                             f"{self.normalize!r}")
        if self.ctas_per_sm not in (1, 2):
            raise ValueError(f"ctas_per_sm must be 1 or 2, got {self.ctas_per_sm!r}")
        if self.splits_per_cta is not None and (
                not isinstance(self.splits_per_cta, int) or self.splits_per_cta < 1):
            raise ValueError(f"splits_per_cta must be an int >= 1 or None, got "
                             f"{self.splits_per_cta!r}")
        if self.split_decode_stages is not None and self.split_decode_stages < 1:
            raise ValueError(f"split_decode_stages must be >= 1, got "
                             f"{self.split_decode_stages}")
        if self.fold_slots is not None and (self.fold_slots < 2 or self.fold_slots % 2):
            raise ValueError(f"fold_slots must be an even number >= 2 or None, got "
                             f"{self.fold_slots}")
        if self.fold_cols is not None and (self.fold_cols < 16
                                           or self.fold_cols & (self.fold_cols - 1)):
            raise ValueError(f"fold_cols must be a power of two >= 16 or None, got "
                             f"{self.fold_cols}")
        for name in ("pdl", "fold_pdl", "split_pdl"):
            check_pdl(name, getattr(self, name), optional=name != "pdl")
        for name in ("smem_state", "pv_split", "gmem_state", "merge_arrive",
                     "last_merge_arrive", "kv_multicast", "static_slots",
                     "skip_padding_rows", "opaque_bounds"):  # None: by shape
            value = getattr(self, name)
            if not (value is None or isinstance(value, bool)):
                raise ValueError(f"{name} must be None, True or False, got {value!r}")
        for name in ("kv_boxes", "q_boxes", "defer_store_wait"):
            if getattr(self, name) not in (True, False):
                raise ValueError(f"{name} must be True or False, got "
                                 f"{getattr(self, name)!r}")
        if self.q_order not in ("ascending", "descending"):
            raise ValueError(f"q_order must be 'ascending' or 'descending', got "
                             f"{self.q_order!r}")

    @property
    def rows(self) -> int:
        """Query rows per CTA (``compute_wgs=None``: two warpgroups' where the call has
        not resolved it: every path but a plain prefill's, :func:`auto_compute_wgs`)."""
        return self.block_m * (self.compute_wgs or 2)

    @property
    def fold_launch_pdl(self) -> str:
        """The fold kernel's ``pdl`` mode (``fold_pdl``, else ``pdl``)."""
        return self.fold_pdl or self.pdl

    @property
    def split_launch_pdl(self) -> str:
        """A ``split_out`` kernel's ``pdl`` mode (``split_pdl``, else ``pdl`` without
        its early trigger)."""
        return self.split_pdl or {"both": "wait", "trigger": "off"}.get(self.pdl, self.pdl)


#: Mosaic GPU's on-device profiler for the prefill kernel (:func:`profiling`): the
#: ``CompilerParams`` fields it sets, empty when off.
_PROFILE: dict = {}
#: :func:`profiling`'s ``blocks``: a key block's ranges recorded too.
_PROFILE_BLOCKS = False


@contextlib.contextmanager
def profiling(space: int, out_dir: str, *, blocks: bool = False):
    """Within: every prefill kernel traced here records Mosaic GPU's on-device profile,
    ``space`` ranges a warpgroup (each range four 32-bit SMEM entries, added to the
    kernel's SMEM), JAX writing a Perfetto trace per call into ``out_dir``. The ranges
    are the kernel's named scopes: a compute warpgroup's ``item`` (one (tile, head,
    batch) item) and in it ``wait_q``, ``wait_k``, ``fold``, ``skip`` and
    ``epilogue``; the producer's ``produce`` (an item's loads). With ``blocks``, each
    key block's too (:data:`BLOCK_SCOPES`; four more ranges a block, and their clock
    reads sit between the block's instructions: the timeline of a perturbed kernel).
    A diagnostic (benchmarks/mosaic_profile.py). JAX's caches are cleared on entry
    and on exit (:func:`jax.clear_caches`): :func:`forward` is jitted, and a kernel
    traced before the context would otherwise run inside it unprofiled, and a profiled
    one outside it. The named scopes record nothing outside."""
    if not space or not out_dir:
        raise ValueError(f"profiling needs space > 0 and out_dir, got {space!r}, {out_dir!r}")
    global _PROFILE, _PROFILE_BLOCKS
    old = _PROFILE, _PROFILE_BLOCKS
    _PROFILE = {"profile_space": int(space), "profile_dir": out_dir}
    _PROFILE_BLOCKS = bool(blocks)
    jax.clear_caches()
    try:
        yield
    finally:
        _PROFILE, _PROFILE_BLOCKS = old
        jax.clear_caches()


#: A key block's ranges under ``profiling(blocks=True)`` (:meth:`_Forward.block_step`):
#: S = Q K^T issued and awaited (``s``), the online softmax (``softmax``), V's load and
#: the warpgroup's turn awaited (``wait_pv``), P V issued with the next K awaited
#: (``pv``).
BLOCK_SCOPES = ("s", "softmax", "wait_pv", "pv")


def block_scope(name: str):
    """``jax.named_scope(name)`` under ``profiling(blocks=True)``, else no scope."""
    return jax.named_scope(name) if _PROFILE_BLOCKS else contextlib.nullcontext()


def launch(body, *, pdl: str, interpret, **kwargs):
    """``plgpu.kernel(body, interpret=interpret, **kwargs)`` in programmatic dependent
    launch (not when interpreting): with ``pdl`` "both" or "wait", every thread of a CTA
    first runs ``griddepcontrol.wait`` (the grids before this one in the stream have
    completed and their writes are visible: the kernel touches global memory only
    after it); with "both" or "trigger" it then runs
    ``griddepcontrol.launch_dependents`` (the next kernel, if launched with the PDL
    attribute, may start its CTAs once every CTA here has passed this point). JAX 0.11
    launches a kernel that waits with that attribute; JAX 0.10 launches it plainly,
    where both instructions do nothing."""
    check_pdl("pdl", pdl)
    if pdl != "off" and interpret is None:
        inner = body

        def body(*refs):
            if pdl in ("both", "wait"):
                plgpu.griddepcontrol_wait()
            if pdl in ("both", "trigger"):
                plgpu.griddepcontrol_launch_dependents()
            inner(*refs)

    return plgpu.kernel(body, interpret=interpret, **kwargs)


def interpret_params():
    """``InterpretGPUParams()`` of the installed JAX, or None if it has none."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError:  # pragma: no cover - depends on the JAX version
        return None
    return InterpretGPUParams()


def resolve_interpret(interpret):
    """``interpret`` argument -> the kernels' ``interpret``: False or None -> None
    (compile for the GPU); True -> default ``InterpretGPUParams``; an
    ``InterpretGPUParams`` as it is."""
    if interpret is True:
        params = interpret_params()
        if params is None:
            raise NotImplementedError("this JAX has no Mosaic GPU interpret mode")
        return params
    if interpret is False or interpret is None:
        return None
    return interpret


def reset_interpret_state() -> None:
    """Reset the Mosaic GPU interpreter after an exception inside a kernel (the
    interpreter requires it before the next interpreted kernel)."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
        reset_gpu_interpret_mode_state,
    )
    reset_gpu_interpret_mode_state()


#: Whether this JAX's ``plgpu.load`` takes the index as a required argument (0.10.x);
#: later ones read the whole ref it is given and warn when an index is passed
#: ("Please index the reference via ref.at[idx]").
_LOAD_IDX = inspect.signature(plgpu.load).parameters.get("idx")
_LOAD_TAKES_INDEX = _LOAD_IDX is not None and _LOAD_IDX.default is inspect.Parameter.empty


def load_ref(ref, *, layout, optimized: bool = True):
    """The whole SMEM ref ``ref`` in registers, in ``layout`` (``plgpu.load`` with or
    without its index argument, as this JAX's signature has it)."""
    if _LOAD_TAKES_INDEX:
        return plgpu.load(ref, (), layout=layout, optimized=optimized)
    return plgpu.load(ref, layout=layout, optimized=optimized)


#: ``MosaicConfig.gmem_state``'s scratch slots on the GPU: one per SM identifier. Every
#: sm90 part is cut from the GH100 die of 144 SMs, and ``%smid`` numbers the SMs of
#: the die (not necessarily contiguously: an H100 SXM's 132 SMs keep their ids), so
#: ``%smid`` < 144 on every Hopper GPU.
GMEM_STATE_SLOTS = 144


def sm_id():
    """The SM running the calling warpgroup (PTX ``%smid``), an int32 scalar: a slot
    of ``gmem_state``'s scratch that no other CTA of the launch can hold at the same
    time (one CTA an SM: :meth:`_Forward.__init__` checks it)."""
    from jax.experimental.mosaic import gpu as mgpu

    splat = plgpu.Layout.WG_SPLAT(shape=())

    @plgpu.inline_mgpu(return_type=plgpu.ShapeDtypeStruct((), jnp.int32, layout=splat))
    def smid(_):
        return mgpu.FragmentedArray.splat(mgpu.utils.smid(), (),
                                          layout=mgpu.WGSplatFragLayout(shape=()),
                                          is_signed=False)

    return smid()


def _smem_transforms(cols: int, itemsize: int):
    """Tiling + swizzle for an SMEM tile whose minor dimension has ``cols`` elements:
    the widest swizzle (<= 128 bytes) that the row width allows."""
    swizzle = min(128, cols * itemsize)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


#: Head dims of the forward and backward kernels. At D=256 the forward holds a 64x256
#: fp32 accumulator per compute warpgroup and 192 KiB of SMEM with two compute
#: warpgroups (not with ``prefetch_q``: SMEM), 224 KiB with one and the SMEM state
#: (``MosaicConfig.smem_state``, the default past one SPLIT); the backward, see
#: ``mosaic_bwd.backward``. Run on the H200 since 2026-12-01.
HEAD_DIMS = (64, 128, 256)


#: ``split_decode=None`` splits a decode call's keys across CTAs when it has fewer
#: (batch, KV head) CTAs than this: the H200's 132 SMs.
SPLIT_DECODE_BELOW_CTAS = 132


def check_inputs(q, k, v):
    """The kernels' shape and dtype limits (ValueError / TypeError naming them). Any
    ``Sq >= 1`` and ``Skv >= 1``: :func:`forward` pads both internally."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be rank 4, got {q.shape}, {k.shape}, {v.shape}")
    b, hq, sq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k and v must be [B={b}, Hkv, Skv, D={d}], got k {k.shape}, "
                         f"v {v.shape}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (jnp.bfloat16, jnp.float16):
        raise TypeError(f"q, k, v must all be bf16 or fp16, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim D must be one of {HEAD_DIMS}, got {d}")
    if k.shape[1] == 0 or hq % k.shape[1]:
        raise ValueError(f"Hq={hq} must be a positive multiple of Hkv={k.shape[1]}")
    if sq == 0 or k.shape[2] == 0 or b == 0:
        raise ValueError(f"B, Sq and Skv must be positive, got q {q.shape}, k {k.shape}")


def padding(sq: int, skv: int, causal: bool, rows: int,
            offset: int | None = None) -> tuple[int, int, int]:
    """``(lead, padded_sq, padded_skv)``: the query rows are placed at ``lead`` in
    ``padded_sq`` rows (a multiple of the CTA's ``rows``) and the keys padded to whole
    blocks. Causal: ``lead = (Skv - Sq) mod BLOCK_N`` puts every warpgroup tile at a
    multiple of ``BLOCK_N`` in absolute query position (``Skv - Sq + i`` for row i), so
    a row takes the same masked or unmasked path for each key block whatever Sq, the
    chunk or the batch it comes in (DESIGN.md 4.6). The padding rows are computed and
    dropped; the padding keys are masked. ``offset``: row i sees key j iff ``j <= i +
    offset`` (default ``Skv - Sq``)."""
    bn = schedule.BLOCK_N
    lead = ((skv - sq) if offset is None else offset) % bn if causal else 0
    return lead, -(-(lead + sq) // rows) * rows, -(-skv // bn) * bn


def tile_of(ref, bi, h, rows, btnh: bool):
    """The ``[rows, D]`` tile of head ``h`` of sequence ``bi``: ``ref.at[bi, h, rows]``
    of ``[B, H, S, D]``, or ``ref.at[bi, rows, h]`` of ``[B, S, H, D]`` (JAX's layout: a
    TMA box whose rows are ``H * D`` elements apart). The forward and backward kernels'
    one place for it."""
    return ref.at[bi, rows, h] if btnh else ref.at[bi, h, rows]


def _along(axis: int, pad: tuple[int, int]):
    """``jnp.pad`` widths of a rank-4 array padded by ``pad`` along ``axis`` only."""
    return tuple(pad if i == axis else (0, 0) for i in range(4))


def zero_dropped_keys(k, v, key_padding_mask, axis: int = 2):
    """K and V with the keys ``key_padding_mask`` drops set to zero (``axis``: the key
    axis, 2 of ``[B, H, S, D]`` or 1 of ``[B, S, H, D]``). Dropped keys may hold
    anything (a paged cache's unused slots, NaN padding): their probabilities are 0,
    but 0 * inf in a product would be NaN."""
    drop = (~key_padding_mask[:, None, :, None] if axis == 2
            else ~key_padding_mask[:, :, None, None])
    return (jnp.where(drop, 0, k).astype(k.dtype), jnp.where(drop, 0, v).astype(v.dtype))


def _row_sum_update(l, alpha, p32):
    """The online softmax's running row sum after a block: ``l`` rescaled by
    ``alpha``, plus the block's fp32 probabilities summed along each row
    (``rowsum="reduce32"``: in the softmax, or with ``late_rowsum`` after P V's issue;
    one expression for both, so that the two orders keep the same operations)."""
    return l * alpha + p32.sum(axis=1)


def _rows(x, shape, layout=None):
    """``x[:, None]`` broadcast to ``shape`` in one step (Mosaic GPU cannot hold the
    ``[M, 1]`` intermediate of ``x[..., None]``: "Tiling ... does not apply to shape
    (M, 1)"), in ``layout`` where given (a register layout Mosaic GPU cannot infer from
    the rows', such as :func:`fold_layout`'s)."""
    out = lax.broadcast_in_dim(x, shape, [0])
    return out if layout is None else plgpu.layout_cast(out, layout)


def finalize_rows(acc, m, l, log=jnp.log, reciprocal=False):
    """:func:`jaxattn.merge.finalize` for ``[M, D]`` tiles, with the same floating-point
    operations; only the row broadcasts are spelled for Mosaic GPU. Equal in bits to
    ``finalize`` under XLA (tests/test_mosaic_probe.py checks it). ``log=jnp.log2``:
    the same in base 2 (``m`` and the lse in log2 units: the kernels' state, see
    :data:`KERNEL_LSE_BASE2`). ``reciprocal``: ``acc * (1 / l)``, one division per row
    instead of one per element (other bits)."""
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    if reciprocal:
        scaled = acc * _rows(1.0 / l_safe, acc.shape)
    else:
        scaled = acc / _rows(l_safe, acc.shape)
    out = jnp.where(_rows(empty, acc.shape), 0.0, scaled)
    lse = jnp.where(empty, NEG_INF, m + log(l_safe))
    return out, lse


def merge_rows(out_left, lse_left, out_right, lse_right, exp=jnp.exp, log=jnp.log,
               layout=None):
    """:func:`jaxattn.merge.merge` for ``[M, D]`` tiles, with the same floating-point
    operations in the same order (see :func:`finalize_rows`); ``exp=jnp.exp2,
    log=jnp.log2``: the same in base 2. ``layout``: the tiles' register layout, where
    Mosaic GPU cannot infer it from the rows' (:func:`_rows`)."""
    weights = merge_weights(lse_left, lse_right, out_left.shape, exp=exp, log=log,
                            layout=layout)
    return merge_apply(out_left, lse_left, out_right, lse_right, weights, layout=layout)


def merge_weights(lse_left, lse_right, shape, exp=jnp.exp, log=jnp.log, layout=None):
    """:func:`merge_rows`' first half: the merged rows' lse (before the empty rows'
    choice) and the two states' row weights broadcast to ``shape`` (a whole tile, or
    the column chunk that :func:`merge_apply` then takes at a time)."""
    rows = functools.partial(_rows, layout=layout)
    m = jnp.maximum(lse_left, lse_right)
    m_safe = jnp.where(m == NEG_INF, 0.0, m)
    w_left = exp(lse_left - m_safe)
    w_right = exp(lse_right - m_safe)
    total = w_left + w_right
    total_safe = jnp.where(total == 0.0, 1.0, total)
    lse = m_safe + log(total_safe)
    a_left = rows(w_left / total_safe, shape)
    a_right = rows(w_right / total_safe, shape)
    return lse, a_left, a_right


def merge_apply(out_left, lse_left, out_right, lse_right, weights, layout=None,
                pin_fma=False):
    """:func:`merge_rows`' second half on ``[M, C]`` tiles of the two states' outputs
    (``C`` the columns :func:`merge_weights` broadcast to): the merged output and lse.
    Each element's operations do not depend on the columns taken, so a merge by
    column chunks gives the whole tile's bits.

    ``out_left * a_left + out_right * a_right`` is one FMA on the GPU, and which
    product it fuses is LLVM's choice: with both states in registers it fuses the
    left (``fma(out_left, a_left, out_right * a_right)``; every kernel's merge, in
    the PTX of ``benchmarks.mosaic_sass``), but with the left read from SMEM
    (``MosaicConfig.smem_state``) it fused the right, and the output differed in the
    last bit (H100, 2026-12-05). ``pin_fma``: the right product passes through an
    optimization barrier, so the left's is the only one LLVM can fuse: the registers'
    instruction, whatever the operands' origin."""
    shape = out_left.shape
    rows = functools.partial(_rows, layout=layout)
    lse, a_left, a_right = weights
    left, right = out_left * a_left, out_right * a_right
    if pin_fma:
        right = lax.optimization_barrier(right)
    out = left + right
    left_empty = lse_left == NEG_INF
    right_empty = lse_right == NEG_INF
    out = jnp.where(rows(right_empty, shape), out_left,
                    jnp.where(rows(left_empty, shape), out_right, out))
    lse = jnp.where(right_empty, lse_left, jnp.where(left_empty, lse_right, lse))
    return out, lse


#: The kernels' partial states (in-kernel fold, ``split_partials(kernel_lse=True)``,
#: :func:`fold_partials`) keep the lse in the softmax's base: with
#: ``SOFTMAX_EXP_BASE == "2"``, ``lse2 = m2 + log2(l)`` and base-2 merges, converted to
#: the natural log (``* ln 2``, a product whose only use is the store) once, at the
#: end. In natural units the finalize is ``m * ln 2 + log(l)``, a product feeding an
#: add, which the compiler fused into one FMA in some kernels and not in others: on
#: the H200 a non-causal call padded into a second (empty) SPLIT gave lses 1 ulp off
#: on a quarter of the rows with ping-pong, and no output bit changed (run of 2026-11-30, 240f678,
#: ``mosaic_gpu_check --tail_probe``). The base-2 state has no product feeding an add
#: or a subtraction.
KERNEL_LSE_BASE2 = schedule.SOFTMAX_EXP_BASE == "2"


def kernel_finalize(acc, m, l, normalize="divide"):
    """:func:`finalize_rows` in the kernels' base (:data:`KERNEL_LSE_BASE2`), the
    output normalised as ``normalize`` says (:class:`MosaicConfig`)."""
    return finalize_rows(acc, m, l, log=jnp.log2 if KERNEL_LSE_BASE2 else jnp.log,
                         reciprocal=normalize == "reciprocal")


#: The ``exp`` and ``log`` of :func:`merge_rows` and :func:`merge_weights` in the
#: kernels' base (:data:`KERNEL_LSE_BASE2`); empty: the natural base, their defaults.
_KERNEL_BASE = {"exp": jnp.exp2, "log": jnp.log2} if KERNEL_LSE_BASE2 else {}


def kernel_merge(*states, layout=None):
    """:func:`merge_rows` in the kernels' base (:data:`KERNEL_LSE_BASE2`)."""
    return merge_rows(*states, layout=layout, **_KERNEL_BASE)


def kernel_merge_weights(lse_left, lse_right, shape):
    """:func:`merge_weights` in the kernels' base (:data:`KERNEL_LSE_BASE2`)."""
    return merge_weights(lse_left, lse_right, shape, **_KERNEL_BASE)


#: ``MosaicConfig.smem_state``: the columns of the SMEM state merged at a time.
SMEM_STATE_COLS = 64


def natural_lse(lse):
    """A kernel-base lse in natural-log units (the one product, at the end)."""
    return lse * LN2 if KERNEL_LSE_BASE2 else lse


def _visited_blocks(q0, *, block_m: int, offset: int, total: int, causal: bool):
    """Key blocks [0, hi) that any row of the tile starting at query ``q0`` sees; query
    row i sees key j iff ``j <= i + offset`` (causal), of ``total`` blocks."""
    bn = schedule.BLOCK_N
    if not causal:
        return jnp.int32(total)
    last = q0 + (block_m - 1) + offset
    # last // bn + 1 for last >= -bn, 0 below; divide non-negative values only.
    return lax.min(lax.div(lax.max(last + bn, 0), bn), jnp.int32(total))


def _full_blocks(q0, hi, *, offset: int, whole: int, causal: bool):
    """Leading key blocks of [0, hi) that every row from query ``q0`` on sees entirely
    (no mask needed): of the ``whole`` blocks with no key beyond Skv, those whose last
    key ``(j + 1) * BLOCK_N - 1 <= q0 + offset`` when causal."""
    if not causal:
        return lax.min(jnp.int32(whole), hi)
    first = q0 + offset + 1
    return lax.min(lax.min(lax.div(lax.max(first, 0), schedule.BLOCK_N), hi),
                   jnp.int32(whole))


def _build(*, b, hq, hkv, sq, skv, offset, d, dtype, causal, scale, cfg: MosaicConfig,
           gpu_operands: bool, interpret, position: int | None = None,
           key_mask: bool = False, dyn_offsets: bool = False, split_out: bool = False,
           q_btnh: bool = False, kv_btnh: bool = False, carry_in: bool = False,
           raw_out: bool = False, state_rows: int | None = None,
           page_size: int | None = None, state_in: bool = False,
           state_out: bool = False, stack_sq: int = 1, q_row0: int = 0, k_row0: int = 0,
           finish_rows: int = 0,
           q_rows: int | None = None, rows_out: bool = False, kv_boxes: bool = False,
           per_cta: int = 1, sq_rows: int | None = None,
           live_rows: int | None = None):
    """The kernel for ``sq`` query rows (a multiple of the CTA's rows) against ``skv``
    keys (padded to whole blocks by the caller), query row i seeing key j iff ``j <= i +
    offset`` when causal. ``position``: every row is the query at that absolute position
    instead (stacked decode rows, see :func:`forward`); its blocks and their
    masked/unmasked paths are then those of a prefill row at that position.
    ``stack_sq`` (with ``position``): row r is query ``r % stack_sq`` of a head, at
    ``position + r % stack_sq`` (a GQA group's heads' ``stack_sq`` queries stacked:
    speculative verification and short chunks); the tile visits the blocks its last
    query sees and takes the unmasked path only where its first query sees every key,
    so a row may visit one more block than its prefill row, entirely masked for it (an
    exact no-op, as a dropped key's block: ``m`` and ``l`` unchanged, ``alpha = 1``,
    ``p = 0``).
    ``key_mask``: the kernel also takes ``keep`` (fp32 ``[B, skv]``, 1 = keep) and
    ``flags`` (int32 ``[B, blocks]``, 1 where a block drops a key); a block with a
    dropped key takes the masked path with the keys dropped, in place of the unmasked
    one (so a sequence padded with dropped keys gives the rows of the unpadded one,
    whose last block is masked by its length). ``dyn_offsets``: the kernel also takes
    ``offs`` (int32 ``[B]``), sequence b's ``offset`` (a multiple of ``BLOCK_N``) or,
    with ``position``, its ``position``, in place of the static one. ``split_out``: one
    CTA per (tile, head, batch, SPLIT) writes that split's partial state, ``out [B, Hq,
    n_splits, sq, D]`` and ``lse [B, Hq, n_splits, sq]`` fp32 (``(0, -inf)`` where the
    split has nothing visible), for :func:`jaxattn.merge.fold` to fold: split-parallel
    decode. One compute warpgroup, no persistent grid. ``q_btnh`` / ``kv_btnh``: Q and
    O / K and V are ``[B, S, H, D]`` (JAX's layout; each tile a strided TMA box) instead
    of ``[B, H, S, D]``; the lse stays ``[B, Hq, Sq]``. With ``split_out`` only:
    ``carry_in``: the kernel also takes the running state ``(acc [B, Hq, n_splits, sq,
    D], m, l [B, Hq, n_splits, sq])`` fp32 of the split's keys before these (another
    piece of the split, context parallelism) and folds on from it instead of from the
    empty state; ``raw_out``: it writes the running state ``(acc, m, l)`` in that form
    instead of the finalised ``(out, lse)``; ``state_rows`` (one tile of rows, ``sq ==
    64``): only the tile's first ``state_rows`` rows (a multiple of 8) of ``out`` are
    written, ``out [B, Hq, n_splits, state_rows, D]`` (the split decode's stacked rows: a
    GQA group of 4 writes 8 rows of fp32 output state per split, not 64; the lse stays
    whole: a TMA copy moves a multiple of 128 bytes).
    ``page_size``: K and V are a paged cache's pages, ``[num_pages, Hkv, page_size, D]``
    (``[num_pages, page_size, Hkv, D]`` with ``kv_btnh``), read in place: the kernel also
    takes ``table`` (int32 ``[B, pages]``, sequence b's logical page p at physical page
    ``table[b, p]``, whole ``BLOCK_N`` blocks' worth) and ``lens`` (int32 ``[B]``). Key
    block t of sequence b is one TMA box of one page (``page_size`` a multiple of
    ``BLOCK_N``) or ``BLOCK_N // page_size`` boxes of as many pages (``page_size`` a
    multiple of 8 dividing ``BLOCK_N``), the same keys in the same SMEM rows as a
    contiguous block; V's rows at or past ``lens[b]`` are zeroed in SMEM before P V
    (unused slots may hold anything, NaN included). Causal, with ``dyn_offsets``.
    ``state_in`` (not with ``split_out`` or ``position``): the kernel also takes a folded
    state ``(out [B, Hq, sq, D], lse [B, Hq, sq])`` fp32 (the lse in the kernels' base,
    ``(0, -inf)``: empty) and folds its splits on from it instead of from the empty
    state; ``state_out``: it writes the folded state in that form instead of the output
    and the natural-log lse (context parallelism: the key ranges of one call folded one
    launch after another, as the one call's kernel folds them). ``finish_rows`` (with
    ``state_out``, a multiple of the CTA's rows): rows ``[0, finish_rows)`` are stored
    as the output and the natural-log lse (``out [B, Hq, finish_rows, D]``, ``lse``),
    the others as the folded state (``[B, Hq, sq - finish_rows, ...]``, two more
    outputs): the rows whose last keys these are finish, the others go on.
    ``q_row0`` / ``k_row0``: the call's rows are rows ``[q_row0, q_row0 + sq)`` of Q
    and its keys keys ``[k_row0, k_row0 + skv)`` of K and V, read in place (a window
    of larger arrays: context parallelism's shards and ranges without slices); not
    with a key mask, pages or ``[B, S, H, D]``.

    ``q_rows`` (stacked
    decode rows): Q is ``[B, Hkv * q_rows, D]``, KV head h's tile the 64 rows from row
    ``h * q_rows`` (:attr:`MosaicConfig.flat_q`); ``rows_out`` (with ``q_rows``, unsplit):
    ``out [B, Hkv * q_rows, D]`` and ``lse [B, Hkv * q_rows]``, the tiles' first
    ``q_rows`` rows stored in place (:attr:`MosaicConfig.flat_out`). ``kv_boxes``: K
    and V are read as one 64-row box per column tile into swizzled slots without
    tiling, each column tile viewed tiled (:attr:`MosaicConfig.kv_boxes`: ``skv`` need
    not be a multiple of 8; past it, TMA's zeros); the GPU operand path, not with
    pages. ``per_cta`` (``split_out`` without ``carry_in`` or ``raw_out``): each
    CTA takes that many consecutive SPLITs (the last CTA of a row the rest), storing
    each split's state (:attr:`MosaicConfig.splits_per_cta`). ``sq_rows`` (a plain
    prefill on the GPU, :attr:`MosaicConfig.q_boxes`): Q and O hold that many rows
    (the call's Sq, fewer than the tiles' ``sq``), read and written in place by TMA
    (zeros past them on the load, the store clipped), the lse the tiles' ``sq``;
    None: ``sq``. ``live_rows`` (a plain prefill, with ``cfg.skip_padding_rows``):
    the tiles' rows at or past it are padding, and a compute warpgroup whose rows
    all are visits no key block.

    Returns ``call(q, k, v, *extra)``; the stages are the methods of :class:`_Forward`
    (of :class:`_PvSplitForward` with ``cfg.pv_split``)."""
    kind = _PvSplitForward if cfg.pv_split else _Forward
    return kind(b=b, hq=hq, hkv=hkv, sq=sq, skv=skv, offset=offset, d=d, dtype=dtype,
                causal=causal, scale=scale, cfg=cfg, gpu_operands=gpu_operands,
                interpret=interpret, position=position, key_mask=key_mask, dyn_offsets=dyn_offsets,
                split_out=split_out, q_btnh=q_btnh, kv_btnh=kv_btnh, carry_in=carry_in,
                raw_out=raw_out, state_rows=state_rows, page_size=page_size, state_in=state_in,
                state_out=state_out, stack_sq=stack_sq, q_row0=q_row0, k_row0=k_row0,
                finish_rows=finish_rows, q_rows=q_rows, rows_out=rows_out,
                kv_boxes=kv_boxes, per_cta=per_cta, sq_rows=sq_rows,
                live_rows=live_rows).call()


@dataclasses.dataclass
class _Item:
    """One compute warpgroup's view of one (tile, head, batch) item: its SMEM and
    barriers, its rows and the key blocks it visits."""
    w: object  #: the compute warpgroup
    q_s: object  #: its Q tile (then its O tile)
    q_b: object  #: the Q tile's barrier
    lse_s: object
    p_s: object  #: P staged in SMEM (SMEM operand path), else None
    smem: tuple
    bars: tuple
    q0: object  #: the first query row of the warpgroup's tile
    h: object
    bi: object
    base: object  #: the ring position of the item's first step
    flags_ref: object
    kvh: object = None  #: the KV head
    offset: object = None
    position: object = None
    hi: object = None  #: key blocks [0, hi) visited
    full: object = None  #: blocks [0, full) unmasked for every row
    tile_indices: object = None
    #: ``merge_arrive``, while a SPLIT's blocks run: its first block (``lo``) and
    #: whether its first S makes no ping-pong arrival (``arrived``: the previous
    #: SPLIT made it before its merge); None elsewhere
    lo: object = None
    arrived: object = None


class _Forward:
    """The Mosaic GPU forward kernel, built in the stages of the canonical schedule
    (FlashAttention-3's split, on jaxattn's fold order):

    * :meth:`items_of_cta` - the **tile schedule**: which (query tile, head, batch)
      items a CTA runs, heaviest causal tiles first, or a persistent grid's greedy table;
    * :meth:`producer` / :meth:`drain` - the **K/V producer ring**: the producer
      warpgroup TMA-loads key block after key block into ``stages`` SMEM slots;
    * :meth:`softmax` / :meth:`block_step` - the **softmax consumer**: per key block,
      S = Q K^T, the online-softmax step and P V;
    * :meth:`split` / :meth:`splits` - the **SPLIT fold**: each SPLIT's state finalised
      and merged into the running state (``kernel_finalize`` / ``kernel_merge``);
    * :meth:`epilogue` - the **epilogue and lse**: O and the natural-log lse stored by
      TMA (or, ``split_out``, the split's partial state);
    * :meth:`kernel` / :meth:`call` - warp specialisation and the launch.

    The constructor is the static plan: shapes, the resolved launch choices (persistent
    grid, Q prefetch, accumulation) and the SMEM plan (:meth:`scratch`).
    """

    def __init__(self, *, b, hq, hkv, sq, skv, offset, d, dtype, causal, scale,
                 cfg: MosaicConfig, gpu_operands: bool, interpret, position, key_mask,
                 dyn_offsets, split_out, q_btnh=False, kv_btnh=False, carry_in=False,
                 raw_out=False, state_rows=None, page_size=None, state_in=False,
                 state_out=False, stack_sq=1, q_row0=0, k_row0=0, finish_rows=0,
                 q_rows=None, rows_out=False, kv_boxes=False, per_cta=1, sq_rows=None,
                 live_rows=None):
        bn = self.bn = schedule.BLOCK_N
        #: the rows of Q and O (``sq_rows``: fewer than the tiles' ``sq``)
        self.sq_rows = sq if sq_rows is None else sq_rows
        if per_cta != 1 and (not split_out or carry_in or raw_out or per_cta < 1):
            raise ValueError(f"per_cta (SPLITs a CTA) > 1 is for split_out states without "
                             f"carry_in or raw_out, got {per_cta}")
        #: SPLITs a CTA of split_out takes, one after another (MosaicConfig.splits_per_cta).
        self.per_cta = per_cta
        #: The columns of the split's fp32 state staged at a time for its store (d, or
        #: d // 2 where the whole tile beside the ring would cost the ring slots).
        self.state_cols = d
        if q_rows is not None and (position is None or q_btnh or q_row0 or sq != bn
                                   or cfg.prefetch_q or cfg.persistent):
            raise ValueError("q_rows (Q as [B, Hq * Sq, D]) is for stacked decode rows "
                             "without a persistent grid")
        self.q_rows = q_rows
        if rows_out and (q_rows is None or split_out or state_out or (q_rows * 4) % 16):
            raise ValueError(f"rows_out stores q_rows (a multiple of 4: a 16-byte lse "
                             f"copy) rows of an unsplit call, got q_rows={q_rows}")
        self.rows_out = rows_out
        if kv_boxes and (not gpu_operands or page_size is not None or TransformedRef is None):
            raise ValueError("kv_boxes (K and V as boxes of column tiles) is for the GPU operand "
                             "path without pages, on a JAX with UntilingTransform")
        #: kv_boxes: a slot's boxes of BLOCK_N rows by ``box_cols`` columns (128 bytes).
        self.box_cols = 128 // jnp.dtype(dtype).itemsize if kv_boxes else None
        if kv_boxes and d % self.box_cols:
            raise ValueError(f"kv_boxes needs D a multiple of {self.box_cols}, got {d}")
        if stack_sq < 1 or (stack_sq > 1 and position is None):
            raise ValueError(f"stack_sq (>= 1) stacks queries of stacked decode rows "
                             f"(position), got {stack_sq} with position={position}")
        self.stack_sq = stack_sq
        if page_size is not None:
            if not reads_pages_in_place(page_size):
                raise ValueError(f"page_size must be a multiple of {bn} or a multiple of 8 "
                                 f"dividing {bn}, got {page_size}")
            if not (causal and dyn_offsets) or key_mask:
                raise ValueError("paged K/V is served causal, with per-sequence offsets and "
                                 "no key mask")
        self.page_size = page_size
        #: A paged stacked decode's offsets (query 0's position) are computed from the
        #: lengths in the kernel, not passed.
        self.offs_from_lens = (page_size is not None and position is not None
                               and dyn_offsets)
        #: TMA copies per key block (K and V each): a paged block of small pages is
        #: assembled from several.
        self.copies = (d // self.box_cols if kv_boxes else
                       1 if page_size is None or page_size >= bn else bn // page_size)
        if state_rows is not None and (not split_out or carry_in or raw_out or sq != bn
                                       or state_rows % 8 or not 8 <= state_rows <= bn):
            raise ValueError(f"state_rows (a multiple of 8 up to {bn}) is for split_out "
                             f"states of one tile of {bn} rows, got {state_rows} at sq={sq}")
        self.state_rows = state_rows
        if (carry_in or raw_out) and not split_out:
            raise ValueError("carry_in and raw_out are split_out's")
        self.carry_in, self.raw_out = carry_in, raw_out
        if (state_in or state_out) and (split_out or position is not None or q_btnh):
            raise ValueError("state_in / state_out fold a [B, Hq, Sq, D] call's splits in "
                             "the kernel: not with split_out, stacked decode rows or q_btnh")
        self.state_in, self.state_out = state_in, state_out
        if finish_rows and (not state_out or finish_rows % cfg.rows
                            or not 0 < finish_rows < sq):
            raise ValueError(f"finish_rows (with state_out: a multiple of the CTA's "
                             f"{cfg.rows} rows in (0, sq={sq})) got {finish_rows}")
        self.finish_rows = finish_rows
        if (q_row0 or k_row0) and (key_mask or page_size is not None or q_btnh
                                   or kv_btnh or position is not None or split_out):
            raise ValueError("q_row0 / k_row0 window [B, H, S, D] Q and K/V of a "
                             "prefill-shaped call without a key mask, pages or partials")
        if q_row0 < 0 or k_row0 < 0:
            raise ValueError(f"q_row0 and k_row0 must be >= 0, got {q_row0}, {k_row0}")
        self.q_row0, self.k_row0 = q_row0, k_row0
        if q_btnh and split_out:
            raise ValueError("split_out writes [B, Hq, n_splits, Sq, D] partial states: "
                             "q_btnh is not served there")
        self.q_btnh, self.kv_btnh = q_btnh, kv_btnh
        self.b, self.hq, self.sq, self.skv, self.d, self.dtype = b, hq, sq, skv, d, dtype
        self.causal, self.offset, self.position = causal, offset, position
        self.key_mask, self.dyn_offsets, self.split_out = key_mask, dyn_offsets, split_out
        self.gpu_operands, self.interpret = gpu_operands, interpret
        self.bm, self.stages, self.nwg = cfg.block_m, cfg.stages, cfg.compute_wgs or 2
        if split_out and d > 128:
            # The split's fp32 output tile (64 KiB at D=256) beside a ring of two K/V
            # slots exceeds the SMEM: one slot (a launch parameter: the same operations).
            self.stages = 1
        self.rows_cta = cfg.rows
        self.n_tiles = sq // self.rows_cta
        self.total, self.whole = -(-skv // bn), skv // bn
        # Each tile's key blocks in launch order (``hi_cta``: :func:`_visited_blocks` on
        # the host, which the kernel computes with lax ops; every tile's count where the
        # offsets are only known at run time): the persistent grid's choice and its
        # greedy table.
        self.tile_blocks = prefill_tile_blocks(
            self.n_tiles, self.rows_cta, offset, self.total,
            causal=causal and position is None and not dyn_offsets, q_order=cfg.q_order)
        self.group = hq // hkv
        self.itemsize = jnp.dtype(dtype).itemsize
        base2 = KERNEL_LSE_BASE2  # the softmax's base is the kernel state's
        self.exp = jnp.exp2 if base2 else jnp.exp
        self.s_scale = scale * LOG2E if base2 else scale
        # All-ones B operand of the row-sum wgmma. With P in registers its width only
        # has to be a valid wgmma N (16, as the Triton kernels' ROWSUM_COLS); with P in
        # SMEM its swizzle must match P's (lowering: "WGMMA rhs swizzle must match lhs
        # swizzle").
        self.ones_cols = 16 if gpu_operands else bn
        self.use_mma_rowsum = cfg.rowsum == "mma"
        #: The split's fp32 state and its lse rows staged in the K/V ring's SMEM (a
        #: ``RefUnion``): a CTA of ``split_out`` without ``carry_in`` (which loads its
        #: carry there before the loop) runs one item, so the ring is idle once its
        #: last block is consumed; the SMEM of the staging tiles holds more ring slots
        #: (a launch choice). On the GPU only (the interpreter ignores the SMEM plan).
        self.smem_state = self.rows_in_ring = False  # (resolved with the grid below)
        self.ring_union = (split_out and not carry_in and not cfg.persistent
                           and interpret is None and per_cta == 1)
        # A split's CTA: as many of the ring's slots as its SMEM holds (a launch choice:
        # the same blocks in the same order), at most the configured count.
        #: MosaicConfig.ctas_per_sm == 2, for one compute warpgroup without a
        #: persistent grid (split_out, or stacked decode rows), where one slot and the
        #: rest fit half an SM (not at D=256): no producer warpgroup; the compute
        #: warpgroup issues its ring's loads (:meth:`load_k`, :meth:`load_v`) into the
        #: slots that fit.
        #: With ``q_rows`` the last slot's first V load waits until Q has left its
        #: untiled landing slot, which then shares the SMEM of that V slot
        #: (``q_alias``, in the ring's union: a third slot at D=128; the unsplit
        #: decode's epilogue stores its rows through the landing slot once the ring
        #: is idle).
        self.defer_v = self.q_alias = False
        stages, self.stages = self.stages, 1
        self.inline_loads = ((split_out or position is not None) and self.nwg == 1
                             and not cfg.persistent and cfg.ctas_per_sm == 2
                             and smem_bytes(self.scratch(())) <= SMEM_LIMIT_TWO_CTAS)
        self.stages = stages
        self.defer_v = self.inline_loads and q_rows is not None
        self.q_alias = self.defer_v and interpret is None  # (as ring_union: the GPU's)
        #: A folded state's kernel (state_in / state_out) at D > 128 on the GPU: one
        #: compute warpgroup (:func:`state_plan`), its state beside a ring of as many
        #: slots as fit SMEM_LIMIT_STATE (no reduction scratch, as the SMEM state's).
        self.states_tight = ((state_in or state_out) and d > 128 and interpret is None)
        limit = (SMEM_LIMIT_TWO_CTAS if self.inline_loads else
                 SMEM_LIMIT_STATE if self.states_tight else SMEM_LIMIT)
        if per_cta > 1 and smem_bytes(self.scratch(())) > limit:
            # (several splits a CTA: the state is staged beside the ring, which is busy
            # at a split's end; in column halves, the ring keeps its slots)
            self.state_cols = d // 2
        while ((split_out or self.inline_loads or self.states_tight) and self.stages > 1
               and smem_bytes(self.scratch(())) > limit):
            self.stages -= 1

        persistent = cfg.persistent
        if persistent is None:
            persistent = sm_count() if auto_persistent(
                int(self.tile_blocks.max(initial=0)), d, gpu=interpret is None,
                decode=position is not None, split_out=split_out) else 0
        self.cfg = cfg  # scratch() reads it below
        prefetch_q = cfg.prefetch_q
        if prefetch_q is None:  # with a persistent grid, where the second Q buffer fits
            prefetch_q = (bool(persistent)
                          and smem_bytes(self.scratch((2,))) <= SMEM_LIMIT)
        late_rowsum = cfg.late_rowsum
        if late_rowsum is None:
            late_rowsum = auto_late_rowsum(cfg.rowsum, persistent=bool(persistent),
                                           decode=position is not None,
                                           split_out=split_out)
        cfg = self.cfg = dataclasses.replace(cfg, persistent=persistent,
                                             prefetch_q=prefetch_q and bool(persistent),
                                             late_rowsum=late_rowsum)
        #: MosaicConfig.smem_state where it applies (a prefill, one item a CTA); with
        #: one compute warpgroup on the GPU the lse rows staged for the epilogue's store
        #: share the ring's SMEM (idle once the item's last block is consumed).
        applies = smem_state_applies(
            decode=position is not None, persistent=bool(persistent),
            states=split_out or state_in or state_out or raw_out or carry_in
            or bool(finish_rows))
        #: MosaicConfig.gmem_state where it applies (smem_state's domain; it replaces
        #: the SMEM state): the running state in the kernel's last output.
        self.gmem_state = bool(cfg.gmem_state) and applies
        self.smem_state = self.rows_in_ring = False  # (as scratch() reads them here)
        if (self.gmem_state and interpret is None
                and smem_bytes(self.scratch(())) <= GMEM_STATE_MIN_SMEM):
            self.gmem_state = False  # two CTAs could share an SM, and its scratch slot
        self.smem_state = bool(cfg.smem_state) and applies and not self.gmem_state
        self.rows_in_ring = self.smem_state and self.nwg == 1 and interpret is None
        need = smem_bytes(self.scratch(())) if self.smem_state and interpret is None else 0
        if need > SMEM_LIMIT_STATE:
            raise ValueError(
                f"smem_state: the state's SMEM ({self.nwg} x {self.bm}x{d} fp32) takes "
                f"the kernel to {need} bytes, over SMEM_LIMIT_STATE "
                f"({SMEM_LIMIT_STATE}); with compute_wgs={self.nwg} at D={d} it does not "
                f"fit (D=256 needs compute_wgs=1)")
        #: MosaicConfig.defer_store_wait where it applies: the Q buffers' second
        #: (prefetch_q) holds the next item's Q, and the output path is the plain one
        #: (the Q tile's SMEM and the lse row; not split or CP states, decode's rows)
        self.defer_wait = (cfg.defer_store_wait and cfg.prefetch_q and not (
            split_out or state_out or raw_out or finish_rows or rows_out
            or self.gmem_state or self.smem_state))
        self.inplace = (cfg.accumulate or ("inplace" if gpu_operands and interpret is None
                                           else "fresh")) == "inplace"
        self.pingpong = cfg.pingpong and self.nwg > 1
        #: three compute warpgroups' ping-pong: a ring of turns (MosaicConfig.pingpong)
        self.ring = self.pingpong and self.nwg == 3
        #: MosaicConfig.merge_arrive where the two-warpgroup ping-pong runs (None: with
        #: gmem_state)
        self.merge_arrive = self.pingpong and not self.ring and (
            self.gmem_state if cfg.merge_arrive is None else cfg.merge_arrive)
        #: the tiles' rows from here on are padding (MosaicConfig.skip_padding_rows;
        #: None: none skipped). Not with merge_arrive, whose arrivals pair the
        #: warpgroups' SPLIT merges, built for every warpgroup having blocks.
        self.live_rows = (live_rows if auto_skip_padding_rows(
                              cfg.skip_padding_rows, causal=causal, nwg=self.nwg,
                              blocks=self.total)
                          and live_rows is not None
                          and live_rows < sq and position is None
                          and not self.merge_arrive else None)
        #: MosaicConfig.last_merge_arrive with merge_arrive and gmem_state (None: for a
        #: non-causal forward)
        self.last_merge_arrive = self.merge_arrive and self.gmem_state and (
            not causal if cfg.last_merge_arrive is None else cfg.last_merge_arrive)
        if self.inplace and interpret is not None:
            raise ValueError("accumulate='inplace' needs the GPU: the Mosaic GPU "
                             "interpreter cannot accumulate into a live wgmma accumulator")
        if self.inplace and not gpu_operands:
            raise ValueError("accumulate='inplace' needs gpu_operands=True")
        # The interpreter has no CPU rule for layout_cast; the GPU lowering needs the
        # hints.
        self.layout_hints = interpret is None
        self.per_split = schedule.BLOCKS_PER_SPLIT
        #: MosaicConfig.static_slots where it applies (a producer's ring of two slots;
        #: None: :func:`auto_static_slots`)
        self.static_slots = (self.stages == 2 and not self.inline_loads
                             and auto_static_slots(cfg.static_slots, d,
                                                   gpu=interpret is None, nwg=self.nwg,
                                                   causal=causal,
                                                   persistent=bool(persistent)))
        #: MosaicConfig.opaque_bounds (None: :func:`auto_opaque_bounds`)
        self.opaque_bounds = auto_opaque_bounds(
            cfg.opaque_bounds, d, gpu=interpret is None, causal=causal,
            persistent=bool(persistent), blocks=self.total)
        self.n_splits_all = -(-self.total // self.per_split)
        if split_out and (self.nwg != 1 or cfg.persistent):
            raise ValueError("split_out needs one compute warpgroup and no persistent "
                             "grid")
        self.wgmma_layout = plgpu.Layout.WGMMA if self.layout_hints else None
        self.row_layout = plgpu.Layout.WGMMA.reduce(1)
        #: setmaxnreg's (compute, producer) registers, or None
        self.regs = ({2: cfg.registers, 3: cfg.registers3}.get(self.nwg)
                     if interpret is None else None)
        self.set_regs = self.regs is not None
        self.greedy = bool(cfg.persistent)
        #: MosaicConfig.kv_multicast where it applies: heads 2i and 2i + 1 in a cluster
        #: of two CTAs ("hc"), each K/V block's copy multicast into both.
        self.multicast = (bool(cfg.kv_multicast) and interpret is None and not cfg.persistent
                          and not self.inline_loads and page_size is None
                          and not self.box_cols and position is None and not split_out
                          and self.group % 2 == 0)
        # Sequence bi's offset and position: static, or read from ``offs`` (dyn_offsets;
        # :meth:`kernel` puts the refs in ``dyn`` before the first use).
        self.dyn = {}

    # -- helpers ---------------------------------------------------------------------

    def scratch(self, qbufs: tuple) -> list:
        """The kernel's SMEM buffers (``qbufs``: ``(2,)`` with the Q prefetch)."""
        bm, bn, d, nwg, dtype, isz = (self.bm, self.bn, self.d, self.nwg, self.dtype,
                                      self.itemsize)
        # K's ring (K^T's off the GPU operand path)
        if self.box_cols:  # kv_boxes: column tile c's box at [slot, c], swizzled
            cols = self.box_cols
            k_ring, v_ring = (plgpu.SMEM((self.stages, d // cols, bn, cols), dtype,
                                         transforms=(plgpu.SwizzleTransform(128),))
                              for _ in range(2))
        else:
            k_shape = (self.stages, bn, d) if self.gpu_operands else (self.stages, d, bn)
            k_ring = plgpu.SMEM(k_shape, dtype,
                                transforms=_smem_transforms(k_shape[-1], isz))
            v_ring = plgpu.SMEM((self.stages, bn, d), dtype,
                                transforms=_smem_transforms(d, isz))
        cols = self.state_cols
        o32 = (plgpu.SMEM((bm, cols), jnp.float32, transforms=_smem_transforms(cols, 4))
               if self.split_out else None)
        rows = plgpu.SMEM((nwg, bm), jnp.float32)
        q_in = plgpu.SMEM((nwg, bm, d), dtype) if self.q_rows is not None else None
        if self.ring_union or self.q_alias or self.rows_in_ring:
            groups = [(k_ring, v_ring)]
            if self.ring_union:  # the split's state staged where the ring was
                groups.append((o32, rows))
                o32 = rows = None
            if self.rows_in_ring:  # smem_state: the epilogue's lse rows
                groups.append((rows,))
                rows = None
            if self.q_alias:  # Q's landing slot where the last V slot is (q_alias):
                # a group's refs lie one after another, each 1 KiB-aligned (as
                # smem_bytes counts them; test_two_ctas_an_sm_lowers_for_cuda reads
                # the offsets from the lowered module)
                slot = bn * d * isz  # a multiple of 1 KiB
                groups.append((plgpu.SMEM(((2 * self.stages - 1) * slot,), jnp.int8), q_in))
                q_in = None
                if not self.split_out:  # (the unsplit decode's lse rows: its epilogue's,
                    # once the ring is idle; a CTA of several splits stores its states
                    # while the ring runs)
                    groups.append((rows,))
                    rows = None
            k_ring, v_ring = plgpu.RefUnion(*groups), None
        return [
            plgpu.SMEM((*qbufs, nwg, bm, d), dtype, transforms=_smem_transforms(d, isz)),
            k_ring,
            v_ring,
            None if self.gpu_operands else
            plgpu.SMEM((nwg, bm, bn), dtype, transforms=_smem_transforms(bn, isz)),
            plgpu.SMEM((bn, self.ones_cols), dtype,
                       transforms=_smem_transforms(self.ones_cols, isz))
            if self.use_mma_rowsum else None,
            rows,
            plgpu.SMEM((self.stages, bn), jnp.float32) if self.key_mask else None,
            # split_out: the split's fp32 output, staged for its TMA store
            o32,
            # carry_in / raw_out: the running state's m and l rows
            plgpu.SMEM((2, bm), jnp.float32) if self.carry_in or self.raw_out else None,
            # state_in / state_out: each warpgroup's fp32 folded output, loaded / stored
            # by TMA; smem_state: each warpgroup's running state
            plgpu.SMEM((nwg, bm, d), jnp.float32, transforms=_smem_transforms(d, 4))
            if self.state_in or self.state_out or self.smem_state else None,
            # q_rows: each warpgroup's Q tile as TMA lands it, untiled (any first row),
            # before it is stored into the tiled, swizzled Q slot that wgmma reads
            q_in,
        ]

    def layout(self, x, lay):
        return plgpu.layout_cast(x, lay) if self.layout_hints else x

    def load(self, ref, lay, optimized=True):
        """The whole SMEM ref in registers, in layout ``lay`` on the GPU
        (:func:`load_ref`); the interpreter reads it plainly."""
        return load_ref(ref, layout=lay, optimized=optimized) if self.layout_hints else ref[...]

    def split_lo(self):
        """The first block of the CTA's splits (split_out), else 0."""
        return (lax.axis_index("s") * (self.per_split * self.per_cta) if self.split_out
                else jnp.int32(0))

    def dyn_offset(self, bi):
        """Sequence ``bi``'s offset input; a paged stacked decode's is its length less
        its queries (``offs_from_lens``: no XLA subtraction before the launch)."""
        if self.offs_from_lens:
            return self.dyn["lens"][bi] - self.stack_sq
        return self.dyn["offs"][bi]

    def offset_of(self, bi):
        return (self.dyn_offset(bi) if self.dyn_offsets and self.position is None
                else self.offset)

    def position_of(self, bi):
        if self.position is None:
            return None
        return self.dyn_offset(bi) if self.dyn_offsets else self.position

    def block_start(self, x):
        """The start of the BLOCK_N block that holds position ``x`` (floor)."""
        return x - x % self.bn

    def last_block_start(self, position):
        """The start of the block that holds the last of the ``stack_sq`` queries from
        ``position`` on (the stacked rows' last query: it decides the blocks visited)."""
        return self.block_start(position + (self.stack_sq - 1))

    def slot_of(self, it: _Item, j):
        """The ring slot of the item's step ``j``."""
        return lax.rem(it.base + j, jnp.int32(self.stages))

    def sync(self, it: _Item, arrive=True):
        """Ping-pong: one arrival and one wait on the shared scheduling barrier; the
        arrival only where ``arrive`` (:meth:`sched_arrive`: False where
        ``merge_arrive`` made it before the SPLIT's merge, :meth:`split`)."""
        self.sched_arrive(it, arrive)
        plgpu.barrier_wait(it.bars[6].at[0])

    def sched_arrive(self, it: _Item, when=True):
        """One arrival on the ping-pong's scheduling barrier where ``when``
        (:func:`arrive_where`)."""
        arrive_where(it.bars[6].at[0], when)

    def turn_wait(self, it: _Item):
        """Ring (three compute warpgroups' ping-pong): wait for this warpgroup's turn
        (its barrier's next phase: the previous warpgroup passed it on)."""
        plgpu.barrier_wait(it.bars[6].at[it.w])

    def turn_pass(self, it: _Item, when=True):
        """Ring: pass the turn on to the next warpgroup (one arrival on its barrier)
        where ``when`` (:func:`arrive_where`). Each warpgroup alternates
        :meth:`turn_wait` and this, ``hi_cta + 1`` of each an item (:meth:`consumer`), so
        one turn goes round and no barrier is ever two phases ahead of its waiter."""
        arrive_where(it.bars[6].at[lax.rem(it.w + 1, jnp.int32(self.nwg))], when)

    def wait_keep(self, it: _Item, t, slot=None):
        if self.key_mask:  # every step's, to keep the barrier's phase
            plgpu.barrier_wait(it.bars[7].at[self.slot_of(it, t) if slot is None else slot])

    def indices(self):
        """(cols, cols - rows) of a (bm, bn) block in the WGMMA layout: key j * bn + c
        is visible to row r iff c - r <= q0 + offset - j * bn."""
        shape, lay = (self.bm, self.bn), self.wgmma_layout
        rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=lay)
        cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=lay)
        return cols, cols - rows

    # -- the tile schedule -----------------------------------------------------------

    def item(self, qi, h, bi):
        """(tile0, h, bi, kvh, hi_cta) of the tile ``qi`` (in launch order) of head
        ``h`` of batch ``bi``: where the item's rows start, its KV head and the key
        blocks [0, hi_cta) any of the CTA's rows visits."""
        if self.cfg.q_order == "descending":
            qi = (self.n_tiles - 1) - qi
        tile0 = qi * self.rows_cta
        pos = self.position_of(bi)
        hi_cta = _visited_blocks(
            tile0 if pos is None else tile0 * 0 + self.last_block_start(pos),
            block_m=self.rows_cta, offset=self.offset_of(bi), total=self.total,
            causal=self.causal)
        if self.split_out:  # the CTA's splits only: blocks [lo, end)
            hi_cta = lax.max(lax.min(self.split_lo() + self.per_split * self.per_cta,
                                     hi_cta), self.split_lo())
        return tile0, h, bi, lax.div(h, jnp.int32(self.group)), hi_cta

    def items_of_cta(self):
        """Tile schedule: the CTA's items as ``(count, item_at(k))``. One item per CTA
        (a grid of (tile, head, batch), the last, heaviest causal tiles first with
        ``q_order="descending"``), or a persistent grid's row of the greedy table
        (:func:`persistent_schedule`, computed on the host: the items in the order of
        the plain grid, each given to the CTA free first by a count of its key
        blocks)."""
        if not self.cfg.persistent:
            qi = lax.axis_index("q")
            h = (lax.axis_index("h") * 2 + lax.axis_index("hc") if self.multicast
                 else lax.axis_index("h"))
            bi = lax.axis_index("b")
            return jnp.int32(1), lambda k: self.item(qi, h, bi)
        cta = lax.axis_index("cta")
        table = self.dyn["sched"]  # row cta: [count, item, item, ...]
        hq, n_tiles = self.hq, self.n_tiles

        def at_table(k):
            t = table[cta, k + 1]
            return self.item(lax.rem(lax.div(t, jnp.int32(hq)), jnp.int32(n_tiles)),
                             lax.rem(t, jnp.int32(hq)),
                             lax.div(t, jnp.int32(hq * n_tiles)))

        return table[cta, 0], at_table

    # -- the K/V producer ring -------------------------------------------------------

    def producer(self, k_ref, v_ref, smem, bars, kvh, bi, hi, base, keep_ref=None):
        """K/V producer ring, one item: key blocks [split_lo(), hi) into the ring, block
        t at ring position ``base + t``, each slot once the compute warpgroups have
        released it (the "consumed" barriers); with a key mask, each block's keep
        values with its V (they are read up to the softmax, V's slot is released after
        P V)."""
        _, _, k_free, v_free, *_ = bars
        stages = self.stages
        refs = (k_ref, v_ref, keep_ref)

        def load(t, _):
            n = base + t
            slot = lax.rem(n, jnp.int32(stages))
            parts = self.block_parts(bi, t)

            @pl.when(n >= stages)
            def _():
                plgpu.barrier_wait(k_free.at[slot])

            self.load_k(refs, smem, bars, kvh, parts, slot)

            @pl.when(n >= stages)
            def _():
                plgpu.barrier_wait(v_free.at[slot])

            self.load_v(refs, smem, bars, kvh, parts, slot, bi, t)
            return None

        lax.fori_loop(self.split_lo(), hi, load, None)

    def load_k(self, refs, smem, bars, kvh, parts, slot):
        """A key block's K (``parts``: :meth:`block_parts`) into the ring's ``slot``
        (``refs``: K's, V's and the keep values' GMEM refs)."""
        self.load_block(refs[0], smem[1], bars[0], slot, parts, kvh,
                        kt=not self.gpu_operands)

    def load_v(self, refs, smem, bars, kvh, parts, slot, bi, t):
        """Key block ``t``'s V (and with a key mask its keep values) into ``slot``."""
        self.load_block(refs[1], smem[2], bars[1], slot, parts, kvh)
        if self.key_mask:
            bn = self.bn
            plgpu.copy_gmem_to_smem(refs[2].at[bi, pl.ds(t * bn, bn)], smem[6].at[slot],
                                    bars[7].at[slot])

    def load_block(self, ref, ring, bar, slot, parts, kvh, kt=False):
        """The block's K or V rows into ``ring``'s ``slot``: with kv_boxes, one TMA box
        of ``BLOCK_N`` rows by ``box_cols`` columns (128 bytes) per column tile (rows
        past Skv: TMA's zeros); else one TMA copy per part (``kt``: K^T's tiles, off
        the GPU operand path)."""
        if self.box_cols:
            (seq, rows, _), = parts
            cols = self.box_cols
            tile = self.kv_tile(ref, seq, kvh, rows)
            for c in range(self.d // cols):
                plgpu.copy_gmem_to_smem(tile.at[:, pl.ds(c * cols, cols)],
                                        ring.at[slot, c], bar.at[slot])
            return
        multicast = {"collective_axes": "hc"} if self.multicast else {}
        for seq, rows, at in parts:
            if kt:
                src = ref.at[seq, kvh, :, rows]
                dst = ring.at[slot] if at is None else ring.at[slot, :, at]
            else:
                src = self.kv_tile(ref, seq, kvh, rows)
                dst = ring.at[slot] if at is None else ring.at[slot, at]
            plgpu.copy_gmem_to_smem(src, dst, bar.at[slot], **multicast)

    def kv_slot(self, ring, slot):
        """The K or V ring's ``slot`` as ``(first column, [BLOCK_N, columns] tile)``
        parts, in column order: the whole ``[BLOCK_N, D]`` tile (first column None), or
        with kv_boxes one tiled view per column tile of 128 bytes (its box's bytes are
        those of a tiled, swizzled ``[BLOCK_N, 64]`` slot)."""
        if not self.box_cols:
            return ((None, ring.at[slot]),)
        bn, cols = self.bn, self.box_cols
        return tuple((c * cols, untiled_view(ring.at[slot, c].reshape(bn // 8, 1, 8, cols),
                                             (8, cols)))
                     for c in range(self.d // cols))

    def kv_tile(self, ref, seq, kvh, rows):
        """The K or V tile of ``rows`` of KV head ``kvh`` of entry ``seq``."""
        return tile_of(ref, seq, kvh, rows, self.kv_btnh)

    def block_parts(self, bi, t):
        """Key block ``t`` of sequence ``bi`` as TMA copies ``(index, rows, at)``: rows
        ``rows`` of the K/V array's entry ``index`` (a sequence, or a page of the paged
        cache) into the slot's rows ``at`` (None: the whole slot)."""
        bn, ps = self.bn, self.page_size
        if ps is None:
            return [(bi, pl.ds(self.k_row0 + t * bn, bn), None)]
        table = self.dyn["table"]
        width, last = table.shape[1], self.num_pages - 1

        def page(i):
            """Entry ``i`` of the sequence's table row, clamped to a real page (entries
            past its pages, or past the row, hold anything: none of their keys is
            visible, and V's rows past the length are zeroed in the slot)."""
            return jnp.clip(table[bi, jnp.minimum(i, width - 1)], 0, last)

        if ps >= bn:  # one page holds the block
            k0 = t * bn
            return [(page(lax.div(k0, jnp.int32(ps))),
                     pl.ds(lax.rem(k0, jnp.int32(ps)), bn), None)]
        per = self.copies  # the block's pages, in key order
        return [(page(t * per + j), pl.ds(0, ps), pl.ds(j * ps, ps))
                for j in range(per)]

    def zero_tail(self, it: _Item, t, v_parts):
        """Paged: V's rows of block ``t`` at or past the sequence's length set to zero in
        the slot (their probabilities are 0, but 0 * NaN is not), as a contiguous call's
        padding keys are zeros. Only blocks that reach past the length: the last one, and
        any a tile's padding rows visit."""
        bn = self.bn
        valid = self.dyn["lens"][it.bi] - t * bn

        @pl.when(valid < bn)
        def _():
            self._keep_v_rows(v_parts, lambda w: self._iota_rows(w) < valid)

    def zero_dropped(self, it: _Item, t, v_parts, keep_t):
        """Key mask: V's rows of the keys ``keep_t`` drops set to zero in the slot, in a
        block that drops any (its flag): their probabilities are 0, but 0 * NaN is not.
        Read in place, K and V may hold anything at a dropped key (NaN padding, a
        cache's unused slots); K needs nothing, its scores are selected away. The same
        values the kernel saw when the caller's K and V were zeroed by
        :func:`zero_dropped_keys` before it: the same bits, with no copy of the cache."""
        bn = self.bn

        @pl.when(it.flags_ref[it.bi, t] != 0)
        def _():
            kv = self.load(keep_t, plgpu.Layout.WGMMA.reduce(1))
            self._keep_v_rows(v_parts,
                              lambda w: lax.broadcast_in_dim(kv, (bn, w), [0]) != 0.0)

    def _iota_rows(self, width):
        """Each element's row in a ``[BLOCK_N, width]`` tile (WGMMA layout on the GPU)."""
        shape = (self.bn, width)
        return (plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
                if self.layout_hints else lax.broadcasted_iota(jnp.int32, shape, 0))

    def _keep_v_rows(self, v_parts, kept):
        """The V slot's parts (:meth:`kv_slot`) with their elements outside
        ``kept(width)`` (bool ``[bn, width]``, in the WGMMA layout on the GPU) set to
        zero, committed for the P V product."""
        for _, v_t in v_parts:
            x = self.load(v_t, plgpu.Layout.WGMMA)
            v_t[...] = jnp.where(kept(x.shape[1]), x, jnp.zeros_like(x))
        plgpu.commit_smem()

    def drain(self, bars, loads):
        """The producer's end: wait for the compute warpgroups' last release of every
        slot still in flight (of ``loads`` in all), so every barrier arrival is observed
        before the barriers are freed."""
        _, _, k_free, v_free, *_ = bars

        def wait(n, _):
            slot = lax.rem(n, jnp.int32(self.stages))
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            return None

        lax.fori_loop(lax.max(loads - self.stages, 0), loads, wait, None)

    # -- the softmax consumer --------------------------------------------------------

    def softmax(self, it: _Item, j, s, m, l, masked, keep):
        """Online-softmax step of key block ``j`` on the raw scores ``s``: ``(p, alpha,
        m_new, l_new)`` with ``p`` the probabilities in the input dtype; with
        ``rowsum="mma"`` the row sum (on wgmma) and ``l_new`` are the caller's, and with
        ``late_rowsum`` ``l_new`` is the fp32 probabilities, for the caller to sum."""
        # The row max is taken of the raw scores and scaled after (the same value: the
        # scale is positive and rounding is monotone), so ``s * scale`` has one use,
        # the exponent, where the compiler contracts ``s * scale - m`` into one FMA
        # alike on masked and unmasked blocks. (With the scaled scores also feeding
        # the max, a fully visible block gave different bits through the two paths on
        # the H200.) The mask selects the max's input and the exponential's output,
        # never the exponent. (A non-causal call has nothing to mask but dropped keys:
        # a partial last block's padding keys are dropped by a key mask.)
        bm, bn = self.bm, self.bn
        masked = masked and (self.causal or self.key_mask)
        if masked:
            cols, diag = it.tile_indices or self.indices()
            visible = None
            if self.causal and it.position is None:
                visible = diag <= it.q0 + it.offset - j * bn
            elif self.causal and self.stack_sq == 1:
                visible = cols <= it.position - j * bn
            elif self.causal:  # row r is query r % stack_sq: at position + r % stack_sq
                rq = lax.rem(cols - diag, jnp.int32(self.stack_sq))
                visible = cols - rq <= it.position - j * bn
            if self.key_mask:
                kv = self.load(keep, plgpu.Layout.WGMMA.reduce(0))
                kept = lax.broadcast_in_dim(kv, (bm, bn), [1]) != 0.0
                visible = kept if visible is None else visible & kept
            raw_max = jnp.where(visible, s, NEG_INF).max(axis=1)
        else:
            raw_max = s.max(axis=1)
        m_new = jnp.maximum(m, raw_max * self.s_scale)
        m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
        alpha = self.exp(m - m_safe)
        p32 = self.exp(s * self.s_scale - _rows(m_safe, s.shape))
        if masked:
            p32 = jnp.where(visible, p32, 0.0)
        if self.use_mma_rowsum:
            l_new = None
        elif self.cfg.late_rowsum:
            l_new = p32  # summed by block_step once P V is issued
        else:
            l_new = _row_sum_update(l, alpha, p32)
        return p32.astype(self.dtype), alpha, m_new, l_new

    def softmax_at(self, it: _Item, j, s, m, l, masked, keep):
        """:meth:`softmax` on the block's path: with a key mask, a block that would take
        the unmasked path takes the masked one where it drops a key."""
        if masked or not self.key_mask:
            return self.softmax(it, j, s, m, l, masked, keep)
        return lax.cond(it.flags_ref[it.bi, j] != 0,
                        lambda: self.softmax(it, j, s, m, l, True, keep),
                        lambda: self.softmax(it, j, s, m, l, False, keep))

    def block_step(self, it: _Item, n_steps, t, carry, *, masked, slot=None):
        """Softmax consumer, key block ``t`` (taking the masked path if ``masked``): S =
        Q K^T on wgmma (K's slot released), the online-softmax step, then P V into the
        accumulator, in place (``acc * alpha`` as the wgmma's initial accumulator) or
        into a fresh one added after; the next block's K is awaited while P V runs.
        ``slot``: the block's ring slot where the caller knows it as a constant
        (:meth:`unmasked_steps`), else None (:meth:`slot_of`)."""
        acc, m, l = carry
        _, _, v_s, _, ones_s, _, keep_s, *_ = it.smem
        k_bar, v_bar, _, _, _, _, sched, *_ = it.bars
        bm = self.bm
        next_slot = None if slot is None else (slot + 1) % self.stages
        if slot is None:
            slot = self.slot_of(it, t)
        # inline_loads: block t + stages' copies, read before the products (a paged
        # block's table entries are loads from global memory; their use waits for them)
        nxt = ((t + self.stages, self.block_parts(it.bi, t + self.stages))
               if self.inline_loads else None)
        self.wait_keep(it, t, slot)
        # merge_arrive: the SPLIT's first block's arrival made before the last merge
        with block_scope("s"):
            s = self.scores(it, slot, arrive=(True if it.arrived is None else
                                              jnp.logical_not(it.arrived & (t == it.lo))))
        self.release(it, n_steps, nxt, slot, "k")
        keep = keep_s.at[slot] if self.key_mask else None
        with block_scope("softmax"):
            p, alpha, m, l_new = self.softmax_at(it, t, s, m, l, masked, keep)
        # late_rowsum: l_new is the fp32 probabilities, summed once P V is issued
        p32, l_new = (l_new, l) if self.cfg.late_rowsum else (None, l_new)
        if self.gpu_operands:  # P as the P V wgmma's A operand: registers, or SMEM
            p_op = p
        else:
            it.p_s[...] = p
            plgpu.commit_smem()
            p_op = it.p_s
        if self.use_mma_rowsum:
            def psum(acc_ref):
                plgpu.wgmma(acc_ref, p_op, ones_s)
                return acc_ref[...]

            rs = pl.run_scoped(psum, plgpu.ACC((bm, self.ones_cols), jnp.float32))
            l_new = l * alpha + rs.max(axis=1)
        l = l_new
        acc = acc * _rows(alpha, acc.shape)
        if self.cfg.fence and self.gpu_operands:  # (P in SMEM is a ref: nothing to fence)
            acc, m, l, p_op = lax.optimization_barrier((acc, m, l, p_op))
        if self.pingpong and not self.ring:
            plgpu.barrier_arrive(sched.at[0])  # softmax done: the other may go on
        with block_scope("wait_pv"):
            plgpu.barrier_wait(v_bar.at[slot])
            if self.ring:  # this warpgroup's turn: P V now, then the next block's S
                self.turn_wait(it)
            elif self.pingpong:
                plgpu.barrier_wait(sched.at[0])  # the other's products are issued
        v_parts = self.kv_slot(v_s, slot)
        if self.page_size is not None:
            self.zero_tail(it, t, v_parts)
        if self.key_mask:
            self.zero_dropped(it, t, v_parts, keep)

        def pv_parts(acc_ref):
            self.pv_parts(acc_ref, p_op, v_parts)
            if self.ring:  # the item's last product: the turn goes on now
                self.turn_pass(it, t == it.hi - 1)

        def next_k():
            """Wait for block t + 1's K (if the warpgroup has it) while P V runs."""
            @pl.when(t + 1 < n_steps)
            def _():
                plgpu.barrier_wait(k_bar.at[self.slot_of(it, t + 1) if next_slot is None
                                            else next_slot])

        with block_scope("pv"):
            acc, l = self.pv_product(acc, l, alpha, p32, pv_parts, next_k)
        self.release(it, n_steps, nxt, slot, "v")
        return acc, m, l

    def pv_product(self, acc, l, alpha, p32, pv_parts, next_k):
        """:meth:`block_step`'s P V: ``pv_parts(acc_ref)`` into the accumulator in
        place or into a fresh one added after, ``next_k()`` while it runs, and (with
        ``late_rowsum``: ``p32``, the fp32 probabilities) the row sum after its
        issue; ``(acc, l)``."""
        bm, d = self.bm, self.d
        if self.inplace and p32 is not None:
            def pv_late(refs):
                acc_ref, l_ref = refs
                pv_parts(acc_ref)
                l_ref[...] = _row_sum_update(l, alpha, p32)  # after P V's issue
                next_k()

            return pl.run_state(pv_late)((plgpu.ACC.init(acc), l))
        if self.inplace:
            def pv_into(acc_ref):
                pv_parts(acc_ref)
                next_k()

            return pl.run_state(pv_into)(plgpu.ACC.init(acc)), l

        def pv(acc_ref):
            pv_parts(acc_ref)
            l_out = None if p32 is None else _row_sum_update(l, alpha, p32)
            next_k()
            return acc_ref[...], l_out

        pv_acc, l_out = pl.run_scoped(pv, plgpu.ACC((bm, d), jnp.float32))
        return acc + pv_acc, l if l_out is None else l_out

    def scores(self, it: _Item, slot, issued=None, arrive=True):
        """S = Q K^T of the K ring's ``slot`` on wgmma (fp32 ``[bm, bn]``); with
        ping-pong, the scheduling barrier's sync once the product is issued (its
        arrival where ``arrive``: :meth:`sync`); ``issued()``, if given, runs then too
        (before the product is awaited)."""
        k_s = it.smem[1]

        def qk(acc_ref):
            if self.gpu_operands:
                # kv_boxes: one product per column tile of K, accumulated in column
                # order (the whole tile's product issues the same k-steps in that order)
                for c, k_t in self.kv_slot(k_s, slot):
                    q_t = it.q_s if c is None else it.q_s.at[:, pl.ds(c, self.box_cols)]
                    plgpu.wgmma(acc_ref, q_t, k_t.transpose((1, 0)))
            else:  # K^T's slot
                plgpu.wgmma(acc_ref, it.q_s, k_s.at[slot])
            if self.ring:  # the turn's products are issued: the next warpgroup's turn
                self.turn_pass(it)
            elif self.pingpong:
                self.sync(it, arrive)
            if issued is not None:
                issued()
            return acc_ref[...]

        return pl.run_scoped(qk, plgpu.ACC((self.bm, self.bn), jnp.float32))

    def pv_parts(self, acc_ref, p_op, v_parts):
        """P V into ``acc_ref``: one product per V part (:meth:`kv_slot`; with kv_boxes,
        into its columns of the accumulator)."""
        for c, v_t in v_parts:
            plgpu.wgmma(acc_ref if c is None else acc_ref.at[:, pl.ds(c, self.box_cols)],
                        p_op, v_t)

    def release(self, it: _Item, n_steps, nxt, slot, kind: str):
        """A block's K (``kind`` "k") or V ``slot`` read: an arrival on its "consumed"
        barrier for the producer or, without one (``inline_loads``), the load of block
        ``nxt = (t + stages, its parts)`` into the slot, if the warpgroup visits it.
        (Pallas's copy starts with a warpgroup barrier, so every warp's products have
        read the slot.)"""
        if not self.inline_loads:
            plgpu.barrier_arrive(it.bars[2 if kind == "k" else 3].at[slot])
            return
        t, parts = nxt
        pl.when(t < n_steps)(lambda: self.load_inline(it, t, parts, slot, kind))

    def load_inline(self, it: _Item, t, parts, slot, kind: str):
        """``inline_loads``: the compute warpgroup's copy of key block ``t``'s K (``kind``
        "k") or V (and keep values) into ``slot`` (``parts``: :meth:`block_parts`)."""
        refs = self.dyn["kv"]
        if kind == "k":
            self.load_k(refs, it.smem, it.bars, it.kvh, parts, slot)
        else:
            self.load_v(refs, it.smem, it.bars, it.kvh, parts, slot, it.bi, t)

    # -- the SPLIT fold --------------------------------------------------------------

    def unmasked_steps(self, it: _Item, step, lo, mid, carry):
        """The unmasked blocks ``[lo, mid)`` of a SPLIT, in key order, from ``carry``
        (``step``: :meth:`block_step` bound to the item). With ``static_slots``: the loop
        unrolled by the ring's two slots, branched once on the slot of block ``lo``, so
        each step's slot (its SMEM, its barriers and their phase bits) is a constant;
        an odd count's last block after the pairs. The same steps in the same order."""
        step = functools.partial(step, masked=False)
        if not self.static_slots:
            return lax.fori_loop(lo, mid, step, carry)
        return two_slot_loop(lo, mid, step, carry, self.slot_of(it, lo))

    def rows_init(self, value):
        """A ``[bm]`` fp32 row vector of ``value`` in the rows' layout (m, l, lse)."""
        return self.layout(jnp.full((self.bm,), value, jnp.float32), self.row_layout)

    def tile_zeros(self, cols):
        """A ``[bm, cols]`` fp32 zero tile in the WGMMA layout."""
        return self.layout(jnp.zeros((self.bm, cols), jnp.float32), plgpu.Layout.WGMMA)

    def split_bounds(self, it: _Item, si):
        """SPLIT ``si``'s blocks ``(lo, mid, end)``: ``[lo, end)``, unmasked up to
        ``mid``."""
        lo = si * self.per_split
        end = lax.min(lo + self.per_split, it.hi)
        return lo, lax.max(lax.min(it.full, end), lo), end

    def state_slot(self):
        """``gmem_state``: the CTA's slot of the scratch: its SM's (:func:`sm_id`) on the
        GPU, its own in the interpreter (whose CTAs may run at once on one host)."""
        if self.interpret is None:
            return sm_id()
        idx = jnp.int32(0)
        for name, n in zip(self.grid_names, self.grid, strict=True):
            idx = idx * n + lax.axis_index(name)
        return idx

    def n_splits(self, it: _Item):
        """The SPLITs of the item's blocks ``[0, hi)``."""
        return lax.div(it.hi + (self.per_split - 1), jnp.int32(self.per_split))

    def visit(self, it: _Item, p0, p_last):
        """The item's key blocks: ``[0, hi)`` visited (``p_last``: the position that
        decides them) and ``[0, full)`` every row sees entirely (``p0``): no mask
        (masking every block ran 27% slower on the H200, docs/mosaic.md)."""
        it.hi = _visited_blocks(p_last, block_m=self.bm, offset=it.offset,
                                total=self.total, causal=self.causal)
        if self.live_rows is not None:  # rows all padding: no block
            it.hi = jnp.where(it.q0 >= self.live_rows, jnp.int32(0), it.hi)
        it.full = _full_blocks(p0, it.hi, offset=it.offset, whole=self.whole,
                               causal=self.causal)
        if self.opaque_bounds:
            it.hi, it.full = lax.optimization_barrier((it.hi, it.full))

    def split(self, it: _Item, n_steps, si, state, init=None, more=None):
        """SPLIT ``si``: its blocks [lo, end) in key order from a fresh state (or from
        ``init``, the running state of the split's earlier keys: ``carry_in``; those
        from ``mid`` on take the masked path), finalised (:func:`kernel_finalize`) and
        merged into the running ``state`` (:func:`kernel_merge`; None: the first split);
        with ``raw_out`` the running ``(acc, m, l)`` itself. ``more`` (a fold's SPLIT,
        with ``merge_arrive``): whether another SPLIT of the item follows; then the
        ping-pong arrival of that SPLIT's first S is made once this one's blocks are
        issued, before its finalise and merge, and (si > 0) this SPLIT's first S makes
        none (the previous SPLIT made it)."""
        lo, mid, end = self.split_bounds(it, si)
        if init is None:
            init = (self.tile_zeros(self.d), self.rows_init(NEG_INF), self.rows_init(0.0))
        early = more is not None and self.merge_arrive
        it.lo, it.arrived = (lo, si > 0) if early else (None, None)
        step = functools.partial(self.block_step, it, n_steps)
        carry = self.unmasked_steps(it, step, lo, mid, init)
        acc, m, l = lax.fori_loop(mid, end, functools.partial(step, masked=True), carry)
        it.lo = it.arrived = None
        if early:  # (after the wait before P V: the arrival is the next phase's)
            self.sched_arrive(it, more)
        if self.raw_out:
            return acc, m, l
        # m is in the softmax's base (log2 units when base2): the kernel's state stays
        # in that base until the output (KERNEL_LSE_BASE2).
        part = kernel_finalize(acc, m, l, self.cfg.normalize)
        return part if state is None else kernel_merge(*state, *part)

    def fold_in_smem(self, it: _Item, n_steps, n_splits, st):
        """``smem_state``: the item's SPLITs folded in order into the running state's
        output in the SMEM tile ``st``, the empty state first (zeros, lse -inf, as
        :meth:`consumer`'s registers start), each SPLIT's finalised state merged into
        it :data:`SMEM_STATE_COLS` columns at a time (:func:`merge_weights` once, then
        :func:`merge_apply` per column chunk: the operations of :func:`kernel_merge`
        on each element). Returns the running lse (rows, in registers); each thread
        reads back only the elements it wrote, so no barrier is needed."""
        cols = SMEM_STATE_COLS
        chunks = [st.at[:, pl.ds(c, cols)] for c in range(0, self.d, cols)]
        for ref in chunks:
            ref[...] = self.tile_zeros(cols)

        def store(j, o):
            chunks[j][...] = o

        def one(si, lse_s):
            return self.merge_split(it, n_steps, si, lse_s,
                                    lambda j: self.load(chunks[j], plgpu.Layout.WGMMA),
                                    store)

        return lax.fori_loop(0, n_splits, one, self.rows_init(NEG_INF))

    def merge_split(self, it: _Item, n_steps, si, lse_s, left, store, more=None):
        """SPLIT ``si`` (:meth:`split`, with ``more``) merged into the running state of
        lse ``lse_s`` whose output's column chunk ``j`` is ``left(j)`` (read as the
        merge needs it), each merged chunk handed to ``store(j, o)`` as soon as it is
        merged: the merged lse."""
        bm, cols = self.bm, SMEM_STATE_COLS
        o_p, lse_p = self.split(it, n_steps, si, None, more=more)
        weights = kernel_merge_weights(lse_s, lse_p, (bm, cols))
        lse = lse_s
        for j in range(self.d // cols):
            o, lse = merge_apply(left(j), lse_s, o_p[:, j * cols:(j + 1) * cols], lse_p,
                                 weights, pin_fma=True)
            store(j, o)
        return lse

    def fold_in_gmem(self, it: _Item, n_steps, n_splits, st, sink, last_more=False):
        """``gmem_state``: :meth:`fold_in_smem`'s fold with the running state in the
        warpgroup's rows ``st`` of the global scratch (read with ``optimized=False``)
        only between SPLITs: the first SPLIT merged into the empty state's constant
        zeros (no filled scratch), every SPLIT but the last written to ``st`` and the
        next one's merge reading it back, and the last SPLIT's merged column chunks
        handed to ``sink(j, o)`` as each is merged (the epilogue's SMEM: no reload, and
        no 64xD tile held in registers beside the SPLIT's). The same operations on the
        same values as the SMEM state's fold (a merge with the empty state selects the
        SPLIT's own output and lse, whatever the zeros' origin): a launch choice. An
        item of no key blocks runs SPLIT 0 on an empty range (output 0, lse -inf: the
        empty state). ``last_more``: the last SPLIT's ``more`` (:meth:`split`; with
        ``last_merge_arrive``, the warpgroup's next arrival is made before its last
        merge). Returns the lse."""
        cols = SMEM_STATE_COLS
        chunks = [st.at[:, pl.ds(c, cols)] for c in range(0, self.d, cols)]

        def left(si):
            def chunk(j):
                return lax.cond(si == 0, lambda: self.tile_zeros(cols),
                                lambda: self.load(chunks[j], plgpu.Layout.WGMMA, False))
            return chunk

        def store(j, o):
            chunks[j][...] = o

        def one(si, lse_s):
            return self.merge_split(it, n_steps, si, lse_s, left(si), store, more=True)

        lse = lax.fori_loop(0, n_splits - 1, one, self.rows_init(NEG_INF))
        last = lax.max(n_splits - 1, 0)
        return self.merge_split(it, n_steps, last, lse, left(last), sink, more=last_more)

    def consumer(self, w, q_ref, o_ref, lse_ref, smem, bars, tile0, h, bi, hi_cta, base,
                 flags_ref=None, qbuf=None, after_q=None, kvh=None):
        """One (tile, head, batch) item of compute warpgroup ``w``: the Q tile, the
        splits folded in order (:meth:`split`), the blocks only the CTA's other
        warpgroup needs released, and the :meth:`epilogue`. ``base``: the K/V loads of
        the CTA's earlier items (the ring's position). With ``prefetch_q``: ``qbuf``,
        the Q buffer already being loaded for this item, and ``after_q``, called once
        this item's Q is in (it starts the next item's load)."""
        q_s, _, _, p_s, _, lse_s, *_ = smem
        q_bar = bars[4]
        if qbuf is None:
            q_s, q_b = q_s.at[w], q_bar.at[w]
        else:
            q_s, q_b = q_s.at[qbuf, w], q_bar.at[qbuf * self.nwg + w]
        it = _Item(w=w, q_s=q_s, q_b=q_b, lse_s=lse_s.at[w],
                   p_s=None if p_s is None else p_s.at[w], smem=smem, bars=bars,
                   q0=tile0 + w * self.bm, h=h, bi=bi, base=base, flags_ref=flags_ref,
                   kvh=kvh)
        it.offset, it.position = self.offset_of(bi), self.position_of(bi)
        # The position that decides the blocks and their paths: with ``position``, the
        # start of the prefill warpgroup tile that holds it (forward's padding aligns
        # prefill tiles to multiples of BLOCK_N).
        # With ``stack_sq``: the blocks the last query sees, unmasked where the first
        # query sees every key.
        p0 = it.q0 if it.position is None else it.q0 * 0 + self.block_start(it.position)
        p_last = (p0 if it.position is None
                  else it.q0 * 0 + self.last_block_start(it.position))
        self.visit(it, p0, p_last)
        if qbuf is None and self.q_rows is None:
            plgpu.copy_gmem_to_smem(
                tile_of(q_ref, bi, h, pl.ds(self.q_row0 + it.q0, self.bm), self.q_btnh),
                q_s, q_b)
        elif qbuf is None:  # the group's rows from any row: through an untiled slot
            q_in = smem[10].at[w]
            plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(h * self.q_rows + it.q0, self.bm)],
                                    q_in, q_b)
        if self.inline_loads:  # no producer: the ring's first blocks, then one a release
            first_step, n_steps = self.steps(it)
            last = first_step + (self.stages - 1)  # (the ring's last slot)

            def prologue(t, _):
                parts, slot = self.block_parts(bi, t), self.slot_of(it, t)
                self.load_inline(it, t, parts, slot, "k")
                if self.defer_v:  # (the last slot's V once Q has left its landing slot)
                    pl.when(t != last)(lambda: self.load_inline(it, t, parts, slot, "v"))
                else:
                    self.load_inline(it, t, parts, slot, "v")
                return None

            lax.fori_loop(first_step, lax.min(first_step + self.stages, n_steps), prologue,
                          None)
        if self.state_in:
            self.issue_state(it)
        with jax.named_scope("wait_q"):  # (profiling's ranges; nothing otherwise)
            plgpu.barrier_wait(q_b)
        if qbuf is None and self.q_rows is not None:
            # (once per tile; the untiled slot's reads conflict on SMEM banks)
            q_s[...] = self.load(q_in, plgpu.Layout.WGMMA, optimized=False)
            plgpu.commit_smem()
            if self.defer_v:  # the last slot's first V (the copy waits for every warp)
                pl.when(last < n_steps)(lambda: self.load_inline(
                    it, last, self.block_parts(bi, last), self.slot_of(it, last), "v"))
        if after_q is not None:
            after_q()
        it.tile_indices = None if self.cfg.masks_in_loop else self.indices()
        if self.ring:  # the item's first turn: its first S
            self.turn_wait(it)
        elif self.pingpong:
            pl.when(w == 1)(lambda: self.sync(it))

        first_step, n_steps = self.steps(it)
        n_splits = self.n_splits(it)

        with jax.named_scope("wait_k"):
            @pl.when(first_step < n_steps)  # the first K (each later one: during P V)
            def _():
                plgpu.barrier_wait(bars[0].at[self.slot_of(it, first_step)])

        init = (self.tile_zeros(self.d), self.rows_init(NEG_INF))
        if self.split_out and self.per_cta > 1:
            # This CTA's splits, each from the empty state, each stored (the ring runs
            # on across them); the last CTA of a row has the rest.
            s0 = lax.axis_index("s") * self.per_cta

            def one_split(j, _):
                state = self.split(it, n_steps, s0 + j, None)
                self.epilogue(it, o_ref, lse_ref, *state, si=s0 + j, chained=True)
                return None

            lax.fori_loop(0, lax.min(jnp.int32(self.per_cta), self.n_splits_all - s0),
                          one_split, None)
            wait_stores(self.cfg.store_wait)
            return
        if self.split_out:
            # This CTA's split only (blocks [lo, min(lo + per_split, hi)), none when lo
            # >= hi: then finalize gives (0, -inf)); the fold happens outside.
            state = self.split(it, n_steps, lax.axis_index("s"), None,
                               self.load_carry(it) if self.carry_in else None)
            self.epilogue(it, o_ref, lse_ref, *state)
            return
        with jax.named_scope("fold"):
            out, lse = self.fold(it, n_steps, n_splits, init)
        self.after_fold(it, o_ref, lse_ref, out, lse, hi_cta)

    def fold(self, it: _Item, n_steps, n_splits, init):
        """The item's splits folded in order from ``init`` (or the loaded state):
        ``(out, lse)`` (``out`` None where it is already in the Q tile's SMEM)."""
        w = it.w
        if self.state_in:  # the fold goes on from the loaded state
            init = self.wait_state(it)
        if self.gmem_state:  # the output straight into the Q tile's SMEM (Q is done)
            def sink(j, o):
                cols = o.shape[1]
                it.q_s.at[:, pl.ds(j * cols, cols)][...] = o.astype(self.dtype)

            out = None
            st = self.dyn["gstate"].at[self.state_slot(), pl.ds(w * self.bm, self.bm)]
            lse = self.fold_in_gmem(it, n_steps, n_splits, st, sink,
                                    last_more=(w == 0) if self.last_merge_arrive else False)
        elif self.smem_state:
            st = it.smem[9].at[w]
            lse = self.fold_in_smem(it, n_steps, n_splits, st)
            out = self.load(st, plgpu.Layout.WGMMA)
        else:
            def fold(si, state):
                return self.split(it, n_steps, si, state, more=si < n_splits - 1)

            out, lse = lax.fori_loop(0, n_splits, fold, init)
        return out, lse

    def after_fold(self, it: _Item, o_ref, lse_ref, out, lse, hi_cta):
        """The blocks only the CTA's other warpgroups need, released, and the item's
        :meth:`epilogue`."""
        w, bars = it.w, it.bars

        # Blocks the CTA's other warpgroup needs and this one does not: wait for each
        # load (so this warpgroup's release belongs to that block's phase) and release.
        # (last_merge_arrive: warpgroup 0's first arrival after its last merge was made
        # before it.)
        def skip(t, _):
            k_bar, v_bar, k_free, v_free = bars[:4]
            slot = self.slot_of(it, t)
            plgpu.barrier_wait(k_bar.at[slot])
            self.wait_keep(it, t)
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_wait(v_bar.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            if self.ring:  # an empty turn
                self.turn_wait(it)
                self.turn_pass(it)
            elif self.pingpong:
                self.sync(it, True if not self.last_merge_arrive
                          else jnp.logical_not((w == 0) & (t == it.hi)))
                self.sync(it)
            return None

        if self.ring:  # no block: the turn of the last product goes on here
            self.turn_pass(it, it.hi == 0)
        with jax.named_scope("skip"):
            if self.nwg > 1:
                lax.fori_loop(it.hi, hi_cta, skip, None)
            if self.pingpong and not self.ring:
                pl.when(w == 0)(lambda: self.sync(
                    it, True if not self.last_merge_arrive else hi_cta > it.hi))
        with jax.named_scope("epilogue"):
            self.epilogue(it, o_ref, lse_ref, out, lse)

    def steps(self, it: _Item):
        """The warpgroup's ring steps ``[first_step, n_steps)`` (split_out: its splits')."""
        first_step = self.split_lo()
        n_steps = (lax.min(it.hi, self.split_lo() + self.per_split * self.per_cta)
                   if self.split_out else it.hi)
        return first_step, n_steps

    def issue_state(self, it: _Item):
        """``state_in``: start the TMA loads of the item's rows of the folded state (its
        output into the warpgroup's fp32 tile, its lse into the lse row buffer)."""
        o_in, l_in = self.dyn["state"]
        bars, rows = it.bars[9], pl.ds(it.q0, self.bm)
        plgpu.copy_gmem_to_smem(o_in.at[it.bi, it.h, rows], it.smem[9].at[it.w],
                                bars.at[2 * it.w])
        plgpu.copy_gmem_to_smem(l_in.at[it.bi, it.h, rows], it.lse_s, bars.at[2 * it.w + 1])

    def wait_state(self, it: _Item):
        """``state_in``: the loaded folded state in the accumulator's and the rows'
        layouts (the fold's initial state)."""
        bars, o_s = it.bars[9], it.smem[9].at[it.w]
        plgpu.barrier_wait(bars.at[2 * it.w])
        plgpu.barrier_wait(bars.at[2 * it.w + 1])
        return self.load(o_s, plgpu.Layout.WGMMA), self.load(it.lse_s, self.row_layout)

    def load_carry(self, it: _Item):
        """``carry_in``: the running state of the split's earlier keys for the item's
        rows, TMA-loaded into the fp32 staging tile and the rows buffer, read into
        registers in the accumulator's and the rows' layouts."""
        acc_in, m_in, l_in = self.dyn["carry"]
        bar, o32_s, rows_s = it.bars[8].at[0], it.smem[7], it.smem[8]
        at = (it.bi, it.h, lax.axis_index("s"), pl.ds(it.q0, self.bm))
        for src, dst in ((acc_in, o32_s), (m_in, rows_s.at[0]), (l_in, rows_s.at[1])):
            plgpu.copy_gmem_to_smem(src.at[at], dst, bar)
            plgpu.barrier_wait(bar)
        return (self.load(o32_s, plgpu.Layout.WGMMA), self.load(rows_s.at[0], self.row_layout),
                self.load(rows_s.at[1], self.row_layout))

    # -- the epilogue ----------------------------------------------------------------

    def epilogue(self, it: _Item, o_ref, lse_ref, out, lse, l=None, si=None,
                 chained=False):
        """Epilogue and lse: the output in the input dtype through the Q tile's SMEM (Q
        is no longer needed) and the lse in natural-log units, each stored by TMA; with
        ``split_out``, the split's fp32 partial state and its base-2 lse (split ``si``;
        None: the CTA's), staged ``state_cols`` columns at a time. ``chained``: one of
        a CTA's several splits (``splits_per_cta``): the staging tiles are awaited
        before they are written (the previous split's stores read them long before)
        and the stores are not awaited here (the caller awaits them after the last)."""
        rows = pl.ds(it.q0, self.bm)
        if self.raw_out:  # (acc, m, l): lse_ref is m's output, self.dyn["l_out"] l's
            o32_s, rows_s = it.smem[7], it.smem[8]
            o32_s[...] = out
            rows_s.at[0][...] = lse
            rows_s.at[1][...] = l
            plgpu.commit_smem()
            at = (it.bi, it.h, lax.axis_index("s"), rows)
            plgpu.copy_smem_to_gmem(o32_s, o_ref.at[at])
            plgpu.copy_smem_to_gmem(rows_s.at[0], lse_ref.at[at])
            plgpu.copy_smem_to_gmem(rows_s.at[1], self.dyn["l_out"].at[at])
        elif self.split_out:
            o32_s, lse_s, cols = it.smem[7], it.lse_s, self.state_cols
            o_rows, src = rows, o32_s
            if self.state_rows is not None:  # the tile's first rows of out only (the
                # lse row stays whole: a TMA copy moves a multiple of 128 bytes)
                o_rows = pl.ds(0, self.state_rows)
                src = o32_s.at[o_rows]
            for c in range(0, self.d, cols):
                if c or chained:  # the staging tiles read by the previous store
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                o32_s[...] = out if cols == self.d else out[:, c:c + cols]
                if c == 0:
                    lse_s[...] = lse
                plgpu.commit_smem()
                si = lax.axis_index("s") if si is None else si
                dst = o_ref.at[it.bi, it.h, si, o_rows]
                plgpu.copy_smem_to_gmem(src, dst if cols == self.d
                                        else dst.at[:, pl.ds(c, cols)])
                if c == 0:
                    plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[it.bi, it.h, si, rows])
        elif self.state_out and self.finish_rows:  # finished rows, then the state's
            f = self.finish_rows
            done = it.q0 < f
            so_ref, sl_ref = self.dyn["state_out"]
            pl.when(done)(lambda: self.store_output(it, o_ref, lse_ref, out, lse, rows))
            pl.when(jnp.logical_not(done))(lambda: self.store_state(
                it, so_ref, sl_ref, out, lse, pl.ds(it.q0 - f, self.bm)))
        elif self.state_out:
            self.store_state(it, o_ref, lse_ref, out, lse, rows)
        else:
            self.store_output(it, o_ref, lse_ref, out, lse, rows)
        if not (chained or self.defer_wait):
            wait_stores(self.cfg.store_wait)

    def store_state(self, it: _Item, o_ref, lse_ref, out, lse, rows):
        """The folded state, fp32, the lse in the kernels' base (``state_out``)."""
        o32_s = it.smem[9].at[it.w]
        o32_s[...] = out
        it.lse_s[...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o32_s, o_ref.at[it.bi, it.h, rows])
        plgpu.copy_smem_to_gmem(it.lse_s, lse_ref.at[it.bi, it.h, rows])

    def store_output(self, it: _Item, o_ref, lse_ref, out, lse, rows):
        """The output in the input dtype through the Q tile's SMEM (None: already
        there) and the natural-log lse (``rows_out``: the group's rows through the
        untiled Q slot)."""
        if self.rows_out:
            st, r = it.smem[10].at[it.w], self.q_rows
            st[...] = out.astype(self.dtype)
            it.lse_s[...] = natural_lse(lse)
            plgpu.commit_smem()
            at = (it.bi, pl.ds(it.h * r, r))
            plgpu.copy_smem_to_gmem(st.at[pl.ds(0, r)], o_ref.at[at])
            plgpu.copy_smem_to_gmem(it.lse_s.at[pl.ds(0, r)], lse_ref.at[at])
            return
        if self.defer_wait:  # the last item's stores have read the lse row
            wait_stores(self.cfg.store_wait)
        if out is not None:  # (None: already in the Q tile's SMEM, gmem_state)
            it.q_s[...] = out.astype(self.dtype)
        it.lse_s[...] = natural_lse(lse)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(it.q_s, tile_of(o_ref, it.bi, it.h, rows, self.q_btnh))
        plgpu.copy_smem_to_gmem(it.lse_s, lse_ref.at[it.bi, it.h, rows])

    # -- warp specialisation and the launch ------------------------------------------

    def kernel(self, q_ref, k_ref, v_ref, *rest):
        """The CTA: ``compute_wgs`` consumer warpgroups and one producer warpgroup over
        the CTA's items (:meth:`items_of_cta`), sharing the ring's SMEM and barriers;
        with ``inline_loads`` the one compute warpgroup alone, issuing its own loads."""
        cfg, nwg, stages, bm = self.cfg, self.nwg, self.stages, self.bm
        ones_ref = None
        if self.use_mma_rowsum:
            ones_ref, *rest = rest
        if self.raw_out:
            *rest, o_ref, lse_ref, self.dyn["l_out"] = rest
        elif self.finish_rows:
            *rest, o_ref, lse_ref, so_ref, sl_ref = rest
            self.dyn["state_out"] = (so_ref, sl_ref)
        elif self.gmem_state:
            *rest, o_ref, lse_ref, self.dyn["gstate"] = rest
        else:
            *rest, o_ref, lse_ref = rest
        if self.carry_in:
            *rest, acc_in, m_in, l_in = rest
            self.dyn["carry"] = (acc_in, m_in, l_in)
        if self.greedy:
            *rest, self.dyn["sched"] = rest
        if self.state_in:
            *rest, o_in, l_in = rest
            self.dyn["state"] = (o_in, l_in)
        if self.page_size is not None:
            *rest, self.dyn["table"], self.dyn["lens"] = rest
            self.num_pages = k_ref.shape[0]
        if self.dyn_offsets and not self.offs_from_lens:
            *rest, self.dyn["offs"] = rest
        keep_ref, flags_ref = rest if self.key_mask else (None, None)
        self.dyn["kv"] = (k_ref, v_ref, keep_ref)  # (inline_loads: the consumer's loads)
        count, item_at = self.items_of_cta()
        scratch_refs = self.scratch((2,) if cfg.prefetch_q else ())
        barriers = (
            # K / V slot loaded (by ``copies`` TMA copies: a paged block of small pages)
            plgpu.Barrier(num_arrivals=self.copies, num_barriers=stages),
            plgpu.Barrier(num_arrivals=self.copies, num_barriers=stages),
            *self.consumed_barriers(nwg),  # K / V slot consumed
            # Q tile loaded, per compute warpgroup (and Q buffer)
            plgpu.Barrier(num_barriers=nwg * (2 if cfg.prefetch_q else 1)),
            plgpu.Barrier(num_barriers=1),  # ones tile loaded
            # the ping-pong's: a rendezvous of two, or the ring's turn a warpgroup
            (plgpu.Barrier(num_arrivals=1, num_barriers=nwg) if self.ring else
             plgpu.Barrier(num_arrivals=2, num_barriers=1) if self.pingpong else None),
            plgpu.Barrier(num_barriers=stages) if self.key_mask else None,  # keep loaded
            plgpu.Barrier(num_barriers=1) if self.carry_in else None,  # carry loaded
            # state_in: per compute warpgroup, its state's output and lse loaded
            plgpu.Barrier(num_barriers=2 * nwg) if self.state_in else None,
        )

        def body(smem, bars):
            wg = lax.axis_index("wg")
            if self.ring_union or self.q_alias or self.rows_in_ring:
                # the union's refs at their places
                smem = list(smem)
                groups = list(smem[1])
                smem[1], smem[2] = groups.pop(0)
                if self.ring_union:
                    smem[7], smem[5] = groups.pop(0)
                if self.rows_in_ring:
                    smem[5], = groups.pop(0)
                if self.q_alias:
                    _, smem[10] = groups.pop(0)
                    if not self.split_out:
                        smem[5], = groups.pop(0)

            @pl.when(wg < nwg)
            def _():
                if self.set_regs:
                    plgpu.set_max_registers(self.regs[0], action="increase")
                if self.ring:  # the first turn is warpgroup 0's
                    pl.when(wg == nwg - 1)(
                        lambda: plgpu.barrier_arrive(bars[6].at[0]))
                if self.use_mma_rowsum:
                    if self.inline_loads:
                        plgpu.copy_gmem_to_smem(ones_ref, smem[4], bars[5].at[0])
                    plgpu.barrier_wait(bars[5].at[0])

                def issue_q(tile0, h, bi, buf):
                    plgpu.copy_gmem_to_smem(
                        tile_of(q_ref, bi, h, pl.ds(self.q_row0 + tile0 + wg * bm, bm),
                                self.q_btnh),
                        smem[0].at[buf, wg],
                        bars[4].at[buf * nwg + wg])

                def one(k, base):
                    tile0, h, bi, kvh, hi_cta = item_at(k)
                    qbuf = after_q = None
                    if cfg.prefetch_q:
                        qbuf = lax.rem(k, jnp.int32(2))

                        @pl.when(k == 0)
                        def _():
                            issue_q(tile0, h, bi, 0)

                        def after_q():
                            # The other buffer held item k - 1's output, whose store
                            # was awaited at that item's end (defer_wait: here).
                            @pl.when(k + 1 < count)
                            def _():
                                if self.defer_wait:
                                    wait_stores(cfg.store_wait)
                                t1, h1, b1, _, _ = item_at(k + 1)
                                issue_q(t1, h1, b1, 1 - qbuf)

                    with jax.named_scope("item"):
                        self.consumer(wg, q_ref, o_ref, lse_ref, smem, bars, tile0, h, bi,
                                      hi_cta, base, flags_ref, qbuf, after_q, kvh)
                    return base + hi_cta

                lax.fori_loop(0, count, one, -self.split_lo())
                if self.defer_wait:  # the last item's stores
                    wait_stores(cfg.store_wait)
                if self.ring:  # the last turn, passed back to warpgroup 0, taken
                    pl.when(wg == 0)(lambda: plgpu.barrier_wait(bars[6].at[0]))

            if self.inline_loads:  # no producer warpgroup
                return

            @pl.when(wg == nwg)
            def _():
                if self.set_regs:
                    plgpu.set_max_registers(self.regs[1], action="decrease")
                if self.use_mma_rowsum:
                    plgpu.copy_gmem_to_smem(ones_ref, smem[4], bars[5].at[0])

                def one(k, base):
                    _, _, bi, kvh, hi_cta = item_at(k)
                    with jax.named_scope("produce"):
                        self.producer(k_ref, v_ref, smem, bars, kvh, bi, hi_cta, base,
                                      keep_ref)
                    return base + hi_cta

                self.drain(bars, lax.fori_loop(0, count, one, -self.split_lo()))

        pl.run_scoped(body, scratch_refs, barriers, collective_axes="wg")

    def consumed_barriers(self, arrivals: int) -> tuple:
        """The K and V rings' "slot consumed" barriers, ``arrivals`` compute warpgroups'
        releases each; with ``kv_multicast``, cluster barriers (a slot's multicast
        refill waits for both CTAs' releases)."""
        if self.multicast:
            return tuple(plgpu.ClusterBarrier(collective_axes=("hc",), num_arrivals=arrivals,
                                              num_barriers=self.stages) for _ in range(2))
        return tuple(plgpu.Barrier(num_arrivals=arrivals, num_barriers=self.stages)
                     for _ in range(2))

    def cluster(self, grid_names) -> dict:
        """``plgpu.kernel``'s cluster arguments: with ``kv_multicast``, clusters of two
        CTAs along the heads' grid axis ("hc"), else none."""
        if not self.multicast:
            return {}
        names = {"h": "hc", "q": "qc", "b": "bc"}
        return {"cluster": tuple(2 if n == "h" else 1 for n in grid_names),
                "cluster_names": tuple(names[n] for n in grid_names)}

    def threads(self) -> int:
        """The CTA's warpgroups: the compute warpgroups and the producer (none with
        ``inline_loads``: ``ctas_per_sm=2``)."""
        return self.nwg + (0 if self.inline_loads else 1)

    def call(self):
        """``call(q, k, v, *extra)``: the ``plgpu.kernel`` over the grid, its constant
        inputs bound: the row sum's all-ones operand where ``rowsum="mma"`` (only there:
        an unused constant input still costs a launch per call, as XLA materialises a
        splat constant with a broadcast kernel) and a persistent grid's greedy table,
        its last input."""
        cfg, b, hq, d, sq = self.cfg, self.b, self.hq, self.d, self.sq
        heads = hq // 2 if self.multicast else hq  # (kv_multicast: clusters of two)
        grid = ((cfg.persistent,) if cfg.persistent else
                (self.n_tiles, heads, b) if cfg.q_order == "ascending"
                else (heads, self.n_tiles, b))
        grid_names = (("cta",) if cfg.persistent else
                      ("q", "h", "b") if cfg.q_order == "ascending" else ("h", "q", "b"))
        if self.split_out:
            n = self.n_splits_all
            r = sq if self.state_rows is None else self.state_rows
            out_type = (jax.ShapeDtypeStruct((b, hq, n, r, d), jnp.float32),
                        jax.ShapeDtypeStruct((b, hq, n, sq), jnp.float32))
            if self.raw_out:
                out_type = (*out_type, jax.ShapeDtypeStruct((b, hq, n, sq), jnp.float32))
            grid, grid_names = (-(-n // self.per_cta), *grid), ("s", *grid_names)
        elif self.finish_rows:  # (out, lse) of the finished rows, then the state's
            f = self.finish_rows
            out_type = (jax.ShapeDtypeStruct((b, hq, f, d), self.dtype),
                        jax.ShapeDtypeStruct((b, hq, f), jnp.float32),
                        jax.ShapeDtypeStruct((b, hq, sq - f, d), jnp.float32),
                        jax.ShapeDtypeStruct((b, hq, sq - f), jnp.float32))
        elif self.rows_out:  # the groups' rows in place: [B, Hkv * q_rows, ...]
            out_type = (jax.ShapeDtypeStruct((b, hq * self.q_rows, d), self.dtype),
                        jax.ShapeDtypeStruct((b, hq * self.q_rows), jnp.float32))
        else:
            # (sq_rows: the output at Sq rows, the lse at the tiles': a tile's lse rows
            # are one contiguous run, which Mosaic stores as a plain bulk copy clipped at
            # the array's end only, so rows past Sq would land on the next head's.)
            rows = self.sq_rows
            out_type = (jax.ShapeDtypeStruct((b, rows, hq, d) if self.q_btnh
                                             else (b, hq, rows, d),
                                             jnp.float32 if self.state_out else self.dtype),
                        jax.ShapeDtypeStruct((b, hq, sq), jnp.float32))
        if self.gmem_state:  # the running states' scratch (the call drops it): a slot
            # of the CTA's rows per SM (interpret: per CTA, as its CTAs may run at once)
            slots = math.prod(grid) if self.interpret is not None else GMEM_STATE_SLOTS
            out_type = (*out_type, jax.ShapeDtypeStruct((slots, self.nwg * self.bm, d),
                                                        jnp.float32))
        self.grid, self.grid_names = grid, grid_names  # (state_slot)
        call = launch(
            self.kernel,
            pdl=cfg.split_launch_pdl if self.split_out else cfg.pdl,
            out_type=out_type,
            grid=grid,
            grid_names=grid_names,
            **self.cluster(grid_names),
            num_threads=self.threads(),
            thread_name="wg",
            compiler_params=plgpu.CompilerParams(
                approx_math=cfg.approx_math,
                lowering_semantics=getattr(plgpu.LoweringSemantics,
                                           cfg.semantics.capitalize()),
                **(NO_REDUCTION_SCRATCH if self.inline_loads or self.smem_state
                   or self.states_tight else {}),
                **(_PROFILE if self.interpret is None else {})),
            interpret=self.interpret,
        )
        # Constants of the program (numpy arrays).
        ones = ((np.ones((self.bn, self.ones_cols), self.dtype),) if self.use_mma_rowsum
                else ())
        # (every warpgroup's blocks counted, padded ones too: dealt by live warpgroups
        # only, B=8 S=4096 causal D=64 ran 0.94x; notes "twenty-ninth stop")
        table = ((persistent_schedule(np.repeat(self.tile_blocks, hq), b, cfg.persistent),)
                 if self.greedy else ())

        def bound(q, k, v, *extra):
            res = call(q, k, v, *ones, *extra, *table)
            return res[:-1] if self.gmem_state else res

        return bound


class _PvSplitForward(_Forward):
    """``MosaicConfig.pv_split``: one 64-row query tile a CTA, two compute warpgroups
    with two roles, a producer warpgroup as :class:`_Forward`'s. Warpgroup 0 (the
    softmax's) loads Q and, per key block, computes S = Q K^T, the online-softmax step
    (``m``, ``l``: :meth:`softmax_at`) and P, and hands P and the rows' rescale factor
    ``alpha`` over in a two-slot SMEM ring; warpgroup 1 (P V's) scales its accumulator
    by ``alpha`` and adds P V (:meth:`block_step`'s two accumulation orders). The
    running state is held in column halves, the first by warpgroup 0, the second by
    warpgroup 1: at a SPLIT's end warpgroup 0 hands over the SPLIT's ``m`` and ``l``,
    warpgroup 1 its accumulator's first half (fp32 SMEM tiles), and each finalises its
    half and merges it into its half of the state (the merge's FMA pinned as
    ``smem_state``'s, :func:`merge_apply`; the rows' lse computed alike by both).
    Both stage their half of the output in Q's SMEM and warpgroup 0 stores it and the
    lse as :meth:`store_output`. Every element's operations are those of
    :class:`_Forward`'s step, SPLIT and fold: the same bits. Built from a
    one-compute-warpgroup plan (``compute_wgs=1``); not for decode rows, states,
    pages, a key mask, the persistent grid or ``inline_loads``."""

    def __init__(self, **kw):
        self.half = kw["d"] // 2  # (scratch() reads it in the plan)
        super().__init__(**kw)
        if (self.position is not None or self.split_out or self.state_in
                or self.state_out or self.page_size is not None or self.key_mask
                or self.cfg.persistent or self.inline_loads or self.nwg != 1
                or self.q_rows is not None or self.use_mma_rowsum
                or self.cfg.late_rowsum or self.smem_state):
            raise ValueError(
                "pv_split is a prefill's launch on a grid of one CTA per 64-row tile "
                "(compute_wgs=1, rowsum='reduce32' without late_rowsum, no smem_state): "
                "not for decode rows, split or CP states, pages, a key mask or the "
                "persistent grid")
        if self.d % 128:
            raise ValueError(f"pv_split hands the accumulator over in column halves of "
                             f"a multiple of 64: D={self.d}")
        self.set_regs = self.cfg.registers is not None and self.interpret is None

    def threads(self) -> int:
        return 3  # the softmax's, P V's, the producer

    def scratch(self, qbufs: tuple) -> list:
        """:class:`_Forward`'s buffers of one compute warpgroup, then the P ring (two
        ``[bm, bn]`` tiles in the inputs' dtype, a wgmma A operand), the ``alpha``
        rows of its two slots, the fp32 tile of the accumulator's first column half
        and the SPLIT's ``m`` and ``l`` rows."""
        bm, bn, isz = self.bm, self.bn, self.itemsize
        return [*super().scratch(qbufs),
                plgpu.SMEM((2, bm, bn), self.dtype, transforms=_smem_transforms(bn, isz)),
                plgpu.SMEM((2, bm), jnp.float32),
                plgpu.SMEM((bm, self.half), jnp.float32,
                           transforms=_smem_transforms(self.half, 4)),
                plgpu.SMEM((2, bm), jnp.float32)]

    def item_of(self, w, smem, bars, tile0, h, bi, kvh):
        """The item's view (:class:`_Item`) for either warpgroup: the tile's rows and
        the key blocks it visits, as :meth:`consumer` computes them."""
        it = _Item(w=w, q_s=smem[0].at[0], q_b=bars[4].at[0], lse_s=smem[5].at[0],
                   p_s=None, smem=smem, bars=bars, q0=tile0, h=h, bi=bi,
                   base=jnp.int32(0), flags_ref=None, kvh=kvh)
        it.offset, it.position = self.offset_of(bi), None
        self.visit(it, it.q0, it.q0)
        return it

    # -- warpgroup 0: S, the softmax, the fold ----------------------------------------

    def hand_p(self, it: _Item, t, p, alpha):
        """Block ``t``'s P and ``alpha`` into the P ring's slot ``t % 2`` (once warpgroup
        1 has read its block ``t - 2``), for warpgroup 1."""
        p_ring, a_ring = it.smem[11], it.smem[12]
        p_full, p_free = it.bars[10], it.bars[11]
        ps = lax.rem(t, jnp.int32(2))

        @pl.when(t >= 2)
        def _():
            plgpu.barrier_wait(p_free.at[ps])

        p_ring.at[ps][...] = p
        a_ring.at[ps][...] = alpha
        plgpu.commit_smem()
        plgpu.barrier_arrive(p_full.at[ps])

    def softmax_step(self, it: _Item, lo, t, carry, *, masked):
        """Block ``t`` of the SPLIT from block ``lo``: S issued (K's slot released once
        read), then the block before's P handed over (:meth:`hand_p`, from block
        ``lo + 1`` on) while S runs, so that its P V queues behind this S on the
        tensor cores and this block's softmax runs beside that P V; the softmax
        step, then the next block's K awaited. ``carry``: ``(m, l, p, alpha)``, the
        last two the block before's, for the next step (or the SPLIT's end) to hand."""
        m, l, p_prev, alpha_prev = carry
        slot = self.slot_of(it, t)
        s = self.scores(it, slot, issued=lambda: pl.when(t > lo)(
            lambda: self.hand_p(it, t - 1, p_prev, alpha_prev)))
        self.release(it, it.hi, None, slot, "k")
        p, alpha, m, l = self.softmax_at(it, t, s, m, l, masked, None)

        @pl.when(t + 1 < it.hi)
        def _():
            plgpu.barrier_wait(it.bars[0].at[self.slot_of(it, t + 1)])

        return m, l, p, alpha

    def merge_half(self, st, lse_s, acc, m, l):
        """A SPLIT's accumulator column half finalised with its ``m`` and ``l`` and
        merged into the running state's half ``st`` (lse ``lse_s``): the merged half
        and lse (:meth:`fold_in_smem`'s operations on each element)."""
        o_p, lse_p = kernel_finalize(acc, m, l, self.cfg.normalize)
        weights = kernel_merge_weights(lse_s, lse_p, (self.bm, self.half))
        return merge_apply(st, lse_s, o_p, lse_p, weights, pin_fma=True)

    def stage_half(self, it: _Item, w, st):
        """Warpgroup ``w``'s half of the output, cast, into its columns of Q's SMEM."""
        it.q_s.at[:, pl.ds(w * self.half, self.half)][...] = st.astype(self.dtype)

    def softmax_wg(self, it: _Item, q_ref, o_ref, lse_ref):
        """Warpgroup 0's item: Q, each SPLIT's softmax steps, its ``m`` and ``l``
        handed over and the accumulator's first half merged into its half of the
        state, the epilogue (once warpgroup 1 has staged its half)."""
        bm = self.bm
        p_free, ml_full, ml_free, dump_full, dump_free, done = it.bars[11:17]
        dump, ml_s = it.smem[13], it.smem[14]
        plgpu.copy_gmem_to_smem(
            tile_of(q_ref, it.bi, it.h, pl.ds(self.q_row0 + it.q0, bm), self.q_btnh),
            it.q_s, it.q_b)
        plgpu.barrier_wait(it.q_b)
        it.tile_indices = None if self.cfg.masks_in_loop else self.indices()

        @pl.when(it.hi > 0)
        def _():
            plgpu.barrier_wait(it.bars[0].at[self.slot_of(it, 0)])

        def one(si, carry):
            st, lse_s = carry
            lo, mid, end = self.split_bounds(it, si)
            init = (self.rows_init(NEG_INF), self.rows_init(0.0),
                    self.layout(jnp.zeros((bm, self.bn), self.dtype), plgpu.Layout.WGMMA),
                    self.rows_init(0.0))
            step = functools.partial(self.softmax_step, it, lo)
            carry = lax.fori_loop(lo, mid, functools.partial(step, masked=False), init)
            m, l, p, alpha = lax.fori_loop(mid, end, functools.partial(step, masked=True),
                                           carry)
            pl.when(end > lo)(lambda: self.hand_p(it, end - 1, p, alpha))  # the last
            pl.when(si > 0)(lambda: plgpu.barrier_wait(ml_free.at[0]))
            ml_s.at[0][...] = m
            ml_s.at[1][...] = l
            plgpu.commit_smem()
            plgpu.barrier_arrive(ml_full.at[0])
            plgpu.barrier_wait(dump_full.at[0])
            acc = self.load(dump, plgpu.Layout.WGMMA)
            plgpu.barrier_arrive(dump_free.at[0])
            return self.merge_half(st, lse_s, acc, m, l)

        n_splits = self.n_splits(it)
        st, lse = lax.fori_loop(0, n_splits, one, (self.tile_zeros(self.half),
                                                   self.rows_init(NEG_INF)))
        for t in (it.hi - 2, it.hi - 1):  # the P ring's last releases, observed
            pl.when(t >= 0)(lambda t=t: plgpu.barrier_wait(
                p_free.at[lax.rem(t, jnp.int32(2))]))
        pl.when(n_splits > 0)(lambda: plgpu.barrier_wait(ml_free.at[0]))
        self.stage_half(it, 0, st)
        it.lse_s[...] = natural_lse(lse)
        plgpu.commit_smem()
        plgpu.barrier_wait(done.at[0])  # warpgroup 1's half staged
        rows = pl.ds(it.q0, bm)
        plgpu.copy_smem_to_gmem(it.q_s, tile_of(o_ref, it.bi, it.h, rows, self.q_btnh))
        plgpu.copy_smem_to_gmem(it.lse_s, lse_ref.at[it.bi, it.h, rows])
        wait_stores(self.cfg.store_wait)

    # -- warpgroup 1: P V --------------------------------------------------------------

    def pv_step(self, it: _Item, t, acc):
        """Block ``t``: P and ``alpha`` from the P ring, ``acc * alpha`` plus P V (in
        place or fresh, as :meth:`block_step`); the P slot and V's slot released."""
        p_ring, a_ring = it.smem[11], it.smem[12]
        p_full, p_free = it.bars[10], it.bars[11]
        slot, ps = self.slot_of(it, t), lax.rem(t, jnp.int32(2))
        plgpu.barrier_wait(p_full.at[ps])
        alpha = self.load(a_ring.at[ps], self.row_layout)
        acc = acc * _rows(alpha, acc.shape)
        plgpu.barrier_wait(it.bars[1].at[slot])
        v_parts, p_op = self.kv_slot(it.smem[2], slot), p_ring.at[ps]
        if self.inplace:
            def pv_into(acc_ref):
                self.pv_parts(acc_ref, p_op, v_parts)

            acc = pl.run_state(pv_into)(plgpu.ACC.init(acc))
        else:
            def pv(acc_ref):
                self.pv_parts(acc_ref, p_op, v_parts)
                return acc_ref[...]

            acc = acc + pl.run_scoped(pv, plgpu.ACC((self.bm, self.d), jnp.float32))
        plgpu.barrier_arrive(p_free.at[ps])
        self.release(it, it.hi, None, slot, "v")
        return acc

    def pv_wg(self, it: _Item):
        """Warpgroup 1's item: each SPLIT's P V from the zero accumulator, its first
        half handed over and its second merged into its half of the state with the
        SPLIT's ``m`` and ``l``, then its half of the output staged in Q's SMEM."""
        half = self.half
        ml_full, ml_free, dump_full, dump_free, done = it.bars[12:17]
        dump, ml_s = it.smem[13], it.smem[14]

        def one(si, carry):
            st, lse_s = carry
            lo, _, end = self.split_bounds(it, si)
            acc = lax.fori_loop(lo, end, functools.partial(self.pv_step, it),
                                self.tile_zeros(self.d))
            pl.when(si > 0)(lambda: plgpu.barrier_wait(dump_free.at[0]))
            dump[...] = acc[:, :half]
            plgpu.commit_smem()
            plgpu.barrier_arrive(dump_full.at[0])
            plgpu.barrier_wait(ml_full.at[0])
            m = self.load(ml_s.at[0], self.row_layout)
            l = self.load(ml_s.at[1], self.row_layout)
            plgpu.barrier_arrive(ml_free.at[0])
            return self.merge_half(st, lse_s, acc[:, half:], m, l)

        n_splits = self.n_splits(it)
        st, _ = lax.fori_loop(0, n_splits, one, (self.tile_zeros(half),
                                                 self.rows_init(NEG_INF)))
        pl.when(n_splits > 0)(lambda: plgpu.barrier_wait(dump_free.at[0]))
        # Q's copy has landed (a tile that sees no key passes no P, which would have
        # ordered it after warpgroup 0's last S) before its SMEM takes the output
        plgpu.barrier_wait(it.q_b)
        self.stage_half(it, 1, st)
        plgpu.commit_smem()
        plgpu.barrier_arrive(done.at[0])

    # -- the CTA -----------------------------------------------------------------------

    def kernel(self, q_ref, k_ref, v_ref, *rest):
        """Warpgroup 0 (the softmax's), 1 (P V's) and 2 (the producer) over the CTA's
        one item, sharing the ring's SMEM and barriers."""
        cfg, stages = self.cfg, self.stages
        if self.dyn_offsets:
            *rest, self.dyn["offs"] = rest
        o_ref, lse_ref = rest
        _, item_at = self.items_of_cta()
        barriers = (
            plgpu.Barrier(num_arrivals=self.copies, num_barriers=stages),  # K loaded
            plgpu.Barrier(num_arrivals=self.copies, num_barriers=stages),  # V loaded
            # K slot read (warpgroup 0), V slot read (warpgroup 1)
            *self.consumed_barriers(1),
            plgpu.Barrier(num_barriers=1),  # Q loaded
            None, None, None, None, None,
            plgpu.Barrier(num_barriers=2),  # P slot written
            plgpu.Barrier(num_barriers=2),  # P slot read
            plgpu.Barrier(num_barriers=1),  # the SPLIT's m and l written
            plgpu.Barrier(num_barriers=1),  # m and l read
            plgpu.Barrier(num_barriers=1),  # the accumulator's first half written
            plgpu.Barrier(num_barriers=1),  # the half read
            plgpu.Barrier(num_barriers=1),  # warpgroup 1's output half staged
        )

        def body(smem, bars):
            wg = lax.axis_index("wg")
            tile0, h, bi, kvh, hi_cta = item_at(0)

            @pl.when(wg < 2)
            def _():
                if self.set_regs:
                    plgpu.set_max_registers(cfg.registers[0], action="increase")

            @pl.when(wg == 0)
            def _():
                self.softmax_wg(self.item_of(0, smem, bars, tile0, h, bi, kvh),
                                q_ref, o_ref, lse_ref)

            @pl.when(wg == 1)
            def _():
                self.pv_wg(self.item_of(1, smem, bars, tile0, h, bi, kvh))

            @pl.when(wg == 2)
            def _():
                if self.set_regs:
                    plgpu.set_max_registers(cfg.registers[1], action="decrease")
                self.producer(k_ref, v_ref, smem, bars, kvh, bi, hi_cta, jnp.int32(0))
                self.drain(bars, hi_cta)

        pl.run_scoped(body, self.scratch(()), barriers, collective_axes="wg")


#: ``MosaicConfig(persistent=None)`` runs a persistent grid when no tile has more key
#: blocks than this (4096 keys). On the H200 (run of 2026-12-01, 5dc95b6, Hq=32 Hkv=8 D=128 bf16)
#: the persistent grid with the Q prefetch against one CTA per tile: causal B=16 S=1024
#: +11%, B=2 S=4096 +4-6%, B=8 S=4096 +2%, non-causal B=2 S=4096 +5%; causal S=8192 -2%,
#: S=16384 and S=32768 -2 to -3%, non-causal S=16384 -2% (the items' prologues and
#: epilogues overlap; the blocks run slower).
PERSISTENT_MAX_BLOCKS = 64
#: The most SMEM a CTA's buffers may take (:func:`smem_bytes`): an sm90 CTA's 227 KiB
#: less what the Mosaic GPU lowering adds for barriers and its own use (2256 to 2320
#: bytes at 6 to 8 ring slots of the split decode, JAX 0.10.2).
SMEM_LIMIT = 227 * 1024 - 2560
#: Compiler parameters of a kernel that reserves no SMEM for cross-warp reductions
#: (Pallas reserves ``reduction_scratch_bytes``, 2 KiB, for any kernel with a
#: reduction; the forward's are the rows of the WGMMA layout, within a warp, and take
#: none), where this JAX's ``CompilerParams`` has the field.
NO_REDUCTION_SCRATCH = ({"reduction_scratch_bytes": 0} if "reduction_scratch_bytes" in
                        {f.name for f in dataclasses.fields(plgpu.CompilerParams)} else {})
#: The buffers' SMEM of a ``MosaicConfig.smem_state`` kernel, which reserves no
#: reduction scratch (:data:`NO_REDUCTION_SCRATCH`, where this JAX can drop it): 227 KiB
#: less 512 bytes for the barriers. D=256 with one compute warpgroup takes 224 KiB,
#: 225 KiB with a key mask (a non-causal call with a partial last block): over
#: :data:`SMEM_LIMIT` by 512 bytes (the H200, 2026-12-05).
SMEM_LIMIT_STATE = 227 * 1024 - 512 - (0 if NO_REDUCTION_SCRATCH else 2048)
#: The buffers' SMEM (:func:`smem_bytes`) of a CTA of which two share an SM
#: (``MosaicConfig.ctas_per_sm``): an H100's or H200's SM has 228 KiB, of which
#: the runtime keeps 1 KiB a CTA; 512 bytes for the barriers, and the reduction
#: scratch where it cannot be dropped (:data:`NO_REDUCTION_SCRATCH`).
SMEM_LIMIT_TWO_CTAS = 113 * 1024 - 512 - (0 if NO_REDUCTION_SCRATCH else 2048)


#: ``MosaicConfig.gmem_state`` applies on the GPU where its buffers' SMEM exceeds this:
#: then no second CTA fits on the SM (228 KiB, of which the runtime keeps 1 KiB a CTA),
#: so the SM's slot of the scratch (:func:`sm_id`) is the CTA's alone.
GMEM_STATE_MIN_SMEM = 113 * 1024


def split_decode_stages(cfg: MosaicConfig) -> int:
    """The split decode kernel's ring slots where D <= 128 (``cfg.split_decode_stages``;
    None: 4 with one CTA an SM, 2 with two)."""
    if cfg.split_decode_stages is not None:
        return cfg.split_decode_stages
    return 2 if cfg.ctas_per_sm == 2 else 4


def splits_per_cta(cfg: MosaicConfig, ctas: int, n_splits: int) -> int:
    """SPLITs a CTA of the split decode takes (``cfg.splits_per_cta``, at most
    ``n_splits``), for ``ctas`` (batch, KV head) rows of ``n_splits`` splits. None: as
    many as fill the GPU's CTA slots (:func:`sm_count` x ``ctas_per_sm``) once, each
    row's splits shared evenly among as many CTAs as the slots give a row (B=8 Hkv=8,
    8192 keys: 2 a CTA, 256 CTAs; 131072 keys: 32 a CTA)."""
    k = cfg.splits_per_cta
    if k is None:
        per_row = max(1, sm_count() * cfg.ctas_per_sm // max(1, ctas))
        k = -(-n_splits // per_row)
    return max(1, min(k, n_splits))


def smem_bytes(scratch) -> int:
    """The SMEM of a kernel's buffers (``plgpu.SMEM`` or ``RefUnion`` specs, None
    skipped) as Mosaic GPU lays them out: each starts 1 KiB-aligned."""
    return sum(-(-math.prod(x.shape) * jnp.dtype(x.dtype).itemsize // 1024) * 1024
               for x in scratch if x is not None)


#: The SM count assumed when JAX's device does not say (an H100 / H200 has 132).
DEFAULT_SM_COUNT = 132


def auto_persistent(max_tile_blocks: int, d: int, *, gpu: bool, decode: bool,
                    split_out: bool) -> bool:
    """``MosaicConfig(persistent=None)``'s choice: a persistent grid where no tile has
    more than :data:`PERSISTENT_MAX_BLOCKS` key blocks, at the head dims it was measured
    at (D <= 128: at D = 256 the H200 has not run it), compiled for the GPU (not in
    interpret mode), and not for decode or split states (their own launches)."""
    return (gpu and not decode and not split_out and d <= 128
            and max_tile_blocks <= PERSISTENT_MAX_BLOCKS)


def auto_late_rowsum(rowsum: str, *, persistent: bool, decode: bool,
                     split_out: bool) -> bool:
    """``MosaicConfig(late_rowsum=None)``'s choice: the row sum after P V's issue for a
    prefill's ``reduce32`` row sum on a grid of one CTA per tile, where the H200 measured
    it faster (3 to 6% at D=128 S >= 8192); not on the persistent grid (12 to 20% slower
    there), nor for decode rows or split states (not measured). A launch choice: the
    same bits either way."""
    return rowsum == "reduce32" and not persistent and not decode and not split_out


def smem_state_applies(*, decode: bool, persistent: bool, states: bool) -> bool:
    """Where ``MosaicConfig.smem_state`` applies: a prefill (not decode rows) on a grid
    of one CTA per tile, whose output is the folded state itself (``states``: split
    or CP states in or out, a carried or raw state, finished rows: the registers'
    path)."""
    return not (decode or persistent or states)


def pv_split_applies(*, decode: bool, persistent: bool, states: bool, key_mask: bool,
                     d: int, rowsum: str = "reduce32") -> bool:
    """Where ``MosaicConfig.pv_split`` applies: :func:`smem_state_applies`' domain
    without a key mask, at a D whose accumulator halves are whole 64-column tiles,
    with ``rowsum="reduce32"`` (the arithmetic choice it computes; "mma" keeps the
    plan it had)."""
    return (smem_state_applies(decode=decode, persistent=persistent, states=states)
            and not key_mask and d % 128 == 0 and rowsum == "reduce32")


def auto_smem_state(d: int, skv: int, *, gpu: bool) -> bool:
    """``MosaicConfig(smem_state=None)``'s choice for a prefill on a grid of one CTA
    per tile (the caller's conditions), with ``skv`` keys (padded to whole blocks):
    the SMEM state with one compute warpgroup at D=256 compiled for the GPU where the
    keys span more than one SPLIT (the registers' state spills from the second
    SPLIT's merge on; with one SPLIT there is no merge and two warpgroups are 1.4x
    faster). Not at D <= 128 (no spill; the state does not fit beside two
    warpgroups' buffers) nor in interpret mode. A launch choice: the same bits."""
    return gpu and d == 256 and -(-skv // schedule.BLOCK_N) > schedule.BLOCKS_PER_SPLIT


def auto_gmem_state(cfg: MosaicConfig, d: int, skv: int, *, gpu: bool) -> bool:
    """``MosaicConfig(gmem_state=None)``'s choice for a prefill on a grid of one CTA
    per tile (the caller's conditions): the state in the per-SM global scratch with
    two compute warpgroups where :func:`auto_smem_state` would take the SMEM state with
    one (D=256 on the GPU, keys past one SPLIT), unless the config chose that state
    (``smem_state`` not None) or another warpgroup count (``compute_wgs`` not 2). On
    the H100 (2026-12-06, with the K/V multicast) 1.03 to 1.12x the SMEM state causal,
    1.00 to 1.09x non-causal (S 2048 to 16384). A launch choice: the same bits."""
    return (cfg.smem_state is None and cfg.compute_wgs in (None, 2)
            and auto_smem_state(d, skv, gpu=gpu))


def auto_compute_wgs(cfg: MosaicConfig, d: int, skv: int, *, gpu: bool,
                     states: bool, causal: bool, b: int, hq: int,
                     sq: int | None = None, offset: int | None = None) -> int:
    """``MosaicConfig(compute_wgs=None)``'s choice for a plain prefill (not decode rows,
    split or CP states, a carried or raw state: ``states``), with ``skv`` keys padded to
    whole blocks: three compute warpgroups at D=64 on the GPU where the grid is one CTA
    a tile (``persistent=0``, or None where a tile's blocks can pass
    :data:`PERSISTENT_MAX_BLOCKS`: :func:`auto_persistent`'s other side) or the call is
    not causal, and for a causal call on the persistent grid where
    :func:`c3_causal_pays` (``b`` sequences of ``hq`` heads and ``sq`` queries, default
    ``skv``, at the static ``offset``, default ``skv - sq``); else two. On the H100
    (2026-12-06, notes "eighteenth stop") three were
    1.00 to 1.06x two at S=8192 and 32768, causal and not; at D=128 0.48 to 0.85x
    (their registers spill). On the persistent grid (S <= 4096; H100, 2026-12-07, notes
    "twenty-fifth stop") three were 1.09 to 1.11x two non-causal at S=2048 and 4096 and
    1.01 to 1.03x at S=1024, but 0.75 to 0.84x causal, where the constant slots
    (``static_slots``) cost them: without those, 1.02 to 1.04x causal and 0.96 to
    0.99x non-causal (with them the causal kernel spills 740 bytes, in its masked
    loop; without, 16: this machine's ptxas): so causal calls run three on dynamic
    slots (:func:`auto_static_slots`) where they pay. A launch choice: the same bits
    (``test_three_warpgroups_keep_bits_on_gpu``)."""
    if cfg.compute_wgs is not None:
        return cfg.compute_wgs
    if not gpu or d != 64 or states:
        return 2
    # (the last tile's blocks reach Skv's: the most any tile has)
    if not (causal and _prefill_persistent(cfg, d, skv, gpu=gpu)):
        return 3
    return 3 if c3_causal_pays(cfg, skv, b=b, hq=hq, sq=sq, offset=offset) else 2


#: Three compute warpgroups' speed over two's per unit of work (query rows times key
#: blocks of the persistent grid's most loaded CTA), causal D=64 on dynamic slots:
#: :func:`c3_causal_pays`' threshold (H100, 2026-12-07, notes "twenty-seventh stop").
C3_CAUSAL_GAIN = 1.08
#: The same where three warpgroups skip padded ones (padded warpgroups counted free):
#: three with it won at ratios 1.020 to 1.097 (S=512 to 2048 and 3072, B * S = 32k)
#: and lost at 1.028 (S=2560, 2%) and 1.016 (S=4096, 1 to 5%): no threshold orders
#: these (H100, 2026-12-07, notes "twenty-ninth stop"); the skip's loss lies past
#: :data:`C3_CAUSAL_SKIP_MAX_BLOCKS`, where the default does not skip.
C3_CAUSAL_GAIN_SKIP = 1.10
#: The most key blocks of a causal call whose padded warpgroups of three the default
#: skips (:func:`auto_skip_padding_rows`): in every measured row (H100, 2026-12-07,
#: notes "twenty-ninth stop" and "thirty-second stop", bits equal) three with the skip
#: ran 1.02 to 1.22x the default of two at S=512 to 2048 (B * S = 32k) and 0.98x two
#: at 2560, 0.92 to 0.94x three without it at 4096.
C3_CAUSAL_SKIP_MAX_BLOCKS = 32


def c3_causal_pays(cfg: MosaicConfig, skv: int, *, b: int, hq: int,
                   sq: int | None = None, offset: int | None = None) -> bool:
    """Whether a causal prefill on the persistent grid (``b`` sequences of ``hq`` heads,
    ``sq`` queries, default ``skv``, row i seeing key j iff ``j <= i + offset``, default
    ``skv - sq``) is expected faster on three compute warpgroups than on two: the most
    loaded CTA's work (:func:`persistent_span` of each launch's tiles, times the tile's
    rows) on three is under :data:`C3_CAUSAL_GAIN` times that on two. A 192-row tile
    pads the queries to a multiple of 192 and walks three diagonal blocks where a
    128-row tile walks two, and the items deal onto the CTAs differently: the work of
    three over two ranges from 1.02 (S=3072, B * S = 32k) to 1.24 (S=1024).
    Where the kernel of ``nwg`` warpgroups skips padded ones
    (:func:`auto_skip_padding_rows`: ``cfg.skip_padding_rows=True``, or by default
    three over at most :data:`C3_CAUSAL_SKIP_MAX_BLOCKS` key blocks) a warpgroup
    whose rows are all padding counts as free: a tile's blocks count for its live
    warpgroups' share (the item's overhead in full), against
    :data:`C3_CAUSAL_GAIN_SKIP` where three skip (that series: 1.016 to 1.097, three
    at each point; B=1: two at 1280 keys and under, 1.16 and more)."""
    sq = skv if sq is None else sq
    offset = skv - sq if offset is None else offset
    n_cta = cfg.persistent or sm_count()
    total = -(-skv // schedule.BLOCK_N)
    work, skips = {}, {}
    for nwg in (2, 3):
        skips[nwg] = skip = auto_skip_padding_rows(cfg.skip_padding_rows, causal=True,
                                                   nwg=nwg, blocks=total)
        rows = cfg.block_m * nwg
        lead, sq_pad, _ = padding(sq, skv, True, rows, offset)
        n_tiles = sq_pad // rows
        blocks = prefill_tile_blocks(n_tiles, rows, offset - lead, total,
                                     causal=True, q_order=cfg.q_order)
        if skip:  # in warpgroup-blocks: the overhead nwg times
            live = live_warpgroups(n_tiles, rows, cfg.block_m, lead + sq,
                                   q_order=cfg.q_order)
            span = persistent_span(np.repeat(blocks * live, hq), b, n_cta,
                                   overhead=ITEM_OVERHEAD_BLOCKS * nwg)
            work[nwg] = span * cfg.block_m
        else:
            work[nwg] = persistent_span(np.repeat(blocks, hq), b, n_cta) * rows
    gain = C3_CAUSAL_GAIN_SKIP if skips[3] else C3_CAUSAL_GAIN
    return work[3] < gain * work[2]


def live_warpgroups(n_tiles: int, rows: int, block_m: int, live_rows: int, *,
                    q_order: str) -> np.ndarray:
    """Each of ``n_tiles`` query tiles' (``rows`` rows, in launch order as
    :func:`prefill_tile_blocks`) compute warpgroups of ``block_m`` rows holding any of
    the first ``live_rows`` rows: the ones ``MosaicConfig.skip_padding_rows`` runs."""
    tiles = launch_tiles(n_tiles, q_order)
    return np.clip(-(-(live_rows - tiles * rows) // block_m), 0, rows // block_m)


def _prefill_persistent(cfg: MosaicConfig, d: int, skv: int, *, gpu: bool) -> bool:
    """Whether a plain prefill of ``skv`` keys (whole blocks) runs the persistent grid."""
    return bool(cfg.persistent if cfg.persistent is not None else auto_persistent(
        -(-skv // schedule.BLOCK_N), d, gpu=gpu, decode=False, split_out=False))


def auto_skip_padding_rows(skip_padding_rows: bool | None, *, causal: bool,
                           nwg: int | None = None, blocks: int | None = None) -> bool:
    """``MosaicConfig(skip_padding_rows=None)``'s choice (not None: that) for a kernel
    of ``nwg`` compute warpgroups over ``blocks`` key blocks: for a non-causal prefill,
    where the H100 measured 1.05 to 1.11x at D=64 (2026-12-07, S=512 to 2560, notes
    "twenty-ninth stop"), and for a causal one of three warpgroups over at most
    :data:`C3_CAUSAL_SKIP_MAX_BLOCKS` blocks: there three with it ran 1.02 to 1.22x
    the default of two at S=512 to 2048 (notes "twenty-ninth stop" and "thirty-second
    stop"), but 0.98x two at 2560 and 0.93 to 0.94x themselves without it at B=8
    S=4096; two causal warpgroups were not measured with it. The loss's cause is not
    yet found: not the early launch of the next kernel (0.93x with ``pdl="off"`` too)
    nor the clock (the skip's kernel ran unthrottled at 1980 MHz, the one without it
    at the power cap), and the kernel built with the on-device profiler does not show
    it (equal cycles; notes "thirty-second stop"), nor the main loop's form (with
    ``opaque_bounds`` still 0.95x; "thirty-third stop"). A launch choice: the same bits
    (``test_skip_padding_rows_keep_bits_on_gpu``)."""
    if skip_padding_rows is not None:
        return skip_padding_rows
    if not causal:
        return True
    return nwg == 3 and blocks is not None and blocks <= C3_CAUSAL_SKIP_MAX_BLOCKS


#: :func:`auto_opaque_bounds` puts the item's bounds behind the barrier past this many
#: key blocks (S > 1024): the H100's rows (2026-12-08, trees ``f71c1ce`` and ``6ee3de9``,
#: three calls, one process each, bits equal) gained at 24, 32, 40, 48 and 64 blocks
#: and lost at 8 and 16.
OPAQUE_BOUNDS_ABOVE_BLOCKS = 16


def auto_opaque_bounds(opaque_bounds: bool | None, d: int, *, gpu: bool, causal: bool,
                       persistent: bool, blocks: int) -> bool:
    """``MosaicConfig(opaque_bounds=None)``'s choice (not None: that) for a kernel over
    ``blocks`` key blocks: on the GPU for a D=64 causal prefill on the persistent grid
    past :data:`OPAQUE_BOUNDS_ABOVE_BLOCKS` blocks. Past 16 blocks ptxas gives three
    warpgroups' main loop the longer of its two forms where the bounds are plain (294
    instructions against 289; notes "thirty-second stop") and the barrier the
    shorter. The H100 measured, against the same launch without it (one process a
    call, three calls, 2026-12-08), 1.07x at B=21 S=1536 and 1.05x at B=16 S=2048
    (three warpgroups with ``skip_padding_rows``), 1.01 to 1.04x at B=12 S=2560 (two)
    and B=10 S=3072, 1.00 to 1.02x at B=8 S=4096 (three); and 0.93x at B=64 S=512 and
    0.93 to 0.96x at B=32 S=1024, where the loop's form is already the short one (285:
    the barrier makes it 289). Not measured elsewhere (non-causal, D=128 and 256, one
    CTA a tile: there it changes the code too, notes "thirty-second stop"). A launch
    choice: the same bits (``test_opaque_bounds_keep_bits_on_gpu``)."""
    if opaque_bounds is not None:
        return opaque_bounds
    return (gpu and d == 64 and causal and persistent
            and blocks > OPAQUE_BOUNDS_ABOVE_BLOCKS)


def auto_static_slots(static_slots: bool | None, d: int, *, gpu: bool, nwg: int,
                      causal: bool, persistent: bool) -> bool:
    """``MosaicConfig(static_slots=None)``'s choice (``static_slots`` not None: that),
    for a kernel of ``nwg`` compute warpgroups: on the GPU at D=64 (the H100 measured
    1.02 to 1.06x, 2026-12-06; the interpreter keeps the dynamic slots, fewer programs
    to compile), but not for three compute warpgroups on a causal prefill on the
    persistent grid. With constant slots those items ran 0.75 to 0.84x two warpgroups
    (H100, 2026-12-07, notes "twenty-fifth stop"; one copy of the loop, the retired
    ``peel_slot``, 0.85 to 0.90x); on dynamic slots 1.02 to 1.10x at S=4096 and 1.09
    to 1.14x at S=3072 (B=2 to 10), 0.99 to 1.02x at S=2048 (notes "twenty-sixth
    stop", calls 2 to 4; one run of B=2 S=4096 0.98x). Not at D=128 or 256 (0.89 to
    0.91x: spills). A launch choice: the same bits
    (``test_static_slots_keep_bits_on_gpu``, ``test_three_warpgroups_keep_bits_on_gpu``)."""
    if static_slots is not None:
        return static_slots
    return gpu and d == 64 and not (nwg == 3 and causal and persistent)


def state_plan(cfg: MosaicConfig, d: int, *, gpu: bool) -> MosaicConfig:
    """The launch plan of a kernel that loads or stores a folded state (``state_in``
    / ``state_out``: CP's key ranges, a window's unfinished rows): at D > 128 on the
    GPU one compute warpgroup, whose fp32 state (64 KiB at D=256) fits beside its Q
    tile and the ring (two warpgroups' states, 128 KiB, beside their Q tiles and one
    ring slot do not: the H100's D=256 matrix, 2026-12-06). A launch choice: the same
    bits."""
    if gpu and d > 128 and cfg.compute_wgs != 1:
        return dataclasses.replace(cfg, compute_wgs=1)
    return cfg


def auto_kv_multicast(d: int, *, state_in_memory: bool) -> bool:
    """``MosaicConfig(kv_multicast=None)``'s choice for a prefill on a grid of one CTA
    per tile (the caller's conditions): the K/V multicast where the prefill folds its
    state out of registers (``state_in_memory``) at D > 128: ``smem_state``'s SMEM
    state, one compute warpgroup on a 64-row tile, where the H100 measured it 1.00 to
    1.12x (2026-12-06), or ``gmem_state``'s scratch with two, 1.01 to 1.14x beside
    ``gmem_state`` alone (S=2048 to 16384); not with two compute warpgroups holding the
    state in registers (one SPLIT at D=256: 0.95 to 1.03x) nor at D <= 128 (0.87 to
    1.10x, 0.93 to 0.99x at D=64). A launch choice: the same bits."""
    return state_in_memory and d > 128


def sm_count() -> int:
    """The default device's streaming multiprocessors (:data:`DEFAULT_SM_COUNT` when it is
    not a GPU that says: lowering for CUDA on a CPU machine)."""
    dev = jax.devices()[0]
    n = getattr(dev, "core_count", None) if dev.platform == "gpu" else None
    return int(n) if n else DEFAULT_SM_COUNT


#: Blocks' worth of time an item costs beyond its key blocks (load Q, fill the
#: pipeline, store O), in :func:`persistent_schedule`'s estimate.
ITEM_OVERHEAD_BLOCKS = 2


def launch_tiles(n_tiles: int, q_order: str) -> np.ndarray:
    """The query tiles' indices in the order a prefill launches them
    (``MosaicConfig.q_order``)."""
    tiles = np.arange(n_tiles, dtype=np.int64)
    return tiles[::-1] if q_order == "descending" else tiles


def prefill_tile_blocks(n_tiles: int, rows: int, offset: int, total: int, *,
                        causal: bool, q_order: str) -> np.ndarray:
    """The key blocks ``[0, n)`` each of ``n_tiles`` query tiles of ``rows`` rows
    visits, of ``total``, in launch order (``MosaicConfig.q_order``): :func:`_visited_blocks`
    on the host, causal with the kernel's static ``offset`` (row i sees key j iff ``j <=
    i + offset``), else every block."""
    tiles = launch_tiles(n_tiles, q_order)
    if not causal:
        return np.full(tiles.shape, total, np.int64)
    bn = schedule.BLOCK_N
    return np.minimum(np.maximum(tiles * rows + (rows - 1) + offset + bn, 0) // bn, total)


def _greedy(blocks_per_tile_head, batch: int, n_cta: int,
            overhead: int = ITEM_OVERHEAD_BLOCKS):
    """:func:`persistent_schedule`'s deal: ``(per_cta, ends)``, each CTA's items in
    order and the time (key blocks plus ``overhead`` an item) its last one ends."""
    cost = np.tile(np.asarray(blocks_per_tile_head, np.int64), batch) + overhead
    heap = [(0, c) for c in range(n_cta)]  # (busy until, cta): already a heap
    per_cta = [[] for _ in range(n_cta)]
    for t, w in enumerate(cost):
        end, c = heapq.heappop(heap)
        per_cta[c].append(t)
        heapq.heappush(heap, (end + int(w), c))
    ends = np.zeros(n_cta, np.int64)
    for end, c in heap:
        ends[c] = end
    return per_cta, ends


def persistent_span(blocks_per_tile_head, batch: int, n_cta: int, *,
                    overhead: int = ITEM_OVERHEAD_BLOCKS) -> int:
    """The persistent grid's estimated length: the key blocks (plus ``overhead``,
    :data:`ITEM_OVERHEAD_BLOCKS`, an item) of the CTA whose items end last in
    :func:`persistent_schedule`'s table."""
    return int(_greedy(blocks_per_tile_head, batch, n_cta, overhead)[1].max(initial=0))


def persistent_schedule(blocks_per_tile_head, batch: int, n_cta: int) -> np.ndarray:
    """The persistent grid's table, int32 ``[n_cta, 1 + most]``: row c is
    ``[count, item, item, ...]`` (padded with -1), the items of CTA c in the order it
    runs them. Items ``t`` are numbered as a plain grid launches them (here: the
    ``blocks_per_tile_head`` entries, one per (tile, head) with the head fastest, then
    the batch) and each goes to the CTA whose items so far end first (ties: the lowest
    CTA), costing its key blocks plus :data:`ITEM_OVERHEAD_BLOCKS`."""
    per_cta, _ = _greedy(blocks_per_tile_head, batch, n_cta)
    most = max(len(x) for x in per_cta)
    table = np.full((n_cta, 1 + most), -1, np.int32)
    for c, items in enumerate(per_cta):
        table[c, 0] = len(items)
        table[c, 1:1 + len(items)] = items
    return table


def _prepare(q, k, v, *, causal, scale, interpret, config, key_padding_mask=None,
             causal_offsets=None, partials=False, btnh=False, carry=None, raw=False,
             pages=None, state=None, state_out=False):
    """``(call, args, unpad)``: the kernel, its padded inputs, and the function that
    takes the kernel's ``(out, lse)`` back to ``[B, Hq, Sq, ...]``.

    A GQA group's queries that fit one 64-row warpgroup tile (``group * Sq <= 64``:
    decode, speculative verification, short chunks): the group's heads' queries are
    stacked as the rows of one tile per (batch, KV head), so K and V are read once per
    group (``_build``'s ``position`` and ``stack_sq``; row r is query ``r % Sq`` of head
    ``r // Sq``). Otherwise the rows are padded as :func:`padding` says.
    ``key_padding_mask`` ([B, Skv] bool, True = keep) becomes the kernel's keep values
    (padding keys dropped) and per-block flags.

    ``causal_offsets`` ([B] int, causal only; default ``Skv - Sq`` for every sequence; a
    Python int: that offset for every sequence, the kernel's static one where no row
    sees past a partial last key block):
    row i of sequence b sees key j iff ``j <= i + causal_offsets[b]`` (a paged cache's
    ``seq_lens - Sq``). Each sequence's rows are placed at its own lead
    (``offset mod BLOCK_N``, in ``BLOCK_N - 1 + Sq`` rows rounded up to the CTA's), so
    its tiles sit where :func:`padding` puts them for that offset: the rows' bits are
    those of a call whose static offset is the sequence's. A partial last key block is
    then dropped by a key mask (a row could see past Skv).

    ``partials``: the kernel writes each SPLIT's partial state instead of folding them
    (one compute warpgroup of 64 rows: launch choices never change a row's bits), and
    ``unpad`` returns ``(out [n_splits, B, Hq, Sq, D], lse [n_splits, B, Hq, Sq])`` fp32.

    ``btnh``: q, k, v and out are ``[B, S, H, D]`` (JAX's layout), read and written in
    place by the kernel's TMA boxes (the lse stays ``[B, Hq, Sq]``); decode stacks the
    group's rows as above (a free reshape of ``[B, 1, Hq, D]``).

    With ``partials`` only: ``carry`` (the running state ``(acc [n_splits, B, Hq, Sq,
    D], m, l [n_splits, B, Hq, Sq])`` of each split's earlier keys, as ``raw`` gives it)
    is placed in the kernel's rows (padding rows empty: ``(0, -inf, 0)``) for the
    kernel to fold on from; ``raw``: the kernel writes the running state and ``unpad``
    takes ``(acc, m, l)`` back to that form.

    ``pages``: ``(block_table [B, max_pages] int, seq_lens [B] int, layout)``; ``k, v``
    are then a paged cache's pages (``layout`` "HND": ``[num_pages, Hkv, page_size,
    D]``, "NHD": ``[num_pages, page_size, Hkv, D]``), read in place by the kernel
    (``_build``'s ``page_size``), causal with offsets ``seq_lens - Sq``: the rows of
    each sequence's contiguous call.

    ``state``: a folded state ``(out [B, Hq, Sq, D], lse [B, Hq, Sq])`` fp32 (the lse in
    the kernels' base) that the kernel folds its splits on from (``_build``'s
    ``state_in``); ``state_out``: the kernel writes the folded state in that form and
    ``unpad`` returns it (``_build``'s ``state_out``). One query row is then not stacked
    (launch choices never change a row's bits)."""
    cfg = config or MosaicConfig()
    if state is not None or state_out:
        if partials or btnh or pages is not None:
            raise ValueError("a folded state is served with [B, Hq, Sq, D] contiguous K/V, "
                             "without partial states")
        cfg = state_plan(dataclasses.replace(cfg, stack_decode=False), q.shape[-1],
                         gpu=resolve_interpret(interpret) is None)
    if (carry is not None or raw) and not partials:
        raise ValueError("carry and raw are partial states' options")
    if btnh and partials:
        raise ValueError("partials are [B, Hq, ...] states: btnh is not served there")
    sa = 1 if btnh else 2  # the sequence axis
    bn = schedule.BLOCK_N
    if partials:
        cfg = dataclasses.replace(cfg, compute_wgs=1, block_m=bn, persistent=0,
                                  prefetch_q=False)
    page_size = kv_btnh = None
    if pages is not None:
        if not causal or btnh or partials or key_padding_mask is not None:
            raise ValueError("paged K/V is served causal, [B, Hq, Sq, D], without partial "
                             "states or a key padding mask")
        table, lens, layout = pages
        kv_btnh = layout == "NHD"
        _, hkv_p, page_size, _ = page_dims(k, layout)  # (the kernel reads num_pages)
        # Whole key blocks of logical pages. Entries past a sequence's pages are never
        # used for a visible key: the kernel clamps each entry it reads (and its index,
        # past the row) to a real page, so the table is passed as it is.
        table = jnp.asarray(table, jnp.int32)
        lens = jnp.asarray(lens, jnp.int32)
        skv_pages = -(-(table.shape[1] * page_size) // bn) * bn
        shape = (q.shape[0], hkv_p, skv_pages, q.shape[3])
        check_inputs(q, *(jax.ShapeDtypeStruct(shape, x.dtype) for x in (k, v)))
        if k.shape != v.shape:
            raise ValueError(f"k and v pages must have one shape, got {k.shape}, {v.shape}")
        causal_offsets = lens - q.shape[2]
    else:
        check_inputs(*((as_bhsd(x) for x in (q, k, v)) if btnh else (q, k, v)))
        kv_btnh = btnh
    static_offset = None
    if causal and isinstance(causal_offsets, (int, np.integer)):
        # One offset for every sequence, known when tracing: the static kernel, unless a
        # row would see past a partial last key block (there the dynamic path's dropped
        # padding keys decide the bits).
        sk, qn = k.shape[sa], q.shape[sa]
        if pages is None and (sk % bn == 0 or int(causal_offsets) + qn <= sk):
            static_offset = int(causal_offsets)
            causal_offsets = None
            if static_offset != sk - qn:  # the stacked decode's row sits at Skv - 1
                cfg = dataclasses.replace(cfg, stack_decode=False)
        else:
            causal_offsets = jnp.full((q.shape[0],), int(causal_offsets), jnp.int32)
    dyn = causal and causal_offsets is not None
    if dyn:
        causal_offsets = jnp.asarray(causal_offsets)
        if causal_offsets.shape != (q.shape[0],) or not jnp.issubdtype(
                causal_offsets.dtype, jnp.integer):
            raise ValueError(f"causal_offsets must be int [B] = [{q.shape[0]}], got "
                             f"{causal_offsets.dtype} {causal_offsets.shape}")
        causal_offsets = causal_offsets.astype(jnp.int32)
    if key_padding_mask is not None:
        if key_padding_mask.shape != (k.shape[0], k.shape[sa]):
            raise ValueError(f"key_padding_mask must be [B, Skv] = "
                             f"{(k.shape[0], k.shape[sa])}, got {key_padding_mask.shape}")
        if key_padding_mask.dtype != jnp.bool_:
            raise TypeError(f"key_padding_mask must be bool, got {key_padding_mask.dtype}")
    # A non-causal call with a partial last block: its padding keys are dropped by a
    # key mask (the kernel has no bound at Skv), so the kernel is the one a caller's
    # padding with dropped keys gets (the same code on every block; on the H200 a
    # kernel bounding the keys at Skv gave rows that differed from it in the last
    # bits, and ran 3 to 9% slower: docs/mosaic.md, retired options).
    synth = pages is None and (not causal or dyn) and k.shape[sa] % bn != 0
    if synth and key_padding_mask is None:
        key_padding_mask = jnp.ones((k.shape[0], k.shape[sa]), jnp.bool_)
    key_mask = key_padding_mask is not None  # the kernel zeroes V's dropped keys in SMEM
    interpret = resolve_interpret(interpret)
    gpu_operands = cfg.gpu_operands if cfg.gpu_operands is not None else interpret is None
    if btnh:
        b, sq, hq, d = q.shape
        _, skv, hkv, _ = k.shape
    elif pages is not None:
        b, hq, sq, d = q.shape
        hkv, skv = hkv_p, skv_pages
    else:
        b, hq, sq, d = q.shape
        _, hkv, skv, _ = k.shape
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    skv_pad = -(-skv // bn) * bn
    skv_kernel = skv_pad if synth else skv  # the keys the kernel bounds itself
    stacked = group * sq  # the rows of a (batch, KV head) tile when stacked
    # MosaicConfig.kv_boxes: K and V read in place in boxes instead of a copy padded
    # to whole blocks.
    kv_boxes = (cfg.kv_boxes and pages is None and skv_pad != skv
                and gpu_operands and interpret is None and cfg.semantics == "lane"
                and TransformedRef is not None)
    if stacked <= bn and cfg.stack_decode and (sq == 1 or not (partials or raw
                                                               or carry is not None)):
        # Launch parameters never change a row's bits: one warpgroup of 64 rows here.
        cfg = dataclasses.replace(cfg, compute_wgs=1, block_m=bn)
        want = (b * hkv < SPLIT_DECODE_BELOW_CTAS if cfg.split_decode is None
                else cfg.split_decode)
        split = partials or (want and not cfg.persistent
                             and -(-skv_kernel // bn) > schedule.BLOCKS_PER_SPLIT)
        if split and not partials and d <= 128:
            cfg = dataclasses.replace(cfg, stages=split_decode_stages(cfg))
        per_cta = (splits_per_cta(cfg, b * hkv, schedule.num_splits(skv_kernel))
                   if split and not partials else 1)
        # The split decode writes only the group's rows of each split's state (rounded
        # up to a power of two from 8: the fold kernel's fold_layout then gives each
        # thread one row); CP's partial states keep the whole tile (their unpad reads
        # 64 rows).
        state_rows = (max(8, 1 << (stacked - 1).bit_length()) if split and not partials
                      else None)
        # MosaicConfig.flat_out: the group's rows, cast, stored in place (a multiple of
        # 4 rows: a 16-byte lse copy), by the fold (split) or by the kernel (unsplit).
        flat_out = cfg.flat_out and not partials and stacked % 4 == 0
        final = ((stacked, q.dtype) if flat_out and split and not (btnh and sq > 1)
                 else None)
        # MosaicConfig.flat_q: the group's rows read from [B, Hq * Sq, D] in place.
        q_rows = stacked if (cfg.flat_q and stacked < bn and not partials
                             and not cfg.persistent) else None
        rows_out = flat_out and q_rows is not None and not split
        call = _build(b=b, hq=hkv, hkv=hkv, sq=bn, skv=skv_kernel, offset=0,
                      d=d, dtype=q.dtype, causal=causal, scale=scale, cfg=cfg,
                      gpu_operands=gpu_operands, interpret=interpret,
                      position=skv - sq, key_mask=key_mask, dyn_offsets=dyn,
                      split_out=split, kv_btnh=kv_btnh,
                      carry_in=carry is not None, raw_out=raw,
                      state_rows=state_rows, page_size=page_size, stack_sq=sq,
                      q_rows=q_rows, rows_out=rows_out,
                      kv_boxes=kv_boxes, per_cta=per_cta)
        # Row r of a (batch, KV head) tile is query r % Sq of the group's head r // Sq:
        # [B, Hq, Sq, D] is [B, Hkv, group * Sq, D] in memory ([B, 1, Hq, D] too; [B,
        # Sq, Hq, D] with Sq > 1 is transposed, a decode-sized copy).
        if btnh and sq > 1:
            q = jnp.transpose(q.reshape(b, sq, hkv, group, d), (0, 2, 3, 1, 4))
        if q_rows is not None:  # the free reshape; past the last group, TMA's zeros
            # (padded for the interpreter, which refuses out-of-bounds reads)
            q = q.reshape(b, hkv * stacked, d)
            if interpret is not None:
                q = jnp.pad(q, ((0, 0), (0, bn - stacked), (0, 0)))
        else:
            q = jnp.pad(q.reshape(b, hkv, stacked, d),
                        ((0, 0), (0, 0), (0, bn - stacked), (0, 0)))
        # Query 0's position (a row's: r % Sq more); paged, the kernel takes it from the
        # lengths (_Forward.offs_from_lens).
        offs = causal_offsets if pages is None else None
        out_dtype = q.dtype

        def place(x, fill):  # [n, B, Hq, 1, ...] -> [B, Hkv, n, 64, ...]
            x = x.reshape(x.shape[0], b, hkv, group, *x.shape[4:])
            x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, bn - group))
                        + ((0, 0),) * (x.ndim - 4), constant_values=fill)
            return jnp.moveaxis(x, 0, 2)

        def unpad(out, lse):
            if partials:  # [B, Hkv, n_splits, 64, ...] -> [n_splits, B, Hq, 1, ...]
                n = out.shape[2]
                return (jnp.moveaxis(out[:, :, :, :group], 2, 0).reshape(n, b, hq, 1, d),
                        jnp.moveaxis(lse[:, :, :, :group], 2, 0).reshape(n, b, hq, 1))
            if split:  # [B, Hkv, n_splits, R, ...]: fold the splits in key order
                n, r = out.shape[2], out.shape[3]
                out, lse = fold_tiles(out.reshape(b * hkv, n, r, d),
                                      lse.reshape(b * hkv, n, bn), interpret=interpret,
                                      config=cfg, final=final)
                if final is not None:  # the fold stored [B, Hq, Sq, ...] itself
                    return ((out.reshape(b, sq, hq, d) if btnh
                             else out.reshape(b, hq, sq, d)), lse.reshape(b, hq, sq))
                out = out.reshape(b, hkv, r, d).astype(out_dtype)
                lse = lse.reshape(b, hkv, r)
            elif rows_out:  # [B, Hkv * stacked, ...]: the group's rows, stored in place
                out, lse = out.reshape(b, hkv, stacked, d), lse.reshape(b, hkv, stacked)
            out = out[:, :, :stacked].reshape(b, hkv, group, sq, d)
            out = (jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, sq, hq, d) if btnh
                   else out.reshape(b, hq, sq, d))
            return out, lse[:, :, :stacked].reshape(b, hq, sq)
    elif dyn:
        rows = cfg.rows
        sq_pad = -(-(bn - 1 + sq) // rows) * rows
        lead = causal_offsets % bn  # [B], floor mod: 0..63
        offs = causal_offsets - lead  # multiples of BLOCK_N
        call = _build(b=b, hq=hq, hkv=hkv, sq=sq_pad, skv=skv_kernel, offset=0,
                      d=d, dtype=q.dtype, causal=causal, scale=scale, cfg=cfg,
                      gpu_operands=gpu_operands, interpret=interpret,
                      key_mask=key_mask, dyn_offsets=True, split_out=partials,
                      q_btnh=btnh, kv_btnh=kv_btnh, carry_in=carry is not None,
                      raw_out=raw, page_size=page_size,
                      state_in=state is not None, state_out=state_out,
                      kv_boxes=kv_boxes)
        q = jax.vmap(lambda x, at: lax.dynamic_update_slice(
            jnp.zeros((sq_pad, hq, d) if btnh else (hq, sq_pad, d), x.dtype), x,
            (at, 0, 0) if btnh else (0, at, 0)))(q, lead)

        def place(x, fill):  # [n, B, Hq, Sq, ...] -> [B, Hq, n, sq_pad, ...] at lead
            x = jnp.moveaxis(x, 0, 2)
            return jax.vmap(lambda y, at: lax.dynamic_update_slice(
                jnp.full((*y.shape[:2], sq_pad, *y.shape[3:]), fill, y.dtype), y,
                (0, 0, at) + (0,) * (y.ndim - 3)))(x, lead)

        def unpad(out, lse):
            if partials:  # [B, Hq, n_splits, rows, ...] -> [n_splits, B, Hq, Sq, ...]
                n = out.shape[2]
                return (jnp.moveaxis(jax.vmap(lambda x, at: lax.dynamic_slice(
                            x, (0, 0, at, 0), (hq, n, sq, d)))(out, lead), 2, 0),
                        jnp.moveaxis(jax.vmap(lambda x, at: lax.dynamic_slice(
                            x, (0, 0, at), (hq, n, sq)))(lse, lead), 2, 0))
            return (jax.vmap(lambda x, at: lax.dynamic_slice(
                        x, (at, 0, 0) if btnh else (0, at, 0),
                        (sq, hq, d) if btnh else (hq, sq, d)))(out, lead),
                    jax.vmap(lambda x, at: lax.dynamic_slice(x, (0, at), (hq, sq)))(
                        lse, lead))
    else:
        # a kernel of states (split or CP states in or out, a carried or raw state),
        # not a plain prefill's output
        states = (partials or raw or carry is not None or state is not None
                  or state_out)
        cfg = dataclasses.replace(cfg, compute_wgs=auto_compute_wgs(
            cfg, d, skv_kernel, gpu=interpret is None, states=states, causal=causal,
            b=b, hq=hq, sq=sq, offset=static_offset))
        folds = smem_state_applies(  # (the folded state's prefill: one CTA a tile)
            decode=False, persistent=bool(cfg.persistent), states=states)
        if cfg.gmem_state is None:
            cfg = dataclasses.replace(cfg, gmem_state=folds and auto_gmem_state(
                cfg, d, skv_kernel, gpu=interpret is None))
        smem_state = False if cfg.gmem_state else cfg.smem_state  # (gmem replaces it)
        if smem_state is None:
            smem_state = folds and auto_smem_state(d, skv_kernel, gpu=interpret is None)
            cfg = dataclasses.replace(cfg, smem_state=smem_state,
                                      compute_wgs=1 if smem_state else cfg.compute_wgs)
        if cfg.kv_multicast is None:  # (by the state's choice, before pv_split's)
            cfg = dataclasses.replace(cfg, kv_multicast=auto_kv_multicast(
                d, state_in_memory=bool(smem_state) or (folds and cfg.gmem_state)))
        # MosaicConfig.pv_split: where it applies, one 64-row tile a CTA on two
        # warpgroups of two roles (built from the one-warpgroup plan)
        pv = bool(cfg.pv_split) and cfg.block_m == 64 and pv_split_applies(
            decode=False, persistent=bool(cfg.persistent), key_mask=key_mask,
            states=states, d=d, rowsum=cfg.rowsum)
        cfg = dataclasses.replace(cfg, pv_split=pv, **(
            dict(compute_wgs=1, smem_state=False, gmem_state=False, late_rowsum=False,
                 persistent=0)
            if pv else {}))
        lead, sq_pad, skv_pad = padding(sq, skv, causal, cfg.rows, static_offset)
        offset = skv - sq if static_offset is None else static_offset
        # MosaicConfig.q_boxes: rows padded only at the end, read and written in place
        # (Sq on the 8-row grid of Q's tiled SMEM: Mosaic GPU's TMA transform refuses a
        # GMEM dimension off its tiling)
        q_boxes = (cfg.q_boxes and interpret is None and lead == 0 and sq_pad != sq
                   and sq % 8 == 0 and not states)
        call = _build(b=b, hq=hq, hkv=hkv, sq=sq_pad, skv=skv_kernel,
                      offset=offset - lead, d=d, dtype=q.dtype, causal=causal,
                      scale=scale, cfg=cfg, gpu_operands=gpu_operands,
                      interpret=interpret, key_mask=key_mask, split_out=partials,
                      q_btnh=btnh, kv_btnh=btnh, carry_in=carry is not None,
                      raw_out=raw, state_in=state is not None,
                      state_out=state_out, kv_boxes=kv_boxes,
                      sq_rows=sq if q_boxes else None,
                      live_rows=None if states else lead + sq)
        if (lead, sq_pad) != (0, sq) and not q_boxes:
            q = jnp.pad(q, _along(sa, (lead, sq_pad - sq - lead)))

        def place(x, fill):  # [n, B, Hq, Sq, ...] -> [B, Hq, n, sq_pad, ...] at lead
            x = jnp.moveaxis(x, 0, 2)
            return jnp.pad(x, ((0, 0),) * 3 + ((lead, sq_pad - sq - lead),)
                           + ((0, 0),) * (x.ndim - 4), constant_values=fill)

        def unpad(out, lse):
            if partials:  # [B, Hq, n_splits, rows, ...] -> [n_splits, B, Hq, Sq, ...]
                return (jnp.moveaxis(out[:, :, :, lead:lead + sq], 2, 0),
                        jnp.moveaxis(lse[:, :, :, lead:lead + sq], 2, 0))
            if (lead, sq_pad) == (0, sq):
                return out, lse
            if q_boxes:  # out at sq rows already; the lse at the tiles' rows (_build)
                return out, lse[:, :, :sq]
            return (lax.slice_in_dim(out, lead, lead + sq, axis=sa),
                    lse[:, :, lead:lead + sq])
    if skv_pad != skv and not kv_boxes:
        k, v = (jnp.pad(x, _along(sa, (0, skv_pad - skv))) for x in (k, v))
    # Off the GPU operand path K is read as K^T [B, Hkv, D, Skv] (an XLA transpose; of
    # the pages: [num_pages, Hkv, D, page_size]).
    k_in = (k if gpu_operands else jnp.transpose(k, (0, 2, 3, 1)) if kv_btnh
            else jnp.swapaxes(k, 2, 3))
    extra = ()
    if key_mask:
        keep = jnp.pad(key_padding_mask, ((0, 0), (0, skv_pad - skv)))
        flags = (~keep).reshape(b, skv_pad // bn, bn).any(axis=2).astype(jnp.int32)
        extra = (keep.astype(jnp.float32), flags)
    if dyn and offs is not None:
        extra = (*extra, offs)
    if pages is not None:
        extra = (*extra, table, lens)
    if state is not None:
        extra = (*extra, place(state[0][None], 0.0)[:, :, 0],
                 place(state[1][None], NEG_INF)[:, :, 0])
    if carry is not None:
        acc, m, l = carry
        extra = (*extra, place(acc, 0.0), place(m, NEG_INF), place(l, 0.0))
    if raw:
        rows_of = unpad

        def unpad(acc, m, l):
            return (*rows_of(acc, m), rows_of(acc, l)[1])
    return call, (q, k_in, v, *extra), unpad


@functools.partial(jax.jit, static_argnames=("causal", "scale", "interpret", "config",
                                             "btnh"))
def forward(q, k, v, *, causal: bool = False, scale: float | None = None,
            interpret=False, config: MosaicConfig | None = None, key_padding_mask=None,
            causal_offsets=None, btnh: bool = False):
    """Attention forward ``(out [B, Hq, Sq, D] q.dtype, lse [B, Hq, Sq] fp32)``.

    ``interpret``: False (compile for the GPU), True (Mosaic GPU interpret mode on the
    CPU, default parameters) or an ``InterpretGPUParams``. ``key_padding_mask``: None or
    ``[B, Skv]`` bool, True = keep (DESIGN.md section 3). ``causal_offsets``: None or
    ``[B]`` int, per-sequence causal offsets (:func:`_prepare`; ignored when not causal).
    ``btnh``: q, k, v and out are ``[B, S, H, D]``, read and written in place (the lse
    stays ``[B, Hq, Sq]``).
    """
    call, args, unpad = _prepare(q, k, v, causal=causal, scale=scale, interpret=interpret,
                                 config=config, key_padding_mask=key_padding_mask,
                                 causal_offsets=causal_offsets, btnh=btnh)
    return unpad(*call(*args))


def reads_pages_in_place(page_size: int) -> bool:
    """Whether :func:`paged_forward` reads pages of ``page_size`` keys in place:
    multiples of ``BLOCK_N`` (a block is a slice of one page) and multiples of 8 that
    divide it (a block is assembled from several pages by one TMA copy each; the SMEM
    tile's swizzle atom is 8 rows)."""
    bn = schedule.BLOCK_N
    return page_size > 0 and (page_size % bn == 0 or (bn % page_size == 0
                                                      and page_size % 8 == 0))


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "config", "layout"))
def paged_forward(q, k_pages, v_pages, block_table, seq_lens, *, scale: float | None = None,
                  interpret=False, config: MosaicConfig | None = None,
                  layout: str = "HND"):
    """Causal attention of the last ``Sq`` tokens of each sequence against its paged KV,
    read in place (no gather): ``k_pages, v_pages [num_pages, Hkv, page_size, D]``
    (``layout="HND"``) or ``[num_pages, page_size, Hkv, D]`` (``"NHD"``), ``block_table
    [B, max_pages]`` int, ``seq_lens [B]`` int, ``page_size`` as
    :func:`reads_pages_in_place` says. Returns ``(out [B, Hq, Sq, D], lse [B, Hq, Sq])``:
    each row's bits are those of :func:`forward` on the sequence's contiguous keys with
    ``causal_offsets = seq_lens - Sq`` (the same blocks of keys, in the same order, into
    the same SMEM rows; the keys past a sequence's length are never visible and their
    V rows are zeroed in SMEM)."""
    page_size = page_dims(k_pages, layout)[2]  # (raises for another layout)
    if not reads_pages_in_place(page_size):
        raise ValueError(f"pages of {page_size} keys are not read in place (a multiple of "
                         f"{schedule.BLOCK_N}, or a multiple of 8 dividing it)")
    call, args, unpad = _prepare(q, k_pages, v_pages, causal=True, scale=scale,
                                 interpret=interpret, config=config,
                                 pages=(block_table, seq_lens, layout))
    return unpad(*call(*args))


@functools.partial(jax.jit, static_argnames=("causal", "scale", "interpret", "config",
                                             "kernel_lse"))
def split_partials(q, k, v, *, causal: bool = False, scale: float | None = None,
                   interpret=False, config: MosaicConfig | None = None,
                   key_padding_mask=None, causal_offsets=None, kernel_lse: bool = False):
    """Each SPLIT's partial state, ``(out [n_splits, B, Hq, Sq, D], lse [n_splits, B,
    Hq, Sq])`` fp32 (``(0, -inf)`` where a row sees nothing of a split): the states
    :func:`forward` folds in the kernel, for a fold outside it (context parallelism,
    split-parallel decode). ``kernel_lse=True``: the lse in the kernels' base
    (:data:`KERNEL_LSE_BASE2`), as :func:`fold_partials` takes it; :func:`fold_partials`
    of those, cast to the input dtype, is :func:`forward`'s result in bits. Otherwise
    the natural-log lse (``jaxattn.merge.fold`` of those states is the forward's result
    within rounding, not in bits). Arguments as :func:`forward`'s."""
    call, args, unpad = _prepare(q, k, v, causal=causal, scale=scale, interpret=interpret,
                                 config=config, key_padding_mask=key_padding_mask,
                                 causal_offsets=causal_offsets, partials=True)
    out, lse = unpad(*call(*args))
    return out, (lse if kernel_lse else natural_lse(lse))


@functools.partial(jax.jit, static_argnames=("causal", "scale", "interpret", "config",
                                             "finish"))
def split_segment(q, k, v, carry=None, *, causal: bool = False, scale: float | None = None,
                  interpret=False, config: MosaicConfig | None = None,
                  key_padding_mask=None, causal_offsets=None, finish: bool = True):
    """Keys ``k, v`` inside one SPLIT (its start, or the keys right after an earlier
    piece of it) folded on from that piece's running state ``carry`` (None: the split's
    start), as the kernel folds the whole split: with ``finish``, the split's state as
    :func:`split_partials` (``kernel_lse=True``) gives it, ``(out [1, B, Hq, Sq, D],
    lse [1, B, Hq, Sq])``; else the running state ``(acc [1, B, Hq, Sq, D], m, l [1,
    B, Hq, Sq])`` fp32 (m in the kernels' base) for the next piece. Pieces cut at
    multiples of ``BLOCK_N`` give the single call's bits (context parallelism across a
    cut inside a split)."""
    if k.shape[2] > schedule.SPLIT:
        raise ValueError(f"a split segment holds at most SPLIT = {schedule.SPLIT} keys, "
                         f"got {k.shape[2]}")
    call, args, unpad = _prepare(q, k, v, causal=causal, scale=scale, interpret=interpret,
                                 config=config, key_padding_mask=key_padding_mask,
                                 causal_offsets=causal_offsets, partials=True, carry=carry,
                                 raw=not finish)
    return unpad(*call(*args))


@functools.partial(jax.jit, static_argnames=("causal", "scale", "interpret", "config",
                                             "finish", "offset"))
def fold_on(q, k, v, state=None, *, causal: bool = False, scale: float | None = None,
            interpret=False, config: MosaicConfig | None = None, key_padding_mask=None,
            causal_offsets=None, finish: bool = False, offset: int | None = None):
    """The keys ``k, v`` folded onto ``state``, SPLIT after SPLIT in the kernel, as
    :func:`forward` folds a call's splits: ``state`` is ``(out [B, Hq, Sq, D], lse [B,
    Hq, Sq])`` fp32, the lse in the kernels' base (:data:`KERNEL_LSE_BASE2`), the fold of
    the keys before these (None: none, and nothing is loaded); returns the folded state
    in that form, or with ``finish`` what :func:`forward` returns from it (the output in
    the input dtype, the natural-log lse). With ``k`` starting on a SPLIT boundary of a
    longer call and every earlier SPLIT folded into ``state`` (here or by
    :func:`fold_partials`), the finished result (or the state cast to the input dtype,
    its lse in natural-log units by :func:`natural_lse`) is that call's in bits: one
    launch per key range of context parallelism, the state carried between launches in
    fp32. ``offset``: in place of ``causal_offsets``, one causal offset for every
    sequence, known when tracing (the kernel's static offset: no rows placed per
    sequence, so no copy of the state in and out of the kernel's padded rows). Other
    arguments as :func:`forward`'s."""
    _check_state(state, q.shape)
    call, args, unpad = _prepare(q, k, v, causal=causal, scale=scale, interpret=interpret,
                                 config=config, key_padding_mask=key_padding_mask,
                                 causal_offsets=causal_offsets if offset is None
                                 else int(offset), state=state, state_out=not finish)
    return unpad(*call(*args))


def _check_state(state, shape) -> None:
    """ValueError unless ``state`` is None or ``(out, lse)`` fp32 of ``shape`` ``[B, Hq,
    rows, D]`` and ``[B, Hq, rows]`` (a folded state of :func:`fold_on` /
    :func:`fold_window`)."""
    if state is None:
        return
    b, hq, n, d = shape
    o_in, l_in = state
    if (o_in.shape, l_in.shape) != ((b, hq, n, d), (b, hq, n)) or \
            (o_in.dtype, l_in.dtype) != (jnp.float32, jnp.float32):
        raise ValueError(f"state must be (out {(b, hq, n, d)}, lse {(b, hq, n)}) "
                         f"float32, got {o_in.dtype} {o_in.shape}, {l_in.dtype} "
                         f"{l_in.shape}")


def window_in_place(rows: tuple[int, int], keys: tuple[int, int], finish_rows: int,
                    offset: int, causal: bool, config: MosaicConfig | None = None) -> bool:
    """Whether :func:`fold_window` reads this window in place: its rows and
    ``finish_rows`` whole CTAs of rows, its keys whole ``BLOCK_N`` blocks, and a causal
    offset on the block grid (no padding anywhere)."""
    cta_rows, bn = (config or MosaicConfig()).rows, schedule.BLOCK_N
    n = rows[1] - rows[0]
    return (n % cta_rows == 0 and 0 <= finish_rows <= n and finish_rows % cta_rows == 0
            and (keys[1] - keys[0]) % bn == 0 and not (causal and offset % bn))


def fold_window(q, k, v, state=None, *, rows: tuple[int, int], keys: tuple[int, int],
                finish_rows: int, offset: int, causal: bool, scale: float | None = None,
                interpret=False, config: MosaicConfig | None = None):
    """:func:`fold_on` on a window: query rows ``[r0, r1)`` of ``q`` against keys
    ``[x, y)`` of ``k, v`` (``rows``, ``keys``), read in place by the kernel (no
    slices), query row ``r0 + i`` seeing key ``x + j`` iff ``j <= i + offset`` (one
    static offset, a multiple of ``BLOCK_N``) when causal. ``state``: the folded state
    of exactly these rows (``(out [B, Hq, r1 - r0, D], lse)`` fp32, the lse in the
    kernels' base; None: none). Rows ``[r0, r0 + finish_rows)`` are finished (the
    output in q's dtype and the natural-log lse, as :func:`forward` stores them), the
    others stored as the folded state the next window's launch loads. Returns
    ``(finished or None, state or None)``. Context parallelism's range-major fold: one
    launch per key range over every query shard that sees it.

    Served where the window needs no padding: ``r1 - r0`` and ``finish_rows``
    multiples of the CTA's rows, ``y - x`` a multiple of ``BLOCK_N``
    (:func:`window_in_place`; ``ValueError`` otherwise: :meth:`MosaicBackend.fold_window`
    slices instead)."""
    cfg = dataclasses.replace(config or MosaicConfig(), stack_decode=False)
    check_inputs(q, k, v)
    (r0, r1), (x, y) = rows, keys
    n, skv, bn = r1 - r0, y - x, schedule.BLOCK_N
    b, hq, sq_all, d = q.shape
    if not (0 <= r0 < r1 <= sq_all and 0 <= x < y <= k.shape[2]):
        raise ValueError(f"rows {rows} and keys {keys} must be non-empty windows of "
                         f"{sq_all} rows and {k.shape[2]} keys")
    if not window_in_place(rows, keys, finish_rows, offset, causal, cfg):
        raise ValueError(f"a window of {n} rows (and finish_rows={finish_rows}) in "
                         f"multiples of {cfg.rows}, {skv} keys in multiples of {bn} and "
                         f"an offset ({offset}) in multiples of {bn} is served in place")
    _check_state(state, (b, hq, n, d))
    interpret = resolve_interpret(interpret)
    if state is not None or finish_rows < n:  # (a CTA of fewer rows: still in place)
        cfg = state_plan(cfg, d, gpu=interpret is None)
    gpu_operands = cfg.gpu_operands if cfg.gpu_operands is not None else interpret is None
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    call = _build(b=b, hq=hq, hkv=k.shape[1], sq=n, skv=skv,
                  offset=int(offset) if causal else 0, d=d, dtype=q.dtype,
                  causal=causal, scale=scale, cfg=cfg, gpu_operands=gpu_operands,
                  interpret=interpret, state_in=state is not None,
                  state_out=finish_rows < n,  # all finished: the plain epilogue
                  finish_rows=finish_rows if finish_rows < n else 0,
                  q_row0=r0, k_row0=x)
    k_in = k if gpu_operands else jnp.swapaxes(k, 2, 3)
    res = call(q, k_in, v, *(state or ()))
    if finish_rows == n:
        return tuple(res), None
    if finish_rows == 0:
        return None, tuple(res)
    return tuple(res[:2]), tuple(res[2:])


#: The SMEM the fold kernel's slots may take per CTA (:func:`fold_launch`): 64 KiB
#: leaves room for three CTAs per SM. On the H200 (2026-12-03, docs/notes.md) 128 KiB
#: (16 slots of 32 columns, one CTA per SM) ran the fold at B=8 Skv=32768 in 19.2 us
#: against 14.7 with 8 slots, and the decode 2 to 3% slower at B=8.
FOLD_SMEM = 64 * 1024


def fold_launch(n: int, tiles: int, d: int, config: MosaicConfig | None = None):
    """``(slots, cols)`` of the fold kernel for ``n`` states of ``tiles`` 64-row tiles
    at head dim ``d``: ``config``'s ``fold_slots`` / ``fold_cols`` where set; else D is
    halved (down to 16 columns) while the CTAs, ``tiles * d / cols``, are fewer than
    :data:`SPLIT_DECODE_BELOW_CTAS` (the states of a few (batch, KV head) tiles are
    read by more SMs), and the slots are as many of ``64 * cols * 4`` bytes as
    :data:`FOLD_SMEM` holds, 2 to 16; never more than ``n`` rounded up to even. Launch
    choices only: the same merges per element in the same order. Down to 16 columns:
    on the H200 (2026-12-04, tree ``bdd7fc2``) 16 ran the decode at B=1 131072 keys in
    170.8 us against 176.4 at 32 (8 tiles: 64 CTAs against 32), bits equal."""
    cfg = config or MosaicConfig()
    cols = cfg.fold_cols
    if cols is None:
        cols = d
        while cols > 16 and tiles * (d // cols) < SPLIT_DECODE_BELOW_CTAS:
            cols //= 2
    if d % cols:
        raise ValueError(f"fold_cols must divide the head dim {d}, got {cols}")
    slots = cfg.fold_slots
    if slots is None:
        slots = max(2, min(16, FOLD_SMEM // (schedule.BLOCK_N * cols * 4)))
    return min(slots, 2 * max(1, -(-n // 2))), cols


def fold_layout(rows: int, cols: int):
    """The fold kernel's register layout for a tile-major state's ``[rows, cols]``
    (``rows`` a multiple of 8 below 64, ``cols`` of 16): tiles of ``t`` rows, the
    largest power of two up to 32 that divides ``rows``, each row held by ``128 / t``
    lanes (``cols * t / 128`` elements a lane, in vectors of up to 4), each warp a
    quarter of the tile's rows. A thread holds ``rows / t`` rows, so it computes the
    merges' row weights for ``rows / t`` rows: one where ``rows`` is a power of two, as
    the split decode's ``state_rows`` is (the WGMMA layout's 64-row tile, which the fold
    keeps for 64 rows: two rows a thread). A launch choice: the same operations per
    element."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    t = next(t for t in (32, 16, 8) if rows % t == 0)
    lanes = 128 // t
    v = min(4, cols // lanes)
    lay = fa.TiledLayout(fa.Tiling(((t, lanes * v), (t // 4, lanes * v), (1, v))),
                         warp_dims=(-6,), lane_dims=(-4, -3), vector_dim=-1,
                         _check_canonical=False).canonicalize()
    return plgpu.Layout.TILED(lay.tiling, warp_dims=lay.warp_dims,
                              lane_dims=lay.lane_dims, vector_dim=lay.vector_dim)


def _build_fold(n: int, rows: int, d: int, interpret, approx_math: bool,
                tile_major: bool = False, state_rows: int = schedule.BLOCK_N,
                natural: bool = True, slots: int = 2, cols: int | None = None,
                final: tuple[int, object] | None = None, pdl: str = "both"):
    """The fold kernel: one CTA per tile of rows and ``cols`` columns of D (``d / cols``
    CTAs per tile; each computes the rows' weights alike and folds its columns), one
    warpgroup walking the ``n`` states in order through ``slots`` SMEM slots in two
    halves (a chunk of ``slots / 2`` states, loaded by one TMA copy of the outputs and
    one of the lses on one barrier, merged from one half while the next chunk lands in
    the other; one barrier wait and one warpgroup sync per chunk), the running state in
    registers, merged by :func:`kernel_merge` (the forward's merge), the lse converted
    to natural-log units at the store (by the first column's CTA).

    The states are ``[n, rows, D]`` and ``[n, rows]`` (64-row tiles in the WGMMA
    layout), or with ``tile_major`` ``[rows / 64 * n, state_rows, D]`` and ``[rows / 64
    * n, 64]`` (the split decode's own layout, read in place, its tile and split axes
    merged: a chunk's copy then has three dimensions, five once tiled in SMEM): then a
    CTA folds a tile's ``state_rows`` rows only, in :func:`fold_layout` below 64, and
    the result is ``[rows / 64 * state_rows, D]``. ``final=(r, dtype)`` (tile-major):
    only each tile's first ``r`` rows are stored, the output cast to ``dtype``, as
    ``out [rows / 64 * r, D]`` and ``lse [rows / 64 * r]`` (the decode's ``[B, Hq, Sq,
    ...]`` in memory: no slice and cast after the kernel)."""
    bm = schedule.BLOCK_N
    cols = d if cols is None else cols
    if final is not None and (not tile_major or final[0] > state_rows
                              or (final[0] * 4) % 16):
        raise ValueError(f"final=(r, dtype) stores r <= state_rows rows of tile-major "
                         f"states, r a multiple of 4 (a 16-byte lse copy), got {final}")
    if slots < 2 or slots % 2:
        raise ValueError(f"the fold's slots must be an even number >= 2, got {slots}")
    chunk = slots // 2
    full, tail = divmod(n, chunk)
    chunks = full + (tail > 0)
    hints = interpret is None
    tm = state_rows if tile_major else bm  # a CTA's rows
    if tm < bm:  # (64 rows: the WGMMA layout, two rows a thread; fold_layout's two
        # lanes a row conflict on SMEM banks)
        layout = fold_layout(tm, cols)
        row_layout = layout.reduce(1)
        o_transforms = ()
    else:
        layout, row_layout = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)
        o_transforms = _smem_transforms(cols, 4)
    tiles = rows // bm

    def kernel(o_ref, l_ref, out_ref, lse_ref):
        t = lax.axis_index("t")
        c = lax.axis_index("c")
        dcols = pl.ds(c * cols, cols)

        def body(o_s, l_s, rl_s, bars, free, fin_s=None):
            def issue(j, count):  # chunk j's ``count`` (static) states into half j % 2
                half = lax.rem(j, jnp.int32(2))
                s0, i0, bar = half * chunk, j * chunk, bars.at[half]
                if tile_major:  # [T * n, state_rows, D], [T * n, 64]: the lses whole
                    # (a copy's bytes are a multiple of 128 in Pallas)
                    src_o = o_ref.at[pl.ds(t * n + i0, count), pl.ds(0, tm), dcols]
                    src_l = l_ref.at[pl.ds(t * n + i0, count)]
                else:
                    src_o = o_ref.at[pl.ds(i0, count), pl.ds(t * bm, bm), dcols]
                    src_l = l_ref.at[pl.ds(i0, count), pl.ds(t * bm, bm)]
                plgpu.copy_gmem_to_smem(src_o, o_s.at[pl.ds(s0, count)], bar)
                plgpu.copy_gmem_to_smem(src_l, l_s.at[pl.ds(s0, count)], bar)

            def issue_any(j):  # chunk j, if there is one (j dynamic)
                pl.when(j < full)(lambda: issue(j, chunk))
                if tail:
                    pl.when(j == full)(lambda: issue(j, tail))

            def step(j, state, count):  # chunk j's ``count`` states (static)
                # awaited (one barrier: both copies) and read, then merged in order
                # (unrolled: the merges' loads and independent work interleave; the
                # same operations in the same order), then its half released (every
                # thread has read it: an arrival each, observed here) and refilled
                # with chunk j + 2 while chunk j + 1 is merged.
                half = lax.rem(j, jnp.int32(2))
                plgpu.barrier_wait(bars.at[half])
                xs = []
                for u in range(count):
                    slot = half * chunk + u
                    if hints:
                        xs.append((load_ref(o_s.at[slot], layout=layout),
                                   load_ref(l_s.at[slot, pl.ds(0, tm)],
                                            layout=row_layout)))
                    else:
                        xs.append((o_s[slot], l_s[slot, pl.ds(0, tm)]))
                for x, lx in xs:
                    state = kernel_merge(*state, x, lx,
                                         layout=layout if hints and tm < bm else None)
                plgpu.barrier_arrive(free.at[half])
                plgpu.barrier_wait(free.at[half])
                issue_any(j + 2)
                return state

            for j in range(min(2, chunks)):
                issue(jnp.int32(j), chunk if j < full else tail)
            zeros = jnp.zeros((tm, cols), jnp.float32)
            empty = jnp.full((tm,), NEG_INF, jnp.float32)
            if hints:
                zeros = plgpu.layout_cast(zeros, layout)
                empty = plgpu.layout_cast(empty, row_layout)
            state = lax.fori_loop(0, full, lambda j, st: step(j, st, chunk), (zeros, empty))
            if tail:  # the last chunk's states
                state = step(jnp.int32(full), state, tail)
            out, lse = state
            rl_s[...] = natural_lse(lse) if natural else lse
            if final is None:
                res_s = o_s.at[0]  # every load is consumed: slot 0 stages the result
                res_s[...] = out
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(res_s, out_ref.at[pl.ds(t * tm, tm), dcols])
                lse_dst, lse_src = lse_ref.at[pl.ds(t * tm, tm)], rl_s
            else:  # the tile's first r rows, cast, through an untiled SMEM tile
                r = final[0]
                fin_s[...] = out.astype(final[1])
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(fin_s.at[pl.ds(0, r)],
                                        out_ref.at[pl.ds(t * r, r), dcols])
                lse_dst, lse_src = lse_ref.at[pl.ds(t * r, r)], rl_s.at[pl.ds(0, r)]

            @pl.when(c == 0)
            def _():
                plgpu.copy_smem_to_gmem(lse_src, lse_dst)

            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            body,
            plgpu.SMEM((slots, tm, cols), jnp.float32, transforms=o_transforms),
            plgpu.SMEM((slots, bm), jnp.float32),
            plgpu.SMEM((tm,), jnp.float32),
            plgpu.Barrier(num_arrivals=2, num_barriers=2),  # a chunk landed (two copies)
            plgpu.Barrier(num_barriers=2),  # a half read (an arrival per thread)
            *(() if final is None else (plgpu.SMEM((tm, cols), final[1]),)),
        )

    out_rows = tiles * (tm if final is None else final[0])
    return launch(
        kernel,
        pdl=pdl,
        out_type=(jax.ShapeDtypeStruct((out_rows, d),
                                       jnp.float32 if final is None else final[1]),
                  jax.ShapeDtypeStruct((out_rows,), jnp.float32)),
        grid=(tiles, d // cols),
        grid_names=("t", "c"),
        compiler_params=plgpu.CompilerParams(
            approx_math=approx_math, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )


def fold_partials(outs, lses, *, interpret=False, config: MosaicConfig | None = None,
                  natural: bool = True):
    """Fold partial states stacked on the leading axis (ascending key ranges), as
    :func:`jaxattn.merge.fold` does, in a Mosaic GPU kernel with the forward's own
    merge (:func:`kernel_merge`, in the kernels' base). On the H200 XLA's compilation
    of :func:`jaxattn.merge.fold` contracted the merge's products otherwise than the
    kernel (one fp32 ulp on most elements; docs/notes.md, 2026-11-30), so the states of
    :func:`split_partials` are folded here wherever the result must equal
    :func:`forward` in bits (context parallelism, split-parallel decode).

    ``outs``: ``[n, ..., D]`` fp32, ``D`` in :data:`HEAD_DIMS`; ``lses``: ``[n, ...]`` fp32, in
    the kernels' base (``split_partials(..., kernel_lse=True)``). Returns ``(out [...,
    D], lse [...])`` fp32, the lse in natural-log units; ``(0, -inf)`` when every state
    is empty. ``config``: the forward's (its ``approx_math``, an arithmetic choice the
    fold must share with the forward whose states it folds). ``natural=False``: the lse
    stays in the kernels' base (a state :func:`fold_on` folds on from).
    """
    if outs.ndim < 2 or lses.shape != outs.shape[:-1]:
        raise ValueError(f"outs must be [n, ..., D] and lses [n, ...] alike, got "
                         f"{outs.shape} and {lses.shape}")
    if outs.dtype != jnp.float32 or lses.dtype != jnp.float32:
        raise TypeError(f"partial states must be float32, got {outs.dtype}, {lses.dtype}")
    n, d = outs.shape[0], outs.shape[-1]
    if d not in HEAD_DIMS:
        raise ValueError(f"fold_partials supports D in {HEAD_DIMS}, got {d}")
    lead = outs.shape[1:-1]
    if n == 0:
        return (jnp.zeros((*lead, d), jnp.float32), jnp.full(lead, NEG_INF, jnp.float32))
    r = math.prod(lead)
    bm = schedule.BLOCK_N
    rows = max(-(-r // bm) * bm, bm)
    o = jnp.pad(outs.reshape(n, r, d), ((0, 0), (0, rows - r), (0, 0)))
    lse = jnp.pad(lses.reshape(n, r), ((0, 0), (0, rows - r)), constant_values=NEG_INF)
    cfg = config or MosaicConfig()
    slots, cols = fold_launch(n, rows // bm, d, config)
    out, lse = _build_fold(n, rows, d, resolve_interpret(interpret), cfg.approx_math,
                           natural=natural, slots=slots, cols=cols,
                           pdl=cfg.fold_launch_pdl)(o, lse)
    return out[:r].reshape(*lead, d), lse[:r].reshape(lead)


fold_partials_jit = jax.jit(fold_partials, static_argnames=("interpret", "config", "natural"))


def fold_tiles(outs, lses, *, interpret=False, config: MosaicConfig | None = None,
               final: tuple[int, object] | None = None):
    """:func:`fold_partials` of states laid out tile-major, as the split decode writes
    them: ``outs [T, n, R, D]`` (each 64-row tile's first R rows, R a multiple of 8 up to
    64), ``lses [T, n, 64]`` (kernel base) -> ``(out [T, R, D], lse [T, R])``, read in
    place (no split-major copy of the states). The same operations per row: the same
    bits."""
    t, n, r, d = outs.shape
    bm = schedule.BLOCK_N
    if (r % 8 or not 8 <= r <= bm or lses.shape != (t, n, bm) or d not in HEAD_DIMS):
        raise ValueError(f"outs must be [T, n, R (8 to {bm}, a multiple of 8), D in "
                         f"{HEAD_DIMS}] and lses [T, n, {bm}], got {outs.shape}, "
                         f"{lses.shape}")
    cfg = config or MosaicConfig()
    slots, cols = fold_launch(n, t, d, config)
    out, lse = _build_fold(n, t * bm, d, resolve_interpret(interpret), cfg.approx_math,
                           tile_major=True, state_rows=r, slots=slots, cols=cols,
                           final=final, pdl=cfg.fold_launch_pdl)(
                               outs.reshape(t * n, r, d), lses.reshape(t * n, bm))
    if final is not None:  # ``final=(r', dtype)``: [T * r', D] in dtype and [T * r']
        return out, lse
    return out.reshape(t, r, d), lse.reshape(t, r)


def lower_for_cuda(q, k, v, *, causal: bool = False, scale: float | None = None,
                   config: MosaicConfig | None = None, key_padding_mask=None,
                   causal_offsets=None, btnh: bool = False):
    """Lower (not compile) the GPU kernel for CUDA; works on a machine without a GPU.

    Runs the Pallas -> Mosaic GPU lowering (layouts, wgmma operand constraints, the
    SMEM plan), not ptxas. Returns the ``jax.stages.Lowered``. ``btnh``: as
    :func:`forward`'s.
    """
    def f(q, k, v, mask, offs):
        call, args, unpad = _prepare(q, k, v, causal=causal, scale=scale, interpret=False,
                                     config=config, key_padding_mask=mask,
                                     causal_offsets=offs, btnh=btnh)
        return unpad(*call(*args))

    return jax.jit(f).trace(q, k, v, key_padding_mask, causal_offsets).lower(
        lowering_platforms=("cuda",))
