"""The registered ``"mosaic"`` backend (jaxattn/backends/mosaic/backend.py): chosen on
sm90 only, its refusals, fp32 on the Pallas kernels, its CUDA lowering (forward and
gradient) on a CPU, and its wrapper (head-dim padding, the custom VJP) in Mosaic GPU
interpret mode. On an sm90 GPU the parameterised battery (tests/test_backends.py) runs
it natively."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, np_attention, ragged_cache, rand_qkv, rel_err
from jax import lax
from mosaic_support import (
    dropped_nan,
    missing_api,
    missing_interpret,
    needs_threads,
)

import jaxattn
from jaxattn import reference, registry
from jaxattn.backends.mosaic import backend as mosaic_backend
from jaxattn.invariance import bits_equal, normal

needs_api = pytest.mark.skipif(missing_api(("load", "Layout")) is not None,
                               reason=str(missing_api(("load", "Layout"))))
_why_interp = missing_interpret(("load", "Layout"))
needs_interpret = pytest.mark.skipif(_why_interp is not None, reason=str(_why_interp))

#: The lowering checks' cases run in CI (tests/conftest.py: the others with -m slow on
#: the CPU, all of them on the GPU battery): CP with chunks runs CP's kernels, the
#: causal prefill the non-causal one's, decode the stacked rows', paged HND NHD's.
CPU_CASES = {
    "test_every_path_at_d256_lowers_for_cuda": (
        "causal", "key padding mask", "decode", "chunked prefill", "cp chunks",
        "paged HND", "varlen"),
    "test_forward_and_gradient_lower_for_cuda": ("128", "200"),
}


def test_chosen_on_sm90_by_capability():
    """Priority before pallas on the GPU; chosen exactly where available (sm90), never
    on a CPU."""
    be = registry.backend("mosaic")
    assert be.platforms == ("gpu",)
    assert be.priority["gpu"] < registry.backend("pallas").priority["gpu"]
    # One backend object serves every op whose path it has: CP resolves the same way.
    assert "mosaic" in registry.backend_names("cp_attention")
    assert registry.resolve("attention", platform="cpu").name != "mosaic"
    if ON_GPU:
        want = "mosaic" if be.available() is None else "pallas"
        assert jaxattn.get_op("attention").backend == want


@pytest.mark.skipif(ON_GPU, reason="on a GPU the backend may be available")
def test_unavailable_off_hopper_with_the_reason():
    with pytest.raises((RuntimeError, ValueError), match="mosaic"):
        jaxattn.get_op("attention", backend="mosaic")
    assert "sm90" in mosaic_backend.unavailable_reason()


def test_check_supported_reasons():
    bf16 = jnp.dtype(jnp.bfloat16)
    for d in (1, 16, 48, 64, 100, 128, 200, 256):
        assert mosaic_backend.check_supported(d, bf16) is None, d
        assert mosaic_backend.check_supported(d, jnp.float16) is None, d
    # fp32: the Pallas kernels' head dims (every D from 1 to 256, padded inside)
    for d in (1, 16, 32, 48, 64, 80, 128, 192, 256):
        assert mosaic_backend.check_supported(d, jnp.float32) is None, d
    assert "fp32 runs the Pallas kernels" in mosaic_backend.check_supported(300, jnp.float32)
    assert "D=257" in mosaic_backend.check_supported(257, bf16)
    assert "D=0" in mosaic_backend.check_supported(0, bf16)
    assert "int8" in mosaic_backend.check_supported(64, jnp.int8)


def test_fp32_runs_the_pallas_kernels():
    """fp32 (no fp32 wgmma) is served by the Pallas backend's kernels (interpreted on a
    CPU): accurate against float64, gradients included; a head dim beyond 256 is
    refused with the reason. On the GPU, test_fp32_is_the_pallas_backends
    checks the bits on every path. D=48: padded to 64 inside the Pallas kernels."""
    seed = int(np.random.default_rng().integers(2**16))
    q, k, v = rand_qkv(1, 2, 1, 12, 30, 48, jnp.float32, seed=seed)
    out, lse = mosaic_backend.attention(q, k, v, causal=True, scale=0.25)
    ref, ref_lse = np_attention(q, k, v, scale=0.25)
    assert out.dtype == jnp.float32 and not np.isnan(np.asarray(out)).any()
    assert rel_err(out, ref) < 1e-5, f"seed {seed}"
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=1e-5)
    g = jax.grad(lambda q: mosaic_backend.attention(q, k, v, causal=True, scale=0.25)[0]
                 .sum())(q)
    want = jax.grad(lambda q: reference.forward_fp32(q, k, v, causal=True, scale=0.25)
                    .sum())(q)
    assert rel_err(g, want) < 1e-4, f"seed {seed}"
    q300 = jnp.ones((1, 1, 4, 300), jnp.float32)
    with pytest.raises(ValueError, match="fp32 runs the Pallas kernels"):
        mosaic_backend.attention(q300, q300, q300, causal=True, scale=0.125)


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [200, 256])
def test_large_head_dims_forward_and_gradients(d, causal):
    """D=256 (and D=200, zero-padded to it) on sm90: the forward and the gradients (dK
    and dV by two kernels) against the fp32 reference, Sq and Skv off the 64 grid, a
    key padding mask, GQA; no NaN; padded keys get exactly zero dK and dV."""
    seed = int(np.random.default_rng().integers(2**16))
    q, k, v = rand_qkv(2, 8, 2, 200, 300, d, jnp.bfloat16, seed=seed)
    m = np.ones((2, 300), bool)
    m[0, 250:] = False
    mask = jnp.asarray(m)
    w = normal(seed, q.shape)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w)

    kw = dict(causal=causal, key_padding_mask=mask)
    out = jaxattn.attention(q, k, v, backend="mosaic", **kw)
    ref = reference.forward_fp32(q, k, v, **kw)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert rel_err(out, ref) < 2e-2, f"seed {seed}"
    got = jax.grad(loss(lambda q, k, v: jaxattn.attention(q, k, v, backend="mosaic", **kw)),
                   (0, 1, 2))(q, k, v)
    want = jax.grad(loss(lambda q, k, v: reference.forward_fp32(q, k, v, **kw)), (0, 1, 2))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    for name, g, r in zip("qkv", got, want, strict=True):
        assert g.dtype == jnp.bfloat16 and not np.isnan(np.asarray(g, np.float32)).any()
        assert rel_err(g, r) < 5e-2, f"d{name} (seed {seed})"
    for g in got[1:]:
        assert not np.asarray(g, np.float32)[0, :, 250:].any()


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_flat_q_and_out_keep_bits_on_gpu():
    """On sm90, MosaicConfig(flat_q=True) (the stacked decode rows read from [B, Hq * Sq,
    D], the rows past a group the next group's queries or zeros) and flat_out=True (the
    split decode's fold storing the group's rows cast in place) give the padded call's
    bits: decode split and unsplit, 8, 4 and 3 queries per group (4 and 3: most groups'
    first rows off the 8-row grid, through flat_q's untiled slot; unsplit, 8 and 4 rows
    stored in place through it), at Skv a multiple of 8 and not of 64, and not of 8
    (K and V read in boxes either way); no NaN. (``flat_kv``, K and V through the free
    reshape ``[B, Hkv * Skv, D]``, was retired on 2026-12-06: level with the boxes.)"""
    from jaxattn.backends.mosaic import forward as mf
    q, k, v = rand_qkv(2, 64, 8, 1104, 1104, 128, jnp.bfloat16)
    for hq, sq, end, b in ((64, 1, 1032, 2), (32, 1, 1096, 1), (64, 1, 136, 2),
                           (32, 4, 1104, 2), (64, 1, 1025, 2), (32, 1, 1087, 1),
                           (24, 1, 1096, 2), (32, 1, 1000, 2)):
        qs = q[:b, :hq, end - sq:end]
        ks, vs = k[:b, :, :end], v[:b, :, :end]
        off = dict(flat_q=False, flat_out=False)
        base = mf.forward(qs, ks, vs, causal=True, config=mf.MosaicConfig(**off))
        for on in ("flat_q", "flat_out", None):  # each alone, and both
            cfg = mf.MosaicConfig() if on is None else mf.MosaicConfig(**{**off, on: True})
            got = mf.forward(qs, ks, vs, causal=True, config=cfg)
            for x, y in zip(base, got, strict=True):
                assert not np.isnan(np.asarray(y, np.float32)).any(), (sq, end, b, cfg)
                assert bits_equal(x, y), (hq, sq, end, b, cfg)


def _configs_agree_in_bits(f, configs, tag, *args, **kw):
    """``f(*args, config=c, **kw)``'s outputs under each of ``configs`` after the first
    equal the first's in bits, and none has a NaN (a failure names the output's
    index: for the backward 0 dQ, 1 dK, 2 dV)."""
    want = f(*args, config=configs[0], **kw)
    for config in configs[1:]:
        for i, (x, y) in enumerate(zip(want, f(*args, config=config, **kw), strict=True)):
            assert not np.isnan(np.asarray(y, np.float32)).any(), (tag, config, i)
            assert bits_equal(x, y), (tag, config, f"output {i}")


def _mask_and_layout_agree(configs, rng, q, k, v, s):
    """The mosaic forward under each of ``configs`` gives the first's bits, no NaN, on
    the first ``s`` rows and keys of ``q``, ``k``, ``v`` (``[B, H, S, D]``): non-causal
    with a random key padding mask over the house's poison in the dropped keys (NaN in
    K, inf in V: ``mosaic_support.dropped_nan``), and causal in JAX's ``[B, S, H, D]``
    layout."""
    from jaxattn.backends.mosaic import forward as mf
    q, k, v = q[:, :, :s], k[:, :, :s], v[:, :, :s]
    keep = jnp.asarray(rng.random((q.shape[0], s)) < 0.8)
    (k_nan, v_inf), _ = dropped_nan(k, v, keep)
    _configs_agree_in_bits(mf.forward, configs, ("mask", s), q, k_nan, v_inf,
                           causal=False, key_padding_mask=keep)
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    _configs_agree_in_bits(mf.forward, configs, ("btnh", s), t(q), t(k), t(v),
                           causal=True, btnh=True)


def _prefill_configs_agree_in_bits(configs, cases, d128=True):
    """The mosaic forward under each of ``configs`` gives the first's bits, no NaN, on
    fresh D=256 inputs (B=2, Hq=8, Hkv=2) for each case ``(Sq, Skv, causal)`` (the
    queries the last Sq of the first Skv rows where Sq <= Skv, else the first Sq);
    ``d128``: then a D=128 causal prefill at S=2100."""
    from jaxattn.backends.mosaic import forward as mf
    q, k, v = rand_qkv(2, 8, 2, 2900, 2900, 256, jnp.bfloat16)
    for sq, skv, causal in cases:
        lo = max(skv - sq, 0)
        _configs_agree_in_bits(mf.forward, configs, (sq, skv, causal),
                               q[:, :, lo:lo + sq], k[:, :, :skv], v[:, :, :skv],
                               causal=causal)
    if d128:
        qd, kd, vd = rand_qkv(2, 8, 2, 2100, 2100, 128, jnp.bfloat16)
        _configs_agree_in_bits(mf.forward, configs, 128, qd, kd, vd, causal=True)


#: ``(Sq, Skv, causal)`` of the D=256 prefill bits tests of the SPLIT fold's launches:
#: causal one and three SPLITs, a chunk, Sq > Skv (tiles that see no key), non-causal
#: with a partial last block (the key mask, the K/V boxes) and with whole blocks (their
#: loops differ: a launch option right in one was wrong in the other, docs/mosaic.md's
#: retired ``q_in_registers``).
_FOLD_CASES = ((1000, 1000, True), (2900, 2900, True), (300, 2900, True),
               (1000, 300, True), (2100, 2100, False), (2048, 2048, False))


def _backward_configs_agree_in_bits(configs, d, cases):
    """The mosaic backward's gradients under each ``BwdConfig`` of ``configs`` equal the
    first's in bits, no NaN, on fresh inputs (B=2, Hq=8, Hkv=2, head dim ``d``) for each
    case ``(Sq, Skv, causal, masked)``; ``masked``: a random key padding mask over the
    house's poison in the dropped keys (NaN in K, inf in V: ``dropped_nan``)."""
    from jaxattn.backends.mosaic import backward as mb
    rng = np.random.default_rng()
    for sq, skv, causal, masked in cases:
        q, k, v = rand_qkv(2, 8, 2, sq, skv, d, jnp.bfloat16)
        do = rand_qkv(2, 8, 8, sq, skv, d, jnp.bfloat16)[0]
        keep = None
        if masked:
            keep = jnp.asarray(rng.random((2, skv)) > 0.2).at[:, -1].set(True)
            (k, v), _ = dropped_nan(k, v, keep)
        out, lse = jaxattn.attention(q, k, v, causal=causal, return_lse=True,
                                     key_padding_mask=keep, backend="mosaic")
        _configs_agree_in_bits(
            lambda *a, config, **kw: mb.backward(*a, config=config, **kw), configs,
            (d, sq, skv, causal, masked), q, k, v, out, lse, do, causal=causal,
            key_padding_mask=keep)


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_kv_boxes_keep_bits_on_gpu():
    """On sm90, MosaicConfig(kv_boxes=True) (the default: K and V read in place as one
    TMA box of 64 rows per column tile, TMA's zeros past Skv; S and P V as one product
    per column tile) gives the bits of the copy padded to whole blocks
    (kv_boxes=False), out and lse, no NaN: Skv off the 8-row grid in a decode step
    split and unsplit, 4 queries per head, a causal prefill and chunk, a non-causal
    prefill, a key padding mask with NaN in dropped K and inf in dropped V,
    per-sequence offsets, [B, S, H, D], D = 64 and 256; twice, on fresh inputs."""
    from jaxattn.backends.mosaic import forward as mf
    rng = np.random.default_rng()
    pad, boxes = mf.MosaicConfig(kv_boxes=False), mf.MosaicConfig(kv_boxes=True)

    def agree(q, k, v, tag, config=None, **kw):
        """The boxed call's out and lse equal the padded copy's in bits, no NaN
        (``config``: fields set on both)."""
        both = [dataclasses.replace(c, **(config or {})) for c in (pad, boxes)]
        _configs_agree_in_bits(mf.forward, both, tag, q, k, v, **kw)

    for _ in range(2):
        q, k, v = rand_qkv(2, 32, 8, 1100, 1100, 128, jnp.bfloat16)
        cases = [  # (b, hq, sq, skv, causal, config)
            (2, 32, 1, 1025, True, {}), (1, 32, 1, 1099, True, {}),  # split
            (2, 32, 1, 1025, True, {"split_decode": False}),
            (2, 32, 4, 1090, True, {}), (2, 32, 100, 1100, True, {}),
            (1, 32, 70, 1001, True, {}), (2, 32, 300, 1097, False, {}),
            (2, 8, 1, 137, True, {})]
        for b, hq, sq, skv, causal, config in cases:
            agree(q[:b, :hq, skv - sq:skv], k[:b, :, :skv], v[:b, :, :skv],
                  (b, hq, sq, skv, causal, config), config, causal=causal)
        # A key padding mask (NaN in dropped K, inf in dropped V) and per-sequence
        # offsets, Skv = 1100 (a partial last block, a multiple of 4 and not of 8).
        m = rng.random((2, 1100)) > 0.3
        m[:, -1] = True
        keep = jnp.asarray(m)
        (k_nan, v_inf), _ = dropped_nan(k, v, keep)
        offs = jnp.asarray([1099 - 7, 1050], jnp.int32)
        for sq, causal, kw in ((300, False, {"key_padding_mask": keep}),
                               (1, True, {"key_padding_mask": keep}),
                               (8, True, {"causal_offsets": offs})):
            kk, vv = (k_nan, v_inf) if "key_padding_mask" in kw else (k, v)
            agree(q[:, :, 1100 - sq:], kk, vv, (sq, causal, list(kw)), causal=causal, **kw)
        # [B, S, H, D], and D = 64 and 256.
        t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
        for sq, skv in ((1, 1025), (100, 1097)):
            agree(t(q[:, :, skv - sq:skv]), t(k[:, :, :skv]), t(v[:, :, :skv]),
                  ("btnh", sq, skv), causal=True, btnh=True)
        for d in (64, 256):
            qd, kd, vd = rand_qkv(2, 8, 8, 100, 1003, d, jnp.bfloat16)
            for sq in (1, 100):
                agree(qd[:, :, -sq:], kd, vd, (d, sq), causal=True)


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_late_rowsum_keeps_bits_on_gpu():
    """On sm90, MosaicConfig(late_rowsum=True) (a block's row sum and l's update taken
    after its P V wgmma is issued, in the product's scope) gives late_rowsum=False's
    bits (so does the default, which picks one of the two by shape),
    out and lse, no NaN: a causal prefill and chunk with a partial last block, a
    non-causal prefill, D = 64 and 256, a decode step split and unsplit, 4 queries per
    head, a key padding mask (NaN in dropped K, inf in dropped V), pages of 16 and 64
    keys with ragged lengths."""
    from jaxattn.backends.mosaic import forward as mf
    rng = np.random.default_rng()
    configs = [mf.MosaicConfig(late_rowsum=False), mf.MosaicConfig(late_rowsum=True)]

    def agree(f, tag, *args, **kw):
        _configs_agree_in_bits(f, configs, tag, *args, **kw)

    q, k, v = rand_qkv(2, 32, 8, 5000, 5000, 128, jnp.bfloat16)
    for sq, skv, causal in ((1100, 1100, True), (300, 1097, True), (1100, 1100, False),
                            (1, 5000, True), (4, 1090, True)):
        agree(mf.forward, (sq, skv, causal), q[:, :, skv - sq:skv], k[:, :, :skv],
              v[:, :, :skv], causal=causal)
    unsplit = [dataclasses.replace(c, split_decode=False) for c in configs]
    _configs_agree_in_bits(mf.forward, unsplit, "unsplit", q[:, :, -1:], k, v, causal=True)
    for d in (64, 256):
        qd, kd, vd = rand_qkv(2, 8, 8, 1003, 1003, d, jnp.bfloat16)
        agree(mf.forward, d, qd, kd, vd, causal=True)
    _masked_and_paged_decode_agree(agree, rng, q, k, v)


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_smem_state_keeps_bits_on_gpu():
    """On sm90, MosaicConfig(compute_wgs=1, smem_state=True) (the state folded across
    SPLITs in SMEM, merged 64 columns at a time; the lse rows in the ring's SMEM) and
    ``smem_state``'s default (with ``gmem_state=False``: that launch at D=256 past one
    SPLIT) give the bits of two compute warpgroups with the state in registers and of
    the default, out and lse, no NaN:
    D=256 causal prefills of one and three SPLITs, a chunk with a partial last block,
    non-causal with a partial last block (the key mask); D=128 causal."""
    from jaxattn.backends.mosaic import forward as mf
    configs = [mf.MosaicConfig(smem_state=False),
               # (persistent=0: at D=128 S=2100 the default is persistent)
               mf.MosaicConfig(compute_wgs=1, smem_state=True, persistent=0),
               mf.MosaicConfig(gmem_state=False), mf.MosaicConfig()]
    _prefill_configs_agree_in_bits(configs, ((1000, 1000, True), (2900, 2900, True),
                                             (300, 2900, True), (2100, 2100, False)))


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_gmem_state_keeps_bits_on_gpu():
    """On sm90, MosaicConfig(gmem_state=True) (two compute warpgroups, the state folded
    across SPLITs in a global scratch, merged 64 columns at a time from and to the
    registers), with and without the K/V multicast (the default at D=256 past one
    SPLIT: both), gives the bits of two compute warpgroups with the state in registers
    and of the SMEM state (``gmem_state=False``'s one warpgroup), out and lse, no NaN:
    D=256 causal prefills of one and three SPLITs, a chunk, Sq > Skv, non-causal with a
    partial last block (the key mask); D=128 causal."""
    from jaxattn.backends.mosaic import forward as mf
    configs = [mf.MosaicConfig(smem_state=False), mf.MosaicConfig(gmem_state=False),
               mf.MosaicConfig(gmem_state=True, kv_multicast=False), mf.MosaicConfig()]
    _prefill_configs_agree_in_bits(configs, _FOLD_CASES)


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_merge_arrive_keeps_bits_on_gpu():
    """On sm90, the ping-pong arrival of a SPLIT's first S made before the previous
    SPLIT's merge (``merge_arrive``: the default with ``gmem_state``, D=256 past one
    SPLIT) gives the bits of the arrival in place, with the state in the global scratch
    and in registers (two compute warpgroups; at D=128 on the persistent grid), out and
    lse, no NaN: D=256 causal one and three SPLITs (the second warpgroup's rows see one
    SPLIT more at Skv=2900: one warpgroup's fold ends where the other's goes on), a
    chunk, Sq > Skv, non-causal with a partial last block; D=128 causal. The same for
    ``last_merge_arrive`` (warpgroup 0's last merge too) on and off (its default: on
    non-causal)."""
    from jaxattn.backends.mosaic import forward as mf
    configs = [mf.MosaicConfig(smem_state=False),
               mf.MosaicConfig(smem_state=False, merge_arrive=True),
               mf.MosaicConfig(merge_arrive=False), mf.MosaicConfig(),
               mf.MosaicConfig(last_merge_arrive=True),
               mf.MosaicConfig(last_merge_arrive=False)]
    _prefill_configs_agree_in_bits(configs, _FOLD_CASES)


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_three_warpgroups_keep_bits_on_gpu():
    """On sm90, three compute warpgroups (``compute_wgs=3``: 192-row tiles, the
    ping-pong as a ring of turns, ``registers3``), on the persistent grid and on one
    CTA a tile, and the default (three at D=64 past the persistent grid's 64 key
    blocks a tile, and on it non-causal, or causal where ``c3_causal_pays``) give two
    warpgroups' bits, out and lse, no NaN, with no hang: at D=64 (B=2, Hq=8, Hkv=2)
    each of the SPLIT fold's cases (causal one and three SPLITs, a chunk, Sq > Skv,
    non-causal with a partial last block and with whole blocks) and 4200 keys causal
    and not (the default's three), a key padding mask over NaN in the dropped keys' K
    and V, and JAX's ``[B, S, H, D]`` layout; at D=128 causal three SPLITs and
    non-causal whole blocks. Also three on dynamic slots (``static_slots=False``) on
    every case: the default's slots for causal items of three warpgroups on the
    persistent grid (``auto_static_slots``)."""
    from jaxattn.backends.mosaic import forward as mf
    configs = [mf.MosaicConfig(compute_wgs=2), mf.MosaicConfig(),
               mf.MosaicConfig(compute_wgs=3), mf.MosaicConfig(compute_wgs=3, persistent=0),
               mf.MosaicConfig(compute_wgs=3, static_slots=False)]
    rng = np.random.default_rng()
    for d, cases in ((64, (*_FOLD_CASES, (4200, 4200, True), (4200, 4200, False))),
                     (128, ((2900, 2900, True), (2048, 2048, False)))):
        q, k, v = rand_qkv(2, 8, 2, 4200, 4200, d, jnp.bfloat16)
        for sq, skv, causal in cases:
            lo = max(skv - sq, 0)
            _configs_agree_in_bits(mf.forward, configs, (d, sq, skv, causal),
                                   q[:, :, lo:lo + sq], k[:, :, :skv], v[:, :, :skv],
                                   causal=causal)
        if d == 64:
            _mask_and_layout_agree(configs, rng, q, k, v, 2100)


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_defer_store_wait_keeps_bits_on_gpu():
    """On sm90, ``defer_store_wait`` (an item's output stores awaited only before their
    SMEM is next written) gives the default's bits, out and lse, no NaN, with no hang,
    on the persistent grid with several items a CTA: D=64 (three warpgroups and two)
    and D=128, causal and not, a partial last tile and block (2000 rows), a key
    padding mask over NaN in the dropped keys' K and V, JAX's layout."""
    from jaxattn.backends.mosaic import forward as mf
    rng = np.random.default_rng()
    for d in (64, 128):
        configs = [mf.MosaicConfig(), mf.MosaicConfig(defer_store_wait=True),
                   mf.MosaicConfig(compute_wgs=2, defer_store_wait=True)]
        q, k, v = rand_qkv(4, 16, 4, 2048, 2048, d, jnp.bfloat16)
        for s, causal in ((2048, True), (2048, False), (2000, True), (2000, False)):
            _configs_agree_in_bits(mf.forward, configs, (d, s, causal), q[:, :, :s],
                                   k[:, :, :s], v[:, :, :s], causal=causal)
        _mask_and_layout_agree(configs, rng, q, k, v, 1500)


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_skip_padding_rows_keep_bits_on_gpu():
    """On sm90, ``skip_padding_rows`` (a compute warpgroup whose rows are all padding
    visits no block) gives the default's bits, out and lse, no NaN, with no hang:
    D=64 at 1000 rows (the last 192-row tile's last two warpgroups padding) and 960
    (the last 128-row tile's second), causal and not, three warpgroups on either
    grid and two, a causal chunk of 100 queries on 1100 keys (40 rows of lead), a key
    padding mask over NaN in the dropped keys' K and V, JAX's layout; D=128 at 960
    rows causal and not. The first configuration computes the padding rows, the
    default skips them where not causal and, causal, for three warpgroups over at most
    32 key blocks (``skip_padding_rows=None``), the others always (the last with
    ``opaque_bounds``, the item's bounds behind an optimisation barrier)."""
    from jaxattn.backends.mosaic import forward as mf
    rng = np.random.default_rng()
    skip = functools.partial(mf.MosaicConfig, skip_padding_rows=True)
    noskip = mf.MosaicConfig(skip_padding_rows=False)
    for d, configs, cases in (
            (64, [noskip, mf.MosaicConfig(), skip(), skip(compute_wgs=2),
                  skip(compute_wgs=3), skip(compute_wgs=3, persistent=0),
                  skip(compute_wgs=3, opaque_bounds=True)],
             ((1000, 1000, True), (1000, 1000, False), (960, 960, True),
              (960, 960, False), (100, 1100, True))),
            (128, [noskip, mf.MosaicConfig(), skip()],
             ((960, 960, True), (960, 960, False)))):
        q, k, v = rand_qkv(2, 8, 2, 1100, 1100, d, jnp.bfloat16)
        for sq, skv, causal in cases:
            lo = skv - sq
            _configs_agree_in_bits(mf.forward, configs, (d, sq, skv, causal),
                                   q[:, :, lo:lo + sq], k[:, :, :skv], v[:, :, :skv],
                                   causal=causal)
        if d == 64:
            _mask_and_layout_agree(configs, rng, q, k, v, 1000)


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_opaque_bounds_keep_bits_on_gpu():
    """On sm90, ``opaque_bounds`` (the item's block bounds behind an optimisation
    barrier; by default on for D=64 causal prefills on the persistent grid past 16 key
    blocks) gives the bits without it, out and lse, no NaN: D=64 causal at 1100 keys
    (18 blocks: the default takes the barrier) and 2100 (33), a chunk of 300 queries
    on 2100 keys, and non-causal at 2100 (the default without it); the default, and
    two and three warpgroups with it, the latter skipping padding rows."""
    from jaxattn.backends.mosaic import forward as mf
    configs = [mf.MosaicConfig(opaque_bounds=False), mf.MosaicConfig(),
               mf.MosaicConfig(opaque_bounds=True, compute_wgs=2),
               mf.MosaicConfig(opaque_bounds=True, compute_wgs=3, skip_padding_rows=True)]
    q, k, v = rand_qkv(2, 8, 2, 2100, 2100, 64, jnp.bfloat16)
    for sq, skv, causal in ((1100, 1100, True), (2100, 2100, True), (300, 2100, True),
                            (2100, 2100, False)):
        lo = skv - sq
        _configs_agree_in_bits(mf.forward, configs, (64, sq, skv, causal),
                               q[:, :, lo:lo + sq], k[:, :, :skv], v[:, :, :skv],
                               causal=causal)


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_q_boxes_keep_bits_on_gpu():
    """On sm90, ``MosaicConfig(q_boxes=True)`` (the default: Q and O at Sq rows, the
    last tile's rows past Sq TMA's zeros and a clipped store; the lse sliced) gives the
    padded copy's bits, out and lse (an lse store past Sq once landed on the next
    head's rows), no NaN, and the outputs have Sq rows: D=64
    with three warpgroups (4200 rows: 192-row tiles) causal and not, JAX's layout, a
    key padding mask over NaN in dropped K and V; D=128 (two warpgroups, 5000 rows)
    causal; a chunk with a causal lead (the copy either way)."""
    from jaxattn.backends.mosaic import forward as mf
    configs = [mf.MosaicConfig(q_boxes=False), mf.MosaicConfig()]  # (the default: True)
    rng = np.random.default_rng()
    q, k, v = rand_qkv(2, 8, 2, 5000, 5000, 64, jnp.bfloat16)
    for sq, skv, causal in ((4200, 4200, True), (4200, 4200, False), (4000, 4160, True)):
        lo = skv - sq
        _configs_agree_in_bits(mf.forward, configs, (64, sq, skv, causal),
                               q[:, :, lo:skv], k[:, :, :skv], v[:, :, :skv], causal=causal)
    _mask_and_layout_agree(configs, rng, q, k, v, 4200)
    qd, kd, vd = rand_qkv(2, 8, 2, 5000, 5000, 128, jnp.bfloat16)
    _configs_agree_in_bits(mf.forward, configs, 128, qd, kd, vd, causal=True)


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_static_slots_keep_bits_on_gpu():
    """On sm90, ``MosaicConfig(static_slots=True)`` (the unmasked blocks' loop unrolled
    by the K/V ring's two slots, branched on the slot of each SPLIT's first block)
    gives ``static_slots=False``'s bits, out and lse, no NaN: at D=256 each of the
    SPLIT fold's cases (the default's launches: the state in GMEM, SMEM, registers)
    and D=128 causal; at D=64 the persistent grid (a CTA's items of odd and even block
    counts in turn: the ring's slot at an item's first block changes) causal and not,
    three warpgroups (4200 keys), a chunk with a lead, a key mask over poisoned keys
    and JAX's layout; decode steps (Sq 1 and 4) and the split decode."""
    from jaxattn.backends.mosaic import forward as mf
    configs = [mf.MosaicConfig(static_slots=False), mf.MosaicConfig(static_slots=True)]
    _prefill_configs_agree_in_bits(configs, _FOLD_CASES)
    rng = np.random.default_rng()
    q, k, v = rand_qkv(2, 8, 2, 4200, 4200, 64, jnp.bfloat16)
    for sq, skv, causal in ((2100, 2100, True), (2100, 2100, False), (4200, 4200, True),
                            (4200, 4200, False), (1000, 4160, True), (1, 4200, True),
                            (4, 3000, True)):
        lo = skv - sq
        _configs_agree_in_bits(mf.forward, configs, (64, sq, skv, causal),
                               q[:, :, lo:skv], k[:, :, :skv], v[:, :, :skv], causal=causal)
    _mask_and_layout_agree(configs, rng, q, k, v, 2100)
    qd, kd, vd = rand_qkv(2, 32, 8, 1, 20000, 128, jnp.bfloat16)
    _configs_agree_in_bits(mf.forward, configs, "split decode", qd, kd, vd, causal=True)


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
@pytest.mark.parametrize("d", [64, 128])
def test_static_slots_keep_backward_bits_on_gpu(d):
    """On sm90, ``BwdConfig(static_slots=True)`` (the dK/dV kernel's steps unrolled by
    the ring's two slots, branched on the slot of each run's first step: a causal
    head's masked and unmasked runs start on either slot) gives ``static_slots=False``'s
    gradients in bits, no NaN: causal with a partial last block, non-causal, a key
    padding mask over poisoned keys, more queries than keys; GQA (four heads' runs a
    KV block)."""
    from jaxattn.backends.mosaic import backward as mb
    configs = [mb.BwdConfig(static_slots=False), mb.BwdConfig(static_slots=True)]
    _backward_configs_agree_in_bits(configs, d, ((1000, 1000, True, False),
                                                 (1024, 1024, False, False),
                                                 (1000, 1000, True, True),
                                                 (1000, 300, True, False)))


