"""Registry dispatch: platform priority only, explicit backends never fall back."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import ON_GPU, rand_qkv

import jaxattn
from jaxattn import registry
from jaxattn.invariance import bits_equal


def test_platform_priority():
    assert registry.resolve("attention", platform="cpu").name == "reference"
    avail = {n: registry.backend(n).available() is None
             for n in registry.backend_names("attention")}
    gpu = ("mosaic" if avail["mosaic"] else "pallas" if avail["pallas"] else "reference")
    assert registry.resolve("attention", platform="gpu").name == gpu
    op = jaxattn.get_op("attention")
    assert op.backend == (gpu if ON_GPU else "reference")
    assert "backend=" in repr(op)


def test_dispatch_does_not_depend_on_shapes():
    chosen = {jaxattn.get_op("attention").backend}
    for shape in [(1, 2, 1, 4), (3, 8, 100, 64)]:
        q, k, v = rand_qkv(shape[0], shape[1], 1, shape[2], shape[2], shape[3])
        chosen.add(jaxattn.get_op("attention").backend)
    assert len(chosen) == 1


def test_explicit_backend_is_used_and_reported():
    q, k, v = rand_qkv(1, 4, 2, 8, 8, 16)
    for name in ("reference", "pallas"):
        op = jaxattn.get_op("attention", backend=name)
        assert op.backend == name
        np.testing.assert_allclose(op(q, k, v), jaxattn.reference.forward_fp32(q, k, v),
                                   rtol=1e-4, atol=1e-5)
    # attention(backend=...) is that op.
    assert bits_equal(jaxattn.attention(q, k, v, backend="reference"),
                      jaxattn.get_op(backend="reference")(q, k, v))


def test_unknown_names_raise():
    with pytest.raises(ValueError, match=r"unknown backend 'cuda'.*registered: mosaic, pallas, "
                                         r"reference"):
        jaxattn.get_op("attention", backend="cuda")
    with pytest.raises(KeyError, match=r"unknown op 'attn'; known ops: .*attention"):
        jaxattn.get_op("attn")


def test_explicit_backend_on_wrong_platform_raises():
    with pytest.raises(ValueError, match=r"does not run on platform 'tpu'"):
        registry.resolve("attention", "pallas", platform="tpu")


def test_unavailable_backend_raises_instead_of_falling_back():
    registry.register(registry.FunctionBackend(
        "broken", lambda *a, **k: None, priority={"cpu": -1, "gpu": -1},
        available=lambda: "no such device"))
    try:
        with pytest.raises(RuntimeError, match=r"backend 'broken' is unavailable: no such"):
            jaxattn.get_op("attention", backend="broken")
        # Automatic choice skips it (declared capability), whatever the shapes.
        assert jaxattn.get_op("attention").backend != "broken"
    finally:
        registry.unregister("broken")


def test_op_surface():
    op = jaxattn.get_op("attention", backend="reference")
    q, k, v = rand_qkv(1, 2, 1, 5, 5, 8, jax.numpy.bfloat16)
    out, lse = op.forward_with_lse(q, k, v)
    assert out.dtype == q.dtype and lse.dtype == jax.numpy.float32
    assert bits_equal(op.forward(q, k, v), out) and bits_equal(op(q, k, v), out)
    o32, l32 = op.forward_fp32_with_lse(q, k, v)
    assert o32.dtype == jax.numpy.float32
    assert bits_equal(o32, jaxattn.reference.forward_fp32(q, k, v))
    assert bits_equal(op.forward_fp32(q, k, v), o32)
    out2, lse2 = jaxattn.attention(q, k, v, return_lse=True, backend="reference")
    assert bits_equal(out2, out) and bits_equal(lse2, lse)


def test_every_listed_op_is_there_after_import_jaxattn_with_its_own_contract():
    """After a bare ``import jaxattn`` (a fresh process: no module imported beside it),
    every op the registry lists resolves, and ``"cp_attention"`` takes the seed's CP
    arguments (positions, world size, chunk size) on every entry, agreeing with the
    attention op."""
    import subprocess
    import sys

    from conftest import cpu_env

    code = """
import inspect, sys
import jax, jax.numpy as jnp, numpy as np
import jaxattn
names = jaxattn.registry.op_names()
assert set(names) >= {"attention", "cp_attention"}, names
for name in names:
    op = jaxattn.get_op(name)
    for entry in ("forward", "forward_with_lse", "forward_fp32", "forward_fp32_with_lse"):
        assert callable(getattr(op, entry)), (name, entry)
cp = jaxattn.get_op("cp_attention")
for entry in ("forward", "forward_with_lse", "forward_fp32", "forward_fp32_with_lse"):
    params = inspect.signature(getattr(type(cp), entry)).parameters
    if entry.endswith("lse"):
        assert {"query_position_offsets", "key_position_offsets", "cp_world_size",
                "kv_chunk_size"} <= set(params), (entry, list(params))
ks = jax.random.split(jax.random.PRNGKey(3), 3)
q = jax.random.normal(ks[0], (2, 4, 24, 16), jnp.float32)
k = jax.random.normal(ks[1], (2, 2, 24, 16), jnp.float32)
v = jax.random.normal(ks[2], (2, 2, 24, 16), jnp.float32)
o, l = cp.forward_fp32_with_lse(q, k, v, causal=True, cp_world_size=2, kv_chunk_size=8,
                                query_position_offsets=jnp.zeros((2,), jnp.int32),
                                key_position_offsets=jnp.zeros((2,), jnp.int32))
o1, l1 = jaxattn.get_op("attention").forward_fp32_with_lse(q, k, v, causal=True)
assert o.dtype == jnp.float32 and o.shape == q.shape and l.shape == q.shape[:3]
assert float(jnp.max(jnp.abs(o - o1))) < 1e-5, float(jnp.max(jnp.abs(o - o1)))
assert float(jnp.max(jnp.abs(cp(q, k, v, cp_world_size=3) - o1))) < 1e-5
print("ok", names, repr(cp))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=cpu_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CPAttentionOp(op='cp_attention'" in proc.stdout
