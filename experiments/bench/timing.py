"""Wall-clock timing for the benchmarks: every timed call blocks until its result is ready.

The benchmarks run as scripts (``python experiments/bench/NAME.py``, with ``jaxformer``
installed, e.g. ``pip install -e .``); a script's own directory is on ``sys.path``, so they
import this module and :mod:`procmem` as ``from timing import ...``.
"""

from __future__ import annotations

import os
import statistics
import time

import jax


def timed(fn, *args):
    """``(fn(*args), wall seconds)``, the result blocked until ready."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t0


def wall_times(fn, *args, warmup: int = 1, repeats: int = 5) -> list[float]:
    """Seconds of each of ``repeats`` calls ``fn(*args)``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    return [timed(fn, *args)[1] for _ in range(repeats)]


def median_seconds(fn, *args, warmup: int = 1, repeats: int = 5) -> float:
    """Median of :func:`wall_times`."""
    return statistics.median(wall_times(fn, *args, warmup=warmup, repeats=repeats))


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_line() -> str:
    """The CPU model, its vector ISA flags, the cores and the load average, for every table."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = " ".join(f for f in ISA_FLAGS if f in flags) or "none of " + " ".join(ISA_FLAGS)
    return (f"CPU: {model}, {os.cpu_count()} cores, ISA {isa}; load average "
            f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())} (1 / 5 / 15 min)")


XLA_RUNTIME_SPANS = ("ThunkExecutor", "SlinkyThreadPool", "ThreadpoolListener", "end: ")  # the executor's own


def xla_op_ns(trace_dir: str, steps: int) -> dict[str, float]:
    """Nanoseconds per step of each XLA CPU op in a ``jax.profiler.trace(trace_dir)`` of ``steps`` steps run
    with ``--xla_cpu_enable_xprof_traceme=true``: ops by HLO instruction name, summed over XLA's threads."""
    import collections
    import glob

    data = jax.profiler.ProfileData.from_file(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
    op_ns = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if line.name.startswith("tf_XLA"):
                for ev in line.events:
                    if not ev.name.startswith(XLA_RUNTIME_SPANS):
                        op_ns[ev.name] += ev.duration_ns / steps
    return op_ns