def _transposed_products(d):
    """A kernel of one warpgroup over ``q, k [64, d]``, ``x, xt [64, 64]`` bf16 (``xt``
    = ``x``'s transpose) that returns ``(Q K^T, K Q^T, x K, xt^T K)`` fp32: the dQ
    kernel's scores (Q by K^T, both from SMEM), the dK/dV kernel's (K by Q^T), the dQ
    kernel's product dS K (dS in registers) and that product with dS^T staged in SMEM
    as the dK/dV kernel holds it, read through a transposed view (what a dQ formed in
    the dK/dV kernel would issue)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from jaxattn.backends.mosaic import backward as mb
    from jaxattn.backends.mosaic import forward as mf
    n, bf16, f32 = 64, jnp.bfloat16, jnp.float32

    def body(q_ref, k_ref, x_ref, xt_ref, s_ref, st_ref, y_ref, yt_ref):
        def scoped(q_s, k_s, x_s, xt_s, o_nn, o_nd, bars):
            for i, (src, dst) in enumerate(((q_ref, q_s), (k_ref, k_s), (x_ref, x_s),
                                            (xt_ref, xt_s))):
                plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
            for i in range(4):
                plgpu.barrier_wait(bars.at[i])
            x = mf.load_ref(x_s, layout=plgpu.Layout.WGMMA)
            for (a, b, cols), buf, out in (((q_s, mb._t(k_s), n), o_nn, s_ref),
                                           ((k_s, mb._t(q_s), n), o_nn, st_ref),
                                           ((x, k_s, d), o_nd, y_ref),
                                           ((mb._t(xt_s), k_s, d), o_nd, yt_ref)):
                buf[...] = mb._wgmma(a, b, (n, cols))  # one product live at a time
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(buf, out)
                plgpu.wait_smem_to_gmem(0)

        tile = lambda cols: plgpu.SMEM((n, cols), bf16,
                                       transforms=mf._smem_transforms(cols, 2))
        pl.run_scoped(scoped, tile(d), tile(d), tile(n), tile(n), plgpu.SMEM((n, n), f32),
                      plgpu.SMEM((n, d), f32), plgpu.Barrier(num_barriers=4))

    return plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct((n, n), f32),) * 2
        + (jax.ShapeDtypeStruct((n, d), f32),) * 2,
        compiler_params=plgpu.CompilerParams())


def _check_transposed_products(q, k, x, s, st, y, yt):
    """Each of the kernel's four products within fp32 sums' error of float64 on the
    same bf16 inputs (1e-4 of the largest: a wrong operand or view is off by the
    values themselves), none NaN: so that equal bits are equal right answers."""
    q64, k64, x64 = (np.asarray(a, np.float64) for a in (q, k, x))
    for got, want in ((s, q64 @ k64.T), (st, k64 @ q64.T), (y, x64 @ k64), (yt, x64 @ k64)):
        got = np.asarray(got, np.float64)
        assert not np.isnan(got).any()
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@needs_api
@pytest.mark.parametrize("d", [64, 256])
def test_transposed_products_lower_for_cuda(d):
    """The kernel of :func:`test_transposed_products_keep_bits_on_gpu` lowers for CUDA
    on a machine without a GPU (its SMEM views and wgmma operands are valid; the
    interpreter has no transposed SMEM view, so it does not run here)."""
    s = jax.ShapeDtypeStruct
    args = (s((64, d), jnp.bfloat16),) * 2 + (s((64, 64), jnp.bfloat16),) * 2
    text = jax.jit(_transposed_products(d)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
@pytest.mark.parametrize("d", [64, 128, 256])
def test_transposed_products_keep_bits_on_gpu(d):
    """On sm90, the dK/dV kernel's scores K Q^T are the transpose of the dQ kernel's
    Q K^T bit for bit, and dS K is the same product whether dS sits in registers (the
    dQ kernel) or is read from dS^T in SMEM through a transposed view: the two facts a
    dQ formed in the dK/dV kernel needs to keep the dQ kernel's bits (notes,
    "thirty-fourth stop"). Inputs scaled so that the fp32 sums round (random normal
    values times 8)."""
    seed = int(np.random.default_rng().integers(2**16))
    rng = np.random.default_rng(seed)
    q, k = (normal(rng, (64, d), jnp.bfloat16, scale=8.0) for _ in range(2))
    x = normal(rng, (64, 64), jnp.bfloat16, scale=8.0)
    s, st, y, yt = jax.jit(_transposed_products(d))(q, k, x, x.T)
    _check_transposed_products(q, k, x, s, st, y, yt)
    assert bits_equal(s, st.T), f"seed {seed}"
    assert bits_equal(y, yt), f"seed {seed}"


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
@pytest.mark.parametrize("d", [64, 128])
def test_fused_dq_keeps_bits_on_gpu(d):
    """On sm90, BwdConfig(fused_dq=True) (dQ added in the dK/dV kernel in the dQ
    kernel's order) gives the default backward's dQ, dK and dV in bits, no NaN, twice
    in a row (its semaphores outlive a launch: the second call finds them back at
    zero), and so does ``dq_signal="step_end"``: causal and non-causal, a query tail,
    Sq > Skv (tiles that see no key), a chunk (Sq < Skv); GQA (four query heads a KV
    head). Needs ``test_transposed_products_keep_bits_on_gpu`` (the same dS in both
    kernels)."""
    from jaxattn.backends.mosaic import backward as mb
    configs = [mb.BwdConfig(), mb.BwdConfig(fused_dq=True), mb.BwdConfig(fused_dq=True),
               mb.BwdConfig(fused_dq=True, dq_signal="step_end")]
    _backward_configs_agree_in_bits(configs, d, ((1024, 1024, True, False),
                                                 (1024, 1024, False, False),
                                                 (1000, 1024, True, False),
                                                 (1024, 512, True, False),
                                                 (256, 1024, True, False)))


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_sm_ids_fit_gmem_state_slots_on_gpu():
    """On sm90, the SM id that picks ``gmem_state``'s scratch slot (``sm_id``, PTX
    ``%smid``) is below ``GMEM_STATE_SLOTS`` on every CTA of an 8192-CTA launch, takes
    no more values than the GPU has SMs, and is one value across the warpgroup's
    threads (each CTA writes it from every thread's lanes)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from jaxattn.backends.mosaic import forward as mf
    n = 8192

    def body(o_ref):
        def scoped(buf):
            buf[...] = jnp.broadcast_to(mf.sm_id(), (128,))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(buf, o_ref.at[lax.axis_index("x")])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM((128,), jnp.int32))

    ids = np.asarray(jax.jit(plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((n, 128), jnp.int32), grid=(n,),
        grid_names=("x",), compiler_params=plgpu.CompilerParams()))())
    np.testing.assert_array_equal(ids, np.broadcast_to(ids[:, :1], ids.shape))
    seen = np.unique(ids[:, 0])
    sms = jax.devices()[0].core_count
    assert seen.min() >= 0 and seen.max() < mf.GMEM_STATE_SLOTS, seen
    assert 8 <= len(seen) <= sms, (len(seen), sms)


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_pv_split_keeps_bits_on_gpu():
    """On sm90, MosaicConfig(pv_split=True) (one 64-row tile a CTA: warpgroup 0's S and
    softmax, warpgroup 1's P V, the SPLIT's accumulator handed over in column halves)
    gives the bits of the default and of two compute warpgroups with the state in
    registers, out and lse, no NaN: D=256 causal prefills of one and three SPLITs
    (Skv off the block grid: the flat K/V), a chunk, Sq > Skv (tiles that see no
    key), non-causal on whole blocks and with a partial last block (the key mask:
    pv_split does not apply); D=128 causal."""
    from jaxattn.backends.mosaic import forward as mf
    configs = [mf.MosaicConfig(smem_state=False), mf.MosaicConfig(),
               mf.MosaicConfig(pv_split=True)]
    _prefill_configs_agree_in_bits(configs, (
        (1000, 1000, True), (2900, 2900, True), (300, 2900, True), (1000, 300, True),
        (2048, 2048, False), (2100, 2100, False)))


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_kv_multicast_keeps_bits_on_gpu():
    """On sm90, MosaicConfig(kv_multicast=True) (heads 2i and 2i + 1 in a cluster of two
    CTAs, each K/V block's TMA copy multicast into both) and the default (None: on
    past one SPLIT at D=256) give the bits of ``kv_multicast=False``, out and lse, no
    NaN: D=256 causal one and three SPLITs, a chunk, Sq > Skv, non-causal with a
    partial last block (the key mask: each CTA loads its keep values); D=128 on the
    grid of one CTA per tile (persistent=0) and the default's persistent grid (where
    it does not apply); a GQA group of 2 and of 4; with ``pv_split`` too."""
    from jaxattn.backends.mosaic import forward as mf
    configs = [mf.MosaicConfig(kv_multicast=False), mf.MosaicConfig(),
               mf.MosaicConfig(kv_multicast=True),
               mf.MosaicConfig(kv_multicast=True, pv_split=True)]
    _prefill_configs_agree_in_bits(configs, _FOLD_CASES, d128=False)
    for hkv in (4, 2):
        qd, kd, vd = rand_qkv(2, 8, hkv, 2100, 2100, 128, jnp.bfloat16)
        for extra in ({"persistent": 0}, {}):
            _configs_agree_in_bits(
                mf.forward, [dataclasses.replace(c, **extra) for c in configs],
                (128, hkv, extra), qd, kd, vd, causal=True)


