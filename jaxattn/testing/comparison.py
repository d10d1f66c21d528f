"""Single-device comparison harness: where do two materialisations of attention differ?

Each function runs one backend along several paths that a rollout or a trainer would
take for the same tokens and reports, per path against ``full_prefill``:

* ``out`` and ``lse`` drift: max, mean, p95, p99 of the absolute difference, and the
  number of active (compared) elements; ``lse`` over finite entries only;
* ``bitwise_equal``: the raw bits of out and lse (``jaxattn.invariance.bits_equal``);
* optional active-token ``dlogp`` drift: candidate minus full_prefill selected log-prob,
  with logits ``attention_out (heads flattened) @ lm_head_weight``;
* provenance: chunk and page sizes and bounds, merge order, backend, lse domain.

Paths: ``full_prefill`` (training-style), ``chunked_prefill`` (query chunks against all
earlier keys), ``paged_kv`` (the same chunks read from a shuffled paged cache), and an
optional ``transformer_engine_paged_kv`` oracle that merges per-page partial states with
Transformer Engine's context-parallel correction helpers (imported lazily; reported
unavailable, with the reason, when absent). Reports are JSON-compatible via ``to_dict``.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import paged, rope
from jaxattn.cp import PartialState, merge_partial_states
from jaxattn.invariance import bits_equal
from jaxattn.registry import get_op  # noqa: F401  (re-exported for callers)

TE_MODULE = "transformer_engine.pytorch.attention.dot_product_attention.context_parallel"


@dataclasses.dataclass
class AttentionInputs:
    """A prefill problem: ``q [B, Hq, S, D]``, ``k, v [B, Hkv, S, D]`` (causal)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    scale: float | None = None
    lm_head_weight: jax.Array | None = None  # [Hq * D, vocab]
    target_ids: jax.Array | None = None      # [B, S] int
    active_mask: jax.Array | None = None     # [B, S] bool


def drift(candidate, baseline, mask=None) -> dict:
    """Absolute-difference statistics over the active (and finite-baseline) elements."""
    a = np.asarray(candidate, np.float64)
    b = np.asarray(baseline, np.float64)
    keep = np.isfinite(b) if mask is None else (np.asarray(mask, bool) & np.isfinite(b))
    keep = np.broadcast_to(keep, a.shape)
    d = np.abs(a - b)[keep]
    d = np.where(np.isnan(d), np.inf, d)
    if d.size == 0:
        return {"max": 0.0, "mean": 0.0, "p95": 0.0, "p99": 0.0, "active": 0}
    return {"max": float(d.max()), "mean": float(d.mean()),
            "p95": float(np.percentile(d, 95)), "p99": float(np.percentile(d, 99)),
            "active": int(d.size)}


@dataclasses.dataclass
class PathReport:
    """One path compared with full_prefill."""

    name: str
    available: bool
    out_drift: dict | None = None
    lse_drift: dict | None = None
    bitwise_equal: bool | None = None
    dlogp_drift: dict | None = None
    provenance: dict = dataclasses.field(default_factory=dict)
    unavailable_reason: str | None = None


@dataclasses.dataclass
class ComparisonReport:
    """All paths of one comparison."""

    op: str
    backend: str
    dtype: str
    shape: dict
    paths: list[PathReport]
    extra: dict = dataclasses.field(default_factory=dict)

    def path(self, name: str) -> PathReport:
        return next(p for p in self.paths if p.name == name)

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(dataclasses.asdict(self))


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.generic,)):
        return x.item()
    if isinstance(x, float) and not np.isfinite(x):
        return str(x)
    return x


def _selected_logp(out, inputs: AttentionInputs):
    b, h, s, d = out.shape
    hidden = jnp.moveaxis(out.astype(jnp.float32), 1, 2).reshape(b, s, h * d)
    logits = jnp.einsum("bsk,kv->bsv", hidden, inputs.lm_head_weight.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, inputs.target_ids[..., None], axis=-1)[..., 0]


