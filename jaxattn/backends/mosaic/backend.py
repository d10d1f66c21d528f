"""The ``"mosaic"`` backend: the Mosaic GPU (Hopper) forward and backward
(:mod:`jaxattn.backends.mosaic.forward`, :mod:`jaxattn.backends.mosaic.backward`) behind the
backend interface (:class:`MosaicBackend`), differentiable through ``jax.custom_vjp``.

On an sm90 GPU the registry chooses it before ``"pallas"``: it serves every
call the ``"pallas"`` backend serves. What it serves (:func:`check_supported`, raised as
ValueError by the op otherwise):

* bf16 or fp16 inputs on the Mosaic GPU kernels (the wgmma operand types);
* fp32 inputs on the Pallas backend's kernels (Hopper's wgmma has no fp32 product, only
  tf32): every fp32 path of this backend (forward, backward, paged KV, CP) is the
  ``"pallas"`` backend's, so fp32 keeps that backend's invariance matrix, and
  ``forward_fp32`` (which upcasts) is the Pallas backend's fp32 result. The head dims
  are then the Pallas kernels' (1 to 256, zero-padded to a power of two from 16);
* bf16/fp16 head dims 1 to 256: D < 64 runs zero-padded to 64, 64 < D < 128 to 128,
  128 < D < 256 to 256. The padding adds exact zeros to every dot product, and a given
  D always runs the same padded kernel, so the invariance matrix is unaffected; the
  scale is that of the real D;
* any B, Hq, Hkv with Hq a multiple of Hkv, any Sq and Skv (padded inside the kernels;
  Sq = 0 or Skv = 0 are answered without a kernel: no rows, or rows with no visible
  key: 0 and lse = -inf), causal or not, with or without a key padding mask;
* an NVIDIA GPU of compute capability 9.0 (wgmma and TMA as sm90a has them).

Paged KV (:mod:`jaxattn.paged`): causal calls at a native head dim read the pages in
place (pages of a multiple of 64 keys, or of 8, 16 or 32); otherwise the pages are
gathered into contiguous K and V and the forward runs with the keys past each sequence's
length dropped. Both with per-sequence causal offsets (``seq_lens - Sq``), so a row's
bits are those of its contiguous call. CP
(:mod:`jaxattn.cp`): the kernel's per-SPLIT partial states, folded by the Mosaic fold
kernel, and the backward over key ranges.

The Mosaic modules are imported on first use, so importing jaxattn never depends on
``jax.experimental.pallas.mosaic_gpu``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import platform as _platform
from jaxattn.backends.base import Backend, page_dims
from jaxattn.backends.common import pad_head_dim, padded_head_dim
from jaxattn.backends.pallas import forward as pallas_triton
from jaxattn.backends.pallas.backend import BACKEND as PALLAS

#: Head dims the kernels take natively; others are zero-padded to the next one.
NATIVE_HEAD_DIMS = (64, 128, 256)
#: The dtypes of the Mosaic GPU kernels.
DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def on_pallas(dtype) -> bool:
    """Whether this backend serves a call of ``dtype`` on the Pallas backend's kernels
    (fp32: Hopper's wgmma has no fp32 product)."""
    return np.dtype(dtype) == np.dtype(jnp.float32)


def check_supported(head_dim: int, dtype) -> str | None:
    """Why this backend cannot serve a call of this head dim and dtype, or None."""
    if on_pallas(dtype):
        reason = pallas_triton.check_supported(head_dim)
        return None if reason is None else f"fp32 runs the Pallas kernels: {reason}"
    if np.dtype(dtype) not in DTYPES:
        return (f"dtype {np.dtype(dtype).name} is not supported by the Mosaic GPU kernels "
                f"(bf16 or fp16; fp32 on the Pallas kernels)")
    if not 1 <= head_dim <= NATIVE_HEAD_DIMS[-1]:
        return (f"head dim D={head_dim} is not supported by the Mosaic GPU kernels "
                f"(1 to {NATIVE_HEAD_DIMS[-1]})")
    return None


def unavailable_reason() -> str | None:
    """Why this process cannot run the Mosaic GPU kernels, or None."""
    here = _platform.current()
    if here != "gpu":
        return (f"the Mosaic GPU kernels need an NVIDIA Hopper GPU (sm90), the platform is "
                f"{here!r} (their interpret-mode tests: tests/test_mosaic_*.py)")
    cc = str(getattr(jax.devices()[0], "compute_capability", ""))
    if cc != "9.0":
        return f"the Mosaic GPU kernels need compute capability 9.0 (sm90a), got {cc!r}"
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the installed JAX
        return f"jax.experimental.pallas.mosaic_gpu does not import: {e}"
    return None


def _padded_head_dim(d: int) -> int:
    return padded_head_dim(d, NATIVE_HEAD_DIMS)


def _refuse_unsupported(q) -> None:
    """Raise :func:`check_supported`'s reason (ValueError), if any."""
    reason = check_supported(q.shape[-1], q.dtype)
    if reason is not None:
        raise ValueError(reason)


def _is_empty(q, k, btnh: bool = False) -> bool:
    """No rows, or rows that see no key: answered without a kernel."""
    return 0 in (*q.shape[:3], k.shape[1 if btnh else 2])


def _served(q, k, v, run, btnh: bool = False):
    """The Mosaic entries' common frame: refuse what the kernels do not serve, answer
    empty calls without a kernel (0 and -inf, zero gradients), zero-pad the head dim to
    a native one, ``run(q, k, v) -> (out, lse)`` and cut the output back to D.
    ``btnh``: q, k, v are ``[B, S, H, D]``."""
    _refuse_unsupported(q)
    if on_pallas(q.dtype):
        raise ValueError("fp32 runs the Pallas kernels, not this entry (an internal error)")
    d = q.shape[-1]
    b, sq, hq = (q.shape[0], q.shape[1], q.shape[2]) if btnh else (
        q.shape[0], q.shape[2], q.shape[1])
    if _is_empty(q, k, btnh):
        return jnp.zeros(q.shape, q.dtype), jnp.full((b, hq, sq), -jnp.inf, jnp.float32)
    dp = _padded_head_dim(d)
    out, lse = run(*(pad_head_dim(x, dp) for x in (q, k, v)))
    return out[..., :d], lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _core(q, k, v, key_padding_mask, causal_offsets, causal, scale, interpret, fwd_config,
          bwd_config, btnh):
    from jaxattn.backends.mosaic import forward as mosaic_fwd
    return mosaic_fwd.forward(q, k, v, causal=causal, scale=scale, interpret=interpret,
                              config=fwd_config, key_padding_mask=key_padding_mask,
                              causal_offsets=causal_offsets if causal else None, btnh=btnh)


def _core_fwd(q, k, v, key_padding_mask, causal_offsets, causal, scale, interpret,
              fwd_config, bwd_config, btnh):
    out, lse = _core(q, k, v, key_padding_mask, causal_offsets, causal, scale, interpret,
                     fwd_config, bwd_config, btnh)
    return (out, lse), (q, k, v, key_padding_mask, causal_offsets, out, lse)


def _kernel_backward(q, k, v, key_padding_mask, causal_offsets, out, lse, d_out, d_lse, *,
                     causal, scale, interpret, bwd_config, btnh=False):
    """The Mosaic backward of native-D inputs: with per-sequence causal offsets, the
    backward over one key range (its kernels take dynamic offsets). ``btnh``: q, k, v,
    out, d_out and the gradients are ``[B, S, H, D]``."""
    from jaxattn.backends.mosaic import backward as mosaic_bwd
    d_out = d_out.astype(out.dtype)
    if causal and causal_offsets is not None:
        return mosaic_bwd.backward_over_ranges(
            q, k, v, out, lse, d_out, d_lse, ranges=[(0, k.shape[1 if btnh else 2])],
            offsets=jnp.asarray(causal_offsets, jnp.int32), causal=True, scale=scale,
            interpret=interpret, config=bwd_config, key_padding_mask=key_padding_mask,
            btnh=btnh)
    return mosaic_bwd.backward(q, k, v, out, lse, d_out, d_lse, causal=causal, scale=scale,
                               interpret=interpret, config=bwd_config,
                               key_padding_mask=key_padding_mask, btnh=btnh)


def _core_bwd(causal, scale, interpret, fwd_config, bwd_config, btnh, residuals,
              cotangents):
    q, k, v, key_padding_mask, causal_offsets, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dk, dv = _kernel_backward(q, k, v, key_padding_mask, causal_offsets, out, lse, d_out,
                                  d_lse, causal=causal, scale=scale, interpret=interpret,
                                  bwd_config=bwd_config, btnh=btnh)
    return dq, dk, dv, None, None


_core.defvjp(_core_fwd, _core_bwd)


def _pad_all(dp, *xs):
    return tuple(None if x is None else pad_head_dim(x, dp) for x in xs)


class MosaicBackend(Backend):
    """The Mosaic GPU kernels behind the interface; fp32 calls on every path are the
    Pallas backend's (:func:`on_pallas`). ``interpret`` and the configs are for tests
    (Mosaic GPU interpret mode on a CPU with one-warpgroup configurations); the
    registered instance compiles for the GPU with the default configurations."""

    name = "mosaic"
    description = ("Pallas Mosaic GPU kernels (Hopper: wgmma, TMA) on the canonical "
                   "schedule; bf16/fp16 (fp32 on the Pallas kernels)")
    platforms = ("gpu",)
    paths = frozenset(("attention", "backward", "cp", "cp_mesh", "paged", "varlen"))
    priority = {"gpu": 5}  # before pallas wherever available (sm90)

    def __init__(self, *, interpret=False, fwd_config=None, bwd_config=None):
        self.interpret = interpret
        self.fwd_config = fwd_config
        self.bwd_config = bwd_config
        if interpret:
            self.platforms = ("gpu", "cpu")

    def available(self) -> str | None:
        return None if self.interpret else unavailable_reason()

    def unsupported(self, dims, path="attention", *, page_size=None):
        if on_pallas(dims.dtype):
            reason = PALLAS.unsupported(dims, path, page_size=page_size)
            return None if reason is None else f"fp32 runs the Pallas kernels: {reason}"
        return (super().unsupported(dims, path, page_size=page_size)
                or check_supported(dims.head_dim, dims.dtype))

    def serving(self, dtype) -> Backend:
        """fp32 calls are served by the Pallas kernels on every path."""
        return PALLAS if on_pallas(dtype) else self

    def _kw(self):
        return dict(interpret=self.interpret, fwd_config=self.fwd_config,
                    bwd_config=self.bwd_config)

    def forward_with_lse(self, q, k, v, *, causal, scale, key_padding_mask=None,
                         causal_offsets=None):
        if on_pallas(q.dtype):
            return PALLAS.forward_with_lse(q, k, v, causal=causal, scale=scale,
                                           key_padding_mask=key_padding_mask,
                                           causal_offsets=causal_offsets)
        return attention(q, k, v, key_padding_mask, causal=causal, scale=scale,
                         causal_offsets=causal_offsets, **self._kw())

    def forward_with_lse_btnh(self, q, k, v, *, causal, scale, key_padding_mask=None,
                              causal_offsets=None):
        """JAX's layout read and written in place by the kernels (forward and backward:
        each tile a strided TMA box, no transpose); fp32 (the Pallas kernels) transposes
        as the default does."""
        if on_pallas(q.dtype):
            return super().forward_with_lse_btnh(q, k, v, causal=causal, scale=scale,
                                                 key_padding_mask=key_padding_mask,
                                                 causal_offsets=causal_offsets)
        return attention(q, k, v, key_padding_mask, causal=causal, scale=scale,
                         causal_offsets=causal_offsets, btnh=True, **self._kw())

    def backward(self, q, k, v, key_padding_mask, out, lse, d_out, d_lse, *, causal, scale,
                 causal_offsets=None):
        return backward(q, k, v, key_padding_mask, out, lse, d_out, d_lse, causal=causal,
                        scale=scale, causal_offsets=causal_offsets,
                        interpret=self.interpret, bwd_config=self.bwd_config)

    def split_states(self, q, k, v, key_padding_mask, causal_offsets, *, causal, scale):
        """The Mosaic kernel's split axis (:func:`forward.split_partials`), the lse in
        the kernels' base, for :meth:`fold_states`."""
        if on_pallas(q.dtype):
            return PALLAS.split_states(q, k, v, key_padding_mask, causal_offsets,
                                       causal=causal, scale=scale)
        from jaxattn.backends.mosaic import forward as mosaic_fwd
        _refuse_unsupported(q)
        d = q.shape[-1]
        dp = _padded_head_dim(d)
        o_parts, lse_parts = mosaic_fwd.split_partials(
            *_pad_all(dp, q, k, v), causal=bool(causal), scale=float(scale),
            interpret=self.interpret, config=self.fwd_config,
            key_padding_mask=key_padding_mask,
            causal_offsets=causal_offsets if causal else None, kernel_lse=True)
        return o_parts[..., :d], lse_parts

    carries_split_state = True

    def split_segment(self, q, k, v, key_padding_mask, causal_offsets, carry, *, causal,
                      scale, finish):
        """A piece of a SPLIT continued from the running state of the piece before it
        (:func:`forward.split_segment`), in the states' form of :meth:`split_states`."""
        if on_pallas(q.dtype):
            return PALLAS.split_segment(q, k, v, key_padding_mask, causal_offsets, carry,
                                        causal=causal, scale=scale, finish=finish)
        from jaxattn.backends.mosaic import forward as mosaic_fwd
        _refuse_unsupported(q)
        d = q.shape[-1]
        dp = _padded_head_dim(d)
        if carry is not None:
            carry = (pad_head_dim(carry[0], dp), *carry[1:])
        res = mosaic_fwd.split_segment(
            *_pad_all(dp, q, k, v), carry, causal=bool(causal), scale=float(scale),
            interpret=self.interpret, config=self.fwd_config,
            key_padding_mask=key_padding_mask,
            causal_offsets=causal_offsets if causal else None, finish=finish)
        return (res[0][..., :d], *res[1:])

    def fold_states(self, outs, lses, *, natural=True):
        """Folded by the Mosaic fold kernel, as the single call folds in its kernel
        (XLA's merge differed from it in the last bit on the H200). For the states of a
        bf16/fp16 call; an fp32 call's states are the Pallas kernels' (:meth:`serving`).
        ``natural=False``: the lse stays in the kernels' base (the states' form)."""
        from jaxattn.backends.mosaic import forward as mosaic_fwd
        d = outs.shape[-1]
        dp = _padded_head_dim(d)
        out, lse = mosaic_fwd.fold_partials(pad_head_dim(outs, dp), lses,
                                            interpret=self.interpret, config=self.fwd_config,
                                            natural=natural)
        return out[..., :d], lse

    def fold_on(self, state, q, k, v, key_padding_mask, causal_offsets, *, causal, scale,
                finish=False):
        """In one launch of the forward kernel (:func:`forward.fold_on`: the state
        loaded into the fold's registers, the folded state stored in fp32, or with
        ``finish`` the output and lse as the single call stores them) where its fp32
        tile fits beside the kernel's buffers (D up to 128); otherwise
        :meth:`split_states` folded by the fold kernel."""
        if on_pallas(q.dtype):
            return PALLAS.fold_on(state, q, k, v, key_padding_mask, causal_offsets,
                                  causal=causal, scale=scale, finish=finish)
        from jaxattn.backends.mosaic import forward as mosaic_fwd
        _refuse_unsupported(q)
        d = q.shape[-1]
        dp = _padded_head_dim(d)
        if dp > 128:
            return super().fold_on(state, q, k, v, key_padding_mask, causal_offsets,
                                   causal=causal, scale=scale, finish=finish)
        if state is not None:
            state = (pad_head_dim(state[0], dp), state[1])
        static = causal and isinstance(causal_offsets, (int, np.integer))
        out, lse = mosaic_fwd.fold_on(
            *_pad_all(dp, q, k, v), state, causal=bool(causal), scale=float(scale),
            interpret=self.interpret, config=self.fwd_config,
            key_padding_mask=key_padding_mask,
            causal_offsets=causal_offsets if causal and not static else None,
            offset=int(causal_offsets) if static else None, finish=finish)
        return out[..., :d], lse

    def fold_window(self, state, q, k, v, key_padding_mask, *, rows, keys, finish_rows,
                    offset, causal, scale):
        """In one launch of the forward kernel reading the window in place
        (:func:`forward.fold_window`: Q at its first row, K and V at its first key, the
        finished rows stored as the output and the others as the state) where the
        window needs no padding; otherwise sliced (:meth:`Backend.fold_window`)."""
        from jaxattn.backends.mosaic import forward as mosaic_fwd
        in_place = (not on_pallas(q.dtype) and key_padding_mask is None
                    and q.shape[-1] == _padded_head_dim(q.shape[-1])
                    and mosaic_fwd.window_in_place(rows, keys, finish_rows, offset, causal,
                                                   self.fwd_config))
        if not in_place:
            return super().fold_window(state, q, k, v, key_padding_mask, rows=rows,
                                       keys=keys, finish_rows=finish_rows, offset=offset,
                                       causal=causal, scale=scale)
        _refuse_unsupported(q)
        return mosaic_fwd.fold_window(q, k, v, state, rows=rows, keys=keys,
                                      finish_rows=finish_rows, offset=int(offset),
                                      causal=bool(causal), scale=float(scale),
                                      interpret=self.interpret, config=self.fwd_config)

    def finish_state(self, state, dtype):
        """The cast and the lse's one product (:func:`forward.natural_lse`), as the
        kernel's epilogue does them."""
        from jaxattn.backends.mosaic import forward as mosaic_fwd
        return state[0].astype(dtype), mosaic_fwd.natural_lse(state[1])

    def backward_over_ranges(self, q, k, v, key_padding_mask, out, lse, d_out, d_lse, *,
                             ranges, offsets, causal, scale):
        """dK/dV per key range and dQ continued across the ranges in ascending order
        (:func:`backward.backward_over_ranges`); ranges that do not start on multiples
        of 128 keys (an unaligned ``kv_chunk_size``, whose bits CP does not promise)
        are taken as one range."""
        if on_pallas(q.dtype):
            return PALLAS.backward_over_ranges(q, k, v, key_padding_mask, out, lse, d_out,
                                               d_lse, ranges=ranges, offsets=offsets,
                                               causal=causal, scale=scale)
        _refuse_unsupported(q)
        if _is_empty(q, k):
            return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
        from jaxattn.backends.mosaic import backward as mosaic_bwd
        skv = k.shape[2]
        ranges = [(a, e) for a, e in ranges if e > a]
        if any(a % (2 * mosaic_bwd.BLOCK_KV) for a, _ in ranges):
            ranges = [(0, skv)]
        offsets = offsets if causal else jnp.zeros_like(offsets)
        d = q.shape[-1]
        dp = _padded_head_dim(d)
        q_, k_, v_, out_, d_out_ = _pad_all(dp, q, k, v, out, d_out.astype(out.dtype))
        grads = mosaic_bwd.backward_over_ranges(
            q_, k_, v_, out_, lse, d_out_, d_lse, ranges=ranges, offsets=offsets,
            causal=causal, scale=scale, interpret=self.interpret, config=self.bwd_config,
            key_padding_mask=key_padding_mask)
        return tuple(g[..., :d] for g in grads)

    # The mesh path (jaxattn.cp.sharded_attention): each device's rows and keys.
    def delta(self, out, d_out, d_lse):
        """``rowsum(dO * O) - dlse`` by the Mosaic delta kernel (rows padded to its
        64-row tiles and the head dim as the forward pads it: zeros add nothing)."""
        if on_pallas(out.dtype):
            return PALLAS.delta(out, d_out, d_lse)
        _refuse_unsupported(out)
        from jaxattn.backends.mosaic import backward as mosaic_bwd
        b, hq, sq, d = out.shape
        if sq == 0:
            return jnp.zeros((b, hq, 0), jnp.float32)
        dp = _padded_head_dim(d)
        rows = -(-sq // mosaic_bwd.BLOCK_Q) * mosaic_bwd.BLOCK_Q
        pad = ((0, 0), (0, 0), (0, rows - sq))
        out_, d_out_ = (jnp.pad(pad_head_dim(x, dp), (*pad, (0, 0)))
                        for x in (out, d_out.astype(out.dtype)))
        d_lse_ = None if d_lse is None else jnp.pad(d_lse.astype(jnp.float32), pad)
        return mosaic_bwd.delta(out_, d_out_, d_lse_, interpret=self.interpret,
                                config=self.bwd_config)[:, :, :sq]

    def key_gradients(self, q, k, v, key_padding_mask, d_out, lse, delta, *, causal, scale,
                      causal_offsets):
        """dK, dV of these keys over every query row (the dK/dV kernel of
        :func:`backward.backward_over_ranges` over one range)."""
        if on_pallas(q.dtype):
            return PALLAS.key_gradients(q, k, v, key_padding_mask, d_out, lse, delta,
                                        causal=causal, scale=scale,
                                        causal_offsets=causal_offsets)
        return self._gradients("key_gradients", q, k, v, key_padding_mask, d_out, lse,
                               delta, causal=causal, scale=scale,
                               causal_offsets=causal_offsets)

    def query_gradients(self, q, k, v, key_padding_mask, d_out, lse, delta, *, causal,
                        scale, causal_offsets):
        """dQ of these query rows over every key (the dQ kernel of
        :func:`backward.backward_over_ranges` over one range, scaled and cast)."""
        if on_pallas(q.dtype):
            return PALLAS.query_gradients(q, k, v, key_padding_mask, d_out, lse, delta,
                                          causal=causal, scale=scale,
                                          causal_offsets=causal_offsets)
        return self._gradients("query_gradients", q, k, v, key_padding_mask, d_out, lse,
                               delta, causal=causal, scale=scale,
                               causal_offsets=causal_offsets)

    def _gradients(self, which, q, k, v, key_padding_mask, d_out, lse, delta, *, causal,
                   scale, causal_offsets):
        _refuse_unsupported(q)
        from jaxattn.backends.mosaic import backward as mosaic_bwd
        if _is_empty(q, k):
            return ((jnp.zeros_like(k), jnp.zeros_like(v)) if which == "key_gradients"
                    else jnp.zeros_like(q))
        d = q.shape[-1]
        dp = _padded_head_dim(d)
        q_, k_, v_, d_out_ = _pad_all(dp, q, k, v, d_out.astype(q.dtype))
        offsets = (jnp.asarray(causal_offsets, jnp.int32) if causal
                   else jnp.zeros((q.shape[0],), jnp.int32))
        grads = getattr(mosaic_bwd, which)(
            q_, k_, v_, lse, d_out_, delta, offsets=offsets, causal=bool(causal),
            scale=float(scale), interpret=self.interpret, config=self.bwd_config,
            key_padding_mask=key_padding_mask)
        if which == "key_gradients":
            return tuple(g[..., :d] for g in grads)
        return grads[..., :d]

    def paged_forward(self, q, k_pages, v_pages, block_table, seq_lens, *, causal, scale,
                      layout="HND"):
        """fp32: the Pallas kernels (pages read in place). bf16/fp16, causal, a native
        head dim (64, 128, 256) and pages of a multiple of 64 keys or of 8, 16 or 32:
        the Mosaic kernel reads the pages in place (:func:`forward.paged_forward`: one
        TMA box per page slice, a key block assembled from several small pages). Else
        (non-causal, other page sizes, a padded head dim) the pages are gathered into
        contiguous K and V (a copy) and the forward runs with the keys past each
        sequence's length dropped. Either way with per-sequence causal offsets
        ``seq_lens - Sq``: each row's bits are those of its contiguous call."""
        if on_pallas(q.dtype):
            return PALLAS.paged_forward(q, k_pages, v_pages, block_table, seq_lens,
                                        causal=causal, scale=scale, layout=layout)
        from jaxattn.backends.mosaic import forward as mosaic_fwd
        page_size = page_dims(k_pages, layout)[2]
        if (causal and q.shape[-1] in NATIVE_HEAD_DIMS
                and mosaic_fwd.reads_pages_in_place(page_size)
                and 0 not in (*q.shape[:3], k_pages.shape[0], block_table.shape[1])):
            _refuse_unsupported(q)
            return mosaic_fwd.paged_forward(q, k_pages, v_pages, block_table, seq_lens,
                                            scale=float(scale), interpret=self.interpret,
                                            config=self.fwd_config, layout=layout)
        return super().paged_forward(q, k_pages, v_pages, block_table, seq_lens,
                                     causal=causal, scale=scale, layout=layout)


def attention(q, k, v, key_padding_mask=None, *, causal: bool, scale: float,
              causal_offsets=None, interpret=False, fwd_config=None, bwd_config=None,
              btnh: bool = False):
    """``(out [B, Hq, Sq, D] q.dtype, lse [B, Hq, Sq] fp32)``, differentiable (the
    Mosaic backward; dK/dV and dQ kernels). ``causal_offsets``: ``[B]`` int or None
    (with ``causal``, row i of sequence b sees key j iff ``j <= i + causal_offsets[b]``).
    ``btnh``: q, k, v and out are ``[B, S, H, D]`` (JAX's layout), read and written in
    place by the forward and backward kernels; the lse stays ``[B, Hq, Sq]``; bf16/fp16
    only. ``interpret`` and the configs are for tests. fp32: the Pallas backend's
    kernels (interpreted on a CPU)."""
    if on_pallas(q.dtype):
        _refuse_unsupported(q)
        if btnh:
            raise ValueError("btnh: fp32 runs the Pallas kernels on [B, H, S, D] (the "
                             "backend's forward_with_lse_btnh transposes for it)")
        return PALLAS.forward_with_lse(q, k, v, causal=causal, scale=scale,
                                       key_padding_mask=key_padding_mask,
                                       causal_offsets=causal_offsets)
    offs = None if causal_offsets is None else jnp.asarray(causal_offsets, jnp.int32)
    return _served(q, k, v, lambda q, k, v: _core(
        q, k, v, key_padding_mask, offs, bool(causal), float(scale), interpret, fwd_config,
        bwd_config, bool(btnh)), btnh)


def backward(q, k, v, key_padding_mask, out, lse, d_out, d_lse, *, causal: bool,
             scale: float, causal_offsets=None, interpret=False, bwd_config=None):
    """``(dq, dk, dv)`` from the forward's residuals ``(out, lse)`` of :func:`attention`
    and the cotangents ``d_out``, ``d_lse``: the backward :func:`attention`'s custom VJP
    runs, without recomputing the forward (for callers that keep the residuals, as the
    torch bridge does), and the same bits. The head dim is zero-padded as the forward
    pads it (the forward's padded output columns are exact zeros); fp32: the Pallas
    backend's backward. Empty calls give zero gradients."""
    _refuse_unsupported(q)
    if on_pallas(q.dtype):
        return PALLAS.backward(q, k, v, key_padding_mask, out, lse, d_out, d_lse,
                               causal=causal, scale=scale, causal_offsets=causal_offsets)
    if _is_empty(q, k):
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    d = q.shape[-1]
    dp = _padded_head_dim(d)
    q_, k_, v_, out_, d_out_ = _pad_all(dp, q, k, v, out, d_out.astype(out.dtype))
    grads = _kernel_backward(q_, k_, v_, key_padding_mask, causal_offsets, out_, lse, d_out_,
                             d_lse, causal=causal, scale=scale, interpret=interpret,
                             bwd_config=bwd_config)
    return tuple(g[..., :d] for g in grads)


BACKEND = MosaicBackend()
