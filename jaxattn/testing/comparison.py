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
import inspect
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
    """A prefill problem: ``q [B, Hq, S, D]``, ``k, v [B, Hkv, S, D]``.

    ``causal`` and ``key_padding_mask`` (``[B, S]`` bool, True = keep) are passed to
    every path; ``rope_positions`` (``[B, S]`` or ``[S]`` int) are the default positions
    of :func:`compare_single_gpu_rope_attention`. The seed harness calls this class
    ``AttentionComparisonInputs`` (an alias)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    scale: float | None = None
    lm_head_weight: jax.Array | None = None  # [Hq * D, vocab]
    target_ids: jax.Array | None = None      # [B, S] int
    active_mask: jax.Array | None = None     # [B, S] bool
    causal: bool = True
    key_padding_mask: jax.Array | None = None  # [B, S] bool, True = keep
    rope_positions: jax.Array | None = None    # [B, S] or [S] int


#: The seed harness's name of :class:`AttentionInputs`.
AttentionComparisonInputs = AttentionInputs


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


#: Transformer Engine's context-parallel correction helpers the oracle calls.
TE_HELPERS = ("flash_attn_fwd_softmax_lse_correction", "flash_attn_fwd_out_correction_init",
              "flash_attn_fwd_out_correction")


def _param_names(fn) -> tuple[str, ...] | None:
    """Parameter names of ``fn`` (a Python function, a ``torch.compile`` wrapper or a
    TorchScript function), or None when they cannot be read."""
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        pass
    schema = getattr(fn, "schema", None)  # torch.jit.ScriptFunction
    args = getattr(schema, "arguments", None)
    return None if args is None else tuple(a.name for a in args)


def te_unavailable(te) -> str | None:
    """Why the module ``te`` cannot serve the oracle (a helper it lacks, or a signature
    it does not have), in plain words, or None."""
    missing = [name for name in TE_HELPERS if not callable(getattr(te, name, None))]
    if missing:
        return (f"Transformer Engine's context-parallel module ({TE_MODULE}) has no "
                f"{', '.join(missing)}; the oracle needs {', '.join(TE_HELPERS)}")
    for name in TE_HELPERS[1:]:
        params = _param_names(getattr(te, name))
        if params is not None and not {"softmax_lse"} <= set(params):
            return (f"Transformer Engine's {name} takes ({', '.join(params)}), not the "
                    f"out/lse arguments the oracle passes")
    return None


def _te_layout_kwargs(fn) -> dict:
    """The layout arguments of a TE out-correction helper for ``out [B, S, H, D]`` and
    ``lse [B, H, S]`` (TE's "bshd"): current releases take ``seq_dim`` (1 here), some
    take ``movedim_src``/``movedim_dst`` (2 -> 1), and older ones none (they transpose
    the lse's last two axes themselves, which is the same move)."""
    params = _param_names(fn) or ()
    if "seq_dim" in params:
        return {"seq_dim": 1}
    if "movedim_src" in params and "movedim_dst" in params:
        return {"movedim_src": 2, "movedim_dst": 1}
    return {}


def _te_paged(op, inputs, page_size, te):
    """Per-page partial states merged by Transformer Engine's correction helpers, called
    by keyword with TE's "bshd" layout (``out [B, S, H, D]``, ``lse [B, H, S]``)."""
    import torch

    from jaxattn import cp

    q, k, v = inputs.q, inputs.k, inputs.v
    s = q.shape[2]
    mask = inputs.key_padding_mask
    states = []
    for a, e in _chunks(s, page_size):
        # Keys [a, e) for every query: the reference CP op gives the partial state.
        o, l_ = cp.forward_fp32_with_lse(
            q, k[:, :, a:e], v[:, :, a:e], scale=inputs.scale, causal=inputs.causal,
            key_padding_mask=None if mask is None else mask[:, a:e],
            query_position_offsets=jnp.zeros((q.shape[0],), jnp.int32),
            key_position_offsets=jnp.full((q.shape[0],), a, jnp.int32), backend="reference")
        states.append((torch.from_numpy(np.asarray(jnp.swapaxes(o, 1, 2)).copy()),
                       torch.from_numpy(np.asarray(l_).copy())))
    init, step = te.flash_attn_fwd_out_correction_init, te.flash_attn_fwd_out_correction
    lse = states[0][1].clone()
    for _, l_step in states[1:]:
        te.flash_attn_fwd_softmax_lse_correction(softmax_lse=lse, softmax_lse_per_step=l_step)
    out = init(out_init_step=states[0][0], softmax_lse=lse,
               softmax_lse_init_step=states[0][1], **_te_layout_kwargs(init))
    for o_step, l_step in states[1:]:
        step(out=out, out_per_step=o_step, softmax_lse=lse, softmax_lse_per_step=l_step,
             **_te_layout_kwargs(step))
    out = jnp.swapaxes(jnp.asarray(out.numpy()), 1, 2)
    return out.astype(q.dtype), jnp.asarray(lse.numpy())


def compare_single_gpu_attention(inputs: AttentionInputs, query_chunk_size: int,
                                 kv_page_size: int, include_transformer_engine: bool = False,
                                 *, backend: str | None = None, seed: int = 0,
                                 progress=None) -> ComparisonReport:
    """full_prefill vs chunked_prefill vs paged_kv (vs the TE oracle) for one backend.

    ``inputs.causal`` and ``inputs.key_padding_mask`` apply to every path: a causal
    chunk of queries sees the keys up to its end, a non-causal one sees every key (the
    paged path then writes the whole sequence before the first chunk reads it). The
    paged path takes per-sequence lengths, not a mask: with a key padding mask it is
    reported unavailable, with the reason."""
    op = get_op("attention", backend=backend)
    q, k, v = inputs.q, inputs.k, inputs.v
    b, hq, s, d = q.shape
    causal, mask = bool(inputs.causal), inputs.key_padding_mask
    say = progress or (lambda msg: None)
    say("full_prefill")
    fwd = jax.jit(lambda q, k, v, m: op.forward_with_lse(q, k, v, scale=inputs.scale,
                                                         causal=causal, key_padding_mask=m))
    base_out, base_lse = fwd(q, k, v, mask)
    base_logp = (_selected_logp(base_out, inputs) if inputs.lm_head_weight is not None
                 else None)
    base = (base_out, base_lse, base_logp)
    prov_common = {"backend": op.backend, "lse_domain": "natural log, fp32",
                   "causal": causal, "key_padding_mask": mask is not None}
    paths = [_report("full_prefill", base_out, base_lse, base, inputs,
                     {**prov_common, "merge_order": "in-kernel, ascending SPLIT order"})]

    say("chunked_prefill")
    chunks = _chunks(s, query_chunk_size)
    # A causal chunk [a, e) sees keys [0, e); a non-causal one every key.
    ends = [e if causal else s for _, e in chunks]
    outs, lses = zip(*[fwd(q[:, :, a:e], k[:, :, :n], v[:, :, :n],
                           None if mask is None else mask[:, :n])
                       for (a, e), n in zip(chunks, ends, strict=True)], strict=True)
    paths.append(_report("chunked_prefill", jnp.concatenate(outs, 2), jnp.concatenate(lses, 2),
                         base, inputs, {**prov_common, "query_chunk_size": query_chunk_size,
                                        "chunk_bounds": [list(c) for c in chunks],
                                        "merge_order": "in-kernel, ascending SPLIT order"}))

    say("paged_kv")
    if mask is not None:
        paths.append(PathReport("paged_kv", available=False, unavailable_reason=(
            "the paged cache takes per-sequence lengths (seq_lens), not a key padding "
            "mask; run this comparison without key_padding_mask for the paged path")))
    else:
        table, kp, vp = _paged_cache(k, v, kv_page_size, seed)
        lens = jnp.zeros((b,), jnp.int32)
        if not causal:  # every chunk reads the whole sequence
            kp, vp, lens = paged.write(kp, vp, table, lens, k, v)
        outs, lses = [], []
        for a, e in chunks:
            if causal:
                kp, vp, lens = paged.write(kp, vp, table, lens, k[:, :, a:e], v[:, :, a:e])
            o, l_ = paged.attention(q[:, :, a:e], kp, vp, table, lens, scale=inputs.scale,
                                    causal=causal, return_lse=True, backend=op.backend)
            outs.append(o)
            lses.append(l_)
        paths.append(_report("paged_kv", jnp.concatenate(outs, 2), jnp.concatenate(lses, 2),
                             base, inputs, {**prov_common, "kv_page_size": kv_page_size,
                                            "num_pages": int(kp.shape[0]),
                                            "block_table": np.asarray(table).tolist(),
                                            "query_chunk_size": query_chunk_size,
                                            "merge_order": "logical KV block order (pages "
                                                           "read in place)"}))

    if include_transformer_engine:
        say("transformer_engine_paged_kv")
        try:
            te = importlib.import_module(TE_MODULE)
        except Exception as e:  # noqa: BLE001 - any import failure makes the path unavailable
            te, why = None, (f"Transformer Engine is not installed here ({TE_MODULE} could "
                             f"not be imported: {e})")
        else:
            why = te_unavailable(te)
        if why is not None:
            paths.append(PathReport("transformer_engine_paged_kv", available=False,
                                    unavailable_reason=why))
        else:
            o, l_ = _te_paged(op, inputs, kv_page_size, te)
            paths.append(_report("transformer_engine_paged_kv", o, l_, base, inputs,
                                 {**prov_common, "backend": "reference partial states + TE",
                                  "kv_page_size": kv_page_size, "te_module": TE_MODULE,
                                  "merge_order": "TE lse correction, then out correction, "
                                                 "ascending page order"}))
    return ComparisonReport("attention", op.backend, str(q.dtype),
                            {"B": b, "Hq": hq, "Hkv": k.shape[1], "S": s, "D": d}, paths)


#: Query chunk of the fused-like RoPE path when the caller names none (the seed's).
DEFAULT_ROPE_CHUNK = 512


def compare_single_gpu_rope_attention(inputs: AttentionInputs, position_ids=None, *,
                                      query_chunk_size: int = DEFAULT_ROPE_CHUNK,
                                      theta: float = rope.DEFAULT_THETA,
                                      rotary_dim: int | None = None,
                                      backend: str | None = None) -> ComparisonReport:
    """Unfused RoPE then attention vs a fused-like path (RoPE applied per query chunk at
    the chunk's positions, as a fused kernel would, then attention on the chunk).

    ``inputs.q``/``inputs.k`` are pre-RoPE; ``position_ids`` (``[B, S]`` or ``[S]``)
    default to ``inputs.rope_positions``, then to ``arange(S)``. ``inputs.causal`` and
    ``inputs.key_padding_mask`` apply to both paths. Reports post-RoPE q/k drift and
    bits, the attention drift, and the RoPE provenance.
    """
    op = get_op("attention", backend=backend)
    q, k, v = inputs.q, inputs.k, inputs.v
    b, hq, s, d = q.shape
    if position_ids is None:
        position_ids = (inputs.rope_positions if inputs.rope_positions is not None
                        else jnp.arange(s, dtype=jnp.int32))
    causal, mask = bool(inputs.causal), inputs.key_padding_mask
    pos = jnp.broadcast_to(jnp.asarray(position_ids), (b, s))
    kw = dict(theta=theta, rotary_dim=rotary_dim)
    q_rot, k_rot = rope.forward(q, pos, **kw), rope.forward(k, pos, **kw)
    fwd = jax.jit(lambda q, k, v, m: op.forward_with_lse(q, k, v, scale=inputs.scale,
                                                         causal=causal, key_padding_mask=m))
    base_out, base_lse = fwd(q_rot, k_rot, v, mask)
    base = (base_out, base_lse, _selected_logp(base_out, inputs)
            if inputs.lm_head_weight is not None else None)
    prov = rope.provenance(pos, head_dim=d, output_dtype=q.dtype, **kw)
    prov = {**prov, "causal": causal, "key_padding_mask": mask is not None}
    paths = [_report("unfused_rope_attention", base_out, base_lse, base, inputs,
                     {**prov, "fusion_boundary": "unfused_rope_attention",
                      "qk_state": "post_rope", "backend": op.backend})]
    chunks = _chunks(s, query_chunk_size)
    k_parts = [rope.forward(k[:, :, a:e], pos[:, a:e], **kw) for a, e in chunks]
    q_parts = [rope.forward(q[:, :, a:e], pos[:, a:e], **kw) for a, e in chunks]
    k_fused = jnp.concatenate(k_parts, 2)
    q_fused = jnp.concatenate(q_parts, 2)
    ends = [e if causal else s for _, e in chunks]
    outs, lses = zip(*[fwd(q_parts[i], k_fused[:, :, :n], v[:, :, :n],
                           None if mask is None else mask[:, :n])
                       for i, n in enumerate(ends)], strict=True)
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
    time) vs attention over the full logical KV. Decoding is causal and the paged cache
    takes lengths, not a mask: ``inputs.causal=False`` or a ``key_padding_mask`` raise
    ValueError."""
    if not inputs.causal or inputs.key_padding_mask is not None:
        raise ValueError("compare_decode_kv_replay replays causal decoding over a paged cache: "
                         f"it needs causal=True and no key_padding_mask, got causal="
                         f"{inputs.causal}, key_padding_mask="
                         f"{'given' if inputs.key_padding_mask is not None else None}")
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


__all__ = ["AttentionComparisonInputs", "AttentionInputs", "ComparisonReport", "PartialState",
           "PathReport", "compare_decode_kv_replay", "compare_single_gpu_attention",
           "compare_single_gpu_rope_attention", "drift", "merge_partial_states",
           "te_unavailable"]