def _masked_and_paged_decode_agree(agree, rng, q, k, v):
    """``agree(f, tag, *args, **kw)`` on a decode step of q's last row over [B=2, Hkv,
    5000, D] K and V under a key padding mask (NaN in dropped K, inf in dropped V), and
    from pages of 16 (NHD) and 64 (HND) keys in a shuffled pool with ragged lengths
    (5000 and 2100; NaN in unused slots)."""
    from jaxattn.backends.mosaic import forward as mf
    m = rng.random((2, 5000)) > 0.3
    m[:, -1] = True
    keep = jnp.asarray(m)
    (k_nan, v_inf), _ = dropped_nan(k, v, keep)
    agree(mf.forward, "mask", q[:, :, -1:], k_nan, v_inf, causal=True,
          key_padding_mask=keep)
    lens = np.array([5000, 2100])
    for ps, layout in ((16, "NHD"), (64, "HND")):
        kp, vp, table = ragged_cache(layout, ps, lens, k, v, seed=int(rng.integers(2**16)))
        agree(mf.paged_forward, (ps, layout), q[:, :, -1:], kp, vp, table,
              jnp.asarray(lens, jnp.int32), layout=layout)


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_two_ctas_an_sm_keeps_bits_on_gpu():
    """On sm90, MosaicConfig(ctas_per_sm=2), the default (the decode kernels without a
    producer warpgroup, two CTAs an SM; 2 ring slots at D=128 and 3) gives the bits of
    ctas_per_sm=1 (a producer warpgroup), out and lse, no NaN: the split decode past several
    SPLITs, on and off the 8-row grid, 4 queries a head, the unsplit decode (B=20),
    D = 64, a key padding mask with NaN in dropped K and inf in dropped V, pages of 16
    and 64 keys (both layouts, NaN in unused slots, ragged lengths), and CP's split
    states of a prefill chunk with per-sequence offsets; twice, on fresh inputs."""
    from jaxattn.backends.mosaic import forward as mf
    rng = np.random.default_rng()
    one = mf.MosaicConfig(ctas_per_sm=1)
    # the default: the split kernel's 2 ring slots at D=128, and 3 (Q's landing slot
    # shares the last V slot's SMEM); the unsplit decode's and CP's 2 (``stages``) and 3
    twos = (mf.MosaicConfig(),
            mf.MosaicConfig(split_decode_stages=3),
            mf.MosaicConfig(stages=3))

    def agree(f, tag, *args, **kw):
        _configs_agree_in_bits(f, (one, *twos), tag, *args, **kw)

    for _ in range(2):
        q, k, v = rand_qkv(2, 32, 8, 300, 5000, 128, jnp.bfloat16)
        for b, sq, skv in ((2, 1, 5000), (1, 1, 4097), (2, 4, 3000), (2, 1, 1090)):
            agree(mf.forward, (b, sq, skv), q[:b, :, -sq:], k[:b, :, :skv], v[:b, :, :skv],
                  causal=True)
        # the unsplit decode (B * Hkv >= SPLIT_DECODE_BELOW_CTAS), on and off the grid
        qb, kb, vb = rand_qkv(20, 32, 8, 1, 3000, 128, jnp.bfloat16)
        for skv in (3000, 2049):
            agree(mf.forward, ("unsplit", skv), qb, kb[:, :, :skv], vb[:, :, :skv],
                  causal=True)
        agree(mf.forward, "d64", *rand_qkv(2, 8, 8, 1, 3000, 64, jnp.bfloat16), causal=True)
        _masked_and_paged_decode_agree(agree, rng, q, k, v)
        agree(mf.split_partials, "cp", q, k, v, causal=True,
              causal_offsets=jnp.asarray([4700, 2000], jnp.int32))


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_splits_per_cta_keeps_bits_on_gpu():
    """On sm90, MosaicConfig(splits_per_cta=k): a CTA of the split decode takes k
    consecutive SPLITs, its ring running on across them and each split's state staged
    beside the ring (in column halves at D=128): the bits of one split a CTA
    (``splits_per_cta=1``, named: the default may change), out and lse, no NaN, with
    k = 2, 3 (the last CTA of a row has fewer) and None (enough to fill the GPU's CTA
    slots once): 5 SPLITs and one off the 8-row grid, 4 queries a head, D = 64, one
    CTA an SM (a producer warpgroup), a key padding mask with NaN in dropped K and inf
    in dropped V, and pages of 16 and 64 keys (both layouts, NaN in unused slots,
    ragged lengths: the short sequence's later splits empty); twice, on fresh inputs."""
    from jaxattn.backends.mosaic import forward as mf
    rng = np.random.default_rng()
    base = mf.MosaicConfig(splits_per_cta=1)
    several = (mf.MosaicConfig(splits_per_cta=2), mf.MosaicConfig(splits_per_cta=3),
               mf.MosaicConfig(splits_per_cta=None))

    def agree(f, tag, *args, configs=(base, *several), **kw):
        _configs_agree_in_bits(f, configs, tag, *args, **kw)

    for _ in range(2):
        q, k, v = rand_qkv(2, 32, 8, 4, 5000, 128, jnp.bfloat16)
        for b, sq, skv in ((2, 1, 5000), (1, 1, 4097), (2, 4, 3000)):
            agree(mf.forward, (b, sq, skv), q[:b, :, -sq:], k[:b, :, :skv], v[:b, :, :skv],
                  causal=True)
        # 40 SPLITs of one sequence: None takes 2 a CTA (264 CTA slots, 8 rows)
        agree(mf.forward, "long", *rand_qkv(1, 32, 8, 1, 40000, 128, jnp.bfloat16),
              causal=True)
        agree(mf.forward, "d64", *rand_qkv(2, 8, 8, 1, 3000, 64, jnp.bfloat16), causal=True)
        agree(mf.forward, "one CTA an SM", q[:, :, -1:], k, v, causal=True,
              configs=(mf.MosaicConfig(ctas_per_sm=1, splits_per_cta=1),
                       mf.MosaicConfig(ctas_per_sm=1, splits_per_cta=3)))
        _masked_and_paged_decode_agree(agree, rng, q, k, v)


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_key_mask_reads_kv_in_place_on_gpu():
    """On sm90, a key padding mask with NaN in the dropped keys of K and inf in V's
    (the kernel zeroes V's dropped rows in SMEM; XLA no longer zeroes a copy): the
    bits of the call on zeroed K and V, no NaN. Prefill, causal chunk, stacked decode
    (split past one SPLIT and not), two compute warpgroups and one."""
    from jaxattn.backends.mosaic import forward as mf
    rng = np.random.default_rng()
    q, k, v = rand_qkv(2, 32, 8, 1100, 1100, 128, jnp.bfloat16)
    for sq, skv, causal in ((300, 1100, False), (100, 1100, True), (1, 1100, True),
                            (1, 300, True), (4, 1090, True)):
        m = rng.random((2, skv)) > 0.3
        m[:, 64:128] = False  # a wholly dropped block
        m[:, -1] = True
        keep = jnp.asarray(m)
        (k_nan, v_inf), (kz, vz) = dropped_nan(k[:, :, :skv], v[:, :, :skv], keep)
        qs = q[:, :, skv - sq:skv]
        for cfg in (mf.MosaicConfig(), mf.MosaicConfig(compute_wgs=1, block_m=64)):
            want = mf.forward(qs, kz, vz, causal=causal, key_padding_mask=keep, config=cfg)
            got = mf.forward(qs, k_nan, v_inf, causal=causal, key_padding_mask=keep,
                             config=cfg)
            for x, y in zip(want, got, strict=True):
                assert not np.isnan(np.asarray(y, np.float32)).any(), (sq, skv, cfg)
                assert bits_equal(x, y), (sq, skv, causal, cfg)


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_stacked_queries_equal_prefill_rows_on_gpu():
    """On sm90, 2 to 8 queries per head (speculative verification) with the GQA group's
    heads and queries stacked in one tile (K and V read once per group) give the
    prefill's rows in bits, out and lse: queries across a block edge (126 to 129) and a
    SPLIT edge (1019 to 1026, the split decode at B=1), both layouts of q; no NaN."""
    q, k, v = rand_qkv(2, 32, 8, 1100, 1100, 128, jnp.bfloat16)
    full, full_lse = jaxattn.attention(q, k, v, return_lse=True, backend="mosaic")
    for sq, end, b in ((2, 130, 2), (8, 130, 2), (5, 1027, 1), (8, 1100, 2)):
        rows = slice(end - sq, end)
        qs, ks, vs = q[:b, :, rows], k[:b, :, :end], v[:b, :, :end]
        out, lse = jaxattn.attention(qs, ks, vs, return_lse=True, backend="mosaic")
        assert not np.isnan(np.asarray(out, np.float32)).any()
        assert bits_equal(out, full[:b, :, rows]), (sq, end, b)
        assert bits_equal(lse, full_lse[:b, :, rows]), (sq, end, b)
        t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
        be = registry.resolve("attention", "mosaic")
        out_t, _ = be.forward_with_lse_btnh(t(qs), t(ks), t(vs), causal=True,
                                            scale=128 ** -0.5)
        assert bits_equal(t(out_t), out), (sq, end, b, "[B, S, H, D]")


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_split_decode_state_rows_keep_bits_on_gpu():
    """On sm90 the split decode's states of every power-of-two row count the fold kernel
    tiles (8, 16 and 32 rows in ``fold_layout``, 64 in the WGMMA layout; from 4, 6, 12,
    20, 24 and 64 stacked rows) fold to the in-kernel fold's bits, out and lse, over
    three SPLITs with ragged per-sequence offsets (the second sequence's later split
    empty); no NaN."""
    from jaxattn.backends.mosaic import forward as mf
    for hq, sq in ((32, 1), (16, 3), (32, 3), (32, 5), (64, 3), (64, 8)):
        q, k, v = rand_qkv(2, hq, 8, sq, 2100, 128, jnp.bfloat16)
        offs = jnp.asarray([2100 - sq, 1000], jnp.int32)
        for kw in ({}, {"causal_offsets": offs}):
            want, got = (mf.forward(q, k, v, causal=True, config=mf.MosaicConfig(
                split_decode=split), **kw) for split in (False, True))
            for x, y in zip(want, got, strict=True):
                assert not np.isnan(np.asarray(y, np.float32)).any(), (hq, sq)
                assert bits_equal(x, y), (hq, sq, list(kw))


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_pdl_chains_keep_bits_on_gpu():
    """On sm90, kernels launched as programmatic dependents (``pdl``) read what the
    kernel before them wrote and write only after it has read: eight decode steps in one
    program, each step's query the last step's output (split kernel, then the fold
    reading its states; the next split kernel rewriting them), and the forward and
    backward of a prefill (the delta kernel reading the forward's output, dK/dV and dQ
    reading delta), in every mode (and the fold's own), equal in bits to ``"off"``, on
    fresh inputs, twice; no NaN. On JAX 0.11 and later the kernels are launched with
    the PDL attribute."""
    from jaxattn.backends.mosaic import backward as mb
    from jaxattn.backends.mosaic import forward as mf

    def decode(q, k, v, cfg):
        for _ in range(8):
            q = mf.forward(q, k, v, causal=True, config=cfg)[0]
        return (q,)

    def train(q, k, v, cfg):
        out, lse = mf.forward(q, k, v, causal=True, config=cfg)
        grads = mb.backward(q, k, v, out, lse, out, causal=True,
                            config=mb.BwdConfig(pdl=cfg.pdl))
        return (out, lse, *grads)

    modes = [{"pdl": "off"}, *({"pdl": m} for m in mf.PDL_MODES if m != "off"),
             {"pdl": "trigger", "fold_pdl": "wait"}, {"split_pdl": "both"}]
    for fn, shape in ((decode, (2, 32, 8, 1, 20000, 128)),
                      (train, (2, 8, 2, 1024, 1024, 128))):
        for _ in range(2):
            q, k, v = rand_qkv(*shape, jnp.bfloat16)
            want, *gots = (jax.jit(fn, static_argnums=3)(q, k, v, mf.MosaicConfig(**kw))
                           for kw in modes)
            for got in gots:
                for x, y in zip(want, got, strict=True):
                    assert not np.isnan(np.asarray(y, np.float32)).any(), fn
                    assert bits_equal(x, y), fn
    if tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11):
        text = jax.jit(decode, static_argnums=3).lower(q, k, v, mf.MosaicConfig()).as_text()
        assert "uses_pdl" in text


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [64, 128])
def test_dq_epilogue_scales_and_casts_as_xla_on_gpu(d, causal):
    """On sm90 the dQ kernel's epilogue (``dq * scale`` cast to bf16) gives the bits of
    the fp32 accumulator scaled and cast by XLA, as the backward did before: the same
    product and rounding. Two dQ tiles per CTA (the default), GQA, no NaN."""
    from jaxattn.backends.mosaic import backward as mb
    q, k, v = rand_qkv(2, 8, 2, 512, 512, d, jnp.bfloat16)
    do = rand_qkv(2, 8, 8, 512, 512, d, jnp.bfloat16)[0]
    out, lse = jaxattn.attention(q, k, v, causal=causal, return_lse=True, backend="mosaic")
    scale = d ** -0.5
    dq = mb.backward(q, k, v, out, lse, do, causal=causal, scale=scale)[0]
    acc = mb.dq_accumulate(q, k, v, do, lse, mb.delta(out, do), causal=causal, scale=scale)
    assert dq.dtype == jnp.bfloat16 and acc.dtype == jnp.float32
    assert not np.isnan(np.asarray(dq, np.float32)).any()
    assert bits_equal(dq, (acc * scale).astype(jnp.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_dq_in_smem_keeps_bits_on_gpu():
    """On sm90, BwdConfig(dq_in_smem=True) (the dQ kernel's running dQ in its fp32
    output tile, each block's product added 64 columns at a time; the default where
    D > 128) gives False's gradients in bits, no NaN: D=256 causal with a partial last
    block and non-causal, GQA, dQ scaled and cast in the kernel; D=128 (two dQ tiles a CTA); and dQ
    continued across two key ranges (CP's path), scaled and cast at the last."""
    from jaxattn.backends.mosaic import backward as mb
    # (dq_pair, the default at D=256, keeps dQ in registers: the one-warpgroup kernel's
    # option is CP's key ranges' path)
    configs = [mb.BwdConfig(dq_in_smem=False, dq_pair=False),
               mb.BwdConfig(dq_in_smem=True, dq_pair=False)]
    _backward_configs_agree_in_bits(configs, 256, ((1000, 1000, True, False),
                                                   (1024, 1024, False, False)))
    _backward_configs_agree_in_bits(configs, 128, ((1024, 1024, True, False),))
    q, k, v = rand_qkv(2, 8, 2, 512, 1024, 256, jnp.bfloat16)
    do = rand_qkv(2, 8, 8, 512, 1024, 256, jnp.bfloat16)[0]
    out, lse = jaxattn.attention(q, k, v, causal=True, return_lse=True, backend="mosaic")
    _configs_agree_in_bits(
        lambda *a, config, **kw: mb.backward_over_ranges(*a, config=config, **kw),
        configs, "ranges", q, k, v, out, lse, do, ranges=[(0, 512), (512, 1024)],
        offsets=jnp.asarray([512, 512], jnp.int32), causal=True)


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_d256_backward_options_keep_bits_on_gpu():
    """On sm90 at D=256, the backward's launch options give the same gradients in bits,
    no NaN: the default (dK and dV by one kernel, a warpgroup each: ``dkdv_pair``; the
    dQ kernel's K in two slots, V in one freed after dP: ``dq_split_ring``), each of
    those two off, both off (dK and dV by two kernels), and the two kernels with two KV
    blocks a CTA (``dv_wgs=2``: no V or delta loaded; ``dk_wgs=2``: one ring slot).
    Causal with a partial last block, non-causal, and a key padding mask over NaN in
    dropped K and V; GQA."""
    from jaxattn.backends.mosaic import backward as mb
    two = dict(dkdv_pair=False, dq_split_ring=False)
    configs = [mb.BwdConfig(), mb.BwdConfig(dkdv_pair=False), mb.BwdConfig(dq_split_ring=False),
               mb.BwdConfig(**two), mb.BwdConfig(**two, dv_wgs=2),
               mb.BwdConfig(**two, dk_wgs=2)]
    _backward_configs_agree_in_bits(configs, 256, ((1000, 1000, True, False),
                                                   (1024, 1024, False, False),
                                                   (1000, 1000, True, True)))


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
@pytest.mark.parametrize("d", [128, 256])
def test_dq_pair_keeps_bits_on_gpu(d):
    """On sm90, BwdConfig(dq_pair=True) (the dQ kernel's query tile on two compute
    warpgroups: S and P on one, dP and dS on the other, each adding dS K to half of
    dQ's columns) gives the one-warpgroup kernel's gradients in bits, no NaN: causal
    with a partial last block, non-causal, a key padding mask over NaN in dropped K and
    V, and more queries than keys (query tiles that see no key); GQA."""
    from jaxattn.backends.mosaic import backward as mb
    configs = [mb.BwdConfig(dq_pair=False), mb.BwdConfig(dq_pair=True)]
    _backward_configs_agree_in_bits(configs, d, ((1000, 1000, True, False),
                                                 (1024, 1024, False, False),
                                                 (1000, 1000, True, True),
                                                 (1000, 300, True, False)))


@pytest.mark.gpu
@pytest.mark.skipif(mosaic_backend.unavailable_reason() is not None,
                    reason=str(mosaic_backend.unavailable_reason()))
def test_fp32_is_the_pallas_backends():
    """On sm90, the mosaic backend's fp32 calls equal the pallas backend's in bits: the
    forward with its lse, the gradients, paged KV and CP."""
    from jaxattn import cp, paged
    q, k, v = rand_qkv(2, 4, 2, 100, 300, 64, jnp.float32)
    mask = jnp.asarray(np.arange(300)[None].repeat(2, 0) % 7 != 2)
    for fn in (lambda be: jaxattn.attention(q, k, v, key_padding_mask=mask,
                                            return_lse=True, backend=be),
               lambda be: jax.grad(lambda q, k, v: jaxattn.attention(
                   q, k, v, backend=be).sum(), (0, 1, 2))(q, k, v),
               lambda be: cp.forward_with_lse(q, k, v, cp_world_size=2, backend=be)):
        got, want = fn("mosaic"), fn("pallas")
        for a, b in zip(got, want, strict=True):
            assert not np.isnan(np.asarray(a)).any()
            assert bits_equal(a, b)
    # A paged cache of 5 pages of 64 keys per sequence (pallas reads pages in place:
    # multiples of BLOCK_N); sequences of 300 and 250 keys, one decode row each.
    kp = jnp.concatenate([k, k[:, :, :20]], axis=2)
    vp = jnp.concatenate([v, v[:, :, :20]], axis=2)
    pages = lambda x: x.reshape(2, 2, 5, 64, 64).transpose(0, 2, 1, 3, 4).reshape(  # noqa: E731
        10, 2, 64, 64)
    table = jnp.arange(10, dtype=jnp.int32).reshape(2, 5)
    lens = jnp.array([300, 250], jnp.int32)
    got, want = (paged.attention(q[:, :, -1:], pages(kp), pages(vp), table, lens,
                                 return_lse=True, backend=be) for be in ("mosaic", "pallas"))
    for a, b in zip(got, want, strict=True):
        assert not np.isnan(np.asarray(a)).any()
        assert bits_equal(a, b)


def test_empty_calls_need_no_kernel():
    """Skv = 0: rows that see no key (0, -inf) and zero gradients; Sq = 0: no rows.
    Neither launches a kernel, so both run on any platform."""
    q, k, v = rand_qkv(2, 4, 2, 5, 0, 64, jnp.bfloat16)
    out, lse = mosaic_backend.attention(q, k, v, causal=True, scale=0.125)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not np.asarray(out, np.float32).any() and np.isneginf(np.asarray(lse)).all()
    g = jax.grad(lambda q: mosaic_backend.attention(q, k, v, causal=True, scale=0.125)[0]
                 .astype(jnp.float32).sum())(q)
    assert not np.asarray(g, np.float32).any()
    q0 = q[:, :, :0]
    k1, v1 = rand_qkv(2, 4, 2, 1, 7, 64, jnp.bfloat16)[1:]
    out, lse = mosaic_backend.attention(q0, k1, v1, causal=False, scale=0.125)
    assert out.shape == (2, 4, 0, 64) and lse.shape == (2, 4, 0)


@needs_api
@pytest.mark.parametrize("d", [16, 128, 200])
def test_forward_and_gradient_lower_for_cuda(d):
    """The backend's forward and its gradient (delta, dK/dV, dQ) go through the Pallas
    -> Mosaic GPU lowering for CUDA on a CPU-only machine, D=16 zero-padded to 64, D=200
    to 256 (dK and dV by one kernel of two warpgroups there, a sum each)."""
    q = jax.ShapeDtypeStruct((2, 4, 100, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 2, 150, d), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((2, 150), jnp.bool_)

    def loss(q, k, v, m):
        out, lse = mosaic_backend.attention(q, k, v, m, causal=True, scale=0.3)
        return out.astype(jnp.float32).sum() + jnp.where(jnp.isinf(lse), 0, lse).sum()

    f = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
    text = f.trace(q, k, k, mask).lower(lowering_platforms=("cuda",)).as_text()
    # forward, delta, dK/dV, dQ
    assert text.count("custom_call @mosaic_gpu") == 4


@needs_api
def test_every_kernel_waits_for_the_one_before_it():
    """``pdl="both"`` (the default): every kernel of a step (the forward, the gradient's
    delta, dK/dV and dQ; the split decode and its fold) runs ``griddepcontrol.wait``
    once in the lowering for CUDA, and each but the split decode's split kernel (whose
    fold is not started early: ``split_pdl``) then ``griddepcontrol.launch_dependents``;
    with ``pdl="off"`` none does."""
    from jaxattn.backends.mosaic import backward as mb
    from jaxattn.backends.mosaic import forward as mf
    q = jax.ShapeDtypeStruct((2, 4, 100, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 2, 150, 128), jnp.bfloat16)
    qd = jax.ShapeDtypeStruct((1, 4, 1, 128), jnp.bfloat16)
    kd = jax.ShapeDtypeStruct((1, 2, 16384, 128), jnp.bfloat16)
    for pdl in (True, False):
        mode = "both" if pdl else "off"
        fcfg, bcfg = mf.MosaicConfig(pdl=mode), mb.BwdConfig(pdl=mode)

        def step(q, k, v, fcfg=fcfg, bcfg=bcfg):
            out, lse = mf.forward(q, k, v, causal=True, scale=0.3, config=fcfg)
            return out, mb.backward(q, k, v, out, lse, out, causal=True, scale=0.3,
                                    config=bcfg)

        def decode(q, k, v, fcfg=fcfg):
            return mf.forward(q, k, v, causal=True, scale=0.3, config=fcfg)

        for fn, args, kernels, triggers in ((step, (q, k, k), 4, 4),
                                            (decode, (qd, kd, kd), 2, 1)):
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("custom_call @mosaic_gpu") == kernels
            assert text.count("griddepcontrol.wait") == (kernels if pdl else 0), (pdl, fn)
            assert (text.count("griddepcontrol.launch_dependents")
                    == (triggers if pdl else 0)), (pdl, fn)


@needs_threads
@needs_interpret
def test_interpret_backend_wrapper():
    """The wrapper in interpret mode (one warpgroup per kernel): D=16 zero-padded to 64,
    a key padding mask, causal with Sq < Skv; forward and gradients (through the custom
    VJP, eagerly: one interpreted kernel per computation) against the fp32 reference;
    the backward from saved residuals and the paged entry against the op in bits."""
    from jaxattn.backends.mosaic import backward as mosaic_bwd
    from jaxattn.backends.mosaic import forward as mosaic_fwd
    seed = int(np.random.default_rng().integers(2**16))
    q, k, v = rand_qkv(1, 2, 1, 40, 70, 16, jnp.bfloat16, seed=seed)
    mask = jnp.asarray(np.arange(70)[None] % 9 != 4)
    kw = dict(causal=True, scale=0.25, interpret=True,
              fwd_config=mosaic_fwd.MosaicConfig(compute_wgs=1, block_m=64),
              bwd_config=mosaic_bwd.BwdConfig(dkdv_wgs=1, dq_wgs=1))
    out, lse = mosaic_backend.attention(q, k, v, mask, **kw)
    ref, ref_lse = reference.forward_fp32_with_lse(q, k, v, causal=True, scale=0.25,
                                                   key_padding_mask=mask)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert rel_err(out, ref) < 2e-2, f"seed {seed}"
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-2)
    w = normal(seed, q.shape)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w)

    got = jax.grad(loss(lambda q, k, v: mosaic_backend.attention(q, k, v, mask, **kw)[0]),
                   (0, 1, 2))(q, k, v)
    want = jax.grad(loss(lambda q, k, v: reference.forward_fp32(
        q, k, v, causal=True, scale=0.25, key_padding_mask=mask)), (0, 1, 2))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    for name, g, r in zip("qkv", got, want, strict=True):
        assert g.shape == r.shape and g.dtype == jnp.bfloat16, name
        assert not np.isnan(np.asarray(g, np.float32)).any(), name
        assert rel_err(g, r) < 5e-2, f"d{name} (seed {seed})"
    # The backward from saved residuals (the torch bridge's; no recomputed forward):
    # the custom VJP's gradients in bits, the head dim padded as the forward pads it.
    direct = mosaic_backend.backward(q, k, v, mask, out, lse, w.astype(jnp.bfloat16),
                                     jnp.zeros_like(lse), causal=True, scale=0.25,
                                     interpret=True, bwd_config=kw["bwd_config"])
    for name, g, h in zip("qkv", got, direct, strict=True):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint16),
                                      np.asarray(h).view(np.uint16),
                                      err_msg=f"d{name} (seed {seed})")
    # Per-sequence offsets (the paged path's; here the static one, Skv - Sq = 30) give
    # the same bits as the op, D padding included.
    po, pl_ = mosaic_backend.attention(q, k, v, mask,
                                       causal_offsets=jnp.array([30], jnp.int32), **kw)
    np.testing.assert_array_equal(np.asarray(po).view(np.uint16),
                                  np.asarray(out).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(pl_).view(np.uint32),
                                  np.asarray(lse).view(np.uint32))


