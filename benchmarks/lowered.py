"""jaxattn's Mosaic GPU kernels as lowered for CUDA, on any machine (no flags: shared by
``benchmarks.mosaic_asm``, ``benchmarks.mosaic_sass`` and the tests): the modules a
lowering produces, as text or as the custom call carries them, each kernel's launch
(threads a CTA, dynamic SMEM), and a set of shapes that cross the kernels' cases."""

from __future__ import annotations

import io
import re

_LAUNCH = re.compile(r"gpu\.launch .*? threads\(.*?\) in \(%\w+ = %c(\d+)\D.*?"
                     r"dynamic_shared_memory_size %c(\d+)_i32")


def _watch(lower, keep) -> list | None:
    """``keep(module_in, module_out)`` of each Mosaic GPU module that ``lower()`` lowers,
    in order, at Mosaic GPU's serialisation step (``core._run_serde_pass``); None where
    this JAX's Mosaic GPU has no such step to watch."""
    from jax.experimental.mosaic.gpu import core
    serde = getattr(core, "_run_serde_pass", None)
    if serde is None:  # pragma: no cover - depends on the JAX version
        return None
    kept = []

    def watch(module, **kw):
        out = serde(module, **kw)
        kept.append(keep(module, out))
        return out

    core._run_serde_pass = watch
    try:
        lower()
    finally:
        core._run_serde_pass = serde
    return kept


#: The module's dump name, which newer Mosaic GPU (JAX 0.11) numbers per process
#: (``"body_2"``, ``"body_3"``, ...): not part of the kernel, so two lowerings of one
#: kernel compare equal without it.
_DUMP_NAME = re.compile(r'mosaic_gpu\.dump_basename = "[^"]*"')


def modules(lower) -> list[str] | None:
    """The text of each Mosaic GPU module that ``lower()`` lowers, in order, without
    source locations and the per-process dump name, as Mosaic GPU serialises it (None:
    see :func:`_watch`)."""
    return _watch(lower, lambda module, _: _DUMP_NAME.sub(
        'mosaic_gpu.dump_basename = "-"',
        module.operation.get_asm(enable_debug_info=False)))


def serialized(lower) -> list[bytes] | None:
    """Each Mosaic GPU module that ``lower()`` lowers, as the custom call carries it
    (serialised bytecode: what the CUDA plugin compiles; None: see :func:`_watch`)."""
    def bytecode(_, out):
        buf = io.BytesIO()
        out.operation.write_bytecode(buf, desired_version=0)
        return buf.getvalue()

    return _watch(lower, bytecode)


def launch_of(text: str) -> tuple[int, int]:
    """``(threads a CTA, dynamic SMEM bytes)`` of one module's ``gpu.launch``."""
    threads, smem = _LAUNCH.search(text).groups()
    return int(threads), int(smem)


def launches(lower) -> list[tuple[int, int]] | None:
    """:func:`launch_of` of each module that ``lower()`` lowers (None: see
    :func:`modules`)."""
    texts = modules(lower)
    return None if texts is None else [launch_of(t) for t in texts]


#: The H100's and H200's SMEM a CTA may hold (Mosaic GPU's ``max_smem_bytes``).
DEVICE_SMEM = 227 * 1024


