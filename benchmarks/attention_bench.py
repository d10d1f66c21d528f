"""Attention speed and memory: jaxattn beside its peers, measured in one process and run.

    python -m benchmarks.attention_bench --out_dir=/tmp/bench        # GPU
    python -m benchmarks.attention_bench --smoke                     # CPU, tiny shapes

Modes (``--modes``):

- ``fwd`` and ``fwdbwd``: Sq = Skv = S for each of ``--seq_lens``; TFLOP/s count the
  visible pairs only when causal; forward+backward counts 3.5x the forward FLOPs.
- ``chunked``: chunked prefill, one chunk of ``--chunk_size`` queries against S keys
  (the chunk's queries are the last ones: causal offset S - chunk), TFLOP/s.
- ``decode``: ``--decode_batch`` sequences, Sq = ``--decode_sq`` (1; 2 to 8:
  speculative verification, the sequence's last queries), GB/s of K and V read, beside
  the measured device-to-device copy bandwidth (bytes read + written).

Every row also records the memory the call needs beyond its inputs and outputs: for a
JAX system the compiled executable's temporary buffers (``memory_analysis()``), for a
torch system the allocator's peak during the call minus what was allocated before and
minus the outputs (CUDA only).

Peers (``--backends``, see benchmarks/systems.py): cuDNN and XLA through
``jax.nn.dot_product_attention``, JAX's built-in Pallas ``mha``, and torch SDPA's flash,
cuDNN and efficient backends when torch with CUDA is present. Timing follows
/work/.library/device/METHOD.md: warm-up, then the median over ``--iters`` samples, each
of ``reps`` back-to-back calls with one synchronisation, rotating over ``--input_sets``
fresh random input sets (no call reads its predecessor's inputs from L2). ``reps`` is
chosen per point so that a sample lasts about ``--sample_ms`` (at most ``--reps``).
``--tokens`` fixes B * S (the batch shrinks as S grows, so every point fills the chip).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from absl import app, flags

import jaxattn
from benchmarks import report, systems

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch", 2, "Batch for fwd / fwdbwd / chunked (unless --tokens).")
flags.DEFINE_integer("tokens", 0, "If > 0: batch = max(1, tokens // S) for each S.")
flags.DEFINE_integer("num_q_heads", 32, "Query heads.")
flags.DEFINE_integer("num_kv_heads", 8, "KV heads.")
flags.DEFINE_integer("head_dim", 128, "Head dim.")
flags.DEFINE_list("seq_lens", ["1024", "4096", "16384"], "Sequence lengths (fwd, fwdbwd, "
                  "chunked).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Dtype.")
flags.DEFINE_bool("causal", True, "Causal attention (fwd, fwdbwd).")
flags.DEFINE_list("modes", ["fwd", "fwdbwd", "decode"], "What to time: fwd, fwdbwd, "
                  "chunked, decode.")
flags.DEFINE_list("backends", ["jaxattn:mosaic", "jaxattn:pallas", "cudnn", "xla",
                               "pallas_mha", "torch_flash", "torch_cudnn", "torch_efficient"],
                  "Systems to time (benchmarks/systems.py); torch ones need torch + CUDA; "
                  "jaxattn:mosaic an sm90 GPU (elsewhere, and where it refuses a shape, "
                  "its rows are reported as such; plain jaxattn is the platform's first "
                  "backend: mosaic on sm90, pallas on other GPUs).")
flags.DEFINE_integer("chunk_size", 2048, "Queries per chunk (chunked).")
flags.DEFINE_integer("decode_batch", 8, "Batch for decode.")
flags.DEFINE_list("decode_kv_lens", ["4096", "32768"], "Context lengths for decode.")
flags.DEFINE_integer("decode_sq", 1, "Queries per head in decode mode (2 to 8: "
                     "speculative verification).")
flags.DEFINE_integer("iters", 10, "Timed samples per point (median reported).")
flags.DEFINE_integer("reps", 50, "Most back-to-back calls per timed sample. Short calls "
                     "need many: on the H200 (2026-12-04) 10 read jaxattn's decode at B=1 "
                     "131072 keys 10% slower than 50 (0.181 against 0.162 to 0.165 ms; "
                     "torch cuDNN 0.140 against 0.129 to 0.134), the pipeline's refill "
                     "after each sample's synchronisation spread over fewer calls.")
flags.DEFINE_float("sample_ms", 50.0, "Target duration of one timed sample.")
flags.DEFINE_integer("warmup", 3, "Untimed calls first.")
flags.DEFINE_integer("input_sets", 3, "Input sets rotated over (defeats L2 reuse).")
flags.DEFINE_string("out_dir", None, "Write results.json and results.md here.")
flags.DEFINE_bool("smoke", False, "Tiny shapes that run on a CPU (CI keeps the binary alive):"
                  " jaxattn runs its Pallas kernels (interpret mode), beside XLA and torch's "
                  "CPU SDPA.")


def _random(shape, dtype, key):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _nbytes(tree) -> int:
    return sum(int(x.numel() * x.element_size()) if hasattr(x, "element_size")
               else int(x.size * x.dtype.itemsize) for x in jax.tree.leaves(tree))


def _jax_temp_mb(compiled) -> float | None:
    """The compiled executable's temporary buffers, MB (None where not reported)."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # some runtimes have no memory analysis
        return None
    return None if ma is None else ma.temp_size_in_bytes / 2**20


