"""The canonical reduction schedule: the only place its constants live.

DESIGN.md section 4. Every forward path (prefill, chunked prefill, decode, paged KV,
context parallelism) visits a query row's keys in ascending logical position, in blocks
of ``BLOCK_N`` keys aligned to multiples of ``BLOCK_N`` from key 0. Blocks are folded by
online softmax (running max ``m``, running sum ``l``, unnormalised accumulator, all fp32)
within a split of ``SPLIT`` keys aligned from key 0; the splits' partial states are then
folded left to right by :func:`jaxattn.merge.merge`.

These numbers never depend on the batch, the sequence lengths, the number of sequences,
the device count or an autotuner. Changing either one changes the bits of every backend
that follows the schedule, so it is a breaking change.
"""

from __future__ import annotations

from typing import Final

#: Keys per block of the online-softmax inner loop.
BLOCK_N: Final[int] = 64

#: Keys per split: the unit of split-KV parallelism (decode) and of context-parallel
#: sharding that keeps the bits of a single device.
SPLIT: Final[int] = 1024

#: Blocks per split.
BLOCKS_PER_SPLIT: Final[int] = SPLIT // BLOCK_N

#: Exponential of the in-kernel online softmax: "2" (``exp2`` of scores pre-scaled by
#: log2(e): the GPU's fast approximate instruction, used alike by every kernel path) or
#: "e" (``exp``, the instruction XLA uses). The merge of partial states and the backward's
#: recomputed probabilities always use exp/log. On the H200 (2026-11-29, JAX 0.11.2,
#: ``python -m benchmarks.tune --what=variants``, B=2 Hq=32 Hkv=8 S=4096 D=128 causal
#: bf16) "2" ran the forward at 305.5 TFLOP/s against 271.8 for "e", with decode rows,
#: chunked prefill and every tile height still equal in bits (docs/notes.md).
SOFTMAX_EXP_BASE: Final[str] = "2"

#: Row sum of a block's probabilities: "mma" (on the matrix unit: the same bits for
#: every tile height, by the measurement in DESIGN.md section 4) or "reduce" (a vector
#: reduction, whose order follows the register layout; a candidate for speed that must
#: be shown tile-invariant on the GPU before it is used); "reduce32" sums the fp32
#: probabilities before their cast (a Pallas-only tuning candidate, benchmarks/tune.py:
#: faster on the H200, but not tile-invariant there); "tree" sums them by a fixed
#: pairwise tree (``common.pairwise_rowsum``; a Pallas-only candidate not yet timed).
ROWSUM: Final[str] = "mma"

assert SPLIT % BLOCK_N == 0, "SPLIT must be a multiple of BLOCK_N"
assert SOFTMAX_EXP_BASE in ("e", "2") and ROWSUM in ("mma", "reduce", "reduce32", "tree")


def num_blocks(num_keys: int) -> int:
    """Number of ``BLOCK_N`` blocks that cover ``num_keys`` keys."""
    return -(-num_keys // BLOCK_N)


def num_splits(num_keys: int) -> int:
    """Number of ``SPLIT`` splits that cover ``num_keys`` keys."""
    return -(-num_keys // SPLIT)


def bucket_length(n: int) -> int:
    """The padded length a caller compiles for instead of ``n`` (a key count, or the
    query count of a prefill chunk): the next power of two up to ``SPLIT``, the next
    multiple of ``SPLIT`` above. A cache growing token by token then compiles once per
    bucket (1, 2, 4, ..., 1024, 2048, 3072, ...) instead of once per length.

    Padding is free in bits on a backend that follows the schedule (the tail-padding
    row of the invariance matrix); the true lengths are passed at run time, so the
    blocks past them are skipped. Costs: at most ``n - 1`` extra keys below ``SPLIT``
    (memory of the padded copy, up to 2x), at most ``SPLIT - 1`` above."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"bucket_length takes a positive int, got {n!r}")
    if n <= SPLIT:
        return 1 << (n - 1).bit_length()
    return -(-n // SPLIT) * SPLIT
