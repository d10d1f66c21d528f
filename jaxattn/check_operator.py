"""Operator check CLI: the comparison harness on Qwen3-8B-shaped heads, with verdicts.

    python -m jaxattn.check_operator --op attention --candidate pallas --dtype bf16
    python -m jaxattn.check_operator --candidate pallas --batch 8 --seq_len 4096   # GPU

Runs full_prefill, chunked_prefill, paged_kv (and the Transformer Engine oracle with
``--include_transformer_engine``), the RoPE fused-like vs unfused comparison and the
paged decode replay; prints a table; writes a JSON report with ``--json_out``; exits 1
when a bitwise invariant the candidate promises, or the accuracy bar, fails.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxattn import invariance, reference
from jaxattn.invariance import TOLERANCE
from jaxattn.testing import comparison as cmp

FLAGS = flags.FLAGS
flags.DEFINE_enum("op", "attention", ["attention"], "Operator to check.")
flags.DEFINE_enum("candidate", "pallas", ["pallas", "triton", "mosaic", "reference"],
                  "Backend under test (triton: the raw Triton backend, its extra; mosaic: "
                  "the Mosaic GPU backend, sm90 only).")
flags.DEFINE_enum("dtype", "bf16", ["fp32", "bf16", "fp16"], "Input dtype.")
flags.DEFINE_integer("batch", 2, "Batch (Qwen3-8B GPU check: 8).")
flags.DEFINE_integer("num_q_heads", 32, "Query heads.")
flags.DEFINE_integer("num_kv_heads", 8, "KV heads.")
flags.DEFINE_integer("head_dim", 128, "Head dim.")
flags.DEFINE_integer("seq_len", 192, "Sequence length (GPU check: 4096).")
flags.DEFINE_integer("query_chunk_size", 80, "Chunk size of chunked prefill and paged_kv.")
flags.DEFINE_integer("kv_page_size", 64, "Page size of the paged KV cache.")
flags.DEFINE_integer("decode_steps", 16, "Tokens decoded one by one in the replay.")
flags.DEFINE_integer("vocab", 512, "Vocabulary of the random lm_head for dlogp drift.")
flags.DEFINE_bool("include_transformer_engine", False, "Add the TE merge oracle path.")
flags.DEFINE_integer("seed", 0, "Random seed.")
flags.DEFINE_string("json_out", None, "Write the JSON report here.")

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _say(msg: str, t0: float = time.time()) -> None:
    print(f"  ... {msg} ({time.time() - t0:.0f}s)", flush=True)


def main(argv):
    del argv
    dtype = DTYPES[FLAGS.dtype]
    p = invariance.Problem(batch=FLAGS.batch, num_q_heads=FLAGS.num_q_heads,
                           num_kv_heads=FLAGS.num_kv_heads, seq_len=FLAGS.seq_len,
                           head_dim=FLAGS.head_dim, dtype=dtype, seed=FLAGS.seed)
    q, k, v = invariance.random_qkv(p)
    key = jax.random.PRNGKey(FLAGS.seed + 1)
    w = jax.random.normal(key, (p.num_q_heads * p.head_dim, FLAGS.vocab)) / np.sqrt(
        p.num_q_heads * p.head_dim)
    tid = jax.random.randint(jax.random.PRNGKey(FLAGS.seed + 2), (p.batch, p.seq_len), 0,
                             FLAGS.vocab)
    active = jax.random.uniform(jax.random.PRNGKey(FLAGS.seed + 3), (p.batch, p.seq_len)) > 0.1
    inputs = cmp.AttentionInputs(q, k, v, lm_head_weight=w, target_ids=tid, active_mask=active)
    print(f"check_operator --op {FLAGS.op} --candidate {FLAGS.candidate} --dtype {FLAGS.dtype}"
          f" on {jax.devices()[0].device_kind} (jax {jax.__version__}): B={p.batch} "
          f"Hq={p.num_q_heads} Hkv={p.num_kv_heads} S={p.seq_len} D={p.head_dim}", flush=True)
    kw = dict(backend=FLAGS.candidate)
    reports = [
        cmp.compare_single_gpu_attention(inputs, FLAGS.query_chunk_size, FLAGS.kv_page_size,
                                         FLAGS.include_transformer_engine, progress=_say, **kw),
        cmp.compare_single_gpu_rope_attention(inputs, jnp.arange(p.seq_len) + 7,
                                              query_chunk_size=FLAGS.query_chunk_size, **kw),
        cmp.compare_decode_kv_replay(inputs, FLAGS.kv_page_size,
                                     prompt_len=max(1, p.seq_len - FLAGS.decode_steps),
                                     progress=_say, **kw),
    ]
    _say("accuracy vs forward_fp32")
    out = reports[0].path("full_prefill")
    ref = reference.forward_fp32(q, k, v)
    got = jax.jit(lambda q, k, v: cmp.get_op("attention", backend=FLAGS.candidate)(q, k, v))(
        q, k, v)
    rel = float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(ref))) /
                np.max(np.abs(np.asarray(ref))))
    acc_ok = rel <= TOLERANCE[dtype] and not np.isnan(np.asarray(got, np.float32)).any()
    del out

    promises_bits = FLAGS.candidate != "reference"
    failed = not acc_ok
    print(f"\naccuracy: max|out-ref|/max|ref| = {rel:.2e} (bar {TOLERANCE[dtype]:.0e}) "
          f"-> {'PASS' if acc_ok else 'FAIL'}")
    print(f"{'comparison':<18}{'path':<30}{'bits':<7}{'out max':>10}{'out p99':>10}"
          f"{'lse max':>10}{'dlogp max':>11}  verdict")
    for rep in reports:
        for path in rep.paths:
            if not path.available:
                print(f"{rep.op:<18}{path.name:<30}{'-':<7}{'':>41}  unavailable: "
                      f"{path.unavailable_reason}")
                continue
            oracle = path.name.startswith("transformer_engine")
            if oracle or not promises_bits:
                ok = path.out_drift["max"] <= TOLERANCE[dtype] * float(np.max(np.abs(
                    np.asarray(ref))))
            else:
                ok = bool(path.bitwise_equal)
            failed |= not ok
            dl = path.dlogp_drift["max"] if path.dlogp_drift else float("nan")
            print(f"{rep.op:<18}{path.name:<30}{str(path.bitwise_equal):<7}"
                  f"{path.out_drift['max']:>10.2e}{path.out_drift['p99']:>10.2e}"
                  f"{path.lse_drift['max']:>10.2e}{dl:>11.2e}  "
                  f"{'PASS' if ok else 'FAIL'}{'' if promises_bits and not oracle else ' (tol)'}")
        if rep.extra:
            print(f"{'':<18}post-RoPE q/k bitwise equal: {rep.extra['post_rope_qk_bitwise_equal']}")
            failed |= not rep.extra["post_rope_qk_bitwise_equal"]
    print(f"\n{'FAIL' if failed else 'PASS'}")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump({"accuracy": {"max_rel_err": rel, "ok": acc_ok},
                       "reports": [r.to_dict() for r in reports], "passed": not failed,
                       "device": jax.devices()[0].device_kind, "jax": jax.__version__},
                      f, indent=2)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    app.run(main)
