"""Rollout and training log-probs, equal in bits, in a Qwen3-style decoder in JAX.

    python -m examples.qwen3_rollout_parity                 # small, runs on a CPU
    python -m examples.qwen3_rollout_parity --size=qwen3-8b # Qwen3-8B sizes (GPU)

A randomly initialised Qwen3-style stack (RMSNorm, QK-norm, RoPE, GQA attention through
jaxattn, SwiGLU MLP) generates tokens greedily for a batch of prompts of different
lengths, the way a rollout engine does: one prompt by a plain prefill, one by chunked
prefill, two by one padded prefill, then step-by-step decode of the whole batch against
a paged KV cache. A trainer then recomputes the log-probs of the generated tokens with a
full forward over the padded batch. The script prints the per-token difference.

How the difference becomes exactly zero:

* attention: jaxattn's kernels reduce every row in one fixed order (prefill, chunk,
  paged decode, padded batch all give the same bits);
* everything else is token-wise. It runs through :func:`rowwise`, which cuts the tokens
  into fixed chunks of ``ROWS`` rows (padded, and at least two chunks so the loop is
  never dropped) and maps one compiled per-chunk computation over them: every matmul,
  norm and softmax sees the same shape whatever the batch, so a token's bits do not
  depend on how many other tokens share the call.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import jaxattn
from jaxattn import paged, rope

ROWS = 16  # tokens per fixed chunk of the token-wise computations
#: False: token-wise layers run as plain matmuls over all rows (the usual, faster, not
#: batch-invariant way); only the cost measurement turns it off.
ROWWISE = True


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256
    hidden: int = 128
    layers: int = 2
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 256
    theta: float = 1_000_000.0
    eps: float = 1e-6
    dtype: str = "float32"
    #: jaxattn backend of every attention call ("pallas": the canonical schedule; on a
    #: CPU it runs in interpret mode). "reference" shows what breaks parity.
    backend: str = "pallas"


SIZES = {
    "small": Config(),
    "qwen3-8b": Config(vocab=151_936, hidden=4096, layers=36, q_heads=32, kv_heads=8,
                       head_dim=128, intermediate=12_288, dtype="bfloat16", backend="pallas"),
}


def init_params(cfg: Config, seed: int = 0) -> dict:
    """Random weights (no download): normal / sqrt(fan_in)."""
    dt = jnp.dtype(cfg.dtype)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 8 + 8 * cfg.layers))

    def w(shape):
        return (jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(shape[0])).astype(dt)

    layers = []
    for _ in range(cfg.layers):
        layers.append({
            "ln1": jnp.ones((cfg.hidden,), dt), "ln2": jnp.ones((cfg.hidden,), dt),
            "wq": w((cfg.hidden, cfg.q_heads * cfg.head_dim)),
            "wk": w((cfg.hidden, cfg.kv_heads * cfg.head_dim)),
            "wv": w((cfg.hidden, cfg.kv_heads * cfg.head_dim)),
            "wo": w((cfg.q_heads * cfg.head_dim, cfg.hidden)),
            "q_norm": jnp.ones((cfg.head_dim,), dt), "k_norm": jnp.ones((cfg.head_dim,), dt),
            "gate": w((cfg.hidden, cfg.intermediate)), "up": w((cfg.hidden, cfg.intermediate)),
            "down": w((cfg.intermediate, cfg.hidden)),
        })
    return {"embed": (w((cfg.vocab, cfg.hidden)) * float(np.sqrt(cfg.vocab))).astype(dt),
            "final_norm": jnp.ones((cfg.hidden,), dt), "lm_head": w((cfg.hidden, cfg.vocab)),
            "layers": layers}


def rowwise(fn, *xs):
    """Apply ``fn`` to fixed chunks of ``ROWS`` rows of ``xs`` (leading dims equal), so the
    compiled per-chunk computation is the same for every call, whatever the row count."""
    if not ROWWISE:
        return fn(*xs)
    n = xs[0].shape[0]
    chunks = max(2, -(-n // ROWS))
    pad = chunks * ROWS - n
    padded = [jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in xs]
    shaped = [x.reshape(chunks, ROWS, *x.shape[1:]) for x in padded]
    out = jax.lax.map(lambda a: fn(*a), tuple(shaped))
    return jax.tree_util.tree_map(lambda y: y.reshape(chunks * ROWS, *y.shape[2:])[:n], out)


def _rms(x, w, eps):
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    return (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype) * w


def _pre_attention(cfg, lp, h, pos):
    """Token-wise: RMSNorm, q/k/v projections, QK-norm, RoPE. h [R, H], pos [R]."""
    x = _rms(h, lp["ln1"], cfg.eps)
    r = h.shape[0]
    q = (x @ lp["wq"]).reshape(r, cfg.q_heads, cfg.head_dim)
    k = (x @ lp["wk"]).reshape(r, cfg.kv_heads, cfg.head_dim)
    v = (x @ lp["wv"]).reshape(r, cfg.kv_heads, cfg.head_dim)
    q = _rms(q, lp["q_norm"], cfg.eps)
    k = _rms(k, lp["k_norm"], cfg.eps)
    # RoPE on [1, H, R, D] with the tokens' own positions.
    q = rope.forward(jnp.swapaxes(q, 0, 1)[None], pos[None], theta=cfg.theta)[0]
    k = rope.forward(jnp.swapaxes(k, 0, 1)[None], pos[None], theta=cfg.theta)[0]
    return jnp.swapaxes(q, 0, 1), jnp.swapaxes(k, 0, 1), v


def _post_attention(cfg, lp, h, attn):
    """Token-wise: output projection, residual, RMSNorm, SwiGLU MLP, residual."""
    h = h + attn.reshape(h.shape[0], -1) @ lp["wo"]
    x = _rms(h, lp["ln2"], cfg.eps)
    return h + (jax.nn.silu(x @ lp["gate"]) * (x @ lp["up"])) @ lp["down"]


def _logp(cfg, params, h, targets):
    """Token-wise: final norm, lm_head, log-softmax, log-prob of ``targets`` (and argmax)."""
    x = _rms(h, params["final_norm"], cfg.eps)
    logits = (x @ params["lm_head"]).astype(jnp.float32)
    lp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0], jnp.argmax(logits, -1)


def _to_bhsd(x, b, s):
    """[B*S, H, D] token rows -> [B, H, S, D]."""
    return jnp.swapaxes(x.reshape(b, s, *x.shape[1:]), 1, 2)


def _from_bhsd(x):
    b, h, s, d = x.shape
    return jnp.swapaxes(x, 1, 2).reshape(b * s, h, d)


# ------------------------------------------------------------------------ training

@functools.partial(jax.jit, static_argnames=("cfg",))
def _train_attention(cfg: Config, q, k, v, keep, lengths):
    """The trainer's attention: jaxattn's backend, or (cost measurement only: "cudnn" /
    "xla") ``jax.nn.dot_product_attention``, the usual non-invariant choice."""
    if cfg.backend in ("cudnn", "xla"):
        sw = lambda x: jnp.swapaxes(x, 1, 2)
        out = jax.nn.dot_product_attention(sw(q), sw(k), sw(v), is_causal=True,
                                           key_value_seq_lengths=lengths.astype(jnp.int32),
                                           implementation=cfg.backend)
        return sw(out)
    return jaxattn.attention(q, k, v, key_padding_mask=keep, backend=cfg.backend)


def train_logprobs(cfg: Config, params, tokens, lengths):
    """Full forward over a tail-padded batch ``tokens [B, S]``: log-prob of token t+1 at
    every position t (``[B, S-1]``), as a trainer computes it."""
    b, s = tokens.shape
    keep = jnp.arange(s)[None, :] < lengths[:, None]
    pos = jnp.broadcast_to(jnp.arange(s), (b, s)).reshape(-1)
    h = params["embed"][tokens.reshape(-1)]
    for lp in params["layers"]:
        q, k, v = rowwise(functools.partial(_pre_attention, cfg, lp), h, pos)
        attn = _train_attention(cfg, _to_bhsd(q, b, s), _to_bhsd(k, b, s),
                                _to_bhsd(v, b, s), keep, lengths)
        h = rowwise(functools.partial(_post_attention, cfg, lp), h, _from_bhsd(attn))
    targets = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1).reshape(-1)
    logp, _ = rowwise(functools.partial(_logp, cfg, params), h, targets)
    return logp.reshape(b, s)[:, :-1]


# ------------------------------------------------------------------------- rollout

class Rollout:
    """A minimal rollout engine over a paged KV cache (one cache per layer)."""

    def __init__(self, cfg: Config, params, batch: int, max_len: int, page_size: int = 64):
        self.cfg, self.params = cfg, params
        self.page_size = page_size
        max_pages = -(-max_len // page_size)
        num_pages = batch * max_pages
        perm = np.random.default_rng(0).permutation(num_pages)  # any page table will do
        self.table = jnp.asarray(perm.reshape(batch, max_pages).astype(np.int32))
        shape = (num_pages, cfg.kv_heads, page_size, cfg.head_dim)
        dt = jnp.dtype(cfg.dtype)
        self.pages = [[jnp.zeros(shape, dt), jnp.zeros(shape, dt)] for _ in range(cfg.layers)]
        self.lens = jnp.zeros((batch,), jnp.int32)

    def _write(self, layer, rows, k, v):
        """Append k, v ``[B', Hkv, T, D]`` for batch rows ``rows``."""
        kp, vp = self.pages[layer]
        kp, vp, _ = paged.write(kp, vp, self.table[rows], self.lens[rows], k, v)
        self.pages[layer] = [kp, vp]

    def prefill(self, b: int, prompt: np.ndarray, chunk: int | None = None):
        """Prefill sequence ``b`` (contiguous attention, or chunked against the cache).
        Returns the last position's hidden state row."""
        cfg = self.cfg
        chunk = chunk or len(prompt)
        rows = jnp.array([b])
        for a in range(0, len(prompt), chunk):
            toks = jnp.asarray(prompt[a:a + chunk])
            pos = jnp.arange(a, a + len(toks))
            h = self.params["embed"][toks]
            for li, lp in enumerate(self.params["layers"]):
                q, k, v = rowwise(functools.partial(_pre_attention, cfg, lp), h, pos)
                qb, kb, vb = (_to_bhsd(x, 1, len(toks)) for x in (q, k, v))
                self._write(li, rows, kb, vb)
                if chunk == len(prompt):  # plain prefill: contiguous attention
                    attn = jaxattn.attention(qb, kb, vb, backend=cfg.backend)
                else:                     # chunked prefill: read the cache
                    kp, vp = self.pages[li]
                    attn = paged.attention(qb, kp, vp, self.table[rows],
                                           self.lens[rows] + len(toks), backend=cfg.backend)
                h = rowwise(functools.partial(_post_attention, cfg, lp), h, _from_bhsd(attn))
            self.lens = self.lens.at[b].add(len(toks))
        return h[-1]

    def prefill_padded(self, bs: list[int], prompts: list[np.ndarray]):
        """Prefill several sequences as one tail-padded batch."""
        cfg = self.cfg
        s = max(len(p) for p in prompts)
        toks = jnp.asarray(np.stack([np.pad(p, (0, s - len(p))) for p in prompts]))
        lengths = jnp.asarray([len(p) for p in prompts])
        keep = jnp.arange(s)[None, :] < lengths[:, None]
        n = len(bs)
        pos = jnp.broadcast_to(jnp.arange(s), (n, s)).reshape(-1)
        h = self.params["embed"][toks.reshape(-1)]
        for li, lp in enumerate(self.params["layers"]):
            q, k, v = rowwise(functools.partial(_pre_attention, cfg, lp), h, pos)
            qb, kb, vb = (_to_bhsd(x, n, s) for x in (q, k, v))
            for i, b in enumerate(bs):
                self._write(li, jnp.array([b]), kb[i:i + 1, :, :len(prompts[i])],
                            vb[i:i + 1, :, :len(prompts[i])])
            attn = jaxattn.attention(qb, kb, vb, key_padding_mask=keep, backend=cfg.backend)
            h = rowwise(functools.partial(_post_attention, cfg, lp), h, _from_bhsd(attn))
        for b, p in zip(bs, prompts, strict=True):
            self.lens = self.lens.at[b].add(len(p))
        return [h.reshape(n, s, -1)[i, len(p) - 1] for i, p in enumerate(prompts)]

    def decode_step(self, tokens: jax.Array):
        """One token per sequence, all sequences together. Returns hidden rows [B, H]."""
        cfg = self.cfg
        pos = self.lens
        h = self.params["embed"][tokens]
        nb = tokens.shape[0]
        for li, lp in enumerate(self.params["layers"]):
            q, k, v = rowwise(functools.partial(_pre_attention, cfg, lp), h, pos)
            qb, kb, vb = (_to_bhsd(x, nb, 1) for x in (q, k, v))
            self._write(li, jnp.arange(nb), kb, vb)
            kp, vp = self.pages[li]
            attn = paged.attention(qb, kp, vp, self.table, self.lens + 1, backend=cfg.backend)
            h = rowwise(functools.partial(_post_attention, cfg, lp), h, _from_bhsd(attn))
        self.lens = self.lens + 1
        return h

    def sample(self, h_rows, dummy_targets):
        """Greedy next tokens and their log-probs for hidden rows ``[B, H]``."""
        cfg, params = self.cfg, self.params
        _, nxt = rowwise(functools.partial(_logp, cfg, params), h_rows, dummy_targets)
        logp, _ = rowwise(functools.partial(_logp, cfg, params), h_rows, nxt)
        return nxt, logp


def run(cfg: Config, prompt_lens=(37, 100, 64, 5), new_tokens: int = 12, seed: int = 0,
        chunk: int = 48):
    """Roll out, then recompute as a trainer; returns (rollout logp, train logp, tokens)."""
    params = init_params(cfg, seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg.vocab, n) for n in prompt_lens]
    b = len(prompts)
    eng = Rollout(cfg, params, b, max(prompt_lens) + new_tokens + 1)
    last = [None] * b
    last[0] = eng.prefill(0, prompts[0])                       # plain prefill
    last[1] = eng.prefill(1, prompts[1], chunk=chunk)          # chunked prefill
    last[2], last[3] = eng.prefill_padded([2, 3], prompts[2:4])  # one padded prefill
    h = jnp.stack(last)
    zeros = jnp.zeros((b,), jnp.int32)
    generated, rollout_logp = [], []
    for step in range(new_tokens):
        nxt, logp = eng.sample(h, zeros)
        generated.append(np.asarray(nxt))
        rollout_logp.append(np.asarray(logp))
        if step + 1 < new_tokens:
            h = eng.decode_step(nxt)
    generated = np.stack(generated, 1)                # [B, T]
    rollout_logp = np.stack(rollout_logp, 1)          # [B, T]
    seqs = [np.concatenate([p, g]) for p, g in zip(prompts, generated, strict=True)]
    lengths = np.array([len(s_) for s_ in seqs])
    s_max = int(lengths.max())
    tokens = jnp.asarray(np.stack([np.pad(s_, (0, s_max - len(s_))) for s_ in seqs]))
    train = np.asarray(train_logprobs(cfg, params, tokens, jnp.asarray(lengths)))
    # The log-prob of generated token j of sequence b sits at position len(prompt_b)-1+j.
    train_logp = np.stack([train[i, len(p) - 1:len(p) - 1 + new_tokens]
                           for i, p in enumerate(prompts)])
    return rollout_logp, train_logp, generated


