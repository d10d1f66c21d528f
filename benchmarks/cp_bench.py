"""Distributed CP on several devices: bits against one device, tokens/s, and the bytes
each collective moves against the measured all-gather bandwidth.

    python -m benchmarks.cp_bench --out_dir=/tmp/cp           # every GPU of the host
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      python -m benchmarks.cp_bench --smoke                    # 8 virtual CPU devices

For each degree n of ``--degrees`` (the first n devices) and each S of ``--seq_lens``:

- bits: ``jaxattn.cp.sharded_attention`` forward (out, lse) and backward (dQ, dK, dV)
  against ``jaxattn.attention`` on one device (both with the default backend:
  ``mosaic`` on sm90), on raw bits (``--check_bits_max_s``
  bounds the lengths checked, since one device must hold the whole problem);
- speed: forward and forward+backward tokens/s (B * S / time), median of ``--iters``,
  beside the single ``jaxattn.attention`` call and ``jaxattn.cp.forward_with_lse`` on one
  device (CP simulated at the degrees ``--sim_degrees``, its forward's bits checked
  against the single call) timed in the same run (``--degrees=1``: a one-device mesh);
- bytes: what the forward and backward all-gathers receive per device (docs/cp.md's
  table), and the all-gather bandwidth measured on the same devices with a buffer of the
  forward's size, so the time the collectives need is known beside the total.

NVLink multicast stays off on multi-GPU hosts (the device notes: NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1): this binary sets them when
unset, before JAX starts, and records them.
"""

from __future__ import annotations

import functools
import os
import sys
import time

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
for _k, _v in MULTICAST_OFF.items():
    os.environ.setdefault(_k, _v)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxattn  # noqa: E402
from benchmarks import report  # noqa: E402
from jaxattn import cp  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("degrees", [], "CP degrees (default: 2, 4, 8 up to the device count).")
flags.DEFINE_list("seq_lens", ["32768", "65536", "131072", "262144"], "Sequence lengths.")
flags.DEFINE_integer("batch", 1, "Batch.")
flags.DEFINE_integer("num_q_heads", 32, "Query heads.")
flags.DEFINE_integer("num_kv_heads", 8, "KV heads.")
flags.DEFINE_integer("head_dim", 128, "Head dim.")
flags.DEFINE_bool("load_balance", True, "Causal load balancing (chunks i and 2n-1-i).")
flags.DEFINE_integer("check_bits_max_s", 131072, "Longest S whose bits are checked "
                     "against one device.")
flags.DEFINE_integer("iters", 5, "Timed samples (median).")
flags.DEFINE_string("out_dir", None, "Write results.json and results.md here.")
flags.DEFINE_bool("smoke", False, "Tiny shapes (8 virtual CPU devices).")
flags.DEFINE_string("backend", None, "Backend of both sides (default: the platform's, as "
                    "jaxattn.attention picks; --smoke: pallas, whose CPU bits are promised).")
flags.DEFINE_list("sim_degrees", ["8"], "cp_world_size values of the one-device cp.forward "
                  "timed beside (empty: not timed).")


def gather_bytes(b, hq, hkv, s, d, itemsize, n) -> dict:
    """Bytes each device receives in the all-gathers (docs/cp.md)."""
    frac = (n - 1) / n
    fwd = 2 * b * hkv * s * d * itemsize * frac
    bwd = fwd + (2 * b * hq * s * d * itemsize + 2 * b * hq * s * 4) * frac
    return {"fwd_gather_MB": fwd / 2**20, "bwd_gather_MB": bwd / 2**20}