def _torch_extra_mb(run: Callable, args: tuple) -> float | None:
    """Allocator peak during one call minus what was allocated before and minus the
    outputs, MB (CUDA only)."""
    import torch
    if not torch.cuda.is_available() or jax.default_backend() == "cpu":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = run(*args)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return max(0, peak - _nbytes(out)) / 2**20


def bench_point(system: systems.System, mode: str, b, hq, hkv, sq, skv, d, dtype, causal,
                iters, warmup, n_sets) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(sq * 7 + skv + b), 4 * n_sets)
    sets = []
    for i in range(n_sets):
        q = _random((b, hq, sq, d), dtype, keys[4 * i])
        k = _random((b, hkv, skv, d), dtype, keys[4 * i + 1])
        v = _random((b, hkv, skv, d), dtype, keys[4 * i + 2])
        args = system.prepare(q, k, v)
        if mode == "fwdbwd":
            args = (*args, system.prepare_like_q(_random((b, hq, sq, d), dtype,
                                                         keys[4 * i + 3])))
        system.sync(args)
        sets.append(args)
    if mode == "fwdbwd":
        run = lambda *a: system.fwdbwd(*a, causal=causal)
    else:
        run = lambda *a: system.forward(*a, causal=causal)
    if system.framework == "jax":  # compiled once: timed, and asked for its memory
        timed = jax.jit(run).lower(*sets[0]).compile()
        extra = _jax_temp_mb(timed)
        # XLA transposes around the kernels (layout changes inside the timed call).
        transposes = timed.as_text().count(" transpose(")
    else:
        timed, extra, transposes = run, _torch_extra_mb(run, sets[0]), None
    sec, reps = report.sampled_seconds(timed, sets, system.sync, iters, warmup, FLAGS.reps,
                      FLAGS.sample_ms / 1e3)
    row = {"system": system.name, "mode": mode, "B": b, "Hq": hq, "Hkv": hkv, "Sq": sq,
           "Skv": skv, "D": d, "dtype": str(jnp.dtype(dtype)), "causal": causal,
           "ms": sec * 1e3, "reps": reps, "extra_MB": extra, "transposes": transposes}
    if mode == "decode":
        row["GB/s"] = 2 * b * hkv * skv * d * jnp.dtype(dtype).itemsize / sec / 1e9
    else:
        flops = report.attention_flops(b, hq, sq, skv, d, causal)
        row["TFLOP/s"] = flops * (3.5 if mode == "fwdbwd" else 1.0) / sec / 1e12
    return row


def _fmt(r: dict, key: str, spec: str) -> str:
    return format(r[key], spec) if r.get(key) is not None else ""


def to_markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Measured {meta['date']} on {meta['device']} (jax {meta['jax']}, torch "
             f"{meta.get('torch', 'absent')}, jaxattn backend {meta['jaxattn_backend']}); "
             f"command: `{meta['command']}`", ""]
    if meta.get("copy_GBps"):
        lines += [f"Device-to-device copy bandwidth (read + write): "
                  f"{meta['copy_GBps']:.0f} GB/s", ""]
    if meta.get("dispatch_floor_ms"):
        lines += [f"Dispatch floor (a jitted one-add program, back to back): "
                  f"{meta['dispatch_floor_ms'] * 1e3:.1f} us per call", ""]
    lines += ["| mode | system | B | Hq | Hkv | Sq | Skv | D | causal | ms | TFLOP/s | GB/s "
              "| extra MB | transposes |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = (f"| {r['mode']} | {r['system']} | {r['B']} | {r['Hq']} | {r['Hkv']} | "
                f"{r['Sq']} | {r['Skv']} | {r['D']} | {r['causal']} |")
        if "error" in r:
            lines.append(f"{head} {r['error'][:70].replace('|', '/')} | | | | |")
            continue
        lines.append(f"{head} {r['ms']:.3f} | {_fmt(r, 'TFLOP/s', '.1f')} | "
                     f"{_fmt(r, 'GB/s', '.0f')} | {_fmt(r, 'extra_MB', '.1f')} | "
                     f"{_fmt(r, 'transposes', 'd')} |")
    return "\n".join(lines) + "\n"


