"""jaxattn as an attention implementation of Hugging Face transformers.

    from torch_bridge import hf
    hf.register()                                   # name "jaxattn", default backend
    model = Qwen3ForCausalLM(config)                # or from_pretrained(...)
    model.set_attn_implementation("jaxattn")        # or attn_implementation="jaxattn"

``register`` puts two entries under one name: an attention function in
``transformers.AttentionInterface`` and a mask builder in
``transformers.AttentionMaskInterface``. Both are needed: transformers builds no mask at
all for an implementation that has no mask builder, so padding would be dropped silently.

What is accepted (mapped exactly onto jaxattn's contract, docs/contract.md):

* causal attention where the queries are the last ``Sq`` of the ``Skv`` keys (prefill,
  chunked prefill and decode on a ``DynamicCache``): jaxattn's bottom-right ``causal=True``;
* plus key padding (left or right, from the 2D ``attention_mask``): ``key_padding_mask``
  ``[B, Skv]``, True = keep, read off the last query row of the 4D mask (under the causal
  rule that row sees every key, so it is exactly the padding);
* packed rows: several sequences in one row, which transformers finds in ``position_ids``
  when there is no padding mask and no cache (training and scoring forwards), or which a
  flattening collator passes as ``cu_seq_lens_q/k`` and ``max_length_q/k``. The mask
  builder recognises transformers' packed mask (its causal mask AND
  ``packed_sequence_mask_function``) and builds no ``[S, S]`` mask; the attention function
  takes the sequences from ``position_ids`` (or the ``cu_seq_lens_*``) and runs
  :func:`torch_bridge.varlen_attention`;
* ``scaling`` passed verbatim as ``scale``; GQA is left to jaxattn (K/V not repeated).

What is refused with a ``ValueError`` rather than computed wrongly: sliding-window and
chunked attention and any other mask pattern transformers builds from a mask function
other than its plain causal or packed one; bidirectional (``is_causal=False``)
attention; a prefill whose queries are not the last keys (a ``StaticCache`` prefill, whose
keys include empty future slots); 4D masks passed in by the user that are not
"causal + key padding" (float masks must hold only 0 and the dtype's minimum or -inf: no
biases); dropout > 0; attention sinks (``s_aux``/``sinks``), ``softcap`` and position
biases; packed rows read off ``position_ids`` under ``torch.compile`` (pass the
``cu_seq_lens_*`` there), and packed rows with a padding mask or a cache.

How the mask is checked: the mask builder refuses by structure (which mask function
transformers composed, window sizes, offsets), which is plain Python and holds under
``torch.compile``. The attention function then rebuilds the expected mask from the derived
padding mask (bottom-right causal AND padding) and compares it with the mask it was given,
element for element; this reads tensor values, so it is skipped while ``torch.compile``
traces (there the structural check is what remains).

Rows with no visible key (the query rows of left padding) come out as zeros, as jaxattn
defines them; transformers' eager attention returns an average of values there. Those rows
are padding and are never read by the real tokens.

Bits: with a kernel backend (``mosaic``, ``pallas``), decode rows equal the full
forward's rows, and a sequence alone equals its rows in a right-padded, a left-padded
(jaxattn aligns each sequence's key blocks to its first kept key) or a packed batch.

transformers is imported lazily: ``import torch_bridge`` works without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torch_bridge.ops import get_op
from torch_bridge.varlen import varlen_attention

DEFAULT_NAME = "jaxattn"

# Keyword arguments that change the math: refused unless absent or None.
_REFUSED_KWARGS = {
    "sliding_window": "sliding-window attention",
    "softcap": "logit soft-capping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias",
}


def _compiling() -> bool:
    return torch.compiler.is_compiling()


# ---------------------------------------------------------------------------- the mask

def _closure(fn: Callable) -> dict:
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(code.co_freevars, (c.cell_contents for c in cells), strict=True)) \
        if code is not None else {}


def packed_sequence_ids(mask_function: Callable) -> torch.Tensor | None:
    """The ``[B, S]`` sequence ids of transformers' packed-sequence mask (its causal mask
    AND ``packed_sequence_mask_function(ids)``, the causal part possibly remapped to each
    sequence's positions), or None for any other mask function. Recognised by the
    functions transformers composes (plain Python, so it holds under ``torch.compile``);
    anything else is refused by the caller."""
    from transformers import masking_utils as mu

    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    parts = _closure(mask_function).get("mask_functions", ())
    causal, ids = 0, None
    for part in parts:
        qual = getattr(part, "__qualname__", "")
        if part is mu.causal_mask_function:
            causal += 1
        elif qual == "remap_positions_for_packed_sequence.<locals>.inner_mask" and \
                _closure(part).get("mask_function") is mu.causal_mask_function:
            causal += 1
        elif qual == "packed_sequence_mask_function.<locals>.inner_mask" and ids is None:
            ids = _closure(part).get("packed_sequence_mask")
        else:
            return None
    return ids if causal == 1 and isinstance(ids, torch.Tensor) else None


def mask_builder(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0,
                 kv_offset: int = 0, mask_function: Callable | None = None,
                 attention_mask: torch.Tensor | None = None, local_size: int | None = None,
                 **kwargs) -> torch.Tensor:
    """The ``AttentionMaskInterface`` entry: transformers' sdpa-style 4D bool mask
    ``[B, 1, Sq, Skv]`` (True = attend), always materialised, after refusing by structure
    what jaxattn cannot compute."""
    from transformers import masking_utils as mu

    if mask_function is not None and packed_sequence_ids(mask_function) is not None:
        # Packed sequences (transformers found them in position_ids): no [S, S] mask is
        # built; the attention function takes the sequences from position_ids (or the
        # cu_seq_lens_* a flattening collator passes) and runs jaxattn's varlen entry.
        if q_length != kv_length or kv_offset != 0 or attention_mask is not None:
            raise ValueError("jaxattn serves packed sequences without a cache or a padding "
                             "mask only (training and scoring forwards)")
        return None
    if mask_function is not None and mask_function is not mu.causal_mask_function:
        name = getattr(mask_function, "__name__", repr(mask_function))
        raise ValueError(
            f"jaxattn computes causal attention with key padding only; transformers asked "
            f"for another mask pattern (mask function {name!r}: sliding window, chunked, "
            f"packed sequences, bidirectional or a custom overlay)")
    if local_size is not None:
        raise ValueError(f"jaxattn has no local/sliding attention (local_size={local_size})")
    if q_length > 1:
        q_end = q_offset
        if isinstance(q_end, torch.Tensor):
            if _compiling():
                raise ValueError("jaxattn cannot check a tensor query offset (a StaticCache "
                                 "prefill) under torch.compile; use a DynamicCache")
            q_end = int(q_end)
        if q_end + q_length != kv_offset + kv_length:
            raise ValueError(
                f"jaxattn's causal rule needs the {q_length} queries to be the last keys, but "
                f"they sit at [{q_end}, {q_end + q_length}) of keys [{kv_offset}, "
                f"{kv_offset + kv_length}) (a StaticCache prefill?); use a DynamicCache")
    for k in ("allow_is_causal_skip", "allow_is_bidirectional_skip", "use_vmap"):
        kwargs.pop(k, None)
    # Never skipped: a None mask is ambiguous (sdpa reads it as top-left causal).
    return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                        q_offset=q_offset, kv_offset=kv_offset,
                        mask_function=mu.causal_mask_function, attention_mask=attention_mask,
                        local_size=None, allow_is_causal_skip=False,
                        allow_is_bidirectional_skip=False, use_vmap=False, **kwargs)


def causal_keep(sq: int, skv: int, device=None) -> torch.Tensor:
    """jaxattn's ``causal=True`` as a ``[Sq, Skv]`` bool: row i keeps keys j <= i + Skv - Sq."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(skv, device=device)[None, :]
    return j <= i + (skv - sq)


