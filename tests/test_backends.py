"""One parameterised battery that every backend of "attention" runs.

A backend gets the whole battery by being listed in BACKENDS with its capabilities:
``follows_schedule`` backends promise every row of the invariance matrix (DESIGN.md 7);
the others promise the first two. On a CPU the Pallas kernels run in interpret mode
and the raw Triton kernels in Triton's interpreter, on a GPU natively: the same tests,
both places. A backend whose optional dependencies are missing is skipped with the
reason its ``available()`` gives.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, np_attention, rand, rand_qkv, rel_err
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxattn
from jaxattn import invariance, reference, registry, schedule
from jaxattn.invariance import bits_equal


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    name: str
    follows_schedule: bool
    #: Every head dim from 1 to this one is served (kernels pad it internally).
    max_head_dim: int | None = 256
    #: ``jaxattn.cp`` has a backend of this name (CP over this backend's partial states).
    cp: bool = True
    #: ``jaxattn.paged`` serves this backend.
    paged: bool = True
    #: Input dtypes it serves (others raise ValueError: checked below).
    dtypes: tuple[str, ...] = ("bfloat16", "float16", "float32")


BACKENDS = [
    BackendSpec("reference", follows_schedule=False, max_head_dim=None),
    BackendSpec("pallas", follows_schedule=True),
    BackendSpec("triton", follows_schedule=True, cp=False),
    # Mosaic GPU (sm90 only; skipped elsewhere with its reason); its fp32 calls run the
    # Pallas kernels (jaxattn/backends/mosaic/backend.py).
    BackendSpec("mosaic", follows_schedule=True),
]
#: CI time: on a CPU the triton backend runs in Triton's interpreter (the slowest of the
#: three); these rows of its battery run with -m slow there (the H200 battery runs them
#: natively, and the pallas kernels run every row on the CPU).
SLOW_ON_CPU = {"triton": {
    "test_tail_padding_vs_unpadded",
    "test_flags_and_padding_that_hide_no_key_keep_bits_in_one_block",
    "test_packed_varlen_vs_alone", "test_row_alone_vs_in_batch",
    "test_decode_past_one_split_with_padding_mask", "test_chunked_prefill_vs_full",
    # tests/test_triton.py checks the Triton kernels' accuracy, gradients and bits beside
    # the Pallas backend on the CPU; these rows of theirs run on the GPU (140 s of CI).
    "test_every_head_dim", "test_gradients_match_reference", "test_paged_kv_equals_contiguous",
    "test_decode_steps_vs_prefill", "test_gqa_and_fp32_invariance",
    # The Triton interpreter on a CPU is deterministic: run to run there shows nothing
    # the GPU battery does not (37 s of CI).
    "test_run_to_run"},
    # The reference backend is plain XLA, the same program on the CPU and the GPU: its
    # fp32 gradients, fp16 forward cases and every-head-dim rows run with -m slow here
    # (80 s of CI); test_head_dims and the bf16 rows keep it covered on the CPU.
    "reference": {"test_gradients_match_reference[float32]",
                  "test_forward_accuracy[float16]", "test_every_head_dim"},
    # The Pallas kernels in the interpreter (about 70 s of CI): fp16 runs bf16's kernels
    # (its forward cases here with -m slow; every_head_dim's D=80 keeps fp16 in CI),
    # fp32's gradients the same blocks as bf16's, and every_head_dim keeps a D padded to
    # 16, one to 128 and one to 256 (3, 80, 192; D=8, 96 and 256 on the GPU).
    "pallas": {"test_forward_accuracy[float16]", "test_gradients_match_reference[float32]",
               "test_every_head_dim[8]", "test_every_head_dim[96]",
               "test_every_head_dim[256]",
               # non-causal packing: tests/test_varlen.py's packings on pallas
               "test_packed_varlen_vs_alone[False]"}}
TOL = {jnp.bfloat16: 3e-2, jnp.float16: 5e-3, jnp.float32: 1e-5}
GRAD_TOL = {jnp.bfloat16: 5e-2, jnp.float16: 1e-2, jnp.float32: 1e-4}


def _unavailable(spec) -> str | None:
    """Why ``spec``'s backend cannot run in this process (e.g. an optional dependency is
    missing), or None."""
    return registry.backend(spec.name).available()


@pytest.fixture(params=BACKENDS, ids=lambda s: s.name)
def spec(request) -> BackendSpec:
    reason = _unavailable(request.param)
    if reason is not None:
        pytest.skip(f"backend {request.param.name!r} is unavailable: {reason}")
    return request.param


def _op(spec):
    return jaxattn.get_op("attention", backend=spec.name)


def _need_dtype(spec, dtype) -> None:
    """Skip (with the reason) where ``spec`` does not serve ``dtype``; the refusal
    itself is tested in test_unserved_calls_raise."""
    name = jnp.dtype(dtype).name
    if name not in spec.dtypes:
        pytest.skip(f"{spec.name} does not serve {name}")


def _fwd(spec, **kw):
    op = _op(spec)
    return jax.jit(lambda q, k, v, m=None: op.forward_with_lse(q, k, v, key_padding_mask=m,
                                                               **kw))


# ----------------------------------------------------------------------------- accuracy

@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sq,skv", [(70, 70), (1, 130), (33, 200), (100, 40)])
def test_forward_accuracy(spec, dtype, causal, sq, skv):
    _need_dtype(spec, dtype)
    q, k, v = rand_qkv(2, 4, 2, sq, skv, 64, dtype)
    out, lse = _fwd(spec, causal=causal)(q, k, v)
    ref_out, ref_lse = reference.forward_fp32_with_lse(q, k, v, causal=causal)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert rel_err(out, ref_out) < TOL[dtype]
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(np.asarray(ref_lse))
    assert np.max(np.abs(np.asarray(lse)[fin] - np.asarray(ref_lse)[fin])) < (
        1e-5 if dtype == jnp.float32 else 2e-2)


def test_forward_fp32_accuracy_against_float64(spec):
    _need_dtype(spec, jnp.float32)
    q, k, v = rand_qkv(1, 4, 1, 40, 90, 32)
    out, lse = _op(spec).forward_fp32_with_lse(q, k, v)
    ref_out, ref_lse = np_attention(q, k, v)
    assert out.dtype == jnp.float32
    assert rel_err(out, ref_out) < 1e-5


@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_head_dims(spec, d):
    q, k, v = rand_qkv(1, 2, 1, 20, 70, d, jnp.bfloat16)
    out = _op(spec)(q, k, v)
    assert rel_err(out, reference.forward_fp32(q, k, v)) < TOL[jnp.bfloat16]


@pytest.mark.parametrize("d,dtype", [(3, "float32"), (8, "bfloat16"), (80, "float16"),
                                     (96, "float32"), (192, "bfloat16"), (256, "float16")])
def test_every_head_dim(spec, d, dtype):
    """Any D from 1 to 256 (Phi-2's 80, Phi-3's 96, DeepSeek's 192 among them; each
    dtype at two of them, one padded to 16 or 128 and one to 256 or unpadded): out, lse
    and gradients within tolerance of the fp32 reference, with the scale of the real
    D; a decode row of a sequence alone equals its row in the batch's prefill, in bits
    (the kernels run zero-padded to a head dim they are compiled for; a given D always
    runs the same padded kernel)."""
    _need_dtype(spec, dtype)
    dt = jnp.dtype(dtype)
    q, k, v = rand_qkv(2, 4, 2, 70, 70, d, dt)
    op = _op(spec)

    def loss(q, k, v):
        out, lse = op.forward_with_lse(q, k, v)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse), (out, lse)

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(
        q, k, v)
    ref_out, ref_lse = reference.forward_fp32_with_lse(*f32)
    want = jax.grad(lambda q, k, v: jnp.sum(reference.forward_fp32(q, k, v)) + jnp.sum(
        reference.forward_fp32_with_lse(q, k, v)[1]), (0, 1, 2))(*f32)
    assert out.shape == q.shape and out.dtype == dt
    assert rel_err(out, ref_out) < TOL[dt.type], (dtype, d)
    assert float(jnp.max(jnp.abs(lse - ref_lse))) < (1e-5 if dt == jnp.float32 else 2e-2)
    for name, g, w in zip("qkv", grads, want, strict=True):
        assert g.shape == w.shape and not np.isnan(np.asarray(g, np.float32)).any()
        assert rel_err(g, w) < GRAD_TOL[dt.type], (dtype, d, name)
    if not spec.follows_schedule:
        return
    fwd = _fwd(spec, causal=True)
    out, lse = fwd(q, k, v)
    o1, l1 = fwd(q[1:, :, 69:], k[1:], v[1:])
    assert bits_equal(o1, out[1:, :, 69:]) and bits_equal(l1, lse[1:, :, 69:]), dtype


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (6, 3), (8, 1)])
def test_gqa_groups(spec, hq, hkv):
    q, k, v = rand_qkv(2, hq, hkv, 9, 75, 64, jnp.bfloat16)
    out = _op(spec)(q, k, v)
    ref = np_attention(q, k, v)[0]
    assert rel_err(out, ref) < TOL[jnp.bfloat16]
    # Head h must read KV head h // g.
    g = hq // hkv
    h = hq - 1
    one = _op(spec)(q[:, h:h + 1], k[:, h // g:h // g + 1], v[:, h // g:h // g + 1])
    assert rel_err(one[:, 0], ref[:, h]) < TOL[jnp.bfloat16]


@pytest.mark.parametrize("dt", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("scale", [None, 0.0, 0.05, 1.3])
def test_scale(spec, scale, dt):
    _need_dtype(spec, dt)
    q, k, v = rand_qkv(1, 2, 1, 16, 80, 64, dt)
    out = _op(spec)(q, k, v, scale=scale)
    assert rel_err(out, np_attention(q, k, v, scale=scale)[0]) < TOL[dt]


def test_padding_mask_and_rows_with_no_visible_key(spec):
    b, s = 3, 90
    q, k, v = rand_qkv(b, 4, 2, s, s, 64, jnp.bfloat16)
    mask = np.ones((b, s), bool)
    mask[0, 60:] = False
    mask[1, :5] = False          # causal rows 0..4 of batch 1 see nothing
    mask[2, :] = False           # batch 2 sees nothing
    mask[1, 40:47] = False
    out, lse = _fwd(spec, causal=True)(q, k, v, jnp.asarray(mask))
    ref_out, ref_lse = np_attention(q, k, v, mask=mask)
    assert rel_err(out, ref_out) < TOL[jnp.bfloat16]
    empty = np.isneginf(ref_lse)
    assert empty[1, :, :5].all() and empty[2].all()
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), empty)
    assert np.all(np.asarray(out, np.float32)[empty] == 0)
    assert not np.isnan(np.asarray(out, np.float32)).any()


def test_empty_kv_and_single_query(spec):
    q, k, v = rand_qkv(2, 4, 2, 5, 0, 64, jnp.bfloat16)
    for causal in (True, False):  # no keys, with and without a (then empty) key mask
        for mask in (None, jnp.ones((2, 0), jnp.bool_)):
            out, lse = _fwd(spec, causal=causal)(q, k, v, mask)
            assert np.all(np.asarray(out, np.float32) == 0), (causal, mask)
            assert np.isneginf(np.asarray(lse)).all(), (causal, mask)
    q, k, v = rand_qkv(2, 4, 2, 1, 1, 64, jnp.bfloat16)
    out = _op(spec)(q, k, v)
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.repeat(np.asarray(v, np.float32), 2, axis=1), rtol=1e-2)


def test_nan_in_padded_keys_does_not_leak(spec):
    b, s = 2, 100
    q, k, v = rand_qkv(b, 4, 2, s, s, 64, jnp.bfloat16)
    lengths = np.array([100, 37])
    mask = np.arange(s)[None] < lengths[:, None]
    pad = ~mask[:, None, :, None]
    k_nan = jnp.where(pad, jnp.nan, k).astype(k.dtype)
    v_nan = jnp.where(pad, jnp.inf, v).astype(v.dtype)
    out, lse = _fwd(spec, causal=False)(q, k_nan, v_nan, jnp.asarray(mask))
    ref = np_attention(q, k, v, causal=False, mask=mask)[0]
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert not np.isnan(np.asarray(lse)).any()
    assert rel_err(out, ref) < TOL[jnp.bfloat16]


def test_inputs_not_mutated(spec):
    q, k, v = rand_qkv(1, 2, 1, 20, 20, 64, jnp.bfloat16)
    copies = [np.array(x) for x in (q, k, v)]
    jax.grad(lambda q, k, v: _op(spec)(q, k, v).astype(jnp.float32).sum(), (0, 1, 2))(q, k, v)
    assert all(bits_equal(x, c) for x, c in zip((q, k, v), copies, strict=True))


def test_unserved_calls_raise(spec):
    """A dtype or head dim the backend does not serve raises ValueError with the reason
    (never a silent hand-off to another backend)."""
    unserved = [(jnp.dtype(d), 64) for d in ("bfloat16", "float16", "float32")
                if jnp.dtype(d).name not in spec.dtypes]
    if spec.max_head_dim is not None:
        unserved.append((jnp.dtype(jnp.bfloat16), spec.max_head_dim + 1))
    if not unserved:
        pytest.skip(f"{spec.name} serves every dtype and head dim of the battery")
    for dt, d in unserved:
        q, k, v = rand_qkv(1, 2, 1, 8, 8, d, dt)
        with pytest.raises(ValueError, match=spec.name):
            _op(spec)(q, k, v)


# ---------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("causal,sq,skv,masked", [(True, 70, 70, False), (True, 20, 130, True),
                                                 (False, 50, 33, True), (True, 90, 40, False)])
def test_gradients_match_reference(spec, dtype, causal, sq, skv, masked):
    _need_dtype(spec, dtype)
    q, k, v = rand_qkv(2, 4, 2, sq, skv, 64, dtype)
    mask = None
    if masked:
        m = np.ones((2, skv), bool)
        m[0, skv // 2:] = False
        m[1, :3] = False
        mask = jnp.asarray(m)
    w_out = rand(q.shape)
    w_lse = rand(q.shape[:3])
    op = _op(spec)

    def loss(fn, q, k, v):
        out, lse = fn(q, k, v)
        lse = jnp.where(jnp.isneginf(lse), 0.0, lse)
        return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(lse * w_lse)

    got = jax.grad(lambda *a: loss(lambda q, k, v: op.forward_with_lse(
        q, k, v, causal=causal, key_padding_mask=mask), *a), (0, 1, 2))(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = jax.grad(lambda *a: loss(lambda q, k, v: reference.forward_fp32_with_lse(
        q, k, v, causal=causal, key_padding_mask=mask), *a), (0, 1, 2))(*f32)
    for name, g, w in zip("qkv", got, want, strict=True):
        assert g.dtype == dtype, name
        assert not np.isnan(np.asarray(g, np.float32)).any(), name
        assert rel_err(g, w) < GRAD_TOL[dtype], name
    if masked:  # padded keys get exactly zero dK and dV
        for g in got[1:]:
            assert np.all(np.asarray(g, np.float32)[0, :, skv // 2:] == 0)


def test_rows_with_no_visible_key_get_zero_gradients(spec):
    q, k, v = rand_qkv(1, 2, 1, 40, 10, 64, jnp.bfloat16)  # offset -30: rows 0..29 empty
    g = jax.grad(lambda q, k, v: _op(spec)(q, k, v).astype(jnp.float32).sum() * 1.0,
                 (0, 1, 2))(q, k, v)
    assert all(not np.isnan(np.asarray(x, np.float32)).any() for x in g)
    assert np.all(np.asarray(g[0], np.float32)[:, :, :30] == 0)


# --------------------------------------------------------------------- invariance matrix

PROBLEM = invariance.Problem(batch=3, num_q_heads=4, num_kv_heads=2, seq_len=150,
                             head_dim=64, dtype="bfloat16")


def _assert_all(results, promised=True):
    for r in results:
        if promised:
            assert r.equal, f"{r.case} [{r.kind}]: {r.detail}"


def test_row_alone_vs_in_batch(spec):
    fwd, bwd = invariance.check_batch(_op(spec), PROBLEM)
    _assert_all([fwd])
    if spec.name == "reference" and ON_GPU and not bwd.equal:
        # Known gap, measured on the H200 (2026-11-29, JAX 0.11.2): XLA compiles the
        # reference's gradient differently with the batch size even though every
        # sequence runs in its own loop trip. The kernel backends keep this promise.
        pytest.xfail(f"reference backward on GPU is not batch-invariant: {bwd.detail}")
    _assert_all([bwd])


def test_run_to_run(spec):
    _assert_all(invariance.check_rerun(_op(spec), PROBLEM))


def test_chunked_prefill_vs_full(spec):
    if not spec.follows_schedule:
        pytest.skip("not promised by this backend")
    # 37: chunk edges off the block grid; 100: a chunk that spans a block edge.
    _assert_all(invariance.check_chunked_prefill(_op(spec), PROBLEM, [37, 100]))


def test_decode_steps_vs_prefill(spec):
    if not spec.follows_schedule:
        pytest.skip("not promised by this backend")
    # The first key, both sides of each block edge, the last row (CI time: six steps on
    # the CPU; the bridge's decode test runs 140 against the prefill's rows on pallas).
    steps = ([0, 1, 62, 63, 64, 65, 100, 127, 128, 149] if ON_GPU
             else [0, 63, 64, 127, 128, 149])
    _assert_all(invariance.check_decode(_op(spec), PROBLEM, steps))


def test_tail_padding_vs_unpadded(spec):
    if not spec.follows_schedule:
        pytest.skip("not promised by this backend")
    _assert_all(invariance.check_padding(_op(spec), PROBLEM, [150, 64, 1]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gqa_and_fp32_invariance(spec, dtype):
    if not spec.follows_schedule:
        pytest.skip("not promised by this backend")
    _need_dtype(spec, dtype)
    p = dataclasses.replace(PROBLEM, num_q_heads=8, num_kv_heads=1, dtype=dtype,
                            seq_len=80)
    _assert_all(invariance.check_decode(_op(spec), p, [0, 40, 79]))
    _assert_all(invariance.check_chunked_prefill(_op(spec), p, [50]))


#: XLA:CPU's own defaults (a process without the suite's fast-compile flags of
#: conftest.py): what a user's interpret-mode call compiles with. XLA fuses differently
#: there, so a kernel whose loop structure depends on a flag shows it only here.
XLA_DEFAULT_OPT = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False}


def _compiled(fn, *args):
    """``fn`` jitted and compiled at XLA's default optimisation level on a CPU (as the
    suite's conftest flags would not), natively elsewhere; then called on ``args``."""
    lowered = jax.jit(fn).lower(*args)
    opts = XLA_DEFAULT_OPT if jax.default_backend() == "cpu" else None
    return lowered.compile(compiler_options=opts)(*args)


