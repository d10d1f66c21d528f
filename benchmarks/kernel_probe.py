"""A few calls of one attention op at one shape, for a profiler to watch (H200).

    ncu --clock-control none --set full -k regex:NAME --launch-skip 2 --launch-count 1 \\
        -o fwd python3 -m benchmarks.kernel_probe --mode=fwd

``gpu_suite.sh``'s ``ncu`` stage runs it twice: once to list the kernels and their
times, then the full section set on the longest kernel (issue 33's "where the time goes
per tile": stall reasons, issue slots, the source view's per-instruction samples; issue
26's decode: occupancy and the DRAM throughput of the split kernel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import app, flags

import jaxattn

FLAGS = flags.FLAGS
flags.DEFINE_enum("mode", "fwd", ["fwd", "fwdbwd", "fold", "decode"], "Forward, "
                  "forward and backward, CP's fold over a key range (Backend.fold_on: a "
                  "launch that stores the fp32 state, then one that loads and stores it; "
                  "the queries of --seq_len rows after --seq_len keys), or decode (one "
                  "query per head against --seq_len keys, causal).")
flags.DEFINE_integer("batch", 2, "Batch.")
flags.DEFINE_integer("seq_len", 4096, "Sequence length (Sq = Skv; decode: Skv).")
flags.DEFINE_integer("num_q_heads", 32, "Query heads.")
flags.DEFINE_integer("num_kv_heads", 8, "KV heads.")
flags.DEFINE_integer("head_dim", 128, "Head dim.")
flags.DEFINE_bool("causal", True, "Causal.")
flags.DEFINE_integer("calls", 3, "Calls after the first (compiling) one.")
flags.DEFINE_string("backend", None, "Backend (default: the registry's).")
flags.DEFINE_string("peer", None, "Instead of jaxattn: a peer system of benchmarks/systems.py "
                    "(e.g. torch_cudnn, cudnn), forward, forward and backward (its "
                    "fwdbwd: the gradients of sum(out * dO)) or decode, for the same "
                    "profiler sections beside jaxattn's kernels.")
flags.DEFINE_string("mosaic_config", None, "With the mosaic backend (--backend=mosaic or the "
                    "registry's default on sm90): call the Mosaic forward "
                    "with these MosaicConfig fields, key=value[:key=value...] (e.g. "
                    "split_decode_stages=2), instead of the registry's op.")


def main(argv):
    del argv
    b, s, d = FLAGS.batch, FLAGS.seq_len, FLAGS.head_dim
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    sq = 1 if FLAGS.mode == "decode" else s
    q = jax.random.normal(ks[0], (b, FLAGS.num_q_heads, sq, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, FLAGS.num_kv_heads, s, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, FLAGS.num_kv_heads, s, d), jnp.bfloat16)
    causal = FLAGS.causal or FLAGS.mode == "decode"
    if FLAGS.peer is not None:
        if FLAGS.mode not in ("fwd", "fwdbwd", "decode"):
            raise app.UsageError("--peer is for forward, fwdbwd or decode")
        from benchmarks import systems
        system = systems.make(FLAGS.peer)
        args, run = system.prepare(q, k, v), system.forward
        if FLAGS.mode == "fwdbwd":  # the gradients of sum(out * dO)
            args = (*args, system.prepare_like_q(
                jax.random.normal(ks[3], q.shape, jnp.bfloat16)))
            run = system.fwdbwd
        for _ in range(FLAGS.calls + 1):
            system.sync(run(*args, causal=causal))
        print(f"kernel_probe: {FLAGS.mode} on {FLAGS.peer}, B={b} Sq={sq} Skv={s} D={d}")
        return
    op = jaxattn.get_op("attention", backend=FLAGS.backend)
    if FLAGS.mosaic_config is not None:
        # (the registry's default backend counts: mosaic on sm90)
        if op.backend != "mosaic" or FLAGS.mode not in ("fwd", "decode"):
            raise app.UsageError(f"--mosaic_config is for the mosaic backend, forward or "
                                 f"decode; got backend {op.backend!r}, mode {FLAGS.mode!r}")
        from benchmarks.report import config_fields
        from jaxattn.backends.mosaic import forward as mf
        cfg = mf.MosaicConfig(**config_fields(FLAGS.mosaic_config))

        def fn(q, k, v):
            return mf.forward(q, k, v, causal=causal, scale=d ** -0.5, config=cfg)[0]

        fn = jax.jit(fn)
    elif FLAGS.mode == "fold":
        be = op.backend_object.serving(q.dtype)
        kw = dict(causal=True, scale=d ** -0.5)

        def fn(q, k, v):
            state = be.fold_on(None, q, k, v, None, s, finish=False, **kw)
            return be.fold_on(state, q, k, v, None, s, finish=False, **kw)

        fn = jax.jit(fn)
    elif FLAGS.mode in ("fwd", "decode"):
        fn = jax.jit(lambda q, k, v: op(q, k, v, causal=causal))
    else:
        do = jax.random.normal(ks[3], q.shape, jnp.bfloat16)
        fn = jax.jit(lambda q, k, v: jax.vjp(
            lambda q, k, v: op(q, k, v, causal=causal), q, k, v)[1](do))
    for _ in range(FLAGS.calls + 1):
        jax.block_until_ready(fn(q, k, v))
    print(f"kernel_probe: {FLAGS.mode} on {op.backend}"
          f"{' ' + FLAGS.mosaic_config if FLAGS.mosaic_config else ''}, B={b} Sq={sq} "
          f"Skv={s} D={d}")


if __name__ == "__main__":
    app.run(main)
