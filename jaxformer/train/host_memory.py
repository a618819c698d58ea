"""Huge pages for the temporary buffers of XLA's CPU programs.

XLA's CPU runtime allocates each execution's temporary buffer (every intermediate of a train step at once: 129 MB
for the main job's, ``compiled.memory_analysis().temp_size_in_bytes``) with ``malloc`` and frees it when the
execution ends. glibc serves a block that large with a fresh ``mmap`` and unmaps it on ``free``, so every step
faults in every 4 KiB page of its buffer anew: in the main job's GPT-2-shaped twin (108 MB), 26,000 page faults
and ~90 ms of kernel CPU time a step beside ~250 ms of the step's own, on 2 EPYC cores. With glibc's tunable
``glibc.malloc.hugetlb=1`` (glibc 2.35 and later) malloc asks the kernel for transparent huge pages on those
mappings (where the kernel's mode is ``[madvise]``, the usual default; ``[always]`` gives them unasked): 2 MiB
pages, 250-430 faults a step instead of 26,300, the memory still handed back at every ``free``, and the twin's step
1.21-1.36x faster (a PyTorch step timed in the same processes moved by -1.5 to +4.7%; its blocks are smaller, and
glibc's heap recycles them): ``experiments/results/train_throughput.md``.

A tunable is read once, when the process starts: :func:`restart_with_huge_pages` starts the process again with it
(``jaxformer train`` does, before anything else: the one command measured with it so far); from your own script,
set it in the environment (a child process inherits it)::

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
RESTARTED = "JAXFORMER_HUGE_PAGES_RESTARTED"
"""Set by :func:`restart_with_huge_pages` in the process it starts: never a second restart (glibc drops tunables
from the environment of a setuid or file-capability interpreter, so the tunable itself cannot say so)."""
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def libc_function(name: str):
    """The C library's function ``name`` from the symbols this process has loaded (glibc's, where it is the C
    library) on Linux; None elsewhere or where it has none of that name (musl: no ``gnu_get_libc_version``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError, TypeError):
        return None


def glibc_version() -> tuple[int, int] | None:
    """The C library's version where it is glibc (``gnu_get_libc_version``); None elsewhere (musl, macOS)."""
    version = libc_function("gnu_get_libc_version")
    if version is None:
        return None
    version.restype = ctypes.c_char_p
    try:
        major, minor, *_ = version().decode().split(".") + ["0"]
        return int(major), int(minor)
    except ValueError:  # a version string of another shape: not a glibc to rely on
        return None


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


def why_no_huge_pages() -> str | None:
    """Why :func:`restart_with_huge_pages` would leave this process as it is, in a few words; None where it would
    start it again with huge pages."""
    if os.environ.get(OPT_OUT) == "0":
        return f"{OPT_OUT}=0"
    if os.environ.get(RESTARTED):
        return "restarted already"
    if any(t.startswith("glibc.malloc.hugetlb=") for t in os.environ.get("GLIBC_TUNABLES", "").split(":")):
        return "glibc.malloc.hugetlb set already"  # the user's value, whatever it is, stands
    if sys.flags.interactive or hasattr(sys, "ps1") or "ipykernel" in sys.modules or len(sys.orig_argv) < 2:
        return "an interactive session (its state would be lost)"
    version = glibc_version()
    if version is None or version < (2, 35):
        return "not glibc 2.35 or later"
    try:
        if "[madvise]" not in THP.read_text():
            return "the kernel's transparent huge pages are not in madvise mode (always: given unasked; never: off)"
    except OSError:
        return "no transparent huge pages in this kernel"
    if not runs_on_the_cpu():
        return "JAX runs on an accelerator (its buffers live there)"
    return None


def restart_with_huge_pages() -> None:
    """Start this process again, as it was started (``os.execv``: the same PID, arguments and environment), with
    :data:`TUNABLE` added to ``GLIBC_TUNABLES``; return at once, changing nothing, where :func:`why_no_huge_pages`
    says why not (``JAXFORMER_HUGE_PAGES=0``, restarted or set already, an interactive session, not glibc 2.35+,
    transparent huge pages not in madvise mode, JAX on an accelerator). Call it first thing: whatever ran before
    it runs again."""
    if why_no_huge_pages() is not None or not sys.executable:
        return
    before = {k: os.environ.get(k) for k in ("GLIBC_TUNABLES", RESTARTED)}
    tunables = before["GLIBC_TUNABLES"]
    os.environ["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}" if tunables else TUNABLE
    os.environ[RESTARTED] = "1"
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    try:
        os.execv(sys.executable, sys.orig_argv)
    except (OSError, ValueError):  # no interpreter to start again (a frozen or embedded Python): go on as it is
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