# bf16 stands for the 16-bit dtypes (fp16 runs the same kernels); fp32 is where the
# one-block bits once differed (CI time: fp32 and the whole block, 64 keys, with -m
# slow; the H200 battery runs every case).
@pytest.mark.parametrize("dtype,skv", [("bfloat16", 40),
                                       pytest.param("float32", 40, marks=pytest.mark.slow),
                                       pytest.param("bfloat16", 64, marks=pytest.mark.slow)])
def test_flags_and_padding_that_hide_no_key_keep_bits_in_one_block(spec, dtype, skv):
    """The matrix's row "a flag or padding that hides no key changes no bit", where all
    the keys fit one BLOCK_N block (fp32 on the Pallas kernels once computed other bits
    there without causal, at XLA's default optimisation level): a decode row with and
    without ``causal``; an all-True mask and no mask; keys tail-padded with NaN to a whole
    block and masked vs the unpadded call. Forward (out, lse) compiled at XLA's default
    optimisation level on a CPU (where its fusion showed the difference) and at the
    suite's; gradients at the suite's. 40 keys: a partial block (and the padding case);
    64: one whole block."""
    if not spec.follows_schedule:
        pytest.skip("not promised by this backend")
    _need_dtype(spec, dtype)
    dt = jnp.dtype(dtype)
    q, k, v = rand_qkv(2, 8, 2, 1, skv, 64, dt)
    do = rand(q.shape, dt)
    op = _op(spec)
    pad = schedule.BLOCK_N - skv
    nan = jnp.full((*k.shape[:2], pad, k.shape[3]), jnp.nan, dt)
    padded = tuple(jnp.concatenate([x, nan], axis=2) for x in (k, v))
    keep = jnp.broadcast_to(jnp.arange(schedule.BLOCK_N) < skv, (2, schedule.BLOCK_N))
    # (name, causal, keys and values, mask): each hides no key of the base call.
    cases = [("causal=False", False, (k, v), None),
             ("all-True mask", True, (k, v), jnp.ones((2, skv), bool))]
    if pad:
        cases.append(("NaN tail padding to one block, causal=False", False, padded, keep))

    def forward(causal, m):
        return lambda q, kk, vv: op.forward_with_lse(q, kk, vv, causal=causal,
                                                     key_padding_mask=m)

    def grads(causal, m):
        def loss(q, kk, vv):
            out = op.forward(q, kk, vv, causal=causal, key_padding_mask=m)
            return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
        return jax.jit(lambda q, kk, vv: [g[:, :, :skv] if i else g for i, g in enumerate(
            jax.grad(loss, (0, 1, 2))(q, kk, vv))])

    base_fwd = _compiled(forward(True, None), q, k, v)
    base_fwd_suite = jax.jit(forward(True, None))(q, k, v)
    base_grads = grads(True, None)(q, k, v)
    for case, causal, (kk, vv), m in cases:
        got = [("forward (XLA's default optimisation)", base_fwd,
                _compiled(forward(causal, m), q, kk, vv)),
               ("forward", base_fwd_suite, jax.jit(forward(causal, m))(q, kk, vv)),
               ("gradients", base_grads, grads(causal, m)(q, kk, vv))]
        for what, want, have in got:
            for a, b in zip(want, have, strict=True):
                assert not np.isnan(np.asarray(b, np.float32)).any(), (case, what)
                assert bits_equal(a, b), f"{case}, {what}: {invariance._mismatch(a, b)}"


