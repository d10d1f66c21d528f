"""Packed sequences and left padding: what the bits-keeping layouts cost.

    python -m benchmarks.varlen_bench --out_dir=/tmp/varlen     # GPU
    python -m benchmarks.varlen_bench --smoke                   # CPU, tiny shapes

Times, in one process, forward and forward + backward of:

* ``varlen``: :func:`jaxattn.varlen.attention` on a packed batch (FlashAttention's
  layout), the sequences' lengths from ``--packs`` ("balanced": equal lengths; "skewed":
  one long sequence and many short ones);
* ``padded``: the same sequences as a right-padded batch ``[N, H, max_len, D]`` through
  :func:`jaxattn.attention` with a key padding mask (what a trainer without varlen runs);
* ``cudnn_padded``: ``jax.nn.dot_product_attention(implementation="cudnn")`` on that
  padded batch with ``query_seq_lengths`` / ``key_value_seq_lengths`` (GPU only);
* left padding: a batch of ``--lp_batch`` sequences of ``--lp_seq`` tokens, left-padded
  by a different amount each, with its mask, beside the same batch without a mask.

TFLOP/s count the causal pairs of the real tokens only (forward + backward: 3.5x the
forward's FLOPs), so the padding each layout computes shows as a lower rate. Timing: a
warm-up, then the median of ``--iters`` samples of back-to-back calls rotating over
``--input_sets`` input sets (benchmarks/report.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import jaxattn
from benchmarks import report
from jaxattn import varlen

FLAGS = flags.FLAGS
flags.DEFINE_list("packs", ["balanced", "skewed"], "Packings to time.")
flags.DEFINE_integer("num_q_heads", 32, "Query heads.")
flags.DEFINE_integer("num_kv_heads", 8, "KV heads.")
flags.DEFINE_integer("head_dim", 128, "Head dim.")
flags.DEFINE_integer("lp_batch", 8, "Left padding: batch.")
flags.DEFINE_integer("lp_seq", 2048, "Left padding: tokens per row.")
flags.DEFINE_integer("iters", 5, "Timed samples per point.")
flags.DEFINE_integer("input_sets", 2, "Input sets rotated over.")
flags.DEFINE_float("sample_ms", 30.0, "Target duration of one sample.")
flags.DEFINE_string("backend", None, "jaxattn backend (None: the platform's first).")
flags.DEFINE_string("out_dir", None, "Write results.json / results.md here.")
flags.DEFINE_bool("smoke", False, "Tiny shapes on a CPU (the Pallas kernels, interpreted).")

PACKS = {
    "balanced": [2048] * 8,
    "skewed": [8192, 2048, 1024, 1024, 512, 512, 256, 256, 128, 128, 64, 64],
}
SMOKE_PACKS = {"balanced": [64] * 2, "skewed": [100, 20, 1]}


def _rand(key, shape):
    return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)


def _time(fn, inputs) -> float:
    sync = jax.block_until_ready
    return report.sampled_seconds(fn, inputs, sync, FLAGS.iters, 2, 50,
                                  FLAGS.sample_ms / 1e3)[0]


def _grad(f):
    def loss(q, k, v, do):
        return jnp.sum(f(q, k, v).astype(jnp.float32) * do)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def bench_pack(name: str, lengths: list[int], backend) -> list[dict]:
    hq, hkv, d = FLAGS.num_q_heads, FLAGS.num_kv_heads, FLAGS.head_dim
    n, t, mx = len(lengths), sum(lengths), max(lengths)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    flops = sum(report.attention_flops(1, hq, s, s, d, True) for s in lengths)
    rows = []
    sets = []
    for i in range(FLAGS.input_sets):
        ks = jax.random.split(jax.random.PRNGKey(100 + i), 4)
        q, k, v = _rand(ks[0], (t, hq, d)), _rand(ks[1], (t, hkv, d)), _rand(ks[2], (t, hkv, d))
        sets.append((q, k, v, _rand(ks[3], (t, hq, d))))

    def packed(q, k, v):
        return varlen.attention(q, k, v, cu, cu, max_seqlen_q=mx, max_seqlen_k=mx,
                                backend=backend)

    # The right-padded batch of the same sequences.
    idx = np.zeros((n, mx), np.int32)
    keep = np.zeros((n, mx), bool)
    for j, s in enumerate(lengths):
        idx[j, :s] = np.asarray(cu)[j] + np.arange(s)
        keep[j, :s] = True
    idx_j, keep_j = jnp.asarray(idx), jnp.asarray(keep)

    def to_padded(x):
        return jnp.where(keep_j[:, None, :, None], jnp.swapaxes(x[idx_j], 1, 2), 0)

    padded_sets = [tuple(to_padded(x) for x in s) for s in sets]

    def padded(q, k, v):
        return jaxattn.attention(q, k, v, key_padding_mask=keep_j, backend=backend)

    systems = [("varlen", packed, sets), ("padded", padded, padded_sets)]
    if jax.default_backend() == "gpu":
        lens = jnp.asarray(lengths, jnp.int32)

        def cudnn(q, k, v):
            out = jax.nn.dot_product_attention(
                jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2),
                is_causal=True, query_seq_lengths=lens, key_value_seq_lengths=lens,
                implementation="cudnn")
            return jnp.swapaxes(out, 1, 2)

        systems.append(("cudnn_padded", cudnn, padded_sets))
    for sysname, f, ins in systems:
        fwd = jax.jit(f)
        bwd = _grad(f)
        for mode, fn, args in (("fwd", fwd, [s[:3] for s in ins]), ("fwdbwd", bwd, ins)):
            try:
                sec = _time(fn, args)
                rate = flops * (3.5 if mode == "fwdbwd" else 1.0) / sec / 1e12
                row = dict(pack=name, system=sysname, mode=mode, sequences=n, tokens=t,
                           max_len=mx, ms=sec * 1e3, tflops=rate)
            except Exception as e:  # a peer that refuses the shape
                row = dict(pack=name, system=sysname, mode=mode, error=str(e)[:200])
            report.print_row(row)
            rows.append(row)
    return rows


def bench_left_padding(backend) -> list[dict]:
    b, s = FLAGS.lp_batch, FLAGS.lp_seq
    hq, hkv, d = FLAGS.num_q_heads, FLAGS.num_kv_heads, FLAGS.head_dim
    pads = jnp.asarray([(j * s) // (2 * b) for j in range(b)], jnp.int32)  # 0 .. s/2
    keep = jnp.arange(s)[None, :] >= pads[:, None]
    sets = []
    for i in range(FLAGS.input_sets):
        ks = jax.random.split(jax.random.PRNGKey(200 + i), 4)
        sets.append((_rand(ks[0], (b, hq, s, d)), _rand(ks[1], (b, hkv, s, d)),
                     _rand(ks[2], (b, hkv, s, d)), _rand(ks[3], (b, hq, s, d))))
    flops = report.attention_flops(b, hq, s, s, d, True)
    rows = []
    for sysname, mask in (("no mask", None), ("left-padded mask", keep)):
        def f(q, k, v, mask=mask):
            return jaxattn.attention(q, k, v, key_padding_mask=mask, backend=backend)
        for mode, fn, args in (("fwd", jax.jit(f), [x[:3] for x in sets]),
                               ("fwdbwd", _grad(f), sets)):
            sec = _time(fn, args)
            row = dict(pack=f"left padding B={b} S={s}", system=sysname, mode=mode,
                       ms=sec * 1e3,
                       tflops=flops * (3.5 if mode == "fwdbwd" else 1.0) / sec / 1e12)
            report.print_row(row)
            rows.append(row)
    return rows


def main(argv):
    del argv
    backend = FLAGS.backend or ("pallas" if FLAGS.smoke else None)
    if FLAGS.smoke:
        FLAGS.num_q_heads, FLAGS.num_kv_heads, FLAGS.head_dim = 2, 1, 64
        FLAGS.lp_batch, FLAGS.lp_seq, FLAGS.iters, FLAGS.input_sets = 2, 80, 1, 1
    packs = SMOKE_PACKS if FLAGS.smoke else PACKS
    name = jaxattn.get_op("attention", backend=backend).backend
    print({"jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
           "backend": name}, flush=True)
    rows = []
    for p in FLAGS.packs:
        rows += bench_pack(p, packs[p], backend)
    rows += bench_left_padding(backend)
    lines = ["| layout | system | mode | ms | TFLOP/s (real tokens) |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['pack']} | {r['system']} | {r['mode']} | {r['error']} | |")
        else:
            lines.append(f"| {r['pack']} | {r['system']} | {r['mode']} | {r['ms']:.3f} | "
                         f"{r['tflops']:.1f} |")
    md = "\n".join(lines) + "\n"
    print(md)
    report.write(FLAGS.out_dir, dict(backend=name, rows=rows), md)


if __name__ == "__main__":
    app.run(main)
