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

assert SPLIT % BLOCK_N == 0, "SPLIT must be a multiple of BLOCK_N"


def num_blocks(num_keys: int) -> int:
    """Number of ``BLOCK_N`` blocks that cover ``num_keys`` keys."""
    return -(-num_keys // BLOCK_N)


def num_splits(num_keys: int) -> int:
    """Number of ``SPLIT`` splits that cover ``num_keys`` keys."""
    return -(-num_keys // SPLIT)