def test_cp_degrees_in_the_matrix(spec):
    """The matrix's CP row: degrees 1, 2 and 4 over 256 keys (shards of 64 keys at
    degree 4 cut the splits: SPLIT shrunk to 128 keys so the shapes stay small;
    restored afterwards) equal the single call in bits, forward and backward. (Chunks
    that cut splits: tests/test_cp.py; the row's chunk sizes and its tolerance chunks
    run on the H200 through ``python -m jaxattn.check``.)"""
    if not spec.follows_schedule:
        pytest.skip("not promised by this backend")
    if not spec.cp:
        pytest.skip(f"jaxattn.cp has no {spec.name!r} backend (no CP over its partial states)")
    from jaxattn import schedule
    old = (schedule.SPLIT, schedule.BLOCKS_PER_SPLIT)
    schedule.SPLIT, schedule.BLOCKS_PER_SPLIT = 128, 128 // schedule.BLOCK_N
    jax.clear_caches()
    try:
        p = dataclasses.replace(PROBLEM, seq_len=256, batch=1)
        res = invariance.check_cp(_op(spec), p, [1, 2, 4, 8], chunk_sizes=(None,),
                                  tolerance_chunks=())
        assert all(r.checked for r in res) and len(res) == 2
        assert "degree x kv_chunk_size) 1, 2, 4 vs" in res[0].case
        _assert_all(res)
    finally:
        schedule.SPLIT, schedule.BLOCKS_PER_SPLIT = old
        jax.clear_caches()


