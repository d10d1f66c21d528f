"""Context parallelism: partial states, the global-order merge, CP attention on one
device and over a mesh of 8 CPU devices."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_env, np_attention, rand, rand_qkv, rel_err, with_xla_flags
from mosaic_support import missing_interpret, needs_threads

import jaxattn
from jaxattn import cp
from jaxattn.backends.mosaic import backend as mosaic_backend
from jaxattn.invariance import bits_equal

_why_interp = missing_interpret(("load", "Layout"))
needs_mosaic_interpret = pytest.mark.skipif(_why_interp is not None, reason=str(_why_interp))


def _states(n=5, shape=(1, 2, 3, 8)):
    edges = [0, 4, 4, 9, 20, 33][:n + 1]
    return [cp.PartialState(rand(shape), rand(shape[:3]), a, b)
            for a, b in zip(edges, edges[1:], strict=False)]


def test_merge_partial_states_is_order_free_and_matches_a_left_fold():
    states = _states()
    merged = cp.merge_partial_states(states)
    assert (merged.start, merged.end) == (0, 33)
    shuffled = states[:]
    random.Random(0).shuffle(shuffled)
    again = cp.merge_partial_states(shuffled)
    assert bits_equal(again.out, merged.out) and bits_equal(again.lse, merged.lse)
    out, lse = states[0].out, states[0].lse
    for s in states[1:]:
        if s.end > s.start:
            out, lse = jaxattn.merge(out, lse, s.out, s.lse)
    np.testing.assert_allclose(merged.out, out, rtol=1e-6, atol=1e-6)


def test_merge_with_an_empty_state_keeps_bits():
    s = _states(1)[0]
    empty = cp.PartialState.empty(s.out.shape, at=s.end)
    m = cp.merge_partial_states([empty, s])
    assert bits_equal(m.out, s.out) and bits_equal(m.lse, s.lse)
    # An empty range made of (0, -inf) data over a non-empty key range also passes through.
    blank = cp.PartialState(jnp.zeros_like(s.out), jnp.full_like(s.lse, -jnp.inf), s.end, 50)
    m = cp.merge_partial_states([blank, s])
    assert bits_equal(m.out, s.out) and bits_equal(m.lse, s.lse) and m.end == 50


def test_merge_rejects_gaps_overlaps_and_shape_mismatch():
    a = _states(1)[0]  # [0, 4)
    gap = cp.PartialState(a.out, a.lse, 10, 12)
    with pytest.raises(ValueError, match=r"gap in key ranges: \[0, 4\) then \[10, 12\)"):
        cp.merge_partial_states([a, gap])
    over = cp.PartialState(a.out, a.lse, 2, 6)
    with pytest.raises(ValueError, match=r"overlapping key ranges: \[0, 4\) and \[2, 6\)"):
        cp.merge_partial_states([a, over])
    with pytest.raises(ValueError, match="different shapes"):
        cp.merge_partial_states([a, cp.PartialState(a.out[:, :1], a.lse[:, :1], 4, 5)])
    with pytest.raises(ValueError, match="at least one"):
        cp.merge_partial_states([])


# CI time: degree 8 (29 s) with -m slow; the 8-device mesh test runs degree 8. Degrees 2
# and 4 without chunks (15 and 10 s) with -m slow: tests/test_backends.py's CP row runs
# degrees 1, 2, 4 and 8 in bits on pallas, forward and backward.
@pytest.mark.parametrize("world,chunk", [pytest.param(1, None, marks=pytest.mark.slow),
                                         pytest.param(2, None, marks=pytest.mark.slow),
                                         (2, 128),
                                         pytest.param(4, None, marks=pytest.mark.slow),
                                         pytest.param(8, None, marks=pytest.mark.slow)])
def test_cp_degrees_equal_single_call_in_bits(small_split, world, chunk):
    # 8 SPLIT-aligned shards need 1024 keys; two shards (and chunks of one SPLIT) 512.
    s = 1024 if world == 8 else 512
    q, k, v = rand_qkv(2, 4, 2, s, s, 64, jnp.bfloat16)
    mask = jnp.asarray(np.arange(s) % 13 != 5)[None].repeat(2, 0)
    do = rand(q.shape, jnp.bfloat16)
    op = jaxattn.get_op("attention", backend="pallas")
    ref, ref_vjp = jax.vjp(lambda q, k, v: op.forward_with_lse(q, k, v, key_padding_mask=mask),
                           q, k, v)
    got, got_vjp = jax.vjp(lambda q, k, v: cp.forward_with_lse(
        q, k, v, key_padding_mask=mask, cp_world_size=world, kv_chunk_size=chunk,
        backend="pallas"), q, k, v)
    assert bits_equal(got[0], ref[0]) and bits_equal(got[1], ref[1])
    d_lse = rand(ref[1].shape)
    for a, b in zip(got_vjp((do, d_lse)), ref_vjp((do, d_lse)), strict=True):
        assert bits_equal(a, b)


# CI time: shards that cut a split run in the matrix's CP row (degree 8) by default.
@pytest.mark.parametrize("s,world,chunk,causal", [
    pytest.param(384, 2, None, True, marks=pytest.mark.slow), (384, 3, 64, False)])
def test_cuts_inside_a_split_at_block_multiples_keep_bits(small_split, s, world, chunk,
                                                          causal):
    """Shards of 192 keys and chunks of 64 cut the splits of 128 keys: the running state
    is carried across each cut, so forward and gradients are the single call's bits."""
    q, k, v = rand_qkv(2, 4, 2, s, s, 64, jnp.bfloat16)
    mask = jnp.asarray(np.arange(s) % 13 != 5)[None].repeat(2, 0)
    k = k.at[:, :, 5::13].set(jnp.nan)  # masked keys: NaN must reach nothing
    v = v.at[:, :, 5::13].set(jnp.nan)
    do = rand(q.shape, jnp.bfloat16)
    op = jaxattn.get_op("attention", backend="pallas")
    kw = dict(key_padding_mask=mask, causal=causal)
    ref, ref_vjp = jax.vjp(lambda q, k, v: op.forward_with_lse(q, k, v, **kw), q, k, v)
    got, got_vjp = jax.vjp(lambda q, k, v: cp.forward_with_lse(
        q, k, v, cp_world_size=world, kv_chunk_size=chunk, backend="pallas", **kw), q, k, v)
    assert not jnp.isnan(got[0]).any()
    assert bits_equal(got[0], ref[0]) and bits_equal(got[1], ref[1])
    d_lse = rand(ref[1].shape)
    for a, b in zip(got_vjp((do, d_lse)), ref_vjp((do, d_lse)), strict=True):
        assert bits_equal(a, b)