def profile_space(b: int, s: int, *, hq: int, hkv: int, d: int, causal: bool,
                  config, blocks: bool, n_sm: int) -> int:
    """Profiler ranges a warpgroup that ``forward.profiling`` needs for the prefill of
    ``b`` sequences of ``s`` queries and keys (``hq`` / ``hkv`` heads, head dim ``d``)
    with ``config`` (a ``MosaicConfig``) on ``n_sm`` SMs: the CTA whose items hold the
    most ranges (eight an item, five a key block with ``blocks``; the persistent
    grid's greedy table, else one item a CTA), plus 32. The launch (threads, SMEM) is
    read from the kernel lowered for CUDA. Raises ValueError where the ranges (16
    bytes each, for every warpgroup) do not fit beside the kernel's SMEM."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxattn import schedule
    from jaxattn.backends.mosaic import forward as mf
    q = jax.ShapeDtypeStruct((b, hq, s, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((b, hkv, s, d), jnp.bfloat16)
    texts = modules(lambda: mf.lower_for_cuda(q, k, k, causal=causal, config=config))
    if not texts:
        raise ValueError("this JAX does not expose the lowered Mosaic GPU modules")
    threads, smem = launch_of(texts[0])
    wgs = threads // 128
    rows = config.block_m * (wgs - 1)  # (the compute warpgroups' tile)
    total = -(-s // schedule.BLOCK_N)
    lead, sq_pad, _ = mf.padding(s, s, causal, rows)
    n_tiles = sq_pad // rows
    tile_blocks = mf.prefill_tile_blocks(n_tiles, rows, -lead, total, causal=causal,
                                         q_order=config.q_order)
    per_item = np.tile(np.repeat(8 + 5 * tile_blocks * int(blocks), hq), b)
    if mf._prefill_persistent(config, d, total * schedule.BLOCK_N, gpu=True):
        table = mf.persistent_schedule(np.repeat(tile_blocks, hq), b,
                                       config.persistent or n_sm)
        most = max(int(per_item[r[1:1 + r[0]]].sum()) for r in table)
    else:
        most = int(per_item.max())
    need = most + 32
    room = (DEVICE_SMEM - smem) // (16 * wgs)
    if need > room:
        raise ValueError(
            f"the profile needs {need} ranges a warpgroup ({need * 16 * wgs} bytes of "
            f"SMEM for {wgs} warpgroups), {room} fit beside the kernel's {smem} bytes: "
            f"a smaller B or S{', or no --blocks' if blocks else ''}")
    return need


def shapes():
    """name -> a function of a MosaicConfig that lowers that call for CUDA."""
    import jax
    import jax.numpy as jnp

    from jaxattn.backends.mosaic import forward as mf
    S, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16

    def call(b, hq, hkv, sq, skv, d=128, causal=True, mask=False):
        q, k = S((b, hq, sq, d), bf16), S((b, hkv, skv, d), bf16)
        keep = S((b, skv), jnp.bool_) if mask else None
        return lambda c: mf.lower_for_cuda(q, k, k, causal=causal, config=c,
                                           key_padding_mask=keep)

    def paged(ps):
        q, pages = S((2, 32, 1, 128), bf16), S((512, ps, 8, 128), bf16)
        table, lens = S((2, 4096 // ps), jnp.int32), S((2,), jnp.int32)
        return lambda c: jax.jit(lambda q, kp, t, n: mf.paged_forward(
            q, kp, kp, t, n, config=c, layout="NHD")).trace(q, pages, table, lens).lower(
            lowering_platforms=("cuda",))

    return {"decode-split-8x8192": call(8, 32, 8, 1, 8192),
            "decode-split-8x8193": call(8, 32, 8, 1, 8193),
            "decode-mask-8x8192": call(8, 32, 8, 1, 8192, mask=True),
            "decode-32x8192": call(32, 32, 8, 1, 8192),
            "decode-paged16": paged(16),
            "prefill-2x4096": call(2, 32, 8, 4096, 4096),
            "prefill-2x4097": call(2, 32, 8, 4097, 4097),
            "prefill-noncausal-2x4096": call(2, 32, 8, 4096, 4096, causal=False),
            "prefill-d64-2x4096": call(2, 32, 8, 4096, 4096, d=64),
            "prefill-d64-noncausal-2x4096": call(2, 32, 8, 4096, 4096, d=64, causal=False),
            "prefill-d256-2x1024": call(2, 32, 8, 1024, 1024, d=256),
            "prefill-d256-2x2048": call(2, 32, 8, 2048, 2048, d=256),
            # (four SPLITs: the SPLIT loops' middle iterations, e.g. gmem_state's reads)
            "prefill-d256-1x4096": call(1, 32, 8, 4096, 4096, d=256)}