@contextlib.contextmanager
def _mosaic_at_split_128():
    """The Mosaic kernels in interpret mode (one warpgroup of 64 rows) with SPLIT shrunk
    to 128 keys, so CP shards and cuts fit interpret-mode shapes; yields the kernels'
    keyword arguments and restores SPLIT afterwards."""
    from jaxattn import schedule
    from jaxattn.backends.mosaic import backward as mosaic_bwd
    from jaxattn.backends.mosaic import forward as mosaic_fwd
    old = (schedule.SPLIT, schedule.BLOCKS_PER_SPLIT)
    schedule.SPLIT, schedule.BLOCKS_PER_SPLIT = 128, 128 // schedule.BLOCK_N
    jax.clear_caches()
    try:
        yield dict(interpret=True,
                   fwd_config=mosaic_fwd.MosaicConfig(compute_wgs=1, block_m=64),
                   bwd_config=mosaic_bwd.BwdConfig(dkdv_wgs=1, dq_wgs=1))
    finally:
        schedule.SPLIT, schedule.BLOCKS_PER_SPLIT = old
        jax.clear_caches()


@pytest.mark.slow  # CI time (30 s): the H200 runs these cuts natively (tests/test_cp.py)
@needs_threads
@needs_interpret
@pytest.mark.parametrize("sq,skv,world,chunk,causal", [(1, 250, 1, 64, True),
                                                      (30, 250, 1, 64, True),
                                                      (256, 256, 2, 64, False)])
