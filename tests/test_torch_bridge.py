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
    if t.dtype == torch.int32:
        return jnp.asarray(t.cpu().numpy())
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


def test_forward_without_gradients_exports_only_the_output(monkeypatch):
    """``forward`` outside autograd returns ``out`` alone and crosses back from JAX once
    (no lse export); its bits are ``forward_with_lse``'s."""
    q, k, v = _t(1, 4, 3, 64), _t(1, 2, 70, 64), _t(1, 2, 70, 64, seed=5)
    op = torch_bridge.get_op("attention", backend=BACKEND)
    out_lse = op.forward_with_lse(q, k, v)
    exports = []
    real = bridge._to_torch
    monkeypatch.setattr(bridge, "_to_torch", lambda x, p: exports.append(x.shape) or real(x, p))
    with torch.no_grad():
        out = op(q, k, v)
    assert exports == [(1, 4, 4, 64)]  # the bucketed output (Sq = 3 padded to 4), no lse
    assert torch.equal(out.view(torch.int16), out_lse[0].view(torch.int16))
    exports.clear()
    op.forward_with_lse(q, k, v)
    assert len(exports) == 2


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
    with pytest.raises(ValueError, match=r"Hq=2 is not divisible by Hkv=3"):
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
def test_cuda_streams_non_contiguous_inputs_are_copied_before_jax_reads(monkeypatch):
    """A non-contiguous input is made contiguous by torch on its stream, and JAX's stream
    must wait for that copy. The copy is delayed here by a spin kernel queued right
    before it, into a block the caching allocator hands back full of NaN: a bridge that
    ordered JAX's stream before the copy (as one did, found by 300 decode steps of
    sliced tensors under load) reads NaN."""
    assert DEV == "cuda"
    op = torch_bridge.get_op("attention")
    q, k, v = _t(1, 32, 64, 128), _t(1, 8, 4096, 128, seed=2), _t(1, 8, 4096, 128, seed=4)
    expect = op(q, k, v)
    kt = k.transpose(2, 3).contiguous().transpose(2, 3)  # K's values, K^T's strides
    assert not kt.is_contiguous() and torch.equal(kt, k)
    del kt
    real = torch.Tensor.contiguous

    def slow_contiguous(self, *args, **kwargs):
        if not self.is_contiguous():
            torch.cuda._sleep(100_000_000)  # tens of ms of spinning before the copy
        return real(self, *args, **kwargs)

    for _ in range(3):
        kt = k.transpose(2, 3).contiguous().transpose(2, 3)
        torch.full_like(k, float("nan"))  # freed at once: the copy's block, NaN-filled
        monkeypatch.setattr(torch.Tensor, "contiguous", slow_contiguous)
        got = op(q, kt, v)
        monkeypatch.undo()
        assert not torch.isnan(got).any() and torch.equal(got, expect)


@pytest.mark.gpu
def test_cuda_streams_jax_producer_read_by_torch():
    x = jax.random.normal(jax.random.PRNGKey(0), (8192, 8192), jnp.float32)
    y = (x @ x) @ x  # long enough to be in flight at the hand-off
    t = bridge.to_torch(y)
    assert t.data_ptr() == y.unsafe_buffer_pointer()
    assert torch.equal(t.cpu(), torch.from_numpy(np.asarray(y)))