def test_paged_kv_equals_contiguous(spec):
    """The matrix's paged row: decode and chunks against a paged cache (any page table;
    pages of 16 keys, four to a block, and of 64; both layouts) equal contiguous KV in
    bits (pallas reads pages in place; triton and mosaic gather them)."""
    if not spec.follows_schedule:
        pytest.skip("not promised by this backend")
    if not spec.paged:
        pytest.skip(f"jaxattn.paged does not serve {spec.name!r}")
    p = dataclasses.replace(PROBLEM, batch=2, seq_len=150)
    _assert_all(invariance.check_paged(_op(spec), p, [16, 64], steps=[0, 63, 64, 149]))


@pytest.mark.parametrize("causal", [True, False])
def test_packed_varlen_vs_alone(spec, causal):
    """The matrix's varlen row: sequences packed end to end (an empty one, one token, a
    start off the block grid, and with causal a chunk: packed chunked prefill) equal each
    sequence alone in bits, forward and backward."""
    if not spec.follows_schedule:
        pytest.skip("not promised by this backend")
    if not causal and spec.name == "triton" and not ON_GPU:
        pytest.skip("CI time: the layout is the interface's default, checked without causal "
                    "on the Pallas kernels; on a GPU every backend runs it")
    p = dataclasses.replace(PROBLEM, batch=1, seq_len=70, causal=causal)
    _assert_all(invariance.check_varlen(_op(spec), p, [70, 1, 0, 37]))


