"""Where a bridge call's host time goes: cProfile of back-to-back calls, and each step of
a call timed alone (DLPack in, the jitted call, DLPack out, the custom op).

    python -m benchmarks.bridge_profile            # on the GPU (CUDA torch)
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("calls", 200, "Calls per timing.")


def _per_call(fn, n, sync):
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) / n * 1e6


def _rows(bridge, jax, torch, op, fn, q, k, v, jq, jk, jv, lens):
    holder = {}

    def jitted():
        holder["o"] = fn(jq, jk, jv, None, lens)

    def no_grad():
        with torch.no_grad():
            op(q, k, v)

    return {
        "to_jax x3": lambda: [bridge.to_jax(t) for t in (q, k, v)],
        "jax.dlpack.from_dlpack x3": lambda: [jax.dlpack.from_dlpack(t) for t in (q, k, v)],
        "jitted call": jitted,
        "to_torch x2": lambda: [torch.from_dlpack(x) for x in holder["o"]],
        "op(q, k, v)": lambda: op(q, k, v),
        "op(q, k, v) no_grad": no_grad,
        "custom op (torch.compile's path)": lambda: bridge._attention_op(
            q, k, v, None, None, None, "attention", op.backend, True, None, 1, -1),
        "_forward_impl": lambda: bridge._forward_impl(
            q, k, v, None, None, None, "attention", op.backend, True, None, 1, -1),
    }


def main(argv):
    del argv
    import jax
    import torch

    import torch_bridge
    from torch_bridge import bridge

    dev = "cuda" if torch.cuda.is_available() and jax.default_backend() != "cpu" else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    op = torch_bridge.get_op("attention")
    n = FLAGS.calls
    for name, (b, hq, hkv, sq, skv, d) in {"tiny": (1, 32, 8, 1, 64, 128),
                                           "prefill": (2, 32, 8, 4096, 4096, 128)}.items():
        q = torch.randn(b, hq, sq, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, hkv, skv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        jq, jk, jv = (bridge.to_jax(t) for t in (q, k, v))
        fn = bridge._jax_bucketed_forward(op.backend, True, None,
                                          "gpu" if dev == "cuda" else "cpu")
        lens = bridge._lengths(q.device, sq, skv)
        rows = _rows(bridge, jax, torch, op, fn, q, k, v, jq, jk, jv, lens)
        fn(jq, jk, jv, None, lens)
        for label, f in rows.items():
            print(f"{name:8s} {label:34s} {_per_call(f, n, sync):9.1f} us/call", flush=True)
        pr = cProfile.Profile()
        sync()
        pr.enable()
        for _ in range(n):
            op(q, k, v)
        sync()
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(18)
        print(f"--- cProfile of {n} op calls ({name}), by own time ---")
        print(buf.getvalue()[-6000:], flush=True)


if __name__ == "__main__":
    app.run(main)
