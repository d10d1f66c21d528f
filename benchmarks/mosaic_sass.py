"""The SASS of jaxattn's Mosaic GPU kernels, compiled on a machine without a GPU.

    python -m benchmarks.mosaic_sass --out_dir=/tmp/sass [--shapes=prefill-2x4096]
        [--config=key=value:...] [--backward]

Mosaic GPU turns a kernel's module into PTX, and ptxas turns that into SASS, inside
the CUDA PJRT plugin when XLA instantiates the custom call on a GPU. This binary runs
the same compiler without one:

1. it lowers the kernels for CUDA (``benchmarks.lowered``'s shapes, or the
   backward's at B=2 S=4096) and keeps each module as Mosaic GPU serialises it;
2. it hands each module to the plugin's exported ``MosaicGpuCompile`` with
   ``MOSAIC_GPU_DUMP_PTX`` set. The plugin asks the CUDA driver for the device's
   compute capability, so a stand-in ``libcuda.so.1`` (built here with gcc, loaded
   first) reports sm_90 and no device; the PTX is written before the plugin would
   load the kernel (which then fails, as it must without a GPU);
3. it runs ``ptxas -arch=sm_90a -v`` on the PTX (registers, spills, and the notes on
   serialised wgmmas, C7513/C7514) and ``nvdisasm -c`` on the cubin, and writes per
   kernel the PTX, the ptxas log, the SASS and ``summary.txt``: each loop's instruction
   mix and the order of its synchronisation points (``benchmarks.sass.timeline``).

Needs: gcc; the ``jax-cuda12-pjrt`` wheel of the installed jaxlib's version (fetched
with ``pip download`` into ``--cache_dir``); a CUDA 13 toolkit's ptxas and libdevice
(``--cuda_root``, default /usr/local/cuda); nvdisasm (``--cuda_root``'s, else the
``nvidia-cuda-nvdisasm`` wheel, fetched the same way). On this project's H200 the
same kernels' ptxas reported the same registers (168 for the prefill, 150 for the
split decode) and the same 332-instruction prefill loop as Nsight Compute's SASS.
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from absl import app, flags

from benchmarks import lowered, sass

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", None, "One folder per shape (PTX, ptxas log, SASS), and "
                    "summary.txt, go here.")
flags.DEFINE_list("shapes", [], "benchmarks.lowered's shape names (default: all).")
flags.DEFINE_string("config", "", "MosaicConfig fields (key=value[:key=value...]).")
flags.DEFINE_bool("backward", False, "Also the backward's kernels (B=2 S=4096 Hq=32 "
                  "Hkv=8 causal, D=--bwd_head_dim).")
flags.DEFINE_integer("bwd_head_dim", 128, "The head dim of --backward's kernels.")
flags.DEFINE_string("bwd_config", "", "BwdConfig fields for --backward.")
flags.DEFINE_string("cuda_root", "/usr/local/cuda", "A CUDA 13 toolkit: bin/ptxas and "
                    "nvvm/libdevice.")
flags.DEFINE_string("cache_dir", os.path.expanduser("~/.cache/jaxattn-sass"),
                    "The plugin wheel, nvdisasm and the stand-in libcuda are kept here.")
flags.DEFINE_integer("max_loop", 800, "summary.txt lists loops of at most this many "
                     "instructions (the kernels' outer loops repeat the inner ones).")

_STANDIN_CUDA = r"""
/* A stand-in CUDA driver for compiling Mosaic GPU kernels without a GPU: one sm_90
   device, no context; loading a module fails. */
