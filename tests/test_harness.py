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
from mosaic_support import dropped_nan

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
    # (the unbumped paths' bits equal: test_compare_single_gpu_attention_report)
    bumped = cmp._report("x", inputs.q.at[0, 0, 5, 3].add(1e-3), jnp.zeros((2, 4, 130)),
                         (inputs.q, jnp.zeros((2, 4, 130)), None), inputs, {})
    assert not bumped.bitwise_equal
    assert bumped.out_drift["max"] == pytest.approx(1e-3, rel=1e-3)
    assert bumped.out_drift["p99"] == 0.0


def _lse_correction(softmax_lse, softmax_lse_per_step):
    """TE's ``flash_attn_fwd_softmax_lse_correction``: in place, log(e^a + e^b)."""
    import torch
    hi = torch.max(softmax_lse, softmax_lse_per_step)
    lo = torch.min(softmax_lse, softmax_lse_per_step)
    softmax_lse.copy_(hi + torch.log1p(torch.exp(lo - hi)))


def _weight(lse_step, lse, seq_dim):
    """exp(lse_step - lse) ``[B, H, S]`` moved to the output's layout, with a trailing
    axis for D (as TE's helpers form it)."""
    import torch
    return torch.exp(lse_step - lse).movedim(2, seq_dim).unsqueeze(-1)


def _te_current():
    """A stand-in for Transformer Engine's context-parallel module with its current
    signatures (``seq_dim`` last and required, as in TE 2.x)."""
    te = types.ModuleType(cmp.TE_MODULE)
    te.calls = []

    def flash_attn_fwd_softmax_lse_correction(softmax_lse, softmax_lse_per_step):
        te.calls.append("lse")
        _lse_correction(softmax_lse, softmax_lse_per_step)

    def flash_attn_fwd_out_correction_init(out_init_step, softmax_lse, softmax_lse_init_step,
                                           seq_dim):
        te.calls.append("init")
        return (out_init_step * _weight(softmax_lse_init_step, softmax_lse, seq_dim)).to(
            out_init_step.dtype)

    def flash_attn_fwd_out_correction(out, out_per_step, softmax_lse, softmax_lse_per_step,
                                      seq_dim):
        te.calls.append("out")
        out.add_(out_per_step * _weight(softmax_lse_per_step, softmax_lse, seq_dim))

    te.flash_attn_fwd_softmax_lse_correction = flash_attn_fwd_softmax_lse_correction
    te.flash_attn_fwd_out_correction_init = flash_attn_fwd_out_correction_init
    te.flash_attn_fwd_out_correction = flash_attn_fwd_out_correction
    return te


def _te_seq_dim_third():
    """TE 1.x's order: ``seq_dim`` right after the two outputs."""
    te = _te_current()

    def flash_attn_fwd_out_correction_init(out_init_step, seq_dim, softmax_lse,
                                           softmax_lse_init_step):
        te.calls.append("init")
        return out_init_step * _weight(softmax_lse_init_step, softmax_lse, seq_dim)

    def flash_attn_fwd_out_correction(out, out_per_step, seq_dim, softmax_lse,
                                      softmax_lse_per_step):
        te.calls.append("out")
        out.add_(out_per_step * _weight(softmax_lse_per_step, softmax_lse, seq_dim))

    te.flash_attn_fwd_out_correction_init = flash_attn_fwd_out_correction_init
    te.flash_attn_fwd_out_correction = flash_attn_fwd_out_correction
    return te


def _te_without_seq_dim():
    """The oldest releases: no layout argument, the lse's last two axes swapped (bshd)."""
    te = _te_current()

    def flash_attn_fwd_out_correction_init(out_init_step, softmax_lse, softmax_lse_init_step):
        te.calls.append("init")
        return out_init_step * _weight(softmax_lse_init_step, softmax_lse, 1)

    def flash_attn_fwd_out_correction(out, out_per_step, softmax_lse, softmax_lse_per_step):
        te.calls.append("out")
        out.add_(out_per_step * _weight(softmax_lse_per_step, softmax_lse, 1))

    te.flash_attn_fwd_out_correction_init = flash_attn_fwd_out_correction_init
    te.flash_attn_fwd_out_correction = flash_attn_fwd_out_correction
    return te


@pytest.mark.parametrize("make_te", [_te_current, _te_seq_dim_third, _te_without_seq_dim],
                         ids=["current", "seq_dim_third", "no_seq_dim"])
def test_transformer_engine_oracle_with_te_signatures(monkeypatch, make_te):
    """The oracle calls TE's helpers as their signatures read (``seq_dim`` where a release
    takes it, required in current TE) and agrees with the single call."""
    pytest.importorskip("torch")
    te = make_te()
    monkeypatch.setitem(sys.modules, cmp.TE_MODULE, te)
    rep = cmp.compare_single_gpu_attention(_inputs("float32"), 48, 64,
                                           include_transformer_engine=True, backend="pallas")
    path = rep.path("transformer_engine_paged_kv")
    assert path.available, path.unavailable_reason
    assert te.calls.count("init") == 1 and te.calls.count("out") == 2 and "lse" in te.calls
    assert path.out_drift["max"] < 1e-4 and path.lse_drift["max"] < 1e-4
    assert path.provenance["te_module"] == cmp.TE_MODULE


