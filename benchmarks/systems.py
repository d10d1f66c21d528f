"""The attention systems the benchmark binaries compare, behind one small interface.

Every system takes inputs in jaxattn's layout (``q [B, Hq, Sq, D]``, ``k, v [B, Hkv,
Skv, D]``) and follows jaxattn's causal rule (query row i sees keys ``j <= i + Skv -
Sq``, bottom-right aligned), so the same experiment means the same thing for each. Where
a peer's own ``is_causal`` is top-left aligned, the system passes what makes it
bottom-right (nothing for ``Sq == 1``, ``is_causal`` for ``Sq == Skv``, an explicit
mask otherwise) and says so.

Systems (``--backends`` names):

- ``jaxattn`` (the platform's first backend; ``jaxattn:<backend>`` picks one, e.g.
  ``jaxattn:reference`` or ``jaxattn:triton``); ``jaxattn:mosaic:<key=value...>`` runs
  the Mosaic backend with those ``MosaicConfig`` fields (e.g.
  ``jaxattn:mosaic:splits_per_cta=None``: a launch variant beside the default and the
  peers in one run);
- ``jaxattn_btnh`` (``jaxattn_btnh:<backend>``): ``jaxattn.dot_product_attention`` on
  JAX's ``[B, S, H, D]`` arrays (the JAX drop-in; Sq == Skv or Sq == 1 when causal);
- ``cudnn`` and ``xla``: ``jax.nn.dot_product_attention(implementation=...)`` on its
  own ``[B, S, H, D]`` arrays;
- ``pallas_mha``: JAX's built-in Pallas Triton ``mha`` (no GQA: K and V are repeated to
  Hq heads in ``prepare``, outside any timed region; Sq must fill its 128-row blocks);
- ``pallas_mgpu``: JAX's built-in Pallas Mosaic GPU attention (Hopper; GQA native;
  causal only with ``Sq == Skv``; forward only where causal); ``pallas_mgpu:64`` with
  key blocks of 64 (jaxattn's BLOCK_N) instead of 128;
- ``torch_flash``, ``torch_cudnn``, ``torch_efficient``, ``torch_math``: torch's
  ``scaled_dot_product_attention`` pinned to one backend with ``sdpa_kernel``; GQA via
  ``enable_gqa`` where the backend takes it, else K and V repeated in ``prepare``.

A system exposes ``prepare`` (layout change, outside timing), ``forward``, ``fwdbwd``
(gradients of ``sum(out * do)``), ``sync`` and ``to_numpy``; ``kv_lens`` passes tail key
padding ([B] valid key counts) where the system supports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn
from benchmarks import report

JAX_PEERS = ("cudnn", "xla", "pallas_mha", "pallas_mgpu")
TORCH_PEERS = {"torch_flash": "FLASH_ATTENTION", "torch_cudnn": "CUDNN_ATTENTION",
               "torch_efficient": "EFFICIENT_ATTENTION", "torch_math": "MATH"}


class Unsupported(Exception):
    """The system cannot run this case (reported as such, not as a failure)."""


def causal_mask(sq: int, skv: int) -> np.ndarray:
    """jaxattn's causal rule as a boolean [Sq, Skv] matrix (True = visible)."""
    i = np.arange(sq)[:, None]
    j = np.arange(skv)[None, :]
    return j <= i + (skv - sq)


@dataclasses.dataclass
class System:
    name: str
    framework: str  # "jax" or "torch"
    prepare: Callable[..., Any]  # (q, k, v) jax arrays -> native args
    forward: Callable[..., Any]  # (*native, causal, kv_lens=None) -> out
    fwdbwd: Callable[..., Any]  # (*native, do_native, causal, kv_lens=None) -> (dq, dk, dv)
    prepare_like_q: Callable[[Any], Any]  # a [B, Hq, Sq, D] jax array (e.g. dO) -> native
    sync: Callable[[Any], None]
    to_numpy: Callable[[Any], np.ndarray]  # native out -> [B, H, S, D] numpy
    notes: str = ""


# ------------------------------------------------------------------------------ JAX