def test_left_padding_vs_alone(spec):
    """The matrix's left-padding row: a left-padded batch (queries padded alike) equals
    each sequence alone in bits, forward and backward; the padding rows are (0, -inf)."""
    if not spec.follows_schedule:
        pytest.skip("not promised by this backend")
    p = dataclasses.replace(PROBLEM, batch=1, seq_len=100)
    # 37: off the block grid; 64: a whole block of padding queries (36 real rows).
    _assert_all(invariance.check_left_padding(_op(spec), p, [37, 64]))


def test_decode_past_one_split_with_padding_mask(spec):
    """Decode over more than one SPLIT (split-parallel path) with a padding mask."""
    if not spec.follows_schedule:
        pytest.skip("not promised by this backend")
    s = jaxattn.SPLIT + 100
    q, k, v = rand_qkv(1, 4, 2, s, s, 64, jnp.bfloat16)
    mask = jnp.asarray(np.arange(s) % 11 != 3)[None]
    fwd = _fwd(spec, causal=True)
    out, lse = fwd(q, k, v, mask)
    for t in (jaxattn.SPLIT - 1, jaxattn.SPLIT, s - 1):
        o, l = fwd(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], mask[:, :t + 1])
        assert bits_equal(o, out[:, :, t:t + 1]) and bits_equal(l, lse[:, :, t:t + 1]), t