def test_arguments_are_validated_before_any_conversion():
    """Type and value of every option checked before float()/int()/.to(); each error
    names the argument and what it got."""
    op = torch_bridge.get_op("attention", backend=BACKEND)
    cp_op = torch_bridge.get_op("cp_attention", backend=BACKEND)
    q, k, v = _t(1, 2, 8, 16), _t(1, 1, 8, 16), _t(1, 1, 8, 16, seed=1)
    with pytest.raises(TypeError, match="scale must be None or a real number, got str"):
        op(q, k, v, scale="bad")
    with pytest.raises(TypeError, match="scale must be None or a real number, got bool"):
        op(q, k, v, scale=True)
    with pytest.raises(ValueError, match="scale must be finite, got nan"):
        op(q, k, v, scale=float("nan"))
    with pytest.raises(TypeError, match="causal must be a bool, got int"):
        op(q, k, v, causal=1)
    with pytest.raises(TypeError, match="cp_world_size must be a positive int, got True"):
        cp_op(q, k, v, cp_world_size=True)
    with pytest.raises(ValueError, match="cp_world_size must be a positive int, got 0"):
        cp_op(q, k, v, cp_world_size=0)
    with pytest.raises(TypeError, match="kv_chunk_size must be None or a positive int, got 2.5"):
        cp_op(q, k, v, kv_chunk_size=2.5)
    with pytest.raises(ValueError, match="kv_chunk_size must be None or a positive int, got 0"):
        cp_op(q, k, v, kv_chunk_size=0)
    with pytest.raises(TypeError, match="query_position_offsets must be an int tensor"):
        cp_op(q, k, v, query_position_offsets=torch.tensor([1.5], device=DEV))
    with pytest.raises(ValueError, match=r"key_position_offsets must be a scalar or have shape"):
        cp_op(q, k, v, key_position_offsets=[1, 2, 3])
    with pytest.raises(TypeError, match="query_position_offsets must be None, an int"):
        cp_op(q, k, v, query_position_offsets="3")
    # forward_fp32 checks that q, k, v share a dtype before it upcasts them.
    with pytest.raises(TypeError, match="q, k and v must share one dtype"):
        op.forward_fp32(q.float(), k, v)
    with pytest.raises(TypeError, match="q, k and v must share one dtype"):
        op.forward_fp32_with_lse(q, k.float(), v)
    with pytest.raises(TypeError, match="key_padding_mask must be None or a bool torch.Tensor"):
        op(q, k, v, key_padding_mask=[[True] * 8])


def test_bucket_length_rule():
    """Powers of two up to SPLIT, multiples of SPLIT above; anything else is refused."""
    bl = jaxattn.schedule.bucket_length
    split = jaxattn.schedule.SPLIT
    assert [bl(n) for n in (1, 2, 3, 5, 64, 65, 1000, split)] == [1, 2, 4, 8, 64, 128, 1024,
                                                                   split]
    assert [bl(n) for n in (split + 1, 2049, 3 * split)] == [2 * split, 3 * split, 3 * split]
    assert all(n <= bl(n) < 2 * n or bl(n) - n < split for n in range(1, 5000, 7))
    for bad in (0, -3, 2.0, True, None):
        with pytest.raises(ValueError, match="bucket_length takes a positive int"):
            bl(bad)


def _decode_bucket_case(backend: str, steps: int, d: int):
    """``steps`` decode steps against a cache growing from 1 key: per step the bridge's
    (out, lse), the traces it took, and the unbucketed JAX prefill of every step at once."""
    op = torch_bridge.get_op("attention", backend=backend)
    q, k, v = (_t(2, 4, steps, d, seed=31), _t(2, 2, steps, d, seed=32),
               _t(2, 2, steps, d, seed=33))
    before = bridge.TRACE_COUNT["n"]
    rows = [op.forward_with_lse(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1])
            for i in range(steps)]
    traces = bridge.TRACE_COUNT["n"] - before
    return q, k, v, rows, traces


