"""The Mosaic GPU (Hopper) backward prototype, jaxattn/backends/mosaic/backward.py.

On a CPU: the kernels (delta, dK/dV, dQ) run in Mosaic GPU interpret mode and are
lowered for CUDA without a GPU. Gradients are checked against ``jax.vjp`` of
``reference.forward_fp32`` and against the Pallas Triton backend (``backend="pallas"``,
interpret mode). Everything skips, with the reason, when the installed JAX lacks the
interpret mode or an API the prototype needs.
"""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mosaic_support import (
    bits,
    dropped_nan,
    missing_api,
    missing_interpret,
    needs_threads,
)

import jaxattn
from jaxattn import reference
from jaxattn.invariance import normal


def _missing_api() -> str | None:
    return missing_api(("load", "Layout"))


def _missing_interpret() -> str | None:
    return missing_interpret(("load", "Layout"))


def _missing_callbacks() -> str | None:
    if (why := _missing_interpret()) is not None:
        return why
    try:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    except ImportError as e:  # pragma: no cover - depends on the JAX version
        return f"no Mosaic GPU interpreter callbacks module: {e}"
    if "np.matmul(a, b" not in inspect.getsource(gpu_callbacks.wgmma):
        return ("the interpreter's wgmma no longer calls np.matmul (the Triton substitute "
                "would not match it)")
    return None


needs_api = pytest.mark.skipif(_missing_api() is not None, reason=str(_missing_api()))
needs_interpret = pytest.mark.skipif(_missing_interpret() is not None,
                                     reason=str(_missing_interpret()))
needs_callbacks = pytest.mark.skipif(_missing_callbacks() is not None,
                                     reason=str(_missing_callbacks()))


@pytest.fixture
def mosaic_bwd():
    from jaxattn.backends.mosaic import backward as mosaic_bwd
    try:
        yield mosaic_bwd
    finally:
        # After an exception inside an interpreted kernel the interpreter must be reset
        # before the next one; harmless otherwise.
        try:
            mosaic_bwd.reset_interpret_state()
        except Exception:  # pragma: no cover
            pass


#: The lowering checks' cases run in CI (tests/conftest.py: the others with -m slow on
#: the CPU, all of them on the GPU battery): one of each kernel and launch family.
CPU_CASES = {
    "test_lowers_for_cuda_without_gpu": ("64-True-lane", "128-False-warpgroup"),
    "test_dkdv_options_lower": ("default", "accumulate=inplace-dkdv_wgs=1",
                                "mask=scores-exp2=False-dq_wgs=2",
                                "split_dkdv=True-dv_wgs=2-dk_wgs=2"),
    "test_head_dim_256_lowers_for_cuda": ("False",),
    "test_dq_pair_lowers_for_cuda": ("256",),
    "test_tails_and_key_mask_lower": ("True-default", "False-mask=scores-exp2=False"),
}

def _inputs(b, hq, hkv, sq, skv, d, dtype=jnp.bfloat16):
    seed = int(np.random.SeedSequence().generate_state(1)[0])
    rng = np.random.default_rng(seed)
    q, k, v, do = (normal(rng, (b, h, s, d), dtype)
                   for h, s in ((hq, sq), (hkv, skv), (hkv, skv), (hq, sq)))
    for x in (q, k, v, do):
        assert np.abs(np.asarray(x, np.float32)).max() > 0.0
    return seed, q, k, v, do


def _triton(q, k, v, do, causal):
    """(out, lse) of the Pallas Triton forward and its gradients (interpret mode)."""
    out, lse = jaxattn.attention(q, k, v, causal=causal, return_lse=True, backend="pallas")
    f = lambda q, k, v: jaxattn.attention(q, k, v, causal=causal, backend="pallas")  # noqa: E731
    _, vjp = jax.vjp(f, q, k, v)
    return out, lse, vjp(do)


def _mosaic(mb, q, k, v, out, lse, do, causal, config=None):
    # One dK/dV and one dQ warpgroup unless a test asks for two: interpret-mode kernels
    # with three warpgroups deadlock the interpreter on 2 cores more often
    # (docs/mosaic.md); the bits are the same (test_interpret_dkdv_two_warpgroups_keep_
    # bits here, and for both kernels mosaic_gpu_check on the H200).
    config = config or mb.BwdConfig(dkdv_wgs=1, dq_wgs=1)
    return mb.backward(q, k, v, out, lse, do, causal=causal, interpret=True, config=config)


# (B, Hq, Hkv, Sq, Skv, D, causal): GQA (2 query heads per KV head) with two query and
# two KV blocks across the diagonal; Sq > Skv (the first 64 rows see no key: zero dq,
# and they must add nothing to dk/dv) with D=128; a chunk of 64 queries against 192
# keys (causal offset 128); non-causal, two batches.
_CASES = [
    (1, 2, 1, 128, 128, 64, True),
    (1, 1, 1, 128, 64, 128, True),
    (1, 1, 1, 64, 192, 128, True),
    (2, 1, 1, 64, 128, 64, False),
]
_ids = lambda c: "B{}-Hq{}-Hkv{}-Sq{}-Skv{}-D{}-c{}".format(*c)  # noqa: E731


# CI time: the two middle cases (about 22 s) run with -m slow; the causal offsets and
# rows that see no key run in the default battery through test_mosaic_backend's wrapper
# and btnh tests, and natively on the H200.
@needs_threads
@needs_interpret
@pytest.mark.parametrize("case", [c if i in (0, 3) else pytest.param(c, marks=pytest.mark.slow)
                                  for i, c in enumerate(_CASES)], ids=_ids)
