"""The invariance matrix of DESIGN.md section 7, as checks on raw bits.

Each check runs one backend on fresh random inputs and compares the bits of two ways of
computing the same rows (``jnp.array_equal`` on the arrays themselves, never an upcast
allclose). The checks are used by the tests, by ``python -m jaxattn.check`` and by the
GPU script, so all three measure the same thing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.registry import get_op

#: Accuracy bars: max |out - ref| / max |ref| against forward_fp32 (DESIGN.md 7).
TOLERANCE = {"bfloat16": 3e-2, "float16": 5e-3, "float32": 1e-5}


@dataclasses.dataclass(frozen=True)
class Problem:
    """Shapes of one invariance run (q and k share the sequence length)."""

    batch: int = 2
    num_q_heads: int = 4
    num_kv_heads: int = 2
    seq_len: int = 160
    head_dim: int = 64
    dtype: str = "bfloat16"
    causal: bool = True
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One row of the matrix: ``equal`` is the raw-bits verdict."""

    case: str
    kind: str  # "forward", "backward", or "tolerance" (equal: within the row's bound)
    equal: bool
    detail: str = ""
    checked: bool = True  # False: the case does not apply to this problem (see detail)


def normal(seed, shape, dtype=jnp.float32, *, scale: float = 1.0,
           nan_from: int | None = None) -> jax.Array:
    """Normal values (standard, times ``scale``) of ``shape`` in ``dtype`` from ``seed``
    (an int or a numpy ``Generator``), drawn by numpy in fp32 and rounded to ``dtype``
    on the host, and NaN from row ``nan_from`` of the first axis on: no XLA program per
    shape (on a CPU, jax.random's compiled once per new shape, about 0.25 s each)."""
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    x = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
    if nan_from is not None:
        x[nan_from:] = np.nan
    return jnp.asarray(x.astype(jnp.dtype(dtype)))


def random_qkv(p: Problem, *, seq_len: int | None = None, batch: int | None = None,
               seed: int | None = None):
    """Fresh normal q, k, v (never zeros) for a problem."""
    s = p.seq_len if seq_len is None else seq_len
    b = p.batch if batch is None else batch
    rng = np.random.default_rng(p.seed if seed is None else seed)
    q, k, v = (normal(rng, (b, h, s, p.head_dim), p.dtype)
               for h in (p.num_q_heads, p.num_kv_heads, p.num_kv_heads))
    return q, k, v