def measure_cost(cfg: Config, batch: int, seq_len: int, iters: int = 5,
                 peer: str | None = None) -> list[dict]:
    """What bitwise parity costs the trainer: forward and forward+backward (gradients of
    the summed log-probs with respect to every weight) of :func:`train_logprobs` over a
    tail-padded batch, with the parity setup (rowwise layers + jaxattn) beside plain
    matmuls + jaxattn and plain matmuls + ``peer`` attention (cuDNN on a GPU for a
    bf16 or fp16 model, else XLA). Median seconds of ``iters`` synchronised calls after
    a warm-up."""
    from benchmarks.report import median_seconds

    global ROWWISE
    # cuDNN's fused attention takes fp16/bf16 only: an fp32 model's GPU peer is XLA.
    cudnn_ok = jax.default_backend() == "gpu" and cfg.dtype in ("bfloat16", "float16")
    peer = peer or ("cudnn" if cudnn_ok else "xla")
    params = init_params(cfg, 0)
    rng = np.random.default_rng(1)
    lengths = jnp.asarray(rng.integers(seq_len // 2, seq_len + 1, batch).astype(np.int32))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab, (batch, seq_len)).astype(np.int32))

    rows = []
    for label, rowwise_on, backend in (("parity: rowwise + jaxattn", True, cfg.backend),
                                       ("plain matmuls + jaxattn", False, cfg.backend),
                                       (f"plain matmuls + {peer}", False, peer)):
        ROWWISE = rowwise_on
        try:
            c = dataclasses.replace(cfg, backend=backend)
            fwd = jax.jit(lambda p, c=c: train_logprobs(c, p, tokens, lengths))
            grad = jax.jit(jax.grad(lambda p, c=c: train_logprobs(c, p, tokens, lengths)
                                    .astype(jnp.float32).sum()))
            rows.append({"setup": label, "fwd_ms": median_seconds(fwd, (params,), iters) * 1e3,
                         "fwdbwd_ms": median_seconds(grad, (params,), iters) * 1e3})
        except Exception as e:  # e.g. a peer that cannot run on this platform
            rows.append({"setup": label, "error": f"{type(e).__name__}: {e}"[:200]})
        finally:
            ROWWISE = True
    return rows


FLAGS = flags.FLAGS


def _define_flags() -> None:
    """Flags exist only when this file is the program (importing it defines none)."""
    flags.DEFINE_enum("size", "small", list(SIZES), "Model size.")
    flags.DEFINE_integer("new_tokens", 12, "Tokens generated per sequence.")
    flags.DEFINE_integer("seed", 0, "Seed of weights and prompts.")
    flags.DEFINE_enum("backend", "pallas", ["pallas", "reference"], "jaxattn backend.")
    flags.DEFINE_bool("rollout", True, "Run the rollout / training parity check "
                      "(--norollout --measure_cost: the cost measurement alone).")
    flags.DEFINE_bool("measure_cost", False, "Also time the trainer's forward and "
                      "forward+backward with and without the parity setup.")
    flags.DEFINE_integer("cost_batch", 4, "Batch of the cost measurement.")
    flags.DEFINE_integer("cost_seq_len", 256, "Padded length of the cost measurement.")
    flags.DEFINE_integer("rows", ROWS, "Tokens per fixed chunk of the token-wise layers "
                         "(rollout and training share it, so any value keeps parity; "
                         "larger chunks use a GPU's matrix units better).")
    flags.DEFINE_integer("cost_layers", 0, "Decoder layers of the cost measurement (0: "
                         "all of --size). Each layer is the same work, so a few layers "
                         "give the same ratios with far shorter compiles.")


def main(argv):
    global ROWS
    del argv
    if FLAGS.rows < 1:
        raise app.UsageError(f"--rows must be >= 1, got {FLAGS.rows}")
    ROWS = FLAGS.rows
    cfg = dataclasses.replace(SIZES[FLAGS.size], backend=FLAGS.backend)
    if FLAGS.rollout:
        roll, train, gen = run(cfg, new_tokens=FLAGS.new_tokens, seed=FLAGS.seed)
        diff = np.abs(roll.astype(np.float64) - train.astype(np.float64))
        print(f"{jax.devices()[0].device_kind}, attention backend "
              f"{cfg.backend}, model {FLAGS.size}: {gen.shape[0]} sequences x "
              f"{gen.shape[1]} generated tokens, token-wise chunks of {ROWS} rows")
        print("per-token |rollout logp - training logp|, max per sequence:",
              [float(d.max()) for d in diff])
        print("bitwise equal:",
              bool(np.array_equal(roll.view(np.uint32), train.view(np.uint32))))
    if FLAGS.measure_cost:
        cost_cfg = (dataclasses.replace(cfg, layers=FLAGS.cost_layers) if FLAGS.cost_layers
                    else cfg)
        print(f"trainer cost, B={FLAGS.cost_batch}, S={FLAGS.cost_seq_len} (tail-padded), "
              f"model {FLAGS.size} with {cost_cfg.layers} of its {cfg.layers} layers, "
              f"{cfg.dtype}:")
        for r in measure_cost(cost_cfg, FLAGS.cost_batch, FLAGS.cost_seq_len):
            if "error" in r:
                print(f"  {r['setup']:<32} {r['error']}")
            else:
                print(f"  {r['setup']:<32} forward {r['fwd_ms']:9.2f} ms   "
                      f"forward+backward {r['fwdbwd_ms']:9.2f} ms")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