def test_interpret_backward_accuracy(mosaic_bwd, case):
    b, hq, hkv, sq, skv, d, causal = case
    seed, q, k, v, do = _inputs(b, hq, hkv, sq, skv, d)
    out, lse, grads_t = _triton(q, k, v, do, causal)
    grads = _mosaic(mosaic_bwd, q, k, v, out, lse, do, causal)
    f = lambda q, k, v: reference.forward_fp32(q, k, v, causal=causal)  # noqa: E731
    _, vjp = jax.vjp(f, q, k, v)
    grads_ref = vjp(do.astype(jnp.float32))
    for name, g, gt, gr, x in zip("qkv", grads, grads_t, grads_ref, (q, k, v), strict=True):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        g32 = np.asarray(g.astype(jnp.float32))
        gr = np.asarray(gr)
        assert not np.isnan(g32).any(), f"d{name}: NaN (seed {seed})"
        err = np.max(np.abs(g32 - gr)) / np.max(np.abs(gr))
        assert err < 2e-2, f"d{name}: max|g-ref|/max|ref| = {err:.3g} (seed {seed})"
        # The interpreter's wgmma is np.matmul, the Triton interpreter's dot is XLA's:
        # their fp32 sums round differently, so a few bf16 elements may differ by about
        # one ulp of the tensor's scale (see test_bits_equal_triton_with_same_products).
        gt32 = np.asarray(gt.astype(jnp.float32))
        diff = np.max(np.abs(g32 - gt32)) / np.max(np.abs(gt32))
        assert diff < 1e-2, f"d{name}: max|g-triton|/max|triton| = {diff:.3g} (seed {seed})"
    if causal and sq > skv:
        empty = sq - skv  # rows i < Sq - Skv see no key
        assert np.all(np.asarray(grads[0])[:, :, :empty] == 0), f"seed {seed}"
        assert np.all(np.asarray(lse)[:, :, :empty] == -np.inf)
    # The dQ kernel scales and casts in its epilogue: the bits of the fp32 accumulator
    # scaled and cast in XLA, as the backward computed them before.
    cfg = mosaic_bwd.BwdConfig(dkdv_wgs=1, dq_wgs=1)
    acc = mosaic_bwd.dq_accumulate(q, k, v, do, lse, mosaic_bwd.delta(out, do, interpret=True),
                                   causal=causal, scale=1.0 / math.sqrt(d), interpret=True,
                                   config=cfg)
    assert acc.dtype == jnp.float32
    np.testing.assert_array_equal(bits(grads[0]),
                                  bits((acc * (1.0 / math.sqrt(d))).astype(q.dtype)),
                                  err_msg=f"seed {seed}")


@pytest.fixture
def triton_numpy_dot():
    """Make the Triton backward's tile products (``pallas_triton_vjp.dot``) run as
    ``np.matmul`` on the host, as the Mosaic GPU interpreter's wgmma does; restored
    afterwards. (The other way round, XLA's dot inside the interpreter's wgmma callback,
    can deadlock XLA:CPU's thread pool: an XLA computation launched from a callback while
    the warpgroup threads block in barrier callbacks.)"""
    from jaxattn.backends.pallas import backward as pallas_triton_vjp

    def numpy_dot(a, b, *, trans_b=False, precision=None):
        del precision  # bf16 inputs only here
        shape = (a.shape[0], b.shape[0] if trans_b else b.shape[1])

        def host(a, b):
            b = np.asarray(b)
            return np.matmul(np.asarray(a), b.T if trans_b else b, dtype=np.float32)

        return jax.pure_callback(host, jax.ShapeDtypeStruct(shape, jnp.float32), a, b)

    saved = pallas_triton_vjp.dot
    pallas_triton_vjp.dot = numpy_dot
    jax.clear_caches()  # retrace the jitted Triton backward with the substitute
    try:
        yield
    finally:
        pallas_triton_vjp.dot = saved
        jax.clear_caches()


@pytest.mark.slow  # CI time (21 s): the H200's mosaic_gpu_check compares with Pallas
@needs_threads
@needs_callbacks
@pytest.mark.parametrize("case", _CASES[:2], ids=_ids)
def test_bits_equal_triton_with_same_products(mosaic_bwd, triton_numpy_dot, case):
    """With the Triton backward's tile products computed as the Mosaic GPU interpreter
    computes wgmma (``np.matmul``), dq, dk, dv, the dQ accumulator and delta equal the
    Triton backend's bit for bit: the prototype performs the same operations in the
    same order (tiles, ascending loops, GQA head order, masking, scaling) with the
    Triton source's probabilities (``mask="scores"``, ``exp(s * scale - lse)``: not the
    defaults, which are the backend's own bits)."""
    b, hq, hkv, sq, skv, d, causal = case
    seed, q, k, v, do = _inputs(b, hq, hkv, sq, skv, d)
    cfg = mosaic_bwd.BwdConfig(dkdv_wgs=1, dq_wgs=1, mask="scores", exp2=False)
    out, lse, grads_t = _triton(q, k, v, do, causal)
    grads = _mosaic(mosaic_bwd, q, k, v, out, lse, do, causal, cfg)
    for name, g, gt in zip("qkv", grads, grads_t, strict=True):
        np.testing.assert_array_equal(bits(g), bits(gt), err_msg=f"d{name} (seed {seed})")
    from jaxattn.backends.pallas import backward as pallas_triton_vjp
    dl = mosaic_bwd.delta(out, do, interpret=True)
    np.testing.assert_array_equal(bits(dl), bits(pallas_triton_vjp.delta(out, do, None,
                                                                            interpret=True)))
    scale = 1.0 / math.sqrt(d)
    acc = mosaic_bwd.dq_accumulate(q, k, v, do, lse, dl, causal=causal, scale=scale,
                                   interpret=True, config=cfg)
    acc_t = pallas_triton_vjp.dq_accumulate(q, k, v, do, lse, dl, causal=causal, scale=scale,
                                            interpret=True)
    np.testing.assert_array_equal(bits(acc), bits(acc_t), err_msg=f"seed {seed}")


@needs_threads
@needs_interpret
def test_delta_triton_option_and_dlse(mosaic_bwd):
    """``BwdConfig(delta="triton")`` is the Triton kernel; the Mosaic delta kernel gives
    the same bits in interpret mode, with a cotangent of lse."""
    seed, q, _, _, do = _inputs(1, 2, 1, 128, 64, 64)
    out = q  # any bf16 tile
    dlse = normal(seed + 1, (1, 2, 128))
    a = mosaic_bwd.delta(out, do, dlse, interpret=True)
    b = mosaic_bwd.delta(out, do, dlse, interpret=True,
                         config=mosaic_bwd.BwdConfig(delta="triton"))
    ref = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1) - dlse
    np.testing.assert_allclose(np.asarray(a), np.asarray(ref), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"seed {seed}")