def bits_equal(a: jax.Array, b: jax.Array) -> bool:
    """Raw-bit equality (NaN payloads and signed zeros included)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.tobytes() == b.tobytes()


def _mismatch(a, b) -> str:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shapes/dtypes {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    if a.size == 0:
        return "empty arrays differ"
    uint = np.dtype(f"uint{a.dtype.itemsize * 8}")
    n = int(np.count_nonzero(a.view(uint) != b.view(uint)))
    with np.errstate(invalid="ignore"):
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return f"{n}/{a.size} elements differ in bits, max |diff| {np.nanmax(diff):.3g}"


def _compare(case: str, kind: str, pairs: Sequence[tuple[jax.Array, jax.Array]]) -> CheckResult:
    for a, b in pairs:
        if not bits_equal(a, b):
            return CheckResult(case, kind, False, _mismatch(a, b))
    return CheckResult(case, kind, True, f"{len(pairs)} comparisons")


def _fwd(op, causal: bool):
    return jax.jit(lambda q, k, v, m=None: op.forward_with_lse(
        q, k, v, causal=causal, key_padding_mask=m))


def _grads(op, causal: bool):
    def loss(q, k, v, do, m):
        out = op.forward(q, k, v, causal=causal, key_padding_mask=m)
        return jnp.sum(out.astype(jnp.float32) * do)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def check_batch(op, p: Problem) -> list[CheckResult]:
    """A sequence computed alone vs inside a batch (forward and backward)."""
    q, k, v = random_qkv(p)
    fwd = _fwd(op, p.causal)
    out, lse = fwd(q, k, v)
    pairs = []
    for i in range(p.batch):
        o1, l1 = fwd(q[i:i + 1], k[i:i + 1], v[i:i + 1])
        pairs += [(o1[0], out[i]), (l1[0], lse[i])]
    res = [_compare("row alone vs in batch", "forward", pairs)]
    do = normal(p.seed + 7, q.shape)
    grads = _grads(op, p.causal)
    g = grads(q, k, v, do, None)
    pairs = []
    for i in range(p.batch):
        g1 = grads(q[i:i + 1], k[i:i + 1], v[i:i + 1], do[i:i + 1], None)
        pairs += [(a[0], b[i]) for a, b in zip(g1, g, strict=True)]
    res.append(_compare("row alone vs in batch", "backward", pairs))
    return res


def check_rerun(op, p: Problem, repeats: int = 3) -> list[CheckResult]:
    """The same inputs, run several times (forward and backward)."""
    q, k, v = random_qkv(p)
    fwd = _fwd(op, p.causal)
    first = fwd(q, k, v)
    pairs = [(a, b) for _ in range(repeats - 1) for a, b in zip(first, fwd(q, k, v),
                                                                  strict=True)]
    res = [_compare("run to run", "forward", pairs)]
    do = normal(p.seed + 7, q.shape)
    grads = _grads(op, p.causal)
    g0 = grads(q, k, v, do, None)
    pairs = [(a, b) for _ in range(repeats - 1)
             for a, b in zip(g0, grads(q, k, v, do, None), strict=True)]
    res.append(_compare("run to run", "backward", pairs))
    return res


def check_chunked_prefill(op, p: Problem, chunk_sizes: Sequence[int]) -> list[CheckResult]:
    """Query chunks against all earlier keys vs the full causal prefill."""
    q, k, v = random_qkv(p)
    fwd = _fwd(op, True)
    out, lse = fwd(q, k, v)
    pairs = []
    for c in chunk_sizes:
        for start in range(0, p.seq_len, c):
            end = min(start + c, p.seq_len)
            o, l = fwd(q[:, :, start:end], k[:, :, :end], v[:, :, :end])
            pairs += [(o, out[:, :, start:end]), (l, lse[:, :, start:end])]
    return [_compare(f"chunked prefill {list(chunk_sizes)} vs full", "forward", pairs)]


def check_decode(op, p: Problem, steps: Sequence[int] | None = None) -> list[CheckResult]:
    """Decode steps (Sq = 1 against a growing cache) vs the prefill row of that token."""
    q, k, v = random_qkv(p)
    fwd = _fwd(op, True)
    out, lse = fwd(q, k, v)
    steps = range(p.seq_len) if steps is None else steps
    pairs = []
    for t in steps:
        o, l = fwd(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1])
        pairs += [(o, out[:, :, t:t + 1]), (l, lse[:, :, t:t + 1])]
    return [_compare(f"decode ({len(pairs) // 2} steps) vs prefill", "forward", pairs)]


def check_padding(op, p: Problem, lengths: Sequence[int]) -> list[CheckResult]:
    """A tail-padded batch (key_padding_mask) vs each sequence unpadded.

    Padded keys hold NaN, so a leak of a padded key into a valid row also shows. The
    backward compares gradients with a zero cotangent on padded rows.
    """
    b = len(lengths)
    s = p.seq_len
    q, k, v = random_qkv(p, batch=b)
    valid = jnp.arange(s)[None, :] < jnp.asarray(lengths)[:, None]
    nan = jnp.asarray(jnp.nan, k.dtype)
    k_pad = jnp.where(valid[:, None, :, None], k, nan)
    v_pad = jnp.where(valid[:, None, :, None], v, nan)
    fwd = _fwd(op, p.causal)
    out, lse = fwd(q, k_pad, v_pad, valid)
    do = normal(p.seed + 7, q.shape)
    do_pad = jnp.where(valid[:, None, :, None], do, 0.0)
    grads = _grads(op, p.causal)
    g = grads(q, k_pad, v_pad, do_pad, valid)
    fpairs, bpairs = [], []
    for i, n in enumerate(lengths):
        sl = (slice(i, i + 1), slice(None), slice(0, n))
        o1, l1 = fwd(q[sl], k[sl], v[sl])
        fpairs += [(o1, out[sl]), (l1, lse[sl[:3]])]
        g1 = grads(q[sl], k[sl], v[sl], do[sl], None)
        bpairs += [(a, b_[sl]) for a, b_ in zip(g1, g, strict=True)]
        # Padded keys get exactly zero dK and dV.
        zero_k = jnp.zeros_like(g[1][i:i + 1, :, n:])
        bpairs += [(g[1][i:i + 1, :, n:], zero_k), (g[2][i:i + 1, :, n:], zero_k)]
    return [_compare(f"tail padding {list(lengths)} vs unpadded", "forward", fpairs),
            _compare(f"tail padding {list(lengths)} vs unpadded", "backward", bpairs)]


def check_paged(op, p: Problem, page_sizes: Sequence[int], steps: Sequence[int],
                seed: int = 0, layouts: Sequence[str] = ("HND", "NHD")) -> list[CheckResult]:
    """Decode steps and a chunk read from a paged KV cache (shuffled page table, unused
    pages and slots full of NaN) vs the contiguous prefill rows, for every page size
    and page layout."""
    from jaxattn import paged, registry

    if "paged" not in registry.backend(op.backend).paths:
        return [CheckResult("paged KV vs contiguous", "forward", True,
                            f"backend {op.backend!r} has no paged KV path; not checked",
                            checked=False)]
    q, k, v = random_qkv(p)
    fwd = _fwd(op, True)
    out, lse = fwd(q, k, v)
    pairs = []
    rng = np.random.default_rng(seed)
    for ps in page_sizes:
        for layout in layouts:
            max_pages = -(-p.seq_len // ps)
            num_pages = p.batch * max_pages + 3
            table = jnp.asarray(rng.permutation(num_pages)[:p.batch * max_pages]
                                .reshape(p.batch, max_pages).astype(np.int32))
            shape = ((num_pages, ps, p.num_kv_heads, p.head_dim) if layout == "NHD"
                     else (num_pages, p.num_kv_heads, ps, p.head_dim))
            kp = jnp.full(shape, jnp.nan, k.dtype)
            vp = jnp.full(shape, jnp.nan, v.dtype)
            lens = jnp.zeros((p.batch,), jnp.int32)
            t0 = 0
            kw = dict(return_lse=True, backend=op.backend, layout=layout)
            for t in sorted(set(steps)):
                kp, vp, lens = paged.write(kp, vp, table, lens, k[:, :, t0:t + 1],
                                           v[:, :, t0:t + 1], layout=layout)
                t0 = t + 1
                o, l = paged.attention(q[:, :, t:t + 1], kp, vp, table, lens, **kw)
                pairs += [(o, out[:, :, t:t + 1]), (l, lse[:, :, t:t + 1])]
            # A chunk: the last min(37, t0) tokens written so far.
            c = min(37, t0)
            o, l = paged.attention(q[:, :, t0 - c:t0], kp, vp, table, lens, **kw)
            pairs += [(o, out[:, :, t0 - c:t0]), (l, lse[:, :, t0 - c:t0])]
    return [_compare(f"paged KV (pages {list(page_sizes)}, {'/'.join(layouts)}) vs "
                     f"contiguous", "forward", pairs)]


def check_cp(op, p: Problem, degrees: Sequence[int],
             chunk_sizes: Sequence[int | None] = (None, 64, 256, 1024),
             tolerance_chunks: Sequence[int] = (1000,)) -> list[CheckResult]:
    """CP at each degree whose shards are whole key blocks (``BLOCK_N``) for this
    sequence length, with each ``kv_chunk_size`` of ``chunk_sizes`` that is a multiple of
    ``BLOCK_N`` and cuts the shard (None: the whole shard), forward and backward, vs the
    single call in bits (context parallelism simulated on one device with the backend's
    partial states; a cut inside a SPLIT carries the kernels' running state). The
    ``tolerance_chunks`` (not multiples of ``BLOCK_N``) are compared within 2 bf16 ulps
    of the output's scale, forward only."""
    from jaxattn import cp, registry, schedule

    if op.backend not in registry.backend_names("cp_attention"):
        return [CheckResult("CP vs no CP", kind, True,
                            f"backend {op.backend!r} has no cp_attention path; not checked",
                            checked=False) for kind in ("forward", "backward")]
    q, k, v = random_qkv(p)
    do = normal(p.seed + 7, q.shape)
    bn = schedule.BLOCK_N
    aligned = [d for d in degrees if p.seq_len % (d * bn) == 0]
    if not aligned:
        return [CheckResult("CP vs no CP", kind, True,
                            f"no degree of {list(degrees)} gives shards of whole "
                            f"{bn}-key blocks at S={p.seq_len}; not checked", checked=False)
                for kind in ("forward", "backward")]

    def run(fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(do.astype(out.dtype))

    def cp_call(d, c):
        return lambda q, k, v: cp.forward(q, k, v, cp_world_size=d, kv_chunk_size=c,
                                          backend=op.backend)

    base, gbase = run(lambda q, k, v: op.forward(q, k, v))
    fpairs, bpairs, cases = [], [], []
    for d in aligned:
        shard = p.seq_len // d
        for c in chunk_sizes:
            if c is not None and (c % bn or c >= shard):
                continue  # off the block grid, or the whole shard (chunk None)
            out, g = run(cp_call(d, c))
            fpairs.append((out, base))
            bpairs += list(zip(g, gbase, strict=True))
            cases.append(f"{d}" if c is None else f"{d}x{c}")
    case = f"CP (degree x kv_chunk_size) {', '.join(cases)} vs no CP"
    results = [_compare(case, "forward", fpairs), _compare(case, "backward", bpairs)]
    scale = float(jnp.max(jnp.abs(base.astype(jnp.float32))))
    for d in aligned:
        for c in tolerance_chunks:
            if c >= p.seq_len // d:
                continue
            out = cp_call(d, c)(q, k, v)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - base.astype(jnp.float32))))
            bound = 2 * 2.0 ** -8 * scale
            results.append(CheckResult(
                f"CP degree {d} x kv_chunk_size {c} (cuts off the block grid) vs no CP",
                "tolerance", err <= bound and not bool(jnp.isnan(out).any()),
                f"max |diff| {err:.3g} (bound {bound:.3g})"))
    return results


