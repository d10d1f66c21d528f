"""Pallas Mosaic GPU (Hopper: wgmma + TMA) attention backward.

The backward of the ``"mosaic"`` backend (:mod:`jaxattn.backends.mosaic.backend`, by
name only), the companion of :mod:`jaxattn.backends.mosaic.forward`, developed on a CPU
machine in Mosaic GPU interpret mode and checked there by lowering for CUDA (no GPU).
See docs/mosaic.md, "Backward prototype".

It follows the canonical backward order of :mod:`jaxattn.backends.pallas.backward`
(DESIGN.md section 4) with the same tiles (``block_q = block_kv = 64``, the Triton
``backward_config`` for D <= 128) and the same floating-point operations per tile, so
that the two backends can be compared op for op:

* :func:`delta`: ``rowsum(dO * O) - dlse`` per query row (fp32 ``[B, Hq, Sq]``), by
  default in a small Mosaic GPU kernel (one warpgroup per 64-row tile; the row sum is a
  vector reduction, as in ``pallas_triton_vjp._delta_kernel``: on the GPU its order
  follows the register layout, so its bits vs Triton's are a GPU question).
  ``BwdConfig(delta="triton")`` calls ``pallas_triton_vjp.delta`` instead (the Triton
  kernel, bit for bit the Triton backend's delta).
* :func:`dkdv`: one CTA per (KV block of 64 keys, KV head, batch). The compute
  warpgroup loads K and V once, then walks the GQA group's query heads in ascending
  order and, for each, the query blocks of 64 rows in ascending order (from the first
  block with a row that sees the KV block), in transposed space ``[keys, queries]``:
  ``s^T = K Q^T * scale``, causal ``where``, ``p^T = exp(s^T - lse_safe)``,
  ``dV += p^T dO``, ``dp^T = V dO^T``, ``ds^T = p^T (dp^T - delta)``, ``dK += ds^T Q``.
  The producer warpgroup streams (Q, dO, lse, delta) tiles through a ring of
  ``stages`` SMEM slots. dK is scaled at the end; both go out by TMA in k's dtype.
* :func:`dq_accumulate`: one CTA per (query block of 64 rows, query head, batch),
  walking KV blocks in ascending order: ``s = Q K^T * scale``, ``p = exp(s - lse_safe)``,
  ``dp = dO V^T``, ``ds = p (dp - delta)``, ``dQ += ds K``. The producer streams K/V.
  Output: the unscaled fp32 accumulator, as ``pallas_triton_vjp.dq_accumulate``; in
  :func:`backward` (and the last key range of :func:`backward_over_ranges`) the kernel
  scales and casts it in its epilogue, the product and rounding
  ``pallas_triton_vjp.backward`` applies in XLA (``_DqKernel.finish``).

On the GPU dK and dV are summed in the wgmma accumulators (``accumulate``, default
"inplace" there); in interpret mode, and for ``dQ`` always, every accumulation is
``acc + (fresh wgmma product)``, the Triton source's ``acc + dot(...)``: the wgmma
accumulates into a *fresh* accumulator that is added to the running value in
registers. No atomics; the order never depends on the shapes. ``exp2`` is the
approximate ``ex2`` instruction on the GPU (``approx_math``, as the forward's). Options
with their own bits (:class:`BwdConfig`): ``accumulate``, ``approx_math``, ``exp2``
and ``mask``. Rows with no visible key have ``lse = -inf``, hence ``lse_safe = +inf``
and ``p = 0`` exactly: zero gradients.

Two operand modes (``gpu_operands``), same arithmetic, both lower for CUDA:

* True (the Hopper path): ``Q^T``, ``dO^T``, ``K^T``, ``V^T`` are transposed SMEM views
  (:func:`_t`) and ``p^T``/``ds^T``/``ds`` are wgmma A operands from
  registers.
* False (the interpret-mode subset, JAX 0.10.2 interpreter): XLA transposes q, dO, k, v
  to ``[..., D, S]`` and TMA loads ``[D, 64]`` tiles, and the A operands are staged
  through SMEM (``commit_smem`` before the wgmma).

:func:`backward` takes any positive ``Sq`` and ``Skv`` (padded inside as the forward
pads) and a key padding mask; :func:`dkdv` and :func:`dq_accumulate` keep the whole-tile
contract (multiples of 64, no mask); :func:`backward_over_ranges` adds per-sequence causal
offsets and key ranges (dQ continued from range to range: context parallelism).
Restrictions: bf16/fp16, D in {64, 128} (the backend pads smaller head dims).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxattn import schedule
from jaxattn.backends.common import LOG2E
from jaxattn.backends.mosaic.forward import (
    HEAD_DIMS,
    _along,
    _smem_transforms,
    check_inputs,
    check_pdl,
    check_store_wait,
    interpret_params,
    launch,
    load_ref,
    padding,
    reset_interpret_state,
    resolve_interpret,
    tile_of,
    two_slot_loop,
    wait_stores,
    zero_dropped_keys,
)
from jaxattn.backends.pallas import backward as pallas_triton_vjp
from jaxattn.validation import as_bhsd

NEG_INF = float("-inf")
POS_INF = float("inf")

#: Query rows per tile (dK/dV: the inner loop's step; dQ: the CTA's rows). Equal to
#: ``pallas_triton_vjp.backward_config(D).block_q`` for D <= 128: it sets the
#: accumulation order of dK/dV, so it must match the Triton backend's.
BLOCK_Q = 64
#: Keys per tile (dK/dV: the CTA's keys; dQ: the inner loop's step).
BLOCK_KV = schedule.BLOCK_N
#: ``BwdConfig.dq_in_smem``: the columns of dQ added into the SMEM tile at a time.
DQ_SMEM_COLS = 64
# Head dims: mosaic_fwd.HEAD_DIMS. At D=256 a warpgroup holds one 64 x 256 fp32 sum: dK
# and dV come from one kernel of two warpgroups, a sum each (``split_dkdv``,
# ``dkdv_pair``), and dQ from one query tile per CTA on two warpgroups, half of dQ's
# columns each (``dq_pair``); run on the H200 since 2026-12-01 (tests/test_mosaic_
# backend.py's test_large_head_dims_forward_and_gradients; the invariance matrix at
# D=256 on an H100, 2026-12-05).
__all__ = ["BLOCK_KV", "BLOCK_Q", "BwdConfig", "backward", "backward_over_ranges", "delta",
           "dkdv", "dq_accumulate", "interpret_params", "lower_for_cuda",
           "reset_interpret_state"]


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    """Launch parameters of the backward kernels. ``accumulate``, ``approx_math``,
    ``exp2`` and ``mask`` change the floating-point operations (each is its own set of
    bits, fixed per backend); the others never change a bit."""

    #: SMEM ring slots of the streamed operands (TMA prefetch depth).
    stages: int = 2
    #: None: the Hopper operand path unless interpreting (see the module docstring).
    gpu_operands: bool | None = None
    #: Mosaic GPU lowering semantics, pinned as in ``mosaic_fwd.MosaicConfig``: "lane"
    #: (the default of JAX 0.10.x) or "warpgroup" (the default from JAX 0.11.0).
    semantics: str = "lane"
    #: "mosaic": the Mosaic GPU delta kernel of this module; "triton":
    #: ``pallas_triton_vjp.delta`` (the Triton backend's kernel).
    delta: str = "mosaic"
    #: Compute warpgroups of the dK/dV kernel (1 or 2). With 2, a CTA holds two KV
    #: blocks (one per warpgroup) that share one stream of query blocks, starting at
    #: the first block's first visible query block; the second warpgroup's extra
    #: (fully masked) query blocks add exact zeros, so the bits are those of 1. Needs
    #: ``Skv`` to be a multiple of 128 (else 1 is used: the same bits).
    dkdv_wgs: int = 2
    #: dK/dV accumulation across query blocks: "fresh" (each product in a fresh wgmma
    #: accumulator added to the running sum: the Triton source's ``acc + dot``) or
    #: "inplace" (the running sums are the wgmma accumulators; rounds differently; GPU
    #: operand path only). None: "inplace" on the GPU operand path (the faster on the
    #: H200: 374 against 353 TFLOP/s at B=2 S=4096 with ``approx_math``, run of 2026-12-01,
    #: 6a24bfd), "fresh" in interpret mode (whose wgmma cannot accumulate into a live accumulator).
    accumulate: str | None = None
    #: Compute warpgroups of the dQ kernel (1 or 2). With 2, a CTA holds two 64-row
    #: query tiles that share one stream of KV blocks (each tile's rows see the same
    #: blocks in the same order as with 1: the same bits). Needs ``Sq`` to be a
    #: multiple of 128, and the GPU operand path where D=128 (else 1 is used).
    dq_wgs: int = 2
    #: ``setmaxnreg`` (compute, producer) where a kernel has two compute warpgroups
    #: (three warpgroups share the register file); None: no reallocation.
    registers: tuple[int, int] | None = (240, 24)
    #: Mosaic GPU's ``approx_math`` (``exp2`` as ``ex2.approx.ftz.f32``), as
    #: :class:`~jaxattn.backends.mosaic.forward.MosaicConfig`'s: other bits.
    approx_math: bool = True
    #: The probabilities as ``exp2(s * (scale * log2 e) - lse * log2 e)``: one FMA and
    #: one ``ex2`` per element (the forward's form) instead of ``exp(s * scale - lse)``
    #: (a product, a difference and, with ``approx_math``, ``ex2`` of a further
    #: product). Other bits. On the H200 (run of 2026-12-01, 79e97f6, with ``mask="probs"``): 383.8
    #: against 371.2 TFLOP/s at B=2 S=4096.
    exp2: bool = True
    #: Where the causal / key mask acts: "scores" (the scaled scores of every block set
    #: to -inf before the exponential: the Triton source's order) or "probs" (the
    #: probabilities of the blocks that need a mask set to 0 after it; blocks every
    #: row and key of which is visible skip the mask, as the forward's fast path:
    #: masking every block cost the forward 27% on the H200). Other bits than
    #: "scores"; the same bits on both paths of "probs" (the mask only selects). On the
    #: H200 (run of 2026-12-01, 79e97f6): 371.2 against 363.3 TFLOP/s at B=2 S=4096, 424.4 against
    #: 402.5 at B=1 S=16384.
    mask: str = "probs"
    #: dK and dV by two kernels, one accumulator each (the same operations: the same
    #: bits); None: only where D > 128 (two 64 x 256 fp32 accumulators per warpgroup do
    #: not fit in registers).
    split_dkdv: bool | None = None
    #: Programmatic dependent launch, as ``MosaicConfig.pdl`` ("both", "wait",
    #: "trigger" or "off"; :func:`~jaxattn.backends.mosaic.forward.launch`). A launch
    #: choice.
    pdl: str = "both"
    #: The dK/dV kernel's probabilities computed while its dP^T = V dO^T product runs
    #: (issued, then P^T from S^T, then the wait), where the default awaits dP^T first.
    #: ptxas overlaps them on its own in the dQ kernel and in the dK/dV kernel's masked
    #: blocks, but not in its unmasked ones (``benchmarks.mosaic_sass``, 2026-12-05:
    #: there both products are awaited before the first exponential; with this, the
    #: exponentials sit between dP^T's wgmmas, and the kernel spills 104 bytes against
    #: 148). The same operations: a launch choice.
    dp_overlap: bool = False
    #: The dQ kernel's running dQ kept in its fp32 output tile's SMEM instead of
    #: registers: each block's product ``dS K`` taken :data:`DQ_SMEM_COLS` columns at
    #: a time into a fresh wgmma accumulator, added to those columns read from the
    #: tile (``running + fresh``, the registers' order) and written back. Each
    #: element's product is the same 64-key wgmma reduction and its sum the same
    #: addition: a launch choice. For D=256, where the running dQ (128 registers a
    #: thread) beside the whole product's fresh accumulator and S, dP and P spills
    #: (``benchmarks.mosaic_sass --backward --bwd_head_dim=256``: 1752 bytes, the
    #: key-block loop 103 spill loads and 56 stores a block). None: only where D > 128.
    #: On an H100 (2026-12-05, tree f2afb68, D=256 causal): bits equal, the backward
    #: 36.1 -> 33.2 ms at B=8 S=4096 and 111.3 -> 102.4 ms at B=2 S=16384 (8%).
    dq_in_smem: bool | None = None
    #: Compute warpgroups of the dV kernel where dK and dV are split (``split_dkdv``):
    #: 1 or 2, each holding one KV block of a shared query stream, as ``dkdv_wgs``
    #: (the same bits). The dV kernel holds no V (it computes no dP), so two fit at
    #: D=256 (K, and the ring of Q, dO and lse: 192 KiB). Needs ``Skv`` to be a
    #: multiple of 128 (else 1). Not yet run on a GPU.
    dv_wgs: int = 1
    #: Compute warpgroups of the split dK kernel, 1 or 2, as ``dv_wgs``. At D=256 two
    #: warpgroups' K and V (128 KiB) leave room for one ring slot of Q and dO, so the
    #: kernel then runs ``stages=1`` (the two warpgroups still overlap each other's
    #: softmax and products; the next step's load waits for both). Not yet run on a GPU.
    dk_wgs: int = 1
    #: The dQ kernel's K/V ring split in two where D > 128 and no key mask is given
    #: (ignored elsewhere): K (K and K^T off the GPU operand path) in ``stages + 1``
    #: slots and V in its own ``stages``, V's freed as soon as the block's dP is
    #: computed. At D=256 (one K/V slot: Q, dO, the fp32 tile and one block fill 192
    #: KiB) block j+1's V then loads under block j's softmax and dQ product, and its K
    #: into the second slot (224 KiB; every SMEM buffer takes whole KiB, so a key mask's
    #: keep values pass the 227 by 96 bytes). The same operations: a launch choice.
    #: None: on (it applies only where D > 128). On an H100 (2026-12-05, tree b57d173,
    #: D=256 causal): bits equal, the backward 32.1 -> 29.8 ms at B=8 S=4096 and
    #: 101.8 -> 86.8 ms at B=2 S=16384; with ``dkdv_pair`` 20.2 -> 17.9 and 77.5 -> 68.4.
    dq_split_ring: bool | None = None
    #: Where dK and dV are split (``split_dkdv``), one kernel for both instead of two:
    #: its two compute warpgroups share one KV block and one query stream, warpgroup 0
    #: computing S^T and P^T and summing dV, warpgroup 1 computing dP^T, taking P^T
    #: (fp32) from an SMEM tile and summing dK. Each sum's operations are those of its
    #: own kernel (the same bits); S^T is computed once where the two kernels compute
    #: it twice, and Q and dO stream once. SMEM at D=256: K, V, two ring slots and the
    #: P^T tile, 210 KiB. None: where D > 128 (where the split is the default). On an
    #: H100 (2026-12-05, tree b57d173, D=256 causal): bits equal, the backward 32.1 ->
    #: 20.2 ms at B=8 S=4096 and 101.8 -> 77.5 ms at B=2 S=16384.
    dkdv_pair: bool | None = None
    #: The dQ kernel with two compute warpgroups on one 64-row query tile where D >= 128
    #: and it stores the finished dQ from zero (not a CP key range's accumulator):
    #: warpgroup 0 computes S and P and hands P (fp32) to warpgroup 1 through an SMEM
    #: tile, warpgroup 1 computes dP and dS and hands dS back through another, and each
    #: adds ``dS K`` to its half of dQ's columns in registers (a fresh 64 x D/2 product
    #: added to the running half: each element's operations are the one-warpgroup
    #: kernel's, the same bits). Why: under Nsight Compute (H100, 2026-12-05) the
    #: one-warpgroup dQ kernel is the D=256 backward's longest (9.3 ms of 17.9 at B=8
    #: S=4096 causal, 355 TFLOP/s), its warpgroup waiting on its own wgmma 32% of its
    #: samples. ptxas: 168 registers, no spills. None: where D > 128. On an H100
    #: (2026-12-05, tree 65e3de1): bits equal at D=128 and 256; the D=256 backward 18.6
    #: -> 16.1 ms causal at B=8 S=4096 (69.4 -> 58.8 at B=2 S=16384), 36.0 -> 31.8 and
    #: 144.4 -> 127.4 non-causal; at D=128 (one tile a CTA against the default's two)
    #: 6.8 -> 9.2 ms.
    dq_pair: bool | None = None
    #: The dK/dV kernel's steps (one query block each) in a loop unrolled by the
    #: ring's two slots, branched once per run of steps on the slot of its first, so
    #: each step's four barrier waits (Q, dO, lse, delta), its arrival and its slots'
    #: SMEM take constant slots and phase bits instead of ``t mod 2`` and a dynamic
    #: shift of each barrier array's phase bitfield (``MosaicConfig.static_slots``,
    #: the forward's). Where the ring has two slots, not ``dkdv_pair``'s kernel; None:
    #: on the GPU. The same steps in the same order: a launch choice. Off: ptxas
    #: gives D=64's step 350 instructions against 390 with a few spills (D=128's heavy
    #: spills), and the H100 ran D=64's backward 0.92 to 0.96x (2026-12-06,
    #: docs/mosaic.md's row).
    static_slots: bool | None = False
    #: How each kernel's CTA awaits its epilogue's TMA stores (delta, dK/dV, dQ), as
    #: ``MosaicConfig.store_wait`` ("read": until their SMEM has been read). A launch
    #: choice.
    store_wait: str = "read"
    #: dQ formed in the dK/dV kernel instead of by the dQ kernel (five 64-key products
    #: a step instead of seven): each compute warpgroup stages its ``dS^T`` in SMEM,
    #: takes its share ``dS K`` of the step's query tile into a fresh accumulator and
    #: adds it to the tile's fp32 dQ in global memory by a TMA reduce-add, in the dQ
    #: kernel's order (ascending key blocks: a GMEM semaphore per query tile counts the
    #: shares added; a block's share waits for its rank), the first share stored; XLA
    #: then scales and casts it as the dQ kernel's ``finish`` does. The dQ kernel's
    #: additions in its order: its bits if the dK/dV kernel's ``dS`` equals the dQ
    #: kernel's (``test_transposed_products_keep_bits_on_gpu``) and a fresh wgmma sum
    #: is never -0. GPU only (the interpreter has no semaphores or reduce-adds), for
    #: :func:`backward` at D <= 128 without a key mask. Not yet run on a GPU (notes,
    #: "thirty-fourth stop"; the retired ``dq="fused"`` of 2026-11-30 added in the
    #: other order).
    fused_dq: bool = False
    #: With ``fused_dq``: when a warpgroup awaits its share's reduce-add and signals the
    #: tile's semaphore: "next_step" (at the start of its next step's share, or after
    #: its last step: the writes' round trip under that step's products; the next key
    #: block's wait a step later) or "step_end" (right after issuing it, as the retired
    #: fused dQ did: the round trip in every step). The same additions in the same
    #: order either way.
    dq_signal: str = "next_step"

    def __post_init__(self):
        check_store_wait(self.store_wait)
        if not isinstance(self.fused_dq, bool):
            raise TypeError(f"fused_dq must be True or False, got {self.fused_dq!r}")
        if self.dq_signal not in ("next_step", "step_end"):
            raise ValueError(f"dq_signal must be 'next_step' or 'step_end', got "
                             f"{self.dq_signal!r}")
        if self.stages < 1:
            raise ValueError(f"stages must be >= 1, got {self.stages}")
        check_pdl("pdl", self.pdl)
        if not isinstance(self.dp_overlap, bool):
            raise TypeError(f"dp_overlap must be True or False, got {self.dp_overlap!r}")
        if self.semantics not in ("lane", "warpgroup"):
            raise ValueError(f"semantics must be 'lane' or 'warpgroup', got {self.semantics!r}")
        if self.delta not in ("mosaic", "triton"):
            raise ValueError(f"delta must be 'mosaic' or 'triton', got {self.delta!r}")
        if self.accumulate not in (None, "fresh", "inplace"):
            raise ValueError(f"accumulate must be 'fresh' or 'inplace', got "
                             f"{self.accumulate!r}")
        if self.dkdv_wgs not in (1, 2):
            raise ValueError(f"dkdv_wgs must be 1 or 2, got {self.dkdv_wgs}")
        if self.mask not in ("scores", "probs"):
            raise ValueError(f"mask must be 'scores' or 'probs', got {self.mask!r}")
        if self.dq_wgs not in (1, 2):
            raise ValueError(f"dq_wgs must be 1 or 2, got {self.dq_wgs}")
        if self.dv_wgs not in (1, 2):
            raise ValueError(f"dv_wgs must be 1 or 2, got {self.dv_wgs}")
        if self.dk_wgs not in (1, 2):
            raise ValueError(f"dk_wgs must be 1 or 2, got {self.dk_wgs}")
        for name in ("dq_in_smem", "dkdv_pair", "dq_split_ring", "dq_pair", "static_slots"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be None, True or False, got "
                                f"{getattr(self, name)!r}")
        if self.registers is not None and (
                len(self.registers) != 2 or any(r % 8 or not 24 <= r <= 256
                                                for r in self.registers)):
            raise ValueError(f"registers must be None or two multiples of 8 in [24, 256], "
                             f"got {self.registers}")


assert BLOCK_Q == pallas_triton_vjp.backward_config(128).block_q
assert BLOCK_KV == pallas_triton_vjp.backward_config(128).block_kv


def _check(q, k, v):
    """The forward's checks, and (no padding here yet) whole BLOCK_Q-row query tiles
    and whole BLOCK_KV-key blocks."""
    check_inputs(q, k, v)
    if q.shape[2] % BLOCK_Q:
        raise ValueError(f"Sq={q.shape[2]} must be a positive multiple of {BLOCK_Q} "
                         f"(prototype)")
    if k.shape[2] % BLOCK_KV:
        raise ValueError(f"Skv={k.shape[2]} must be a positive multiple of BLOCK_N="
                         f"{BLOCK_KV} (prototype)")


def _produce(srcs, sm, bars, stages: int, total, source, rings=None):
    """The producer warpgroup's ring: step t copies ``source(name, ref, t)`` of every
    source into slot ``t % stages`` (signalling ``bars[name]``) once the consumer has
    freed that slot (``bars["free"]``), then waits for the last ``stages`` slots to be
    freed before the kernel ends. ``rings``: instead, ``[(names, slots, free), ...]``,
    rings of their own slot counts and free barriers, filled in that order each step."""
    rings = rings or [(tuple(srcs), stages, "free")]

    def load(t, _):
        for names, slots, free in rings:
            slot = lax.rem(t, jnp.int32(slots))

            @pl.when(t >= slots)
            def _(free=free, slot=slot):  # (traced here, once)
                plgpu.barrier_wait(bars[free].at[slot])

            for name in names:
                plgpu.copy_gmem_to_smem(source(name, srcs[name], t), sm[name].at[slot],
                                        bars[name].at[slot])
        return None

    lax.fori_loop(0, total, load, None)

    for _, slots, free in rings:
        def drain(t, _, slots=slots, free=free):
            plgpu.barrier_wait(bars[free].at[lax.rem(t, jnp.int32(slots))])
            return None

        lax.fori_loop(lax.max(total - slots, 0), total, drain, None)


def _check_rows(name, x, shape, dtype=None):
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name} must be {jnp.dtype(dtype).name}, got {x.dtype}")


def _probs(cfg: BwdConfig, s, lse_safe, scale, visible, rows_axis):
    """The probabilities of the raw scores ``s`` (a tile) given each row's ``lse_safe``
    (+inf where the row sees no key) along ``rows_axis`` of the tile, masked by
    ``visible`` (None: nothing masked) as ``cfg.mask`` says: the one formula of the
    dK/dV and dQ kernels."""
    if cfg.exp2:
        ex, c, lse_b = jnp.exp2, scale * LOG2E, lse_safe * LOG2E
    else:
        ex, c, lse_b = jnp.exp, scale, lse_safe
    lse_b = lax.broadcast_in_dim(lse_b, s.shape, [rows_axis])
    if visible is None:
        return ex(s * c - lse_b)
    if cfg.mask == "probs":
        return jnp.where(visible, ex(s * c - lse_b), 0.0)
    return ex(jnp.where(visible, s * c, NEG_INF) - lse_b)


def _compiler_params(cfg: BwdConfig):
    return plgpu.CompilerParams(
        approx_math=cfg.approx_math,
        lowering_semantics=getattr(plgpu.LoweringSemantics, cfg.semantics.capitalize()))


class _Layouts:
    """Layout hints, emitted only when compiling for the GPU (the interpreter has no CPU
    rule for ``layout_cast`` or ``load(..., layout=)``; the lowering needs them)."""

    def __init__(self, interpret):
        self.hints = interpret is None

    def zeros(self, shape):
        x = jnp.zeros(shape, jnp.float32)
        return plgpu.layout_cast(x, plgpu.Layout.WGMMA) if self.hints else x

    def iota(self, shape, dim):
        return plgpu.broadcasted_iota(jnp.int32, shape, dim,
                                      layout=plgpu.Layout.WGMMA if self.hints else None)

    def tile(self, ref):
        """A 2-D SMEM tile as a WGMMA-layout array."""
        return load_ref(ref, layout=plgpu.Layout.WGMMA) if self.hints else ref[...]

    def vec(self, ref, reduced_axis):
        """A row vector of a ``[M, N]`` WGMMA tile: ``reduced_axis=1`` indexes rows,
        ``0`` indexes columns."""
        if self.hints:
            return load_ref(ref, layout=plgpu.Layout.WGMMA.reduce(reduced_axis))
        return ref[...]


def _wgmma(a, b, shape):
    """``a @ b`` on wgmma into a fresh fp32 accumulator of ``shape``."""
    def f(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(f, plgpu.ACC(shape, jnp.float32))


def _set_registers(cfg: BwdConfig, nwg: int, interpret, role: int):
    """``setmaxnreg`` for a compute (role 0) or producer (role 1) warpgroup of a kernel
    with ``nwg`` compute warpgroups (only with two, and only on the GPU)."""
    if cfg.registers is None or nwg != 2 or interpret is not None:
        return
    plgpu.set_max_registers(cfg.registers[role],
                            action="increase" if role == 0 else "decrease")


def _a_operand(x, smem, gpu_operands):
    """A wgmma A operand: the array itself (registers) or staged through ``smem``."""
    if gpu_operands:
        return x
    smem[...] = x
    plgpu.commit_smem()
    return smem


def _t(ref):
    """The SMEM view ``ref`` (a ``.at[...]`` view) transposed for a wgmma operand
    (``plgpu.transpose_ref`` is this in JAX 0.10.2 and deprecated from 0.11)."""
    return ref.transpose((1, 0))


# ----------------------------------------------------------------------------- delta


def _build_delta(*, b, hq, sq, d, dtype, cfg, interpret, btnh=False):
    bm = BLOCK_Q
    lay = _Layouts(interpret)
    itemsize = jnp.dtype(dtype).itemsize

    def kernel(o_ref, do_ref, dlse_ref, delta_ref):
        qi, h, bi = lax.axis_index("q"), lax.axis_index("h"), lax.axis_index("b")
        rows = pl.ds(qi * bm, bm)

        def body(smem, bars):
            o_s, do_s, dl_s, out_s = smem
            plgpu.copy_gmem_to_smem(tile_of(o_ref, bi, h, rows, btnh), o_s, bars.at[0])
            plgpu.copy_gmem_to_smem(tile_of(do_ref, bi, h, rows, btnh), do_s, bars.at[1])
            plgpu.copy_gmem_to_smem(dlse_ref.at[bi, h, rows], dl_s, bars.at[2])
            for i in range(3):
                plgpu.barrier_wait(bars.at[i])
            o = lay.tile(o_s).astype(jnp.float32)
            do = lay.tile(do_s).astype(jnp.float32)
            # pallas_triton_vjp._delta_kernel: jnp.sum(o * do, axis=1) - dlse.
            out_s[...] = jnp.sum(o * do, axis=1) - lay.vec(dl_s, 1)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_s, delta_ref.at[bi, h, rows])
            wait_stores(cfg.store_wait)

        tile = plgpu.SMEM((bm, d), dtype, transforms=_smem_transforms(d, itemsize))
        pl.run_scoped(body, [tile, tile, plgpu.SMEM((bm,), jnp.float32),
                             plgpu.SMEM((bm,), jnp.float32)],
                      plgpu.Barrier(num_barriers=3))

    return launch(
        kernel, pdl=cfg.pdl, out_type=jax.ShapeDtypeStruct((b, hq, sq), jnp.float32),
        grid=(sq // bm, hq, b), grid_names=("q", "h", "b"),
        compiler_params=_compiler_params(cfg), interpret=interpret)


# ------------------------------------------------------------------------------ dK dV


def _first_qblock(start, *, causal, offset, n_q):
    """First query block with a row that sees key ``start`` (pallas_triton_vjp's
    ``first``): key j is visible to query i iff j <= i + offset."""
    if not causal:
        return jnp.int32(0)
    first_row = start - offset
    first = lax.div(lax.max(first_row, jnp.int32(0)), jnp.int32(BLOCK_Q))
    return lax.min(first, jnp.int32(n_q))


class _DkdvTile(NamedTuple):
    """A dK/dV CTA's place in the schedule (:meth:`_DkdvKernel.schedule`): batch ``bi``,
    KV head ``kvh``, ``start`` (the first key of the CTA's first KV block) and its
    stream of ``total`` steps, step t being query block ``first + t % n`` of query head
    ``kvh * group + t // n``; ``offs``: the ``offs`` ref (``dyn_offsets``) or None."""

    bi: jax.Array
    kvh: jax.Array
    start: jax.Array
    first: jax.Array
    n: jax.Array
    total: jax.Array
    offs: object


class _DkdvBlock(NamedTuple):
    """A compute warpgroup's KV block (:meth:`_DkdvKernel.load_block`): its SMEM views
    ``sm`` (K, V and the staged A operands of this warpgroup), first key ``start``, the
    causal ``offset``, the tile's ``diag`` (key index minus query index) and ``kept``
    (the kept keys as rows of ``[keys, queries]``, or None)."""

    sm: dict
    start: jax.Array
    offset: object
    diag: jax.Array
    kept: jax.Array | None


@dataclasses.dataclass(kw_only=True)
class _DkdvKernel:
    """The dK/dV kernel for ``sq`` query rows and ``skv`` keys (both multiples of 64);
    query row i sees key j iff ``j <= i + offset`` when causal (default ``skv - sq``).
    ``key_mask``: the kernel also takes ``keep`` (fp32 ``[B, skv]``, 1 = keep) and drops
    the other keys. ``dyn_offsets``: the kernel also takes ``offs`` (int32 ``[B]``, last),
    sequence b's offset in place of ``offset``. ``parts``: "dkdv" (both), "dk" or "dv"
    (that one alone, by the same operations: a warpgroup then holds one 64 x D
    accumulator, as D=256 needs; one warpgroup).

    The fields are the static launch parameters; the stages, in schedule order, are
    :meth:`schedule` (tile scheduler), :meth:`produce` (producer warpgroup: the TMA
    ring of Q, dO, lse, delta), the consumer's :meth:`load_block`, :meth:`mainloop`
    (over :meth:`steps` of :meth:`step`) and :meth:`epilogue`; :meth:`kernel` ties them
    together and :meth:`build` launches it."""

    b: int
    hq: int
    hkv: int
    sq: int
    skv: int
    d: int
    dtype: object
    causal: bool
    scale: float
    cfg: BwdConfig
    gpu_operands: bool
    interpret: object
    offset: int | None = None
    key_mask: bool = False
    dyn_offsets: bool = False
    parts: str = "dkdv"
    btnh: bool = False

    def __post_init__(self):
        if self.parts not in ("dkdv", "dk", "dv", "pair"):
            raise ValueError(f"parts must be 'dkdv', 'dk', 'dv' or 'pair', got "
                             f"{self.parts!r}")
        cfg, bkv = self.cfg, BLOCK_KV
        self.want_dk, self.want_dv = self.parts != "dv", self.parts != "dk"
        self.stages = cfg.stages
        wgs = {"dkdv": cfg.dkdv_wgs, "dv": cfg.dv_wgs, "dk": cfg.dk_wgs, "pair": 2}[self.parts]
        self.nwg = wgs if self.skv % (wgs * bkv) == 0 or self.parts == "pair" else 1
        #: KV blocks a CTA holds (``pair``: one, for both warpgroups).
        self.kv_per_cta = 1 if self.parts == "pair" else self.nwg
        if self.parts == "dk" and self.nwg > 1 and self.d > 128:
            self.stages = 1  # K and V of two warpgroups leave SMEM for one slot
        #: BwdConfig.static_slots where it applies (None: on the GPU)
        self.static_slots = self.stages == 2 and self.parts != "pair" and (
            self.interpret is None if cfg.static_slots is None else cfg.static_slots)
        gpu = self.gpu_operands and self.interpret is None
        self.inplace = (cfg.accumulate or ("inplace" if gpu else "fresh")) == "inplace"
        if self.inplace and not gpu:
            raise ValueError("accumulate='inplace' needs the GPU operand path (and no "
                             "interpret mode)")
        self.group, self.n_q = self.hq // self.hkv, self.sq // BLOCK_Q
        self.static_offset = self.skv - self.sq if self.offset is None else self.offset
        self.lay = _Layouts(self.interpret)
        self.tr = functools.partial(_smem_transforms,
                                    itemsize=jnp.dtype(self.dtype).itemsize)
        #: The streamed operands, in the ring's copy order (dV alone needs no delta,
        #: and no V: it computes no dP).
        self.names = (["q", "do", "lse"] + (["delta"] if self.want_dk else [])
                      + ([] if self.gpu_operands else ["qt", "dot"]))

    def offset_of(self, bi, offs_ref):
        """The causal offset of sequence ``bi`` (read from ``offs`` with
        ``dyn_offsets``)."""
        return offs_ref[bi] if self.dyn_offsets else self.static_offset

    # -- tile scheduler

    def schedule(self, offs_ref) -> _DkdvTile:
        """Tile scheduler: the CTA (grid ``(kv, h, b)``) holds ``nwg`` consecutive KV
        blocks from ``start`` and walks the GQA group's query heads in ascending order
        and, for each, the query blocks in ascending order from the first with a row
        that sees key ``start``."""
        kb, kvh, bi = lax.axis_index("kv"), lax.axis_index("h"), lax.axis_index("b")
        start = kb * (self.kv_per_cta * BLOCK_KV)
        first = _first_qblock(start, causal=self.causal, offset=self.offset_of(bi, offs_ref),
                              n_q=self.n_q)
        n = jnp.int32(self.n_q) - first
        total = n * self.group
        n = lax.max(n, jnp.int32(1))  # a divisor; total == 0 when no block is visible
        return _DkdvTile(bi, kvh, start, first, n, total, offs_ref)

    def steps(self, blk: _DkdvBlock, tile: _DkdvTile, body, carry):
        """The step order: ``body`` over the steps [0, total) in order. With
        ``mask="probs"`` and a causal mask alone, each head's query blocks that see
        every key of the block (from the first whose first row sees the block's last
        key) take the unmasked path."""
        cfg, bq, bkv = self.cfg, BLOCK_Q, BLOCK_KV
        total, first = tile.total, tile.first

        def run(lo, hi, body, carry, first_slot=None):
            if not self.static_slots:
                return lax.fori_loop(lo, hi, body, carry)
            if first_slot is None:  # (the ring's step t is in slot t mod 2)
                first_slot = lax.rem(lo, jnp.int32(2))
            return two_slot_loop(lo, hi, body, carry, first_slot)

        if cfg.mask == "scores" or not self.causal or self.key_mask:
            return run(0, total, body, carry, 0)
        per = lax.div(total, jnp.int32(self.group))  # query blocks per head
        late = lax.max(blk.start + (bkv - 1) - blk.offset, 0)
        n_mask = lax.min(lax.max(lax.div(late + (bq - 1), jnp.int32(bq)) - first, 0),
                         per)

        def head(hh, carry):
            base = hh * per
            carry = run(base, base + n_mask, body, carry)
            return run(base + n_mask, base + per, functools.partial(body, masked=False),
                       carry)

        return lax.fori_loop(0, self.group, head, carry)

    # -- producer

    def produce(self, refs, sm, bars, tile: _DkdvTile):
        """Producer warpgroup: the TMA ring; step t's Q, dO, lse and delta tiles (and
        Q^T, dO^T off the GPU operand path) go to slot ``t % stages``."""
        bq, group = BLOCK_Q, self.group

        def source(name, ref, t):
            h = tile.kvh * group + lax.div(t, tile.n)
            rows = pl.ds((tile.first + lax.rem(t, tile.n)) * bq, bq)
            if name in ("qt", "dot"):
                return ref.at[tile.bi, h, :, rows]
            return tile_of(ref, tile.bi, h, rows, self.btnh and name in ("q", "do"))

        srcs = {name: refs[name] for name in self.names}
        _produce(srcs, sm, bars, self.stages, tile.total, source)

    # -- consumer

    def load_block(self, w, refs, sm, bars, tile: _DkdvTile) -> _DkdvBlock:
        """Consumer prologue: warpgroup w holds the CTA's w-th KV block and loads its K
        and V (and keep values) once. The query stream starts at the CTA's ``first``
        (that of its first block), so where this block's own first visible query block
        is later, the steps before it are fully masked."""
        bq, bkv, lay, bi, kvh = BLOCK_Q, BLOCK_KV, self.lay, tile.bi, tile.kvh
        start = tile.start + w * bkv
        offset = self.offset_of(bi, tile.offs)
        sm = dict(sm, k=sm["k"].at[w], v=sm["v"].at[w] if "v" in sm else None)
        if "p" in sm:
            sm.update(p=sm["p"].at[w], ds=sm["ds"].at[w])
        keys = pl.ds(start, bkv)
        plgpu.copy_gmem_to_smem(tile_of(refs["k"], bi, kvh, keys, self.btnh), sm["k"],
                                bars["misc"].at[2 * w])
        if self.want_dk:  # V for dP (dV alone computes none)
            plgpu.copy_gmem_to_smem(tile_of(refs["v"], bi, kvh, keys, self.btnh), sm["v"],
                                    bars["misc"].at[2 * w + 1])
        plgpu.barrier_wait(bars["misc"].at[2 * w])
        if self.want_dk:
            plgpu.barrier_wait(bars["misc"].at[2 * w + 1])
        # [keys, queries]: visible iff start + r <= q0 + c + offset.
        diag = lay.iota((bkv, bq), 0) - lay.iota((bkv, bq), 1)
        kept = None
        if self.key_mask:  # the block's keys that are kept, as rows of [keys, queries]
            plgpu.copy_gmem_to_smem(refs["keep"].at[bi, pl.ds(start, bkv)],
                                    sm["keep"].at[w], bars["keep"].at[w])
            plgpu.barrier_wait(bars["keep"].at[w])
            kept = lax.broadcast_in_dim(lay.vec(sm["keep"].at[w], 1), (bkv, bq), [0]) != 0.0
        return _DkdvBlock(sm, start, offset, diag, kept)

    def step(self, blk: _DkdvBlock, tile: _DkdvTile, bars, t, carry, accs=None,
             masked=True, slot=None):
        """Consumer step t (one query block, pallas_triton_vjp._dkdv_kernel.q_body op
        for op): ``s^T = K Q^T`` and ``dp^T = V dO^T``, P recomputed from lse (masked
        unless ``masked`` is False: every key of the block visible to every row),
        ``ds^T = p^T (dp^T - delta)``, then ``dV += p^T dO`` and ``dK += ds^T Q``;
        frees the slot. ``accs``: the (dK, dV) wgmma accumulators to sum into in place
        (the carry then stays as it is). ``slot``: the step's ring slot where the caller
        knows it as a constant (``static_slots``), else None (``t mod stages``)."""
        bq, bkv, d, lay, sm, cfg = BLOCK_Q, BLOCK_KV, self.d, self.lay, blk.sm, self.cfg
        want_dk, want_dv, gpu_operands = self.want_dk, self.want_dv, self.gpu_operands
        dk, dv = carry
        if slot is None:
            slot = lax.rem(t, jnp.int32(self.stages))
        q0 = (tile.first + lax.rem(t, tile.n)) * bq
        for name in ("lse", "delta", "q", "do", "qt", "dot"):  # (the streamed ones)
            if name in self.names:
                plgpu.barrier_wait(bars[name].at[slot])
        lse = lay.vec(sm["lse"].at[slot], 0)
        dlt = lay.vec(sm["delta"].at[slot], 0) if want_dk else None
        q_s, do_s = sm["q"].at[slot], sm["do"].at[slot]
        qt = _t(q_s) if gpu_operands else sm["qt"].at[slot]
        dot_ = (_t(do_s) if gpu_operands else sm["dot"].at[slot]) if want_dk else None
        s_t = _wgmma(sm["k"], qt, (bkv, bq))
        overlap = want_dk and cfg.dp_overlap  # P^T computed while dP^T runs
        if not overlap:
            dp_t = _wgmma(sm["v"], dot_, (bkv, bq)) if want_dk else None  # dV alone: no dP
        visible = self.visible(blk, q0, masked)
        lse_safe = jnp.where(lse == NEG_INF, POS_INF, lse)
        if overlap:
            def dp_and_p(dp_ref):
                plgpu.wgmma(dp_ref, sm["v"], dot_)
                p = _probs(cfg, s_t, lse_safe, self.scale, visible, 1)
                return dp_ref[...], p

            dp_t, p_t = pl.run_scoped(dp_and_p, plgpu.ACC((bkv, bq), jnp.float32))
        else:
            p_t = _probs(cfg, s_t, lse_safe, self.scale, visible, 1)
        p_op = (_a_operand(p_t.astype(self.dtype), sm.get("p"), gpu_operands) if want_dv
                else None)
        ds_op = None
        if want_dk:
            ds_t = p_t * (dp_t - lax.broadcast_in_dim(dlt, (bkv, bq), [1]))
            ds_op = _a_operand(ds_t.astype(self.dtype), sm.get("ds"), gpu_operands)
        if accs is not None:
            if want_dv:
                plgpu.wgmma(accs[1], p_op, do_s)
            if want_dk:
                plgpu.wgmma(accs[0], ds_op, q_s)
            plgpu.wgmma_wait(0)  # the slot's Q and dO are read: free it
        elif self.parts == "dkdv":
            pv = _wgmma(p_op, do_s, (bkv, d))
            dsq = _wgmma(ds_op, q_s, (bkv, d))
            dv, dk = dv + pv, dk + dsq
        elif want_dv:
            dv = dv + _wgmma(p_op, do_s, (bkv, d))
        else:
            dk = dk + _wgmma(ds_op, q_s, (bkv, d))
        plgpu.barrier_arrive(bars["free"].at[slot])
        self.after_step(blk, tile, t, ds_op)
        return dk, dv

    def after_step(self, blk: _DkdvBlock, tile: _DkdvTile, t, ds_op):
        """What step t does once its slot is free, with its ``dS^T`` operand ``ds_op``:
        nothing here (:class:`_DkdvFusedKernel`: its dQ share)."""

    def first_carry(self, zeros):
        """The in-place steps' initial carry: dK's and dV's placeholders
        (:class:`_DkdvFusedKernel`: beside its pending share)."""
        return zeros, zeros

    def after_steps(self, carry):
        """What the in-place mainloop does with its last carry: nothing here
        (:class:`_DkdvFusedKernel`: its pending share flushed)."""

    def visible(self, blk: _DkdvBlock, q0, masked):
        """The ``[keys, queries]`` mask of the step at query row ``q0`` (causal, kept
        keys), or None: unmasked (``masked`` False, or nothing to mask)."""
        if not masked:
            return None
        visible = blk.diag <= q0 + blk.offset - blk.start if self.causal else None
        if blk.kept is not None:
            visible = blk.kept if visible is None else visible & blk.kept
        return visible

    def mainloop(self, blk: _DkdvBlock, tile: _DkdvTile, bars):
        """Consumer mainloop: dK and dV summed over the steps, in the wgmma accumulators
        (``accumulate="inplace"``) or in registers (fresh products added); a part not
        computed keeps a placeholder (the loop carry's zeros)."""
        bkv, d = BLOCK_KV, self.d
        step = functools.partial(self.step, blk, tile, bars)
        zeros = self.lay.zeros((bkv, d))
        if self.inplace and self.parts == "dkdv":
            # The running sums live in wgmma accumulators across the query blocks.
            def run(dk_ref, dv_ref):
                dk_ref[...] = zeros
                dv_ref[...] = zeros
                self.after_steps(self.steps(
                    blk, tile, functools.partial(step, accs=(dk_ref, dv_ref)),
                    self.first_carry(zeros)))
                return dk_ref[...], dv_ref[...]

            return pl.run_scoped(run, plgpu.ACC((bkv, d), jnp.float32),
                                 plgpu.ACC((bkv, d), jnp.float32))
        if self.inplace:
            def run_one(acc_ref):
                acc_ref[...] = zeros
                accs = (acc_ref, None) if self.want_dk else (None, acc_ref)
                self.steps(blk, tile, functools.partial(step, accs=accs), (zeros, zeros))
                return acc_ref[...]

            one = pl.run_scoped(run_one, plgpu.ACC((bkv, d), jnp.float32))
            return (one, None) if self.want_dk else (None, one)
        return self.steps(blk, tile, step, (zeros, zeros))

    # -- epilogue

    def epilogue(self, blk: _DkdvBlock, tile: _DkdvTile, refs, dk, dv):
        """Epilogue: dK scaled, both cast to k's dtype and staged in the SMEM of K and V
        (no longer needed; dV alone, which holds no V, in K's), then stored by TMA."""
        sm, keys = blk.sm, pl.ds(blk.start, BLOCK_KV)
        dv_s = sm["v"] if self.want_dk else sm["k"]
        if self.want_dk:
            sm["k"][...] = (dk * self.scale).astype(self.dtype)
        if self.want_dv:
            dv_s[...] = dv.astype(self.dtype)
        plgpu.commit_smem()
        if self.want_dk:
            plgpu.copy_smem_to_gmem(sm["k"], tile_of(refs["dk"], tile.bi, tile.kvh, keys,
                                                   self.btnh))
        if self.want_dv:
            plgpu.copy_smem_to_gmem(dv_s, tile_of(refs["dv"], tile.bi, tile.kvh, keys,
                                                self.btnh))
        wait_stores(self.cfg.store_wait)

    def consume(self, w, refs, sm, bars, tile: _DkdvTile):
        """Compute warpgroup w: its block's prologue, mainloop and epilogue."""
        blk = self.load_block(w, refs, sm, bars, tile)
        dk, dv = self.mainloop(blk, tile, bars)
        self.epilogue(blk, tile, refs, dk, dv)

    # -- the kernel

    def smem(self):
        """The SMEM of a CTA: K and V per warpgroup, the ring's slots (and the staged A
        operands off the GPU operand path), and the keep values (``key_mask``)."""
        dtype, tr, nwg, stages, bq, bkv, d = (self.dtype, self.tr, self.nwg, self.stages,
                                              BLOCK_Q, BLOCK_KV, self.d)
        spec = {
            "k": plgpu.SMEM((nwg, bkv, d), dtype, transforms=tr(d)),
            "v": plgpu.SMEM((nwg, bkv, d), dtype, transforms=tr(d)),
            "q": plgpu.SMEM((stages, bq, d), dtype, transforms=tr(d)),
            "do": plgpu.SMEM((stages, bq, d), dtype, transforms=tr(d)),
            "lse": plgpu.SMEM((stages, bq), jnp.float32),
            "delta": plgpu.SMEM((stages, bq), jnp.float32),
        }
        if not self.want_dk:  # dV alone: no dP, so neither V nor delta
            del spec["v"], spec["delta"]
        if not self.gpu_operands:
            spec.update(
                qt=plgpu.SMEM((stages, d, bq), dtype, transforms=tr(bq)),
                dot=plgpu.SMEM((stages, d, bq), dtype, transforms=tr(bq)),
                p=plgpu.SMEM((nwg, bkv, bq), dtype, transforms=tr(bq)),
                ds=plgpu.SMEM((nwg, bkv, bq), dtype, transforms=tr(bq)))
        if self.key_mask:
            spec["keep"] = plgpu.SMEM((nwg, bkv), jnp.float32)
        bar_spec = {name: plgpu.Barrier(num_barriers=stages) for name in self.names}
        bar_spec["free"] = plgpu.Barrier(num_arrivals=nwg, num_barriers=stages)
        bar_spec["misc"] = plgpu.Barrier(num_barriers=2 * nwg)
        if self.key_mask:
            bar_spec["keep"] = plgpu.Barrier(num_barriers=nwg)
        return spec, bar_spec

    def kernel(self, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
        """The kernel body: the CTA's schedule, then ``nwg`` compute warpgroups and the
        producer warpgroup."""
        refs = dict(q=q_ref, k=k_ref, v=v_ref, do=do_ref, lse=lse_ref, delta=delta_ref)
        offs_ref = None
        if self.key_mask:
            refs["keep"], *rest = rest
        if self.dyn_offsets:
            offs_ref, *rest = rest
        if self.parts in ("dkdv", "pair"):
            *t_refs, refs["dk"], refs["dv"] = rest
        elif self.want_dk:
            *t_refs, refs["dk"] = rest
        else:
            *t_refs, refs["dv"] = rest
        if not self.gpu_operands:
            refs.update(qt=t_refs[0], dot=t_refs[1])
        tile = self.schedule(offs_ref)
        cfg, nwg, interpret = self.cfg, self.nwg, self.interpret

        def body(sm, bars):
            wg = lax.axis_index("wg")

            @pl.when(wg < nwg)
            def _():
                _set_registers(cfg, nwg, interpret, 0)
                self.consume(wg, refs, sm, bars, tile)

            @pl.when(wg == nwg)
            def _():
                _set_registers(cfg, nwg, interpret, 1)
                self.produce(refs, sm, bars, tile)

        pl.run_scoped(body, *self.smem(), collective_axes="wg")

    def out_types(self):
        """The kernel's outputs: dK and dV (or the one of ``parts``)."""
        kv_grad = jax.ShapeDtypeStruct(
            (self.b, self.skv, self.hkv, self.d) if self.btnh
            else (self.b, self.hkv, self.skv, self.d), self.dtype)
        return (kv_grad,) * (2 if self.parts in ("dkdv", "pair") else 1)

    def build(self):
        """The launch: one CTA per (``nwg`` KV blocks, KV head, batch), ``nwg + 1``
        warpgroups."""
        return launch(
            self.kernel, pdl=self.cfg.pdl, out_type=self.out_types(),
            grid=(self.skv // (self.kv_per_cta * BLOCK_KV), self.hkv, self.b),
            grid_names=("kv", "h", "b"),
            num_threads=self.nwg + 1, thread_name="wg",
            compiler_params=_compiler_params(self.cfg), interpret=self.interpret)


class _DkdvPairKernel(_DkdvKernel):
    """``BwdConfig.dkdv_pair``: dK and dV of one KV block by the two compute warpgroups
    of one CTA on one query stream (``parts="pair"``). Step t of warpgroup 0: ``s^T = K
    Q^T``, P^T from lse (masked), stored (fp32) in the P tile, ``dV += p^T dO``; of
    warpgroup 1: ``dp^T = V dO^T``, P^T read from the tile, ``ds^T = p^T (dp^T -
    delta)``, ``dK += ds^T Q``. Every value is computed by the operations of the split
    kernels (:class:`_DkdvKernel` with ``parts`` "dv" and "dk"), in the same order."""

    def load_block(self, w, refs, sm, bars, tile: _DkdvTile) -> _DkdvBlock:
        """Warpgroup w's prologue: K (and the keep values) for warpgroup 0, V for 1."""
        bq, bkv, lay, bi, kvh = BLOCK_Q, BLOCK_KV, self.lay, tile.bi, tile.kvh
        offset = self.offset_of(bi, tile.offs)
        keys = pl.ds(tile.start, bkv)
        name = "k" if w == 0 else "v"
        plgpu.copy_gmem_to_smem(tile_of(refs[name], bi, kvh, keys, self.btnh), sm[name],
                                bars["misc"].at[w])
        plgpu.barrier_wait(bars["misc"].at[w])
        diag = lay.iota((bkv, bq), 0) - lay.iota((bkv, bq), 1)
        kept = None
        if self.key_mask and w == 0:
            plgpu.copy_gmem_to_smem(refs["keep"].at[bi, keys], sm["keep"], bars["keep"].at[0])
            plgpu.barrier_wait(bars["keep"].at[0])
            kept = lax.broadcast_in_dim(lay.vec(sm["keep"], 1), (bkv, bq), [0]) != 0.0
        return _DkdvBlock(sm, tile.start, offset, diag, kept)

    def step_dv(self, blk: _DkdvBlock, tile: _DkdvTile, bars, t, carry, accs=None,
                masked=True):
        """Warpgroup 0's step t: P^T (the split dV kernel's), handed to warpgroup 1
        through the P tile, and dV."""
        bq, bkv, sm, cfg = BLOCK_Q, BLOCK_KV, blk.sm, self.cfg
        gpu_operands = self.gpu_operands
        slot = self.wait_step(bars, t, ("lse", "q", "do") + (() if gpu_operands else ("qt",)))
        q0 = (tile.first + lax.rem(t, tile.n)) * bq
        lse = self.lay.vec(sm["lse"].at[slot], 0)
        q_s, do_s = sm["q"].at[slot], sm["do"].at[slot]
        qt = _t(q_s) if gpu_operands else sm["qt"].at[slot]
        s_t = _wgmma(sm["k"], qt, (bkv, bq))
        lse_safe = jnp.where(lse == NEG_INF, POS_INF, lse)
        p_t = _probs(cfg, s_t, lse_safe, self.scale, self.visible(blk, q0, masked), 1)

        @pl.when(t > 0)
        def _():  # warpgroup 1 has read the last step's P^T
            plgpu.barrier_wait(bars["p_free"].at[0])

        sm["pt"][...] = p_t
        plgpu.barrier_arrive(bars["p_full"].at[0])
        p_op = _a_operand(p_t.astype(self.dtype), sm.get("p"), gpu_operands)
        return self.add_and_free(carry, accs, 1, p_op, do_s, bars, slot)

    def step_dk(self, blk: _DkdvBlock, tile: _DkdvTile, bars, t, carry, accs=None,
                masked=True):
        """Warpgroup 1's step t: dP^T, P^T from the P tile, dS^T (the split dK kernel's
        operations) and dK. ``masked`` is warpgroup 0's (P^T comes masked)."""
        del masked
        bq, bkv, sm = BLOCK_Q, BLOCK_KV, blk.sm
        gpu_operands = self.gpu_operands
        slot = self.wait_step(bars, t, ("delta", "q", "do") + (() if gpu_operands
                                                              else ("dot",)))
        dlt = self.lay.vec(sm["delta"].at[slot], 0)
        q_s, do_s = sm["q"].at[slot], sm["do"].at[slot]
        dot_ = _t(do_s) if gpu_operands else sm["dot"].at[slot]
        dp_t = _wgmma(sm["v"], dot_, (bkv, bq))
        plgpu.barrier_wait(bars["p_full"].at[0])
        p_t = self.lay.tile(sm["pt"])
        plgpu.barrier_arrive(bars["p_free"].at[0])
        ds_t = p_t * (dp_t - lax.broadcast_in_dim(dlt, (bkv, bq), [1]))
        ds_op = _a_operand(ds_t.astype(self.dtype), sm.get("ds"), gpu_operands)
        return self.add_and_free(carry, accs, 0, ds_op, q_s, bars, slot)

    def wait_step(self, bars, t, names):
        """Step t's ring slot, once the streams ``names`` (those the warpgroup reads)
        have arrived there."""
        slot = lax.rem(t, jnp.int32(self.stages))
        for name in names:
            plgpu.barrier_wait(bars[name].at[slot])
        return slot

    def add_and_free(self, carry, accs, which, a_op, b_s, bars, slot):
        """``a_op @ b_s`` added to sum ``which`` (0: dK, 1: dV) of the carry: in place
        into ``accs[which]`` (awaited: the slot's operands are read) or as a fresh
        product; then the ring's slot is freed."""
        sums = list(carry)
        if accs is not None:
            plgpu.wgmma(accs[which], a_op, b_s)
            plgpu.wgmma_wait(0)
        else:
            sums[which] = sums[which] + _wgmma(a_op, b_s, (BLOCK_KV, self.d))
        plgpu.barrier_arrive(bars["free"].at[slot])
        return tuple(sums)

    def run_role(self, w, blk: _DkdvBlock, tile: _DkdvTile, bars):
        """Warpgroup w's loop over the steps: its sum (dV for 0, dK for 1)."""
        bkv, d = BLOCK_KV, self.d
        step = functools.partial(self.step_dv if w == 0 else self.step_dk, blk, tile, bars)
        zeros = self.lay.zeros((bkv, d))
        if self.inplace:
            def run_one(acc_ref):
                acc_ref[...] = zeros
                accs = (None, acc_ref) if w == 0 else (acc_ref, None)
                self.steps(blk, tile, functools.partial(step, accs=accs), (zeros, zeros))
                return acc_ref[...]

            return pl.run_scoped(run_one, plgpu.ACC((bkv, d), jnp.float32))
        dk, dv = self.steps(blk, tile, step, (zeros, zeros))
        return dv if w == 0 else dk

    def consume(self, w, refs, sm, bars, tile: _DkdvTile):
        """Warpgroup 0 sums dV and stores it (staged in K's SMEM), warpgroup 1 sums dK
        and stores it scaled (staged in V's)."""
        for role in (0, 1):
            @pl.when(w == role)
            def _(role=role):  # (traced here, once)
                blk = self.load_block(role, refs, sm, bars, tile)
                acc = self.run_role(role, blk, tile, bars)
                if role == 0:  # the last step's P^T read (every phase observed)
                    @pl.when(tile.total > 0)
                    def _():
                        plgpu.barrier_wait(bars["p_free"].at[0])

                name, out = ("k", "dv") if role == 0 else ("v", "dk")
                val = acc if role == 0 else acc * self.scale
                sm[name][...] = val.astype(self.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(sm[name], tile_of(refs[out], tile.bi, tile.kvh,
                                                          pl.ds(tile.start, BLOCK_KV),
                                                          self.btnh))
                wait_stores(self.cfg.store_wait)

    def smem(self):
        """K and V of the CTA's block, the ring's slots, the P^T tile (fp32), the
        staged A operands off the GPU operand path, the keep values."""
        dtype, tr, stages, bq, bkv, d = (self.dtype, self.tr, self.stages, BLOCK_Q,
                                         BLOCK_KV, self.d)
        spec = {
            "k": plgpu.SMEM((bkv, d), dtype, transforms=tr(d)),
            "v": plgpu.SMEM((bkv, d), dtype, transforms=tr(d)),
            "q": plgpu.SMEM((stages, bq, d), dtype, transforms=tr(d)),
            "do": plgpu.SMEM((stages, bq, d), dtype, transforms=tr(d)),
            "lse": plgpu.SMEM((stages, bq), jnp.float32),
            "delta": plgpu.SMEM((stages, bq), jnp.float32),
            "pt": plgpu.SMEM((bkv, bq), jnp.float32, transforms=_smem_transforms(bq, 4)),
        }
        if not self.gpu_operands:
            spec.update(
                qt=plgpu.SMEM((stages, d, bq), dtype, transforms=tr(bq)),
                dot=plgpu.SMEM((stages, d, bq), dtype, transforms=tr(bq)),
                p=plgpu.SMEM((bkv, bq), dtype, transforms=tr(bq)),
                ds=plgpu.SMEM((bkv, bq), dtype, transforms=tr(bq)))
        if self.key_mask:
            spec["keep"] = plgpu.SMEM((bkv,), jnp.float32)
        bar_spec = {name: plgpu.Barrier(num_barriers=stages) for name in self.names}
        bar_spec["free"] = plgpu.Barrier(num_arrivals=2, num_barriers=stages)
        bar_spec["misc"] = plgpu.Barrier(num_barriers=2)
        bar_spec["p_full"] = plgpu.Barrier(num_barriers=1)
        bar_spec["p_free"] = plgpu.Barrier(num_barriers=1)
        if self.key_mask:
            bar_spec["keep"] = plgpu.Barrier(num_barriers=1)
        return spec, bar_spec


class _DkdvFusedKernel(_DkdvKernel):
    """``BwdConfig.fused_dq``: the dK/dV kernel (``parts="dkdv"``, in place, on the GPU)
    that also forms dQ. After step t (query tile i of head h) warpgroup w, which holds
    key block ``kb``, stages its ``dS^T`` in SMEM, takes ``dS K`` (64 x D, a fresh
    accumulator, through a transposed view of the staged tile: the dQ kernel's product
    on the same values) into its fp32 share tile, waits until the tile's semaphore
    counts ``kb`` shares added (every key block below ``kb`` that the tile sees: the
    dQ kernel's ascending order), stores the share (``kb`` 0) or reduce-adds it into
    the kernel's third output ``dq_acc`` (``[B, Hq, Sq, D]`` fp32, unscaled) by TMA,
    awaits the copy's writes, and signals; the tile's last key block takes the count
    back to zero instead (``pl.get_global`` semaphores outlive the launch). A key block
    the tile does not see adds nothing (warpgroup 1's extra masked steps). Tiles that
    see no key get no share: :func:`_finish_fused_dq` zeroes them."""

    def __post_init__(self):
        super().__post_init__()
        if self.interpret is not None or not self.gpu_operands or not self.inplace:
            raise ValueError("fused_dq needs the GPU: the interpreter has no semaphores "
                             "or TMA reduce-adds (and the GPU operand path, in place)")
        if self.d > 128:
            raise ValueError(f"fused_dq is for D <= 128 (dK and dV in one kernel), got "
                             f"D={self.d}")
        if self.key_mask or self.dyn_offsets:
            raise ValueError(f"fused_dq takes no key mask (nor a key count off the "
                             f"{BLOCK_KV}-key grid, which the backward masks) and no "
                             f"per-sequence offsets")
        self.n_kv = self.skv // BLOCK_KV

    def load_block(self, w, refs, sm, bars, tile: _DkdvTile) -> _DkdvBlock:
        """The base prologue; the block's views also hold its warpgroup's dS^T and
        share tiles."""
        blk = super().load_block(w, refs, sm, bars, tile)
        return blk._replace(sm=dict(blk.sm, dst=sm["dst"].at[w], dqs=sm["dqs"].at[w]))

    def step(self, blk: _DkdvBlock, tile: _DkdvTile, bars, t, carry, accs=None,
             masked=True, slot=None):
        """The base step, its carry ``((dk, dv), pend)``: ``pend`` the warpgroup's share
        not yet signalled (``dq_signal="next_step"``; int32 ``(issued, semaphore index,
        last)``), handed to and from :meth:`after_step` within the step's trace."""
        base, self._pend = carry
        out = super().step(blk, tile, bars, t, base, accs=accs, masked=masked, slot=slot)
        return out, self._pend

    def first_carry(self, zeros):
        """dK's and dV's placeholders, and no share pending."""
        return (zeros, zeros), (jnp.int32(0),) * 3

    def after_steps(self, carry):
        """The share still pending after the last step, flushed."""
        self.flush(carry[1])

    def flush(self, pend):
        """A share issued and not yet signalled (``pend``): its writes awaited, then the
        tile's semaphore signalled (not for a tile's last share, whose wait reset it)."""
        issued, idx, last = pend

        @pl.when(issued != 0)
        def _():
            plgpu.wait_smem_to_gmem(0)  # its writes done before the count moves on
            pl.when(last == 0)(lambda: plgpu.semaphore_signal(
                self.sems.at[idx], 1, memory_scope="gpu"))

    def after_step(self, blk: _DkdvBlock, tile: _DkdvTile, t, ds_op):
        bq, bkv = BLOCK_Q, BLOCK_KV
        sm, now = blk.sm, self.cfg.dq_signal == "step_end"
        i = tile.first + lax.rem(t, tile.n)
        h = tile.kvh * self.group + lax.div(t, tile.n)
        kb = lax.div(blk.start, jnp.int32(bkv))
        hi = _last_kvblock(i * bq, causal=self.causal, offset=blk.offset, n_kv=self.n_kv)
        idx = (tile.bi * self.hq + h) * self.n_q + i
        visible, last = kb < hi, kb == hi - 1
        if not now:
            self.flush(self._pend)  # the previous step's share

        @pl.when(visible)
        def _():
            sm["dst"][...] = ds_op  # [keys, queries]
            plgpu.commit_smem()
            share = _wgmma(_t(sm["dst"]), sm["k"], (bq, self.d))  # dS [queries, keys] K
            sm["dqs"][...] = share  # (the last share's writes awaited by its flush)
            plgpu.commit_smem()
            sem = self.sems.at[idx]
            pl.when(~last)(lambda: plgpu.semaphore_wait(sem, kb, decrement=False,
                                                        memory_scope="gpu"))
            pl.when(last)(lambda: plgpu.semaphore_wait(sem, kb, decrement=True,
                                                       memory_scope="gpu"))
            dst = self.dq_ref.at[tile.bi, h, pl.ds(i * bq, bq)]
            pl.when(kb == 0)(lambda: plgpu.copy_smem_to_gmem(sm["dqs"], dst))
            pl.when(kb > 0)(lambda: plgpu.copy_smem_to_gmem(sm["dqs"], dst,
                                                            reduction_op="add"))
            if now:
                self.flush((jnp.int32(1), idx, last.astype(jnp.int32)))

        self._pend = ((jnp.int32(0),) * 3 if now else
                      (visible.astype(jnp.int32), idx, last.astype(jnp.int32)))

    def smem(self):
        """The base SMEM, and per compute warpgroup a dS^T tile (bf16) and a share tile
        (fp32)."""
        spec, bar_spec = super().smem()
        nwg, bq, bkv, d = self.nwg, BLOCK_Q, BLOCK_KV, self.d
        spec["dst"] = plgpu.SMEM((nwg, bkv, bq), self.dtype, transforms=self.tr(bq))
        spec["dqs"] = plgpu.SMEM((nwg, bq, d), jnp.float32,
                                 transforms=_smem_transforms(d, 4))
        return spec, bar_spec

    def kernel(self, *refs):
        """The base kernel, with ``dq_acc`` (the last output) and the tiles' semaphores
        kept for :meth:`after_step`."""
        *refs, self.dq_ref = refs
        self.sems = pl.get_global(plgpu.SemaphoreType.REGULAR((self.b * self.hq * self.n_q,)))
        super().kernel(*refs)

    def out_types(self):
        return (*super().out_types(),
                jax.ShapeDtypeStruct((self.b, self.hq, self.sq, self.d), jnp.float32))


def _finish_fused_dq(acc, *, offset: int, causal: bool, scale: float, dtype, btnh: bool):
    """:class:`_DkdvFusedKernel`'s ``dq_acc`` as the dQ kernel's ``finish`` leaves it:
    the tiles that see no key zeroed (no share reached them), ``acc * scale`` cast to
    ``dtype``; ``[B, S, H, D]`` with ``btnh``."""
    if causal:
        n_q = acc.shape[2] // BLOCK_Q
        blind = sum(1 for i in range(n_q) if i * BLOCK_Q + (BLOCK_Q - 1) + offset < 0)
        if blind:
            acc = acc.at[:, :, :blind * BLOCK_Q].set(0.0)
    dq = (acc * scale).astype(dtype)
    return jnp.swapaxes(dq, 1, 2) if btnh else dq


def _build_dkdv(**kw):
    """The dK/dV kernel (:class:`_DkdvKernel`'s parameters; ``parts="pair"``:
    :class:`_DkdvPairKernel`; ``parts="fused"``: :class:`_DkdvFusedKernel`)."""
    if kw.get("parts") == "fused":
        return _DkdvFusedKernel(**dict(kw, parts="dkdv")).build()
    cls = _DkdvPairKernel if kw.get("parts") == "pair" else _DkdvKernel
    return cls(**kw).build()


# --------------------------------------------------------------------------------- dQ


def _last_kvblock(q0, *, causal, offset, n_kv):
    """KV blocks [0, hi) that a row of the tile at ``q0`` sees (pallas_triton_vjp's
    ``hi``)."""
    if not causal:
        return jnp.int32(n_kv)
    last = q0 + (BLOCK_Q - 1) + offset
    return lax.min(lax.div(lax.max(last + BLOCK_KV, 0), jnp.int32(BLOCK_KV)),
                   jnp.int32(n_kv))


class _DqTile(NamedTuple):
    """A dQ CTA's place in the schedule (:meth:`_DqKernel.schedule`): batch ``bi``,
    query head ``h`` (of KV head ``kvh``), first row ``tile0`` of its ``nwg`` tiles and
    ``hi_cta``, the KV blocks [0, hi_cta) that its last tile sees (a superset of every
    tile's); ``offs``: the ``offs`` ref (``dyn_offsets``) or None."""

    bi: jax.Array
    h: jax.Array
    kvh: jax.Array
    tile0: jax.Array
    hi_cta: jax.Array
    offs: object


class _DqRows(NamedTuple):
    """A compute warpgroup's query tile (:meth:`_DqKernel.load_rows`): first row
    ``q0``, the causal ``offset``, the KV blocks [0, hi) its rows see, its rows
    ``rows_sl``, its SMEM ``own`` (Q, dO, lse, delta, the fp32 output tile), the rows'
    ``lse_safe`` and delta ``dlt``, the tile's ``diag`` (key index minus query index)
    and ``ds_s`` (the staged dS off the GPU operand path, or None)."""

    q0: jax.Array
    offset: object
    hi: jax.Array
    rows_sl: object
    own: dict
    lse_safe: jax.Array
    dlt: jax.Array
    diag: jax.Array
    ds_s: object


@dataclasses.dataclass(kw_only=True)
class _DqKernel:
    """The dQ kernel: the unscaled fp32 dQ accumulator; ``offset``, ``key_mask`` and
    ``dyn_offsets`` as in :class:`_DkdvKernel` (the keep values stream with K and V).
    ``continue_acc``: the kernel also takes ``acc`` (fp32 ``[B, Hq, sq, D]``, after
    ``offs``) and goes on from it instead of from zero (dQ over key ranges in ascending
    order: context parallelism), the same additions as one call over their union.
    ``finish``: the kernel stores dQ itself, ``(acc * scale)`` cast to the inputs' dtype
    (the product and the rounding that XLA applied to the fp32 accumulator after the
    kernel: the same bits, without the accumulator's round trip through HBM).

    The fields are the static launch parameters; the stages, in schedule order, are
    :meth:`schedule` (tile scheduler), :meth:`produce` (producer warpgroup: the TMA
    ring of K, V and the keep values), the consumer's :meth:`load_rows`,
    :meth:`mainloop` (over :meth:`step`, then :meth:`release`) and :meth:`epilogue`;
    :meth:`kernel` ties them together and :meth:`build` launches it."""

    b: int
    hq: int
    hkv: int
    sq: int
    skv: int
    d: int
    dtype: object
    causal: bool
    scale: float
    cfg: BwdConfig
    gpu_operands: bool
    interpret: object
    offset: int | None = None
    key_mask: bool = False
    dyn_offsets: bool = False
    continue_acc: bool = False
    finish: bool = False
    btnh: bool = False

    def __post_init__(self):
        cfg, bq, d = self.cfg, BLOCK_Q, self.d
        self.stages = cfg.stages
        # Two tiles need the Hopper operand path's SMEM at D=128: the staged operands of
        # the other path (K^T, V^T, ds) exceed the H200's 227 KiB there. At D=256 one
        # tile and one K/V slot fit (Q, dO, the fp32 output tile and K, V: 192 KiB);
        # launch parameters, the same operations.
        self.nwg = (cfg.dq_wgs if self.sq % (cfg.dq_wgs * bq) == 0
                    and (self.gpu_operands or d <= 64) and d <= 128 else 1)
        #: Compute warpgroups: one a tile (``dq_pair``'s subclass: two on one tile).
        self.n_compute = self.nwg
        if d > 128:
            self.stages = 1
        #: ``BwdConfig.dq_split_ring``, where it applies (with a key mask the keep
        #: values' slots, each padded to 1 KiB, pass the SMEM by 96 bytes at D=256).
        self.split_ring = (cfg.dq_split_ring is not False) and d > 128 and not self.key_mask
        #: ``BwdConfig.dq_in_smem``, resolved (None: where D > 128).
        self.dq_in_smem = cfg.dq_in_smem if cfg.dq_in_smem is not None else d > 128
        self.group, self.n_kv = self.hq // self.hkv, self.skv // BLOCK_KV
        self.static_offset = self.skv - self.sq if self.offset is None else self.offset
        self.lay = _Layouts(self.interpret)
        self.tr = functools.partial(_smem_transforms,
                                    itemsize=jnp.dtype(self.dtype).itemsize)
        #: The streamed operands, in the ring's copy order.
        self.names = ((["k", "v"] if self.gpu_operands else ["k", "kt", "vt"])
                      + (["keep"] if self.key_mask else []))
        #: The rings: ``(names, slots, free barrier)``; with ``split_ring``, V (read by
        #: dP alone) in a ring of its own, freed early.
        early = ("v" if self.gpu_operands else "vt",) if self.split_ring else ()
        late = tuple(n for n in self.names if n not in early)
        self.rings = ([(late, self.stages + 1, "free"), (early, self.stages, "free_v")]
                      if early else [(late, self.stages, "free")])
        self.slots = {n: slots for names, slots, _ in self.rings for n in names}

    def offset_of(self, bi, offs_ref):
        """The causal offset of sequence ``bi`` (read from ``offs`` with
        ``dyn_offsets``)."""
        return offs_ref[bi] if self.dyn_offsets else self.static_offset

    # -- tile scheduler

    def schedule(self, offs_ref) -> _DqTile:
        """Tile scheduler: the CTA (grid ``(q, h, b)``) holds ``nwg`` consecutive query
        tiles of 64 rows from ``tile0`` and walks the KV blocks [0, hi_cta) in
        ascending order."""
        bq, nwg = BLOCK_Q, self.nwg
        qi, h, bi = lax.axis_index("q"), lax.axis_index("h"), lax.axis_index("b")
        kvh = lax.div(h, jnp.int32(self.group))
        tile0 = qi * (nwg * bq)
        # The blocks of the CTA's last tile: a superset of every tile's.
        hi_cta = _last_kvblock(tile0 + (nwg - 1) * bq, causal=self.causal,
                               offset=self.offset_of(bi, offs_ref), n_kv=self.n_kv)
        return _DqTile(bi, h, kvh, tile0, hi_cta, offs_ref)

    # -- producer

    def produce(self, srcs, sm, bars, tile: _DqTile):
        """Producer warpgroup: the TMA ring; block j's K and V (K, K^T and V^T off the
        GPU operand path) and keep values go to slot ``j % stages``."""
        bkv, bi, kvh = BLOCK_KV, tile.bi, tile.kvh

        def source(name, ref, j):
            cols = pl.ds(j * bkv, bkv)
            if name == "keep":
                return ref.at[bi, cols]
            if name in ("kt", "vt"):
                return ref.at[bi, kvh, :, cols]
            return tile_of(ref, bi, kvh, cols, self.btnh)

        _produce(srcs, sm, bars, self.stages, tile.hi_cta, source,
                 self.rings if self.split_ring else None)

    # -- consumer

    def load_rows(self, w, refs, sm, bars, tile: _DqTile) -> _DqRows:
        """Consumer prologue: warpgroup w holds the CTA's w-th tile of 64 rows and loads
        its Q, dO, lse and delta (and the accumulator so far: ``continue_acc``) once."""
        bq, bkv, lay, bi, h = BLOCK_Q, BLOCK_KV, self.lay, tile.bi, tile.h
        q0 = tile.tile0 + w * bq
        offset = self.offset_of(bi, tile.offs)
        hi = _last_kvblock(q0, causal=self.causal, offset=offset, n_kv=self.n_kv)
        rows_sl = pl.ds(q0, bq)
        row_names = ("q", "do", "lse", "delta")
        own = {name: sm[name].at[w] for name in (*row_names, "out")}
        srcs = [(name, refs[name]) for name in row_names]
        if self.continue_acc:  # the accumulator so far, into the output tile's SMEM
            srcs.append(("out", refs["acc_in"]))
        for i, (name, ref) in enumerate(srcs):
            plgpu.copy_gmem_to_smem(tile_of(ref, bi, h, rows_sl,
                                          self.btnh and name in ("q", "do", "out")),
                                    own[name],
                                    bars["misc"].at[5 * w + i])
        for i in range(len(srcs)):
            plgpu.barrier_wait(bars["misc"].at[5 * w + i])
        lse = lay.vec(own["lse"], 1)
        dlt = lay.vec(own["delta"], 1)
        lse_safe = jnp.where(lse == NEG_INF, POS_INF, lse)
        # [queries, keys]: visible iff j * bkv + c <= q0 + r + offset.
        diag = lay.iota((bq, bkv), 1) - lay.iota((bq, bkv), 0)
        ds_s = sm["ds"].at[w] if "ds" in sm else None
        return _DqRows(q0, offset, hi, rows_sl, own, lse_safe, dlt, diag, ds_s)

    def step(self, rows: _DqRows, sm, bars, j, dq, masked=True):
        """Consumer step j (one KV block, pallas_triton_vjp._dq_kernel.body op for op):
        ``s = Q K^T`` and ``dp = dO V^T``, P recomputed from lse (masked unless
        ``masked`` is False: every key of the block visible to every row),
        ``ds = p (dp - delta)``, ``dQ += ds K``; frees the slot."""
        bq, bkv, lay, gpu_operands = BLOCK_Q, BLOCK_KV, self.lay, self.gpu_operands
        slot = self.slot_of(j)
        for name in self.names:
            plgpu.barrier_wait(bars[name].at[slot[name]])
        k_s = sm["k"].at[slot["k"]]
        kt = _t(k_s) if gpu_operands else sm["kt"].at[slot["kt"]]
        vt = _t(sm["v"].at[slot["v"]]) if gpu_operands else sm["vt"].at[slot["vt"]]
        s = _wgmma(rows.own["q"], kt, (bq, bkv))
        dp = _wgmma(rows.own["do"], vt, (bq, bkv))
        if self.split_ring:  # V is read: its slot takes the next block's
            plgpu.barrier_arrive(bars["free_v"].at[slot["free_v"]])
        p = _probs(self.cfg, s, rows.lse_safe, self.scale,
                   self.visible(rows, sm, slot, j, masked), 0)
        ds = p * (dp - lax.broadcast_in_dim(rows.dlt, (bq, bkv), [0]))
        ds_op = _a_operand(ds.astype(self.dtype), rows.ds_s, gpu_operands)
        if self.dq_in_smem:  # the running dQ in the output tile, a column chunk at a time
            for cols in self.dq_chunks():
                ref = rows.own["out"].at[:, cols]
                ref[...] = lay.tile(ref) + _wgmma(ds_op, k_s.at[:, cols],
                                                  (bq, DQ_SMEM_COLS))
        else:
            dq = dq + _wgmma(ds_op, k_s, (bq, self.d))
        plgpu.barrier_arrive(bars["free"].at[slot["free"]])
        return dq

    def visible(self, rows: _DqRows, sm, slot, j, masked):
        """Block j's mask of the tile (None: every key visible to every row, or
        ``masked`` False): causal and the keep values in the block's slot."""
        if not masked:
            return None
        bq, bkv = BLOCK_Q, BLOCK_KV
        visible = rows.diag <= rows.q0 + rows.offset - j * bkv if self.causal else None
        if self.key_mask:
            kept = lax.broadcast_in_dim(self.lay.vec(sm["keep"].at[slot["keep"]], 0),
                                        (bq, bkv), [1]) != 0.0
            visible = kept if visible is None else visible & kept
        return visible

    def slot_of(self, j):
        """Block j's slot in each stream's ring and in each ring's free barriers (by
        name)."""
        by_count = {k: lax.rem(j, jnp.int32(k)) for _, k, _ in self.rings}
        slots = {n: by_count[k] for n, k in self.slots.items()}
        slots.update({free: by_count[k] for _, k, free in self.rings})
        return slots

    def dq_chunks(self):
        """``dq_in_smem``: the column slices of dQ taken at a time, in column order."""
        return [pl.ds(c, DQ_SMEM_COLS) for c in range(0, self.d, DQ_SMEM_COLS)]

    def release(self, bars, j, _):
        """Consumer step j of a block that only the other warpgroup's tile sees: waits
        for the slot and frees it unread."""
        slot = self.slot_of(j)
        for name in self.names:
            plgpu.barrier_wait(bars[name].at[slot[name]])
        for _, _, free in self.rings:
            plgpu.barrier_arrive(bars[free].at[slot[free]])
        return None

    def mainloop(self, rows: _DqRows, tile: _DqTile, sm, bars, step=None, dq=None):
        """Consumer mainloop: the tile walks the blocks its rows see ([0, hi)) exactly
        as a CTA of one warpgroup would (with ``mask="probs"`` and a causal mask alone,
        those whose last key the tile's first row sees unmasked), then releases the
        blocks only the other warpgroup needs ([hi, hi_cta)) unread. ``step`` and the
        initial ``dq``: :meth:`step` and the tile's own (given: ``dq_pair``'s)."""
        step = functools.partial(step or self.step, rows, sm, bars)
        hi, q0, offset, bkv = rows.hi, rows.q0, rows.offset, BLOCK_KV
        if dq is None and self.dq_in_smem:  # the tile holds dQ: acc_in's, or zeros
            if not self.continue_acc:
                for cols in self.dq_chunks():
                    rows.own["out"].at[:, cols][...] = self.lay.zeros(
                        (BLOCK_Q, DQ_SMEM_COLS))
        elif dq is None:
            dq = (self.lay.tile(rows.own["out"]) if self.continue_acc
                  else self.lay.zeros((BLOCK_Q, self.d)))
        if self.cfg.mask == "scores" or not self.causal or self.key_mask:
            dq = lax.fori_loop(0, hi, step, dq)
        else:
            # Blocks whose last key the tile's first row sees: no mask (mask="probs").
            full = lax.min(lax.div(lax.max(q0 + offset + 1, 0), jnp.int32(bkv)), hi)
            dq = lax.fori_loop(0, full, functools.partial(step, masked=False), dq)
            dq = lax.fori_loop(full, hi, step, dq)
        if self.nwg > 1:
            lax.fori_loop(hi, tile.hi_cta, functools.partial(self.release, bars), None)
        return dq

    # -- epilogue

    def epilogue(self, rows: _DqRows, tile: _DqTile, refs, dq):
        """Epilogue: the fp32 dQ tile staged in SMEM and stored by TMA; with ``finish``,
        ``dq * scale`` in the inputs' dtype, staged in the Q tile's SMEM (every wgmma
        that read Q has been waited for: its results are in ``dq``)."""
        if self.dq_in_smem:  # (dq is None: the output tile holds it)
            staged = rows.own["q"] if self.finish else rows.own["out"]
            if self.finish:
                for cols in self.dq_chunks():
                    staged.at[:, cols][...] = (self.lay.tile(rows.own["out"].at[:, cols])
                                               * self.scale).astype(self.dtype)
        elif self.finish:
            staged = rows.own["q"]
            staged[...] = (dq * self.scale).astype(self.dtype)
        else:
            staged = rows.own["out"]
            staged[...] = dq
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(staged, tile_of(refs["acc"], tile.bi, tile.h, rows.rows_sl,
                                                self.btnh))
        wait_stores(self.cfg.store_wait)

    def consume(self, w, refs, sm, bars, tile: _DqTile):
        """Compute warpgroup w: its tile's prologue, mainloop and epilogue."""
        rows = self.load_rows(w, refs, sm, bars, tile)
        dq = self.mainloop(rows, tile, sm, bars)
        self.epilogue(rows, tile, refs, dq)

    # -- the kernel

    def smem(self):
        """The SMEM of a CTA: each warpgroup's Q, dO, lse, delta and fp32 output tile
        (and staged dS off the GPU operand path), and the ring's slots."""
        dtype, tr, nwg, slots, bq, bkv, d = (self.dtype, self.tr, self.nwg, self.slots,
                                              BLOCK_Q, BLOCK_KV, self.d)
        spec = {
            "q": plgpu.SMEM((nwg, bq, d), dtype, transforms=tr(d)),
            "do": plgpu.SMEM((nwg, bq, d), dtype, transforms=tr(d)),
            "lse": plgpu.SMEM((nwg, bq), jnp.float32),
            "delta": plgpu.SMEM((nwg, bq), jnp.float32),
            "out": plgpu.SMEM((nwg, bq, d), jnp.float32,
                              transforms=_smem_transforms(d, 4)),
            "k": plgpu.SMEM((slots["k"], bkv, d), dtype, transforms=tr(d)),
        }
        if self.gpu_operands:
            spec["v"] = plgpu.SMEM((slots["v"], bkv, d), dtype, transforms=tr(d))
        else:
            spec.update(
                kt=plgpu.SMEM((slots["kt"], d, bkv), dtype, transforms=tr(bkv)),
                vt=plgpu.SMEM((slots["vt"], d, bkv), dtype, transforms=tr(bkv)),
                ds=plgpu.SMEM((nwg, bq, bkv), dtype, transforms=tr(bkv)))
        if self.key_mask:
            spec["keep"] = plgpu.SMEM((slots["keep"], bkv), jnp.float32)
        bar_spec = {name: plgpu.Barrier(num_barriers=slots[name]) for name in self.names}
        for _, count, free in self.rings:
            bar_spec[free] = plgpu.Barrier(num_arrivals=nwg, num_barriers=count)
        bar_spec["misc"] = plgpu.Barrier(num_barriers=5 * nwg)
        return spec, bar_spec

    def kernel(self, q_ref, do_ref, lse_ref, delta_ref, *rest):
        """The kernel body: the CTA's schedule, then ``nwg`` compute warpgroups and the
        producer warpgroup."""
        refs = dict(q=q_ref, do=do_ref, lse=lse_ref, delta=delta_ref)
        *kv_refs, refs["acc"] = rest
        offs_ref = None
        if self.continue_acc:
            *kv_refs, refs["acc_in"] = kv_refs
        if self.dyn_offsets:
            *kv_refs, offs_ref = kv_refs
        tile = self.schedule(offs_ref)
        srcs = dict(zip(self.names, kv_refs, strict=True))
        cfg, n, interpret = self.cfg, self.n_compute, self.interpret

        def body(sm, bars):
            wg = lax.axis_index("wg")

            @pl.when(wg < n)
            def _():
                _set_registers(cfg, n, interpret, 0)
                self.consume(wg, refs, sm, bars, tile)

            @pl.when(wg == n)
            def _():
                _set_registers(cfg, n, interpret, 1)
                self.produce(srcs, sm, bars, tile)

        pl.run_scoped(body, *self.smem(), collective_axes="wg")

    def build(self):
        """The launch: one CTA per (``nwg`` query tiles, query head, batch), the
        ``n_compute`` compute warpgroups and the producer."""
        return launch(
            self.kernel,
            pdl=self.cfg.pdl,
            out_type=jax.ShapeDtypeStruct(
                (self.b, self.sq, self.hq, self.d) if self.btnh
                else (self.b, self.hq, self.sq, self.d),
                self.dtype if self.finish else jnp.float32),
            grid=(self.sq // (self.nwg * BLOCK_Q), self.hq, self.b),
            grid_names=("q", "h", "b"),
            num_threads=self.n_compute + 1, thread_name="wg",
            compiler_params=_compiler_params(self.cfg), interpret=self.interpret)


class _DqPairKernel(_DqKernel):
    """``BwdConfig.dq_pair``: one query tile's dQ by two compute warpgroups. Step j of
    warpgroup 0: ``s = Q K^T``, P from lse (masked), stored (fp32) in the P tile, then,
    once warpgroup 1 has stored dS, ``dQ[:, :D/2] += dS K[:, :D/2]``; of warpgroup 1:
    ``dp = dO V^T``, P read from the P tile, ``ds = p (dp - delta)`` stored (in the
    inputs' dtype) in the dS tile, ``dQ[:, D/2:] += dS K[:, D/2:]``. Each value is
    computed by :class:`_DqKernel`'s operations (every dQ element a fresh product over
    the block's keys added to the running value), so the bits are its bits. Serves
    ``finish`` without ``continue_acc`` (the dQ of :func:`backward`)."""

    def __post_init__(self):
        super().__post_init__()
        self.nwg, self.n_compute, self.dq_in_smem, self.half = 1, 2, False, self.d // 2
        gpu = self.gpu_operands
        #: The streams each warpgroup reads (0: S, the mask, dQ; 1: dP, dQ).
        self.reads = ({"k", "keep"} if gpu else {"k", "kt", "keep"},
                      {"k", "v"} if gpu else {"k", "vt"})

    def load_rows(self, w, refs, sm, bars, tile: _DqTile) -> _DqRows:
        """Warpgroup w's prologue: Q and lse for warpgroup 0, dO and delta for 1."""
        bq, bkv, lay, bi, h = BLOCK_Q, BLOCK_KV, self.lay, tile.bi, tile.h
        q0 = tile.tile0
        offset = self.offset_of(bi, tile.offs)
        hi = _last_kvblock(q0, causal=self.causal, offset=offset, n_kv=self.n_kv)
        rows_sl = pl.ds(q0, bq)
        own = {name: sm[name].at[0] for name in ("q", "do", "lse", "delta")}
        names = ("q", "lse") if w == 0 else ("do", "delta")
        for i, name in enumerate(names):
            plgpu.copy_gmem_to_smem(tile_of(refs[name], bi, h, rows_sl,
                                            self.btnh and name in ("q", "do")),
                                    own[name], bars["misc"].at[2 * w + i])
        for i in range(len(names)):
            plgpu.barrier_wait(bars["misc"].at[2 * w + i])
        lse_safe = dlt = None
        if w == 0:
            lse = lay.vec(own["lse"], 1)
            lse_safe = jnp.where(lse == NEG_INF, POS_INF, lse)
        else:
            dlt = lay.vec(own["delta"], 1)
        diag = lay.iota((bq, bkv), 1) - lay.iota((bq, bkv), 0)
        return _DqRows(q0, offset, hi, rows_sl, own, lse_safe, dlt, diag, None)

    def wait_reads(self, bars, w, slot):
        """Block j's streams that warpgroup w reads, once arrived in their slots."""
        for name in self.names:
            if name in self.reads[w]:
                plgpu.barrier_wait(bars[name].at[slot[name]])

    def step_p(self, rows: _DqRows, sm, bars, j, dq, masked=True):
        """Warpgroup 0's step j: S, P (handed over in the P tile), its half of dQ."""
        bq, bkv = BLOCK_Q, BLOCK_KV
        slot = self.slot_of(j)
        self.wait_reads(bars, 0, slot)
        k_s = sm["k"].at[slot["k"]]
        kt = _t(k_s) if self.gpu_operands else sm["kt"].at[slot["kt"]]
        s = _wgmma(rows.own["q"], kt, (bq, bkv))
        p = _probs(self.cfg, s, rows.lse_safe, self.scale,
                   self.visible(rows, sm, slot, j, masked), 0)

        @pl.when(j > 0)
        def _():  # warpgroup 1 has read the last step's P
            plgpu.barrier_wait(bars["p_free"].at[0])

        sm["pt"][...] = p
        plgpu.barrier_arrive(bars["p_full"].at[0])
        plgpu.barrier_wait(bars["ds_full"].at[0])
        return self.add_half(sm, bars, slot, dq, 0, k_s)

    def step_ds(self, rows: _DqRows, sm, bars, j, dq, masked=True):
        """Warpgroup 1's step j: dP, P from the P tile, dS (handed over in the dS tile),
        its half of dQ. ``masked`` is warpgroup 0's (P comes masked)."""
        del masked
        bq, bkv = BLOCK_Q, BLOCK_KV
        slot = self.slot_of(j)
        self.wait_reads(bars, 1, slot)
        vt = (_t(sm["v"].at[slot["v"]]) if self.gpu_operands
              else sm["vt"].at[slot["vt"]])
        dp = _wgmma(rows.own["do"], vt, (bq, bkv))
        if self.split_ring:  # V is read: its slot takes the next block's
            plgpu.barrier_arrive(bars["free_v"].at[slot["free_v"]])
        plgpu.barrier_wait(bars["p_full"].at[0])
        p = self.lay.tile(sm["pt"])
        plgpu.barrier_arrive(bars["p_free"].at[0])
        ds = p * (dp - lax.broadcast_in_dim(rows.dlt, (bq, bkv), [0]))

        @pl.when(j > 0)
        def _():  # warpgroup 0's product has read the last step's dS
            plgpu.barrier_wait(bars["ds_free"].at[0])

        sm["ds"][...] = ds.astype(self.dtype)
        plgpu.commit_smem()
        plgpu.barrier_arrive(bars["ds_full"].at[0])
        return self.add_half(sm, bars, slot, dq, 1, sm["k"].at[slot["k"]])

    def add_half(self, sm, bars, slot, dq, w, k_s):
        """``dq + dS K[:, half w]`` (a fresh product added); frees the dS tile (w = 0)
        and the ring's slot."""
        cols = pl.ds(w * self.half, self.half)
        dq = dq + _wgmma(sm["ds"], k_s.at[:, cols], (BLOCK_Q, self.half))
        if w == 0:
            plgpu.barrier_arrive(bars["ds_free"].at[0])
        plgpu.barrier_arrive(bars["free"].at[slot["free"]])
        return dq

    def consume(self, w, refs, sm, bars, tile: _DqTile):
        """Each warpgroup sums its half of dQ's columns; both stage theirs, scaled and
        cast, in the Q tile's SMEM (every wgmma that read Q has been awaited: warpgroup
        1 passed the last P), and warpgroup 0 stores the tile."""
        for role in (0, 1):
            @pl.when(w == role)
            def _(role=role):  # (traced here, once)
                rows = self.load_rows(role, refs, sm, bars, tile)
                dq = self.mainloop(rows, tile, sm, bars,
                                   step=self.step_p if role == 0 else self.step_ds,
                                   dq=self.lay.zeros((BLOCK_Q, self.half)))

                @pl.when(rows.hi > 0)
                def _():  # the other warpgroup's last hand-over (every phase observed)
                    plgpu.barrier_wait(bars["p_free" if role == 0 else "ds_free"].at[0])

                if role == 1:  # Q's copy has landed (a tile that sees no key passes
                    # no P, which would have ordered it) before its SMEM takes dQ
                    plgpu.barrier_wait(bars["misc"].at[0])
                cols = pl.ds(role * self.half, self.half)
                rows.own["q"].at[:, cols][...] = (dq * self.scale).astype(self.dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(bars["done"].at[0])
                if role == 0:
                    plgpu.barrier_wait(bars["done"].at[0])
                    plgpu.copy_smem_to_gmem(rows.own["q"], tile_of(
                        refs["acc"], tile.bi, tile.h, rows.rows_sl, self.btnh))
                    wait_stores(self.cfg.store_wait)

    def smem(self):
        """:class:`_DqKernel`'s SMEM of one tile without its fp32 output tile (dQ stays in
        registers), with the P tile (fp32) and the dS tile; a ring's free barrier takes
        an arrival from each warpgroup that reads one of its streams."""
        bq, bkv = BLOCK_Q, BLOCK_KV
        spec, bar_spec = super().smem()
        del spec["out"]
        spec["pt"] = plgpu.SMEM((bq, bkv), jnp.float32, transforms=_smem_transforms(bkv, 4))
        spec["ds"] = plgpu.SMEM((bq, bkv), self.dtype, transforms=self.tr(bkv))
        for names, count, free in self.rings:
            readers = sum(bool(set(names) & reads) for reads in self.reads)
            bar_spec[free] = plgpu.Barrier(num_arrivals=readers, num_barriers=count)
        bar_spec["misc"] = plgpu.Barrier(num_barriers=4)
        for name in ("p_full", "p_free", "ds_full", "ds_free"):
            bar_spec[name] = plgpu.Barrier(num_barriers=1)
        bar_spec["done"] = plgpu.Barrier(num_arrivals=2, num_barriers=1)
        return spec, bar_spec


def _build_dq(**kw):
    """The dQ kernel (:class:`_DqKernel`'s parameters; :class:`_DqPairKernel` where
    ``BwdConfig.dq_pair`` applies)."""
    asked = kw["cfg"].dq_pair if kw["cfg"].dq_pair is not None else kw["d"] > 128
    pair = asked and kw["d"] >= 128 and kw.get("finish") and not kw.get("continue_acc")
    return (_DqPairKernel if pair else _DqKernel)(**kw).build()


# --------------------------------------------------------------------------- wrappers


def _check_whole_tiles(q, k, v, d_out, lse, delta_):
    """:func:`dkdv`'s and :func:`dq_accumulate`'s input checks (whole tiles)."""
    _check(q, k, v)
    _check_rows("d_out", d_out, q.shape)
    _check_rows("lse", lse, q.shape[:3], jnp.float32)
    _check_rows("delta", delta_, q.shape[:3], jnp.float32)


def _t_in(x, btnh: bool = False):
    """``[B, H, D, S]`` (the operands staged transposed off the GPU operand path) from
    ``[B, H, S, D]`` or, with ``btnh``, ``[B, S, H, D]``: an XLA transpose."""
    return jnp.transpose(x, (0, 2, 3, 1)) if btnh else jnp.swapaxes(x, 2, 3)


def _bhsd(shape, btnh: bool):
    """``(B, H, S, D)`` of a ``[B, H, S, D]`` shape or, with ``btnh``, a ``[B, S, H,
    D]`` one."""
    b, x, y, d = shape
    return (b, y, x, d) if btnh else (b, x, y, d)


def _seq_axis(btnh: bool) -> int:
    return 1 if btnh else 2


def _pad_seq(x, btnh: bool, pad):
    """``x`` (rank 4) zero-padded by ``pad`` along its sequence axis."""
    return jnp.pad(x, _along(_seq_axis(btnh), pad))


@functools.partial(jax.jit, static_argnames=("interpret", "config", "btnh"))
def delta(out, d_out, d_lse=None, *, interpret=False, config: BwdConfig | None = None,
          btnh: bool = False):
    """``rowsum(dO * O) - dlse`` per query row, fp32 ``[B, Hq, Sq]`` (see the module
    docstring for the two implementations). ``btnh``: out and d_out are ``[B, Sq, Hq,
    D]`` (read in place)."""
    cfg = config or BwdConfig()
    b, hq, sq, d = _bhsd(out.shape, btnh)
    d_lse = (jnp.zeros((b, hq, sq), jnp.float32) if d_lse is None
             else d_lse.astype(jnp.float32))
    if cfg.delta == "triton":
        if btnh:
            raise ValueError("delta='triton' reads [B, Hq, Sq, D]: btnh is not served there")
        return pallas_triton_vjp.delta(out, d_out, d_lse, interpret=bool(interpret))
    if out.dtype not in (jnp.bfloat16, jnp.float16) or d not in HEAD_DIMS:
        raise ValueError(f"out must be bf16/fp16 with D in {HEAD_DIMS}, got {out.dtype} {d}")
    if sq % BLOCK_Q or sq == 0:
        raise ValueError(f"Sq={sq} must be a positive multiple of {BLOCK_Q} (prototype)")
    _check_rows("d_out", d_out, out.shape)
    _check_rows("d_lse", d_lse, (b, hq, sq))
    call = _build_delta(b=b, hq=hq, sq=sq, d=d, dtype=out.dtype, cfg=cfg,
                        interpret=resolve_interpret(interpret), btnh=btnh)
    return call(out, d_out.astype(out.dtype), d_lse)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "interpret", "config"))
def dkdv(q, k, v, d_out, lse, delta_, *, causal: bool, scale: float, interpret=False,
         config: BwdConfig | None = None):
    """dK, dV ``([B, Hkv, Skv, D], [B, Hkv, Skv, D])`` in k's dtype, given the final lse
    and delta of every query row (``pallas_triton_vjp.dkdv``'s contract)."""
    _check_whole_tiles(q, k, v, d_out, lse, delta_)
    return _dkdv_parts(q, k, v, d_out.astype(q.dtype), lse, delta_, None,
                       offset=k.shape[2] - q.shape[2], causal=causal, scale=float(scale),
                       interpret=interpret, config=config or BwdConfig())


@functools.partial(jax.jit, static_argnames=("causal", "scale", "interpret", "config"))
def dq_accumulate(q, k, v, d_out, lse, delta_, *, causal: bool, scale: float,
                  interpret=False, config: BwdConfig | None = None):
    """The unscaled fp32 dQ accumulator ``[B, Hq, Sq, D]`` over all keys
    (``pallas_triton_vjp.dq_accumulate`` without ``acc``)."""
    _check_whole_tiles(q, k, v, d_out, lse, delta_)
    return _dq_blocks(q, k, v, d_out.astype(q.dtype), lse, delta_, None,
                      offset=k.shape[2] - q.shape[2], causal=causal, scale=float(scale),
                      interpret=interpret, config=config or BwdConfig())


def _checked_backward_inputs(q, k, v, out, lse, d_out, d_lse, key_padding_mask,
                             btnh=False):
    """The backward entries' input checks; returns K and V with dropped keys zeroed
    (their gradients are zero anyway)."""
    check_inputs(*((as_bhsd(x) for x in (q, k, v)) if btnh else (q, k, v)))
    b, hq, sq, _ = _bhsd(q.shape, btnh)
    skv = k.shape[_seq_axis(btnh)]
    _check_rows("out", out, q.shape)
    _check_rows("d_out", d_out, q.shape)
    _check_rows("lse", lse, (b, hq, sq), jnp.float32)
    if d_lse is not None:
        _check_rows("d_lse", d_lse, (b, hq, sq))
    if key_padding_mask is None:
        return k, v
    if key_padding_mask.shape != (b, skv) or key_padding_mask.dtype != jnp.bool_:
        raise ValueError(f"key_padding_mask must be bool [B, Skv] = {(b, skv)}, got "
                         f"{key_padding_mask.dtype} {key_padding_mask.shape}")
    return zero_dropped_keys(k, v, key_padding_mask, axis=_seq_axis(btnh))


@functools.partial(jax.jit, static_argnames=("causal", "scale", "interpret", "config",
                                             "btnh"))
def backward(q, k, v, out, lse, d_out, d_lse=None, *, causal: bool,
             scale: float | None = None, interpret=False, config: BwdConfig | None = None,
             key_padding_mask=None, btnh: bool = False):
    """Gradients ``(dq, dk, dv)`` of attention given the forward's ``(out, lse)`` and the
    cotangents ``d_out`` (and optionally ``d_lse``); ``pallas_triton_vjp.backward``'s
    order and final scaling. ``interpret``: False (GPU), True or an
    ``InterpretGPUParams`` (Mosaic GPU interpret mode on the CPU).

    Any ``Sq``, ``Skv``: the rows are padded as the forward pads them
    (``mosaic_fwd.padding``: causal tiles aligned to 64 absolute positions; padding rows
    get ``lse = -inf``, so they add nothing) and the keys to whole blocks, dropped by the
    key mask. ``key_padding_mask``: None or ``[B, Skv]`` bool, True = keep; dropped keys
    get zero gradients. ``btnh``: q, k, v, out, d_out and the gradients are ``[B, S, H,
    D]`` (JAX's layout), read and written in place by the kernels' TMA boxes; lse and
    d_lse stay ``[B, Hq, Sq]``."""
    cfg = config or BwdConfig()
    k, v = _checked_backward_inputs(q, k, v, out, lse, d_out, d_lse, key_padding_mask,
                                    btnh)
    b, hq, sq, d = _bhsd(q.shape, btnh)
    sa = _seq_axis(btnh)
    skv = k.shape[sa]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    lead, sq_pad, skv_pad = padding(sq, skv, causal, BLOCK_Q * cfg.dq_wgs)
    rows = (lead, sq_pad - sq - lead)
    if (lead, sq_pad) != (0, sq):
        q, out, d_out = (_pad_seq(x, btnh, rows) for x in (q, out, d_out))
        # padding rows add nothing
        lse = jnp.pad(lse, ((0, 0), (0, 0), rows), constant_values=NEG_INF)
        d_lse = None if d_lse is None else jnp.pad(d_lse, ((0, 0), (0, 0), rows))
    keep = key_padding_mask
    if skv_pad != skv:
        k, v = (_pad_seq(x, btnh, (0, skv_pad - skv)) for x in (k, v))
        keep = jnp.ones((b, skv), jnp.bool_) if keep is None else keep
        keep = jnp.pad(keep, ((0, 0), (0, skv_pad - skv)))
    dq, dk, dv = _backward_blocks(q, k, v, out, lse, d_out, d_lse, keep,
                                  offset=skv - sq - lead, causal=causal, scale=scale,
                                  interpret=interpret, cfg=cfg, btnh=btnh)
    return (lax.slice_in_dim(dq, lead, lead + sq, axis=sa),
            *(lax.slice_in_dim(g, 0, skv, axis=sa) for g in (dk, dv)))


def backward_over_ranges(q, k, v, out, lse, d_out, d_lse=None, *, ranges, offsets,
                         causal: bool, scale: float | None = None, interpret=False,
                         config: BwdConfig | None = None, key_padding_mask=None,
                         btnh: bool = False):
    """Gradients ``(dq, dk, dv)`` with per-sequence causal offsets and the keys taken in
    ``ranges`` (``[(a, e), ...]``, ascending and covering ``[0, Skv)``; context
    parallelism's key shards): dK and dV of each range by the dK/dV kernel, dQ by the
    dQ kernel continued from range to range (:class:`_DqKernel`'s ``continue_acc``),
    scaled and cast once. Row i of sequence b sees key j iff ``j <= i + offsets[b]``
    (causal). The ranges' starts must be multiples of ``2 * BLOCK_KV`` (SPLIT-aligned
    shards are): each range's CTAs then hold the key blocks one call over all keys
    holds, and the result is that call's in bits. Each sequence's rows are placed at
    their own lead (``offsets[b] mod 64``), as the forward places them. ``btnh``: as in
    :func:`backward`."""
    cfg = config or BwdConfig()
    k, v = _checked_backward_inputs(q, k, v, out, lse, d_out, d_lse, key_padding_mask,
                                    btnh)
    b, hq, sq, d = _bhsd(q.shape, btnh)
    sa = _seq_axis(btnh)
    skv = k.shape[sa]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    offsets = jnp.asarray(offsets)
    if offsets.shape != (b,) or not jnp.issubdtype(offsets.dtype, jnp.integer):
        raise ValueError(f"offsets must be int [B] = [{b}], got {offsets.dtype} "
                         f"{offsets.shape}")
    offsets = offsets.astype(jnp.int32)
    ranges = [(int(a), int(e)) for a, e in ranges]
    if (not ranges or ranges[0][0] != 0 or ranges[-1][1] != skv
            or any(e0 != a1 for (_, e0), (a1, _) in zip(ranges, ranges[1:], strict=False))
            or any(e <= a for a, e in ranges)
            or any(a % (2 * BLOCK_KV) for a, _ in ranges)):
        raise ValueError(f"ranges must be ascending, non-empty, contiguous, cover "
                         f"[0, {skv}) and start at multiples of {2 * BLOCK_KV}; got "
                         f"{ranges}")
    place, unplace, offs = _placement(q.shape, offsets, causal, BLOCK_Q * cfg.dq_wgs,
                                      btnh)
    qp, outp, dop = (place(x, btnh=btnh) for x in (q, out, d_out.astype(q.dtype)))
    lsep = place(lse, NEG_INF)  # padding rows add nothing
    dlsep = None if d_lse is None else place(d_lse.astype(jnp.float32))
    kw = dict(offset=0, causal=causal, scale=scale, interpret=interpret, config=cfg,
              btnh=btnh)
    dl = delta(outp, dop, dlsep, interpret=interpret, config=cfg, btnh=btnh)
    dks, dvs, acc = [], [], None
    for i, (a, e) in enumerate(ranges):
        kr, vr, keep = _key_range(k, v, key_padding_mask, a, e, btnh)
        off_r = offs - a if causal else None
        dk, dv = _dkdv_parts(qp, kr, vr, dop, lsep, dl, keep, off_r, **kw)
        # The last range's kernel scales and casts dQ as it stores it.
        acc = _dq_blocks(qp, kr, vr, dop, lsep, dl, keep, off_r, acc,
                         finish=i == len(ranges) - 1, **kw)
        dks.append(lax.slice_in_dim(dk, 0, e - a, axis=sa))
        dvs.append(lax.slice_in_dim(dv, 0, e - a, axis=sa))
    dq = unplace(acc)
    return dq, jnp.concatenate(dks, axis=sa), jnp.concatenate(dvs, axis=sa)


def _placement(q_shape, offsets, causal: bool, rows_cta: int, btnh: bool = False):
    """``(place, unplace, offs)``: the rows of each sequence placed at their own lead
    (``offsets[b] mod 64`` when causal, as the forward places them) in whole CTA tiles,
    and the offsets in the placed rows' coordinates (multiples of ``BLOCK_KV``).
    ``q_shape`` is ``[B, S, H, D]`` with ``btnh``; ``place(x, btnh=True)`` places such
    an array, ``place(x)`` a ``[B, Hq, Sq, ...]`` one (lse, delta); ``unplace`` takes
    q's layout back."""
    b, hq, sq, d = _bhsd(q_shape, btnh)
    if causal:
        lead = offsets % BLOCK_KV  # [B]: each sequence's tiles at 64 absolute positions
        sq_pad = -(-(BLOCK_KV - 1 + sq) // rows_cta) * rows_cta

        def place(x, fill=0.0, btnh=False):
            shape = ((sq_pad, *x.shape[2:]) if btnh else (x.shape[1], sq_pad, *x.shape[3:]))
            at = (lambda i: (i,) + (0,) * (x.ndim - 2)) if btnh else (
                lambda i: (0, i) + (0,) * (x.ndim - 3))
            return jax.vmap(lambda y, i: lax.dynamic_update_slice(
                jnp.full(shape, fill, y.dtype), y, at(i)))(x, lead)

        def unplace(x):
            return jax.vmap(lambda y, at: lax.dynamic_slice(
                y, (at, 0, 0) if btnh else (0, at, 0),
                (sq, hq, d) if btnh else (hq, sq, d)))(x, lead)
    else:
        lead = jnp.zeros((b,), jnp.int32)
        sq_pad = -(-sq // rows_cta) * rows_cta

        def place(x, fill=0.0, btnh=False):
            pad = [(0, 0)] * x.ndim
            pad[_seq_axis(btnh)] = (0, sq_pad - sq)
            return jnp.pad(x, pad, constant_values=fill)

        def unplace(x):
            return lax.slice_in_dim(x, 0, sq, axis=_seq_axis(btnh))
    return place, unplace, offsets - lead


def _key_range(k, v, key_padding_mask, a: int, e: int, btnh: bool = False):
    """Keys ``[a, e)`` padded to whole ``BLOCK_KV`` blocks, the padding dropped by the
    keep values (fp32, or None without a mask or padding)."""
    b = k.shape[0]
    n = e - a
    n_pad = -(-n // BLOCK_KV) * BLOCK_KV
    sa = _seq_axis(btnh)
    kr, vr = (lax.slice_in_dim(x, a, e, axis=sa) for x in (k, v))
    keep = None if key_padding_mask is None else key_padding_mask[:, a:e]
    if n_pad != n:
        kr, vr = (_pad_seq(x, btnh, (0, n_pad - n)) for x in (kr, vr))
        keep = jnp.ones((b, n), jnp.bool_) if keep is None else keep
        keep = jnp.pad(keep, ((0, 0), (0, n_pad - n)))
    return kr, vr, None if keep is None else keep.astype(jnp.float32)


def _mesh_inputs(q, k, lse, d_out, delta_, offsets, *, causal, scale, config):
    """The checks and placed rows of :func:`key_gradients` / :func:`query_gradients`."""
    cfg = config or BwdConfig()
    check_inputs(q, k, k)
    b, hq, sq, d = q.shape
    _check_rows("d_out", d_out, q.shape)
    _check_rows("lse", lse, (b, hq, sq), jnp.float32)
    _check_rows("delta", delta_, (b, hq, sq), jnp.float32)
    offsets = jnp.asarray(offsets)
    if offsets.shape != (b,) or not jnp.issubdtype(offsets.dtype, jnp.integer):
        raise ValueError(f"offsets must be int [B] = [{b}], got {offsets.dtype} "
                         f"{offsets.shape}")
    place, unplace, offs = _placement(q.shape, offsets.astype(jnp.int32), causal,
                                      BLOCK_Q * cfg.dq_wgs)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    return (cfg, scale, place(q), place(d_out.astype(q.dtype)), place(lse, NEG_INF),
            place(delta_), unplace, offs if causal else None)


def key_gradients(q, k, v, lse, d_out, delta_, *, offsets, causal: bool,
                  scale: float | None = None, interpret=False,
                  config: BwdConfig | None = None, key_padding_mask=None):
    """dK, dV of the keys in ``k``/``v`` over every query row of ``q``, given those
    rows' final ``lse`` and ``delta_`` (context parallelism's mesh path: a device's
    keys against the all-gathered rows). Row i of sequence b sees key j iff ``j <= i +
    offsets[b]`` (causal). :func:`backward_over_ranges`'s dK/dV kernel for one range,
    so a key range starting on a multiple of 64 gets the bits of one call over all
    keys."""
    if key_padding_mask is not None:
        k, v = zero_dropped_keys(k, v, key_padding_mask)
    cfg, scale, qp, dop, lsep, dl, _, offs = _mesh_inputs(
        q, k, lse, d_out, delta_, offsets, causal=causal, scale=scale, config=config)
    skv = k.shape[2]
    kr, vr, keep = _key_range(k, v, key_padding_mask, 0, skv)
    dk, dv = _dkdv_parts(qp, kr, vr, dop, lsep, dl, keep, offs, offset=0, causal=causal,
                         scale=scale, interpret=interpret, config=cfg)
    return dk[:, :, :skv], dv[:, :, :skv]


def query_gradients(q, k, v, lse, d_out, delta_, *, offsets, causal: bool,
                    scale: float | None = None, interpret=False,
                    config: BwdConfig | None = None, key_padding_mask=None):
    """dQ (in q's dtype) of the rows of ``q`` over every key of ``k``/``v``, given the
    rows' final ``lse`` and ``delta_`` (context parallelism's mesh path: a device's rows
    against the all-gathered keys); :func:`backward_over_ranges`'s dQ kernel over one
    range, scaled and cast."""
    if key_padding_mask is not None:
        k, v = zero_dropped_keys(k, v, key_padding_mask)
    cfg, scale, qp, dop, lsep, dl, unplace, offs = _mesh_inputs(
        q, k, lse, d_out, delta_, offsets, causal=causal, scale=scale, config=config)
    kr, vr, keep = _key_range(k, v, key_padding_mask, 0, k.shape[2])
    acc = _dq_blocks(qp, kr, vr, dop, lsep, dl, keep, offs, None, offset=0, causal=causal,
                     scale=scale, interpret=interpret, config=cfg)
    return unplace((acc * scale).astype(q.dtype))


def _backward_blocks(q, k, v, out, lse, d_out, d_lse, keep, *, offset, causal, scale,
                     interpret, cfg, btnh=False):
    """:func:`backward` on whole tiles: ``Sq`` and ``Skv`` multiples of 64, row i seeing
    key j iff ``j <= i + offset`` (causal), ``keep`` None or bool ``[B, Skv]``."""
    kw = dict(offset=offset, causal=causal, scale=scale, interpret=interpret, config=cfg,
              btnh=btnh)
    d_out = d_out.astype(q.dtype)
    dl = delta(out, d_out, d_lse, interpret=interpret, config=cfg, btnh=btnh)
    keep = None if keep is None else keep.astype(jnp.float32)
    if cfg.fused_dq:
        dk, dv, acc = _dkdv_blocks(q, k, v, d_out, lse, dl, keep, parts="fused", **kw)
        return _finish_fused_dq(acc, offset=offset, causal=causal, scale=scale,
                                dtype=q.dtype, btnh=btnh), dk, dv
    dk, dv = _dkdv_parts(q, k, v, d_out, lse, dl, keep, **kw)
    dq = _dq_blocks(q, k, v, d_out, lse, dl, keep, finish=True, **kw)  # scaled, cast
    return dq, dk, dv


def _block_dims(q, k, interpret, config, causal, scale, offset, keep, offs=None,
                btnh=False):
    interp = resolve_interpret(interpret)
    gpu_operands = (config.gpu_operands if config.gpu_operands is not None
                    else interp is None)
    b, hq, sq, d = _bhsd(q.shape, btnh)
    _, hkv, skv, _ = _bhsd(k.shape, btnh)
    return gpu_operands, dict(b=b, hq=hq, hkv=hkv, sq=sq, skv=skv, d=d, dtype=q.dtype,
                              causal=causal, scale=scale, cfg=config,
                              gpu_operands=gpu_operands, interpret=interp, offset=offset,
                              key_mask=keep is not None, dyn_offsets=offs is not None,
                              btnh=btnh)


# Each kernel in a jitted function of its own (one interpreted kernel per XLA
# computation: two in one computation deadlocked the JAX 0.10.2 interpreter).
def _dkdv_parts(q, k, v, d_out, lse, delta_, keep, offs=None, *, config, **kw):
    """:func:`_dkdv_blocks`'s outputs, dK and dV by two kernels where
    ``config.split_dkdv`` says (each kernel in its own jitted call)."""
    split = config.split_dkdv if config.split_dkdv is not None else q.shape[-1] > 128
    if not split:
        return _dkdv_blocks(q, k, v, d_out, lse, delta_, keep, offs, config=config, **kw)
    pair = config.dkdv_pair if config.dkdv_pair is not None else q.shape[-1] > 128
    if pair:  # one kernel, a warpgroup a sum
        return _dkdv_blocks(q, k, v, d_out, lse, delta_, keep, offs, config=config,
                            parts="pair", **kw)
    (dk,) = _dkdv_blocks(q, k, v, d_out, lse, delta_, keep, offs, config=config, parts="dk",
                         **kw)
    (dv,) = _dkdv_blocks(q, k, v, d_out, lse, delta_, keep, offs, config=config, parts="dv",
                         **kw)
    return dk, dv


@functools.partial(jax.jit, static_argnames=("offset", "causal", "scale", "interpret",
                                             "config", "parts", "btnh"))
def _dkdv_blocks(q, k, v, d_out, lse, delta_, keep, offs=None, *, offset, causal, scale,
                 interpret, config, parts="dkdv", btnh=False):
    gpu_operands, dims = _block_dims(q, k, interpret, config, causal, scale, offset, keep,
                                     offs, btnh)
    keep_in = () if keep is None else (keep,)
    offs_in = () if offs is None else (offs,)
    t_in = () if gpu_operands else (_t_in(q, btnh), _t_in(d_out, btnh))
    return _build_dkdv(**dims, parts=parts)(q, k, v, d_out, lse, delta_, *keep_in, *offs_in,
                                            *t_in)


@functools.partial(jax.jit, static_argnames=("offset", "causal", "scale", "interpret",
                                             "config", "btnh", "finish"))
def _dq_blocks(q, k, v, d_out, lse, delta_, keep, offs=None, acc=None, *, offset, causal,
               scale, interpret, config, btnh=False, finish=False):
    gpu_operands, dims = _block_dims(q, k, interpret, config, causal, scale, offset, keep,
                                     offs, btnh)
    keep_in = () if keep is None else (keep,)
    offs_in = () if offs is None else (offs,)
    acc_in = () if acc is None else (acc,)
    kv = (k, v) if gpu_operands else (k, _t_in(k, btnh), _t_in(v, btnh))
    return _build_dq(**dims, continue_acc=acc is not None, finish=finish)(
        q, d_out, lse, delta_, *kv, *keep_in, *offs_in, *acc_in)


def lower_for_cuda(q, k, v, *, causal: bool = False, scale: float | None = None,
                   config: BwdConfig | None = None, key_padding_mask=None,
                   btnh: bool = False):
    """Lower (not compile) the whole GPU backward (delta, dK/dV, dQ) for CUDA on a
    machine without a GPU; ``q``/``k``/``v`` (and ``key_padding_mask``) may be
    ``jax.ShapeDtypeStruct``. Returns the ``jax.stages.Lowered``."""
    b, hq, sq, _ = _bhsd(q.shape, btnh)

    def f(q, k, v, out, lse, d_out, mask):
        return backward(q, k, v, out, lse, d_out, causal=causal, scale=scale,
                        interpret=False, config=config, key_padding_mask=mask, btnh=btnh)

    lse = jax.ShapeDtypeStruct((b, hq, sq), jnp.float32)
    return jax.jit(f).trace(q, k, v, q, lse, q, key_padding_mask).lower(
        lowering_platforms=("cuda",))
