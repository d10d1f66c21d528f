"""RoPE reference, the comparison harness (with a fake Transformer Engine module) and
the check_operator CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rand

from jaxattn import invariance, rope
from jaxattn.testing import comparison as cmp

P = invariance.Problem(batch=2, num_q_heads=4, num_kv_heads=2, seq_len=130, head_dim=64)


def _np_rope(x, pos, theta, rd):
    x = np.asarray(x, np.float64)
    inv = 1.0 / theta ** (np.arange(0, rd, 2) / rd)
    ang = np.asarray(pos, np.float64)[..., None] * inv
    ang = np.concatenate([ang, ang], -1)[:, None]
    rot = x[..., :rd]
    half = rd // 2
    rh = np.concatenate([-rot[..., half:], rot[..., :half]], -1)
    return np.concatenate([rot * np.cos(ang) + rh * np.sin(ang), x[..., rd:]], -1)


@pytest.mark.parametrize("rd", [None, 32])
def test_rope_matches_float64(rd):
    x = rand((2, 3, 9, 64))
    pos = jnp.array([np.arange(9) + 5, np.arange(9) * 100])
    got = rope.forward_fp32(x, pos, rotary_dim=rd)
    want = _np_rope(x, pos, rope.DEFAULT_THETA, rd or 64)
    # fp32 angles carry an absolute error of a few ulps of position * inv_freq, so the
    # bound grows with the position: 2 * pos * eps32 * max|x| (plus rounding); 200 random
    # draws stayed under 11% of it.
    eps = np.finfo(np.float32).eps
    bound = 2 * np.asarray(pos, np.float64)[:, None, :, None] * eps * np.abs(x).max() + 2e-6
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.isfinite(np.asarray(got)).all()
    assert (err <= bound).all(), float((err - bound).max())
    # Small positions (the first sequence: 5..13) hold to a tight tolerance.
    np.testing.assert_allclose(np.asarray(got)[0], want[0], rtol=1e-5, atol=2e-5)
    if rd:
        assert np.array_equal(np.asarray(got)[..., rd:], np.asarray(x)[..., rd:])
    # [S] positions broadcast over the batch; the cast point is the output.
    xb = x.astype(jnp.bfloat16)
    out = rope.forward(xb, jnp.arange(9))
    assert out.dtype == jnp.bfloat16
    assert invariance.bits_equal(out, rope.forward_fp32(xb, jnp.arange(9)).astype(jnp.bfloat16))
    prov = rope.provenance(pos, rotary_dim=rd, head_dim=64, output_dtype=jnp.bfloat16)
    assert prov["rope_cast_at"] == "output" and prov["position_range"] == [0, 800]
    assert prov["rotary_dim"] == (rd or 64) and prov["rope_theta"] == 1e6


def test_rope_errors():
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        rope.forward(rand((1, 1, 2, 8)), jnp.arange(2), rotary_dim=3)
    with pytest.raises(ValueError, match=r"position_ids must have shape \[B, S\]"):
        rope.forward(rand((1, 1, 2, 8)), jnp.arange(3))


def _inputs(dtype="bfloat16"):
    p = invariance.Problem(**{**P.__dict__, "dtype": dtype})
    q, k, v = invariance.random_qkv(p)
    w = rand((p.num_q_heads * p.head_dim, 50), scale=0.05)
    tid = jax.random.randint(jax.random.PRNGKey(1), (p.batch, p.seq_len), 0, 50)
    return cmp.AttentionInputs(q, k, v, lm_head_weight=w, target_ids=tid,
                               active_mask=jnp.arange(p.seq_len)[None].repeat(2, 0) > 3)


@pytest.mark.parametrize("backend", ["pallas", "reference"])
def test_compare_single_gpu_attention_report(backend):
    rep = cmp.compare_single_gpu_attention(_inputs(), 48, 64, include_transformer_engine=True,
                                           backend=backend)
    names = [p.name for p in rep.paths]
    assert names == ["full_prefill", "chunked_prefill", "paged_kv",
                     "transformer_engine_paged_kv"]
    te = rep.path("transformer_engine_paged_kv")
    assert not te.available and "transformer_engine" in te.unavailable_reason
    for name in names[:3]:
        path = rep.path(name)
        assert set(path.out_drift) == {"max", "mean", "p95", "p99", "active"}
        assert path.out_drift["active"] == 2 * 4 * 130 * 64
        assert path.dlogp_drift["active"] == int(np.sum(np.arange(130) > 3)) * 2
        if backend == "pallas":
            assert path.bitwise_equal and path.out_drift["max"] == 0
        assert path.out_drift["max"] < 0.05
    prov = rep.path("paged_kv").provenance
    assert prov["kv_page_size"] == 64 and prov["backend"] == backend
    assert rep.path("chunked_prefill").provenance["chunk_bounds"][-1] == [96, 130]
    json.dumps(rep.to_dict())


def test_drift_statistics_and_bits_flag_see_a_planted_difference():
    inputs = _inputs("float32")
    base = cmp.compare_single_gpu_attention(inputs, 65, 64, backend="pallas")
    assert base.path("chunked_prefill").bitwise_equal
    bumped = cmp._report("x", inputs.q.at[0, 0, 5, 3].add(1e-3), jnp.zeros((2, 4, 130)),
                         (inputs.q, jnp.zeros((2, 4, 130)), None), inputs, {})
    assert not bumped.bitwise_equal
    assert bumped.out_drift["max"] == pytest.approx(1e-3, rel=1e-3)
    assert bumped.out_drift["p99"] == 0.0


class _FakeTE(types.ModuleType):
    """Transformer Engine's CP correction helpers, written from their documented math."""

    calls: list

    def __init__(self):
        super().__init__(cmp.TE_MODULE)
        self.calls = []

    def flash_attn_fwd_softmax_lse_correction(self, lse, lse_step):
        import torch
        self.calls.append("lse")
        lse.copy_(torch.logaddexp(lse, lse_step))

    def flash_attn_fwd_out_correction_init(self, out_step, lse, lse_step):
        import torch
        self.calls.append("init")
        w = torch.exp(lse_step - lse).nan_to_num(0.0)
        return out_step * w[..., None]

    def flash_attn_fwd_out_correction(self, out, out_step, lse, lse_step):
        import torch
        self.calls.append("out")
        out.add_(out_step * torch.exp(lse_step - lse).nan_to_num(0.0)[..., None])