def key_padding_mask_from(attention_mask: torch.Tensor | None, batch: int, sq: int, skv: int,
                          *, verify: bool | None = None) -> torch.Tensor | None:
    """The jaxattn ``key_padding_mask`` ``[B, Skv]`` (True = keep) equivalent to a
    transformers attention mask, or None for no padding.

    Accepted: None (plain causal; only where prefill and decode alignments agree: Sq = 1
    or Sq = Skv), a 2D ``[B, Skv]`` padding mask (bool or 0/1), a 4D bool mask (True =
    attend) or a 4D additive float mask (0 = attend, the dtype's minimum or -inf = not),
    shaped ``[B or 1, 1 or H, Sq, Skv]``. A 4D mask must be bottom-right causal AND key
    padding; ``verify`` (default: when not under ``torch.compile``) checks it element for
    element and raises ``ValueError`` otherwise.
    """
    if verify is None:
        verify = not _compiling()
    if attention_mask is None:
        if sq != 1 and sq != skv:
            raise ValueError(
                f"no attention mask with Sq={sq} != Skv={skv}: the causal alignment is "
                f"ambiguous (transformers' sdpa would align top-left, jaxattn aligns "
                f"bottom-right); pass a mask built by jaxattn's mask builder")
        return None
    m = attention_mask
    if not isinstance(m, torch.Tensor):
        raise ValueError(f"jaxattn takes a tensor attention mask, got {type(m).__name__} "
                         f"(a flex BlockMask or a dict of masks is not supported)")
    if m.ndim == 2:
        if tuple(m.shape) != (batch, skv):
            raise ValueError(f"2D attention mask of shape {tuple(m.shape)}, expected "
                             f"[B, Skv] = {(batch, skv)}")
        if m.dtype != torch.bool:
            if verify and not bool(((m == 0) | (m == 1)).all()):
                raise ValueError("a 2D attention mask must hold only 0 and 1")
            m = m != 0
        return m
    if m.ndim != 4:
        raise ValueError(f"attention mask must be 2D or 4D, got shape {tuple(m.shape)}")
    if m.shape[-2] != sq or m.shape[-1] != skv or m.shape[0] not in (1, batch):
        raise ValueError(f"4D attention mask of shape {tuple(m.shape)} does not match "
                         f"[B, H, Sq, Skv] = [{batch}, H, {sq}, {skv}]")
    if m.dtype == torch.bool:
        keep = m
    elif m.dtype.is_floating_point:
        keep = m == 0
        if verify:
            lowest = torch.finfo(m.dtype).min
            if not bool((keep | (m <= lowest)).all()):
                raise ValueError("a float attention mask must hold only 0 (attend) and the "
                                 "dtype's minimum or -inf (masked); jaxattn takes no bias")
    else:
        raise ValueError(f"4D attention mask of dtype {m.dtype}: expected bool or float")
    if keep.shape[1] != 1:
        if verify and not bool((keep == keep[:, :1]).all()):
            raise ValueError("per-head attention masks are not supported: all heads must "
                             "share one mask")
        keep = keep[:, :1]
    keep = keep[:, 0].expand(batch, sq, skv)
    # Bottom-right causal: the last query row sees every key, so its mask is the padding.
    kpm = keep[:, -1, :]
    if verify:
        expected = causal_keep(sq, skv, keep.device)[None] & kpm[:, None, :]
        if not torch.equal(keep, expected):
            bad = (keep != expected).nonzero()[0].tolist()
            raise ValueError(
                f"the attention mask is not 'causal (queries = the last keys) + key padding' "
                f"(first mismatch at [batch, query, key] = {bad}): sliding window, packed "
                f"sequences, a bidirectional or custom mask, or a static cache; jaxattn "
                f"refuses rather than computing something else")
    return kpm


