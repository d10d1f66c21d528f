"""Overhead of the PyTorch bridge: the same attention through torch_bridge and in JAX.

    python -m benchmarks.bridge_bench --out_dir=/tmp/bridge      # GPU (CUDA torch)
    python -m benchmarks.bridge_bench --smoke                    # CPU, tiny shapes

Times forward and forward+backward at a decode shape and a prefill shape, in one
process: JAX (jitted, inputs already on the device) and torch_bridge (torch tensors in,
torch tensors out; DLPack both ways; autograd through the custom op). Each sample runs
``--reps`` calls back to back and synchronises once; the median of ``--iters`` samples
is reported.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
from absl import app, flags

from benchmarks import report

FLAGS = flags.FLAGS
flags.DEFINE_integer("iters", 10, "Samples per point.")
flags.DEFINE_integer("reps", 10, "Back-to-back calls per sample.")
flags.DEFINE_string("out_dir", None, "Write results.json / results.md here.")
flags.DEFINE_bool("smoke", False, "Tiny shapes that run on a CPU.")


def _median_time(fn, sync, iters, reps):
    fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def _bench_shape(name, shape, op, jop, dev, torch_sync, iters, reps) -> list[dict]:
    import torch

    b, hq, hkv, sq, skv, d = shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, sq, d, generator=g).to(torch.bfloat16).to(dev)
    k = torch.randn(b, hkv, skv, d, generator=g).to(torch.bfloat16).to(dev)
    v = torch.randn(b, hkv, skv, d, generator=g).to(torch.bfloat16).to(dev)
    do = torch.randn(b, hq, sq, d, generator=g).to(torch.bfloat16).to(dev)
    jq, jk, jv, jdo = (jax.dlpack.from_dlpack(x) for x in (q, k, v, do))
    f = jax.jit(lambda q, k, v: jop(q, k, v))
    fb = jax.jit(lambda q, k, v, do: jax.vjp(lambda q, k, v: jop(q, k, v), q, k, v)[1](do))
    holder = {}
    jax_fwd = _median_time(lambda: holder.__setitem__("o", f(jq, jk, jv)),
                           lambda: jax.block_until_ready(holder["o"]), iters, reps)
    jax_fb = _median_time(lambda: holder.__setitem__("g", fb(jq, jk, jv, jdo)),
                          lambda: jax.block_until_ready(holder["g"]), iters, reps)
    tq, tk, tv = (x.clone().requires_grad_() for x in (q, k, v))
    torch_fwd = _median_time(lambda: op(q, k, v), torch_sync, iters, reps)

    def torch_step():
        out = op(tq, tk, tv)
        torch.autograd.backward(out, do)

    torch_fb = _median_time(torch_step, torch_sync, iters, reps)
    rows = []
    for mode, tj, tt in (("fwd", jax_fwd, torch_fwd), ("fwdbwd", jax_fb, torch_fb)):
        rows.append({"shape": name, "B": b, "Hq": hq, "Hkv": hkv, "Sq": sq, "Skv": skv,
                     "D": d, "mode": mode, "jax_ms": tj * 1e3, "bridge_ms": tt * 1e3,
                     "overhead_ms": (tt - tj) * 1e3})
        print(rows[-1], flush=True)
    return rows


def main(argv):
    del argv
    import torch

    import jaxattn
    import torch_bridge

    cuda = torch.cuda.is_available() and jax.default_backend() != "cpu"
    dev = "cuda" if cuda else "cpu"
    if FLAGS.smoke:
        shapes = {"decode": (2, 4, 2, 1, 128, 64), "prefill": (1, 4, 2, 64, 64, 64)}
        iters, reps = 2, 1
    else:
        shapes = {"decode": (8, 32, 8, 1, 4096, 128), "prefill": (2, 32, 8, 4096, 4096, 128)}
        iters, reps = FLAGS.iters, FLAGS.reps
    op = torch_bridge.get_op("attention")
    jop = jaxattn.get_op("attention")
    torch_sync = (lambda: torch.cuda.synchronize()) if cuda else (lambda: None)
    rows = []
    for name, shape in shapes.items():
        rows += _bench_shape(name, shape, op, jop, dev, torch_sync, iters, reps)
    meta = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "torch": torch.__version__,
            "backend": op.backend, "command": "python -m benchmarks.bridge_bench " +
            " ".join(os.sys.argv[1:])}
    md = [f"Measured {meta['date']} on {meta['device']} (jax {meta['jax']}, torch "
          f"{meta['torch']}, backend {meta['backend']}); command: `{meta['command']}`", "",
          "| shape | B | Hq | Hkv | Sq | Skv | D | mode | JAX ms | bridge ms | overhead ms |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['shape']} | {r['B']} | {r['Hq']} | {r['Hkv']} | {r['Sq']} | {r['Skv']} | "
           f"{r['D']} | {r['mode']} | {r['jax_ms']:.3f} | {r['bridge_ms']:.3f} | "
           f"{r['overhead_ms']:.3f} |" for r in rows]
    print("\n".join(md))
    report.write(FLAGS.out_dir, {"meta": meta, "rows": rows}, "\n".join(md) + "\n")

if __name__ == "__main__":
    app.run(main)
