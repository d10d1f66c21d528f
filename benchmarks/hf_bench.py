"""HF transformers with ``attn_implementation="jaxattn"`` beside ``"sdpa"``, in one process.

    python -m benchmarks.hf_bench --out_dir=/tmp/hf               # GPU, Qwen3-8B heads
    python -m benchmarks.hf_bench --smoke                         # CPU, tiny model

A Qwen3 model with random weights and Qwen3-8B's attention heads (Hq=32, Hkv=8, D=128,
hidden 4096; ``--layers`` decoder layers, a ``--vocab`` token vocabulary) times, for each
implementation on the same weights:

* cached decode steps: a ``--batch`` x ``--context`` prompt prefilled into a
  ``DynamicCache``, then ``--steps`` single-token steps (the cache grows a token a step);
  the first step's time is reported apart (jaxattn compiles once per key-length bucket
  there), the median of the rest is the step time;
* training steps: forward + backward of the causal LM loss at ``--train_batch`` x
  ``--train_seq`` (median of ``--train_steps`` after one warm-up step).

Every step synchronises the GPU, so a step's time is its wall time.
"""

from __future__ import annotations

import os
import statistics
import time

from absl import app, flags

from benchmarks import report

FLAGS = flags.FLAGS
flags.DEFINE_integer("layers", 4, "Decoder layers.")
flags.DEFINE_integer("batch", 8, "Decode batch.")
flags.DEFINE_integer("context", 2048, "Cached tokens before the timed decode steps.")
flags.DEFINE_integer("steps", 32, "Timed decode steps.")
flags.DEFINE_integer("train_batch", 4, "Training batch.")
flags.DEFINE_integer("train_seq", 2048, "Training sequence length.")
flags.DEFINE_integer("train_steps", 5, "Timed training steps.")
flags.DEFINE_integer("vocab", 32000, "Vocabulary size (Qwen3's 151936 only grows the "
                     "embedding and the LM head, which do not touch attention).")
flags.DEFINE_enum("dtype", "bf16", ["bf16", "fp16", "fp32"], "Model dtype.")
flags.DEFINE_list("impls", ["sdpa", "jaxattn"], "Attention implementations to time.")
flags.DEFINE_string("out_dir", None, "Write results.json / results.md here.")
flags.DEFINE_bool("smoke", False, "A tiny model and shapes that run on a CPU.")


def _model(torch, dtype, device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if FLAGS.smoke:
        cfg = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=128)
    else:
        cfg = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, vocab_size=FLAGS.vocab)
    config = Qwen3Config(num_hidden_layers=FLAGS.layers, max_position_embeddings=40960,
                         attention_dropout=0.0, tie_word_embeddings=False, **cfg)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs (no host-side init)
        model = Qwen3ForCausalLM(config)
    return model.to(dtype=dtype), config


def _decode(torch, model, impl, batch, context, steps, vocab, device, sync):
    from transformers import DynamicCache

    model.set_attn_implementation(impl)
    model.eval()
    g = torch.Generator(device="cpu").manual_seed(1)
    prompt = torch.randint(0, vocab, (batch, context), generator=g).to(device)
    nxt = torch.randint(0, vocab, (batch, steps + 1, 1), generator=g).to(device)
    times, tokens = [], []
    with torch.no_grad():
        cache = DynamicCache()
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
        sync()
        for i in range(steps + 1):
            t0 = time.perf_counter()
            out = model(input_ids=nxt[:, i], past_key_values=out.past_key_values,
                        use_cache=True)
            sync()
            times.append(time.perf_counter() - t0)
            tokens.append(out.logits[:, -1].float().argmax(-1))
    return times[0], statistics.median(times[1:]), torch.stack(tokens, 1).cpu()


def _train(torch, model, impl, batch, seq, steps, vocab, device, sync):
    model.set_attn_implementation(impl)
    model.train()
    g = torch.Generator(device="cpu").manual_seed(2)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    times = []
    for _ in range(steps + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        sync()
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[1:]), float(loss)


def main(argv):
    del argv
    import jax
    import torch

    from torch_bridge import hf

    hf.register()
    cuda = torch.cuda.is_available() and jax.default_backend() != "cpu"
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[FLAGS.dtype]
    if FLAGS.smoke:
        batch, context, steps, tb, ts, tsteps = 2, 20, 3, 2, 16, 1
    else:
        batch, context, steps = FLAGS.batch, FLAGS.context, FLAGS.steps
        tb, ts, tsteps = FLAGS.train_batch, FLAGS.train_seq, FLAGS.train_steps
    model, config = _model(torch, dtype, device)
    vocab = config.vocab_size
    rows, tokens = [], {}
    for impl in FLAGS.impls:
        first, step, toks = _decode(torch, model, impl, batch, context, steps, vocab,
                                    device, sync)
        tokens[impl] = toks
        rows.append({"impl": impl, "what": "decode step", "B": batch, "S": context,
                     "first_ms": first * 1e3, "ms": step * 1e3})
        print(rows[-1], flush=True)
        first, step, loss = _train(torch, model, impl, tb, ts, tsteps, vocab, device, sync)
        rows.append({"impl": impl, "what": "training step", "B": tb, "S": ts,
                     "first_ms": first * 1e3, "ms": step * 1e3, "loss": loss})
        print(rows[-1], flush=True)
    base = {r["what"]: r["ms"] for r in rows if r["impl"] == "sdpa"}
    for r in rows:
        if r["what"] in base:
            r["vs_sdpa"] = r["ms"] / base[r["what"]]
    same_tokens = (None if len(tokens) < 2 else
                   float((tokens[FLAGS.impls[0]] == tokens[FLAGS.impls[1]]).float().mean()))
    meta = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "backend": hf.make_attention_function().op.backend,
            "layers": FLAGS.layers, "dtype": FLAGS.dtype, "vocab": vocab,
            "greedy_tokens_agree": same_tokens,
            "command": "python -m benchmarks.hf_bench " + " ".join(os.sys.argv[1:])}
    md = [f"Measured {meta['date']} on {meta['device']} (jax {meta['jax']}, torch "
          f"{meta['torch']}, transformers {meta['transformers']}, jaxattn backend "
          f"{meta['backend']}); Qwen3 with Qwen3-8B heads, {FLAGS.layers} layers, random "
          f"weights, {FLAGS.dtype}; command: `{meta['command']}`", "",
          "| implementation | what | B | S | first step ms | step ms (median) | vs sdpa |",
          "|---|---|---|---|---|---|---|"]
    md += [f"| {r['impl']} | {r['what']} | {r['B']} | {r['S']} | {r['first_ms']:.1f} | "
           f"{r['ms']:.2f} | {r.get('vs_sdpa', float('nan')):.3f} |" for r in rows]
    if same_tokens is not None:
        md += ["", f"Greedy tokens of the decode steps equal between the two: "
                   f"{100 * same_tokens:.1f}%."]
    print("\n".join(md))
    report.write(FLAGS.out_dir, {"meta": meta, "rows": rows}, "\n".join(md) + "\n")


if __name__ == "__main__":
    app.run(main)