def allgather_bandwidth(mesh, nbytes: int, iters: int) -> float:
    """GB/s received per device by a tiled all_gather of ``nbytes`` in total."""
    n = mesh.size
    per = max(1, nbytes // 2 // n)
    x = jax.device_put(jnp.ones((n * per,), jnp.bfloat16), NamedSharding(mesh, P("sp")))
    f = jax.jit(jax.shard_map(lambda a: jax.lax.all_gather(a, "sp", tiled=True), mesh=mesh,
                              in_specs=P("sp"), out_specs=P(None), check_vma=False))
    sec = report.median_seconds(f, (x,), iters)
    return per * 2 * (n - 1) / sec / 1e9


def _bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    view = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    return a.shape == b.shape and np.array_equal(a.view(view), b.view(view))


def run_point(devices, n, s, p) -> dict:
    mesh = Mesh(np.array(devices[:n]), ("sp",))
    b, hq, hkv, d = p["b"], p["hq"], p["hkv"], p["d"]
    ks = jax.random.split(jax.random.PRNGKey(s + n), 4)
    rnd = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(p["dtype"])
    q, k, v, do = (rnd(ks[0], (b, hq, s, d)), rnd(ks[1], (b, hkv, s, d)),
                   rnd(ks[2], (b, hkv, s, d)), rnd(ks[3], (b, hq, s, d)))
    shard = NamedSharding(mesh, P(None, None, "sp", None))
    qs, kss, vs, dos = (jax.device_put(x, shard) for x in (q, k, v, do))

    def sharded(q, k, v):
        return cp.sharded_attention(q, k, v, mesh=mesh, axis_name="sp", causal=True,
                                    load_balance=p["load_balance"], return_lse=True,
                                    backend=p["backend"])

    fwd = jax.jit(sharded)
    fwdbwd = jax.jit(lambda q, k, v, do: jax.vjp(lambda q, k, v: sharded(q, k, v)[0],
                                                 q, k, v)[1](do))
    row = {"n": n, "B": b, "Hq": hq, "Hkv": hkv, "D": d, "S": s,
           "load_balance": p["load_balance"]}
    t_f = report.median_seconds(fwd, (qs, kss, vs), p["iters"])
    t_fb = report.median_seconds(fwdbwd, (qs, kss, vs, dos), p["iters"])
    row.update({"fwd_ms": t_f * 1e3, "fwdbwd_ms": t_fb * 1e3,
                "fwd_tokens_per_s": b * s / t_f, "fwdbwd_tokens_per_s": b * s / t_fb})
    row.update(gather_bytes(b, hq, hkv, s, d, jnp.dtype(p["dtype"]).itemsize, n))
    one = devices[0]
    q1, k1, v1, do1 = (jax.device_put(x, one) for x in (q, k, v, do))
    op = jaxattn.get_op("attention", backend=p["backend"])  # as sharded_attention's
    row["backend"] = op.backend
    single_f = jax.jit(op.forward_with_lse)
    single_fb = jax.jit(lambda q, k, v, do: jax.vjp(op.forward, q, k, v)[1](do))
    t1_f = report.median_seconds(single_f, (q1, k1, v1), p["iters"])
    t1_fb = report.median_seconds(single_fb, (q1, k1, v1, do1), p["iters"])
    row.update({"single_fwd_ms": t1_f * 1e3, "single_fwdbwd_ms": t1_fb * 1e3,
                "fwd_vs_single": t1_f / t_f * n, "fwdbwd_vs_single": t1_fb / t_fb * n})
    row["sim"] = []
    for w in p.get("sim_degrees", ()):
        sim = functools.partial(cp.forward_with_lse, cp_world_size=w, backend=p["backend"])
        sim_f = jax.jit(sim)
        sim_fb = jax.jit(lambda q, k, v, do, sim=sim: jax.vjp(
            lambda q, k, v: sim(q, k, v)[0], q, k, v)[1](do))
        t_sf = report.median_seconds(sim_f, (q1, k1, v1), p["iters"])
        t_sfb = report.median_seconds(sim_fb, (q1, k1, v1, do1), p["iters"])
        one_sim = {"degree": w, "fwd_ms": t_sf * 1e3, "fwdbwd_ms": t_sfb * 1e3,
                   "fwd_vs_single": t1_f / t_sf, "fwdbwd_vs_single": t1_fb / t_sfb}
        if s <= p["check_bits_max_s"]:
            out, lse = sim_f(q1, k1, v1)
            ref_out, ref_lse = single_f(q1, k1, v1)
            one_sim["fwd_bits_equal"] = _bits_equal(out, ref_out) and _bits_equal(lse, ref_lse)
        row["sim"].append(one_sim)
    if s <= p["check_bits_max_s"]:
        ref_out, ref_lse = single_f(q1, k1, v1)
        ref_g = single_fb(q1, k1, v1, do1)
        out, lse = fwd(qs, kss, vs)
        g = fwdbwd(qs, kss, vs, dos)
        row["fwd_bits_equal"] = _bits_equal(out, ref_out) and _bits_equal(lse, ref_lse)
        row["bwd_bits_equal"] = all(_bits_equal(a, c) for a, c in zip(g, ref_g, strict=True))
    return row


def to_markdown(rows, meta) -> str:
    lines = [f"Measured {meta['date']} on {meta['n_devices']} x {meta['device']} (jax "
             f"{meta['jax']}); command: `{meta['command']}`; all-gather bandwidth per "
             f"device: " + ", ".join(f"n={k}: {v:.1f} GB/s" for k, v in
                                     meta["allgather_GBps"].items()), "",
             "Per-device efficiency against the single call: single time / (CP time * n).",
             "",
             "| n | S | backend | fwd ms | single fwd ms | fwd eff. | fwd+bwd ms | "
             "single fwd+bwd ms | fwd+bwd eff. | cp.forward (1 device) fwd / fwd+bwd ms "
             "(vs single) | "
             "fwd gather MB | bwd gather MB | fwd bits | bwd bits |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['n']} | {r['S']} | error: {r['error'][:80]} |||||||")
            continue
        bits = lambda key, r=r: {True: "equal", False: "**differ**"}.get(r.get(key),
                                                                       "not checked")
        sim = "; ".join(
            f"n={x['degree']}: {x['fwd_ms']:.2f} ({x['fwd_vs_single']:.2f}) / "
            f"{x['fwdbwd_ms']:.2f} ({x['fwdbwd_vs_single']:.2f})"
            + {True: ", fwd bits equal", False: ", fwd bits **differ**"}.get(
                x.get("fwd_bits_equal"), "") for x in r.get("sim", ())) or "-"
        lines.append(f"| {r['n']} | {r['S']} | {r['backend']} | {r['fwd_ms']:.2f} | "
                     f"{r['single_fwd_ms']:.2f} | {r['fwd_vs_single']:.3f} | "
                     f"{r['fwdbwd_ms']:.2f} | {r['single_fwdbwd_ms']:.2f} | "
                     f"{r['fwdbwd_vs_single']:.3f} | {sim} | "
                     f"{r['fwd_gather_MB']:.1f} | {r['bwd_gather_MB']:.1f} | "
                     f"{bits('fwd_bits_equal')} | {bits('bwd_bits_equal')} |")
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    devices = jax.devices()
    if FLAGS.smoke:
        p = dict(b=1, hq=4, hkv=2, d=64, dtype=jnp.bfloat16, load_balance=True,
                 iters=1, check_bits_max_s=1 << 30, sim_degrees=(),
                 backend=FLAGS.backend or "pallas")
        seq_lens = [512]
        gather_size = 1 << 20
    else:
        p = dict(b=FLAGS.batch, hq=FLAGS.num_q_heads, hkv=FLAGS.num_kv_heads,
                 d=FLAGS.head_dim, dtype=jnp.bfloat16, load_balance=FLAGS.load_balance,
                 iters=FLAGS.iters, check_bits_max_s=FLAGS.check_bits_max_s,
                 sim_degrees=[int(w) for w in FLAGS.sim_degrees],
                 backend=FLAGS.backend)
        seq_lens = [int(s) for s in FLAGS.seq_lens]
        gather_size = 1 << 30
    degrees = [int(x) for x in FLAGS.degrees] or [x for x in (2, 4, 8) if x <= len(devices)]
    if not degrees or max(degrees) > len(devices):
        raise app.UsageError(f"degrees {degrees} need more than the {len(devices)} devices "
                             f"here")
    meta = {"date": time.strftime("%Y-%m-%d"), "device": devices[0].device_kind,
            "n_devices": len(devices), "jax": jax.__version__,
            "command": "python -m benchmarks.cp_bench " + " ".join(sys.argv[1:]),
            "multicast_env": {k: os.environ.get(k) for k in MULTICAST_OFF},
            "allgather_GBps": {}}
    rows = []
    for n in degrees:
        mesh = Mesh(np.array(devices[:n]), ("sp",))
        meta["allgather_GBps"][n] = allgather_bandwidth(mesh, gather_size, p["iters"])
        for s in seq_lens:
            try:
                row = run_point(devices, n, s, p)
            except Exception as e:  # an OOM at one length is reported; the rest goes on
                row = {"n": n, "S": s, "error": f"{type(e).__name__}: {e}"[:300]}
            rows.append(row)
            report.print_row(row)
    md = to_markdown(rows, meta)
    print(md)
    report.write(FLAGS.out_dir, {"meta": meta, "rows": rows}, md)
    if any(r.get("fwd_bits_equal") is False or r.get("bwd_bits_equal") is False
           for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
