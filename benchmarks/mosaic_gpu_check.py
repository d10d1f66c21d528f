"""GPU checks and speed of the Mosaic GPU forward and backward (docs/mosaic.md).

    python -m benchmarks.mosaic_gpu_check --out_dir=$OUT/mosaic        # H200 only
    python -m benchmarks.mosaic_gpu_check --nochecks --speed --fwd_variants=pp,pp3:stages=3

Checks (default): the forward (``mosaic_fwd.forward``) at real shapes for each arithmetic
family (``--families``: accumulate x row sum) and launch variant (``--launches``):
error against ``reference.forward_fp32_with_lse``, rows with no visible key, bits
against the family's default launch (a row must not depend on its tile, warpgroup,
pipeline depth or operand path), batch, chunk and run-to-run invariance in bits, and
whether the bits equal the Pallas backend's. ``--backward``: the backward prototype
against the Pallas backward from the same ``(out, lse)``. ``--speed``: forward TFLOP/s of
the variants beside the Pallas backend, Pallas ``mha`` and cuDNN. Every configuration
runs in its own try block, so one failure is reported and the rest goes on. Prints a
line per result; writes results.json.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import report

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", None, "Write results.json here.")
flags.DEFINE_bool("backward", False, "Also check the backward prototype.")
flags.DEFINE_bool("checks", True, "Run the accuracy / bits checks.")
flags.DEFINE_bool("speed", False, "Time forward and backward against the Pallas backend "
                  "at SPEED_SHAPE (the Mosaic issue's bar is in TFLOP/s).")
flags.DEFINE_bool("speed_causal", True, "Causal forwards (and backwards, with "
                  "--backward_speed) in --speed; false: non-causal.")
flags.DEFINE_integer("iters", 10, "Timed samples (median) for --speed.")
flags.DEFINE_list("families", ["inplace-reduce32", "fresh-mma"],
                  "Arithmetic families checked (FAMILIES); the first gets every launch.")
flags.DEFINE_list("fwd_shapes", None, "Indices into FWD_SHAPES checked; default all.")
flags.DEFINE_list("bwd_shapes", None, "Indices into BWD_SHAPES checked; default all.")
flags.DEFINE_list("launches", None, "Launch variants checked (LAUNCH_VARIANTS); default all.")
flags.DEFINE_list("speed_shapes", ["2:4096", "8:4096", "1:16384"],
                  "B:S points of --speed (Hq=32, Hkv=8, D=--speed_head_dim, causal, bf16).")
flags.DEFINE_integer("speed_head_dim", 128, "Head dim of --speed's forwards (64, 128, 256).")
flags.DEFINE_list("fwd_variants", ["default", "pers:persistent=132",
                                   "pers-pf:persistent=132:prefetch_q=True",
                                   "nopp:pingpong=False"],
                  "Mosaic forward variants timed by --speed: name[:key=value...] "
                  "(MosaicConfig fields; earlier ones: s3:stages=3, "
                  "r240:registers=240/24, ...).")
flags.DEFINE_list("peers", ["pallas_mha", "pallas_mgpu", "cudnn"],
                  "Peers timed beside (benchmarks/systems).")
flags.DEFINE_bool("tail_probe", False, "Non-causal tail padding taken apart (probe_tails).")
flags.DEFINE_bool("backward_speed", False, "Also time the backward prototype in --speed.")
flags.DEFINE_bool("speed_pallas", True, "Time the Pallas backend's forward in --speed "
                  "(--backward_speed needs it: its out and lse feed the backwards).")
flags.DEFINE_list("decode_speed", [], "B:Skv[:Sq[:Hq:Hkv]] points: time decode (Sq "
                  "queries per head, default 1, speculative verification above; Hq=32, "
                  "Hkv=8 unless given; D=128, bf16, causal) of the Mosaic forward "
                  "(in-kernel fold and split_decode) beside the Pallas backend; GB/s of K "
                  "and V read.")
flags.DEFINE_integer("decode_rounds", 3, "Rounds of --decode_speed: every system timed "
                     "once a round (--iters samples), in an order rotated each round; "
                     "the median of the rounds' medians, and each round's.")
flags.DEFINE_bool("decode_masked", False, "Also time --decode_speed with a key padding "
                  "mask (each sequence's first 100 keys dropped, left padding): the "
                  "kernel zeroing V's dropped rows in SMEM ('masked') against XLA "
                  "zeroing K and V in a copy first ('masked:xla-zero', the program "
                  "before tree 363445a); their bits compared.")
flags.DEFINE_list("decode_variants", [],
                  "More Mosaic decode launches timed by --decode_speed (name[:key=value...], "
                  "MosaicConfig fields), e.g. split-s4:split_decode=True:stages=4.")
flags.DEFINE_string("decode_baseline", None,
                    "Path of another version of jaxattn/backends/mosaic/forward.py (e.g. "
                    "`git show REV:jaxattn/backends/mosaic/forward.py > old.py`): its "
                    "default decode timed by --decode_speed as 'mosaic:baseline' in the "
                    "same rounds, its bits compared (a change's before and after in one "
                    "process).")
flags.DEFINE_list("bwd_variants", ["default", "inplace:accumulate=inplace",
                                   "dkdv1:dkdv_wgs=1", "dq1:dq_wgs=1",
                                   "noregs:registers=None"],
                  "Mosaic backward variants timed by --backward_speed: name[:key=value...] "
                  "(BwdConfig fields).")

FWD_SHAPES = [(2, 8, 2, 2048, 2048, 128), (2, 8, 2, 2048, 2048, 64), (4, 32, 8, 128, 4096, 128),
              (1, 4, 4, 256, 128, 64), (2, 8, 2, 1000, 1000, 128), (1, 4, 1, 77, 1500, 64),
              # D=256 (not with prefetch_q: SMEM)
              (2, 8, 2, 1500, 1500, 256)]
BWD_SHAPES = [(2, 8, 2, 2048, 2048, 128), (2, 8, 2, 1024, 2048, 64), (1, 4, 4, 256, 128, 64),
              # D=256: dK and dV by two kernels (split_dkdv), one dQ tile per CTA
              (2, 8, 2, 1024, 1024, 256)]


def _inputs(b, hq, hkv, sq, skv, d, seed):
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (b, hq, sq, d), jnp.bfloat16),
            jax.random.normal(ks[1], (b, hkv, skv, d), jnp.bfloat16),
            jax.random.normal(ks[2], (b, hkv, skv, d), jnp.bfloat16),
            jax.random.normal(ks[3], (b, hq, sq, d), jnp.bfloat16))


def _bits(x):
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _same(a, b) -> bool:
    return bool(np.array_equal(_bits(a), _bits(b)))


def _rel(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


#: Launch variants of the forward: each must give the bits of "default" (a row must not
#: depend on its warpgroup, the CTA's size and order, the pipeline depth or the operand
#: path). Tiles stay 64 rows per warpgroup: 128 rows changed the fp32 row sum's bits on
#: the H200 (docs/mosaic.md).
LAUNCH_VARIANTS = {
    "default": {},
    "1wg-64": dict(compute_wgs=1),
    "nopingpong": dict(pingpong=False),
    "stages3": dict(stages=3),
    "ascending-noregs": dict(q_order="ascending", registers=None),
    "warpgroup": dict(semantics="warpgroup"),
    "smem-operands": dict(gpu_operands=False),
    # The default is a persistent grid where the tiles are short (the checks' shapes):
    # one CTA per tile, and persistent grids, Q prefetch or not.
    "plain-grid": dict(persistent=0),
    "persistent": dict(persistent=132, prefetch_q=False),  # the H200's SM count
    "persistent-prefetch": dict(persistent=132, prefetch_q=True),
    "persistent-7": dict(persistent=7),  # more items per CTA
    # Two warpgroups of two roles on a 64-row tile (applies with rowsum="reduce32");
    # heads 2i and 2i + 1 in a cluster of two, K/V multicast (the plain grid).
    "pv-split": dict(pv_split=True),
    "kv-multicast": dict(kv_multicast=True, persistent=0),
    # Three compute warpgroups (192-row tiles), the ping-pong as a ring of turns.
    "3wg": dict(compute_wgs=3),
    # The epilogue's TMA stores awaited until written, not only read (the default).
    "store-wait-write": dict(store_wait="write"),
}
#: The arithmetic choices (accumulate, rowsum): each is its own set of bits.
FAMILIES = {
    "inplace-reduce32": dict(accumulate="inplace", rowsum="reduce32"),
    "fresh-mma": dict(accumulate="fresh", rowsum="mma"),
    "inplace-mma": dict(accumulate="inplace", rowsum="mma"),
    "fresh-reduce32": dict(accumulate="fresh", rowsum="reduce32"),
    "inplace-reduce32-approx": dict(accumulate="inplace", rowsum="reduce32", approx_math=True),
}


def check_forward(results: list) -> None:
    import jaxattn
    from jaxattn import reference
    from jaxattn.backends.mosaic import forward as mf
    shapes = [FWD_SHAPES[int(i)] for i in FLAGS.fwd_shapes or range(len(FWD_SHAPES))]
    for shape, causal in itertools.product(shapes, [True, False]):
        q, k, v, _ = _inputs(*shape, seed=sum(shape))
        ro, rl = reference.forward_fp32_with_lse(q, k, v, causal=causal)
        po, pl_ = jaxattn.attention(q, k, v, causal=causal, return_lse=True, backend="pallas")
        fin = np.isfinite(np.asarray(rl))
        for fam in FLAGS.families:
            fkw = FAMILIES[fam]
            # The SMEM operand path cannot accumulate in place.
            every = [n for n in FLAGS.launches or LAUNCH_VARIANTS
                     if not (n == "smem-operands" and fkw["accumulate"] == "inplace")]
            names = (every if fam == FLAGS.families[0] else
                     [n for n in every if n in ("default", "1wg-64", "nopingpong")])
            launches = {n: LAUNCH_VARIANTS[n] for n in names}
            first = None
            for name, lkw in launches.items():
                row = {"kind": "forward", "shape": shape, "causal": causal, "family": fam,
                       "launch": name}
                try:
                    cfg = mf.MosaicConfig(**fkw, **lkw)
                    t0 = time.time()
                    o, lse = jax.block_until_ready(mf.forward(q, k, v, causal=causal,
                                                              config=cfg))
                    row.update(seconds=round(time.time() - t0, 2),
                               err=_rel(o.astype(jnp.float32), ro),
                               lse_err=float(np.max(np.where(fin, np.abs(np.asarray(lse) -
                                                                         np.asarray(rl)), 0))),
                               empty_rows_ok=bool(np.array_equal(np.isfinite(np.asarray(lse)),
                                                                 fin)),
                               nan=bool(np.isnan(np.asarray(o, np.float32)).any()),
                               out_bits_eq_pallas=_same(o, po))
                    if first is None and fam == FLAGS.families[0]:
                        row.update(_masked(mf, reference, q, k, v, causal, cfg))
                    if first is None:
                        first = (o, lse, cfg)
                        if fam == FLAGS.families[0]:
                            _invariance(results, mf, q, k, v, causal, cfg, o, lse, shape,
                                        fam)
                    else:
                        row["bits_eq_default"] = _same(o, first[0]) and _same(lse, first[1])
                except Exception as e:  # reported; the other configurations go on
                    row["error"] = f"{type(e).__name__}: {e}"[:400]
                results.append(row)
                print(row, flush=True)


def _masked(mf, reference, q, k, v, causal, cfg) -> dict:
    """A random key padding mask (one sequence with every key dropped): the error
    against the reference with that mask, NaN, and 0 / -inf for the dropped sequence."""
    b, skv = k.shape[0], k.shape[2]
    mask = jax.random.bernoulli(jax.random.key(skv), 0.8, (b, skv)).at[-1].set(False)
    o, lse = mf.forward(q, k, v, causal=causal, config=cfg, key_padding_mask=mask)
    ro, _ = reference.forward_fp32_with_lse(q, k, v, causal=causal, key_padding_mask=mask)
    return dict(mask_err=_rel(o.astype(jnp.float32), ro),
                mask_nan=bool(np.isnan(np.asarray(o, np.float32)).any()),
                mask_dropped_ok=bool(not np.asarray(o[-1], np.float32).any()
                                     and np.all(np.asarray(lse[-1]) == -np.inf)))


def _invariance(results, mf, q, k, v, causal, cfg, o, lse, shape, fam) -> None:
    """Batch invariance (the first sequence alone), chunk and decode invariance (the
    last queries against all keys) and run-to-run equality of one configuration, in
    bits."""
    row = {"kind": "invariance", "shape": shape, "causal": causal, "family": fam}
    try:
        o1, l1 = mf.forward(q[:1], k[:1], v[:1], causal=causal, config=cfg)
        row["batch"] = _same(o1, o[:1]) and _same(l1, lse[:1])
        # The last 128 and the last 70 queries (a start off the 64-row grid: padded
        # inside) against all keys, and the last query alone (a decode row, its GQA
        # group stacked as the rows of one tile, and unstacked).
        for name, n, c in (("chunk", 128, cfg), ("chunk70", 70, cfg),
                           ("decode", 1, dataclasses.replace(cfg, split_decode=False)),
                           ("decode_unstacked", 1,
                            dataclasses.replace(cfg, stack_decode=False)),
                           ("decode_split", 1, dataclasses.replace(cfg, split_decode=True))):
            if q.shape[2] > n:
                oc, lc = mf.forward(q[:, :, -n:], k, v, causal=causal, config=c)
                row[name] = _same(oc, o[:, :, -n:]) and _same(lc, lse[:, :, -n:])
        o2, l2 = mf.forward(q, k, v, causal=causal, config=cfg)
        row["run_to_run"] = _same(o2, o) and _same(l2, lse)
        # Each SPLIT's partial state, folded outside the kernel (context parallelism):
        # by the Mosaic fold kernel (promised equal) and by XLA's merge.fold (reported).
        from jaxattn.merge import fold
        for name, fn, kernel_lse in (
                ("split_fold_mosaic", functools.partial(mf.fold_partials_jit, config=cfg),
                 True),
                ("split_fold_xla", jax.jit(fold), False)):
            outs, lses = mf.split_partials(q, k, v, causal=causal, config=cfg,
                                           kernel_lse=kernel_lse)
            fo, fl = fn(outs, lses)
            row[name] = _same(fo.astype(o.dtype), o) and _same(fl, lse)
        # Tail key padding: 100 more keys (and, causal, 100 more queries), dropped by a
        # key padding mask, give the rows of the unpadded call.
        pad = ((0, 0), (0, 0), (0, 100), (0, 0))
        skv = k.shape[2]
        keep = jnp.broadcast_to(jnp.arange(skv + 100) < skv, (k.shape[0], skv + 100))
        op, lp = mf.forward(jnp.pad(q, pad) if causal else q, jnp.pad(k, pad),
                            jnp.pad(v, pad), causal=causal, config=cfg,
                            key_padding_mask=keep)
        n = q.shape[2]
        row["tail_padding"] = _same(op[:, :, :n], o) and _same(lp[:, :, :n], lse)
    except Exception as e:  # reported; the rest goes on
        row["error"] = f"{type(e).__name__}: {e}"[:400]
    results.append(row)
    print(row, flush=True)


def check_backward(results: list) -> None:
    from jaxattn import reference
    from jaxattn.backends.mosaic import backward as mb
    from jaxattn.backends.pallas import backward as pv
    shapes = [BWD_SHAPES[int(i)] for i in FLAGS.bwd_shapes or range(len(BWD_SHAPES))]
    for shape, causal in itertools.product(shapes, [True, False]):
        q, k, v, do = _inputs(*shape, seed=sum(shape) + 1)
        scale = 1.0 / np.sqrt(shape[-1])
        out, lse = pv.attention(q, k, v, None, None, causal, scale, False)
        dlse = jnp.zeros_like(lse)
        ref = jax.vjp(lambda q, k, v, c=causal: reference.forward_fp32(q, k, v, causal=c),
                      q, k, v)[1](do.astype(jnp.float32))
        tri = pv.backward(q, k, v, None, out, lse, do, dlse, causal=causal, scale=scale,
                          interpret=False)
        first = None
        # The defaults first, then one launch parameter changed at a time: these must
        # agree in bits. "inplace" is its own arithmetic (errors only).
        configs = [{}, dict(dkdv_wgs=1), dict(dq_wgs=2),
                   dict(registers=None), dict(semantics="warpgroup"),
                   dict(gpu_operands=False), dict(split_dkdv=True), dict(dp_overlap=True),
                   dict(accumulate="inplace"),
                   # their own arithmetic (errors; bits only against the default's where
                   # both mask paths meet: the all-kept key mask, check_backward_tails)
                   dict(mask="probs"), dict(mask="probs", exp2=True)]
        for kw in configs:
            row = {"kind": "backward", "shape": shape, "causal": causal, **kw}
            try:
                cfg = mb.BwdConfig(**kw)
                g = jax.block_until_ready(mb.backward(q, k, v, out, lse, do, dlse,
                                                      causal=causal, scale=scale,
                                                      config=cfg))
                row.update(errs=[_rel(a.astype(jnp.float32), r) for a, r in zip(g, ref,
                                                                                 strict=True)],
                           nan=any(bool(np.isnan(np.asarray(a, np.float32)).any())
                                   for a in g),
                           bits_eq_pallas=[_same(a, t) for a, t in zip(g, tri, strict=True)])
                if first is None:
                    first = g
                elif not {"accumulate", "mask"} & set(kw):  # launch parameters: same bits
                    row["bits_eq_first"] = all(_same(a, f) for a, f in zip(g, first,
                                                                            strict=True))
            except Exception as e:  # reported; the other configurations go on
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            results.append(row)
            print(row, flush=True)


def check_backward_tails(results: list) -> None:
    """The backward at Sq=Skv=1000 (padded inside) with a random key padding mask:
    errors against the fp32 reference's gradients with that mask, zero gradients for
    the dropped keys; and 1000 tokens padded to 1100 with the padding keys dropped (zero
    cotangent on the padding rows) against the 1000 alone, in bits. Defaults and
    ``mask="probs"`` (whose unpadded call takes the unmasked path on fully visible
    blocks and the padded one the masked path: the two paths' bits)."""
    from jaxattn import reference
    from jaxattn.backends.mosaic import backward as mb
    for causal, kw in itertools.product([True, False], [{}, dict(mask="probs", exp2=True)]):
        row = {"kind": "backward-tails", "causal": causal, **kw}
        try:
            cfg = mb.BwdConfig(**kw)
            q, k, v, do = _inputs(2, 8, 2, 1000, 1000, 128, seed=11)
            mask = jax.random.bernoulli(jax.random.key(3), 0.8, (2, 1000))
            out, lse = reference.forward_with_lse(q, k, v, causal=causal,
                                                  key_padding_mask=mask)
            g = mb.backward(q, k, v, out, lse, do, causal=causal, config=cfg,
                            key_padding_mask=mask)
            ref = jax.vjp(lambda q, k, v, c=causal, m=mask: reference.forward_fp32(
                q, k, v, causal=c, key_padding_mask=m), q, k, v)[1](do.astype(jnp.float32))
            dropped = ~np.asarray(mask)
            row.update(errs=[_rel(a.astype(jnp.float32), r) for a, r in zip(g, ref,
                                                                             strict=True)],
                       nan=any(bool(np.isnan(np.asarray(a, np.float32)).any()) for a in g),
                       dropped_zero=all(not np.asarray(a, np.float32)[i][:, dropped[i]].any()
                                        for a in g[1:] for i in range(2)))
            pad = ((0, 0), (0, 0), (0, 100), (0, 0))
            o1, l1 = reference.forward_with_lse(q, k, v, causal=causal)
            alone = mb.backward(q, k, v, o1, l1, do, causal=causal, config=cfg)
            tail = jnp.broadcast_to(jnp.arange(1100) < 1000, (2, 1100))
            qp = jnp.pad(q, pad) if causal else q
            dop = jnp.pad(do, pad) if causal else do
            o2, l2 = reference.forward_with_lse(qp, jnp.pad(k, pad), jnp.pad(v, pad),
                                                causal=causal, key_padding_mask=tail)
            # The real rows' O and LSE as the unpadded call had them (XLA's reference
            # need not give the same bits at another key count); the padding rows'
            # own (their cotangent is zero).
            o2 = jnp.concatenate([o1, o2[:, :, 1000:]], axis=2)
            l2 = jnp.concatenate([l1, l2[:, :, 1000:]], axis=2)
            padded = mb.backward(qp, jnp.pad(k, pad), jnp.pad(v, pad), o2, l2, dop,
                                 causal=causal, config=cfg, key_padding_mask=tail)
            row["tail_padding"] = all(_same(a, p_[:, :, :1000]) for a, p_ in zip(
                alone, padded, strict=True))
        except Exception as e:  # reported; the rest goes on
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        results.append(row)
        print(row, flush=True)


def _variant(spec: str):
    """``name[:key=value...]`` -> (name, MosaicConfig kwargs); values are ints, bools,
    None or strings, e.g. ``pp3:stages=3`` or ``r:registers=240/24`` (a tuple)."""
    return report.named_config(spec)


def time_speed(results: list) -> None:
    """Forward TFLOP/s of the Mosaic forward variants (``--fwd_variants``) beside the
    Pallas backend, JAX's Pallas ``mha`` and cuDNN, causal bf16, Hq=32, Hkv=8,
    D=``--speed_head_dim``, at each ``--speed_shapes`` B:S, timed as
    benchmarks/attention_bench.py times (samples of back-to-back calls over rotating
    input sets, median); then the backward prototype beside the Pallas backward."""
    from benchmarks import systems
    from jaxattn.backends.mosaic import backward as mb
    from jaxattn.backends.mosaic import forward as mf
    from jaxattn.backends.pallas import backward as pv
    from jaxattn.backends.pallas import forward as pt
    hq, hkv, d = 32, 8, FLAGS.speed_head_dim
    causal = FLAGS.speed_causal
    scale = 1 / np.sqrt(d)
    for spec in FLAGS.speed_shapes:
        b, s = (int(x) for x in spec.split(":"))
        sets = [_inputs(b, hq, hkv, s, s, d, seed=7 + i)[:3] for i in range(3)]
        flops = report.attention_flops(b, hq, s, s, d, causal)
        fns = {}
        if FLAGS.speed_pallas or FLAGS.backward_speed:
            fns["pallas"] = jax.jit(lambda q, k, v: pt.forward(
                q, k, v, causal=causal, scale=scale, interpret=False))
        for vspec in FLAGS.fwd_variants:
            name, kw = _variant(vspec)
            fns[f"mosaic:{name}"] = jax.jit(functools.partial(
                mf.forward, causal=causal, scale=scale, config=mf.MosaicConfig(**kw)))
        for peer in FLAGS.peers:
            try:
                sysm = systems.make(peer)
                f = functools.partial(sysm.forward, causal=causal)
                # JAX systems compiled as attention_bench compiles them (each op of an
                # uncompiled call is dispatched and timed on its own).
                fns[peer] = (sysm, jax.jit(f) if sysm.framework == "jax" else f)
            except Exception as e:  # a missing peer is reported
                print({"peer": peer, "error": str(e)[:200]}, flush=True)
        base = None  # the default's out and lse on the first set: the variants' bits
        for name, fn in fns.items():
            row = {"kind": "speed", "system": name, "B": b, "S": s, "D": d,
                   "causal": causal}
            if name.startswith("mosaic:"):
                try:
                    got = jax.block_until_ready(fn(*sets[0]))
                    base = got if base is None else base
                    row["bits_as_first_variant"] = all(
                        _same(a, c) for a, c in zip(base, got, strict=True))
                except Exception as e:  # reported below by the timing
                    row["bits_error"] = f"{type(e).__name__}: {e}"[:200]
            try:
                if isinstance(fn, tuple):
                    sysm, f = fn
                    ins = [sysm.prepare(*x) for x in sets]
                    sec, reps = report.sampled_seconds(f, ins, sysm.sync, FLAGS.iters, 3, 10,
                                                       0.03)
                else:
                    sec, reps = report.sampled_seconds(fn, sets, jax.block_until_ready,
                                                       FLAGS.iters, 3, 10, 0.03)
                row.update(ms=sec * 1e3, tflops=flops / sec / 1e12, reps=reps)
            except Exception as e:  # a variant failing here is a result too
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            results.append(row)
            print(row, flush=True)
        if not FLAGS.backward_speed:
            continue
        q, k, v, do = _inputs(b, hq, hkv, s, s, d, seed=7)
        o, lse = fns["pallas"](q, k, v)
        bwds = [(f"mosaic-bwd:{name}", functools.partial(
                    mb.backward, causal=causal, scale=scale, config=mb.BwdConfig(**kw)))
                for name, kw in map(_variant, FLAGS.bwd_variants)]
        bwds.append(("pallas-bwd", lambda q, k, v, o, l, do: pv.backward(
            q, k, v, None, o, l, do, None, causal=causal, scale=scale, interpret=False)))
        first = None
        for name, bwd in bwds:
            row = {"kind": "speed", "system": name, "B": b, "S": s, "causal": causal}
            try:
                fn = jax.jit(bwd)
                before = jax.block_until_ready(fn(q, k, v, o, lse, do))
                if name.startswith("mosaic-bwd:"):  # the variants' bits: the first's
                    first = before if first is None else first
                    row["bits_as_first_variant"] = all(
                        _same(a, c) for a, c in zip(first, before, strict=True))
                sec, reps = report.sampled_seconds(fn, [(q, k, v, o, lse, do)],
                                     jax.block_until_ready, FLAGS.iters, 3, 10, 0.03)
                after = fn(q, k, v, o, lse, do)
                # The same bits after every timed call, and no NaN.
                row.update(ms=sec * 1e3, tflops=2.5 * flops / sec / 1e12,
                           bits_after_timing=all(_same(a, c) for a, c in zip(before, after,
                                                                              strict=True)),
                           nan=any(bool(np.isnan(np.asarray(a, np.float32)).any())
                                   for a in after))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            results.append(row)
            print(row, flush=True)


@functools.cache
def _baseline_forward():
    """--decode_baseline's module (the other version of the Mosaic forward, loaded beside
    this one under another name; it shares jaxattn's other modules)."""
    import importlib.util
    import sys
    name = "jaxattn_baseline_forward"
    spec = importlib.util.spec_from_file_location(name, FLAGS.decode_baseline)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_decode(results: list) -> None:
    """Decode: Sq queries per head (1 unless a point says; speculative verification
    above) against Skv keys, causal, bf16, Hq=32, Hkv=8 unless a point says, D=128; GB/s
    counts the K and V bytes read (the floor of a decode step)."""
    from jaxattn.backends.mosaic import forward as mf
    from jaxattn.backends.pallas import forward as pt
    d = 128
    scale = 1 / np.sqrt(d)
    for spec in FLAGS.decode_speed:
        fields = [int(x) for x in spec.split(":")]
        if len(fields) not in (2, 3, 5):
            raise ValueError(f"--decode_speed takes B:Skv[:Sq[:Hq:Hkv]], got {spec!r}")
        b, s, sq, hq, hkv = (fields + [1, 32, 8][len(fields) - 2:])[:5]
        sets = [_inputs(b, hq, hkv, sq, s, d, seed=7 + i)[:3] for i in range(3)]
        kv_bytes = 2 * b * hkv * s * d * 2
        fns = {
            "pallas": lambda q, k, v: pt.forward(q, k, v, causal=True, scale=scale,
                                                 interpret=False),
            "mosaic:fold-in-kernel": functools.partial(
                mf.forward, causal=True, scale=scale,
                config=mf.MosaicConfig(split_decode=False)),
            "mosaic:split_decode": functools.partial(
                mf.forward, causal=True, scale=scale,
                config=mf.MosaicConfig(split_decode=True)),
            # split_decode=None: split below SPLIT_DECODE_BELOW_CTAS (batch, KV head) CTAs
            "mosaic:default": functools.partial(mf.forward, causal=True, scale=scale),
        }
        for vspec in FLAGS.decode_variants:  # launch options: the same bits
            name, kw = _variant(vspec)
            fns[f"mosaic:{name}"] = functools.partial(
                mf.forward, causal=True, scale=scale, config=mf.MosaicConfig(**kw))
        if FLAGS.decode_baseline:
            fns["mosaic:baseline"] = functools.partial(
                _baseline_forward().forward, causal=True, scale=scale)
        if FLAGS.decode_masked:
            keep = jnp.broadcast_to(jnp.arange(s) >= 100, (b, s))

            def masked(q, k, v, zero_first=False, keep=keep):
                if zero_first:
                    k, v = mf.zero_dropped_keys(k, v, keep)
                return mf.forward(q, k, v, causal=True, scale=scale, key_padding_mask=keep)

            fns["mosaic:masked"] = masked
            fns["mosaic:masked:xla-zero"] = functools.partial(masked, zero_first=True)
        # Compile and check every system first, then time them in rounds (the order
        # rotated each round), so that a drift of the machine over the call does not
        # read as a difference between systems (on 2026-12-04 two runs of one program
        # timed one after the other read 57.5 and 71.2 us).
        outs, rows, jitted = {}, {}, {}
        for name, fn in fns.items():
            row = rows[name] = {"kind": "decode-speed", "system": name, "B": b, "Skv": s,
                                "Sq": sq, "Hq": hq, "Hkv": hkv}
            try:
                jitted[name] = jax.jit(fn)
                outs[name] = jax.block_until_ready(jitted[name](*sets[0]))
                if name == "mosaic:masked:xla-zero" and "mosaic:masked" in outs:
                    row["bits_eq_masked"] = all(
                        _same(a, c) for a, c in zip(outs[name], outs["mosaic:masked"],
                                                    strict=True))
                elif name.startswith("mosaic:") and not name.startswith("mosaic:masked") \
                        and name != "mosaic:fold-in-kernel" and "mosaic:fold-in-kernel" in outs:
                    row["bits_eq_fold_in_kernel"] = all(
                        _same(a, c) for a, c in zip(outs[name], outs["mosaic:fold-in-kernel"],
                                                    strict=True))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                jitted.pop(name, None)
        names = list(jitted)
        samples = {name: [] for name in names}
        for r in range(max(1, FLAGS.decode_rounds)):
            for name in names[r % len(names):] + names[:r % len(names)] if names else ():
                sec, reps = report.sampled_seconds(jitted[name], sets, jax.block_until_ready,
                                                   FLAGS.iters, 2, 50, 0.03)
                samples[name].append(sec)
                rows[name]["reps"] = reps
        for name, row in rows.items():
            if samples.get(name):
                sec = float(np.median(samples[name]))
                row.update(us=sec * 1e6, gbps=kv_bytes / sec / 1e9,
                           rounds_us=[round(x * 1e6, 1) for x in samples[name]])
            results.append(row)
            print(row, flush=True)


def probe_tails(results: list) -> None:
    """Non-causal tail padding, taken apart (the run of 2026-11-30, 240f678: the row at B=2,
    Sq=Skv=1000, D=128
    differed on the H200 and not in interpret mode): keys padded by several amounts and
    dropped by a key mask, against the unpadded call, per launch configuration; how
    many outputs and lses differ in bits."""
    from jaxattn.backends.mosaic import forward as mf

    def padded_row(q, k, v, cfg, extra, o, lse, **row):
        """The unpadded call's ``(o, lse)`` against ``extra`` dropped keys appended."""
        b, skv = k.shape[0], k.shape[2]
        pad = ((0, 0), (0, 0), (0, extra), (0, 0))
        keep = jnp.broadcast_to(jnp.arange(skv + extra) < skv, (b, skv + extra))
        kp, vp = jnp.pad(k, pad), jnp.pad(v, pad)
        op, lp = mf.forward(q, kp, vp, causal=False, config=cfg, key_padding_mask=keep)
        row = {"kind": "tail-probe", **row, "extra_keys": extra,
               "out_diff": int((_bits(op) != _bits(o)).sum()),
               "lse_diff": int((_bits(lp) != _bits(lse)).sum())}
        return row, (op, lp, kp, vp, keep)

    q, k, v, _ = _inputs(2, 8, 2, 1000, 1000, 128, 7)
    for name, cfg in (("default", mf.MosaicConfig()),
                      ("nopp", mf.MosaicConfig(pingpong=False)),
                      ("one-wg", mf.MosaicConfig(compute_wgs=1, pingpong=False))):
        o, lse = mf.forward(q, k, v, causal=False, config=cfg)
        for extra in (30, 100, 1100):
            row, (op, lp, kp, vp, keep) = padded_row(q, k, v, cfg, extra, o, lse,
                                                     config=name)
            row["max_abs"] = float(np.max(np.abs(np.asarray(op, np.float32)
                                                 - np.asarray(o, np.float32))))
            if row["lse_diff"]:
                d = np.asarray(lp, np.float64) - np.asarray(lse, np.float64)
                where = np.argwhere(_bits(lp) != _bits(lse))  # [n, 3]: b, h, row
                row["lse_max_abs"] = float(np.abs(d).max())
                row["lse_rows_mod128"] = np.bincount(where[:, 2] % 128 // 64).tolist()
                row["lse_heads"] = np.bincount(where[:, 1]).tolist()
                row["lse_tiles"] = np.bincount(where[:, 2] // 128).tolist()
                _, sp_l = mf.split_partials(q, kp, vp, causal=False, config=cfg,
                                            key_padding_mask=keep)
                row["split2_lse_finite"] = int(np.isfinite(np.asarray(sp_l[1])).sum())
            results.append(row)
            print(row, flush=True)
    # 77 x 1500 (failing row of the 2026-11-30 run, 1fbd2b0).
    q, k, v, _ = _inputs(1, 4, 1, 77, 1500, 64, 7)
    cfg = mf.MosaicConfig()
    o, lse = mf.forward(q, k, v, causal=False, config=cfg)
    row, _ = padded_row(q, k, v, cfg, 100, o, lse, config="default", shape="77x1500")
    results.append(row)
    print(row, flush=True)


def main(argv):
    del argv
    results = [{"jax": jax.__version__, "device": jax.devices()[0].device_kind}]
    print(results[0], flush=True)
    if FLAGS.checks:
        check_forward(results)
        if FLAGS.backward:
            check_backward_tails(results)
            check_backward(results)
    if FLAGS.speed:
        time_speed(results)
    if FLAGS.decode_speed:
        time_decode(results)
    if FLAGS.tail_probe:
        probe_tails(results)
    report.write(FLAGS.out_dir, results, default=str)


if __name__ == "__main__":
    app.run(main)
