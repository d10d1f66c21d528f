"""The invariance matrix (DESIGN.md section 7) on raw bits, for jaxattn and every peer.

    python -m benchmarks.peer_invariance --out_dir=/tmp/inv          # GPU
    python -m benchmarks.peer_invariance --smoke                      # CPU, tiny shapes

Each system (benchmarks/systems.py) runs the same experiments in jaxattn's layout and
causal rule, and each comparison is on raw bits (outputs viewed as unsigned integers):

- row alone vs in batch: batch element ``--row`` computed inside a batch of ``--batch``
  and alone (forward; backward: dQ, dK, dV of that element);
- run to run: the same inputs ``--repeats`` times (forward; backward);
- chunked prefill vs full prefill: every chunk of each of ``--chunk_sizes`` (queries
  [c0, c1) against keys [0, c1)) vs the full prefill's rows;
- decode vs prefill: Sq = 1 against the first t + 1 keys, for ``--decode_steps`` values
  of t, vs the prefill's row t;
- tail key padding vs unpadded: a sequence of length L padded with random keys to S
  (valid key counts passed as each system takes them) vs the length-L sequence, rows
  [0, L) (forward; backward with zero cotangent on the padded rows).

A cell reads ``equal`` (every bit), ``differs`` (bits differ, values within the dtype's
tolerance: the reduction order changed), ``wrong`` (beyond tolerance: the experiment
does not hold for that system, e.g. a mask it ignores), ``unsupported`` or ``error``.

A case a system cannot express, or whose shape the system itself refuses with
``NotImplementedError``, is reported as unsupported, with the reason. Paged KV
and CP have no counterpart in the peers' APIs; jaxattn's own rows for them are in
``python -m jaxattn.check``.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import systems
from benchmarks.report import write as write_results

FLAGS = flags.FLAGS
flags.DEFINE_list("backends", ["jaxattn", "cudnn", "xla", "pallas_mha", "torch_flash",
                               "torch_cudnn", "torch_efficient"], "Systems to check.")
flags.DEFINE_integer("batch", 4, "Batch.")
flags.DEFINE_integer("row", 1, "The batch element computed alone.")
flags.DEFINE_integer("num_q_heads", 32, "Query heads.")
flags.DEFINE_integer("num_kv_heads", 8, "KV heads.")
flags.DEFINE_integer("head_dim", 128, "Head dim.")
flags.DEFINE_integer("seq_len", 2048, "Sequence length S.")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Dtype.")
flags.DEFINE_list("chunk_sizes", ["256", "1000"], "Chunked prefill chunk sizes.")
flags.DEFINE_list("decode_steps", [], "Decode positions t (default: 8 spread over S).")
flags.DEFINE_list("pad_lengths", [], "Valid lengths L < S (default: S - 37, S // 2 + 1).")
flags.DEFINE_integer("repeats", 3, "Runs compared in the run-to-run rows.")
flags.DEFINE_integer("seed", 0, "Input seed.")
flags.DEFINE_string("out_dir", None, "Write results.json and results.md here.")
flags.DEFINE_bool("smoke", False, "Tiny shapes on a CPU: jaxattn's Pallas kernels in "
                  "interpret mode, XLA and torch's CPU SDPA.")

CASES = [("row alone vs in batch", "forward"), ("row alone vs in batch", "backward"),
         ("run to run", "forward"), ("run to run", "backward"),
         ("chunked prefill vs full", "forward"), ("decode vs prefill row", "forward"),
         ("tail key padding vs unpadded", "forward"),
         ("tail key padding vs unpadded", "backward")]


TOL = {"bfloat16": 3e-2, "float16": 5e-3, "float32": 1e-4}
#: Largest relative difference seen in the current cell (a "differs" far beyond rounding
#: means the experiment is wrong for that system, and is reported as "wrong").
_DRIFT = {"max": 0.0}


def _equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise AssertionError(f"shape/dtype mismatch {a.shape} {a.dtype} vs {b.shape} {b.dtype}")
    eq = np.array_equal(systems.bits(a), systems.bits(b))
    if not eq:
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        rel = np.max(np.abs(a64 - b64)) / max(np.max(np.abs(b64)), 1e-30)
        _DRIFT["max"] = max(_DRIFT["max"], float(np.nan_to_num(rel, nan=np.inf)))
    return eq


class Runner:
    """One system's calls, jitted per shape where the system is JAX, outputs as numpy."""

    def __init__(self, system: systems.System):
        self.s = system
        self._fwd = {}
        self._bwd = {}

    def fwd(self, q, k, v, kv_lens=None) -> np.ndarray:
        s = self.s
        args = s.prepare(q, k, v)
        if s.framework == "jax":
            f = self._fwd.setdefault(kv_lens is not None, jax.jit(
                lambda q, k, v, kl: s.forward(q, k, v, causal=True, kv_lens=kl)))
            out = f(*args, kv_lens)
        else:
            out = s.forward(*args, causal=True, kv_lens=kv_lens)
        s.sync(out)
        out = s.to_numpy(out)
        if np.isnan(out).any() and kv_lens is None:
            raise RuntimeError(f"{s.name} returned NaN")
        return out

    def bwd(self, q, k, v, do, kv_lens=None) -> list[np.ndarray]:
        s = self.s
        args = (*s.prepare(q, k, v), s.prepare_like_q(do))
        if s.framework == "jax":
            f = self._bwd.setdefault(kv_lens is not None, jax.jit(
                lambda q, k, v, do, kl: s.fwdbwd(q, k, v, do, causal=True, kv_lens=kl)))
            grads = f(*args, kv_lens)
        else:
            grads = s.fwdbwd(*args, causal=True, kv_lens=kv_lens)
        s.sync(grads)
        return [s.to_numpy(g) for g in grads]


