"""Packed sequences (jaxattn.varlen) and left padding (jaxattn.layout): the entry's
arguments, one compile for any packing, run-time guards, the reference backend's
accuracy, the Mosaic kernels in interpret mode, and the torch bridge's
``varlen_attention``. The bits of every kernel backend against each sequence alone are
the invariance matrix's rows (tests/test_backends.py: check_varlen, check_left_padding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, np_attention, rand, rel_err
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mosaic_support import missing_interpret, needs_threads

import jaxattn
import jaxattn.platform
from jaxattn import invariance, layout, varlen
from jaxattn.invariance import bits_equal


def _cu(lengths):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


def _packed(lq, lk, hq=4, hkv=2, d=64, dtype=jnp.bfloat16):
    cq, ck = _cu(lq), _cu(lk)
    q = rand((int(cq[-1]), hq, d), dtype)
    k, v = rand((int(ck[-1]), hkv, d), dtype), rand((int(ck[-1]), hkv, d), dtype)
    return q, k, v, cq, ck


def test_one_trace_for_any_packing_of_the_same_sizes():
    """Under jit the lengths are run-time values: two packings of 100 tokens into 3
    sequences share one trace, and each equals its sequences alone."""
    traces = {"n": 0}

    @jax.jit
    def f(q, k, v, cq, ck):
        traces["n"] += 1
        return varlen.attention(q, k, v, cq, ck, max_seqlen_q=64, max_seqlen_k=64,
                                return_lse=True, backend="pallas")

    op = jaxattn.get_op("attention", backend="pallas")
    for lengths in ([40, 0, 60], [1, 63, 36]):
        q, k, v, cq, _ = _packed(lengths, lengths)
        out, lse = f(q, k, v, cq, cq)
        for n in range(3):
            a, b = int(cq[n]), int(cq[n + 1])
            if a == b:
                continue
            t = lambda x: jnp.swapaxes(x[a:b], 0, 1)[None]  # noqa: B023, E731
            o1, l1 = op.forward_with_lse(t(q), t(k), t(v))
            assert bits_equal(o1, t(out)) and bits_equal(l1, lse[None, :, a:b]), lengths
    assert traces["n"] == 1


def test_reference_backend_against_float64():
    """The reference (not the schedule: tolerance, not bits), causal with a chunk (Sq <
    Skv), an empty sequence and a single token; tokens past the last sequence get 0 and
    -inf."""
    lq, lk = [5, 0, 1, 12], [9, 3, 1, 12]
    q, k, v, cq, ck = _packed(lq, lk, dtype=jnp.float32)
    q = jnp.concatenate([q, jnp.full((2, *q.shape[1:]), jnp.nan)])
    out, lse = varlen.attention(q, k, v, cq, ck, return_lse=True, backend="reference")
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    for n in range(len(lq)):
        a, b, c, e = (int(x) for x in (cq[n], cq[n + 1], ck[n], ck[n + 1]))
        if a == b:
            continue
        t = lambda x, s, u: np.swapaxes(np.asarray(x[s:u]), 0, 1)[None]  # noqa: E731
        ref, ref_lse = np_attention(t(q, a, b), t(k, c, e), t(v, c, e))
        assert rel_err(t(out, a, b), ref) < 1e-5
        assert np.allclose(np.asarray(lse[:, a:b]), ref_lse[0], atol=1e-5)
    assert bool((out[-2:] == 0).all()) and bool(jnp.isneginf(lse[:, -2:]).all())


def test_arguments_are_checked_with_their_names():
    q, k, v, cq, ck = _packed([3, 4], [3, 4])
    with pytest.raises(ValueError, match=r"q must have rank 3"):
        varlen.attention(q[None], k, v, cq, ck)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[0\] must be 0"):
        varlen.attention(q, k, v, cq + 1, ck)
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        varlen.attention(q, k, v, cq, jnp.asarray([0, 5, 4], jnp.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] = 9 exceeds the 7 packed"):
        varlen.attention(q, k, v, jnp.asarray([0, 3, 9], jnp.int32), ck)
    with pytest.raises(ValueError, match="same number of sequences"):
        varlen.attention(q, k, v, cq, jnp.asarray([0, 7], jnp.int32))
    with pytest.raises(TypeError, match="cu_seqlens_q must be an integer array"):
        varlen.attention(q, k, v, cq.astype(jnp.float32), ck)
    with pytest.raises(ValueError, match="max_seqlen_q = 3 but a sequence has 4 tokens"):
        varlen.attention(q, k, v, cq, ck, max_seqlen_q=3)
    with pytest.raises(ValueError, match="Hq must be a multiple of Hkv"):
        varlen.attention(q[:, :3], k, v, cq, ck)
    with pytest.raises(TypeError, match="share one dtype"):
        varlen.attention(q.astype(jnp.float32), k, v, cq, ck)


def test_sequences_past_their_bound_give_nan_under_jit():
    """Traced lengths cannot raise: a sequence longer than max_seqlen gets NaN, the
    others their values; malformed cu_seqlens poison every token."""
    q, k, v, cq, ck = _packed([3, 20, 5], [3, 20, 5], dtype=jnp.float32)
    f = jax.jit(lambda cq, ck: varlen.attention(q, k, v, cq, ck, max_seqlen_q=8,
                                                max_seqlen_k=8, backend="reference"))
    out = np.asarray(f(cq, ck))
    assert np.isnan(out[3:23]).all() and np.isfinite(out[:3]).all() \
        and np.isfinite(out[23:]).all()
    assert np.isnan(np.asarray(f(cq.at[0].set(1), ck))).all()


def test_layout_moves_are_exact_inverses():
    """The gathers and their gradients: pad then pack is the identity on the tokens of
    sequences, and the gradient of each is the other (every value moved, none summed)."""
    x = rand((11, 2, 3))
    cu = _cu([4, 0, 7])
    start = jnp.asarray([60, 64, 57], jnp.int32)
    padded = layout.pad_packed(x, cu, start, 64)
    assert padded.shape == (3, 64, 2, 3)
    assert bits_equal(layout.pack_padded(padded, cu, start, 11), x)
    assert bits_equal(padded[0, 60:], x[:4]) and bits_equal(padded[2, 57:], x[4:])
    ct = rand(padded.shape)
    _, vjp = jax.vjp(lambda x: layout.pad_packed(x, cu, start, 64), x)
    assert bits_equal(vjp(ct)[0], layout.pack_padded(ct, cu, start, 11))
    shift = jnp.asarray([3, 0, -2], jnp.int32)
    y = rand((3, 2, 9, 4))
    moved, vjp = jax.vjp(lambda y: layout.shifted(y, shift, 2, 0.0), y)
    assert bits_equal(moved[0, :, :6], y[0, :, 3:]) and bool((moved[0, :, 6:] == 0).all())
    assert bits_equal(vjp(moved)[0][0, :, 3:], y[0, :, 3:])


_why_interp = missing_interpret(("load", "Layout"))


@pytest.mark.slow
@pytest.mark.skipif(_why_interp is not None, reason=str(_why_interp))
@needs_threads
def test_mosaic_kernels_in_interpret_mode():
    """The Mosaic kernels (interpret mode, one warpgroup) behind both layouts: a packed
    batch (a sequence, an empty one, a chunk starting off the block grid) and a
    left-padded batch equal each sequence alone in bits, forward and backward. Behind
    ``-m slow`` (40 s here): the layouts are the op's, which the default run checks on the
    Pallas and Triton kernels, and the Mosaic kernels' per-sequence offsets and masks,
    which these layouts use, have their own interpret tests (tests/test_cp.py,
    tests/test_mosaic_backend.py); on an H200 the battery runs these rows natively.)"""
    from jaxattn import registry
    from jaxattn.backends.mosaic import backend as mb
    from jaxattn.backends.mosaic import backward as mbw
    from jaxattn.backends.mosaic import forward as mf
    be = mb.MosaicBackend(interpret=True,
                          fwd_config=mf.MosaicConfig(compute_wgs=1, block_m=64),
                          bwd_config=mbw.BwdConfig(dkdv_wgs=1, dq_wgs=1))
    op = registry.AttentionOp("attention", be)
    p = invariance.Problem(batch=1, num_q_heads=2, num_kv_heads=1, seq_len=70)
    res = (invariance.check_varlen(op, p, [70, 0])
           + invariance.check_left_padding(op, p, [37]))
    for r in res:
        assert r.checked and r.equal, f"{r.case} [{r.kind}]: {r.detail}"


def test_torch_varlen_equals_jax_and_each_sequence_alone():
    """``torch_bridge.varlen_attention`` (flash_attn_varlen_func's names and layout):
    out, lse and the gradients of its autograd (the backward from saved residuals) equal
    ``jax.grad`` of jaxattn.varlen in bits; a sequence equals the torch op on it alone."""
    torch = pytest.importorskip("torch")
    import torch_bridge

    lq = [37, 0, 70, 1]
    cq = torch.tensor(np.concatenate([[0], np.cumsum(lq)]), dtype=torch.int32)
    t = int(cq[-1])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(t, 4, 64, generator=g).bfloat16().requires_grad_()
    k = torch.randn(t, 2, 64, generator=g).bfloat16().requires_grad_()
    v = torch.randn(t, 2, 64, generator=g).bfloat16().requires_grad_()
    do = torch.randn(t, 4, 64, generator=g).bfloat16()
    out, lse, probs = torch_bridge.varlen_attention(q, k, v, cq, cq, 70, 70, causal=True,
                                                    return_attn_probs=True, backend="pallas")
    assert probs is None and out.shape == q.shape and lse.shape == (4, t)
    out.backward(do)

    def j(x):
        return jnp.asarray(x.detach().float().numpy()).astype(jnp.bfloat16)

    # The torch tensors are on the CPU, so the bridge runs on JAX's CPU device (also on
    # a GPU host): the JAX side runs there too.
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu), jaxattn.platform.use("cpu"):
        cu = jnp.asarray(cq.numpy())
        (o2, l2), vjp = jax.vjp(lambda q, k, v: varlen.attention(
            q, k, v, cu, cu, max_seqlen_q=70, max_seqlen_k=70, return_lse=True,
            backend="pallas"), j(q), j(k), j(v))
        grads = vjp((j(do), jnp.zeros_like(l2)))

    def same(a, b):
        a = a.detach().contiguous()
        view = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
        return np.array_equal(a.view(view).numpy(), np.asarray(b).view(
            np.int16 if view == torch.int16 else np.int32))

    assert same(out, o2) and same(lse, l2)
    assert all(same(x.grad, y) for x, y in zip((q, k, v), grads, strict=True))
    a, b = int(cq[2]), int(cq[3])
    alone = torch_bridge.get_op("attention", backend="pallas")(
        *(x.detach()[a:b].transpose(0, 1)[None].contiguous() for x in (q, k, v)))
    assert torch.equal(alone[0].transpose(0, 1).contiguous().view(torch.int16),
                       out.detach()[a:b].view(torch.int16))
    for bad, match in ((dict(dropout_p=0.1), "dropout_p must be 0"),
                       (dict(window_size=(8, 0)), "window_size"),
                       (dict(softcap=1.0), "softcap"),
                       (dict(alibi_slopes=torch.ones(4)), "alibi_slopes")):
        with pytest.raises(ValueError, match=match):
            torch_bridge.varlen_attention(q, k, v, cq, cq, 70, 70, **bad)
    with pytest.raises(TypeError, match="cu_seqlens_q must be an int32"):
        torch_bridge.varlen_attention(q, k, v, cq.float(), cq, 70, 70)


# (CI time: one packing on the CPU, about 25 s; the matrix's varlen row runs a fixed
# packing causal and not on every backend)
@settings(max_examples=1 if not ON_GPU else 4, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(0, 70), min_size=1, max_size=3), causal=st.booleans())
def test_random_packings_equal_each_sequence_alone(lengths, causal):
    """The matrix's varlen row on random packings (hypothesis): any lengths from 0 to 70,
    causal or not, NaN past the last token; every sequence equals itself alone in bits,
    forward and backward, on the Pallas kernels."""
    p = invariance.Problem(batch=1, num_q_heads=4, num_kv_heads=2,
                           seq_len=max(lengths + [1]), causal=causal)
    results = invariance.check_varlen(jaxattn.get_op(backend="pallas"), p, lengths)
    assert results and all(r.equal for r in results), [r.detail for r in results]
