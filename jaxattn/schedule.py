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

#: Exponential of the in-kernel online softmax: "e" (``exp``, the same instruction XLA
#: uses) or "2" (``exp2`` of scores pre-scaled by log2(e): the GPU's fast approximate
#: instruction; every kernel path would use it alike). The merge of partial states always
#: uses exp/log. "2" is a candidate for speed, not yet measured for invariance on the GPU.
SOFTMAX_EXP_BASE: Final[str] = "e"

#: Row sum of a block's probabilities: "mma" (on the matrix unit: the same bits for
#: every tile height, by the measurement in DESIGN.md section 4) or "reduce" (a vector
#: reduction, whose order follows the register layout; a candidate for speed that must
#: be shown tile-invariant on the GPU before it is used).
ROWSUM: Final[str] = "mma"

assert SPLIT % BLOCK_N == 0, "SPLIT must be a multiple of BLOCK_N"
assert SOFTMAX_EXP_BASE in ("e", "2") and ROWSUM in ("mma", "reduce")


def num_blocks(num_keys: int) -> int:
    """Number of ``BLOCK_N`` blocks that cover ``num_keys`` keys."""
    return -(-num_keys // BLOCK_N)


def num_splits(num_keys: int) -> int:
    """Number of ``SPLIT`` splits that cover ``num_keys`` keys."""
    return -(-num_keys // SPLIT)