def _jax_to_numpy(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def _grads(fwd, q, k, v, do, causal, kv_lens):
    """The gradients of ``sum(fwd(q, k, v) * do)`` by ``jax.vjp`` (one forward, one
    backward; ``do`` in ``fwd``'s output layout)."""
    _, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, causal=causal, kv_lens=kv_lens), q, k, v)
    return vjp(do)


def _fwdbwd_of(fwd):
    """A JAX system's ``fwdbwd``: :func:`_grads` of its ``fwd``, in its own layout."""
    def fwdbwd(q, k, v, do, *, causal, kv_lens=None):
        return _grads(fwd, q, k, v, do, causal, kv_lens)
    return fwdbwd


def _backend_of(backend: str | None) -> str:
    """The jaxattn backend that serves ``backend`` here (None: the platform's first);
    one that cannot (e.g. "mosaic" off an sm90 GPU) is reported, not fatal."""
    try:
        return jaxattn.get_op("attention", backend=backend).backend
    except ValueError as e:
        raise Unsupported(str(e)) from e


def mosaic_variant(**fields):
    """The Mosaic backend with these ``MosaicConfig`` fields (a launch variant; a
    misspelt field raises before the backend's availability is asked)."""
    from jaxattn.backends.mosaic import backend as mosaic_backend
    from jaxattn.backends.mosaic import forward as mosaic_forward
    config = mosaic_forward.MosaicConfig(**fields)
    reason = mosaic_backend.unavailable_reason()
    if reason:
        raise Unsupported(reason)
    return mosaic_backend.MosaicBackend(fwd_config=config)


def _jaxattn(backend: str | None) -> System:
    name = "jaxattn" if backend is None else f"jaxattn:{backend}"
    if backend is not None and backend.startswith("mosaic:"):
        backend = mosaic_variant(**report.config_fields(backend.split(":", 1)[1]))
        notes = f"backend mosaic, {backend.fwd_config}"
    else:
        notes = f"backend {_backend_of(backend)}"

    def fwd(q, k, v, *, causal, kv_lens=None):
        mask = None
        if kv_lens is not None:
            mask = jnp.arange(k.shape[2])[None, :] < kv_lens[:, None]
        return jaxattn.attention(q, k, v, causal=causal, key_padding_mask=mask,
                                 backend=backend)

    fwdbwd = _fwdbwd_of(fwd)
    return System(name, "jax", lambda q, k, v: (q, k, v), fwd, fwdbwd, lambda x: x,
                  jax.block_until_ready, _jax_to_numpy, notes=notes)


def _bshd(x):
    return jnp.swapaxes(x, 1, 2)


def _dpa(implementation: str) -> System:
    """``jax.nn.dot_product_attention`` on its own ``[B, S, H, D]`` arrays: out and
    gradients stay in that layout inside the timed call (``to_numpy`` transposes)."""
    def fwd(q, k, v, *, causal, kv_lens=None):
        sq, skv = q.shape[1], k.shape[1]
        kw: dict[str, Any] = {"implementation": implementation}
        if kv_lens is not None:
            kw["key_value_seq_lengths"] = kv_lens
        if causal and sq == skv:
            kw["is_causal"] = True
        elif causal and sq > 1:  # top-left is_causal; bottom-right needs a mask
            kw["mask"] = jnp.asarray(causal_mask(sq, skv))[None, None]
        return jax.nn.dot_product_attention(q, k, v, **kw)

    fwdbwd = _fwdbwd_of(fwd)

    return System(implementation, "jax", lambda q, k, v: (_bshd(q), _bshd(k), _bshd(v)),
                  fwd, fwdbwd, _bshd, jax.block_until_ready,
                  lambda x: _jax_to_numpy(_bshd(x)),
                  notes="jax.nn.dot_product_attention on [B, S, H, D]; bottom-right causal "
                        "by mask when 1 < Sq < Skv")