@pytest.mark.gpu
def test_cuts_inside_a_split_keep_bits_on_gpu():
    """On the GPU with the default backend (``mosaic`` on sm90) and the real SPLIT:
    shards and chunks that cut splits (degree 8 over 4096 keys: 512; chunks of 64 and
    256; a decode row against 3000 keys in chunks of 192) equal the single call in bits,
    forward and backward; chunks of 1000 keys stay within 2 bf16 ulps."""
    seed = int(np.random.default_rng().integers(2**16))
    q, k, v = rand_qkv(1, 8, 2, 4096, 4096, 128, jnp.bfloat16, seed=seed)
    do = rand(q.shape, jnp.bfloat16)
    ref, ref_vjp = jax.vjp(lambda q, k, v: jaxattn.attention(q, k, v, return_lse=True),
                           q, k, v)
    d_lse = rand(ref[1].shape)
    want = ref_vjp((do, d_lse))
    for world, chunk in [(8, None), (2, 256), (1, 64)]:
        got, vjp = jax.vjp(lambda q, k, v, w=world, c=chunk: cp.forward_with_lse(
            q, k, v, cp_world_size=w, kv_chunk_size=c), q, k, v)
        assert not jnp.isnan(got[0]).any()
        assert bits_equal(got[0], ref[0]) and bits_equal(got[1], ref[1]), (world, chunk, seed)
        for a, b in zip(vjp((do, d_lse)), want, strict=True):
            assert bits_equal(a, b), (world, chunk, seed)
    off = cp.forward(q, k, v, cp_world_size=2, kv_chunk_size=1000).astype(jnp.float32)
    bound = 2 * 2.0 ** -8 * float(jnp.max(jnp.abs(ref[0].astype(jnp.float32))))
    assert float(jnp.max(jnp.abs(off - ref[0].astype(jnp.float32)))) <= bound
    qd = q[:, :, -1:]
    kd, vd = k[:, :, :3000], v[:, :, :3000]
    want_d = jaxattn.attention(qd, kd, vd, return_lse=True)
    got_d = cp.forward_with_lse(qd, kd, vd, kv_chunk_size=192)
    assert bits_equal(got_d[0], want_d[0]) and bits_equal(got_d[1], want_d[1]), seed