def _report(name, out, lse, base, inputs, provenance) -> PathReport:
    base_out, base_lse, base_logp = base
    dl = None
    if base_logp is not None:
        active = (jnp.ones(inputs.target_ids.shape, bool) if inputs.active_mask is None
                  else inputs.active_mask)
        dl = drift(_selected_logp(out, inputs), base_logp, active)
    return PathReport(name=name, available=True, out_drift=drift(out, base_out),
                      lse_drift=drift(lse, base_lse),
                      bitwise_equal=bits_equal(out, base_out) and bits_equal(lse, base_lse),
                      dlogp_drift=dl, provenance=provenance)


def _chunks(s: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, s)) for a in range(0, s, size)]


def _paged_cache(k, v, page_size: int, seed: int):
    b, hkv, s, d = k.shape
    max_pages = -(-s // page_size)
    num_pages = b * max_pages + 1
    perm = np.random.default_rng(seed).permutation(num_pages)[:b * max_pages]
    table = jnp.asarray(perm.reshape(b, max_pages).astype(np.int32))
    shape = (num_pages, hkv, page_size, d)
    # Unused slots hold NaN: a read of a slot that was never written shows up.
    return table, jnp.full(shape, jnp.nan, k.dtype), jnp.full(shape, jnp.nan, v.dtype)


def _te_paged(op, inputs, page_size, te):
    """Per-page partial states merged by Transformer Engine's correction helpers."""
    import torch

    q, k, v = inputs.q, inputs.k, inputs.v
    s = q.shape[2]
    states = []
    for a, e in _chunks(s, page_size):
        # Keys [a, e) for every query: the reference CP op gives the partial state.
        from jaxattn import cp
        o, l_ = cp.forward_fp32_with_lse(
            q, k[:, :, a:e], v[:, :, a:e], scale=inputs.scale,
            query_position_offsets=jnp.zeros((q.shape[0],), jnp.int32),
            key_position_offsets=jnp.full((q.shape[0],), a, jnp.int32), backend="reference")
        states.append((torch.from_numpy(np.asarray(o).copy()),
                       torch.from_numpy(np.asarray(l_).copy())))
    lse = states[0][1].clone()
    for _, l_step in states[1:]:
        te.flash_attn_fwd_softmax_lse_correction(lse, l_step)
    out = te.flash_attn_fwd_out_correction_init(states[0][0], lse, states[0][1])
    for o_step, l_step in states[1:]:
        te.flash_attn_fwd_out_correction(out, o_step, lse, l_step)
    return jnp.asarray(out.numpy()).astype(q.dtype), jnp.asarray(lse.numpy())


def compare_single_gpu_attention(inputs: AttentionInputs, query_chunk_size: int,
                                 kv_page_size: int, include_transformer_engine: bool = False,
                                 *, backend: str | None = None, seed: int = 0,
                                 progress=None) -> ComparisonReport:
    """full_prefill vs chunked_prefill vs paged_kv (vs the TE oracle) for one backend."""
    op = get_op("attention", backend=backend)
    q, k, v = inputs.q, inputs.k, inputs.v
    b, hq, s, d = q.shape
    say = progress or (lambda msg: None)
    say("full_prefill")
    fwd = jax.jit(lambda q, k, v: op.forward_with_lse(q, k, v, scale=inputs.scale))
    base_out, base_lse = fwd(q, k, v)
    base_logp = (_selected_logp(base_out, inputs) if inputs.lm_head_weight is not None
                 else None)
    base = (base_out, base_lse, base_logp)
    prov_common = {"backend": op.backend, "lse_domain": "natural log, fp32"}
    paths = [_report("full_prefill", base_out, base_lse, base, inputs,
                     {**prov_common, "merge_order": "in-kernel, ascending SPLIT order"})]

    say("chunked_prefill")
    chunks = _chunks(s, query_chunk_size)
    outs, lses = zip(*[fwd(q[:, :, a:e], k[:, :, :e], v[:, :, :e]) for a, e in chunks],
                     strict=True)
    paths.append(_report("chunked_prefill", jnp.concatenate(outs, 2), jnp.concatenate(lses, 2),
                         base, inputs, {**prov_common, "query_chunk_size": query_chunk_size,
                                        "chunk_bounds": [list(c) for c in chunks],
                                        "merge_order": "in-kernel, ascending SPLIT order"}))

    say("paged_kv")
    table, kp, vp = _paged_cache(k, v, kv_page_size, seed)
    lens = jnp.zeros((b,), jnp.int32)
    outs, lses = [], []
    for a, e in chunks:
        kp, vp, lens = paged.write(kp, vp, table, lens, k[:, :, a:e], v[:, :, a:e])
        o, l_ = paged.attention(q[:, :, a:e], kp, vp, table, lens, scale=inputs.scale,
                                return_lse=True, backend=op.backend)
        outs.append(o)
        lses.append(l_)
    paths.append(_report("paged_kv", jnp.concatenate(outs, 2), jnp.concatenate(lses, 2), base,
                         inputs, {**prov_common, "kv_page_size": kv_page_size,
                                  "num_pages": int(kp.shape[0]),
                                  "block_table": np.asarray(table).tolist(),
                                  "query_chunk_size": query_chunk_size,
                                  "merge_order": "logical KV block order (pages read in "
                                                 "place)"}))

    if include_transformer_engine:
        say("transformer_engine_paged_kv")
        try:
            te = importlib.import_module(TE_MODULE)
        except Exception as e:  # noqa: BLE001 - any import failure makes the path unavailable
            paths.append(PathReport("transformer_engine_paged_kv", available=False,
                                    unavailable_reason=f"{type(e).__name__}: {e}"))
        else:
            o, l_ = _te_paged(op, inputs, kv_page_size, te)
            paths.append(_report("transformer_engine_paged_kv", o, l_, base, inputs,
                                 {**prov_common, "backend": "reference partial states + TE",
                                  "kv_page_size": kv_page_size, "te_module": TE_MODULE,
                                  "merge_order": "TE lse correction, then out correction, "
                                                 "ascending page order"}))
    return ComparisonReport("attention", op.backend, str(q.dtype),
                            {"B": b, "Hq": hq, "Hkv": k.shape[1], "S": s, "D": d}, paths)


def compare_single_gpu_rope_attention(inputs: AttentionInputs, position_ids, *,
                                      query_chunk_size: int, theta: float = rope.DEFAULT_THETA,
                                      rotary_dim: int | None = None,
                                      backend: str | None = None) -> ComparisonReport:
    """Unfused RoPE then attention vs a fused-like path (RoPE applied per query chunk at
    the chunk's positions, as a fused kernel would, then attention on the chunk).

    ``inputs.q``/``inputs.k`` are pre-RoPE. Reports post-RoPE q/k drift and bits, the
    attention drift, and the RoPE provenance.
    """
    op = get_op("attention", backend=backend)
    q, k, v = inputs.q, inputs.k, inputs.v
    b, hq, s, d = q.shape
    pos = jnp.broadcast_to(jnp.asarray(position_ids), (b, s))
    kw = dict(theta=theta, rotary_dim=rotary_dim)
    q_rot, k_rot = rope.forward(q, pos, **kw), rope.forward(k, pos, **kw)
    fwd = jax.jit(lambda q, k, v: op.forward_with_lse(q, k, v, scale=inputs.scale))
    base_out, base_lse = fwd(q_rot, k_rot, v)
    base = (base_out, base_lse, _selected_logp(base_out, inputs)
            if inputs.lm_head_weight is not None else None)
    prov = rope.provenance(pos, head_dim=d, output_dtype=q.dtype, **kw)
    paths = [_report("unfused_rope_attention", base_out, base_lse, base, inputs,
                     {**prov, "fusion_boundary": "unfused_rope_attention",
                      "qk_state": "post_rope", "backend": op.backend})]
    chunks = _chunks(s, query_chunk_size)
    k_parts = [rope.forward(k[:, :, a:e], pos[:, a:e], **kw) for a, e in chunks]
    q_parts = [rope.forward(q[:, :, a:e], pos[:, a:e], **kw) for a, e in chunks]
    k_fused = jnp.concatenate(k_parts, 2)
    q_fused = jnp.concatenate(q_parts, 2)
    outs, lses = zip(*[fwd(q_parts[i], k_fused[:, :, :e], v[:, :, :e])
                       for i, (_, e) in enumerate(chunks)], strict=True)
    rep = _report("fused_rope_attention", jnp.concatenate(outs, 2), jnp.concatenate(lses, 2),
                  base, inputs, {**prov, "fusion_boundary": "fused_rope_attention",
                                 "qk_state": "post_rope", "backend": op.backend,
                                 "query_chunk_size": query_chunk_size})
    paths.append(rep)
    extra = {"post_rope_q_drift": drift(q_fused, q_rot), "post_rope_k_drift": drift(k_fused, k_rot),
             "post_rope_qk_bitwise_equal": bits_equal(q_fused, q_rot) and
             bits_equal(k_fused, k_rot)}
    return ComparisonReport("rope_attention", op.backend, str(q.dtype),
                            {"B": b, "Hq": hq, "Hkv": k.shape[1], "S": s, "D": d}, paths, extra)


def compare_decode_kv_replay(inputs: AttentionInputs, kv_page_size: int, *,
                             prompt_len: int | None = None, backend: str | None = None,
                             seed: int = 0, progress=None) -> ComparisonReport:
    """Paged decode replay (prefill the prompt into a paged cache, then one token at a
    time) vs attention over the full logical KV."""
    op = get_op("attention", backend=backend)
    q, k, v = inputs.q, inputs.k, inputs.v
    b, hq, s, d = q.shape
    p0 = s // 2 if prompt_len is None else prompt_len
    fwd = jax.jit(lambda q, k, v: op.forward_with_lse(q, k, v, scale=inputs.scale))
    base_out, base_lse = fwd(q, k, v)
    base = (base_out, base_lse, _selected_logp(base_out, inputs)
            if inputs.lm_head_weight is not None else None)
    table, kp, vp = _paged_cache(k, v, kv_page_size, seed)
    kp, vp, lens = paged.write(kp, vp, table, jnp.zeros((b,), jnp.int32), k[:, :, :p0],
                               v[:, :, :p0])
    o, l_ = paged.attention(q[:, :, :p0], kp, vp, table, lens, scale=inputs.scale,
                            return_lse=True, backend=op.backend)
    outs, lses = [o], [l_]
    for t in range(p0, s):
        if progress and (t - p0) % 64 == 0:
            progress(f"decode step {t - p0}/{s - p0}")
        kp, vp, lens = paged.write(kp, vp, table, lens, k[:, :, t:t + 1], v[:, :, t:t + 1])
        o, l_ = paged.attention(q[:, :, t:t + 1], kp, vp, table, lens, scale=inputs.scale,
                                return_lse=True, backend=op.backend)
        outs.append(o)
        lses.append(l_)
    rep = _report("paged_decode_replay", jnp.concatenate(outs, 2), jnp.concatenate(lses, 2),
                  base, inputs, {"backend": op.backend, "kv_page_size": kv_page_size,
                                 "prompt_len": p0, "decode_steps": s - p0,
                                 "merge_order": "logical KV block order",
                                 "lse_domain": "natural log, fp32"})
    full = _report("full_logical_kv", base_out, base_lse, base, inputs,
                   {"backend": op.backend})
    return ComparisonReport("decode_kv_replay", op.backend, str(q.dtype),
                            {"B": b, "Hq": hq, "Hkv": k.shape[1], "S": s, "D": d},
                            [full, rep])


__all__ = ["AttentionInputs", "ComparisonReport", "PartialState", "PathReport",
           "compare_decode_kv_replay", "compare_single_gpu_attention",
           "compare_single_gpu_rope_attention", "drift", "merge_partial_states"]
