"""The Mosaic GPU modules of jaxattn's kernels as lowered for CUDA, on any machine.

    python -m benchmarks.mosaic_asm --out_dir=/tmp/asm [--config=ctas_per_sm=2]

Lowers the Mosaic forward for CUDA (no GPU needed) at a set of shapes (decode split and
not, off the 8-row grid, a key mask, pages of 16 keys, prefills) and writes each kernel's
module as Mosaic GPU serialises it, without source locations, one file per shape, and
``launches.txt`` (per kernel: threads a CTA, dynamic SMEM bytes, the module's md5). Run
it on two trees and ``diff -r`` the folders: a refactor that should not change a kernel
shows no difference (the modules' SSA names are stable for the same code). The
``--config`` fields (``MosaicConfig``, as ``mosaic_gpu_check``'s variants) apply to
every shape.
"""

from __future__ import annotations

import hashlib
import os
import re

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", None, "One file per shape, and launches.txt, go here.")
flags.DEFINE_string("config", "", "MosaicConfig fields (key=value[:key=value...]).")

_LAUNCH = re.compile(r"gpu\.launch .*? threads\(.*?\) in \(%\w+ = %c(\d+)\D.*?"
                     r"dynamic_shared_memory_size %c(\d+)_i32")


def modules(lower) -> list[str] | None:
    """The text of each Mosaic GPU module that ``lower()`` lowers, in order, without
    source locations, as Mosaic GPU serialises it; None where this JAX's Mosaic GPU has
    no such step (``core._run_serde_pass``) to watch."""
    from jax.experimental.mosaic.gpu import core
    serde = getattr(core, "_run_serde_pass", None)
    if serde is None:  # pragma: no cover - depends on the JAX version
        return None
    texts = []

    def watch(module, **kw):
        texts.append(module.operation.get_asm(enable_debug_info=False))
        return serde(module, **kw)

    core._run_serde_pass = watch
    try:
        lower()
    finally:
        core._run_serde_pass = serde
    return texts


def launch_of(text: str) -> tuple[int, int]:
    """``(threads a CTA, dynamic SMEM bytes)`` of one module's ``gpu.launch``."""
    threads, smem = _LAUNCH.search(text).groups()
    return int(threads), int(smem)


def launches(lower) -> list[tuple[int, int]] | None:
    """:func:`launch_of` of each module that ``lower()`` lowers (None: see
    :func:`modules`)."""
    texts = modules(lower)
    return None if texts is None else [launch_of(t) for t in texts]


def _shapes():
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
            "prefill-d64-2x4096": call(2, 32, 8, 4096, 4096, d=64)}


def main(argv):
    del argv
    from benchmarks import report
    from jaxattn.backends.mosaic import forward as mf
    cfg = mf.MosaicConfig(**report.config_fields(FLAGS.config))
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    summary = []
    for name, lower in _shapes().items():
        texts = modules(lambda lower=lower: lower(cfg))
        if texts is None:
            raise SystemExit("this JAX's Mosaic GPU has no core._run_serde_pass to watch")
        with open(os.path.join(FLAGS.out_dir, f"{name}.mlir"), "w") as f:
            f.write("\n".join(texts))
        for i, t in enumerate(texts):
            threads, smem = launch_of(t)
            summary.append(f"{name} kernel {i}: {threads} threads, {smem} bytes of SMEM, "
                           f"md5 {hashlib.md5(t.encode()).hexdigest()}")
    with open(os.path.join(FLAGS.out_dir, "launches.txt"), "w") as f:
        f.write("\n".join(summary) + "\n")
    print("\n".join(summary))


if __name__ == "__main__":
    flags.mark_flag_as_required("out_dir")
    app.run(main)