def _jaxattn_btnh(backend: str | None) -> System:
    """``jaxattn.dot_product_attention`` (jax.nn's signature) on ``[B, S, H, D]`` arrays,
    out and gradients in that layout inside the timed call. jax.nn's causal rule is
    top-left: served where it is jaxattn's (Sq == Skv; Sq == 1 sees every key)."""
    def fwd(q, k, v, *, causal, kv_lens=None):
        sq, skv = q.shape[1], k.shape[1]
        if causal and 1 < sq != skv:
            raise Unsupported("jax.nn's top-left causal rule differs from jaxattn's for "
                              "1 < Sq != Skv")
        return jaxattn.dot_product_attention(q, k, v, is_causal=causal and sq == skv,
                                             key_value_seq_lengths=kv_lens,
                                             implementation=backend)

    fwdbwd = _fwdbwd_of(fwd)

    name = "jaxattn_btnh" if backend is None else f"jaxattn_btnh:{backend}"
    return System(name, "jax", lambda q, k, v: (_bshd(q), _bshd(k), _bshd(v)), fwd, fwdbwd,
                  _bshd, jax.block_until_ready, lambda x: _jax_to_numpy(_bshd(x)),
                  notes=f"jaxattn.dot_product_attention on [B, S, H, D], backend "
                        f"{_backend_of(backend)}")


def _pallas_mha() -> System:
    def prepare(q, k, v):
        g = q.shape[1] // k.shape[1]
        return _bshd(q), _bshd(jnp.repeat(k, g, axis=1)), _bshd(jnp.repeat(v, g, axis=1))

    def fwd(q, k, v, *, causal, kv_lens=None):
        from jax.experimental.pallas.ops.gpu import attention as mha_lib
        if kv_lens is not None or (causal and q.shape[1] != k.shape[1]):
            raise Unsupported("Pallas mha: no key padding, top-left causal only")
        return _bshd(mha_lib.mha(q, k, v, None, sm_scale=1.0 / np.sqrt(q.shape[-1]),
                                 causal=causal))

    def fwdbwd(q, k, v, do, *, causal, kv_lens=None):
        dq, dk, dv = (_bshd(g) for g in _grads(fwd, q, k, v, do, causal, kv_lens))
        return dq, dk, dv  # dk, dv per repeated head (Hq heads)

    return System("pallas_mha", "jax", prepare, fwd, fwdbwd, lambda x: x,
                  jax.block_until_ready, _jax_to_numpy,
                  notes="no GQA: K, V repeated to Hq heads outside timing")


def _pallas_mgpu(block_kv: int = 128) -> System:
    """JAX's own Pallas Mosaic GPU attention (``jax.experimental.pallas.ops.gpu.
    attention_mgpu``, FlashAttention-3-like, Hopper only): the in-tree peer of the
    ``"mosaic"`` backend. Forward only where causal (its backward is non-causal only)."""
    def fwd(q, k, v, *, causal, kv_lens=None):
        from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu
        if kv_lens is not None or (causal and q.shape[1] != k.shape[1]):
            raise Unsupported("Pallas mgpu: no key padding, causal only with Sq == Skv")
        if k.shape[1] % block_kv or q.shape[1] % 64:
            raise Unsupported(f"Pallas mgpu: Skv a multiple of {block_kv}, Sq of 64")
        cfg = mgpu.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2,
                                causal=causal)
        return _bshd(mgpu.attention(q, k, v, cfg))

    def fwdbwd(q, k, v, do, *, causal, kv_lens=None):
        if causal:
            raise Unsupported("Pallas mgpu: its backward is non-causal only")
        return tuple(_bshd(g) for g in _grads(fwd, q, k, v, do, causal, kv_lens))

    def prepare(q, k, v):
        # Its kernel stages Q/O through fp16 SMEM scratch (jax 0.10.2 to 0.11.2), so a
        # bf16 call fails to lower ("src had type bfloat16 and dst had type float16",
        # H200, 2026-11-30): it runs in fp16, the same wgmma rate, cast outside timing.
        cast = (lambda x: x.astype(jnp.float16)) if q.dtype == jnp.bfloat16 else (lambda x: x)
        return _bshd(cast(q)), _bshd(cast(k)), _bshd(cast(v))

    return System("pallas_mgpu" if block_kv == 128 else f"pallas_mgpu:{block_kv}", "jax",
                  prepare,
                  fwd, fwdbwd, lambda x: x, jax.block_until_ready, _jax_to_numpy,
                  notes=f"jax attention_mgpu, block_q=64 block_kv={block_kv}, 2 stages; "
                        "bf16 inputs run as fp16 (its SMEM scratch is fp16)")