def test_interpret_cp_cuts_inside_a_split_keep_bits(sq, skv, world, chunk, causal):
    """CP whose key ranges cut the splits (SPLIT shrunk to 128 keys, chunks of 64): the
    Mosaic kernel carries its running state across each cut (``split_segment``), so the
    forward equals the single call in bits: stacked decode rows, a chunk with
    per-sequence offsets and a key mask, and a non-causal prefill."""
    from jaxattn import cp
    with _mosaic_at_split_128() as kw:
        seed = int(np.random.default_rng().integers(2**16))
        q, k, v = rand_qkv(1, 4, 2, sq, skv, 64, jnp.bfloat16, seed=seed)
        mask = jnp.asarray(np.arange(skv) % 7 != 3)[None] if sq < skv else None
        if mask is not None:  # dropped keys hold NaN: nothing may read them
            k = jnp.where(mask[:, None, :, None], k, jnp.nan)
        want = mosaic_backend.attention(q, k, v, mask, causal=causal, scale=0.125, **kw)
        got = cp.forward_with_lse(q, k, v, causal=causal, scale=0.125, cp_world_size=world,
                                  kv_chunk_size=chunk, key_padding_mask=mask,
                                  backend=mosaic_backend.MosaicBackend(**kw))
        assert not np.isnan(np.asarray(got[0], np.float32)).any()
        for x, y in zip(got, want, strict=True):
            assert bits_equal(x, y), f"seed {seed}"