@pytest.mark.slow  # CI time (21 s): test_mosaic_backend's wrapper test runs tails and a key
# mask through the same kernels against the reference
@needs_threads
@needs_interpret
def test_interpret_backward_tails_and_key_mask(mosaic_bwd):
    """Sq and Skv off the 64 grid (padded inside) with a key padding mask: gradients
    against the fp32 reference's with that mask, zero for the dropped keys; and a
    sequence padded from 100 to 150 tokens with the padding keys dropped (zero
    cotangent on the padding rows) gives the unpadded sequence's gradients in bits."""
    cfg = mosaic_bwd.BwdConfig(dkdv_wgs=1, dq_wgs=1)
    seed, q, k, v, do = _inputs(1, 2, 1, 100, 150, 64)
    mask = np.random.default_rng(seed).uniform(size=(1, 150)) < 0.7
    mask[:, :8] = True
    mask = jnp.asarray(mask)
    out, lse = reference.forward_with_lse(q, k, v, causal=True, key_padding_mask=mask)
    grads = mosaic_bwd.backward(q, k, v, out, lse, do, causal=True, interpret=True,
                                config=cfg, key_padding_mask=mask)
    f = lambda q, k, v: reference.forward_fp32(q, k, v, causal=True,  # noqa: E731
                                               key_padding_mask=mask)
    grads_ref = jax.vjp(f, q, k, v)[1](do.astype(jnp.float32))
    for name, g, gr, x in zip("qkv", grads, grads_ref, (q, k, v), strict=True):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        g32, gr = np.asarray(g.astype(jnp.float32)), np.asarray(gr)
        assert not np.isnan(g32).any(), f"d{name}: NaN (seed {seed})"
        err = np.max(np.abs(g32 - gr)) / np.max(np.abs(gr))
        assert err < 2e-2, f"d{name}: max|g-ref|/max|ref| = {err:.3g} (seed {seed})"
        if name != "q":
            assert not g32[:, :, ~np.asarray(mask[0])].any(), f"d{name}: dropped keys"
    # Tail padding: 100 tokens alone vs padded to 150 with the padding keys dropped.
    q1, k1, v1, do1 = q[:, :, :100], k[:, :, :100], v[:, :, :100], do[:, :, :100]
    o1, l1 = reference.forward_with_lse(q1, k1, v1, causal=True)
    alone = mosaic_bwd.backward(q1, k1, v1, o1, l1, do1, causal=True, interpret=True,
                                config=cfg)
    tail = jnp.arange(150)[None, :] < 100
    pad = ((0, 0), (0, 0), (0, 50), (0, 0))
    o2, l2 = reference.forward_with_lse(jnp.pad(q1, pad), k, v, causal=True,
                                        key_padding_mask=tail)
    # The real rows' O and LSE as the unpadded call had them (the reference need not
    # give the same bits at another key count: on a GPU it does not).
    o2 = jnp.concatenate([o1, o2[:, :, 100:]], axis=2)
    l2 = jnp.concatenate([l1, l2[:, :, 100:]], axis=2)
    padded = mosaic_bwd.backward(jnp.pad(q1, pad), k, v, o2, l2, jnp.pad(do1, pad),
                                 causal=True, interpret=True, config=cfg,
                                 key_padding_mask=tail)
    for name, a, p_ in zip("qkv", alone, padded, strict=True):
        np.testing.assert_array_equal(bits(a), bits(p_[:, :, :100]),
                                      err_msg=f"d{name} (seed {seed})")


@pytest.mark.slow  # CI time: a launch choice, also run on the H200
@needs_threads
@needs_interpret
def test_interpret_dkdv_two_warpgroups_keepbits(mosaic_bwd):
    """Two KV blocks per CTA sharing one query stream (the second block's earlier,
    fully masked query blocks add exact zeros) give the bits of one block per CTA. (Two
    dQ tiles per CTA, ``dq_wgs=2``, are checked in bits on the H200 by mosaic_gpu_check:
    a three-warpgroup kernel hangs this interpreter too often.)"""
    seed, q, k, v, do = _inputs(1, 2, 1, 256, 256, 64)
    out, lse, _ = _triton(q, k, v, do, True)
    one = _mosaic(mosaic_bwd, q, k, v, out, lse, do, True,
                  mosaic_bwd.BwdConfig(dkdv_wgs=1, dq_wgs=1))
    two = _mosaic(mosaic_bwd, q, k, v, out, lse, do, True,
                  mosaic_bwd.BwdConfig(dkdv_wgs=2, dq_wgs=1))
    for name, a, b in zip("qkv", one, two, strict=True):
        assert not np.isnan(np.asarray(a, np.float32)).any(), f"d{name} (seed {seed})"
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"d{name} (seed {seed})")


@pytest.mark.slow  # CI time: a launch choice of the GPU, off in the interpreter by default
# (test_static_slots_keep_backward_bits_on_gpu)
@needs_threads
@needs_interpret
def test_interpret_static_slots_keep_bits(mosaic_bwd):
    """``BwdConfig(static_slots=True)`` (the dK/dV kernel's steps unrolled by the ring's
    two slots, branched on each run's first slot) gives the dynamic slots' gradients in
    bits, no NaN: causal with GQA (two heads' masked and unmasked runs a KV block, on
    either slot) and non-causal (one run of three steps from slot 0: the odd step
    after the pair)."""
    for hq, sq, causal in ((2, 256, True), (1, 192, False)):
        seed, q, k, v, do = _inputs(1, hq, 1, sq, sq, 64)
        out, lse = jaxattn.attention(q, k, v, causal=causal, return_lse=True,
                                     backend="pallas")
        runs = [mosaic_bwd.backward(q, k, v, out, lse, do, causal=causal, interpret=True,
                                    config=mosaic_bwd.BwdConfig(static_slots=ss))
                for ss in (False, True)]
        for name, a, b in zip("qkv", *runs, strict=True):
            assert not np.isnan(np.asarray(b, np.float32)).any(), f"d{name} (seed {seed})"
            np.testing.assert_array_equal(bits(a), bits(b),
                                          err_msg=f"d{name} {causal} (seed {seed})")


@pytest.mark.slow  # CI time: options off by default (dkdv_pair replaces them), also run on the GPU
@needs_threads
@needs_interpret
def test_interpret_split_two_warpgroups_keep_bits(mosaic_bwd):
    """BwdConfig(dv_wgs=2, dk_wgs=2) (the split dV kernel, which holds no V and loads
    no delta, and the split dK kernel, each with two KV blocks per CTA sharing one query
    stream) give the bits of the joint dK/dV kernel of one block per CTA: causal (the
    second block's first query blocks fully masked) with GQA, and a key mask over NaN
    in dropped K and inf in V (``dropped_nan``)."""
    seed, q, k, v, do = _inputs(1, 2, 1, 256, 256, 64)
    keep = jnp.asarray(np.random.default_rng(seed).random((1, 256)) > 0.2).at[:, -1].set(True)
    (k_nan, v_inf), _ = dropped_nan(k, v, keep)
    for mask, kk, vv in ((None, k, v), (keep, k_nan, v_inf)):
        out, lse = jaxattn.attention(q, kk, vv, causal=True, key_padding_mask=mask,
                                     return_lse=True, backend="pallas")
        runs = [mosaic_bwd.backward(q, kk, vv, out, lse, do, causal=True, interpret=True,
                                    key_padding_mask=mask,
                                    config=mosaic_bwd.BwdConfig(dkdv_wgs=1, dq_wgs=1, **kw))
                for kw in ({}, {"split_dkdv": True, "dv_wgs": 2, "dk_wgs": 2})]
        for name, a, b in zip("qkv", *runs, strict=True):
            tag = f"d{name}, mask {mask is not None} (seed {seed})"
            assert not np.isnan(np.asarray(b, np.float32)).any(), tag
            np.testing.assert_array_equal(bits(a), bits(b), err_msg=tag)