# ------------------------------------------------------------------------- properties

@settings(max_examples=5 if not ON_GPU else 25, deadline=None,  # (CI time: 5 on the CPU)
          suppress_health_check=[HealthCheck.too_slow])
@given(b=st.integers(1, 2), hkv=st.integers(1, 2), g=st.sampled_from([1, 2, 4]),
       sq=st.integers(1, 80), extra=st.integers(-20, 90), causal=st.booleans(),
       dtype=st.sampled_from(["bfloat16", "float16", "float32"]), masked=st.booleans(),
       seed=st.integers(0, 2**16))
def test_property_against_reference(b, hkv, g, sq, extra, causal, dtype, masked, seed):
    skv = max(0, sq + extra)
    dt = jnp.dtype(dtype)
    q, k, v = rand_qkv(b, hkv * g, hkv, sq, skv, 64, dt, seed=seed)
    mask = None
    if masked:
        mask = jnp.asarray(np.random.default_rng(seed + 1).uniform(size=(b, skv)) > 0.3)
    for spec in BACKENDS:
        if _unavailable(spec) is not None or dt.name not in spec.dtypes:
            continue
        out, lse = _fwd(spec, causal=causal)(q, k, v, mask)
        ref, ref_lse = np_attention(q, k, v, causal=causal,
                                    mask=None if mask is None else np.asarray(mask))
        out32 = np.asarray(out, np.float32)
        assert not np.isnan(out32).any() and not np.isnan(np.asarray(lse)).any()
        empty = np.isneginf(ref_lse)
        np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), empty)
        assert np.all(out32[empty] == 0)
        if not empty.all():
            assert rel_err(out, ref) < TOL[dt.type], spec.name