@pytest.mark.slow  # CI time (32 s): the H200 runs CP on the Mosaic kernels natively; the
# backward over a key range runs in test_interpret_btnh_backward_equals_bhsd
@needs_threads
@needs_interpret
def test_interpret_cp_equals_single_call():
    """CP over the Mosaic kernels (degree 2, SPLIT shrunk to 128 keys so the shards are
    SPLIT-aligned at S=256): the forward's per-split partial states merged in global
    order, and the backward with dK/dV per key range and dQ continued across them, equal
    the single call's forward and gradients in bits."""
    from jaxattn import cp
    with _mosaic_at_split_128() as kw:
        seed = int(np.random.default_rng().integers(2**16))
        q, k, v = rand_qkv(1, 1, 1, 256, 256, 64, jnp.bfloat16, seed=seed)
        w = normal(seed, q.shape)
        be = mosaic_backend.MosaicBackend(**kw)

        def single(q, k, v):
            return mosaic_backend.attention(q, k, v, causal=True, scale=0.125, **kw)

        def sharded(q, k, v):
            return cp.forward_with_lse(q, k, v, causal=True, scale=0.125, cp_world_size=2,
                                       backend=be)

        want = single(q, k, v)
        got = sharded(q, k, v)
        assert not np.isnan(np.asarray(got[0], np.float32)).any()
        for x, y in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(x).view(np.uint16 if x.dtype.itemsize
                                                             == 2 else np.uint32),
                                          np.asarray(y).view(np.uint16 if y.dtype.itemsize
                                                             == 2 else np.uint32),
                                          err_msg=f"forward (seed {seed})")

        def grads(fn):
            return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)[0].astype(jnp.float32) * w),
                            (0, 1, 2))(q, k, v)

        for name, g, h in zip("qkv", grads(sharded), grads(single), strict=True):
            np.testing.assert_array_equal(np.asarray(g).view(np.uint16),
                                          np.asarray(h).view(np.uint16),
                                          err_msg=f"d{name} (seed {seed})")