# ---------------------------------------------------------------------------- torch


def _torch_system(name: str) -> System:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, TORCH_PEERS[name])
    cuda = jax.default_backend() == "gpu" and torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    state = {"repeat": False}

    def to_torch(x):
        if cuda:
            return torch.from_dlpack(jax.block_until_ready(x)).contiguous()
        a = np.asarray(jax.device_get(x))
        if a.dtype == jnp.bfloat16:
            return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
        return torch.from_numpy(a.copy())

    def prepare(q, k, v):
        return to_torch(q), to_torch(k), to_torch(v)

    def sdpa(q, k, v, causal, kv_lens):
        sq, skv = q.shape[2], k.shape[2]
        g = q.shape[1] // k.shape[1]
        mask = None
        if kv_lens is not None:
            keep = torch.arange(skv, device=q.device)[None, :] < kv_lens[:, None]
            mask = keep[:, None, None, :]
            if causal and sq > 1:
                mask = mask & torch.from_numpy(causal_mask(sq, skv)).to(q.device)
        elif causal and sq == skv:
            pass
        elif causal and sq > 1:
            from torch.nn.attention.bias import causal_lower_right
            mask = causal_lower_right(sq, skv)
        is_causal = causal and sq == skv and kv_lens is None
        with sdpa_kernel([backend]):
            if g > 1 and not state["repeat"]:
                try:
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                          is_causal=is_causal,
                                                          enable_gqa=True)
                except RuntimeError:
                    state["repeat"] = True  # this backend takes no GQA: repeat K, V
            if g > 1:
                k = k.repeat_interleave(g, dim=1)
                v = v.repeat_interleave(g, dim=1)
            try:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                      is_causal=is_causal)
            except RuntimeError as e:
                raise Unsupported(f"{name}: {str(e).splitlines()[0][:200]}") from e

    def _lens(kv_lens):
        return None if kv_lens is None else to_torch(kv_lens)

    def fwd(q, k, v, *, causal, kv_lens=None):
        with torch.no_grad():
            return sdpa(q, k, v, causal, _lens(kv_lens))

    def fwdbwd(q, k, v, do, *, causal, kv_lens=None):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        out = sdpa(q, k, v, causal, _lens(kv_lens))
        return torch.autograd.grad(out, (q, k, v), do)

    def sync(x):
        if cuda:
            torch.cuda.synchronize()

    def to_numpy(x):
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            return x.view(torch.uint16).numpy().view(jnp.bfloat16)
        return x.numpy()

    return System(name, "torch", prepare, fwd, fwdbwd, to_torch, sync, to_numpy,
                  notes=f"torch {torch.__version__} SDPA {TORCH_PEERS[name]} on {device}; "
                        f"GQA by enable_gqa, or K, V repeated where it is refused")


def torch_available() -> str | None:
    try:
        import torch  # noqa: F401
    except ImportError as e:
        return f"torch is not installed ({e})"
    return None


def make(name: str) -> System:
    """The system called ``name`` (see the module docstring)."""
    if name == "jaxattn" or name.startswith("jaxattn:"):
        return _jaxattn(name.split(":", 1)[1] if ":" in name else None)
    if name == "jaxattn_btnh" or name.startswith("jaxattn_btnh:"):
        return _jaxattn_btnh(name.split(":", 1)[1] if ":" in name else None)
    if name in ("cudnn", "xla"):
        return _dpa(name)
    if name == "pallas_mha":
        return _pallas_mha()
    if name == "pallas_mgpu" or name.startswith("pallas_mgpu:"):
        return _pallas_mgpu(int(name.split(":", 1)[1]) if ":" in name else 128)
    if name in TORCH_PEERS:
        reason = torch_available()
        if reason:
            raise Unsupported(reason)
        return _torch_system(name)
    known = ["jaxattn", "jaxattn:<backend>", "jaxattn_btnh", "jaxattn_btnh:<backend>",
             *JAX_PEERS, *TORCH_PEERS]
    raise ValueError(f"unknown system {name!r}; known: {', '.join(known)}")


def bits(x: np.ndarray) -> np.ndarray:
    """Raw bits of a floating array, as unsigned integers."""
    x = np.ascontiguousarray(x)
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])
