"""Paged KV attention from PyTorch: ``torch_bridge.get_op("paged_attention")`` on a
rollout engine's own cache tensors.

    op = torch_bridge.get_op("paged_attention")
    out = op(q, k_cache, v_cache, block_table, seq_lens, layout="NHD")  # vLLM's layout

``q [B, Hq, Sq, D]`` are the last ``Sq`` tokens of each sequence; ``k_cache, v_cache``
are ``[num_pages, Hkv, page_size, D]`` (``layout="HND"``) or ``[num_pages, page_size,
Hkv, D]`` (``"NHD"``, vLLM's and FlashInfer's); ``block_table [B, max_pages]`` and
``seq_lens [B]`` int32. Everything crosses by DLPack without a copy (the cache is read
in place by the kernels, as in JAX: see :mod:`jaxattn.paged` for the page sizes the
``mosaic`` backend gathers instead), and the
result has the bits of :func:`jaxattn.paged.attention` on the same arrays. Forward only
(rollout). Compiles: the cache, the table and the lengths keep their shapes between
steps (the lengths are run-time values), and ``Sq`` is padded to its bucket
(:func:`jaxattn.schedule.bucket_length`) with earlier positions in front, on backends
that follow the schedule (a row's bits do not depend on the rows beside it), so decode
compiles once and chunked prefill once per bucket.
"""

from __future__ import annotations

import functools

import jax
import torch

from jaxattn import paged as jpaged
from jaxattn import platform as _jplatform
from jaxattn import registry
from jaxattn.schedule import bucket_length
from torch_bridge import bridge

__all__ = ["PagedOp"]


#: Traces of the jitted paged call: (backend, causal, scale, layout, platform, q shape).
TRACES: list[tuple] = []


@functools.cache
def _jax_paged(backend: str, causal: bool, scale: float | None, layout: str, platform: str):
    def fn(q, k_pages, v_pages, block_table, seq_lens):
        TRACES.append((backend, causal, scale, layout, platform, q.shape))
        return jpaged.attention(q, k_pages, v_pages, block_table, seq_lens, causal=causal,
                                scale=scale, return_lse=True, backend=backend, layout=layout)
    return jax.jit(fn)


class PagedOp:
    """``jaxattn.paged.attention`` for torch tensors (the device follows the inputs)."""

    op_name = "paged_attention"

    def __init__(self, backend: str | None = None):
        self._requested = backend
        self._by_platform: dict[str, str] = {}

    def _resolve(self, platform: str) -> str:
        return bridge.resolve_backend(self._by_platform, "attention", self._requested,
                                      platform)

    @property
    def backend(self) -> str:
        """The jaxattn backend that serves this op on JAX's default platform."""
        return self._resolve(registry.current_platform())

    def __repr__(self) -> str:
        return f"PagedOp(backend={self.backend!r})"

    def forward_with_lse(self, q, k_pages, v_pages, block_table, seq_lens, *,
                         causal: bool = True, scale: float | None = None,
                         layout: str = "HND") -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, Hq, Sq, D] q.dtype, lse [B, Hq, Sq] fp32)``."""
        named = {"q": q, "k_pages": k_pages, "v_pages": v_pages, "block_table": block_table,
                 "seq_lens": seq_lens}
        for name, t in named.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        for name in ("block_table", "seq_lens"):
            if named[name].dtype != torch.int32:
                raise TypeError(f"{name} must be an int32 tensor, got {named[name].dtype}")
        for name in ("q", "k_pages", "v_pages"):
            if named[name].dtype not in bridge._DTYPES:
                raise TypeError(f"{name} has unsupported dtype {named[name].dtype}")
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        bridge._check_same_device(named)
        jpaged.validate(bridge._Meta(q), bridge._Meta(k_pages), bridge._Meta(v_pages),
                        bridge._Meta(block_table), bridge._Meta(seq_lens), layout)
        platform = bridge._platform(q)
        backend = self._resolve(platform)
        sq = q.shape[2]
        # Earlier positions in front: row i of the padded block is token seq_lens - bq + i.
        bq = bucket_length(sq) if registry.backend(backend).follows_schedule and sq else sq
        if bq != sq:
            q = torch.nn.functional.pad(q, (0, 0, bq - sq, 0))
        fn = _jax_paged(backend, causal, None if scale is None else float(scale), layout,
                        platform)
        with _jplatform.use(platform):
            out, lse = fn(*bridge._to_jax_all(q, k_pages, v_pages, block_table, seq_lens))
            out, lse = bridge._to_torch(out, platform), bridge._to_torch(lse, platform)
        if bq != sq:
            out = out[:, :, bq - sq:].contiguous()
            lse = lse[:, :, bq - sq:].contiguous()
        return out, lse

    def forward(self, q, k_pages, v_pages, block_table, seq_lens, **kwargs) -> torch.Tensor:
        """``out [B, Hq, Sq, D]`` in q's dtype."""
        return self.forward_with_lse(q, k_pages, v_pages, block_table, seq_lens, **kwargs)[0]

    __call__ = forward