class _MaskMemo:
    """The last mask derived, by identity: transformers builds one mask per forward and
    hands the same tensor to every layer, so the element-wise check (which reads the
    mask's values: a host wait on a GPU) runs once per forward, not once per layer. A
    padding mask that keeps every key becomes None (no mask crosses to JAX)."""

    def __init__(self):
        self.key = None
        self.value = None

    def get(self, attention_mask, b, sq, skv):
        if attention_mask is None or _compiling() or not isinstance(attention_mask,
                                                                   torch.Tensor):
            return key_padding_mask_from(attention_mask, b, sq, skv)
        key = (id(attention_mask), attention_mask.data_ptr(), attention_mask._version,
               tuple(attention_mask.shape), attention_mask.dtype, b, sq, skv)
        if key != self.key:
            kpm = key_padding_mask_from(attention_mask, b, sq, skv)
            if kpm is not None and bool(kpm.all()):
                kpm = None
            # The mask itself is held, so its id and storage are not reused while cached.
            self.key, self.value, self._held = key, kpm, attention_mask
        return self.value


def packed_cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor | None:
    """``cu_seqlens [N + 1]`` int32 of the ``B * S`` flattened tokens when ``position_ids
    [B, S]`` pack several sequences into a row (a position that does not follow the one
    before it by 1 starts a sequence, as transformers' ``find_packed_sequence_indices``
    reads them; each row starts one), else None. Reads the values (a host wait on a
    GPU)."""
    b, s = position_ids.shape
    start = torch.ones(b, s, dtype=torch.bool, device=position_ids.device)
    start[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if s < 2 or not bool(start[:, 1:].any()):
        return None
    idx = start.reshape(-1).nonzero().flatten()
    return torch.cat([idx, idx.new_tensor([b * s])]).to(torch.int32)


class _PackMemo:
    """The last packing derived from ``position_ids``, by identity (one per forward: every
    layer gets the same tensor)."""

    def __init__(self):
        self.key = None
        self.value = None

    def get(self, position_ids: torch.Tensor):
        key = (id(position_ids), position_ids.data_ptr(), position_ids._version,
               tuple(position_ids.shape))
        if key != self.key:
            cu = packed_cu_seqlens(position_ids)
            longest = None if cu is None else int((cu[1:] - cu[:-1]).max())
            self.key, self.value, self._held = key, (cu, longest), position_ids
        return self.value


# ------------------------------------------------------------------ attention function

def make_attention_function(backend: str | None = None) -> Callable:
    """An ``AttentionInterface`` function running ``torch_bridge.get_op("attention",
    backend=backend)``. Its ``.op`` attribute is the op (``.op.backend`` names the backend)."""
    op = get_op("attention", backend=backend)
    memo = _MaskMemo()
    _derived_mask = memo.get

    def jaxattn_attention_forward(module: torch.nn.Module, query: torch.Tensor,
                                  key: torch.Tensor, value: torch.Tensor,
                                  attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                  scaling: float | None = None, is_causal: bool | None = None,
                                  **kwargs) -> tuple[torch.Tensor, None]:
        """query ``[B, Hq, Sq, D]``, key/value ``[B, Hkv, Skv, D]`` (cache included, GQA
        not repeated) -> ``(out [B, Sq, Hq, D] contiguous, None)``."""
        if dropout:
            raise ValueError(f"jaxattn has no attention dropout (dropout={dropout}); set "
                             f"attention_dropout=0 or use model.eval()")
        for name, what in _REFUSED_KWARGS.items():
            if kwargs.get(name) is not None:
                raise ValueError(f"jaxattn does not support {what} ({name}=...)")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if not causal:
            raise ValueError("jaxattn's transformers integration serves causal attention "
                             "only (is_causal=False)")
        b, _, sq, _ = query.shape
        skv = key.shape[2]
        if attention_mask is None and sq == skv and (
                kwargs.get("cu_seq_lens_q") is not None
                or isinstance(kwargs.get("position_ids"), torch.Tensor)):
            out = _packed(query, key, value, scaling, kwargs)
            if out is not None:
                return out, None
        kpm = _derived_mask(attention_mask, b, sq, skv)
        out = op(query, key, value, causal=True,
                 scale=None if scaling is None else float(scaling), key_padding_mask=kpm)
        return out.transpose(1, 2).contiguous(), None

    packs = _PackMemo()

    def _packed(query, key, value, scaling, kwargs):
        """Packed sequences through :func:`torch_bridge.varlen_attention`, or None when
        the batch packs nothing (one sequence per row)."""
        b, hq, s, d = query.shape
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        if cu_q is not None:
            if b != 1:
                raise ValueError(f"cu_seq_lens_q describes one packed row; got a batch of {b}")
            cu_k = cu_q if cu_k is None else cu_k
            max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
            max_q = int((cu_q[1:] - cu_q[:-1]).max()) if max_q is None else max_q
            max_k = int((cu_k[1:] - cu_k[:-1]).max()) if max_k is None else max_k
        else:
            if _compiling():
                raise ValueError("jaxattn reads packed sequences off position_ids eagerly; "
                                 "under torch.compile pass cu_seq_lens_q/k and "
                                 "max_length_q/k (DataCollatorWithFlattening)")
            cu_q, longest = packs.get(kwargs["position_ids"].expand(b, s))
            if cu_q is None:
                return None
            cu_k, max_q, max_k = cu_q, longest, longest
        flat = [x.transpose(1, 2).reshape(b * s, x.shape[1], d) for x in (query, key, value)]
        out = varlen_attention(*flat, cu_q, cu_k, max_q, max_k, causal=True,
                               softmax_scale=None if scaling is None else float(scaling),
                               backend=backend)
        return out.reshape(b, s, hq, d)

    jaxattn_attention_forward.op = op
    return jaxattn_attention_forward


def register(name: str = DEFAULT_NAME, backend: str | None = None) -> str:
    """Register jaxattn under ``name`` in transformers' ``AttentionInterface`` and
    ``AttentionMaskInterface`` (global: every model sees it). Returns ``name``; select it
    with ``attn_implementation=name`` or ``model.set_attn_implementation(name)``.

    ``backend`` is the jaxattn backend (None: the platform default: ``mosaic`` on sm90,
    ``pallas`` on other GPUs). The kernel backends (``mosaic``, ``pallas``, ``triton``)
    promise decode rows equal to prefill rows in bits; the reference does not.
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, make_attention_function(backend))
    AttentionMaskInterface.register(name, mask_builder)
    return name
