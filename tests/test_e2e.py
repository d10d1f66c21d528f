"""End to end: rollout (prefill, chunked prefill, padded prefill, paged decode of a mixed
batch) and training log-probs of a Qwen3-style stack are equal in bits."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from examples import qwen3_rollout_parity as demo


def _rollout_and_training(cfg, new_tokens):
    """Roll out four mixed-length prompts, recompute as a trainer; the log-probs must be
    finite and equal in bits. Returns (rollout logp, training logp, generated tokens)."""
    roll, train, gen = demo.run(cfg, prompt_lens=(37, 100, 64, 5), new_tokens=new_tokens,
                                chunk=48)
    assert np.isfinite(roll).all()
    assert np.array_equal(roll.view(np.uint32), train.view(np.uint32)), np.abs(roll - train).max()
    return roll, train, gen


def test_rollout_and_training_logprobs_equal_in_bits():
    roll, train, gen = _rollout_and_training(  # (CI time: one layer; the example two)
        dataclasses.replace(demo.SIZES["small"], layers=1), new_tokens=3)
    assert gen.shape == (4, 3)
    assert (roll <= 0).all()
    assert roll.dtype == train.dtype == np.float32


@pytest.mark.slow  # CI time (50 s): the parity test above at the example's rows; chunk
# sizes' invariance is the matrix's chunked-prefill row (tests/test_backends.py)
def test_parity_holds_for_another_chunk_size(monkeypatch):
    """Any ROWS works as long as rollout and training share it (the example's --rows)."""
    monkeypatch.setattr(demo, "ROWS", 40)
    _rollout_and_training(dataclasses.replace(demo.SIZES["small"], layers=1), new_tokens=3)


@pytest.mark.slow  # CI time (18 s): the parity runs above; the bf16 model on the H200
def test_bf16_model_keeps_its_dtype_and_parity():
    """The Qwen3-8B preset is bf16: activations stay bf16 (no float64 numpy scalar
    promoting them to fp32 against bf16 KV pages) and parity holds."""
    import jax

    cfg = dataclasses.replace(demo.SIZES["small"], layers=1, dtype="bfloat16")
    leaves = jax.tree_util.tree_leaves(demo.init_params(cfg))
    assert {str(x.dtype) for x in leaves} == {"bfloat16"}
    _rollout_and_training(cfg, new_tokens=3)


def test_rowwise_gives_the_same_bits_for_a_row_whatever_the_row_count():
    import jax
    import jax.numpy as jnp

    w = jax.random.normal(jax.random.PRNGKey(0), (64, 48))
    x = jax.random.normal(jax.random.PRNGKey(1), (70, 64))
    fn = lambda a: jnp.tanh(a @ w)
    full = demo.rowwise(fn, x)
    for n in (1, 5, 16, 33):
        part = demo.rowwise(fn, x[:n])
        assert np.array_equal(np.asarray(part).view(np.uint32),
                              np.asarray(full[:n]).view(np.uint32)), n


@pytest.mark.slow  # CI time (23 s): its parity is test_rollout_and_training_logprobs_...
def test_example_runs_as_a_program():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "examples.qwen3_rollout_parity",
                           "--new_tokens=1", "--measure_cost", "--cost_batch=2",
                           "--cost_seq_len=32", "--cost_layers=1"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bitwise equal: True" in proc.stdout
    assert "with 1 of its 2 layers" in proc.stdout
    # The cost table: three setups, each timed (no error row).
    cost = proc.stdout.split("trainer cost")[1].strip().splitlines()[1:]
    import jax

    # The program's model is "small" (fp32); cuDNN takes fp16/bf16 only, so on a GPU too
    # an fp32 model is compared with XLA's attention.
    half = demo.SIZES["small"].dtype in ("bfloat16", "float16")
    peer = "cudnn" if jax.default_backend() == "gpu" and half else "xla"
    assert [line.split("  forward")[0].strip() for line in cost] == [
        "parity: rowwise + jaxattn", "plain matmuls + jaxattn", f"plain matmuls + {peer}"]
    assert all("forward+backward" in line and " ms" in line for line in cost), cost


def test_rowwise_switch_turns_chunking_off_and_back_on():
    """The cost measurement's switch really turns rowwise off (and is restored)."""
    import jax

    w = jax.random.normal(jax.random.PRNGKey(0), (64, 48))
    x = jax.random.normal(jax.random.PRNGKey(1), (40, 64))
    fn = lambda a: a @ w
    calls = []
    demo.ROWWISE = False
    try:
        out = demo.rowwise(lambda a: calls.append(a.shape) or fn(a), x)
    finally:
        demo.ROWWISE = True
    assert calls == [(40, 64)] and out.shape == (40, 48)
    demo.rowwise(lambda a: calls.append(a.shape) or fn(a), x)
    assert calls[1] == (demo.ROWS, 64)  # mapped per fixed chunk again
