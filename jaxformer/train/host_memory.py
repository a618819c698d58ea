"""Huge pages for the temporary buffers of XLA's CPU programs.

XLA's CPU runtime allocates each execution's temporary buffer (every intermediate of a train step at once: 129 MB
for the main job's, ``compiled.memory_analysis().temp_size_in_bytes``) with ``malloc`` and frees it when the
execution ends. glibc serves a block that large with a fresh ``mmap`` and unmaps it on ``free``, so every step
faults in every 4 KiB page of its buffer anew: in the main job's GPT-2-shaped twin (108 MB), 26,000 page faults
and ~90 ms of kernel CPU time a step beside ~250 ms of the step's own, on 2 EPYC cores. With glibc's tunable
``glibc.malloc.hugetlb=1`` (glibc 2.35 and later) malloc asks the kernel for transparent huge pages on those
mappings: 2 MiB pages, 512 times fewer faults, the memory still handed back at every ``free``, and the twin's step
1.27-1.36x faster, where a PyTorch step timed in the same processes does not move (its blocks are smaller, and
glibc's heap recycles them): ``experiments/results/train_throughput.md``.

A tunable is read once, when the process starts: :func:`restart_with_huge_pages` starts the process again with it
(the ``jaxformer`` command does, before anything else); from your own script, set it in the environment::

    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python my_script.py

Only the standard library is imported here.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import pkgutil
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb=1"
"""glibc's malloc tunable: ``madvise(MADV_HUGEPAGE)`` on the memory it maps (glibc 2.35 and later)."""
OPT_OUT = "JAXFORMER_HUGE_PAGES"
"""Set to ``0``: :func:`restart_with_huge_pages` leaves the process as it is."""
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def glibc_version() -> tuple[int, int] | None:
    """The C library's version where it is glibc (``gnu_get_libc_version``); None elsewhere (musl, macOS)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        version = ctypes.CDLL(None).gnu_get_libc_version
    except (OSError, AttributeError, TypeError):
        return None
    version.restype = ctypes.c_char_p
    major, minor, *_ = version().decode().split(".") + ["0"]
    return int(major), int(minor)


def runs_on_the_cpu() -> bool:
    """Whether this process's JAX will run its programs on the CPU: ``JAX_PLATFORMS`` names ``cpu`` first, or
    it is unset and no accelerator plugin (CUDA, ROCm, TPU) is installed. Decided without importing JAX."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    ns = importlib.util.find_spec("jax_plugins")  # jax[cuda]'s plugins live in this namespace package
    plugins = [m.name for m in pkgutil.iter_modules(ns.submodule_search_locations or [])] if ns else []
    plugins += [e.name for e in importlib.metadata.entry_points(group="jax_plugins")]
    return not plugins and importlib.util.find_spec("libtpu") is None


def huge_pages_would_help() -> str | None:
    """None where :func:`restart_with_huge_pages` would restart this process; else why not, in a few words."""
    if os.environ.get(OPT_OUT) == "0":
        return f"{OPT_OUT}=0"
    if TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":"):
        return "set already"
    version = glibc_version()
    if version is None or version < (2, 35):
        return "not glibc 2.35 or later"
    try:
        if "[never]" in THP.read_text():
            return "transparent huge pages off in this kernel"
    except OSError:
        return "no transparent huge pages in this kernel"
    if not runs_on_the_cpu():
        return "JAX runs on an accelerator (its buffers live there)"
    return None


def restart_with_huge_pages() -> None:
    """Start this process again, as it was started (``os.execv``: the same PID, arguments and environment), with
    :data:`TUNABLE` added to ``GLIBC_TUNABLES``; return at once, changing nothing, where
    :func:`huge_pages_would_help` says why not (already set, ``JAXFORMER_HUGE_PAGES=0``, not glibc 2.35+, no
    transparent huge pages, JAX on an accelerator). Call it first thing: whatever ran before it runs again."""
    if huge_pages_would_help() is not None:
        return
    tunables = os.environ.get("GLIBC_TUNABLES")
    os.environ["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}" if tunables else TUNABLE
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(sys.executable, sys.orig_argv)
    except OSError:  # no interpreter to start again (a frozen or embedded Python): go on as it is
        if tunables is None:
            del os.environ["GLIBC_TUNABLES"]
        else:
            os.environ["GLIBC_TUNABLES"] = tunables