def check_varlen(op, p: Problem, lengths: Sequence[int]) -> list[CheckResult]:
    """Sequences packed end to end (``jaxattn.varlen.attention``, FlashAttention's
    layout, NaN in the tokens past the last sequence) vs each sequence alone, forward and
    backward. With ``causal`` a further sequence is a chunk (its queries the last 40 of
    its keys: packed chunked prefill)."""
    from jaxattn import varlen

    be = op.backend_object
    if "varlen" not in be.paths:
        return [CheckResult("packed (varlen) vs alone", kind, True,
                            f"backend {op.backend!r} has no varlen path; not checked",
                            checked=False) for kind in ("forward", "backward")]
    lq = list(lengths) + ([40] if p.causal else [])
    lk = list(lengths) + ([p.seq_len] if p.causal else [])
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    rng = np.random.default_rng(p.seed + 11)
    tq, tk = int(cq[-1]) + 3, int(ck[-1]) + 2  # a NaN tail past the last sequence
    q = normal(rng, (tq, p.num_q_heads, p.head_dim), p.dtype, nan_from=int(cq[-1]))
    k, v = (normal(rng, (tk, p.num_kv_heads, p.head_dim), p.dtype, nan_from=int(ck[-1]))
            for _ in range(2))
    do = jnp.asarray(np.where(np.arange(tq)[:, None, None] < cq[-1],
                              rng.standard_normal(q.shape, dtype=np.float32), np.float32(0)))
    cu_q, cu_k = jnp.asarray(cq), jnp.asarray(ck)

    @jax.jit
    def packed(q, k, v, cu_q, cu_k):
        return varlen.attention(q, k, v, cu_q, cu_k, causal=p.causal, max_seqlen_q=max(lq),
                                max_seqlen_k=max(lk), return_lse=True, backend=be)

    (out, lse), vjp = jax.vjp(lambda q, k, v: packed(q, k, v, cu_q, cu_k), q, k, v)
    g = vjp((do.astype(out.dtype), jnp.zeros_like(lse)))
    fwd, grads = _fwd(op, p.causal), _grads(op, p.causal)
    bhsd = lambda x: jnp.swapaxes(x, 0, 1)[None]  # noqa: E731  [T, H, D] -> [1, H, T, D]
    fpairs, bpairs = [], []
    for n in range(len(lq)):
        a, b, c, e = (int(x) for x in (cq[n], cq[n + 1], ck[n], ck[n + 1]))
        if b == a:
            continue
        o1, l1 = fwd(bhsd(q[a:b]), bhsd(k[c:e]), bhsd(v[c:e]))
        fpairs += [(o1, bhsd(out[a:b])), (l1, lse[None, :, a:b])]
        g1 = grads(bhsd(q[a:b]), bhsd(k[c:e]), bhsd(v[c:e]), bhsd(do[a:b]), None)
        bpairs += [(g1[0], bhsd(g[0][a:b])), (g1[1], bhsd(g[1][c:e])),
                   (g1[2], bhsd(g[2][c:e]))]
    nan = bool(jnp.isnan(out[:cq[-1]].astype(jnp.float32)).any()) or any(
        bool(jnp.isnan(x.astype(jnp.float32)).any()) for x in g)
    case = f"packed (varlen) {lq} vs alone"
    res = [_compare(case, "forward", fpairs), _compare(case, "backward", bpairs)]
    if nan:
        res = [dataclasses.replace(r, equal=False, detail="NaN leaked from the padding")
               for r in res]
    return res


