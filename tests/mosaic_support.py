"""What the Mosaic GPU test files share: the API and interpret-mode checks, the thread
pool the interpreter needs, and a compile cache for the interpreter."""

from __future__ import annotations

import inspect
import os
import threading

import jax
import numpy as np
import pytest

#: plgpu names both prototypes use.
NEEDED = ("kernel", "wgmma", "copy_gmem_to_smem", "copy_smem_to_gmem", "barrier_wait",
          "barrier_arrive", "layout_cast", "broadcasted_iota", "ACC", "SMEM",
          "Barrier", "TilingTransform", "SwizzleTransform", "commit_smem",
          "wait_smem_to_gmem", "LoweringSemantics")


def bits(x):
    """The raw bits of an array (bf16/fp16 as uint16, fp32 as uint32), for bitwise
    comparisons."""
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def dropped_nan(k, v, keep):
    """``((k, v) with NaN in K and inf in V at the keys ``keep`` drops, (k, v) zeroed
    there)``: the second pair is what the Mosaic forward saw when XLA zeroed the
    dropped keys in a copy before it (``[B, Hkv, Skv, D]``; ``keep`` bool ``[B, Skv]``)."""
    import jax.numpy as jnp

    from jaxattn.backends.mosaic.forward import zero_dropped_keys
    drop = ~keep[:, None, :, None]
    k_nan = jnp.where(drop, jnp.nan, k).astype(k.dtype)
    v_inf = jnp.where(drop, jnp.inf, v).astype(v.dtype)
    return (k_nan, v_inf), zero_dropped_keys(k, v, keep)


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
    from jaxattn.backends.mosaic import forward as mosaic_fwd
    if mosaic_fwd.interpret_params() is None:
        return f"jax {jax.__version__} has no Mosaic GPU interpret mode (InterpretGPUParams)"
    return None


#: Threads of the XLA:CPU client (``PJRT_NPROC``) the Mosaic GPU interpreter needs.
INTERPRETER_THREADS = 8


def interpreter_threads() -> int:
    """Threads of this process's XLA:CPU client: ``PJRT_NPROC`` (or ``NPROC``) when set,
    else the CPU count (XLA's default)."""
    for name in ("PJRT_NPROC", "NPROC"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return os.cpu_count() or 1


def missing_threads() -> str | None:
    """Why the Mosaic GPU interpreter could deadlock in this process, or None.

    JAX 0.10.2's interpreter runs each warpgroup of a CTA as a nested XLA:CPU
    computation on its own Python thread, and its barrier waits block inside host
    callbacks, which XLA runs on the client's thread pool. With as many pool threads as
    cores (2 here) the blocked callbacks can take every thread, and the warpgroup that
    would arrive at the barrier never runs: measured 2026-12-02 on 2 cores with the
    other core busy, 3 hangs in 6 runs of one backward group, with or without
    synchronous dispatch; with ``PJRT_NPROC=8`` none in 12 (6 synchronous, 6 not).
    ``tests/conftest.py`` sets it on a CPU-only host before JAX starts, and synchronous
    dispatch too (a second kind of hang, docs/mosaic.md)."""
    if interpreter_threads() < INTERPRETER_THREADS:
        return (f"the Mosaic GPU interpreter needs an XLA:CPU thread pool of at least "
                f"{INTERPRETER_THREADS} threads (PJRT_NPROC={INTERPRETER_THREADS}, set by "
                f"tests/conftest.py before JAX starts); this process has "
                f"{interpreter_threads()} and could deadlock")
    return None


needs_threads = pytest.mark.skipif(missing_threads() is not None,
                                   reason=str(missing_threads()))


def cache_interpreter_compiles() -> bool:
    """Compile each warpgroup's computation of the Mosaic GPU interpreter once.

    JAX 0.10.2's interpreter runs every warpgroup of every CTA (grid point) as a nested
    XLA:CPU computation and lowers and compiles it anew each time
    (``jax._src.pallas.mosaic.interpret.thread_map._run_jaxpr``): on 2 cores about 70% of
    an interpreted kernel's time (measured 2026-12-02: a 4-CTA causal forward took 3.8 s
    per call, 0.4 s with this cache; the outputs are the same bits, since the cached
    executable is the one the interpreter would compile again). This keeps the compiled
    executable per (jaxpr, argument shapes and dtypes) and runs it for every grid point.
    Returns whether the cache was installed (False where the interpreter's function is
    not the one this replaces: a newer JAX then runs as it is)."""
    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:  # pragma: no cover - depends on the JAX version
        return False
    run = getattr(thread_map, "_run_jaxpr", None)
    if run is None or getattr(run, "_jaxattn_cached", False):
        return run is not None
    src = inspect.getsource(run)
    if "traced.lower().compile()(consts, *args)" not in src:  # pragma: no cover
        return False
    cache: dict = {}
    lock = threading.Lock()

    def _run(jaxpr, consts, *args):
        jax.core.eval_jaxpr(jaxpr, consts, *args)

    def cached_run_jaxpr(jaxpr, consts, *args):
        avals = tuple((np.shape(x), np.dtype(getattr(x, "dtype", type(x))).str)
                      for x in jax.tree.leaves((consts, args)))
        key = (id(jaxpr), avals)
        with lock:
            # The entry keeps the jaxpr alive, so its id is never reused by another.
            entry = cache.setdefault(key, [threading.Lock(), None, jaxpr])
        with entry[0]:
            if entry[1] is None:
                entry[1] = jax.jit(_run, static_argnums=(0,)).trace(
                    jaxpr, consts, *args).lower().compile()
        entry[1](consts, *args)

    cached_run_jaxpr._jaxattn_cached = True
    thread_map._run_jaxpr = cached_run_jaxpr
    return True
