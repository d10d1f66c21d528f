"""Shared by the benchmark binaries: where results go (``results.json`` and
``results.md`` under ``--out_dir``), one progress line per measured row, and the
synchronous per-call timer."""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any


def write(out_dir: str | None, data: Any, md: str | None = None, **json_kw) -> None:
    """``data`` as ``out_dir/results.json`` and ``md`` (if given) as ``results.md``;
    nothing when ``out_dir`` is None."""
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(data, f, indent=2, **json_kw)
    if md is not None:
        with open(os.path.join(out_dir, "results.md"), "w") as f:
            f.write(md)


def print_row(row: dict) -> None:
    """One measured row, floats to 3 decimals, flushed (long runs show progress)."""
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()},
          flush=True)


def median_seconds(fn, args, iters: int) -> float:
    """Median wall time of ``iters`` calls of ``fn(*args)``, each waited for, after one
    untimed call (compilation, first-touch)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