def check_left_padding(op, p: Problem, pads: Sequence[int]) -> list[CheckResult]:
    """A left-padded batch (``key_padding_mask`` False on each sequence's first ``pads[i]``
    keys, NaN there; with ``causal`` the queries padded alike, as Hugging Face
    ``generate`` builds its prompts) vs each sequence alone, forward and backward."""
    b, s = len(pads), p.seq_len
    q, k, v = random_qkv(p, batch=b)
    f = jnp.asarray(pads)
    valid = jnp.arange(s)[None, :] >= f[:, None]
    nan = jnp.asarray(jnp.nan, k.dtype)
    k_pad = jnp.where(valid[:, None, :, None], k, nan)
    v_pad = jnp.where(valid[:, None, :, None], v, nan)
    fwd, grads = _fwd(op, p.causal), _grads(op, p.causal)
    out, lse = fwd(q, k_pad, v_pad, valid)
    do = normal(p.seed + 7, q.shape)
    if p.causal:
        do = jnp.where(valid[:, None, :, None], do, 0.0)
    g = grads(q, k_pad, v_pad, do, valid)
    fpairs, bpairs = [], []
    for i, n in enumerate(pads):
        r0 = n if p.causal else 0  # the first real query row
        qs, ks = (slice(i, i + 1), slice(None), slice(r0, s)), (slice(i, i + 1), slice(None),
                                                                slice(n, s))
        o1, l1 = fwd(q[qs], k[ks], v[ks])
        fpairs += [(o1, out[qs]), (l1, lse[qs[:3]])]
        g1 = grads(q[qs], k[ks], v[ks], do[qs], None)
        bpairs += [(g1[0], g[0][qs]), (g1[1], g[1][ks]), (g1[2], g[2][ks])]
        zero_k = jnp.zeros_like(g[1][i:i + 1, :, :n])
        bpairs += [(g[1][i:i + 1, :, :n], zero_k), (g[2][i:i + 1, :, :n], zero_k)]
        if p.causal:  # padding query rows see no key: (0, -inf), zero gradient
            fpairs += [(out[i:i + 1, :, :n], jnp.zeros_like(out[i:i + 1, :, :n])),
                       (lse[i:i + 1, :, :n], jnp.full_like(lse[i:i + 1, :, :n], -jnp.inf))]
    case = f"left padding {list(pads)} vs alone"
    return [_compare(case, "forward", fpairs), _compare(case, "backward", bpairs)]


