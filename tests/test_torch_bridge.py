"""torch_bridge: zero-copy transfer, bits equal to the JAX op, autograd, custom-op
registration, torch.compile, caching, errors; CUDA stream tests on the GPU."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import ON_GPU  # noqa: E402

import jaxattn  # noqa: E402
import torch_bridge  # noqa: E402
from jaxattn import cp  # noqa: E402
from jaxattn.backends.mosaic import backend as mosaic_backend  # noqa: E402
from jaxattn.invariance import bits_equal  # noqa: E402
from torch_bridge import bridge  # noqa: E402

DEV = "cuda" if ON_GPU and torch.cuda.is_available() else "cpu"
BACKEND = "pallas"


def _t(*shape, dtype=torch.bfloat16, grad=False, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else int(np.prod(shape)) + 7)
    x = torch.randn(*shape, generator=g).to(dtype).to(DEV)
    return x.requires_grad_(grad)


def _j(t: torch.Tensor) -> jax.Array:
    """An independent copy of a tensor as a JAX array (through NumPy, not DLPack)."""
    arr = jnp.asarray(t.detach().float().cpu().numpy())
    return arr.astype({torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16,
                       torch.float32: jnp.float32}[t.dtype])


def _same(t: torch.Tensor, x: jax.Array) -> bool:
    return bits_equal(_j(t), x) if t.dtype != torch.float32 else bits_equal(
        t.detach().cpu().numpy(), np.asarray(x))


def test_zero_copy_both_ways():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        t = _t(2, 4, 33, 64, dtype=dtype)
        x = bridge.to_jax(t)
        assert x.unsafe_buffer_pointer() == t.data_ptr()
        back = bridge.to_torch(x)
        assert back.data_ptr() == x.unsafe_buffer_pointer() == t.data_ptr()
        assert back.dtype == dtype and back.device.type == t.device.type


def test_non_contiguous_inputs_are_copied_and_correct():
    t = _t(2, 64, 4, 32).transpose(1, 2)  # [2, 4, 64, 32] view
    assert not t.is_contiguous()
    x = bridge.to_jax(t)
    assert x.unsafe_buffer_pointer() != t.data_ptr()
    assert _same(t.contiguous(), x)


@pytest.mark.parametrize("backend", [BACKEND, "mosaic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_outputs_and_gradients_equal_the_jax_op_in_bits(dtype, backend):
    """Forward, lse and gradients (an lse cotangent included) through the bridge equal
    the JAX op's in bits: the Pallas backend everywhere, and on sm90 the Mosaic one
    (whose bridge backward runs the saved residuals' backward, not the op's VJP)."""
    if backend == "mosaic" and (reason := mosaic_backend.unavailable_reason()):
        pytest.skip(reason)
    q, k, v = _t(2, 4, 70, 64, dtype=dtype, grad=True), _t(2, 2, 90, 64, dtype=dtype, grad=True), \
        _t(2, 2, 90, 64, dtype=dtype, grad=True, seed=3)
    mask = torch.ones(2, 90, dtype=torch.bool, device=DEV)
    mask[1, 60:] = False
    op = torch_bridge.get_op("attention", backend=backend)
    out, lse = op.forward_with_lse(q, k, v, key_padding_mask=mask, scale=0.11)
    w = _t(*out.shape, dtype=torch.float32, seed=5)
    wl = _t(*lse.shape, dtype=torch.float32, seed=6)
    ((out.float() * w).sum() + (lse * wl).sum()).backward()

    jq, jk, jv, jm = _j(q), _j(k), _j(v), jnp.asarray(mask.cpu().numpy())
    jop = jaxattn.get_op("attention", backend=backend)
    jo, jl = jop.forward_with_lse(jq, jk, jv, key_padding_mask=jm, scale=0.11)
    assert _same(out, jo) and _same(lse, jl)
    def loss(a, b, c):
        o, l_ = jop.forward_with_lse(a, b, c, key_padding_mask=jm, scale=0.11)
        return jnp.sum(o.astype(jnp.float32) * _j(w)) + jnp.sum(l_ * _j(wl))

    grads = jax.grad(loss, (0, 1, 2))(jq, jk, jv)
    for t, g in zip((q, k, v), grads, strict=True):
        assert t.grad.dtype == dtype and _same(t.grad, g)


def test_only_inputs_that_require_grad_get_gradients():
    q = _t(1, 2, 16, 64, grad=True)
    k, v = _t(1, 1, 16, 64), _t(1, 1, 16, 64, seed=2)
    torch_bridge.get_op("attention", backend=BACKEND)(q, k, v).float().sum().backward()
    assert q.grad is not None and k.grad is None and v.grad is None


def test_float64_gradient_check_through_the_reference_backend():
    op = torch_bridge.get_op("attention", backend="reference")
    q = _t(1, 4, 12, 16, dtype=torch.float32, grad=True)
    k = _t(1, 2, 15, 16, dtype=torch.float32, grad=True, seed=11)
    v = _t(1, 2, 15, 16, dtype=torch.float32, grad=True, seed=12)
    w = _t(1, 4, 12, 16, dtype=torch.float32, seed=13)
    (op(q, k, v) * w).sum().backward()

    def ref64(q, k, v):  # independent float64 torch computation
        g = q.shape[1] // k.shape[1]
        k2, v2 = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = q @ k2.transpose(-1, -2) / math.sqrt(q.shape[-1])
        sq, skv = q.shape[2], k.shape[2]
        vis = torch.arange(skv)[None, :] <= torch.arange(sq)[:, None] + (skv - sq)
        s = s.masked_fill(~vis.to(s.device), float("-inf"))
        return torch.softmax(s, -1) @ v2

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    (ref64(q64, k64, v64) * w.double()).sum().backward()
    for a, b in zip((q, k, v), (q64, k64, v64), strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-5)


def test_opcheck():
    q, k, v = _t(1, 2, 8, 64, grad=True), _t(1, 1, 8, 64, grad=True), _t(1, 1, 8, 64, grad=True,
                                                                         seed=9)
    torch.library.opcheck(bridge._attention_op,
                          (q, k, v, None, None, None, "attention", BACKEND, True, None, 1, -1))


def test_torch_compile_fullgraph_parity():
    op = torch_bridge.get_op("attention", backend=BACKEND)
    q, k, v = _t(1, 4, 20, 64), _t(1, 2, 20, 64), _t(1, 2, 20, 64, seed=4)
    eager = op(q, k, v)
    compiled = torch.compile(lambda q, k, v: op(q, k, v) * 2, fullgraph=True, backend="eager")
    assert torch.equal(compiled(q, k, v), eager * 2)


def test_compiled_jax_functions_are_cached():
    op = torch_bridge.get_op("attention", backend=BACKEND)
    q, k, v = _t(1, 2, 24, 64, grad=True), _t(1, 1, 24, 64, grad=True), \
        _t(1, 1, 24, 64, grad=True, seed=8)
    op(q, k, v, scale=0.3).float().sum().backward()
    before = bridge.TRACE_COUNT["n"]
    for _ in range(3):
        op(q, k, v, scale=0.3).float().sum().backward()
    assert bridge.TRACE_COUNT["n"] == before
    op(q, k, v, scale=0.4)  # another option set compiles once more
    assert bridge.TRACE_COUNT["n"] == before + 1


def test_cp_attention_op_equals_jax_cp():
    op = torch_bridge.get_op("cp_attention", backend=BACKEND)
    q, k, v = _t(2, 4, 30, 64, grad=True), _t(2, 2, 50, 64, grad=True), \
        _t(2, 2, 50, 64, grad=True, seed=21)
    kw = dict(query_position_offsets=torch.tensor([20, 40], device=DEV), cp_world_size=2,
              kv_chunk_size=16)
    out, lse = op.forward_with_lse(q, k, v, **kw)
    jo, jl = cp.forward_with_lse(_j(q), _j(k), _j(v), query_position_offsets=jnp.array([20, 40]),
                                 cp_world_size=2, kv_chunk_size=16, backend=BACKEND)
    assert _same(out, jo) and _same(lse, jl)
    out.float().sum().backward()
    g = jax.grad(lambda a, b, c: cp.forward(a, b, c, query_position_offsets=jnp.array([20, 40]),
                                            cp_world_size=2, kv_chunk_size=16,
                                            backend=BACKEND).astype(jnp.float32).sum(),
                 (0, 1, 2))(_j(q), _j(k), _j(v))
    for t, x in zip((q, k, v), g, strict=True):
        assert _same(t.grad, x)


def test_errors():
    with pytest.raises(KeyError, match=r"unknown op 'attn'; known ops: attention, cp_attention"):
        torch_bridge.get_op("attn")
    op = torch_bridge.get_op("attention")
    assert op.backend == jaxattn.get_op("attention").backend
    q, k, v = _t(1, 2, 8, 64), _t(1, 1, 8, 64), _t(1, 1, 8, 64, seed=1)
    with pytest.raises(TypeError, match="q has unsupported dtype torch.float64"):
        op(q.double(), k, v)
    with pytest.raises(ValueError, match=r"Hq must be a multiple of Hkv"):
        op(q, k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1))
    with pytest.raises(ValueError, match=r"q must have rank 4"):
        op(q[0], k, v)
    with pytest.raises(ValueError, match=r"all tensors must be on one device, got q on "):
        op(q, k.to("meta"), v)
    with pytest.raises(TypeError, match="key_padding_mask must be a bool tensor|must be bool"):
        op(q, k, v, key_padding_mask=torch.ones(1, 8, dtype=torch.int32, device=DEV))
    with pytest.raises(TypeError, match="belong to the 'cp_attention' op"):
        op(q, k, v, cp_world_size=2)
    cp_op = torch_bridge.get_op("cp_attention")
    with pytest.raises(ValueError, match=r"all tensors must be on one device.*"
                                         r"query_position_offsets on meta"):
        cp_op(q, k, v, query_position_offsets=torch.tensor([3], device="meta"))
    if DEV == "cpu" and torch.cuda.is_available():  # pragma: no cover - mixed machine
        with pytest.raises(ValueError, match="never copies to another device"):
            op(q.cuda(), k.cuda(), v.cuda())


@pytest.mark.gpu
def test_cuda_streams_torch_producer_on_a_side_stream():
    """A slow torch producer on a side stream; the bridge must see its finished data."""
    assert DEV == "cuda"
    op = torch_bridge.get_op("attention")
    k, v = _t(4, 8, 4096, 128), _t(4, 8, 4096, 128, seed=2)
    side = torch.cuda.Stream()
    base = _t(4, 32, 512, 128, seed=3)
    expect = op(base * 2, k, v)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning before the write
        q = base * 2
    torch.cuda.current_stream().wait_stream(side)
    got = op(q, k, v)
    assert torch.equal(got, expect)


@pytest.mark.gpu
def test_cuda_streams_jax_producer_read_by_torch():
    x = jax.random.normal(jax.random.PRNGKey(0), (8192, 8192), jnp.float32)
    y = (x @ x) @ x  # long enough to be in flight at the hand-off
    t = bridge.to_torch(y)
    assert t.data_ptr() == y.unsafe_buffer_pointer()
    assert torch.equal(t.cpu(), torch.from_numpy(np.asarray(y)))
