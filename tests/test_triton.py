"""Tests specific to the raw Triton backend (``backend="triton"``,
:mod:`jaxattn.backends.triton.launch`).

The parameterised battery of ``test_backends.py`` covers accuracy, gradients and the
invariance matrix. Here: what the backend does without its optional dependencies, its own
launch options (paths, tile heights, the whole-block fast path, per-sequence causal
offsets), the interpreter's bf16 rounding, and how its bits compare with the Pallas
backend's. On a CPU the kernels run in Triton's interpreter, on a GPU compiled through
jax-triton.
"""

from __future__ import annotations

import importlib.util as importlib_util
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    ON_GPU,
    assert_configs_keep_bits,
    assert_paths_agree,
    cpu_env,
    np_attention,
    rand,
    rand_qkv,
    rel_err,
    warps_stages_config,
)

import jaxattn
from jaxattn import invariance, reference, registry, schedule
from jaxattn.backends.pallas import backward as pv
from jaxattn.backends.pallas import forward as pt
from jaxattn.backends.triton import launch as tb
from jaxattn.invariance import bits_equal
from jaxattn.merge import fold

UNAVAILABLE = registry.backend("triton").available()
needs_triton = pytest.mark.skipif(UNAVAILABLE is not None,
                                  reason=f"backend 'triton' is unavailable: {UNAVAILABLE}")
TOL = {jnp.bfloat16: 3e-2, jnp.float16: 5e-3, jnp.float32: 1e-5}
GRAD_TOL = {jnp.bfloat16: 5e-2, jnp.float16: 1e-2, jnp.float32: 1e-4}
#: Cases run in CI (tests/conftest.py: the others with -m slow on the CPU, all of them
#: on the GPU battery; about 40 s of CI): the Triton interpreter runs the 16-bit dtypes'
#: kernels for bf16 (fp16's accuracy and fp32's bits beside Pallas on the GPU), and the
#: split path against prefill past one SPLIT causal (the non-causal case on the GPU).
CPU_CASES = {
    "test_accurate_against_forward_fp32_and_reference_gradients": ("bfloat16", "float32"),
    "test_split_parallel_and_prefill_paths_agree_in_bits": ("1-2118-True",),
    "test_bits_beside_the_pallas_backend": ("bfloat16",),
}


def _scale(q):
    return 1 / math.sqrt(q.shape[-1])


def _forward(q, k, v, mask=None, causal=True, **kw):
    return tb.forward(q, k, v, mask, causal=causal, scale=_scale(q), **kw)


def _verdict(a, b) -> str:
    """"bits equal", or how many elements differ and by how much (max |diff|)."""
    return "bits equal" if bits_equal(a, b) else f"differ: {invariance._mismatch(a, b)}"


# ----------------------------------------------------------- without the optional deps

def test_unavailable_without_triton_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # find_spec -> None, import fails
    reason = tb.unavailable_reason("cpu")
    assert reason is not None and "jaxattn[triton]" in reason
    assert registry.backend("triton").available() == reason
    with pytest.raises(RuntimeError, match=r"backend 'triton' is unavailable: .*triton"):
        jaxattn.get_op("attention", backend="triton")
    # Without triton the registry's choice is unchanged: mosaic on sm90, else pallas.
    mosaic = registry.backend("mosaic").available() is None
    gpu = "mosaic" if mosaic else "pallas"
    assert jaxattn.get_op("attention").backend == (gpu if ON_GPU else "reference")