def check_jax_layout(op, p: Problem) -> list[CheckResult]:
    """``jaxattn.dot_product_attention`` on JAX's ``[B, S, H, D]`` (jax.nn's signature;
    read in place by the mosaic kernels) vs :func:`jaxattn.attention` on ``[B, H, S, D]``,
    forward and backward, with keys past ``key_value_seq_lengths`` NaN."""
    from jaxattn import nn

    q, k, v = random_qkv(p)
    s = p.seq_len
    lens = jnp.asarray([s if i % 2 == 0 else max(1, s - 37) for i in range(p.batch)],
                       jnp.int32)
    keep = jnp.arange(s)[None, :] < lens[:, None]
    nan = jnp.asarray(jnp.nan, k.dtype)
    k, v = (jnp.where(keep[:, None, :, None], x, nan) for x in (k, v))
    do = normal(p.seed + 11, q.shape)

    def t(x):
        return jnp.swapaxes(x, 1, 2)

    def drop_in(q, k, v):  # [B, H, S, D] in and out, [B, S, H, D] inside
        return t(nn.dot_product_attention(t(q), t(k), t(v), is_causal=p.causal,
                                          key_value_seq_lengths=lens,
                                          implementation=op.backend))

    def bhsd(q, k, v):
        return op.forward(q, k, v, causal=p.causal, key_padding_mask=keep)

    def run(f):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(do.astype(out.dtype))

    (o1, g1), (o2, g2) = jax.jit(lambda: run(drop_in))(), jax.jit(lambda: run(bhsd))()
    case = "JAX layout [B, S, H, D] vs [B, H, S, D]"
    return [_compare(case, "forward", [(o1, o2)]),
            _compare(case, "backward", list(zip(g1, g2, strict=True)))]