def _grads_rows(grads, b: slice, rows: slice | None = None):
    """Batch slice of (dq, dk, dv); with ``rows``, the sequence rows too."""
    if rows is None:
        return [g[b] for g in grads]
    return [g[b][:, :, rows] for g in grads]


def check_system(r: Runner, q, k, v, do, p: dict, progress) -> dict:
    results = {}
    S = q.shape[2]
    i = p["row"]
    one = slice(i, i + 1)

    def run(case, kind, fn):
        progress(f"{r.s.name}: {case} ({kind})")
        t0 = time.time()
        _DRIFT["max"] = 0.0
        try:
            eq, detail = fn()
            wrong = _DRIFT["max"] > TOL[p["dtype"]]
            results[f"{case}|{kind}"] = {
                "result": "equal" if eq else ("wrong" if wrong else "differs"),
                "detail": detail, "max_rel_diff": _DRIFT["max"]}
        except (systems.Unsupported, NotImplementedError) as e:
            # NotImplementedError: the peer refuses the shape itself (cuDNN's backward
            # on the H200: "Unsupported sequence length Q 2011, KV 2011").
            results[f"{case}|{kind}"] = {"result": "unsupported",
                                         "detail": f"{type(e).__name__}: {e}"[:200]}
        except Exception as e:  # reported per cell; the matrix goes on
            results[f"{case}|{kind}"] = {"result": "error",
                                         "detail": f"{type(e).__name__}: {e}"[:300]}
        results[f"{case}|{kind}"]["seconds"] = round(time.time() - t0, 2)

    full = {}

    def full_out():
        if "out" not in full:
            full["out"] = r.fwd(q, k, v)
        return full["out"]

    def batch_fwd():
        alone = r.fwd(q[one], k[one], v[one])
        return _equal(full_out()[one], alone), f"element {i} of B={q.shape[0]}"

    def batch_bwd():
        g_all = r.bwd(q, k, v, do)
        g_one = r.bwd(q[one], k[one], v[one], do[one])
        eqs = [_equal(a, b) for a, b in zip(_grads_rows(g_all, one), g_one, strict=True)]
        return all(eqs), f"dq, dk, dv equal: {eqs}"

    def run_fwd():
        outs = [r.fwd(q, k, v) for _ in range(p["repeats"])]
        return all(_equal(outs[0], o) for o in outs[1:]), f"{p['repeats']} runs"

    def run_bwd():
        gs = [r.bwd(q, k, v, do) for _ in range(p["repeats"])]
        eq = [all(_equal(a, b) for a, b in zip(gs[0], g, strict=True)) for g in gs[1:]]
        return all(eq), f"{p['repeats']} runs; run n equal to run 1: {eq}"

    def chunked():
        ref = full_out()
        bad = []
        for c in p["chunk_sizes"]:
            for c0 in range(0, S, c):
                c1 = min(S, c0 + c)
                out = r.fwd(q[:, :, c0:c1], k[:, :, :c1], v[:, :, :c1])
                if not _equal(out, ref[:, :, c0:c1]):
                    bad.append((c, c0))
        return not bad, (f"chunk sizes {p['chunk_sizes']}; differing (size, start): "
                         f"{bad[:6]}{' ...' if len(bad) > 6 else ''}")

    def decode():
        ref = full_out()
        bad = [t for t in p["decode_steps"]
               if not _equal(r.fwd(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1]),
                             ref[:, :, t:t + 1])]
        return not bad, f"steps {p['decode_steps']}; differing: {bad}"

    def padded(L):
        kv_lens = jnp.full((1,), L, jnp.int32)
        return (q[one], k[one], v[one], kv_lens), (q[one, :, :L], k[one, :, :L],
                                                   v[one, :, :L])

    def pad_fwd():
        bad = []
        for L in p["pad_lengths"]:
            (qp, kp, vp, kl), (qu, ku, vu) = padded(L)
            if not _equal(r.fwd(qp, kp, vp, kl)[:, :, :L], r.fwd(qu, ku, vu)):
                bad.append(L)
        return not bad, f"S={S}, valid lengths {p['pad_lengths']}; differing: {bad}"

    def pad_bwd():
        bad = []
        for L in p["pad_lengths"]:
            (qp, kp, vp, kl), (qu, ku, vu) = padded(L)
            dop = do[one].at[:, :, L:].set(0)
            gp = r.bwd(qp, kp, vp, dop, kl)
            gu = r.bwd(qu, ku, vu, do[one, :, :L])
            if not all(_equal(a[:, :, :L], b) for a, b in zip(gp, gu, strict=True)):
                bad.append(L)
        return not bad, f"valid lengths {p['pad_lengths']}; differing: {bad}"

    fns = {("row alone vs in batch", "forward"): batch_fwd,
           ("row alone vs in batch", "backward"): batch_bwd,
           ("run to run", "forward"): run_fwd, ("run to run", "backward"): run_bwd,
           ("chunked prefill vs full", "forward"): chunked,
           ("decode vs prefill row", "forward"): decode,
           ("tail key padding vs unpadded", "forward"): pad_fwd,
           ("tail key padding vs unpadded", "backward"): pad_bwd}
    for case, kind in CASES:
        run(case, kind, fns[(case, kind)])
    return results


