"""Speculative verification (2 to 8 queries per head) on the Mosaic forward: the GQA
group's heads and queries stacked in one tile (K and V read once per group) against
one tile per head (``MosaicConfig(stack_decode=False)``), in one process (H200).

    python -m benchmarks.stack_ab --out_dir=$OUT/stack

Hq=32 Hkv=8 D=128 bf16 causal; each point jitted, median of ``--iters`` calls on two
rotating inputs, each call waited for (its host dispatch and wait included, so the
ratio of the two is what this binary gives, not the kernel's bandwidth:
``attention_bench --modes=decode`` times that); GB/s of K and V read once; outputs
compared in raw bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks import report

FLAGS = flags.FLAGS
flags.DEFINE_list("points", ["8x8192x1", "8x8192x4", "8x8192x8", "32x4096x4", "1x32768x4"],
                  "BxSkvxSq points.")
flags.DEFINE_integer("iters", 30, "Timed calls (median).")
flags.DEFINE_string("out_dir", None, "Where results.json and results.md go.")


def main(argv):
    del argv
    from jaxattn.backends.mosaic import forward as mf
    rows = []
    for spec in FLAGS.points:
        b, skv, sq = (int(x) for x in spec.split("x"))

        def inputs(seed, b=b, skv=skv, sq=sq):
            ks = jax.random.split(jax.random.PRNGKey(seed), 3)
            return (jax.random.normal(ks[0], (b, 32, sq, 128), jnp.bfloat16),
                    jax.random.normal(ks[1], (b, 8, skv, 128), jnp.bfloat16),
                    jax.random.normal(ks[2], (b, 8, skv, 128), jnp.bfloat16))

        xs = [jax.block_until_ready(inputs(i)) for i in (0, 1)]
        fns = {name: jax.jit(lambda q, k, v, cfg=cfg: mf.forward(q, k, v, causal=True,
                                                                 config=cfg))
               for name, cfg in (("stacked", mf.MosaicConfig()),
                                 ("per_head", mf.MosaicConfig(stack_decode=False)))}
        t = {name: report.rotating_median_seconds(fn, xs, FLAGS.iters)
             for name, fn in fns.items()}
        a, c = fns["stacked"](*xs[0]), fns["per_head"](*xs[0])
        equal = all(bool(jnp.array_equal(x, y)) for x, y in zip(a, c, strict=True))
        gb = 2 * b * 8 * skv * 128 * 2 / 1e9
        rows.append({"B": b, "Skv": skv, "Sq": sq, "stacked_us": t["stacked"] * 1e6,
                     "per_head_us": t["per_head"] * 1e6,
                     "stacked_GBps": gb / t["stacked"], "per_head_GBps": gb / t["per_head"],
                     "bits_equal": equal})
        print(rows[-1])
    md = ["| B | Skv | Sq | stacked us | GB/s | one tile per head us | GB/s | bits equal |",
          "|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['B']} | {r['Skv']} | {r['Sq']} | {r['stacked_us']:.1f} | "
           f"{r['stacked_GBps']:.0f} | {r['per_head_us']:.1f} | {r['per_head_GBps']:.0f} | "
           f"{r['bits_equal']} |" for r in rows]
    print("\n".join(md))
    report.write(FLAGS.out_dir, {"jax": jax.__version__, "rows": rows}, "\n".join(md) + "\n")


if __name__ == "__main__":
    app.run(main)
