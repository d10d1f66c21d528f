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
flags.DEFINE_list("shapes", ["tiny", "decode", "prefill"], "Which of tiny (B=1, Skv=64), "
                  "decode (B=8, Skv=8192) and prefill (B=2, S=4096) to profile.")
flags.DEFINE_bool("kernels", True, "On CUDA: the GPU kernels of the jitted call (torch "
                  "profiler).")


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
    imp = bridge._IMPORT
    jdev, stream, dl_type, ext, event = imp.target(q.device)
    import torch.nn.functional as F
    from jax._src.lib import _jax

    def jitted():
        holder["o"] = fn(jq, jk, jv, None, lens)

    compiled = fn.lower(jq, jk, jv, None, lens).compile()
    trivial = jax.jit(lambda q, k, v, m, n: q[:, :, :1] + 1)

    def aot():
        holder["o"] = compiled(jq, jk, jv, None, lens)

    def no_grad():
        with torch.no_grad():
            op(q, k, v)

    def ordering():
        if event is not None:
            event.record(torch.cuda.current_stream(q.device))
            ext.wait_event(event)

    def imports(streams):
        ordering()
        return [imp._import_fast(t, s, jdev, dl_type) for t, s in zip((q, k, v), streams,
                                                                   strict=True)]

    def export_plain(x):
        return torch.utils.dlpack.from_dlpack(
            _jax.buffer_to_dlpack_managed_tensor(x.addressable_data(0), stream=None))

    causal = q.shape[2] == k.shape[2]
    return {
        "event record + wait": ordering,
        "torch __dlpack__ x3": lambda: [t.__dlpack__(stream=-1) for t in (q, k, v)],
        "import x3 (stream each)": lambda: imports((stream,) * 3),
        "import x3 (stream first)": lambda: imports((stream, None, None)),
        "import x3 (no stream)": lambda: imports((None,) * 3),
        "to_jax x3": lambda: [bridge.to_jax(t) for t in (q, k, v)],
        "jax.dlpack.from_dlpack x3": lambda: [jax.dlpack.from_dlpack(t) for t in (q, k, v)],
        "jitted trivial (5 args)": lambda: holder.__setitem__("t", trivial(jq, jk, jv, None,
                                                                          lens)),
        "jitted call": jitted,
        "jitted call, AOT compiled": aot,
        "to_torch x2": lambda: [torch.from_dlpack(x) for x in holder["o"]],
        "to_torch out only": lambda: torch.from_dlpack(holder["o"][0]),
        "export x2, no stream": lambda: [export_plain(x) for x in holder["o"]],
        "op(q, k, v)": lambda: op(q, k, v),
        "op(q, k, v) no_grad": no_grad,
        "custom op (torch.compile's path)": lambda: bridge._attention_op(
            q, k, v, None, None, None, "attention", op.backend, True, None, 1, -1),
        "_forward_impl": lambda: bridge._forward_impl(
            q, k, v, None, None, None, "attention", op.backend, True, None, 1, -1),
        "torch sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                             enable_gqa=True),
    }


def _kernels(torch, fn, args, sync):
    """The GPU kernels of one jitted call (torch's profiler sees JAX's stream too)."""
    from torch.profiler import ProfilerActivity, profile
    fn(*args)
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn(*args)
        sync()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)


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
    shapes = {"tiny": (1, 32, 8, 1, 64, 128), "decode": (8, 32, 8, 1, 8192, 128),
              "prefill": (2, 32, 8, 4096, 4096, 128)}
    for name in FLAGS.shapes:
        b, hq, hkv, sq, skv, d = shapes[name]
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
        if dev == "cuda" and FLAGS.kernels:
            print(f"--- GPU kernels of 10 jitted calls ({name}) ---")
            print(_kernels(torch, fn, (jq, jk, jv, None, lens), sync), flush=True)
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
