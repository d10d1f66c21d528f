"""The Mosaic GPU modules of jaxattn's kernels as lowered for CUDA, on any machine.

    python -m benchmarks.mosaic_asm --out_dir=/tmp/asm [--config=ctas_per_sm=1]
        [--shapes=decode-32x8192,prefill-2x4096]

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

from absl import app, flags

from benchmarks.lowered import launch_of, modules, shapes

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", None, "One file per shape, and launches.txt, go here.")
flags.DEFINE_string("config", "", "MosaicConfig fields (key=value[:key=value...]).")
flags.DEFINE_list("shapes", [], "benchmarks.lowered's shape names (default: all).")


def main(argv):
    del argv
    from benchmarks import report
    from jaxattn.backends.mosaic import forward as mf
    cfg = mf.MosaicConfig(**report.config_fields(FLAGS.config))
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    summary = []
    known = shapes()
    unknown = sorted(set(FLAGS.shapes) - set(known))
    if unknown:
        raise app.UsageError(f"--shapes: unknown {unknown}; known: {sorted(known)}")
    for name, lower in known.items():
        if FLAGS.shapes and name not in FLAGS.shapes:
            continue
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