@pytest.mark.slow  # CI time: an option off by default, also run on the GPU
@needs_threads
@needs_interpret
def test_interpret_dp_overlap_keeps_bits(mosaic_bwd):
    """BwdConfig(dp_overlap=True) (the dK/dV kernel's P^T computed while dP^T runs)
    gives the default's bits: causal with a key mask over NaN in K and inf in V (masked and
    unmasked query blocks, a partial last block; a non-causal call runs the same
    unmasked step, CI time)."""
    seed, q, k, v, do = _inputs(1, 2, 1, 200, 200, 64)
    keep = jnp.asarray(np.random.default_rng(seed).random((1, 200)) > 0.2).at[:, -1].set(True)
    (k_nan, v_inf), _ = dropped_nan(k, v, keep)  # the house's poison where dropped
    out, lse = jaxattn.attention(q, k_nan, v_inf, causal=True, key_padding_mask=keep,
                                 return_lse=True, backend="pallas")
    runs = [mosaic_bwd.backward(q, k_nan, v_inf, out, lse, do, causal=True, interpret=True,
                                key_padding_mask=keep,
                                config=mosaic_bwd.BwdConfig(dkdv_wgs=1, dq_wgs=1, **kw))
            for kw in ({}, {"dp_overlap": True})]
    for name, a, b in zip("qkv", *runs, strict=True):
        assert not np.isnan(np.asarray(a, np.float32)).any(), (name, seed)
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"d{name} (seed {seed})")


# CI time (31 to 38 s): the D=256 default's option; test_dq_in_smem_keeps_bits_on_gpu
@pytest.mark.slow
@needs_threads
@needs_interpret
def test_interpret_dq_in_smem_keeps_bits(mosaic_bwd):
    """BwdConfig(dq_in_smem=True) (the dQ kernel's running dQ in its fp32 output tile,
    each block's product added 64 columns at a time) gives the registers' bits with dQ
    continued across two key ranges (the tile starting from the first range's
    accumulator: context parallelism's path, the option's default use at D=256). The
    finished dQ's path: the slow test below."""
    one = dict(dkdv_wgs=1, dq_wgs=1, dq_pair=False)  # (dq_pair keeps dQ in registers)
    seed, q, k, v, do = _inputs(1, 1, 1, 64, 192, 64)
    out, lse = reference.forward_with_lse(q, k, v, causal=True)
    runs = [mosaic_bwd.backward_over_ranges(
                q, k, v, out, lse, do, ranges=[(0, 128), (128, 192)],
                offsets=jnp.asarray([128], jnp.int32), causal=True, interpret=True,
                config=mosaic_bwd.BwdConfig(**one, dq_in_smem=flag))
            for flag in (False, True)]
    np.testing.assert_array_equal(bits(runs[0][0]), bits(runs[1][0]),
                                  err_msg=f"dq over ranges (seed {seed})")
    assert not np.isnan(np.asarray(runs[1][0], np.float32)).any()


@pytest.mark.slow  # CI time: D > 128 runs dq_pair (registers) for a finished dQ
@needs_threads
@needs_interpret
def test_interpret_dq_in_smem_finished_keeps_bits(mosaic_bwd):
    """BwdConfig(dq_in_smem=True, dq_pair=False) gives the registers' bits for a
    finished dQ: causal with a partial last key block (dQ scaled and cast in the
    kernel; D=128, the same kernel as D=256's)."""
    one = dict(dkdv_wgs=1, dq_wgs=1, dq_pair=False)
    seed, q, k, v, do = _inputs(1, 2, 1, 128, 160, 128)
    out, lse = reference.forward_with_lse(q, k, v, causal=True)
    runs = [_mosaic(mosaic_bwd, q, k, v, out, lse, do, True,
                    mosaic_bwd.BwdConfig(**one, dq_in_smem=flag)) for flag in (False, True)]
    for name, a, b in zip("qkv", *runs, strict=True):
        assert not np.isnan(np.asarray(b, np.float32)).any(), f"d{name} (seed {seed})"
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"d{name} (seed {seed})")


def _masked_configs_agree_in_bits(mosaic_bwd, want, got):
    """The interpreted backward with ``BwdConfig(**got)`` gives ``BwdConfig(**want)``'s
    dQ, dK and dV bits, no NaN (one dK/dV and one dQ warpgroup a CTA besides): D=128,
    causal with offset 64 over three key blocks, GQA, a key mask over NaN in dropped K
    and V."""
    seed, q, k, v, do = _inputs(1, 2, 1, 128, 192, 128)
    keep = jnp.asarray(np.random.default_rng(seed).random((1, 192)) > 0.2).at[:, -1].set(True)
    k = jnp.where(keep[:, None, :, None], k, jnp.nan).astype(k.dtype)
    v = jnp.where(keep[:, None, :, None], v, jnp.nan).astype(v.dtype)
    out, lse = jaxattn.attention(q, k, v, causal=True, key_padding_mask=keep,
                                 return_lse=True, backend="pallas")
    runs = [mosaic_bwd.backward(q, k, v, out, lse, do, causal=True, interpret=True,
                                key_padding_mask=keep,
                                config=mosaic_bwd.BwdConfig(dkdv_wgs=1, dq_wgs=1, **kw))
            for kw in (want, got)]
    for name, a, b in zip("qkv", *runs, strict=True):
        assert not np.isnan(np.asarray(b, np.float32)).any(), f"d{name} (seed {seed})"
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"d{name} (seed {seed})")


@needs_threads
@needs_interpret
def test_interpret_dkdv_pair_keeps_bits(mosaic_bwd):
    """BwdConfig(dkdv_pair=True) (dK and dV by one kernel whose two warpgroups share one
    KV block: P^T handed from the dV warpgroup to the dK one through SMEM) gives the
    split kernels' bits: D=128 (the products' shapes differ from S's), causal with
    offset 64, GQA, a key mask over NaN in dropped K and V."""
    _masked_configs_agree_in_bits(mosaic_bwd, dict(split_dkdv=True, dkdv_pair=False),
                                  dict(split_dkdv=True, dkdv_pair=True))


