"""A model of a fused, ordered dQ: what its ordering costs in idle SMs (no GPU).

    python -m benchmarks.dq_order_model --shapes=1:16384,2:4096,4:8192,16:1024 \\
        --lags=0,9,17

The backward's dQ kernel recomputes S and dP (seven 64-key products a step where the
dK/dV kernel alone does four; FlashAttention's fused backward does five). Forming dQ in
the dK/dV kernel and adding each CTA's share to the tile's fp32 dQ in GMEM keeps the dQ
kernel's bits only if the shares are added in its order, ascending key blocks: the CTA
of key-block pair p adds its share of a query tile only after pair p - 1 has added
its own. The dK/dV kernel walks, per query head of the GQA group, the query tiles in
ascending order from the first that sees its keys (tile 2p for a causal pair p with Sq
= Skv), so pair p - 1 reaches a tile 2 + 2h steps after pair p at head h: pair p must
start at least ``lag`` steps after pair p - 1 (8 + 1 for a group of 4; a non-causal
pair reaches every tile at the same step as its neighbours, so its lag is the add's
latency alone, a fraction of a step).

The model: each (KV head, batch, pair p) is one item of ``group * (n_tiles - 2p)``
steps (causal; ``group * n_tiles`` not), dealt in the order p, then head, to whichever
of ``--sms`` CTAs is free first (the hardware's deal of the dK/dV kernel's grid ``(kv,
h, b)``, whose last axis launches fastest), starting no earlier than ``lag`` steps
after the same head's pair p - 1. At lag 0 that is today's dK/dV kernel. It prints
the makespan over perfect balance (every step's work spread evenly): the idle the
order costs. It leaves out everything else (the adds' traffic, staging dS in SMEM,
the polls): an upper bound on what the order allows, not a prediction of the
kernel's speed.
"""

from __future__ import annotations

import heapq

from absl import app, flags

FLAGS = flags.FLAGS


def _define_flags():
    """The binary's flags, defined when it runs (not on import: the tests import
    :func:`makespan` beside other benchmarks' flags of the same names)."""
    flags.DEFINE_list("shapes", ["1:16384", "2:4096", "4:8192", "16:1024"],
                      "B:S points (Sq = Skv = S).")
    flags.DEFINE_list("lags", ["0", "9", "17"], "Steps between a head's pairs' starts.")
    flags.DEFINE_integer("hkv", 8, "KV heads.")
    flags.DEFINE_integer("group", 4, "Query heads per KV head (Hq / Hkv).")
    flags.DEFINE_integer("sms", 132, "CTAs at a time (one an SM).")
    flags.DEFINE_bool("causal", True, "Causal (pairs see tiles from 2p on) or not.")


BLOCK = 64  # query rows a tile, keys a block; a dK/dV CTA holds two blocks (a pair)


def makespan(n_tiles: int, heads: int, group: int, sms: int, lag: float,
             causal: bool = True) -> tuple[float, float]:
    """``(makespan, balance)`` in steps: the greedy deal's last end, and the total work
    over ``sms``. ``heads`` counts (KV head, batch) pairs."""
    pairs = n_tiles // 2
    length = [group * (n_tiles - 2 * p if causal else n_tiles) for p in range(pairs)]
    free = [(0.0, c) for c in range(sms)]
    heapq.heapify(free)
    started: dict[tuple[int, int], float] = {}
    end = 0.0
    for p in range(pairs):
        for h in range(heads):
            t, c = heapq.heappop(free)
            s = t if p == 0 else max(t, started[h, p - 1] + lag)
            started[h, p] = s
            end = max(end, s + length[p])
            heapq.heappush(free, (s + length[p], c))
    return end, heads * sum(length) / sms


def main(argv):
    del argv
    print("| B, S | lag (steps) | makespan / balance | 7/5 passes over it |")
    print("|---|---|---|---|")
    for shape in FLAGS.shapes:
        b, s = (int(x) for x in shape.split(":"))
        if s % (2 * BLOCK):
            raise ValueError(f"--shapes: S must be a multiple of {2 * BLOCK}, got {s}")
        for lag in (float(x) for x in FLAGS.lags):
            end, balance = makespan(s // BLOCK, b * FLAGS.hkv, FLAGS.group, FLAGS.sms,
                                    lag, FLAGS.causal)
            print(f"| {b}, {s} | {lag:g} | {end / balance:.3f} | "
                  f"{7 / 5 / (end / balance):.2f} |")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
