"""Where one-device CP's extra forward time goes: ``cp.forward_with_lse`` at one degree
against variants that leave one cost out, timed in one process beside the single call.

    python -m benchmarks.cp_profile --seq_len=32768 --degree=8 --out_dir=/tmp/cpp

Variants (each jitted, median of ``--iters`` back-to-back calls on two rotating inputs):

- ``single``: the default backend's ``forward_with_lse`` over the whole sequence;
- ``cp``: ``cp.forward_with_lse(cp_world_size=degree)``;
- ``chain``: one ``Backend.fold_on`` launch per (query shard, key range) pair, on query
  shards and key ranges sliced before the timed call, their outputs not concatenated
  (``cp`` ran these launches on slices up to tree ``9d31301``; it now launches once per
  key range over the shards that see it, ``Backend.fold_window``);
- ``stateless``: the same launches, each on its own (no state loaded or stored, the
  output stored as the single call does; not the same bits: only the time matters)
  (``chain`` minus ``stateless``: the fp32 state's traffic);
- ``one_launch_per_shard``: each query shard against all its keys in one launch
  (``stateless`` minus this: the launches' tails and ramps).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import app, flags

import jaxattn
from benchmarks import report
from jaxattn import cp, registry, schedule

FLAGS = flags.FLAGS
flags.DEFINE_integer("seq_len", 32768, "Sequence length.")
flags.DEFINE_integer("degree", 8, "cp_world_size.")
flags.DEFINE_integer("batch", 1, "Batch.")
flags.DEFINE_integer("num_q_heads", 32, "Query heads.")
flags.DEFINE_integer("num_kv_heads", 8, "KV heads.")
flags.DEFINE_integer("head_dim", 128, "Head dim.")
flags.DEFINE_integer("iters", 9, "Timed calls (median).")
flags.DEFINE_string("backend", None, "Backend (default: the registry's).")
flags.DEFINE_string("out_dir", None, "Where results.json and results.md go.")


def main(argv):
    del argv
    s, w = FLAGS.seq_len, FLAGS.degree
    b, hq, hkv, d = FLAGS.batch, FLAGS.num_q_heads, FLAGS.num_kv_heads, FLAGS.head_dim
    # One backend per run; a dict so that launch variants (backends built with other
    # configs) can be timed beside it in one process.
    backends = {"": registry.resolve("cp_attention", FLAGS.backend)}
    scale = d ** -0.5
    shard = s // w
    if s % w or shard % schedule.SPLIT:
        raise app.UsageError(f"--seq_len / --degree must be a whole number of SPLITs "
                             f"({schedule.SPLIT}): got {s} / {w}")
    pairs = [(i, j) for i in range(w) for j in range(i + 1)]  # causal: ranges 0..i

    def inputs(seed):
        ks = jax.random.split(jax.random.PRNGKey(seed), 3)
        return [jax.random.normal(kk, (b, h, s, d), jnp.float32).astype(jnp.bfloat16)
                for kk, h in zip(ks, (hq, hkv, hkv), strict=True)]

    full = [inputs(0), inputs(1)]

    def sliced(q, k, v):
        return ([q[:, :, i * shard:(i + 1) * shard] for i in range(w)],
                [k[:, :, j * shard:(j + 1) * shard] for j in range(w)],
                [v[:, :, j * shard:(j + 1) * shard] for j in range(w)])

    pre = [jax.block_until_ready(jax.jit(sliced)(*x)) for x in full]
    rows, meta = [], {"seq_len": s, "degree": w, "B": b, "Hq": hq, "Hkv": hkv, "D": d,
                      "launches": len(pairs), "jax": jax.__version__,
                      "device": jax.devices()[0].device_kind, "chain_bits_equal": {}}
    for tag, registered in backends.items():
        be = registered.serving(jnp.bfloat16)

        def chain(qs, ks, vs, be=be):
            res = []
            for i in range(w):
                state = None
                for j in range(i + 1):
                    state = be.fold_on(state, qs[i], ks[j], vs[j], None, (i - j) * shard,
                                       causal=True, scale=scale, finish=j == i)
                res.append(state)
            return res

        def stateless(qs, ks, vs, be=be):
            return [be.fold_on(None, qs[i], ks[j], vs[j], None, (i - j) * shard,
                               causal=True, scale=scale, finish=True) for i, j in pairs]

        def per_shard(q, k, v, be=be):
            return [be.fold_on(None, q[:, :, i * shard:(i + 1) * shard],
                               k[:, :, :(i + 1) * shard], v[:, :, :(i + 1) * shard], None,
                               i * shard, causal=True, scale=scale, finish=True)
                    for i in range(w)]

        op = jaxattn.get_op("attention", backend=registered)
        single = jax.jit(op.forward_with_lse)
        timed = [("single", single, full),
                 ("cp", jax.jit(lambda q, k, v, r=registered: cp.forward_with_lse(
                     q, k, v, cp_world_size=w, backend=r)), full),
                 ("chain", jax.jit(chain), pre), ("stateless", jax.jit(stateless), pre),
                 ("one_launch_per_shard", jax.jit(per_shard), full)]
        first = len(rows)
        for name, fn, args in timed:
            ms = report.rotating_median_seconds(fn, args, FLAGS.iters) * 1e3
            rows.append({"backend": be.name, "config": tag, "variant": name, "ms": ms,
                         "vs_single": ms / (rows[first]["ms"] if rows[first:] else ms)})
        # The chain's bits against the single call's (it is cp's computation).
        out, lse = single(*full[0])
        got = chain(*pre[0])
        meta["chain_bits_equal"][tag or be.name] = all(
            bool(jnp.array_equal(got[i][0], out[:, :, i * shard:(i + 1) * shard]))
            and bool(jnp.array_equal(got[i][1], lse[:, :, i * shard:(i + 1) * shard]))
            for i in range(w))
    md = [f"cp_profile {meta}", "", "| backend | config | variant | ms | vs single |",
          "|---|---|---|---|---|"]
    md += [f"| {r['backend']} | {r['config']} | {r['variant']} | {r['ms']:.3f} | "
           f"{r['vs_single']:.3f}x |" for r in rows]
    print("\n".join(md))
    report.write(FLAGS.out_dir, {"meta": meta, "rows": rows}, "\n".join(md) + "\n")


if __name__ == "__main__":
    app.run(main)