def test_pieces_cut_ranges_at_the_splits_of_the_one_call(small_split):
    # SPLIT = 128 here; 300 keys: splits [0, 128), [128, 256), [256, 300).
    assert cp._pieces(0, 300, 300) == [(0, 300, True)]
    assert cp._pieces(64, 300, 300) == [(64, 128, False), (128, 300, True)]
    assert cp._pieces(0, 192, 300) == [(0, 128, True), (128, 192, False)]
    assert cp._pieces(192, 200, 300) == [(192, 200, False)]
    assert cp._pieces(200, 280, 300) == [(200, 256, False), (256, 280, False)]


def test_unaligned_shards_are_within_tolerance(small_split):
    q, k, v = rand_qkv(1, 4, 2, 700, 700, 64, jnp.float32)
    got = cp.forward_fp32(q, k, v, cp_world_size=3, backend="pallas")
    ref = jaxattn.reference.forward_fp32(q, k, v)
    assert rel_err(got, ref) < 1e-5


def test_reference_backend_cp_matches_float64():
    q, k, v = rand_qkv(2, 4, 2, 40, 40, 16)
    for world, chunk in [(1, None), (2, 7), (4, None)]:
        out, lse = cp.forward_fp32_with_lse(q, k, v, cp_world_size=world, kv_chunk_size=chunk,
                                            backend="reference")
        ref_out, ref_lse = np_attention(q, k, v)
        assert rel_err(out, ref_out) < 1e-5
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_position_offsets_are_observable(backend):
    """Different query and key starts against an independent position-aware float64
    computation: an implementation that ignores the offsets fails."""
    q, k, v = rand_qkv(2, 4, 2, 24, 70, 64, jnp.float32)
    qo = np.array([117, 40])
    ko = np.array([100, 0])
    out = cp.forward_fp32(q, k, v, query_position_offsets=jnp.asarray(qo),
                          key_position_offsets=jnp.asarray(ko), cp_world_size=2,
                          kv_chunk_size=16, backend=backend)
    q_pos = qo[:, None] + np.arange(24)
    k_pos = ko[:, None] + np.arange(70)
    ref, _ = np_attention(q, k, v, q_pos=q_pos, k_pos=k_pos)
    assert rel_err(out, ref) < 1e-5
    ignored, _ = np_attention(q, k, v)
    assert rel_err(out, ignored) > 1e-2


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_empty_shards_and_rows_with_no_visible_key(backend):
    q, k, v = rand_qkv(1, 2, 1, 3, 0, 64, jnp.bfloat16)
    out, lse = cp.forward_with_lse(q, k, v, cp_world_size=4, backend=backend)
    assert np.all(np.asarray(out, np.float32) == 0) and np.isneginf(np.asarray(lse)).all()
    q, k, v = rand_qkv(1, 2, 1, 3, 5, 64, jnp.bfloat16)  # more shards than queries
    out, lse = cp.forward_with_lse(q, k, v, cp_world_size=4, backend=backend)
    ref = jaxattn.reference.forward_fp32(q, k, v)
    assert rel_err(out, ref) < 3e-2
    # Keys all after the queries: nothing visible, out 0, lse -inf, no NaN gradients.
    q, k, v = rand_qkv(1, 2, 1, 4, 6, 64, jnp.float32)
    f = lambda q, k, v: cp.forward(q, k, v, query_position_offsets=jnp.array([0]),
                                   key_position_offsets=jnp.array([10]), cp_world_size=2,
                                   backend=backend)
    assert np.all(np.asarray(f(q, k, v)) == 0)
    g = jax.grad(lambda *a: f(*a).sum(), (0, 1, 2))(q, k, v)
    assert all(np.all(np.asarray(x) == 0) for x in g)