# CI time (56 to 65 s): the D=256 default's option; test_dq_pair_keeps_bits_on_gpu (the
# D=256 default's dkdv_pair keeps its interpreter test in CI)
@pytest.mark.slow
@needs_threads
@needs_interpret
def test_interpret_dq_pair_keeps_bits(mosaic_bwd):
    """BwdConfig(dq_pair=True) (the dQ kernel's tile on two warpgroups: P handed from
    the first to the second through SMEM, dS back, each summing half of dQ's columns)
    gives the one-warpgroup kernel's bits: D=128, causal with offset 64 over three key
    blocks (masked and unmasked), GQA, a key mask over NaN in dropped K and V; with
    per-sequence offsets (``backward_over_ranges`` over one range). (Query tiles that
    see no key: the next test, ``-m slow``.)"""
    _masked_configs_agree_in_bits(mosaic_bwd, dict(dq_pair=False), dict(dq_pair=True))
    # Per-sequence offsets read in the kernel (one key range: the finished dQ from zero,
    # dq_pair's case), two sequences.
    seed, q, k, v, do = _inputs(2, 2, 1, 64, 256, 128)
    out, lse = reference.forward_with_lse(q, k, v, causal=True)
    runs = [mosaic_bwd.backward_over_ranges(
                q, k, v, out, lse, do, ranges=[(0, 256)],
                offsets=jnp.asarray([192, 150], jnp.int32), causal=True, interpret=True,
                config=mosaic_bwd.BwdConfig(dkdv_wgs=1, dq_wgs=1, dq_pair=flag))
            for flag in (False, True)]
    for name, a, b in zip("qkv", *runs, strict=True):
        assert not np.isnan(np.asarray(b, np.float32)).any(), f"d{name} (seed {seed})"
        np.testing.assert_array_equal(bits(a), bits(b),
                                      err_msg=f"d{name}, offsets (seed {seed})")


@pytest.mark.slow  # CI time (about 20 s a worker): on the GPU, test_dq_pair_keeps_bits_on_gpu
@needs_threads
@needs_interpret
def test_interpret_dq_pair_without_keys_keeps_bits(mosaic_bwd):
    """BwdConfig(dq_pair=True) with query tiles that see no key (Sq > Skv, causal): no P
    passes between the warpgroups, so only the epilogue's own wait orders Q's copy
    before dQ's staging in its SMEM (without it the interpreter's dQ held Q's values in
    every run); dQ of those rows zero and the one-warpgroup kernel's bits."""
    seed, q, k, v, do = _inputs(1, 2, 1, 320, 64, 128)
    out, lse = reference.forward_with_lse(q, k, v, causal=True)
    dq = [_mosaic(mosaic_bwd, q, k, v, out, lse, do, True,
                  mosaic_bwd.BwdConfig(dkdv_wgs=1, dq_wgs=1, dq_pair=flag))[0]
          for flag in (False, True)]
    assert not np.asarray(dq[1][:, :, :256], np.float32).any(), f"seed {seed}"
    np.testing.assert_array_equal(bits(dq[0]), bits(dq[1]), err_msg=f"dq, Sq > Skv (seed {seed})")


# CI time (25 to 30 s): the D=256 default's option; test_d256_backward_options_keep_bits_on_gpu
@pytest.mark.slow
@needs_threads
@needs_interpret
def test_interpret_dq_split_ring_keeps_bits(mosaic_bwd):
    """BwdConfig(dq_split_ring=True) (at D=256 the dQ kernel's K in two ring slots and V
    in one of its own, freed after dP) gives the default's bits: causal with offset 64
    over three key blocks (each slot reused; masked and unmasked blocks), GQA."""
    one = dict(dkdv_wgs=1, dq_wgs=1)
    seed, q, k, v, do = _inputs(1, 2, 1, 128, 192, 256)
    out, lse = reference.forward_with_lse(q, k, v, causal=True)
    runs = [_mosaic(mosaic_bwd, q, k, v, out, lse, do, True,
                    mosaic_bwd.BwdConfig(**one, dq_split_ring=flag)) for flag in (False, True)]
    assert not np.isnan(np.asarray(runs[1][0], np.float32)).any(), f"dq (seed {seed})"
    np.testing.assert_array_equal(bits(runs[0][0]), bits(runs[1][0]),
                                  err_msg=f"dq (seed {seed})")


@pytest.mark.slow  # CI time: schedule options, the H200 runs the default
@needs_threads
@needs_interpret
def test_interpret_probs_mask_and_exp2(mosaic_bwd):
    """``mask="probs"`` (fully visible blocks skip the mask; the others zero the
    probabilities after the exponential) with and without ``exp2``: accurate against
    the float32 reference, and the unmasked path gives the bits of the masked one: an
    all-kept key padding mask sends every block down the masked path. Causal offset 64
    (a query block that sees one key block whole and the next in part) and GQA."""
    seed, q, k, v, do = _inputs(1, 2, 1, 128, 192, 64)
    out, lse, _ = _triton(q, k, v, do, True)
    f = lambda q, k, v: reference.forward_fp32(q, k, v, causal=True)  # noqa: E731
    _, vjp = jax.vjp(f, q, k, v)
    grads_ref = vjp(do.astype(jnp.float32))
    keep = jnp.ones((1, 192), jnp.bool_)
    for exp2 in (False, True):
        cfg = mosaic_bwd.BwdConfig(dkdv_wgs=1, dq_wgs=1, mask="probs", exp2=exp2)
        fast = _mosaic(mosaic_bwd, q, k, v, out, lse, do, True, cfg)
        masked = mosaic_bwd.backward(q, k, v, out, lse, do, causal=True, interpret=True,
                                     config=cfg, key_padding_mask=keep)
        for name, g, gm, gr in zip("qkv", fast, masked, grads_ref, strict=True):
            g32, gr = np.asarray(g.astype(jnp.float32)), np.asarray(gr)
            assert not np.isnan(g32).any(), f"d{name} exp2={exp2} (seed {seed})"
            err = np.max(np.abs(g32 - gr)) / np.max(np.abs(gr))
            assert err < 2e-2, f"d{name} exp2={exp2}: {err:.3g} (seed {seed})"
            np.testing.assert_array_equal(bits(g), bits(gm),
                                          err_msg=f"d{name} exp2={exp2} (seed {seed})")


