"""The dQ kernel's epilogue against the earlier form, in one process (H200).

    python -m benchmarks.dq_epilogue_ab --out_dir=$OUT/dq

``kernel``: ``_dq_blocks(finish=True)`` (dQ scaled and cast in the kernel's epilogue);
``xla``: the fp32 accumulator (``dq_accumulate``) scaled and cast by XLA after it (the
backward before this change). Both jitted, median of ``--iters`` back-to-back calls on
two rotating inputs; their outputs compared in raw bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks import report

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", ["2,4096,128", "16,1024,128", "2,4096,64", "1,16384,128"],
                  "B,S,D points (Hq=32, Hkv=8, causal).")
flags.DEFINE_integer("iters", 20, "Timed calls (median).")
flags.DEFINE_string("out_dir", None, "Where results.json and results.md go.")


def main(argv):
    del argv
    from jaxattn.backends.mosaic import backward as mb
    from jaxattn.backends.mosaic import forward as mf
    rows = []
    for spec in FLAGS.shapes:
        b, s, d = (int(x) for x in spec.split(","))
        scale = d ** -0.5

        def inputs(seed, b=b, s=s, d=d):
            ks = jax.random.split(jax.random.PRNGKey(seed), 4)
            q = jax.random.normal(ks[0], (b, 32, s, d), jnp.bfloat16)
            k = jax.random.normal(ks[1], (b, 8, s, d), jnp.bfloat16)
            v = jax.random.normal(ks[2], (b, 8, s, d), jnp.bfloat16)
            do = jax.random.normal(ks[3], (b, 32, s, d), jnp.bfloat16)
            out, lse = mf.forward(q, k, v, causal=True)
            return q, k, v, do, lse, mb.delta(out, do)

        xs = [jax.block_until_ready(inputs(i)) for i in (0, 1)]
        kw = dict(offset=0, causal=True, scale=scale, interpret=False,
                  config=mb.BwdConfig())
        kern = jax.jit(lambda q, k, v, do, lse, dl, kw=kw: mb._dq_blocks(
            q, k, v, do, lse, dl, None, finish=True, **kw))
        xla = jax.jit(lambda q, k, v, do, lse, dl, kw=kw, scale=scale: (mb._dq_blocks(
            q, k, v, do, lse, dl, None, **kw) * scale).astype(q.dtype))
        t_k = report.rotating_median_seconds(kern, xs, FLAGS.iters)
        t_x = report.rotating_median_seconds(xla, xs, FLAGS.iters)
        equal = bool(jnp.array_equal(kern(*xs[0]), xla(*xs[0])))
        rows.append({"B": b, "S": s, "D": d, "kernel_us": t_k * 1e6, "xla_us": t_x * 1e6,
                     "saved_us": (t_x - t_k) * 1e6, "bits_equal": equal})
        print(rows[-1])
    md = ["| B | S | D | dQ in-kernel epilogue us | fp32 + XLA scale/cast us | saved us | "
          "bits equal |", "|---|---|---|---|---|---|---|"]
    md += [f"| {r['B']} | {r['S']} | {r['D']} | {r['kernel_us']:.1f} | {r['xla_us']:.1f} | "
           f"{r['saved_us']:.1f} | {r['bits_equal']} |" for r in rows]
    print("\n".join(md))
    report.write(FLAGS.out_dir, {"jax": jax.__version__, "rows": rows}, "\n".join(md) + "\n")


if __name__ == "__main__":
    app.run(main)
