"""``release_host_memory``: what finished runs left in a process, their compiled programs' memory mappings and the
heap glibc kept, is let go (``jaxformer sweep`` calls it between points; without it a process fine-tuning
SmolLM2-135M point after point ran out of mappings and aborted in LLVM, experiments/results/sweep_memory.md)."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest

from jaxformer.train.loop import release_host_memory
from tests.bench_scripts import load_bench, load_script

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
procmem = load_bench("procmem")


def rss() -> int:
    return procmem.proc_kb("VmRSS") * 1024


def glibc():
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim  # noqa: B018 - the lookup is the check
        return libc
    except (OSError, AttributeError):
        return None


@pytest.mark.skipif(not sys.platform.startswith("linux") or glibc() is None, reason="glibc's malloc on Linux only")
def test_freed_heap_blocks_go_back_to_the_os():
    """256 MiB of 4 KiB heap blocks, touched, then freed under one block still held above them (so glibc
    cannot shrink the heap from its top and keeps them for reuse): the resident set stays up until
    ``release_host_memory``, which must return at least 3/4 of it. The heap is trimmed first, so the blocks take
    pages not yet resident. The blocks are malloc'd from this thread,
    whose arena is the one ``malloc_trim`` reaches like every other."""
    libc = glibc()
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block, n = 4096, 256 * MiB // 4096
    libc.malloc_trim(0)  # free blocks earlier tests left resident would be reused without raising the count
    before = rss()
    blocks = [libc.malloc(block) for _ in range(n)]
    assert all(blocks)
    for b in blocks:
        ctypes.memset(b, 1, block)  # resident, not just reserved
    pin = libc.malloc(block)  # above them all: the heap's top cannot be trimmed past it
    touched = rss()
    assert touched - before > 200 * MiB, (before, touched)
    for b in blocks:
        libc.free(b)
    held = rss()
    assert held - before > 200 * MiB, "glibc handed the blocks back by itself: the test shows nothing"
    try:
        assert release_host_memory() is True
        released = held - rss()
        assert released > 192 * MiB, f"released {released / MiB:.0f} MiB of the 256 MiB freed"
    finally:
        libc.free(pin)


def code_maps() -> int:
    """Anonymous executable mappings: JIT-compiled machine code (arenas and thread stacks are not executable)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if len(fields := line.split()) == 5 and fields[1].startswith("r-x"))


def _compile_programs(k: int) -> list:
    """15 programs compiled and kept alive (as the trainer caches keep theirs), shapes unseen before."""
    import jax
    import jax.numpy as jnp

    kept = []
    # 15, not 30 (half the 90 compiles: ~4 s): a release that kept them still leaves >= 15, five times the 3 allowed
    for n in range(15):
        f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(0) * jnp.exp(-x[:, 0]))
        f(jnp.ones((1000 + 100 * k + n, 4))).block_until_ready()
        kept.append(f)
    return kept


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux's")
def test_compiled_programs_give_back_their_memory_mappings():
    """Each compiled program maps its machine code (a code mapping for each of its kernels on XLA's CPU backend,
    beside its data), and a process gets at most ``vm.max_map_count`` mappings: a sweep's process aborted in LLVM
    for want of one. 15 programs held alive add >= 15 anonymous executable mappings (2-3 a program measured);
    after ``release_host_memory`` that count is back within 3 of where it stood before them, in each of two rounds
    after a first one (whose release leaves the runtime's own few, made once)."""
    _compile_programs(0)
    release_host_memory()
    for k in (1, 2):
        before = code_maps()
        kept = _compile_programs(k)
        compiled = code_maps()
        assert compiled - before >= 15, (before, compiled)
        release_host_memory()
        assert code_maps() - before <= 3, (before, compiled, code_maps())
        assert kept[0]._cache_size() == 0  # held, but its executable is gone: it compiles again when called


def test_without_glibc_it_says_so(monkeypatch):
    """Where the C library has no ``malloc_trim`` (musl, macOS) it returns False and does nothing."""
    class NoTrim:
        def __init__(self, name):
            pass

    monkeypatch.setattr(ctypes, "CDLL", NoTrim)
    assert release_host_memory() is False


# 13 s (two points trained, compiled); the measurement script end to end, as the other experiments/ scripts' are
# slow; what the release frees is the tests above, and the sweep's release after every point is a default-run test
# (tests/study/test_sweep.py::test_the_sweep_releases_host_memory_after_every_point)
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the script reads /proc/self")
@pytest.mark.parametrize("release", [True, False])
def test_sweep_memory_script_prints_a_row_per_point_and_stops_at_points(tmp_path, monkeypatch, capsys, release):
    """``experiments/sweep_memory.py`` on a tiny sweep of three points, stopped after two: one table row per point
    run, named, and ``--no-release`` runs the points without the release (the real one counted here)."""
    import jaxformer.train.loop as loop
    from jaxformer.study.sweep import load_sweep
    from tests.study.test_sweep import write_sweep

    calls = []
    monkeypatch.setattr(loop, "release_host_memory", lambda: calls.append(1))  # restored after the test
    mod = load_script(REPO / "experiments" / "sweep_memory.py", "sweep_memory")
    path = write_sweep(tmp_path, {"axes": {"optimizer.lr": [1e-3, 3e-3, 1e-2]}})
    names = [p.name for p in load_sweep(path).points]
    assert mod.main([str(path), "--points", "2"] + ([] if release else ["--no-release"])) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split(" | ")[0] for r in rows] == [f"| 1 {names[0]}", f"| 2 {names[1]}"]
    assert len(calls) == (2 if release else 0)

