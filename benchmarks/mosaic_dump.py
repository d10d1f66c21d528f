"""Dump what Mosaic GPU compiles for the Mosaic forward and backward (H200 only).

    python -m benchmarks.mosaic_dump --out_dir=$OUT/dump [--sass]

For each configuration (the forward's defaults, its persistent variant, the backward's
defaults) one folder under ``--out_dir`` gets Mosaic GPU's ptxas log
(registers per thread, spill stores/loads, SMEM), and with ``--sass`` the SASS, through
Mosaic GPU's dump switches (``MOSAIC_GPU_DUMP_PTXAS``, ``MOSAIC_GPU_DUMP_SASS``,
``MOSAIC_GPU_DUMP_TO``, read when a kernel is compiled). Shapes: B=2, S=4096, Hq=32,
Hkv=8, D=128, causal, bf16 (the Mosaic issue's bar). docs/notes.md, 2026-11-29 reads them.
"""

from __future__ import annotations

import os

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", None, "One folder per configuration is written here.")
flags.DEFINE_bool("sass", False, "Also dump the SASS (large).")


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    from jaxattn.backends.mosaic import backward as mb
    from jaxattn.backends.mosaic import forward as mf

    b, hq, hkv, s, d = 2, 32, 8, 4096, 128
    q = jnp.ones((b, hq, s, d), jnp.bfloat16)
    k = jnp.ones((b, hkv, s, d), jnp.bfloat16)
    lse = jnp.zeros((b, hq, s), jnp.float32)
    runs = {
        "fwd-default": lambda: mf.forward(q, k, k, causal=True),
        "fwd-persistent": lambda: mf.forward(q, k, k, causal=True,
                                             config=mf.MosaicConfig(persistent=132)),
        "bwd-default": lambda: mb.backward(q, k, k, q, lse, q, causal=True),
    }
    os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
    if FLAGS.sass:
        os.environ["MOSAIC_GPU_DUMP_SASS"] = "1"
    for name, fn in runs.items():
        folder = os.path.join(FLAGS.out_dir, name)
        os.makedirs(folder, exist_ok=True)
        os.environ["MOSAIC_GPU_DUMP_TO"] = folder
        try:
            jax.block_until_ready(fn())
            print(name, sorted(os.listdir(folder)), flush=True)
        except Exception as e:  # reported; the other configurations go on
            print(name, "error:", f"{type(e).__name__}: {e}"[:300], flush=True)


if __name__ == "__main__":
    flags.mark_flag_as_required("out_dir")
    app.run(main)