typedef int CUresult;
static const char *msg = "stand-in libcuda: no device";
CUresult cuInit(unsigned f) { return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
CUresult cuCtxGetDevice(int *d) { *d = 0; return 0; }
CUresult cuCtxGetCurrent(void **c) { *c = (void *)0; return 0; }
CUresult cuDeviceGet(int *d, int o) { *d = 0; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuDeviceGetAttribute(int *v, int attr, int d) {
  *v = attr == 75 ? 9 : 0;  /* compute capability major 9, minor (76) 0 */
  return 0;
}
CUresult cuGetErrorString(CUresult r, const char **s) { *s = msg; return 0; }
CUresult cuGetErrorName(CUresult r, const char **s) { *s = msg; return 0; }
CUresult cuModuleLoadData(void **m, const void *image) { return 100; }
"""


def _pip_fetch(spec: str, dest: str) -> str:
    """The wheel of ``spec`` unpacked into ``dest`` (fetched once: unpacked beside it,
    then renamed into place, so a second process sees all of it or none)."""
    if not os.path.exists(os.path.join(dest, ".done")):
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(dest))
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "-d", tmp, spec], check=True)
        for whl in glob.glob(os.path.join(tmp, "*.whl")):
            with zipfile.ZipFile(whl) as z:
                z.extractall(tmp)
            os.remove(whl)
        for tool in glob.glob(os.path.join(tmp, "**", "bin", "*"), recursive=True):
            os.chmod(tool, 0o755)  # zip extraction drops the executable bit
        open(os.path.join(tmp, ".done"), "w").close()
        try:
            os.rename(tmp, dest)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _toolchain(cache: str, cuda_root: str) -> dict:
    """Paths of the plugin, the stand-in libcuda, ptxas and nvdisasm (fetched or built
    into ``cache`` where missing)."""
    import jaxlib
    ptxas = os.path.join(cuda_root, "bin", "ptxas")
    if not os.path.exists(ptxas):
        raise SystemExit(f"--cuda_root={cuda_root!r} has no bin/ptxas")
    plugin_dir = _pip_fetch(f"jax-cuda12-pjrt=={jaxlib.__version__}",
                            os.path.join(cache, f"pjrt-{jaxlib.__version__}"))
    [plugin] = glob.glob(os.path.join(plugin_dir, "jax_plugins", "*", "*.so"))
    nvdisasm = os.path.join(cuda_root, "bin", "nvdisasm")
    if not os.path.exists(nvdisasm):
        found = glob.glob(os.path.join(_pip_fetch("nvidia-cuda-nvdisasm",
                                                  os.path.join(cache, "nvdisasm")),
                                       "nvidia", "*", "bin", "nvdisasm"))
        if not found:
            raise SystemExit("no nvdisasm in --cuda_root nor in nvidia-cuda-nvdisasm")
        nvdisasm = found[0]
    libcuda = os.path.join(cache, "standin", "libcuda.so.1")
    if not os.path.exists(libcuda):
        os.makedirs(os.path.dirname(libcuda), exist_ok=True)
        src = libcuda + ".c"
        with open(src, "w") as f:
            f.write(_STANDIN_CUDA)
        subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                        libcuda, src], check=True)
    return dict(plugin=plugin, libcuda=libcuda, ptxas=ptxas, nvdisasm=nvdisasm)


class Compiler:
    """Mosaic GPU's module -> PTX compiler of the CUDA plugin, run on the CPU."""

    def __init__(self, tools: dict, cuda_root: str, cache: str):
        # The plugin opens "libcuda.so.1" when it first calls the driver: the stand-in,
        # loaded here first under that name, is the one it gets.
        ctypes.CDLL(tools["libcuda"], mode=ctypes.RTLD_GLOBAL)
        self.dll = ctypes.CDLL(tools["plugin"])
        # The plugin registers LLVM's NVPTX target when XLA compiles for a GPU; called
        # alone, MosaicGpuCompile finds it missing, so register it (a local symbol:
        # its address is the exported function's plus the offset nm gives).
        syms = subprocess.run(["nm", tools["plugin"]], capture_output=True, text=True,
                              check=True).stdout
        want = ("MosaicGpuCompile", "_ZN6mosaic3gpu33EnsureLLVMNVPTXTargetIsRegisteredEv")
        offs = {p[2]: int(p[0], 16) for p in (line.split() for line in syms.splitlines())
                if len(p) == 3 and p[2] in want}
        base = ctypes.cast(self.dll.MosaicGpuCompile, ctypes.c_void_p).value
        base -= offs["MosaicGpuCompile"]
        ctypes.CFUNCTYPE(None)(base + offs[want[1]])()
        self.compile_fn = self.dll.MosaicGpuCompile
        self.compile_fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
        self.compile_fn.restype = ctypes.c_void_p
        # ptxas and libdevice are looked up under ./cuda_sdk_lib first.
        self.workdir = os.path.join(cache, "work")
        os.makedirs(self.workdir, exist_ok=True)
        link = os.path.join(self.workdir, "cuda_sdk_lib")
        if os.path.realpath(link) != os.path.realpath(cuda_root):
            tmp = f"{link}.{os.getpid()}"
            os.symlink(os.path.realpath(cuda_root), tmp)
            os.replace(tmp, link)  # (atomic: another process may be reading it)
        os.environ["MOSAIC_GPU_CUDA_ROOT"] = os.path.realpath(cuda_root)

    def ptx(self, module: bytes) -> str:
        """The PTX of one serialised Mosaic GPU module."""
        with tempfile.TemporaryDirectory() as dump:
            os.environ["MOSAIC_GPU_DUMP_TO"] = dump
            os.environ["MOSAIC_GPU_DUMP_PTX"] = "1"
            cwd = os.getcwd()
            os.chdir(self.workdir)
            try:
                self.compile_fn(module, len(module))  # fails at the module load: no GPU
            finally:
                os.chdir(cwd)
                del os.environ["MOSAIC_GPU_DUMP_TO"], os.environ["MOSAIC_GPU_DUMP_PTX"]
            found = glob.glob(os.path.join(dump, "*.ptx"))
            if len(found) != 1:
                raise RuntimeError(f"Mosaic GPU wrote {len(found)} PTX files, expected 1")
            with open(found[0]) as f:
                return f.read()


def analyse(sass_text: str, max_loop: int) -> list[str]:
    """summary.txt's lines for one kernel: per loop of at most ``max_loop``
    instructions (not a barrier's retry), its size, mix and :func:`sass.timeline`."""
    instrs, labels = sass.parse(sass_text)
    lines = []
    for span in sass.loops(instrs, labels):
        b = sass.body(instrs, span)
        if not 16 <= len(b) <= max_loop:
            continue
        lines.append(f"  loop {span[0]:#06x}-{span[1]:#06x}: {len(b)} instructions; "
                     f"{sass.mix(b)}")
        lines.append(f"    order: {sass.timeline(b)}")
    return lines


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    from benchmarks import report
    from jaxattn.backends.mosaic import backward as mb
    from jaxattn.backends.mosaic import forward as mf

    tools = _toolchain(FLAGS.cache_dir, FLAGS.cuda_root)
    comp = Compiler(tools, FLAGS.cuda_root, FLAGS.cache_dir)
    cfg = mf.MosaicConfig(**report.config_fields(FLAGS.config))
    shapes = lowered.shapes()
    runs = {n: (lambda lower=shapes[n]: lower(cfg)) for n in (FLAGS.shapes or shapes)}
    if FLAGS.backward:
        S, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
        d = FLAGS.bwd_head_dim
        q, k = S((2, 32, 4096, d), bf16), S((2, 8, 4096, d), bf16)
        bcfg = mb.BwdConfig(**report.config_fields(FLAGS.bwd_config))
        name = "backward-2x4096" + ("" if d == 128 else f"-d{d}")
        runs[name] = lambda: mb.lower_for_cuda(q, k, k, causal=True, config=bcfg)
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    summary = []
    for name, lower in runs.items():
        folder = os.path.join(FLAGS.out_dir, name)
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        blobs = lowered.serialized(lower)
        if blobs is None:
            raise SystemExit("this JAX's Mosaic GPU has no core._run_serde_pass to watch")
        for i, module in enumerate(blobs):
            stem = os.path.join(folder, f"kernel{i}")
            with open(stem + ".ptx", "w") as f:
                f.write(comp.ptx(module))
            log = subprocess.run([tools["ptxas"], "-arch=sm_90a", "-v", "-o",
                                  stem + ".cubin", stem + ".ptx"],
                                 capture_output=True, text=True)
            with open(stem + ".ptxas", "w") as f:
                f.write(log.stdout + log.stderr)
            if log.returncode:
                raise SystemExit(f"ptxas failed on {stem}.ptx:\n{log.stderr}")
            text = subprocess.run([tools["nvdisasm"], "-c", stem + ".cubin"],
                                  capture_output=True, text=True, check=True).stdout
            with open(stem + ".sass", "w") as f:
                f.write(text)
            notes = [line.split(":", 1)[-1].strip() for line in
                     (log.stdout + log.stderr).splitlines()
                     if "Used" in line or "spill" in line or "Performance Loss" in line]
            summary.append(f"{name} kernel {i}: " + " | ".join(notes))
            summary.extend(analyse(text, FLAGS.max_loop))
    with open(os.path.join(FLAGS.out_dir, "summary.txt"), "w") as f:
        f.write("\n".join(summary) + "\n")
    print("\n".join(summary))


if __name__ == "__main__":
    flags.mark_flag_as_required("out_dir")
    app.run(main)
