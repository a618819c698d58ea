"""Wall-clock timing for the benchmarks: every timed call blocks until its result is ready.

The benchmarks run as scripts (``python experiments/bench/NAME.py``, with ``jaxformer``
installed, e.g. ``pip install -e .``); a script's own directory is on ``sys.path``, so they
import this module and :mod:`procmem` as ``from timing import ...``.
"""

from __future__ import annotations

import collections
import os
import statistics
import time

import jax
from jaxformer.train.host_memory import TUNABLE


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


def alternating_rounds(contenders: dict, rounds: int) -> tuple[dict, dict, dict]:
    """``rounds`` alternating rounds (a busy machine slows every contender alike) over ``contenders``, ``{name:
    (warm, calls)}``: in each round a contender's ``warm()`` runs first, not counted, then each of its ``calls``,
    ``[(key, fn), ...]``, timed, so no counted call is a contender's first after another contender's (after
    another's run the caches are cold and pages it took may fault back). Wall and CPU (process) seconds of each
    counted call by key, and wall seconds of each warm call by name: lists of one per round."""
    wall, cpu, warm = (collections.defaultdict(list) for _ in range(3))
    for _ in range(rounds):
        for name, (first, calls) in contenders.items():
            t0 = time.perf_counter()
            first()
            warm[name].append(time.perf_counter() - t0)
            for key, fn in calls:
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                wall[key].append(time.perf_counter() - t0)
                cpu[key].append(time.process_time() - c0)
    return wall, cpu, warm


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_identity(cpuinfo: str) -> tuple[str, set[str]]:
    """``(model, flags)`` of the first processor in ``/proc/cpuinfo``'s text: its model name with the x86 family and
    model numbers, which tell generations apart where a KVM guest's name does not (every AMD box seen here reports
    "AMD EPYC": family 23 model 49 was Zen 2, 25 / 1 Zen 3, 25 / 17 Zen 4, 26 Zen 5), and its flags."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block only
            continue
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    model = fields.get("model name", "unknown CPU")
    family, number = fields.get("cpu family"), fields.get("model")
    if family and number:
        model += f" (family {family}, model {number})"
    return model, set(fields.get("flags", "").split())


def cpu_line() -> str:
    """The CPU model (:func:`cpu_identity`), its vector ISA flags, the cores, the load average and whether glibc's
    malloc asks for huge pages (``jaxformer.train.host_memory``: the train-step benchmarks restart with them, as
    ``jaxformer train`` does), for every table."""
    try:
        with open("/proc/cpuinfo") as f:
            model, flags = cpu_identity(f.read())
    except OSError:
        model, flags = "unknown CPU", set()
    isa = " ".join(f for f in ISA_FLAGS if f in flags) or "none of " + " ".join(ISA_FLAGS)
    huge = TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":")
    return (f"CPU: {model}, {os.cpu_count()} cores, ISA {isa}; load average "
            f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())} (1 / 5 / 15 min); malloc "
            f"{'huge pages' if huge else 'defaults'}")


XLA_RUNTIME_SPANS = ("ThunkExecutor", "SlinkyThreadPool", "ThreadpoolListener", "end: ")  # the executor's own


def xla_op_events(trace_dir: str) -> list[tuple[int, int, str]]:
    """``(start_ns, end_ns, HLO instruction)`` of every XLA CPU op in a ``jax.profiler.trace(trace_dir)`` run with
    ``--xla_cpu_enable_xprof_traceme=true``, over all of XLA's threads (the executor's own spans left out)."""
    import glob

    data = jax.profiler.ProfileData.from_file(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
    return [(ev.start_ns, ev.start_ns + ev.duration_ns, ev.name)
            for plane in data.planes for line in plane.lines if line.name.startswith("tf_XLA")
            for ev in line.events if not ev.name.startswith(XLA_RUNTIME_SPANS)]


def xla_op_ns(trace_dir: str, steps: int) -> dict[str, float]:
    """Nanoseconds per step of each XLA CPU op in a ``jax.profiler.trace(trace_dir)`` of ``steps`` steps run
    with ``--xla_cpu_enable_xprof_traceme=true``: ops by HLO instruction name, summed over XLA's threads."""
    return op_ns_per_step(xla_op_events(trace_dir), steps)


def op_ns_per_step(events: list[tuple[int, int, str]], steps: int) -> dict[str, float]:
    """Nanoseconds per step of each op name in ``events`` (:func:`xla_op_events`) of ``steps`` steps."""
    import collections

    op_ns = collections.Counter()
    for start, end, name in events:
        op_ns[name] += (end - start) / steps
    return op_ns


def _intervals(events: list[tuple[int, int, str]]):
    """``(ns, indices of the events running)`` for each stretch between consecutive starts and ends of ``events``
    (:func:`xla_op_events`). At equal times starts come first, so an op that takes no time, or ends as another
    starts, adds nothing and never counts below zero."""
    edges = sorted([(s, 1, i) for i, (s, _, _) in enumerate(events)] + [(e, -1, i) for i, (_, e, _) in enumerate(events)],
                   key=lambda x: (x[0], -x[1]))
    running, last = set(), None
    for t, step, i in edges:
        if last is not None and t > last:
            yield t - last, running
        if step > 0:
            running.add(i)
        else:
            running.discard(i)
        last = t


def ops_alone(events: list[tuple[int, int, str]]) -> dict[str, int]:
    """Nanoseconds during which each op name was the only XLA op running (summed over its events): the ops that
    hold a step to one thread (:func:`ops_running`'s "one" share, taken apart)."""
    import collections

    alone = collections.Counter()
    for ns, running in _intervals(events):
        if len(running) == 1:
            alone[events[next(iter(running))][2]] += ns
    return alone


def ops_running(events: list[tuple[int, int, str]]) -> dict[int, float]:
    """Of the span from the first op's start to the last op's end, the fraction with ``k`` ops running at once
    (``{0: .., 1: .., 2: ..}``, 2 meaning two or more): how well a program keeps a CPU's threads busy. An op that
    hands its work to another pool is traced for its launch only (XLA's Eigen dots, when XLA has more than one
    thread), so "0" holds that work as well as the runtime's gaps."""
    busy = {0: 0, 1: 0, 2: 0}
    for ns, running in _intervals(events):
        busy[min(len(running), 2)] += ns
    span = sum(busy.values())
    return {k: v / span for k, v in busy.items()} if span else {}


def hlo_outputs(hlo: str) -> dict[str, str]:
    """Each instruction's output shape in an HLO text, by name: ``f32[768,512]``, a tuple as its first element and
    an ellipsis, ``(f32[768,512], ...)``; where modules joined in one text share a name, the first's."""
    import re

    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = (\()?(\w+\[[\d,]*\])", hlo, re.M):
        out.setdefault(m[1], f"({m[3]}, ...)" if m[2] else m[3])
    return out