@pytest.mark.parametrize("backend", [BACKEND] + (["mosaic"] if ON_GPU else []))
def test_decode_steps_trace_once_per_bucket_and_keep_the_bits(backend):
    """300 decode steps through the bridge (140 on a CPU): at most one trace per bucket
    touched (1, 2, 4, ..., 256, 512), and every step equal in raw bits to the
    unbucketed JAX call: each step against the unbucketed prefill's row (decode rows
    equal prefill rows, a row of the invariance matrix), and steps at and around every
    bucket edge against the unbucketed decode call itself."""
    steps = 300 if ON_GPU else 140  # (CI time: buckets to 256 on the CPU, 512 on a GPU)
    q, k, v, rows, traces = _decode_bucket_case(backend, steps, 16 if not ON_GPU else 128)
    buckets = {jaxattn.schedule.bucket_length(n) for n in range(1, steps + 1)}
    assert len(buckets) == (10 if ON_GPU else 9) and 1 <= traces <= len(buckets), traces
    jop = jaxattn.get_op("attention", backend=backend)
    full_out, full_lse = jop.forward_with_lse(_j(q), _j(k), _j(v), causal=True)
    for i, (out, lse) in enumerate(rows):
        assert not torch.isnan(out).any()
        assert _same(out, full_out[:, :, i:i + 1]) and _same(lse, full_lse[:, :, i:i + 1]), i
    for n in sorted({1, 2, 3, 64, 65, 129, min(257, steps), steps}):
        jo, jl = jop.forward_with_lse(_j(q[:, :, n - 1:n]), _j(k[:, :, :n]), _j(v[:, :, :n]))
        assert _same(rows[n - 1][0], jo) and _same(rows[n - 1][1], jl), n


@pytest.mark.parametrize("backend", [BACKEND, "mosaic"])
@pytest.mark.parametrize("causal,sq,skv", [(True, 37, 100), (False, 5, 70)])
def test_bucketed_prefill_chunks_equal_the_unbucketed_call_forward_and_backward(causal, sq,
                                                                                   skv, backend):
    """Query chunks and key counts off their buckets (padded to 64/128 inside), with a
    key padding mask: out, lse and every gradient equal the JAX op at the exact shapes
    (the Pallas backend everywhere, the Mosaic one on sm90)."""
    if backend == "mosaic" and (reason := mosaic_backend.unavailable_reason()):
        pytest.skip(reason)
    op = torch_bridge.get_op("attention", backend=backend)
    jop = jaxattn.get_op("attention", backend=backend)
    q, k, v = (_t(2, 4, sq, 16, grad=True, seed=sq), _t(2, 2, skv, 16, grad=True, seed=skv),
               _t(2, 2, skv, 16, grad=True, seed=skv + 1))
    mask = torch.ones(2, skv, dtype=torch.bool, device=DEV)
    mask[1, skv // 3:skv // 2] = False
    out, lse = op.forward_with_lse(q, k, v, causal=causal, key_padding_mask=mask)
    g, gl = _t(*out.shape, seed=3), _t(*lse.shape, dtype=torch.float32, seed=4)
    ((out.float() * g.float()).sum() + (lse * gl).sum()).backward()
    m = jnp.asarray(mask.cpu().numpy())

    def f(a, b, c, m=m):
        return jop.forward_with_lse(a, b, c, causal=causal, key_padding_mask=m)
    (jo, jl), vjp = jax.vjp(f, _j(q), _j(k), _j(v))
    assert _same(out, jo) and _same(lse, jl)
    for t, x in zip((q, k, v), vjp((_j(g), _j(gl))), strict=True):
        assert not torch.isnan(t.grad).any()
        assert _same(t.grad, x), (sq, skv, causal)


def test_bucketing_never_recompiles_inside_torch_compile():
    """A compiled model decoding against a growing cache: torch compiles at most twice
    (static shapes, then dynamic), and JAX traces once per bucket."""
    op = torch_bridge.get_op("attention", backend=BACKEND)
    from torch._dynamo.testing import CompileCounter
    counter = CompileCounter()
    f = torch.compile(lambda q, k, v: op(q, k, v) * 2, fullgraph=True, backend=counter)
    q, k, v = _t(1, 2, 1, 16, seed=5), _t(1, 1, 40, 16, seed=6), _t(1, 1, 40, 16, seed=7)
    before = bridge.TRACE_COUNT["n"]
    for n in range(20, 40):
        got = f(q, k[:, :, :n], v[:, :, :n])
        assert torch.equal(got, op(q, k[:, :, :n], v[:, :, :n]) * 2)
    assert counter.frame_count <= 2, counter.frame_count
    assert bridge.TRACE_COUNT["n"] - before <= 2  # buckets 32 and 64


def test_cpu_tensors_run_on_jax_cpu_on_any_host():
    """The device follows the inputs: CPU tensors run on JAX's CPU device (on a GPU host
    too), through the backend chosen for the CPU, in its bits."""
    op = torch_bridge.get_op("attention")
    q, k, v = (_t(1, 4, 9, 32).cpu(), _t(1, 2, 9, 32, seed=2).cpu(),
               _t(1, 2, 9, 32, seed=3).cpu())
    out, lse = op.forward_with_lse(q, k, v)
    assert out.device.type == "cpu" and lse.device.type == "cpu"
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu), jaxattn.platform.use("cpu"):
        jo, jl = jaxattn.get_op("attention", platform="cpu").forward_with_lse(
            *(jax.device_put(_j(t), cpu) for t in (q, k, v)))
    assert _same(out, jo) and _same(lse, jl)
    if DEV == "cuda":  # the same op still runs CUDA tensors on the GPU
        assert op(q.cuda(), k.cuda(), v.cuda()).device.type == "cuda"
    if torch.cuda.is_available() and not ON_GPU:  # pragma: no cover - CUDA torch, CPU JAX
        with pytest.raises(ValueError, match="this JAX has no 'gpu' devices"):
            op(q.cuda(), k.cuda(), v.cuda())