def test_package_imports_without_triton_and_jax_triton():
    code = ("import sys; sys.modules['triton'] = None; sys.modules['jax_triton'] = None\n"
            "import jaxattn\n"
            "from jaxattn import registry\n"
            "print(registry.backend('triton').available())\n"
            "print(jaxattn.get_op('attention', backend='reference').backend)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=cpu_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "needs the triton package" in proc.stdout and "reference" in proc.stdout


# --------------------------------------------------------------------------- accuracy

@needs_triton
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_accurate_against_forward_fp32_and_reference_gradients(dtype):
    """Forward against ``reference.forward_fp32``, gradients (with a cotangent on lse too)
    against the reference's, with GQA, a padding mask and more than one query tile."""
    q, k, v = rand_qkv(2, 4, 2, 40, 140, 64, dtype)
    m = np.ones((2, 140), bool)
    m[0, 100:] = False
    m[1, :7] = False
    mask = jnp.asarray(m)
    op = jaxattn.get_op("attention", backend="triton")
    out, lse = jax.jit(lambda q, k, v: op.forward_with_lse(q, k, v, key_padding_mask=mask))(
        q, k, v)
    ref, ref_lse = reference.forward_fp32_with_lse(q, k, v, key_padding_mask=mask)
    assert out.dtype == dtype and rel_err(out, ref) < TOL[dtype]
    assert float(jnp.max(jnp.abs(lse - ref_lse))) < (1e-5 if dtype == jnp.float32 else 2e-2)

    w_out, w_lse = rand(q.shape), rand(q.shape[:3])

    def loss(fn, q, k, v):
        out, lse = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(lse * w_lse)

    got = jax.grad(lambda *a: loss(lambda q, k, v: op.forward_with_lse(
        q, k, v, key_padding_mask=mask), *a), (0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: loss(lambda q, k, v: reference.forward_fp32_with_lse(
        q, k, v, key_padding_mask=mask), *a), (0, 1, 2))(*(x.astype(jnp.float32)
                                                           for x in (q, k, v)))
    for name, g, w in zip("qkv", got, want, strict=True):
        assert g.dtype == dtype and rel_err(g, w) < GRAD_TOL[dtype], name
    for g in got[1:]:  # dropped keys get exactly zero dK and dV
        assert np.all(np.asarray(g, np.float32)[0, :, 100:] == 0)


@needs_triton
def test_per_sequence_causal_offsets():
    """Query 0 of sequence b sits at key position ``offsets[b]`` (the CP-shard form of
    the causal rule), forward and backward, against the reference at those positions."""
    b, sq, skv = 3, 30, 100
    q, k, v = rand_qkv(b, 4, 2, sq, skv, 64, jnp.float32)
    offsets = jnp.asarray([70, 5, -10], jnp.int32)
    q_pos = offsets[:, None] + jnp.arange(sq)[None, :]
    k_pos = jnp.broadcast_to(jnp.arange(skv), (b, skv))
    out, lse = _forward(q, k, v, None, True, causal_offsets=offsets)
    ref, ref_lse = np_attention(q, k, v, q_pos=np.asarray(q_pos), k_pos=np.asarray(k_pos))
    assert rel_err(out, ref) < 1e-5
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(ref_lse))
    assert np.all(np.asarray(out)[np.isneginf(ref_lse)] == 0)  # rows 0..9 of sequence 2
    do = rand(q.shape)
    got = tb.backward(q, k, v, None, out, lse, do, None, offsets, causal=True,
                      scale=_scale(q))
    want = jax.vjp(lambda q, k, v: reference.forward_fp32_with_lse(
        q, k, v, query_positions=q_pos, key_positions=k_pos)[0], q, k, v)[1](do)
    for g, w in zip(got, want, strict=True):
        assert not np.isnan(np.asarray(g)).any() and rel_err(g, w) < 1e-4


# -------------------------------------------------------- launch options keep the bits

@needs_triton
@pytest.mark.parametrize("sq,skv,causal", [(1, 2 * schedule.SPLIT + 70, True),
                                           (3, schedule.SPLIT + 1, False)])
def test_split_parallel_and_prefill_paths_agree_in_bits(sq, skv, causal):
    q, k, v = rand_qkv(2, 4, 2, sq, skv, 64, jnp.bfloat16)
    mask = jnp.asarray(np.random.default_rng(sq).uniform(size=(2, skv)) > 0.2)
    for m in (None, mask):
        assert_paths_agree(_forward, q, k, v, m, causal)


@pytest.mark.slow  # CI time (14 s): a launch choice, also run on the H200
@needs_triton
def test_tile_height_does_not_change_bits():
    """A row's bits do not depend on which other rows share its tile (on a CPU this
    checks the kernels' indexing; on a GPU also the matrix unit, DESIGN.md 4)."""
    q, k, v = rand_qkv(1, 8, 2, 30, 1100, 64, jnp.bfloat16, seed=11)
    assert_configs_keep_bits(_forward, q, k, v,
                             [pt.ForwardConfig(block_m=bm) for bm in (16, 32, 64, 128)])


@needs_triton
def test_whole_block_steps_give_the_masked_bits():
    """The unmasked fast path for blocks every row sees whole, forward and backward. The
    interpreter keeps the bits too (its dot does not see the masking), so unlike the
    Pallas interpret mode this runs on the CPU as well."""
    # CPU: one sequence, a GQA group of 2, 150 keys (two whole blocks and a partial one;
    # CI time: 26 s at B=2, Hq=4).
    q, k, v = rand_qkv(2, 8, 2, 700, 700, 128, jnp.bfloat16, seed=13) if ON_GPU else \
        rand_qkv(1, 2, 1, 150, 150, 64, jnp.bfloat16, seed=13)
    do = rand(q.shape, jnp.bfloat16, seed=14)
    for causal in (True, False):
        fast = _forward(q, k, v, causal=causal, config=pt.ForwardConfig(whole_blocks=True))
        slow = _forward(q, k, v, causal=causal, config=pt.ForwardConfig(whole_blocks=False))
        assert bits_equal(fast[0], slow[0]) and bits_equal(fast[1], slow[1]), causal
        grads = [tb.backward(q, k, v, None, *fast, do, None, causal=causal, scale=_scale(q),
                             config=pv.BackwardConfig(whole_blocks=w)) for w in (True, False)]
        for a, b in zip(*grads, strict=True):
            assert bits_equal(a, b), causal


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("warps,stages", [(4, 2), (8, 3), (4, 3)])
def test_warps_and_stages_do_not_change_bits(warps, stages):
    q, k, v = rand_qkv(2, 32, 8, 600, 2100, 128, jnp.bfloat16, seed=12)
    assert_configs_keep_bits(_forward, q, k, v, [warps_stages_config(warps, stages)])


@needs_triton
@pytest.mark.parametrize("base,rowsum", [("2", "mma"), ("e", "reduce")])
def test_schedule_variants_are_accurate_and_keep_decode_bits(base, rowsum):
    """The candidate schedule variants (schedule.SOFTMAX_EXP_BASE, schedule.ROWSUM) are
    honoured like in the Pallas kernels: accurate, decode rows equal prefill rows."""
    old = (schedule.SOFTMAX_EXP_BASE, schedule.ROWSUM)
    schedule.SOFTMAX_EXP_BASE, schedule.ROWSUM = base, rowsum
    jax.clear_caches()
    try:
        q, k, v = rand_qkv(1, 4, 2, 100, 100, 64, jnp.bfloat16)
        out, lse = _forward(q, k, v)
        ref, ref_lse = reference.forward_fp32_with_lse(q, k, v)
        assert rel_err(out, ref) < 3e-2 and float(jnp.max(jnp.abs(lse - ref_lse))) < 2e-2
        op = jaxattn.get_op("attention", backend="triton")
        p = invariance.Problem(batch=1, num_q_heads=4, num_kv_heads=2, seq_len=100,
                               head_dim=64)
        assert all(r.equal for r in invariance.check_decode(op, p, [0, 64, 99]))
    finally:
        schedule.SOFTMAX_EXP_BASE, schedule.ROWSUM = old
        jax.clear_caches()


# ------------------------------------------------------------------- bf16 and merge

@needs_triton
def test_bf16_output_is_rounded_to_nearest_even():
    """With one split the combine kernel's merge returns the split's fp32 state bit for
    bit, so the bf16 output is exactly that state rounded: XLA's round-to-nearest-even
    (the interpreter's own fp32 -> bf16 conversion truncates; the kernels avoid it)."""
    q, k, v = rand_qkv(2, 8, 2, 3, 300, 64, jnp.bfloat16, seed=21)
    o_parts, lse_parts = tb.split_partials(q, k, v, causal=True, scale=_scale(q))
    assert o_parts.shape[2] == 1
    out, lse = _forward(q, k, v, path="split")
    assert bits_equal(o_parts[:, :, 0].astype(jnp.bfloat16).reshape(q.shape), out)
    assert bits_equal(lse_parts[:, :, 0].reshape(lse.shape), lse)


@needs_triton
def test_in_kernel_merge_against_an_xla_fold_of_the_split_states():
    """The combine kernel's fold of the partial states against an XLA ``lax.scan`` of
    :func:`merge`. Bits are only promised within one backend; on a CPU the interpreter's
    exp/log are NumPy's and XLA's differ, so this asserts agreement to rounding and
    reports whether the bits are equal (on the GPU they compare jax-triton's Triton with
    XLA)."""
    q, k, v = rand_qkv(2, 4, 2, 3, 3 * schedule.SPLIT + 50, 64, jnp.float32, seed=15)
    o_parts, lse_parts = tb.split_partials(q, k, v, causal=True, scale=1 / 8)
    assert o_parts.shape[2] == 4

    o_xla, lse_xla = jax.jit(fold)(jnp.moveaxis(o_parts, 2, 0), jnp.moveaxis(lse_parts, 2, 0))
    out, lse = tb.forward(q, k, v, causal=True, scale=1 / 8, path="split")
    o_xla, lse_xla = o_xla.reshape(q.shape), lse_xla.reshape(lse.shape)
    print(f"in-kernel merge vs XLA fold: out {_verdict(o_xla, out)}; "
          f"lse {_verdict(lse_xla, lse)}")
    assert rel_err(out, o_xla) < 1e-6 and rel_err(lse, lse_xla) < 1e-6


# --------------------------------------------------------------- bits against Pallas

def _compare_with_pallas(q, k, v, do, *, causal, fusion) -> dict:
    interpret = not ON_GPU
    sc = _scale(q)
    a = tb.forward(q, k, v, causal=causal, scale=sc, enable_fp_fusion=fusion)
    b = pt.forward(q, k, v, causal=causal, scale=sc, interpret=interpret)
    ga = tb.backward(q, k, v, None, *a, do, None, causal=causal, scale=sc,
                     enable_fp_fusion=fusion)
    gb = pv.backward(q, k, v, None, *b, do, None, causal=causal, scale=sc,
                     interpret=interpret)
    names = ("out", "lse", "dq", "dk", "dv")
    pairs = list(zip((*a, *ga), (*b, *gb), strict=True))
    return {n: (_verdict(x, y), rel_err(x, y)) for n, (x, y) in zip(names, pairs, strict=True)}


@needs_triton
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_bits_beside_the_pallas_backend(dtype):
    """Measured, not promised (DESIGN.md 7: backends agree to tolerance). Both compile
    the same operations through Triton, so on the GPU they may agree in bits: this prints
    the verdict per output, with FMA contraction on and off in the raw Triton kernels
    (``pytest -rA`` shows it). On a CPU the Pallas kernels run on XLA:CPU and the Triton
    kernels in NumPy, so there the bits differ; the values agree to rounding."""
    q, k, v = rand_qkv(2, 8, 2, 300, 300, 128, dtype, seed=31) if ON_GPU else \
        rand_qkv(1, 4, 2, 150, 150, 64, dtype, seed=31)
    do = rand(q.shape, dtype, seed=32)
    for fusion in ((False, True) if ON_GPU else (tb.ENABLE_FP_FUSION,)):
        for causal in (True, False):
            res = _compare_with_pallas(q, k, v, do, causal=causal, fusion=fusion)
            print(f"{jnp.dtype(dtype).name} causal={causal} fp_fusion={fusion}: " + "; ".join(
                f"{n} {verdict}" for n, (verdict, _) in res.items()))
            for n, (_, err) in res.items():
                assert err < (1e-5 if dtype == jnp.float32 else 2e-2), (n, err)
            if ON_GPU and dtype == jnp.bfloat16 and not fusion:
                # Measured on the H200 (tb.ENABLE_FP_FUSION's note): without contraction
                # both backends compile to the same arithmetic.
                assert all(v == "bits equal" for v, _ in res.values()), res


# ------------------------------------------------------- the GPU code path, compiled

def _compile_for_sm90(name: str, arrays, scalars, outs, constexprs, *, ones=(),
                      num_warps=4, num_stages=3):
    """Compile a kernel for sm_90 as jax-triton would (pointers, then scalars, then output
    pointers, then constexprs; scalar arguments equal to 1 become constexprs), without a
    GPU: Triton's front end, its NVIDIA passes and the wheel's ptxas."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from jaxattn.backends.triton import kernels as tk

    kernel = getattr(tk, name)
    types = [f"*{t}" for t in arrays] + list(scalars) + [f"*{t}" for t in outs]
    signature = dict(zip(kernel.arg_names, types, strict=False))
    constexprs = dict(constexprs, INTERPRET=False, **{n: 1 for n in ones})
    signature.update({n: "constexpr" for n in constexprs})
    compiled = triton.compile(ASTSource(kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    return compiled.asm["ptx"]


@needs_triton
@pytest.mark.parametrize("dt,d", [("bf16", 128), pytest.param("fp32", 32,
                                                                 marks=pytest.mark.slow)])
def test_kernels_compile_for_sm90_without_a_gpu(dt, d, tmp_path, monkeypatch):
    """The compiled (non-interpreted) code path of every kernel, checked on a CPU: it
    goes through Triton's compiler down to a cubin for the H200, including the decode
    specialisations (q_len, kv_len, n_splits, scale equal to 1)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fp32 = dt == "fp32"
    fwd = dict(GROUP=4, HEAD_DIM=d, BLOCK_N=schedule.BLOCK_N,
               BLOCKS_PER_SPLIT=schedule.BLOCKS_PER_SPLIT, CAUSAL=True, HAS_MASK=False,
               HAS_OFFSETS=False, WHOLE_BLOCKS=True, EXP2=False, ROWSUM_MMA=True, IEEE=fp32)
    ins = [dt, dt, dt, "i32", "i32"]
    ptx = _compile_for_sm90("fwd_prefill_kernel", ins, ["fp32", "i32", "i32"], [dt, "fp32"],
                            dict(fwd, BLOCK_M=128), num_warps=8)
    _compile_for_sm90("fwd_prefill_kernel", ins, ["fp32", "i32", "i32"], [dt, "fp32"],
                      dict(fwd, BLOCK_M=16, HAS_MASK=True, HAS_OFFSETS=True),
                      ones=("scale", "q_len"))
    _compile_for_sm90("fwd_split_kernel", ins, ["fp32", "i32", "i32", "i32"],
                      ["fp32", "fp32"], dict(fwd, BLOCK_M=16),
                      ones=("scale", "q_len", "kv_len", "n_splits"))
    _compile_for_sm90("fwd_combine_kernel", ["fp32", "fp32"], ["i32", "i32"], [dt, "fp32"],
                      dict(HEAD_DIM=d, BLOCK_M=16), ones=("rows",), num_stages=1)
    _compile_for_sm90("bwd_delta_kernel", [dt, dt, "fp32"], ["i32"], ["fp32"],
                      dict(HEAD_DIM=d, BLOCK=64))
    bwd = dict(GROUP=4, HEAD_DIM=d, BLOCK_Q=64, BLOCK_KV=64, CAUSAL=True, HAS_MASK=False,
               HAS_OFFSETS=False, WHOLE_BLOCKS=True, IEEE=fp32)
    bwd_ins = [dt, dt, dt, dt, "fp32", "fp32", "i32", "i32"]
    _compile_for_sm90("bwd_dkdv_kernel", bwd_ins, ["fp32", "i32", "i32"], [dt, dt], bwd,
                      num_stages=2)
    _compile_for_sm90("bwd_dq_kernel", bwd_ins, ["fp32", "i32", "i32"], ["fp32"],
                      dict(bwd, HAS_MASK=True, HAS_OFFSETS=True), num_stages=2)
    # exp is libdevice's range-reduced __nv_expf (as the Pallas lowering emits), not the
    # bare `mul` + `ex2.approx` of Triton's own tl.exp.
    assert "fma.rn" in ptx and "ex2.approx" in ptx
    if not fp32:
        assert "wgmma" in ptx  # bf16 dots on the matrix unit


@needs_triton
def test_lowers_for_cuda_through_jax_triton_without_a_gpu(monkeypatch):
    """The GPU launch path end to end, short of the launch: ``jax_triton.triton_call``
    lowers forward, backward, mask and lse for CUDA (sm_90), with jaxlib's GPU launcher
    stubbed so jax-triton imports on a CPU. It compiles the kernels with the argument types
    jax-triton itself derives: a Python float would be typed fp64 there (the H200 failure
    "acc ... re-assigned to fp64"), so the backend must hand it fp32."""
    if importlib_util.find_spec("jax_triton") is None:
        pytest.skip("jax-triton is not installed")
    import jaxlib.gpu_triton as gpu_triton

    class _Launcher:
        def __init__(self, *args, **kwargs):
            self.args = args

        def to_proto(self, *args, **kwargs):
            return b""

    stubs = dict(get_compute_capability=lambda device: 90,
                 get_serialized_metadata=lambda *a: b"", TritonKernel=_Launcher,
                 TritonKernelCall=_Launcher, TritonAutotunedKernelCall=_Launcher,
                 create_array_parameter=lambda *a: a, create_scalar_parameter=lambda *a: a)
    for name, value in stubs.items():
        monkeypatch.setattr(gpu_triton, name, value, raising=False)
    before = set(sys.modules)
    launch = tb._launch
    monkeypatch.setattr(tb, "_launch", lambda *a, interpret, **kw: launch(
        *a, interpret=False, **kw))
    try:
        q = jax.ShapeDtypeStruct((2, 4, 70, 64), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((2, 2, 90, 64), jnp.bfloat16)
        mask = jax.ShapeDtypeStruct((2, 90), jnp.bool_)

        def fwd_bwd(q, k, v, m):
            f = lambda q, k, v: jaxattn.attention(q, k, v, causal=True, key_padding_mask=m,
                                                  return_lse=True, backend="triton")
            out, vjp = jax.vjp(f, q, k, v)
            return out, vjp(out)

        text = jax.jit(fwd_bwd).trace(q, kv, kv, mask).lower(
            lowering_platforms=("cuda",)).as_text()
        assert text.count("triton_kernel_call") >= 4, text[:2000]
    finally:
        for name in set(sys.modules) - before:
            if name.startswith("jax_triton"):
                del sys.modules[name]