@needs_api
def test_btnh_forward_lowers_for_cuda_without_a_transpose():
    """The forward on ``[B, S, H, D]`` (JAX's layout, ``btnh=True``) lowers for CUDA with
    q, k, v and out read and written in place: no transpose in the module around the
    kernel (each tile is a strided TMA box)."""
    from jaxattn.backends.mosaic import forward as mosaic_fwd
    q = jax.ShapeDtypeStruct((2, 300, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 300, 2, 128), jnp.bfloat16)
    text = jax.jit(lambda q, k, v: mosaic_fwd.forward(q, k, v, causal=True, btnh=True)).trace(
        q, k, k).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
    assert "stablehlo.transpose" not in text


@needs_api
@pytest.mark.parametrize("offsets", [False, True])
def test_btnh_gradient_lowers_for_cuda_without_a_transpose(offsets):
    """The backend's ``[B, S, H, D]`` entry (``jaxattn.dot_product_attention``'s),
    forward and gradient, lowers for CUDA with no transpose anywhere in the module:
    the forward, delta, dK/dV and dQ kernels read q, k, v, out, dO and write out, dQ,
    dK, dV in place; with per-sequence offsets (jax.nn's top-left causal rule for Sq
    != Skv) too."""
    q = jax.ShapeDtypeStruct((2, 100, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 150, 2, 128), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((2, 150), jnp.bool_)
    offs = jnp.zeros((2,), jnp.int32) if offsets else None

    def loss(q, k, v, m):
        out, _ = mosaic_backend.attention(q, k, v, m, causal=True, scale=0.3,
                                          causal_offsets=offs, btnh=True)
        return out.astype(jnp.float32).sum()

    f = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
    text = f.trace(q, k, k, mask).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 4  # forward, delta, dK/dV, dQ
    assert "stablehlo.transpose" not in text


@needs_threads
@needs_interpret
def test_interpret_btnh_backward_equals_bhsd():
    """The ``[B, S, H, D]`` backward (delta, dK/dV and dQ reading and writing JAX's
    layout in place) gives the ``[B, H, S, D]`` backward's bits: a causal chunk with
    partial blocks and a key mask, through the custom VJP, D=16 padded to 64."""
    from jaxattn.backends.mosaic import backward as mosaic_bwd
    from jaxattn.backends.mosaic import forward as mosaic_fwd
    seed = int(np.random.default_rng().integers(2**16))
    q, k, v = rand_qkv(1, 2, 1, 40, 70, 16, jnp.bfloat16, seed=seed)
    mask = jnp.asarray(np.random.default_rng(seed).random((1, 70)) > 0.2)
    kw = dict(causal=True, scale=0.25, interpret=True,
              fwd_config=mosaic_fwd.MosaicConfig(compute_wgs=1, block_m=64),
              bwd_config=mosaic_bwd.BwdConfig(dkdv_wgs=1, dq_wgs=1))
    w = normal(seed, q.shape)
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731

    def grads(btnh, offsets=None):
        def loss(q, k, v):
            out = mosaic_backend.attention(q, k, v, mask, btnh=btnh, causal_offsets=offsets,
                                           **kw)[0]
            return jnp.sum((t(out) if btnh else out).astype(jnp.float32) * w)
        args = (t(q), t(k), t(v)) if btnh else (q, k, v)
        g = jax.grad(loss, (0, 1, 2))(*args)
        return tuple(t(x) for x in g) if btnh else g

    want = grads(False)
    # Without offsets (the static rule) and with per-sequence offsets equal to it (the
    # backward over one key range, its rows placed per sequence).
    for got in (grads(True), grads(True, jnp.array([30], jnp.int32))):
        for name, g, h in zip("qkv", got, want, strict=True):
            assert not np.isnan(np.asarray(g, np.float32)).any(), name
            assert bits_equal(g, h), f"d{name} (seed {seed})"


@pytest.mark.slow
@needs_threads
@needs_interpret
@pytest.mark.parametrize("sq,skv,causal,masked", [(40, 70, True, False), (1, 130, True, False),
                                                  (70, 70, False, True)])
def test_interpret_btnh_forward_equals_bhsd(sq, skv, causal, masked):
    """``btnh=True`` gives the ``[B, H, S, D]`` call's bits (out transposed back, lse
    as is): a causal chunk with a partial block, decode (the group's rows stacked), and
    non-causal with a key mask. ``-m slow`` (about a minute here)."""
    from jaxattn.backends.mosaic import forward as mosaic_fwd
    seed = int(np.random.default_rng().integers(2**16))
    q, k, v = rand_qkv(2, 4, 2, sq, skv, 64, jnp.bfloat16, seed=seed)
    mask = (jnp.asarray(np.random.default_rng(seed).random((2, skv)) > 0.2) if masked
            else None)
    kw = dict(causal=causal, scale=0.2, interpret=True, key_padding_mask=mask,
              config=mosaic_fwd.MosaicConfig(compute_wgs=1, block_m=64))
    out, lse = mosaic_fwd.forward(q, k, v, **kw)
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    out_t, lse_t = mosaic_fwd.forward(t(q), t(k), t(v), btnh=True, **kw)
    assert out_t.shape == t(q).shape and not np.isnan(np.asarray(out_t, np.float32)).any()
    assert bits_equal(t(out_t), out) and bits_equal(lse_t, lse), f"seed {seed}"


def _d256_paths():
    """Every public path's call at D=256 past one SPLIT (3 SPLITs and a block, or 2
    SPLITs, and a partial block where a path takes one), as ``(fn, arg specs)``."""
    from jaxattn import cp, paged, varlen
    b, hq, hkv, d, s = 2, 4, 2, 256, 3 * jaxattn.SPLIT + 64
    bf = jnp.bfloat16

    def spec(*shape, dtype=bf):
        return jax.ShapeDtypeStruct(shape, dtype)

    def grad(f):
        return jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))

    qkv = (spec(b, hq, s, d), spec(b, hkv, s, d), spec(b, hkv, s, d))
    odd = (spec(b, hq, s - 37, d), spec(b, hkv, s - 37, d), spec(b, hkv, s - 37, d))
    even = tuple(spec(*x.shape[:2], 2 * jaxattn.SPLIT, d) for x in qkv)
    ps, keys = 16, 2 * jaxattn.SPLIT
    pages = tuple(spec(b * keys // ps, *shape) for shape in ((hkv, ps, d), (ps, hkv, d)))
    table = (spec(b, keys // ps, dtype=jnp.int32), spec(b, dtype=jnp.int32))
    att = functools.partial(jaxattn.attention, backend="mosaic")
    return {
        "causal": (grad(att), qkv),
        "non-causal partial block": (grad(functools.partial(att, causal=False)), odd),
        "key padding mask": (grad(lambda q, k, v, m: att(q, k, v, key_padding_mask=m)),
                             (*qkv, spec(b, s, dtype=jnp.bool_))),
        "decode": (att, (spec(b, hq, 1, d), *qkv[1:])),
        "decode rows": (att, (spec(b, hq, 4, d), *odd[1:])),
        "chunked prefill": (att, (spec(b, hq, 100, d), *qkv[1:])),
        # (CP's shards and chunks of whole key blocks: its folded-state kernels)
        "cp": (grad(functools.partial(cp.forward, cp_world_size=2, backend="mosaic")), even),
        "cp chunks": (grad(functools.partial(cp.forward, cp_world_size=2, kv_chunk_size=256,
                                             backend="mosaic")), even),
        "paged HND": (functools.partial(paged.attention, backend="mosaic"),
                      (spec(b, hq, 1, d), pages[0], pages[0], *table)),
        "paged NHD": (functools.partial(paged.attention, backend="mosaic", layout="NHD"),
                      (spec(b, hq, 1, d), pages[1], pages[1], *table)),
        "varlen": (grad(lambda q, k, v, cu: varlen.attention(
                       q, k, v, cu, cu, max_seqlen_q=s, max_seqlen_k=s, backend="mosaic")),
                   (spec(b * s, hq, d), spec(b * s, hkv, d), spec(b * s, hkv, d),
                    spec(b + 1, dtype=jnp.int32))),
        "jax layout": (grad(functools.partial(jaxattn.dot_product_attention, is_causal=True,
                                              implementation="mosaic")),
                       (spec(b, s, hq, d), spec(b, s, hkv, d), spec(b, s, hkv, d))),
    }


@needs_api
@pytest.mark.parametrize("path", list(_d256_paths()) if missing_api(("load", "Layout"))
                         is None else ["-"])
def test_every_path_at_d256_lowers_for_cuda(path, monkeypatch):
    """Each public path at D=256 past one SPLIT, forward and backward where it has one,
    lowers for CUDA, where Mosaic GPU refuses a kernel whose buffers exceed the SMEM
    (the H100's D=256 matrix found CP's folded-state kernel at 323 KiB, 2026-12-06; it
    now runs one compute warpgroup). Off the GPU the registry is told it is on one."""
    if not ON_GPU:
        monkeypatch.setattr(registry, "current_platform", lambda: "gpu")
        monkeypatch.setattr(registry.backend("mosaic"), "available", lambda: None)
    fn, args = _d256_paths()[path]
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
