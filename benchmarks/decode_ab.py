"""The Mosaic decode's launch variants (``MosaicConfig`` fields) against each other, and
the Pallas backend's decode beside them, in one process (H200).

    python -m benchmarks.decode_ab --out_dir=$OUT/decode_ab \
        --variants="slots4:,slots3:split_decode_stages=3"

Hq=32 Hkv=8 D=128 bf16 causal, ``--sq`` queries per head (1: decode; 2 to 8:
speculative verification) against ``B x Skv`` keys. Each variant is jitted and timed as
``attention_bench`` times a decode: samples of back-to-back calls on two rotating input
sets (``report.sampled_seconds``), the median of ``--iters`` samples; GB/s of K and V
read once. Each variant's outputs are compared in raw bits with the first variant's (a
launch choice must not change them). ``--variants``: ``name:field=value;field=value``
(empty fields: the default config); values are Python literals (1 and 0 for booleans
work too).
"""

from __future__ import annotations

import ast
import dataclasses

import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks import report

FLAGS = flags.FLAGS
flags.DEFINE_list("points", ["1x32768", "1x131072", "8x8192", "8x32768", "8x131072"],
                  "BxSkv points.")
flags.DEFINE_integer("sq", 1, "Queries per head.")
flags.DEFINE_string("variants", "slots4:,slots3:split_decode_stages=3",
                    "Comma-separated name:field=value;field=value MosaicConfig variants "
                    "(the first is the bits' reference).")
flags.DEFINE_bool("with_pallas", True, "Time the Pallas backend's decode beside them.")
flags.DEFINE_integer("iters", 7, "Timed samples (median).")
flags.DEFINE_float("sample_ms", 20.0, "Target duration of one sample.")
flags.DEFINE_string("out_dir", None, "Where results.json and results.md go.")


def parse_variants(spec: str):
    """``[(name, MosaicConfig)]`` from ``name:field=value;field=value,...``."""
    from jaxattn.backends.mosaic import forward as mf
    fields = {f.name: f.type for f in dataclasses.fields(mf.MosaicConfig)}
    out = []
    for item in spec.split(","):
        name, _, rest = item.partition(":")
        kw = {}
        for pair in filter(None, rest.split(";")):
            key, _, value = pair.partition("=")
            if key not in fields:
                raise app.UsageError(f"--variants: {key!r} is not a MosaicConfig field")
            kw[key] = ast.literal_eval(value)
            if "bool" in str(fields[key]) and kw[key] in (0, 1):
                kw[key] = bool(kw[key])
        out.append((name, mf.MosaicConfig(**kw)))
    return out


def main(argv):
    del argv
    from jaxattn.backends.mosaic import forward as mf
    from jaxattn.backends.pallas.backend import BACKEND as PALLAS
    variants = parse_variants(FLAGS.variants)
    sq = FLAGS.sq
    rows = []
    for spec in FLAGS.points:
        b, skv = (int(x) for x in spec.split("x"))

        def inputs(seed, b=b, skv=skv):
            ks = jax.random.split(jax.random.PRNGKey(seed), 3)
            return (jax.random.normal(ks[0], (b, 32, sq, 128), jnp.bfloat16),
                    jax.random.normal(ks[1], (b, 8, skv, 128), jnp.bfloat16),
                    jax.random.normal(ks[2], (b, 8, skv, 128), jnp.bfloat16))

        xs = [jax.block_until_ready(inputs(i)) for i in (0, 1)]
        fns = {name: jax.jit(lambda q, k, v, cfg=cfg: mf.forward(q, k, v, causal=True,
                                                                 config=cfg))
               for name, cfg in variants}
        if FLAGS.with_pallas:
            fns["pallas"] = jax.jit(lambda q, k, v: PALLAS.forward_with_lse(
                q, k, v, causal=True, scale=128 ** -0.5))
        gb = 2 * b * 8 * skv * 128 * 2 / 1e9
        first = fns[variants[0][0]](*xs[0])
        row = {"B": b, "Skv": skv, "Sq": sq}
        for name, fn in fns.items():
            sec, _ = report.sampled_seconds(fn, xs, jax.block_until_ready, FLAGS.iters, 2,
                                            1000, FLAGS.sample_ms / 1e3)
            row[f"{name}_us"] = sec * 1e6
            row[f"{name}_GBps"] = gb / sec
            if name != "pallas":
                row[f"{name}_bits_equal"] = all(
                    bool(jnp.array_equal(x, y))
                    for x, y in zip(fn(*xs[0]), first, strict=True))
        rows.append(row)
        print(row)
    names = list(fns)
    md = ["| B | Skv | Sq | " + " | ".join(f"{n} us (GB/s)" for n in names)
          + " | bits equal |", "|---|---|---|" + "---|" * (len(names) + 1)]
    for r in rows:
        cells = [f"{r[f'{n}_us']:.1f} ({r[f'{n}_GBps']:.0f})" for n in names]
        equal = all(r[f"{n}_bits_equal"] for n, _ in variants)
        md.append(f"| {r['B']} | {r['Skv']} | {r['Sq']} | " + " | ".join(cells)
                  + f" | {equal} |")
    print("\n".join(md))
    report.write(FLAGS.out_dir, {"jax": jax.__version__, "variants": FLAGS.variants,
                                 "rows": rows}, "\n".join(md) + "\n")


if __name__ == "__main__":
    app.run(main)