@pytest.mark.slow  # CI time: test_large_head_dims runs D=256 on the H200
@needs_threads
@needs_interpret
def test_interpret_split_dkdv_and_head_dim_256(mosaic_bwd):
    """dK and dV by two kernels (``split_dkdv``, one accumulator each) give the bits of
    the joint kernel; at D=256 (the default there: dK and dV by one kernel of two
    warpgroups, a sum each, and dQ with one tile a CTA and K and V in rings of their
    own) the gradients match the float32 reference."""
    seed, q, k, v, do = _inputs(1, 2, 1, 128, 128, 64)
    out, lse, _ = _triton(q, k, v, do, True)
    joint = _mosaic(mosaic_bwd, q, k, v, out, lse, do, True)
    split = _mosaic(mosaic_bwd, q, k, v, out, lse, do, True,
                    mosaic_bwd.BwdConfig(dkdv_wgs=1, dq_wgs=1, split_dkdv=True))
    for name, a, b in zip("qkv", joint, split, strict=True):
        assert not np.isnan(np.asarray(a, np.float32)).any(), f"d{name} (seed {seed})"
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"d{name} (seed {seed})")
    seed, q, k, v, do = _inputs(1, 2, 1, 128, 192, 256)
    f = lambda q, k, v: reference.forward_fp32_with_lse(q, k, v, causal=True)  # noqa: E731
    (out, lse), vjp = jax.vjp(f, q, k, v)
    grads_ref = vjp((do.astype(jnp.float32), jnp.zeros_like(lse)))
    grads = _mosaic(mosaic_bwd, q, k, v, out.astype(q.dtype), lse, do, True)
    for name, g, gr in zip("qkv", grads, grads_ref, strict=True):
        g32, gr = np.asarray(g.astype(jnp.float32)), np.asarray(gr)
        assert not np.isnan(g32).any(), f"D=256 d{name} (seed {seed})"
        err = np.max(np.abs(g32 - gr)) / np.max(np.abs(gr))
        assert err < 2e-2, f"D=256 d{name}: {err:.3g} (seed {seed})"


@pytest.mark.slow  # CI time (37 s): test_mosaic_backend's CP test runs these kernels
@needs_threads
@needs_interpret
def test_interpret_backward_over_ranges(mosaic_bwd):
    """Per-sequence causal offsets and the keys in two ranges (dK/dV per range, dQ
    continued from the first range to the second): each sequence's gradients equal, in
    bits, those of its own call with the static offset (its keys cut where its rows
    stop seeing them); the keys past that get zero dK and dV."""
    cfg = mosaic_bwd.BwdConfig(dkdv_wgs=1, dq_wgs=1)
    seed, q, k, v, do = _inputs(2, 1, 1, 40, 200, 64)
    lens = (200, 140)  # sequence b's rows see keys j <= i + lens[b] - 40
    outs, lses = [], []
    for bi, n in enumerate(lens):
        o, l_ = reference.forward_with_lse(q[bi:bi + 1], k[bi:bi + 1, :, :n],
                                           v[bi:bi + 1, :, :n], causal=True)
        outs.append(o)
        lses.append(l_)
    out, lse = jnp.concatenate(outs), jnp.concatenate(lses)
    offs = jnp.asarray(lens, jnp.int32) - 40
    got = mosaic_bwd.backward_over_ranges(q, k, v, out, lse, do, ranges=[(0, 128),
                                                                         (128, 200)],
                                          offsets=offs, causal=True, interpret=True,
                                          config=cfg)
    for bi, n in enumerate(lens):
        want = mosaic_bwd.backward(q[bi:bi + 1], k[bi:bi + 1, :, :n], v[bi:bi + 1, :, :n],
                                   out[bi:bi + 1], lse[bi:bi + 1], do[bi:bi + 1],
                                   causal=True, interpret=True, config=cfg)
        for name, g, w in zip("qkv", got, want, strict=True):
            g = g[bi:bi + 1] if name == "q" else g[bi:bi + 1, :, :n]
            assert not np.isnan(np.asarray(g, np.float32)).any(), name
            np.testing.assert_array_equal(bits(g), bits(w),
                                          err_msg=f"d{name} seq {bi} (seed {seed})")
        for g in got[1:]:
            assert not np.asarray(g[bi, :, n:], np.float32).any()


def test_backward_over_ranges_rejects_bad_ranges(mosaic_bwd):
    q = jnp.ones((1, 1, 64, 64), jnp.bfloat16)
    k = jnp.ones((1, 1, 300, 64), jnp.bfloat16)
    lse = jnp.zeros((1, 1, 64), jnp.float32)
    offs = jnp.array([236], jnp.int32)
    for ranges in ([(0, 100), (100, 300)], [(0, 128)], [(0, 128), (192, 300)],
                   [(128, 300), (0, 128)]):
        with pytest.raises(ValueError, match="ranges"):
            mosaic_bwd.backward_over_ranges(q, k, k, q, lse, q, ranges=ranges, offsets=offs,
                                            causal=True)
    with pytest.raises(ValueError, match="offsets"):
        mosaic_bwd.backward_over_ranges(q, k, k, q, lse, q, ranges=[(0, 300)],
                                        offsets=jnp.zeros((2,), jnp.int32), causal=True)


@needs_api
def test_backward_over_ranges_lowers_for_cuda(mosaic_bwd):
    q = jax.ShapeDtypeStruct((2, 8, 300, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 2, 2100, 128), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((2, 8, 300), jnp.float32)
    offs = jax.ShapeDtypeStruct((2,), jnp.int32)
    f = jax.jit(lambda q, k, o, l_, offs: mosaic_bwd.backward_over_ranges(
        q, k, k, o, l_, o, ranges=[(0, 1024), (1024, 2048), (2048, 2100)], offsets=offs,
        causal=True))
    text = f.trace(q, k, q, lse, offs).lower(lowering_platforms=("cuda",)).as_text()
    # delta; dK/dV: one kernel for the two whole ranges (same shapes), one for the last;
    # dQ: the first range (from zero), the second (continued), the last (continued).
    assert text.count("custom_call @mosaic_gpu") == 6




@needs_api
@pytest.mark.parametrize("semantics", ["lane", "warpgroup"])
@pytest.mark.parametrize("gpu_operands", [True, False])
@pytest.mark.parametrize("d", [64, 128])
def test_lowers_for_cuda_without_gpu(mosaic_bwd, d, gpu_operands, semantics):
    """delta, dK/dV and dQ, both operand paths (True: transposed SMEM views and register
    A operands; False: the one run in interpret mode), go through the Pallas -> Mosaic
    GPU lowering for CUDA on a CPU-only machine (layouts, wgmma operands, SMEM)."""
    q = jax.ShapeDtypeStruct((1, 4, 256, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 2, 512, d), jnp.bfloat16)
    cfg = mosaic_bwd.BwdConfig(gpu_operands=gpu_operands, semantics=semantics)
    text = mosaic_bwd.lower_for_cuda(q, k, k, causal=True, config=cfg).as_text()
    assert text.count("custom_call @mosaic_gpu") == 3


@needs_api
@pytest.mark.parametrize("kw", [{"gpu_operands": True, "dkdv_wgs": 1},
                                {"gpu_operands": False, "dkdv_wgs": 1},
                                {"accumulate": "inplace"},
                                {"accumulate": "inplace", "dkdv_wgs": 1},
                                {"dq_wgs": 2}, {"dq_wgs": 2, "accumulate": "inplace"},
                                {}, {"registers": None},
                                {"mask": "scores"}, {"exp2": False},
                                {"mask": "scores", "exp2": False, "dq_wgs": 2},
                                {"split_dkdv": True}, {"dp_overlap": True},
                                {"split_dkdv": True, "dv_wgs": 2, "dk_wgs": 2}],
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items())
                         or "default")