def test_transformer_engine_oracle_with_a_fake_module(monkeypatch):
    pytest.importorskip("torch")
    fake = _FakeTE()
    monkeypatch.setitem(sys.modules, cmp.TE_MODULE, fake)
    rep = cmp.compare_single_gpu_attention(_inputs("float32"), 48, 64,
                                           include_transformer_engine=True, backend="pallas")
    te = rep.path("transformer_engine_paged_kv")
    assert te.available and "lse" in fake.calls and fake.calls.count("init") == 1
    assert te.out_drift["max"] < 1e-4 and te.lse_drift["max"] < 1e-4
    assert te.provenance["te_module"] == cmp.TE_MODULE


def test_rope_attention_and_decode_replay():
    inputs = _inputs()
    rep = cmp.compare_single_gpu_rope_attention(inputs, jnp.arange(130) + 11,
                                                query_chunk_size=40, backend="pallas")
    assert rep.extra["post_rope_qk_bitwise_equal"]
    fused = rep.path("fused_rope_attention")
    assert fused.bitwise_equal and fused.provenance["fusion_boundary"] == "fused_rope_attention"
    assert fused.provenance["position_range"] == [11, 140]
    rep = cmp.compare_decode_kv_replay(inputs, 64, prompt_len=120, backend="pallas")
    replay = rep.path("paged_decode_replay")
    assert replay.bitwise_equal and replay.provenance["decode_steps"] == 10
    ref_rep = cmp.compare_decode_kv_replay(inputs, 64, prompt_len=120, backend="reference")
    assert ref_rep.path("paged_decode_replay").out_drift["max"] < 0.05


def test_check_operator_cli(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxattn.check_operator", "--op", "attention", "--candidate",
         "pallas", "--dtype", "bf16", "--num_q_heads=4", "--num_kv_heads=2", "--head_dim=64",
         "--seq_len=100", "--decode_steps=4", "--query_chunk_size=30",
         f"--json_out={out}"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "paged_decode_replay" in proc.stdout and "PASS" in proc.stdout
    report = json.loads(out.read_text())
    assert report["passed"] and len(report["reports"]) == 3
    bad = subprocess.run([sys.executable, "-m", "jaxattn.check_operator", "--candidate", "cuda"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "candidate" in bad.stderr