def test_transformer_engine_without_a_helper_is_reported_unavailable(monkeypatch):
    """A TE module lacking a helper is an unavailable path with the reason in plain
    words, not a crash (and not an exception class name)."""
    pytest.importorskip("torch")
    te = _te_current()
    del te.flash_attn_fwd_out_correction_init
    monkeypatch.setitem(sys.modules, cmp.TE_MODULE, te)
    rep = cmp.compare_single_gpu_attention(_inputs("float32"), 48, 64,
                                           include_transformer_engine=True, backend="pallas")
    path = rep.path("transformer_engine_paged_kv")
    assert not path.available and te.calls == []
    assert "flash_attn_fwd_out_correction_init" in path.unavailable_reason
    assert "Error" not in path.unavailable_reason
    monkeypatch.delitem(sys.modules, cmp.TE_MODULE)
    monkeypatch.setattr(cmp, "TE_MODULE", "transformer_engine_absent_for_this_test")
    rep = cmp.compare_single_gpu_attention(_inputs("float32"), 48, 64,
                                           include_transformer_engine=True, backend="pallas")
    why = rep.path("transformer_engine_paged_kv").unavailable_reason
    assert why.startswith("Transformer Engine is not installed") and "Error:" not in why


def test_seed_names_and_the_non_causal_and_masked_cases():
    """The seed's ``AttentionComparisonInputs`` and its rope call form; ``causal=False``,
    and a key padding mask (causal), on every path: chunked prefill equal in bits to the full
    prefill, the paged path too without a mask (and unavailable, with the reason, with
    one), and the full path within tolerance of float64 attention with the same mask
    (NaN in the dropped keys, inf in their values: nothing leaks)."""
    from conftest import np_attention
    assert cmp.AttentionComparisonInputs is cmp.AttentionInputs
    base = _inputs("float32")
    mask = np.ones((2, 130), bool)
    mask[0, 100:] = False
    mask[1, 7:20] = False
    (k_nan, v_inf), _ = dropped_nan(base.k, base.v, jnp.asarray(mask))  # the house's poison
    for causal, m in ((False, None), (True, mask)):  # (CI time: not both with False)
        inputs = cmp.AttentionComparisonInputs(
            q=base.q, k=base.k if m is None else k_nan, v=base.v if m is None else v_inf,
            lm_head_weight=base.lm_head_weight, target_ids=base.target_ids,
            causal=causal, key_padding_mask=None if m is None else jnp.asarray(m))
        rep = cmp.compare_single_gpu_attention(inputs, 48, 64, backend="pallas")
        assert rep.path("chunked_prefill").bitwise_equal, (causal, m is not None)
        assert rep.path("full_prefill").provenance["causal"] == causal
        paged_path = rep.path("paged_kv")
        if m is None:
            assert paged_path.bitwise_equal
        else:
            assert not paged_path.available and "seq_lens" in paged_path.unavailable_reason
        full = rep.path("full_prefill")
        assert not np.isnan(full.out_drift["max"])
        op = cmp.get_op("attention", backend="pallas")
        out, _ = jax.jit(lambda q, k, v, mm, c=causal, op=op: op.forward_with_lse(
            q, k, v, causal=c, key_padding_mask=mm))(
            inputs.q, inputs.k, inputs.v, inputs.key_padding_mask)
        want, _ = np_attention(base.q, base.k, base.v, causal=causal, mask=m)
        assert not np.isnan(np.asarray(out)).any()
        np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)
    rope_inputs = cmp.AttentionComparisonInputs(q=base.q, k=base.k, v=base.v,
                                                rope_positions=jnp.arange(130) + 3)
    rep = cmp.compare_single_gpu_rope_attention(rope_inputs, backend="pallas")
    assert rep.path("fused_rope_attention").bitwise_equal
    assert rep.path("fused_rope_attention").provenance["position_range"] == [3, 132]
    with pytest.raises(ValueError, match="causal=True and no key_padding_mask"):
        cmp.compare_decode_kv_replay(cmp.AttentionInputs(base.q, base.k, base.v, causal=False),
                                     64)


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
         "pallas", "--dtype", "bf16", "--num_q_heads=2", "--num_kv_heads=1", "--head_dim=32",
         "--seq_len=70", "--decode_steps=2", "--query_chunk_size=30",
         f"--json_out={out}"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "paged_decode_replay" in proc.stdout and "PASS" in proc.stdout
    report = json.loads(out.read_text())
    assert report["passed"] and len(report["reports"]) == 3
    bad = subprocess.run([sys.executable, "-m", "jaxattn.check_operator", "--candidate", "cuda"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "candidate" in bad.stderr