#: The rows :func:`run_matrix` checks, by name, in order.
ROWS: tuple[str, ...] = ("batch", "rerun", "chunked", "decode", "padding", "paged", "cp",
                         "varlen", "left padding", "jax layout")


def run_matrix(backend: str, p: Problem, *, chunk_sizes: Sequence[int],
               decode_steps: Sequence[int] | None, pad_lengths: Sequence[int],
               progress: Callable[[str], None] | None = None,
               rows: Sequence[str] = ROWS) -> list[CheckResult]:
    """Every row of the matrix that a single device can check (or the ``rows`` named,
    of :data:`ROWS`), for one backend. A row whose check raises is reported as not
    equal, with the exception, and the other rows still run."""
    unknown = set(rows) - set(ROWS)
    if unknown:
        raise ValueError(f"unknown matrix rows {sorted(unknown)}; rows: {', '.join(ROWS)}")
    op = get_op("attention", backend=backend)
    results: list[CheckResult] = []
    checks = {
        "batch": lambda: check_batch(op, p),
        "rerun": lambda: check_rerun(op, p),
        "chunked": lambda: check_chunked_prefill(op, p, chunk_sizes),
        "decode": lambda: check_decode(op, p, decode_steps),
        "padding": lambda: check_padding(op, p, pad_lengths),
        "paged": lambda: check_paged(op, p, [1, 8, 16, 32, 64, 128, 256], decode_steps or
                                     list(range(0, p.seq_len, max(1, p.seq_len // 8)))),
        "cp": lambda: check_cp(op, p, [1, 2, 4, 8]),
        "varlen": lambda: check_varlen(op, p, [p.seq_len, 1, 0, 37]),
        "left padding": lambda: check_left_padding(
            op, p, [f for f in (0, 37, 64) if f < p.seq_len]),
        "jax layout": lambda: check_jax_layout(op, p),
    }
    for name in rows:
        if progress:
            progress(f"[{backend}] {name}")
        try:
            results += checks[name]()
        except Exception as e:  # noqa: BLE001  (reported as a failed row)
            results.append(CheckResult(name, "forward", False,
                                       f"raised {type(e).__name__}: {str(e)[:300]}"))
    return results
