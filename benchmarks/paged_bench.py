"""Paged decode beside contiguous decode: GB/s of K and V read per call, per page size,
page layout and backend, with the device's copy bandwidth measured in the same run.

    python -m benchmarks.paged_bench --out_dir=$OUT/paged
    python -m benchmarks.paged_bench --smoke          # tiny, on a CPU

Each point is one decode step (Sq = 1) of B sequences of Skv keys (Hq=32, Hkv=8, D=128
bf16 by default) against a shuffled page table (``--tables=ordered``: page p of
sequence b at physical page ``b * pages + p``, the pool in key order); back-to-back calls
on rotating inputs (report.sampled_seconds). Contiguous rows are ``jaxattn.attention`` on
``[B, Hkv, Skv, D]``; paged rows are ``jaxattn.paged.attention`` (the kernels read the
pages in place).
"""

from __future__ import annotations

import datetime
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import jaxattn
from benchmarks import report

flags.DEFINE_list("batches", ["8", "64"], "Batch sizes.")
flags.DEFINE_list("kv_lens", ["8192", "4096"], "Keys per sequence (paired with --batches).")
flags.DEFINE_list("page_sizes", ["16", "64", "128"], "Page sizes.")
flags.DEFINE_list("layouts", ["HND", "NHD"], "Page layouts.")
flags.DEFINE_list("backends", ["mosaic", "pallas"], "jaxattn backends.")
flags.DEFINE_list("tables", ["shuffled"], "Page tables: shuffled (a random permutation of "
                  "the pool) and/or ordered (each sequence's pages in key order).")
flags.DEFINE_integer("num_q_heads", 32, "Query heads.")
flags.DEFINE_integer("num_kv_heads", 8, "KV heads.")
flags.DEFINE_integer("head_dim", 128, "Head dim.")
flags.DEFINE_integer("iters", 7, "Timed samples per point (median).")
flags.DEFINE_string("out_dir", None, "Write results.json and results.md here.")
flags.DEFINE_list("mosaic_variants", [], "More backends: the Mosaic backend with "
                  "MosaicConfig fields, name:key=value[:key=value...] (reported as "
                  "mosaic:name), e.g. one:ctas_per_sm=1.")
flags.DEFINE_bool("smoke", False, "Tiny shapes that run on a CPU.")
FLAGS = flags.FLAGS


def _backend(name: str):
    """A ``--backends`` name, or ``mosaic:<variant>`` of ``--mosaic_variants``: the
    Mosaic backend with that variant's MosaicConfig."""
    if not name.startswith("mosaic:"):
        return name
    from benchmarks import systems
    fields = dict(map(report.named_config, FLAGS.mosaic_variants))[name[7:]]
    return systems.mosaic_variant(**fields)


def _point(backend, b, skv, ps, layout, hq, hkv, d, sets_n=2, table_kind="shuffled"):
    rng = np.random.default_rng(b * 7 + skv + (ps or 0))
    max_pages = -(-skv // (ps or skv))
    sets = []
    for i in range(sets_n):
        ks = jax.random.split(jax.random.PRNGKey(100 * i + b), 3)
        q = jax.random.normal(ks[0], (b, hq, 1, d), jnp.bfloat16)
        if ps is None:
            k = jax.random.normal(ks[1], (b, hkv, skv, d), jnp.bfloat16)
            v = jax.random.normal(ks[2], (b, hkv, skv, d), jnp.bfloat16)
            sets.append((q, k, v))
            continue
        n = b * max_pages
        shape = (n, ps, hkv, d) if layout == "NHD" else (n, hkv, ps, d)
        kp = jax.random.normal(ks[1], shape, jnp.bfloat16)
        vp = jax.random.normal(ks[2], shape, jnp.bfloat16)
        order = rng.permutation(n) if table_kind == "shuffled" else np.arange(n)
        table = jnp.asarray(order.reshape(b, max_pages).astype(np.int32))
        sets.append((q, kp, vp, table, jnp.full((b,), skv, jnp.int32)))
    impl = _backend(backend)
    if ps is None:
        fn = jax.jit(lambda q, k, v: jaxattn.attention(q, k, v, backend=impl))
    else:
        fn = jax.jit(lambda q, kp, vp, t, lens: jaxattn.paged.attention(
            q, kp, vp, t, lens, backend=impl, layout=layout))
    sec, _ = report.sampled_seconds(fn, sets, jax.block_until_ready, FLAGS.iters, 2, 50,
                                    0.02)
    nbytes = 2 * b * hkv * skv * d * 2
    return {"backend": backend, "B": b, "Skv": skv, "page_size": ps,
            "layout": layout if ps else "contiguous", "table": table_kind if ps else "-",
            "ms": sec * 1e3,
            "GB/s": nbytes / sec / 1e9}


def main(argv):
    del argv
    hq, hkv, d = FLAGS.num_q_heads, FLAGS.num_kv_heads, FLAGS.head_dim
    points = list(zip(map(int, FLAGS.batches), map(int, FLAGS.kv_lens), strict=True))
    page_sizes = [int(p) for p in FLAGS.page_sizes]
    backends = FLAGS.backends + [f"mosaic:{report.named_config(v)[0]}"
                                 for v in FLAGS.mosaic_variants]
    if FLAGS.smoke:
        hq, hkv, d, points, page_sizes, backends = 4, 2, 64, [(2, 128)], [16, 64], ["pallas"]
    rows = []
    for b, skv in points:
        for backend in backends:
            for ps, layout, kind in [(None, None, None)] + [
                    (p, lay, t) for p in page_sizes for lay in FLAGS.layouts
                    for t in FLAGS.tables]:
                try:
                    row = _point(backend, b, skv, ps, layout, hq, hkv, d, table_kind=kind)
                except Exception as e:  # reported, not fatal
                    row = {"backend": backend, "B": b, "Skv": skv, "page_size": ps,
                           "layout": layout, "error": f"{type(e).__name__}: {e}"[:300]}
                print(row, flush=True)
                rows.append(row)
    meta = {"date": datetime.date.today().isoformat(), "device": str(jax.devices()[0]),
            "jax": jax.__version__, "command": "python -m benchmarks.paged_bench "
            + " ".join(sys.argv[1:]), "Hq": hq, "Hkv": hkv, "D": d,
            "copy_GBps": None if FLAGS.smoke else report.copy_bandwidth()}
    lines = [f"Measured {meta['date']} on {meta['device']} (jax {meta['jax']}), Hq={hq} "
             f"Hkv={hkv} D={d} bf16, decode (Sq=1); command: `{meta['command']}`", ""]
    if meta["copy_GBps"]:
        lines += [f"Device copy bandwidth (read + write): {meta['copy_GBps']:.0f} GB/s", ""]
    lines += ["| backend | B | Skv | page size | layout | table | ms | GB/s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tail = (f"{r['error'][:60]} | |" if "error" in r
                else f"{r['ms']:.3f} | {r['GB/s']:.0f} |")
        lines.append(f"| {r['backend']} | {r['B']} | {r['Skv']} | {r['page_size'] or '-'} | "
                     f"{r['layout']} | {r.get('table', '-')} | {tail}")
    md = "\n".join(lines) + "\n"
    print(md)
    report.write(FLAGS.out_dir, {"meta": meta, "rows": rows}, md)


if __name__ == "__main__":
    app.run(main)
