"""Every bad input raises ValueError / TypeError naming the argument and what it got."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rand, rand_qkv

import jaxattn
from jaxattn.validation import validate_inputs


def _ok():
    return rand_qkv(2, 4, 2, 8, 8, 16)


@pytest.mark.parametrize("backend", ["reference", "pallas"])
class TestErrors:
    def test_rank(self, backend):
        q, k, v = _ok()
        with pytest.raises(ValueError, match=r"q must have rank 4.*\(2, 4, 8\)"):
            jaxattn.attention(q[..., 0], k, v, backend=backend)
        with pytest.raises(ValueError, match=r"k must have rank 4"):
            jaxattn.attention(q, k[None], v, backend=backend)

    def test_batch_mismatch(self, backend):
        q, k, v = _ok()
        with pytest.raises(ValueError, match=r"batch mismatch: q has B=2.*k has B=1"):
            jaxattn.attention(q, k[:1], v[:1], backend=backend)

    def test_head_dim_mismatch(self, backend):
        q, k, v = _ok()
        with pytest.raises(ValueError, match=r"head-dim mismatch: q has D=16.*k has D=8"):
            jaxattn.attention(q, k[..., :8], v[..., :8], backend=backend)

    def test_kv_shape_mismatch(self, backend):
        q, k, v = _ok()
        with pytest.raises(ValueError, match=r"k and v must have the same shape"):
            jaxattn.attention(q, k, v[:, :, :4], backend=backend)

    def test_heads_not_divisible(self, backend):
        q, _, _ = _ok()
        k = rand((2, 3, 8, 16))
        with pytest.raises(ValueError, match=r"Hq=4 is not divisible by Hkv=3"):
            jaxattn.attention(q, k, k, backend=backend)

    def test_dtype_mismatch(self, backend):
        q, k, v = _ok()
        with pytest.raises(TypeError, match=r"share one dtype.*q float32.*k bfloat16"):
            jaxattn.attention(q, k.astype(jnp.bfloat16), v, backend=backend)

    def test_unsupported_dtype(self, backend):
        q, k, v = _ok()
        with pytest.raises(TypeError, match=r"q has unsupported dtype int32"):
            jaxattn.attention(q.astype(jnp.int32), k, v, backend=backend)
        with pytest.raises(TypeError, match=r"unsupported dtype float64"):
            jaxattn.attention(np.asarray(q, np.float64), k, v, backend=backend)

    def test_mask_shape(self, backend):
        q, k, v = _ok()
        with pytest.raises(ValueError, match=r"key_padding_mask must have shape \[B, Skv\] = "
                                             r"\(2, 8\), got \(2, 7\)"):
            jaxattn.attention(q, k, v, key_padding_mask=jnp.ones((2, 7), bool), backend=backend)

    def test_mask_dtype(self, backend):
        q, k, v = _ok()
        with pytest.raises(TypeError, match=r"key_padding_mask must be bool.*int32"):
            jaxattn.attention(q, k, v, key_padding_mask=jnp.ones((2, 8), jnp.int32),
                              backend=backend)

    def test_scale_and_causal_types(self, backend):
        q, k, v = _ok()
        with pytest.raises(TypeError, match=r"scale must be None or a real number"):
            jaxattn.attention(q, k, v, scale="0.1", backend=backend)
        with pytest.raises(ValueError, match=r"scale must be finite"):
            jaxattn.attention(q, k, v, scale=float("nan"), backend=backend)
        with pytest.raises(TypeError, match=r"causal must be a bool"):
            jaxattn.attention(q, k, v, causal=1, backend=backend)

    def test_not_an_array(self, backend):
        _, k, v = _ok()
        with pytest.raises(TypeError, match=r"q must be an array, got list"):
            jaxattn.attention([[1.0]], k, v, backend=backend)


def test_validate_returns_dims():
    q, k, v = rand_qkv(2, 6, 3, 5, 9, 16)
    dims = validate_inputs(q, k, v, key_padding_mask=jnp.ones((2, 9), bool))
    assert dims == (2, 6, 3, 5, 9, 16, np.dtype("float32"))
    assert dims.group == 2


def test_pallas_rejects_unsupported_head_dim_instead_of_falling_back():
    q, k, v = rand_qkv(1, 2, 2, 4, 4, 264)
    with pytest.raises(ValueError, match=r"backend 'pallas' cannot serve this call: head dim "
                                         r"D=264 .*\(1 to 256\)"):
        jaxattn.attention(q, k, v, backend="pallas")
    # The reference serves it.
    assert jaxattn.attention(q, k, v, backend="reference").shape == q.shape
