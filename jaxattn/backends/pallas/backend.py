"""The ``"pallas"`` backend: the Pallas kernels (Triton lowering) of
:mod:`jaxattn.backends.pallas.forward` and :mod:`jaxattn.backends.pallas.backward` behind
the backend interface.

GPU: sm80 and newer (the registry's choice where the ``mosaic`` backend is unavailable).
CPU: the same kernels in Pallas interpret mode (``backend="pallas"`` explicitly; the
CPU's automatic choice is the reference). Every path but varlen: the paged cache is read
in place (page sizes that are multiples of ``BLOCK_N``), CP folds the kernels' per-SPLIT
partial states with :func:`jaxattn.merge.fold` (the merge the kernels trace).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxattn import platform as _platform
from jaxattn.backends.base import Backend
from jaxattn.backends.pallas import backward as pv
from jaxattn.backends.pallas import forward as pt


def interpret() -> bool:
    """Whether the kernels run in interpret mode here (on a CPU)."""
    return _platform.current() == "cpu"


def nvidia_gpu_reason(what: str) -> str | None:
    """Why this process's GPU cannot run Triton kernels on the canonical schedule
    (``what`` names them in the message), or None."""
    here = _platform.current()
    if here != "gpu":
        return f"{what} need an NVIDIA GPU, the platform is {here!r}"
    cc = getattr(jax.devices()[0], "compute_capability", None)
    try:
        major = int(str(cc).split(".")[0])
    except ValueError:
        return f"unknown compute capability {cc!r}"
    if major < 8:
        return f"needs compute capability >= 8.0 (bf16 matrix units), got {cc}"
    return None


class PallasBackend(Backend):
    name = "pallas"
    description = "Pallas kernels (Triton lowering) on the canonical schedule"
    platforms = ("gpu", "cpu")
    priority = {"gpu": 10}
    paths = frozenset(("attention", "backward", "cp", "cp_mesh", "paged", "varlen"))

    def available(self) -> str | None:
        if interpret():
            return None
        return nvidia_gpu_reason("the Pallas Triton kernels")

    def unsupported(self, dims, path="attention", *, page_size=None):
        reason = super().unsupported(dims, path, page_size=page_size)
        if reason is None:
            reason = pt.check_supported(dims.head_dim)
        return reason

    def forward_with_lse(self, q, k, v, *, causal, scale, key_padding_mask=None,
                         causal_offsets=None):
        return pv.attention(q, k, v, key_padding_mask, causal_offsets, bool(causal),
                            float(scale), interpret())

    def backward(self, q, k, v, key_padding_mask, out, lse, d_out, d_lse, *, causal, scale,
                 causal_offsets=None):
        return pv.backward(q, k, v, key_padding_mask, out, lse, d_out.astype(out.dtype),
                           d_lse, causal_offsets, causal=bool(causal), scale=float(scale),
                           interpret=interpret())

    def split_states(self, q, k, v, key_padding_mask, causal_offsets, *, causal, scale):
        b, hq, sq, d = q.shape
        o_parts, lse_parts = pt.split_partials(q, k, v, key_padding_mask, causal_offsets,
                                               causal=bool(causal), scale=float(scale),
                                               interpret=interpret())
        n = o_parts.shape[2]  # [B, Hkv, n, g * Sq, D] -> [n, B, Hq, Sq, D]
        return (jnp.moveaxis(o_parts, 2, 0).reshape(n, b, hq, sq, d),
                jnp.moveaxis(lse_parts, 2, 0).reshape(n, b, hq, sq))

    carries_split_state = True

    def split_segment(self, q, k, v, key_padding_mask, causal_offsets, carry, *, causal,
                      scale, finish):
        b, hq, sq, d = q.shape
        res = pt.split_segment(q, k, v, key_padding_mask, causal_offsets, carry,
                               causal=bool(causal), scale=float(scale),
                               interpret=interpret(), finish=finish)
        if not finish:
            return res
        o_parts, lse_parts = res  # [B, Hkv, 1, g * Sq, D] -> [1, B, Hq, Sq, D]
        return (jnp.moveaxis(o_parts, 2, 0).reshape(1, b, hq, sq, d),
                jnp.moveaxis(lse_parts, 2, 0).reshape(1, b, hq, sq))

    def backward_over_ranges(self, q, k, v, key_padding_mask, out, lse, d_out, d_lse, *,
                             ranges, offsets, causal, scale):
        """dK, dV per key range from the final lse and delta; dQ accumulated over the
        ranges in ascending order in one fp32 accumulator, scaled and cast once (bits of
        one call over all keys when ranges start on KV-block boundaries)."""
        kw = dict(causal=bool(causal), scale=float(scale), interpret=interpret())
        d_out = d_out.astype(out.dtype)
        dl = pv.delta(out, d_out, d_lse, interpret=kw["interpret"])
        dks, dvs, acc = [], [], None
        for a, e in ranges:
            if e == a:
                continue
            ms = None if key_padding_mask is None else key_padding_mask[:, a:e]
            off = offsets - a
            dk, dv = pv.dkdv(q, k[:, :, a:e], v[:, :, a:e], d_out, lse, dl, ms, off, **kw)
            dks.append(dk)
            dvs.append(dv)
            acc = pv.dq_accumulate(q, k[:, :, a:e], v[:, :, a:e], d_out, lse, dl, ms, off,
                                   acc, **kw)
        if acc is None:
            return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
        return ((acc * scale).astype(q.dtype), jnp.concatenate(dks, axis=2),
                jnp.concatenate(dvs, axis=2))

    def delta(self, out, d_out, d_lse):
        return pv.delta(out, d_out.astype(out.dtype), d_lse, interpret=interpret())

    def key_gradients(self, q, k, v, key_padding_mask, d_out, lse, delta, *, causal, scale,
                      causal_offsets):
        return pv.dkdv(q, k, v, d_out, lse, delta, key_padding_mask, causal_offsets,
                       causal=bool(causal), scale=float(scale), interpret=interpret())

    def query_gradients(self, q, k, v, key_padding_mask, d_out, lse, delta, *, causal,
                        scale, causal_offsets):
        acc = pv.dq_accumulate(q, k, v, d_out, lse, delta, key_padding_mask, causal_offsets,
                               causal=bool(causal), scale=float(scale),
                               interpret=interpret())
        return (acc * scale).astype(q.dtype)

    def paged_forward(self, q, k_pages, v_pages, block_table, seq_lens, *, causal, scale,
                      layout="HND"):
        """Pages read in place, one ``BLOCK_N`` block at a time (no gather), any page size,
        both layouts."""
        return pt.paged_forward(q, k_pages, v_pages, block_table, seq_lens,
                                causal=bool(causal), scale=float(scale),
                                interpret=interpret(), layout=layout)


BACKEND = PallasBackend()