@pytest.mark.parametrize("backend", [BACKEND] + (["mosaic"] if ON_GPU else []))
@pytest.mark.parametrize("layout,sq", [("NHD", 1), ("HND", 5)])
def test_paged_op_runs_on_the_cache_tensors_with_the_jax_bits(layout, sq, backend):
    """``get_op("paged_attention")`` on torch cache tensors (pages of 16 keys, four to a
    block; NaN in every unused page and slot; int32 table and lengths): the bits of
    ``jaxattn.paged.attention`` on the same arrays; decode (NHD) and a chunk of 5 queries
    padded to its bucket of 8 (HND); the cache is read without a copy (on the GPU also
    by the Mosaic kernels, which read these pages in place)."""
    from jaxattn import paged
    gen = torch.Generator().manual_seed(7)
    b, hq, hkv, d, ps, max_pages = 2, 4, 2, 64, 16, 6
    num_pages = b * max_pages + 1
    shape = (num_pages, ps, hkv, d) if layout == "NHD" else (num_pages, hkv, ps, d)
    kc = torch.full(shape, float("nan"), dtype=torch.bfloat16).to(DEV)
    vc = torch.full(shape, float("nan"), dtype=torch.bfloat16).to(DEV)
    table = torch.randperm(num_pages, generator=gen)[:b * max_pages].reshape(b, max_pages)
    table = table.to(torch.int32).to(DEV)
    lens = torch.tensor([70, 33], dtype=torch.int32, device=DEV)
    k_new, v_new = (torch.randn(b, hkv, 70, d, generator=gen).to(torch.bfloat16) for _ in "kv")
    kj, vj, _ = paged.write(_j(kc), _j(vc), _j(table), jnp.zeros((b,), jnp.int32),
                            _j(k_new.to(DEV)), _j(v_new.to(DEV)), layout=layout)
    kc, vc = bridge.to_torch(kj), bridge.to_torch(vj)  # the "engine's" cache tensors
    q = torch.randn(b, hq, sq, d, generator=gen).to(torch.bfloat16).to(DEV)
    op = torch_bridge.get_op("paged_attention", backend=backend)
    out, lse = op.forward_with_lse(q, kc, vc, table, lens, layout=layout)
    want, want_lse = paged.attention(_j(q), kj, vj, _j(table), _j(lens), return_lse=True,
                                     backend=backend, layout=layout)
    assert out.shape == q.shape and not torch.isnan(out.float()).any()
    assert _same(out, want) and _same(lse, want_lse)
    # Zero-copy import of the cache: JAX reads the torch buffer itself.
    assert bridge.to_jax(kc).unsafe_buffer_pointer() == kc.data_ptr()
    with pytest.raises(TypeError, match="block_table must be an int32"):
        op(q, kc, vc, table.long(), lens, layout=layout)