def _versions() -> dict:
    meta = {"jax": jax.__version__}
    try:
        import jaxlib
        meta["jaxlib"] = jaxlib.__version__
    except ImportError:
        pass
    try:
        import torch
        meta["torch"] = torch.__version__
    except ImportError:
        pass
    return meta


def main(argv):
    del argv
    dtype = jnp.dtype(FLAGS.dtype)
    if FLAGS.smoke:
        heads = dict(hq=4, hkv=2, d=64)
        seq_lens, kv_lens, dec_b, chunk = [64], [128], 2, 32
        names = ["jaxattn:pallas", "xla"] + (["torch_flash", "torch_math"]
                                      if systems.torch_available() is None else [])
        iters, warmup, batch_for = 2, 1, (lambda s: 1)
    else:
        heads = dict(hq=FLAGS.num_q_heads, hkv=FLAGS.num_kv_heads, d=FLAGS.head_dim)
        seq_lens = [int(s) for s in FLAGS.seq_lens]
        kv_lens = [int(s) for s in FLAGS.decode_kv_lens]
        dec_b, chunk, names = FLAGS.decode_batch, FLAGS.chunk_size, FLAGS.backends
        iters, warmup = FLAGS.iters, FLAGS.warmup
        batch_for = (lambda s: max(1, FLAGS.tokens // s)) if FLAGS.tokens > 0 else \
            (lambda s: FLAGS.batch)
    meta = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
            "platform": jax.default_backend(), **_versions(),
            "command": "python -m benchmarks.attention_bench " + " ".join(sys.argv[1:]),
            "jaxattn_backend": jaxattn.get_op().backend}
    rows: list[dict] = []
    loaded: dict[str, systems.System | Exception] = {}
    for name in names:
        try:
            loaded[name] = systems.make(name)
        except systems.Unsupported as e:
            loaded[name] = e
    meta["systems"] = {n: (s.notes if isinstance(s, systems.System) else f"unavailable: {s}")
                       for n, s in loaded.items()}

    def record(name, mode, **kw):
        system = loaded[name]
        base = {"system": name, "mode": mode, "B": kw["b"], "Hq": kw["hq"],
                "Hkv": kw["hkv"], "Sq": kw["sq"], "Skv": kw["skv"], "D": kw["d"],
                "causal": kw["causal"]}
        if isinstance(system, Exception):
            return  # listed once in meta["systems"]
        try:
            row = bench_point(system, mode, dtype=dtype, iters=iters, warmup=warmup,
                              n_sets=FLAGS.input_sets, **kw)
        except Exception as e:  # a peer that cannot run this shape is reported, not fatal
            row = {**base, "error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(row)
        report.print_row(row)

    for mode in ("fwd", "fwdbwd", "chunked"):
        if mode not in FLAGS.modes:
            continue
        for s in seq_lens:
            sq = min(chunk, s) if mode == "chunked" else s
            for name in names:
                record(name, mode, b=batch_for(s), sq=sq, skv=s, causal=FLAGS.causal or
                       mode == "chunked", **heads)
    if "decode" in FLAGS.modes:
        if jax.default_backend() != "cpu":
            meta["copy_GBps"] = report.copy_bandwidth()
            meta["dispatch_floor_ms"] = report.dispatch_floor_ms()
        for s in kv_lens:
            for name in names:
                if name == "pallas_mha":
                    continue  # needs Sq to fill its 128-row blocks
                record(name, "decode", b=dec_b, sq=FLAGS.decode_sq, skv=s, causal=True,
                       **heads)
    md = to_markdown(rows, meta)
    print(md)
    report.write(FLAGS.out_dir, {"meta": meta, "rows": rows}, md)


if __name__ == "__main__":
    app.run(main)
