"""What the two Mosaic GPU probe test files share: the API and interpret-mode checks,
and running a file's interpret tests in a child process with synchronous dispatch."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

#: plgpu names both prototypes use.
NEEDED = ("kernel", "wgmma", "copy_gmem_to_smem", "copy_smem_to_gmem", "barrier_wait",
          "barrier_arrive", "transpose_ref", "layout_cast", "broadcasted_iota", "ACC", "SMEM",
          "Barrier", "TilingTransform", "SwizzleTransform", "commit_smem",
          "wait_smem_to_gmem", "LoweringSemantics")


def bits(x):
    """The raw bits of an array (bf16/fp16 as uint16, fp32 as uint32), for bitwise
    comparisons."""
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def missing_api(extra: tuple[str, ...] = ()) -> str | None:
    """Why this JAX cannot build the prototypes (``extra``: further plgpu names), or None."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError as e:  # pragma: no cover - depends on the JAX version
        return f"no jax.experimental.pallas.mosaic_gpu: {e}"
    absent = [n for n in (*NEEDED, *extra) if not hasattr(plgpu, n)]
    if absent:
        return f"jax {jax.__version__}: plgpu lacks {absent}"
    if "interpret" not in inspect.signature(plgpu.kernel).parameters:
        return f"jax {jax.__version__}: plgpu.kernel has no interpret= argument"
    return None


def missing_interpret(extra: tuple[str, ...] = ()) -> str | None:
    """Why the prototypes cannot run in Mosaic GPU interpret mode here, or None."""
    if (why := missing_api(extra)) is not None:
        return why
    if jax.default_backend() != "cpu":
        return ("interpret mode is the CPU's stand-in; on a GPU the prototypes run natively "
                "(benchmarks/mosaic_gpu_check.py)")
    from jaxattn.kernels import mosaic_fwd
    if mosaic_fwd.interpret_params() is None:
        return f"jax {jax.__version__} has no Mosaic GPU interpret mode (InterpretGPUParams)"
    return None


def async_dispatch() -> bool:
    """JAX 0.10.2's Mosaic GPU interpreter runs each warpgroup as a nested XLA:CPU
    computation whose barrier waits block inside host callbacks; with asynchronous CPU
    dispatch (the default) and 2 cores, XLA's thread pool can be exhausted and the
    kernel deadlocks (observed in 2 of 2 runs of 10 interpreted backwards; none in 26
    with ``jax_cpu_enable_async_dispatch=False``). The flag only takes effect when the
    CPU client is created, so the interpret tests then run in a subprocess."""
    return bool(jax.config.read("jax_cpu_enable_async_dispatch"))


needs_sync = pytest.mark.skipif(async_dispatch(), reason="interpret tests run in "
                                "test_interpret_tests_in_subprocess (async CPU dispatch)")


def run_interpret_tests_in_subprocess(test_file: str, groups: list[str],
                                      timeout: float = 100) -> int:
    """Run ``test_file``'s tests selected by each ``-k`` expression of ``groups``, each
    group in its own child process with synchronous CPU dispatch; returns how many
    tests passed in all. Synchronous dispatch makes the interpreter's deadlock rare but,
    on 2 cores, not impossible (about 1 hang in 10 runs of a whole file): a hung child
    is retried once (small groups keep what a hang costs to one group's time), and a
    second hang is a skip (a hang is not a wrong result; a wrong result fails)."""
    if not async_dispatch():
        pytest.skip("synchronous CPU dispatch: the interpret tests run in this process")
    code = ("import sys, jax; jax.config.update('jax_cpu_enable_async_dispatch', False); "
            "import pytest; sys.exit(pytest.main(sys.argv[1:]))")
    cwd = os.path.dirname(os.path.dirname(os.path.abspath(test_file)))
    passed = 0
    for k_expr in groups:
        cmd = [sys.executable, "-c", code, "-q", "-p", "no:cacheprovider", test_file, "-k",
               k_expr]
        for attempt in range(2):
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                   cwd=cwd)
                break
            except subprocess.TimeoutExpired:
                if attempt:
                    pytest.skip(f"the Mosaic GPU interpreter deadlocked twice in {k_expr!r} "
                                "(JAX 0.10.2's interpreter on few cores, docs/mosaic.md); a "
                                "hang is not a wrong result, so this is a skip, not a pass")
        assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
        assert "skipped" not in r.stdout, r.stdout[-3000:]
        m = re.search(r"(\d+) passed", r.stdout)
        assert m, r.stdout[-3000:]
        passed += int(m.group(1))
    return passed
