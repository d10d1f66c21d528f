"""Shared fixtures. Deterministic XLA flags are set before JAX starts."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
_FLAGS = ["--xla_gpu_deterministic_ops=true"]
_CPU_HOST = not os.path.exists("/dev/nvidiactl")
if _CPU_HOST:
    # The Mosaic GPU interpreter blocks XLA:CPU pool threads in its barrier callbacks; a
    # pool of as many threads as cores can deadlock it (tests/mosaic_support.py,
    # missing_threads). The pool's size is read when the CPU client starts.
    os.environ.setdefault("PJRT_NPROC", "8")
    # A CPU-only host: the interpret-mode kernels (Pallas, Mosaic GPU) are bound by XLA
    # CPU compile time, which LLVM's optimisation level decides; at level 0 the suite
    # runs about a third faster on 2 cores. Every value a test compares is computed in
    # the same process or a child with the same flags. Not on a GPU host (it would slow
    # the GPU's XLA code too).
    _FLAGS += ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
    # Not XLA:CPU's older fusion emitters (--xla_cpu_use_fusion_emitters=false): the
    # suite ran in 445 s instead of 600 to 720 s on 2 cores (2026-12-04), but 14 bitwise
    # tests failed (tile heights, split against prefill paths, CP cuts): the older
    # emitters round one computation differently in different kernels.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    # One persistent compilation cache per test run, shared by the xdist workers and the
    # child processes they start (the CLI and example tests); it also serves the
    # recompiles after a test's jax.clear_caches(). Removed when the run ends.
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="jaxattn-test-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
for _flag in _FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402

if _CPU_HOST:
    # And synchronous dispatch, set before the CPU client starts: an eager backward
    # (jax.grad, not jitted) otherwise queues many small computations behind an
    # interpreted kernel while the kernel's warpgroups wait to execute their nested
    # computations; on 2026-12-04 a clean-clone run hung there a second time, every
    # thread of the worker blocked in XLA:CPU's execute (docs/mosaic.md, "CPU tests and
    # the interpreter's deadlock").
    jax.config.update("jax_cpu_enable_async_dispatch", False)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mosaic_support import cache_interpreter_compiles  # noqa: E402

ON_GPU = jax.default_backend() in ("gpu", "cuda")
# The Mosaic GPU interpreter compiles each warpgroup's computation once per kernel, not
# once per grid point (the same executables, so the same bits; see mosaic_support).
cache_interpreter_compiles()


@pytest.hookimpl(tryfirst=True)  # before -m deselects the slow tests
def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip)
        # A module's SLOW_ON_CPU {backend: {test names}}: those tests of that backend's
        # parameter are slow off the GPU (CI time; the H200 battery runs them natively);
        # "name[part]" only the cases whose id has ``part`` in it.
        callspec = getattr(item, "callspec", None)
        spec = getattr(callspec, "params", {}).get("spec")
        slow = getattr(item.module, "SLOW_ON_CPU", {}).get(getattr(spec, "name", None), ())
        if not ON_GPU and any(_names_case(entry, item.originalname, callspec)
                              for entry in slow):
            item.add_marker(pytest.mark.slow)
        # Slow off the GPU only (CI time), run by the GPU battery (which deselects -m
        # slow): @pytest.mark.slow_on_cpu, and the cases of a module's CPU_CASES {test
        # name: ids kept} not kept. For lowering checks, which lower for CUDA the same on
        # either host: CI keeps a case of each kernel (and JAX 0.10's lowering of it).
        keep = getattr(item.module, "CPU_CASES", {}).get(item.originalname)
        if not ON_GPU and ("slow_on_cpu" in item.keywords or (
                keep is not None and callspec is not None and callspec.id not in keep)):
            item.add_marker(pytest.mark.slow)


def _names_case(entry: str, name: str, callspec) -> bool:
    """Whether a SLOW_ON_CPU entry (``name`` or ``name[part]``, ``part`` one of the
    "-"-separated parts of the case's id) names this test case."""
    base, _, part = entry.partition("[")
    if base != name:
        return False
    return not part or (callspec is not None and part.rstrip("]") in callspec.id.split("-"))


@pytest.fixture
def small_split():
    """SPLIT = 128 keys (two key blocks), so that interpret-mode shapes cross SPLITs at a
    few blocks' cost (CI time). The properties under test (CP's aligned cuts, a split
    decode's or fold's bits against the one-launch fold) hold for any SPLIT; on the GPU
    the tests of the same properties run at the real SPLIT."""
    from jaxattn import schedule
    old = (schedule.SPLIT, schedule.BLOCKS_PER_SPLIT)
    schedule.SPLIT, schedule.BLOCKS_PER_SPLIT = 128, 128 // schedule.BLOCK_N
    jax.clear_caches()
    yield
    schedule.SPLIT, schedule.BLOCKS_PER_SPLIT = old
    jax.clear_caches()


def cpu_env(**extra: str) -> dict:
    """The environment of a child process that must run JAX on the CPU also on a GPU host
    (CPU smoke modes, virtual CPU devices), plus ``extra``."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", **extra}


def with_xla_flags(*flags: str) -> str:
    """This process's XLA_FLAGS (the test flags above) and ``flags``: a child's, so that
    it compiles as the tests do."""
    return " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()


_counter = iter(range(10**9))


def rand(shape, dtype=jnp.float32, *, seed: int | None = None, scale: float = 1.0):
    """Fresh normal values (never zeros); a new seed on every call unless given."""
    from jaxattn.invariance import normal
    seed = next(_counter) + 1000 if seed is None else seed
    return normal(seed, shape, dtype, scale=scale)


def rand_qkv(b, hq, hkv, sq, skv, d, dtype=jnp.float32, seed: int | None = None):
    seed = next(_counter) * 3 + 5000 if seed is None else seed
    return (rand((b, hq, sq, d), dtype, seed=seed), rand((b, hkv, skv, d), dtype, seed=seed + 1),
            rand((b, hkv, skv, d), dtype, seed=seed + 2))


def rel_err(out, ref) -> float:
    """max |out - ref| / max |ref| in float64."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


def ragged_cache(layout, ps, lens, k, v, seed=0):
    """K/V ``[B, Hkv, S, D]`` written into a shuffled paged cache of ``ps``-key pages
    (``layout`` "HND" or "NHD"), only each sequence's first ``lens[b]`` keys; every other
    slot and page NaN. Returns ``(k_pages, v_pages, block_table)``."""
    from jaxattn import paged
    b, max_pages = len(lens), -(-k.shape[2] // ps)
    num_pages = b * max_pages + 3
    table = jnp.asarray(np.random.default_rng(seed).permutation(num_pages)[:b * max_pages]
                        .reshape(b, max_pages).astype(np.int32))
    hkv, d = k.shape[1], k.shape[3]
    shape = (num_pages, ps, hkv, d) if layout == "NHD" else (num_pages, hkv, ps, d)
    kp, vp = jnp.full(shape, jnp.nan, k.dtype), jnp.full(shape, jnp.nan, v.dtype)
    for i in range(b):
        kp, vp, _ = paged.write(kp, vp, table[i:i + 1], jnp.zeros((1,), jnp.int32),
                                k[i:i + 1, :, :lens[i]], v[i:i + 1, :, :lens[i]],
                                layout=layout)
    return kp, vp, table


def np_attention(q, k, v, *, causal=True, scale=None, mask=None, q_pos=None, k_pos=None):
    """Independent float64 NumPy attention: (out, lse), loops over batch and heads."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros((b, hq, sq, d))
    lse = np.full((b, hq, sq), -np.inf)
    for bi in range(b):
        qp = np.arange(sq) + (skv - sq) if q_pos is None else np.asarray(q_pos[bi])
        kp = np.arange(skv) if k_pos is None else np.asarray(k_pos[bi])
        vis = np.ones((sq, skv), bool)
        if causal:
            vis &= kp[None, :] <= qp[:, None]
        if mask is not None:
            vis &= np.asarray(mask[bi])[None, :]
        for h in range(hq):
            kh, vh = k[bi, h // g], v[bi, h // g]
            for i in range(sq):
                idx = np.nonzero(vis[i])[0]
                if idx.size == 0:
                    continue
                s = q[bi, h, i] @ kh[idx].T * scale
                m = s.max()
                p = np.exp(s - m)
                out[bi, h, i] = p @ vh[idx] / p.sum()
                lse[bi, h, i] = m + np.log(p.sum())
    return out, lse


# ------------------------------------------- launch options of a kernel backend keep bits
# ``forward(q, k, v, mask=None, causal=True, path=..., config=...)``: a backend's forward
# with its scale bound (the Pallas and the raw Triton tests share these checks).

def assert_paths_agree(forward, q, k, v, mask, causal):
    """The prefill and split-parallel launch paths give the same bits, and are accurate."""
    from jaxattn import reference
    from jaxattn.invariance import bits_equal

    a = forward(q, k, v, mask, causal, path="prefill")
    b = forward(q, k, v, mask, causal, path="split")
    assert bits_equal(a[0], b[0]) and bits_equal(a[1], b[1])
    assert rel_err(a[0], reference.forward_fp32(q, k, v, causal=causal,
                                                key_padding_mask=mask)) < 3e-2


def assert_configs_keep_bits(forward, q, k, v, configs):
    """Every launch config, on both paths, gives the bits of the default prefill launch."""
    from jaxattn.invariance import bits_equal

    base = forward(q, k, v, path="prefill")
    for config in configs:
        for path in ("prefill", "split"):
            got = forward(q, k, v, path=path, config=config)
            assert bits_equal(got[0], base[0]) and bits_equal(got[1], base[1]), (path, config)


def warps_stages_config(warps: int, stages: int):
    """A forward config with ``warps`` and ``stages`` on both launch paths."""
    from jaxattn.backends.pallas import forward as pt

    return pt.ForwardConfig(num_warps=warps, num_stages=stages, decode_num_warps=warps,
                            decode_num_stages=stages)


if os.environ.get("JAXATTN_TEST_CPU_LOG"):
    # Opt-in (CI-time work): each test's CPU seconds (this process's threads and its
    # children's) and wall seconds, appended to that file. Under xdist the durations
    # pytest prints are wall time shared with the other workers; the CPU is the work.
    import resource
    import time

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        def cpu():
            return sum(getattr(resource.getrusage(who), f)
                       for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                       for f in ("ru_utime", "ru_stime"))
        c0, t0 = cpu(), time.perf_counter()
        yield
        with open(os.environ["JAXATTN_TEST_CPU_LOG"], "a") as f:
            f.write(f"{cpu() - c0:.2f} {time.perf_counter() - t0:.2f} {item.nodeid}\n")