def test_dkdv_options_lower(mosaic_bwd, kw):
    """One or two dK/dV (and dQ) warpgroups, fresh or in-place accumulation, with or
    without register reallocation, both masks and exponentials, dK and dV by one kernel
    or two."""
    q = jax.ShapeDtypeStruct((1, 4, 256, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 2, 512, 128), jnp.bfloat16)
    cfg = mosaic_bwd.BwdConfig(**kw)
    text = mosaic_bwd.lower_for_cuda(q, k, k, causal=True, config=cfg).as_text()
    # delta, dK/dV (two kernels with split_dkdv) and dQ
    assert text.count("custom_call @mosaic_gpu") == (4 if cfg.split_dkdv else 3)


@needs_api
@pytest.mark.parametrize("causal", [True, False])
def test_head_dim_256_lowers_for_cuda(mosaic_bwd, causal):
    """D=256: delta, dK and dV by two kernels, dQ with one tile and one K/V slot per
    CTA (the SMEM: 192 KiB each), query and key tails and a key mask included; causal,
    the launch options that change one kernel each fit too: two warpgroups in the dV kernel
    (``dv_wgs=2``) or in the dK kernel (``dk_wgs=2``, one ring slot), and the dQ
    kernel's split ring (``dq_split_ring``, the default); ``dkdv_pair`` (the default)
    lowers one kernel for both."""
    q = jax.ShapeDtypeStruct((2, 8, 200, 256), jnp.bfloat16)
    skv = 256 if causal else 300  # the options need 2 x 128 keys; a key tail
    k = jax.ShapeDtypeStruct((2, 2, skv, 256), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((2, skv), jnp.bool_)
    for m in (None, mask):
        kernels = {}
        options = (("dv", {"dv_wgs": 2}), ("dk", {"dk_wgs": 2}),
                   ("dq", {"dq_split_ring": True})) if causal else ()  # (CI time)
        two = dict(dkdv_pair=False, dq_split_ring=False)  # dK and dV by two kernels
        for name, kw in (("default", {}), *options):
            text = mosaic_bwd.lower_for_cuda(q, k, k, causal=causal, key_padding_mask=m,
                                             config=mosaic_bwd.BwdConfig(**{**two, **kw})
                                             ).as_text()
            kernels[name] = [line for line in text.splitlines()
                             if "custom_call @mosaic_gpu" in line]
            assert len(kernels[name]) == 4
        if not causal:
            continue
        # dv_wgs=2, dk_wgs=2 (one ring slot) and dq_split_ring (none with a key mask,
        # which a key count off the 64 grid also takes: it would not fit) each change
        # one kernel, not the same.
        changed = {name: [i for i, (a, b) in enumerate(zip(kernels["default"], kernels[name],
                                                              strict=True)) if a != b]
                   for name in ("dv", "dk", "dq")}
        assert len(changed["dv"]) == len(changed["dk"]) == 1, changed
        assert changed["dv"] != changed["dk"], changed
        assert len(changed["dq"]) == (0 if m is not None else 1), changed
        assert not set(changed["dq"]) & set(changed["dv"] + changed["dk"]), changed
        # dkdv_pair (the default): one kernel for dK and dV (its SMEM fits with the key
        # mask too).
        text = mosaic_bwd.lower_for_cuda(q, k, k, causal=causal, key_padding_mask=m
                                         ).as_text()
        assert text.count("custom_call @mosaic_gpu") == 3


@needs_api
@pytest.mark.parametrize("d", [128, 256])
def test_dq_pair_lowers_for_cuda(mosaic_bwd, d):
    """``dq_pair`` lowers for CUDA (SMEM: Q, dO, two K slots, V, the P and dS tiles)
    at D=128 and 256, causal with a key mask and query and key tails, and non-causal;
    it changes the dQ kernel alone."""
    q = jax.ShapeDtypeStruct((2, 8, 200, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 2, 300, d), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((2, 300), jnp.bool_)
    for causal, m in ((True, mask), (False, None)):
        kernels = [[line for line in mosaic_bwd.lower_for_cuda(
            q, k, k, causal=causal, key_padding_mask=m,
            config=mosaic_bwd.BwdConfig(dq_pair=flag)).as_text().splitlines()
                    if "custom_call @mosaic_gpu" in line] for flag in (False, True)]
        assert len(kernels[0]) == len(kernels[1]) == 3
        assert kernels[0][:2] == kernels[1][:2] and kernels[0][2] != kernels[1][2]


@needs_api
@pytest.mark.parametrize("d", [64, 128])
def test_fused_dq_lowers_for_cuda(mosaic_bwd, d):
    """``fused_dq`` lowers for CUDA with its SMEM within the H100's (the base kernel's,
    and per warpgroup a dS^T and an fp32 share tile): two kernels (delta and the fused
    dK/dV) where the default has three, delta's unchanged, the fused one adding by TMA
    reduce-adds between semaphore waits; causal with a query tail and Sq > Skv (tiles
    that see no key), and non-causal; both ``dq_signal`` timings (different kernels)."""
    from benchmarks import lowered
    q = jax.ShapeDtypeStruct((2, 8, 200, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 2, 128, d), jnp.bfloat16)
    configs = [mosaic_bwd.BwdConfig(), mosaic_bwd.BwdConfig(fused_dq=True),
               mosaic_bwd.BwdConfig(fused_dq=True, dq_signal="step_end")]
    for causal in (True, False):
        lower = [functools.partial(mosaic_bwd.lower_for_cuda, q, k, k, causal=causal,
                                   config=c) for c in configs]
        mods = [lowered.modules(f) for f in lower]
        assert [len(m) for m in mods] == [3, 2, 2]
        assert mods[0][0] == mods[1][0] == mods[2][0] and mods[1][1] != mods[2][1]
        for fused in (mods[1][1], mods[2][1]):
            assert "cp.reduce.async.bulk" in fused and "atom." in fused, (d, causal)
        launches = lowered.launches(lower[1])
        assert launches[1][0] == 384 and launches[1][1] <= 232448, launches


@needs_api
def test_fused_dq_refuses_what_it_does_not_serve(mosaic_bwd):
    """``fused_dq``: a bool, ``dq_signal`` one of its two names; the interpreter, a key
    mask, a key count off the 64-key grid (which the backward masks) and D > 128 are
    refused with the reason, not run with another dQ."""
    with pytest.raises(TypeError, match="fused_dq must be True or False"):
        mosaic_bwd.BwdConfig(fused_dq="yes")
    with pytest.raises(ValueError, match="dq_signal must be 'next_step' or 'step_end', "
                                         "got 'later'"):
        mosaic_bwd.BwdConfig(fused_dq=True, dq_signal="later")
    cfg = mosaic_bwd.BwdConfig(fused_dq=True)
    s = jax.ShapeDtypeStruct

    def lower(d=64, skv=128, mask=None, interpret=False):
        q, k = s((1, 2, 128, d), jnp.bfloat16), s((1, 1, skv, d), jnp.bfloat16)
        f = jax.jit(lambda q, k, m: mosaic_bwd.backward(
            q, k, k, q, jnp.zeros((1, 2, 128), jnp.float32), q, causal=True, config=cfg,
            key_padding_mask=m, interpret=interpret))
        return f.trace(q, k, mask).lower(lowering_platforms=("cuda",))

    with pytest.raises(ValueError, match="fused_dq needs the GPU"):
        lower(interpret=True)
    with pytest.raises(ValueError, match="fused_dq takes no key mask"):
        lower(mask=s((1, 128), jnp.bool_))
    with pytest.raises(ValueError, match="fused_dq takes no key mask"):
        lower(skv=100)
    with pytest.raises(ValueError, match="fused_dq is for D <= 128"):
        lower(d=256)
    lower()  # and the plain call lowers


@needs_api
@pytest.mark.parametrize("kw", [{}, {"accumulate": "inplace"},
                                {"gpu_operands": False, "dq_wgs": 1},
                                {"mask": "scores", "exp2": False}],
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items())
                         or "default")
@pytest.mark.parametrize("causal", [True, False])
def test_tails_and_key_mask_lower(mosaic_bwd, kw, causal):
    """Sq and Skv off the 64 grid, with a key padding mask (keep values with the dK/dV
    CTA's block, streamed with K/V to the dQ kernel)."""
    q = jax.ShapeDtypeStruct((2, 4, 200, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 2, 300, 128), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((2, 300), jnp.bool_)
    text = mosaic_bwd.lower_for_cuda(q, k, k, causal=causal, key_padding_mask=mask,
                                     config=mosaic_bwd.BwdConfig(**kw)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 3


def test_config_rejects_bad_values(mosaic_bwd):
    for kw in ({"dkdv_wgs": 3}, {"accumulate": "fma"}, {"delta": "xla"}, {"stages": 0},
               {"dq_wgs": 0}, {"dv_wgs": 3}, {"dk_wgs": 0}, {"registers": (240,)},
               {"registers": (241, 24)}, {"mask": "logits"}, {"store_wait": "none"}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            mosaic_bwd.BwdConfig(**kw)
    # Retired options (docs/mosaic.md, "Configuration options retired"), and a flag
    # given something else.
    for name, value in (("pair_products", True), ("dq", "fused"), ("dq_add", "atomic"),
                        ("dp_overlap", "yes"), ("dq_in_smem", 1), ("dq_split_ring", 1),
                        ("dkdv_pair", 1), ("dq_pair", 1), ("static_slots", 2)):
        with pytest.raises(TypeError, match=name):
            mosaic_bwd.BwdConfig(**{name: value})


@needs_api
def test_lowering_reports_smem_overflow(mosaic_bwd):
    q = jax.ShapeDtypeStruct((1, 1, 128, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 1, 512, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):
        mosaic_bwd.lower_for_cuda(q, k, k, config=mosaic_bwd.BwdConfig(stages=8))


@needs_api
@pytest.mark.parametrize("shapes", [
    ((1, 1, 64, 32), (1, 1, 64, 32)),    # D not 64/128
    ((1, 3, 64, 64), (1, 2, 64, 64)),    # Hq % Hkv
])
def test_rejects_unsupported_shapes(mosaic_bwd, shapes):
    qs, ks = shapes
    q = jnp.ones(qs, jnp.bfloat16)
    k = jnp.ones(ks, jnp.bfloat16)
    lse = jnp.zeros(qs[:3], jnp.float32)
    with pytest.raises(ValueError):
        mosaic_bwd.backward(q, k, k, q, lse, q, causal=True, interpret=True)


@needs_api
def test_rejects_bad_key_mask(mosaic_bwd):
    q = jnp.ones((1, 1, 64, 64), jnp.bfloat16)
    lse = jnp.zeros((1, 1, 64), jnp.float32)
    for mask in (jnp.ones((1, 63), jnp.bool_), jnp.ones((1, 64), jnp.int32)):
        with pytest.raises(ValueError, match="key_padding_mask"):
            mosaic_bwd.backward(q, q, q, q, lse, q, causal=True, interpret=True,
                                key_padding_mask=mask)


@needs_api
@pytest.mark.parametrize("d", [128, 256])
def test_backward_defaults_are_by_head_dim(mosaic_bwd, d):
    """``BwdConfig``'s ``dq_in_smem``, ``dkdv_pair``, ``dq_split_ring`` and ``dq_pair``
    default to None: on where D > 128 (each changes the module there), off where D <=
    128 (also ``dkdv_pair`` where the split is asked for at D=128)."""
    q = jax.ShapeDtypeStruct((1, 4, 256, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 2, 512, d), jnp.bfloat16)

    def kernels(**kw):
        text = mosaic_bwd.lower_for_cuda(q, k, k, causal=True,
                                         config=mosaic_bwd.BwdConfig(**kw)).as_text()
        return [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]

    flags = ("dq_in_smem", "dkdv_pair", "dq_split_ring", "dq_pair")
    default = kernels()
    assert default == kernels(**dict.fromkeys(flags, d > 128))
    if d > 128:
        for flag in ("dkdv_pair", "dq_split_ring", "dq_pair"):  # each, off alone, counts
            assert kernels(**{flag: False}) != default, flag
        # dq_in_smem acts on the one-warpgroup dQ kernel (CP's key ranges; dq_pair off)
        assert kernels(dq_pair=False, dq_in_smem=False) != kernels(dq_pair=False)
        assert len(default) == 3  # delta, dK and dV by one kernel, dQ
    else:
        assert kernels(dq_in_smem=True) != default
        assert kernels(dq_pair=True) != default
        split = kernels(split_dkdv=True)
        assert split == kernels(split_dkdv=True, dkdv_pair=False)
        assert split != kernels(split_dkdv=True, dkdv_pair=True)