def to_markdown(report: dict) -> str:
    meta, names = report["meta"], list(report["systems"])
    lines = [f"Measured {meta['date']} on {meta['device']} (jax {meta['jax']}, torch "
             f"{meta.get('torch', 'absent')}); shapes {meta['shapes']}; command: "
             f"`{meta['command']}`", "",
             "| case | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for case, kind in CASES:
        cells = []
        for n in names:
            res = report["systems"][n]
            cell = res.get(f"{case}|{kind}", {"result": "unavailable"})["result"] \
                if isinstance(res, dict) else "unavailable"
            cells.append({"equal": "equal", "differs": "**differs**"}.get(cell, cell))
        lines.append(f"| {case} ({kind}) | " + " | ".join(cells) + " |")
    lines += ["", "Systems: " + "; ".join(f"{n}: {meta['notes'][n]}" for n in names)]
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    if FLAGS.smoke:
        names = ["jaxattn:pallas", "xla"] + (["torch_flash", "torch_math"]
                                             if systems.torch_available() is None else [])
        b, hq, hkv, d, S = 2, 4, 2, 32, 80
        chunk_sizes, steps, pads = [24], [37, 79], [43]
    else:
        names = FLAGS.backends
        b, hq, hkv, d, S = (FLAGS.batch, FLAGS.num_q_heads, FLAGS.num_kv_heads,
                            FLAGS.head_dim, FLAGS.seq_len)
        chunk_sizes = [int(c) for c in FLAGS.chunk_sizes]
        steps = [int(t) for t in FLAGS.decode_steps] or \
            sorted({0, S - 1, *range(S // 8 - 1, S, S // 8)})[:8]
        pads = [int(x) for x in FLAGS.pad_lengths] or [S - 37, S // 2 + 1]
    dtype = jnp.dtype(FLAGS.dtype)
    ks = jax.random.split(jax.random.PRNGKey(FLAGS.seed), 4)
    rnd = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)
    q = rnd(ks[0], (b, hq, S, d))
    k = rnd(ks[1], (b, hkv, S, d))
    v = rnd(ks[2], (b, hkv, S, d))
    do = rnd(ks[3], (b, hq, S, d))
    p = {"dtype": dtype.name, "row": min(FLAGS.row, b - 1), "repeats": FLAGS.repeats,
         "chunk_sizes": chunk_sizes, "decode_steps": steps, "pad_lengths": pads}
    meta = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
            "platform": jax.default_backend(), "jax": jax.__version__,
            "command": "python -m benchmarks.peer_invariance " + " ".join(sys.argv[1:]),
            "shapes": f"B={b}, Hq={hq}, Hkv={hkv}, D={d}, S={S}, {dtype.name}, causal",
            "params": p, "notes": {}}
    try:
        import torch
        meta["torch"] = torch.__version__
    except ImportError:
        pass
    report = {"meta": meta, "systems": {}}
    t0 = time.time()
    progress = lambda msg: print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)
    for name in names:
        try:
            system = systems.make(name)
        except systems.Unsupported as e:
            report["systems"][name] = f"unavailable: {e}"
            meta["notes"][name] = f"unavailable: {e}"
            continue
        meta["notes"][name] = system.notes
        report["systems"][name] = check_system(Runner(system), q, k, v, do, p, progress)
    md = to_markdown(report)
    print(md)
    write_results(FLAGS.out_dir, report, md)


if __name__ == "__main__":
    app.run(main)