def test_gradients_against_reference():
    q, k, v = rand_qkv(1, 4, 2, 60, 90, 64, jnp.float32)
    w = rand(q.shape)
    qo = jnp.array([50])
    got = jax.grad(lambda *a: jnp.sum(cp.forward(*a, query_position_offsets=qo,
                                                 cp_world_size=2, backend="pallas") * w),
                   (0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: jnp.sum(cp.forward(*a, query_position_offsets=qo,
                                                  backend="reference") * w), (0, 1, 2))(q, k, v)
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-4


def test_registry_and_bad_arguments():
    op = jaxattn.get_op("cp_attention")
    assert op.backend == jaxattn.get_op("attention").backend
    q, k, v = rand_qkv(1, 2, 1, 4, 4, 16)
    assert rel_err(op(q, k, v), jaxattn.reference.forward_fp32(q, k, v)) < 1e-4
    with pytest.raises(ValueError, match="cp_world_size must be a positive int"):
        cp.forward(q, k, v, cp_world_size=0)
    with pytest.raises(ValueError, match="kv_chunk_size must be None or a positive int"):
        cp.forward(q, k, v, kv_chunk_size=0)
    with pytest.raises(ValueError, match=r"query_position_offsets must be an int array of "
                                         r"shape \[B\] = \(1,\)"):
        cp.forward(q, k, v, query_position_offsets=jnp.array([1, 2]))
    with pytest.raises(ValueError, match="Hq must be a multiple"):
        cp.forward(q, k[:, :0], v[:, :0])


def test_sharded_attention_on_8_cpu_devices_equals_one_device():
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh
        import jaxattn
        from jaxattn import cp
        from jaxattn.invariance import bits_equal
        assert len(jax.devices()) == 8
        ks = jax.random.split(jax.random.PRNGKey(3), 5)
        # One sequence (CI time: 53 s with two); 512 keys for 8 shards of 64.
        q = jax.random.normal(ks[0], (1, 4, 512, 64), jnp.float32).astype(jnp.bfloat16)
        k = jax.random.normal(ks[1], (1, 2, 512, 64), jnp.float32).astype(jnp.bfloat16)
        v = jax.random.normal(ks[2], (1, 2, 512, 64), jnp.float32).astype(jnp.bfloat16)
        do = jax.random.normal(ks[3], q.shape, jnp.float32).astype(jnp.bfloat16)
        mask = jnp.asarray(np.arange(512) % 7 != 2)[None]
        att = lambda q, k, v: jaxattn.attention(q, k, v, key_padding_mask=mask,
                                                return_lse=True, backend="pallas")
        ref, vjp = jax.vjp(att, q, k, v)
        dl = jax.random.normal(ks[4], ref[1].shape)
        gref = vjp((do, dl))
        # Degrees 4 and 8, each layout once (4 load-balanced: chunks of 64 keys; 8
        # contiguous: shards of 64); degree 2: tests/test_cli.py's CP benchmark smoke.
        for n, lb in ((4, True), (8, False)):
            mesh = Mesh(np.array(jax.devices()[:n]), ("sp",))
            f = lambda q, k, v: cp.sharded_attention(
                q, k, v, mesh=mesh, axis_name="sp", key_padding_mask=mask,
                load_balance=lb, return_lse=True, backend="pallas")
            got, gvjp = jax.vjp(jax.jit(f), q, k, v)
            assert bits_equal(got[0], ref[0]) and bits_equal(got[1], ref[1]), (n, lb)
            for a, b in zip(gvjp((do, dl)), gref):
                assert bits_equal(a, b), (n, lb)
            assert not np.isnan(np.asarray(got[0], np.float32)).any()
        # backend=None: the backend jaxattn.attention picks (the reference on a CPU),
        # whose mesh gradients agree with its one-device gradients within rounding.
        att0 = lambda q, k, v: jaxattn.attention(q, k, v, key_padding_mask=mask,
                                                 return_lse=True)
        ref0, vjp0 = jax.vjp(att0, q, k, v)
        mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
        f = lambda q, k, v: cp.sharded_attention(q, k, v, mesh=mesh, axis_name="sp",
                                                 key_padding_mask=mask, load_balance=True,
                                                 return_lse=True)
        got, gvjp = jax.vjp(jax.jit(f), q, k, v)
        err = lambda a, b: float(np.max(np.abs(np.asarray(a, np.float64)
                                               - np.asarray(b, np.float64)))
                                 / np.max(np.abs(np.asarray(b, np.float64))))
        assert err(got[0], ref0[0]) < 1e-2 and err(got[1], ref0[1]) < 1e-5
        for a, b in zip(gvjp((do, dl)), vjp0((do, dl))):
            assert err(a, b) < 2e-2, err(a, b)
        print("SHARDED OK")
    """)
    # Eight virtual CPU devices also on a GPU host (the multi-GPU run is benchmarks/cp_bench),
    # compiled with the test flags (tests/conftest.py).
    env = cpu_env(XLA_FLAGS=with_xla_flags("--xla_force_host_platform_device_count=8"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0 and "SHARDED OK" in proc.stdout, proc.stderr[-4000:]


class _SerialMosaic(mosaic_backend.MosaicBackend):
    """The Mosaic backend in interpret mode with every eager kernel call waited for
    before the next one starts: two interpreted Mosaic kernels running at once (JAX's
    asynchronous CPU dispatch overlaps independent eager calls) can hang JAX 0.10.2's
    Mosaic GPU interpreter. Seen once in a CI run of this test on 2026-12-03 (the
    eager key-gradient call waiting forever on XLA's CPU execution semaphore)."""


def _waited(method):
    def call(self, *a, **k):
        return jax.block_until_ready(method(self, *a, **k))
    return call


for _name in ("delta", "key_gradients", "query_gradients", "split_states", "fold_states",
              "fold_on", "merge_into", "split_segment", "forward_with_lse", "backward",
              "backward_over_ranges"):
    setattr(_SerialMosaic, _name, _waited(getattr(mosaic_backend.MosaicBackend, _name)))


# CI time and reliability: -m slow (the hang above stopped one CI run; the test takes 40 s
# here); the H200 battery runs the mesh path on the Mosaic kernels natively.
@pytest.mark.slow
@needs_mosaic_interpret
@needs_threads
def test_sharded_attention_on_the_mosaic_kernels_equals_one_device():
    """The mesh path through the Mosaic kernels (interpret mode, one warpgroup), forward
    and gradients, with a key padding mask, equal the Mosaic backend's one-device call in
    bits: through ``shard_map`` on a one-device mesh (load-balanced: two chunks), and at
    degree 2 load-balanced (four chunks of 64 keys, two per device, out of order), each
    device's share computed by the mesh path's own per-device functions one device after
    the other.

    Degree 2 does not run through a two-device ``shard_map`` here: JAX 0.10.2's Mosaic GPU
    interpreter keeps one barrier table per process, and two devices' kernels running at
    once fail its end-of-kernel check and leave the other device in the all-gather. The
    collectives themselves are tested on 8 CPU devices with the Pallas kernels above."""
    from jax.sharding import Mesh

    from jaxattn.backends.mosaic import backend as mb
    from jaxattn.backends.mosaic import backward as mbw
    from jaxattn.backends.mosaic import forward as mf
    kw = dict(interpret=True, fwd_config=mf.MosaicConfig(compute_wgs=1, block_m=64),
              bwd_config=mbw.BwdConfig(dkdv_wgs=1, dq_wgs=1))
    be = _SerialMosaic(**kw)
    s = 256
    q, k, v = rand_qkv(1, 2, 1, s, s, 64, jnp.bfloat16)
    do = rand(q.shape, jnp.bfloat16)
    mask = jnp.asarray(np.arange(s) % 5 != 3)[None]
    ref, vjp = jax.vjp(lambda q, k, v: mb.attention(q, k, v, mask, causal=True, scale=0.125,
                                                    **kw), q, k, v)
    dl = rand(ref[1].shape)
    gref = vjp((do, dl))

    def check(got, grads, what):
        assert not np.isnan(np.asarray(got[0], np.float32)).any(), what
        assert bits_equal(got[0], ref[0]) and bits_equal(got[1], ref[1]), what
        for name, a, b in zip("qkv", grads, gref, strict=True):
            assert bits_equal(a, b), (name, what)

    mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
    f = lambda q, k, v: cp.sharded_attention(q, k, v, mesh=mesh, axis_name="sp", scale=0.125,
                                             key_padding_mask=mask, load_balance=True,
                                             return_lse=True, backend=be)
    got, gvjp = jax.vjp(jax.jit(f), q, k, v)
    check(got, gvjp((do, dl)), "one-device mesh")

    sc = dict(causal=True, scale=0.125)
    n = 2
    perm, c, chunks = cp._layout(n, s, True)
    inv = np.argsort(perm)
    qp, kp, vp, dop = (jnp.take(x, perm, axis=2) for x in (q, k, v, do))
    mp = jnp.take(mask, perm, axis=1)
    rows = s // n
    dev = [slice(i * rows, (i + 1) * rows) for i in range(n)]
    own = [cp.device_chunks(chunks, c, i) for i in range(n)]
    fwd = [cp.mesh_forward(be, qp[:, :, dev[i]], k, v, mask, own[i], **sc)
           for i in range(n)]
    out_p = jnp.concatenate([o for o, _ in fwd], 2)
    lse_p = jnp.concatenate([l_ for _, l_ in fwd], 2)
    dlp = jnp.take(dl, perm, axis=2)
    delta_p = jnp.concatenate([be.delta(out_p[:, :, d], dop[:, :, d], dlp[:, :, d])
                               for d in dev], 2)
    gathered = dict(q_all=q, do_all=do, lse_all=jnp.take(lse_p, inv, axis=2),
                    delta_all=jnp.take(delta_p, inv, axis=2), k_all=k, v_all=v,
                    m_all=mask)
    bwd = [cp.mesh_backward(be, qp[:, :, d], kp[:, :, d], vp[:, :, d], mp[:, d],
                            dop[:, :, d], lse_p[:, :, d], delta_p[:, :, d], own[i],
                            **gathered, **sc) for i, d in enumerate(dev)]
    grads = [jnp.take(jnp.concatenate([g[j] for g in bwd], 2), inv, axis=2)
             for j in range(3)]
    got = (jnp.take(out_p, inv, axis=2), jnp.take(lse_p, inv, axis=2))
    check(got, grads, "degree 2, load-balanced")


def test_sharded_attention_rejects_bad_layouts():
    from jax.sharding import Mesh
    mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
    q, k, v = rand_qkv(1, 2, 1, 8, 6, 64)
    with pytest.raises(ValueError, match=r"Sq \(8\) must equal Skv \(6\)"):
        cp.sharded_attention(q, k, v, mesh=mesh, axis_name="sp")
    q, k, v = rand_qkv(1, 2, 1, 9, 9, 64)
    with pytest.raises(ValueError, match="must divide into 2 equal chunks"):
        cp.sharded_attention(q, k, v, mesh=mesh, axis_name="sp", load_balance=True)


def test_cp_op_falls_to_the_reference_when_the_kernels_are_unavailable(monkeypatch):
    from jaxattn import registry
    for name in ("pallas", "mosaic"):
        monkeypatch.setattr(registry.backend(name), "available",
                            lambda: "no GPU of compute capability 8+")
    assert registry.resolve("cp_attention", platform="gpu").name == "reference"
    with pytest.raises(RuntimeError, match="backend 'pallas' is unavailable: no GPU"):
        registry.resolve("cp_attention", "pallas", platform="gpu")


def test_cp_at_a_head_dim_the_kernels_pad(small_split):
    """D=96 (padded to 128 inside the kernels): aligned CP equals the single call in
    bits, forward and backward."""
    q, k, v = rand_qkv(1, 4, 2, 256, 256, 96, jnp.bfloat16)
    do = rand(q.shape, jnp.bfloat16)
    op = jaxattn.get_op("attention", backend="pallas")
    ref, ref_vjp = jax.vjp(lambda q, k, v: op.forward_with_lse(q, k, v), q, k, v)
    got, got_vjp = jax.vjp(lambda q, k, v: cp.forward_with_lse(q, k, v, cp_world_size=2,
                                                                backend="pallas"), q, k, v)
    assert got[0].shape == q.shape
    assert bits_equal(got[0], ref[0]) and bits_equal(got[1], ref[1])
    d_lse = rand(ref[1].shape)
    for a, b in zip(got_vjp((do, d_lse)), ref_vjp((do, d_lse)), strict=True):
        assert a.shape[-1] == 96 and bits_equal(a, b)
