"""``restart_with_huge_pages``: glibc's malloc asks for transparent huge pages on the memory it maps, so the
temporary buffer an XLA CPU program maps afresh at every call faults in 2 MiB pages, not 4 KiB ones
(experiments/results/train_throughput.md: a CPU train step 1.2-1.4x faster); ``jaxformer train`` restarts itself
that way first thing."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

import jaxformer.cli as cli
from jaxformer.train import host_memory as hm

REPO = Path(__file__).resolve().parents[2]

# The process restarts itself with the tunable (unless JAXFORMER_HUGE_PAGES=0), then runs a program whose one
# temporary is a [5000, 5000] fp32 product (100 MB: mapped afresh at every call), multiplied again; minor page
# faults counted over 4 calls after 2 warm ones.
PROBE = r"""
import json, os, resource
from jaxformer.train.host_memory import restart_with_huge_pages
restart_with_huge_pages()
import jax
f = jax.jit(lambda x: (x @ x.T) @ x)
x = jax.random.normal(jax.random.key(0), (5000, 8))
compiled = f.lower(x).compile()
temp = compiled.memory_analysis().temp_size_in_bytes
for _ in range(2):
    compiled(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    compiled(x).block_until_ready()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4
print(json.dumps({"tunables": os.environ.get("GLIBC_TUNABLES"), "pid": os.getpid(),
                  "temp_pages": temp // resource.getpagesize(), "faults": faults}))
"""


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hm.OPT_OUT, hm.RESTARTED)}
    return {**env, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO), **extra}


def probe(**env) -> dict:
    proc = subprocess.Popen([sys.executable, "-c", PROBE], env=clean_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return {**json.loads(out.strip().splitlines()[-1]), "started_as": proc.pid}


def test_glibc_version_is_the_c_librarys():
    """The real parse (the other tests fake it): where Python says the C library is glibc, the same version."""
    name, version = platform.libc_ver()
    if name != "glibc":
        assert hm.glibc_version() is None
    else:
        assert hm.glibc_version() == tuple(int(x) for x in version.split(".")[:2])


def test_libc_function_is_none_without_the_symbol_or_off_linux(monkeypatch):
    """``libc_function`` (``glibc_version``'s and ``release_host_memory``'s lookup): a name the C library lacks, or
    another platform, gives None, not an exception; where the C library is glibc its ``malloc_trim`` is found."""
    assert hm.libc_function("jaxformer_no_such_function") is None
    if platform.libc_ver()[0] == "glibc":
        assert hm.libc_function("malloc_trim") is not None
    monkeypatch.setattr(hm.sys, "platform", "darwin")
    assert hm.libc_function("malloc_trim") is None and hm.glibc_version() is None


# 7 s (two fresh processes import JAX); the effect itself (fewer page faults under the tunable) is not default-run.
# The restart's decisions, the tunable it adds and its exec (recorded) are default-run below, and where glibc and
# the kernel allow it a real in-place restart runs in every `python -m jaxformer.cli train` of tests/train/test_interrupt.py (default-run), which signals the pid it started
@pytest.mark.slow
def test_huge_pages_fault_in_the_temporary_buffer_in_far_fewer_pages(monkeypatch):
    """Counted work, not time: page faults per call against the temporary buffer's 4 KiB pages (24,414).
    glibc's defaults fault in (nearly) every one of them at every call; with huge pages, under a twentieth
    (2 MiB pages: a 512th, plus what the kernel could not give as huge pages; 428 a call measured)."""
    for name in ("GLIBC_TUNABLES", hm.OPT_OUT, hm.RESTARTED):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    if (why := hm.why_no_huge_pages()) is not None:
        pytest.skip(f"no restart with huge pages on this machine: {why}")
    if resource.getpagesize() != 4096:
        pytest.skip(f"{resource.getpagesize()}-byte pages: the counts below are for 4 KiB ones")
    default, huge = probe(**{hm.OPT_OUT: "0"}), probe()
    assert default["tunables"] is None and huge["tunables"] == "glibc.malloc.hugetlb=1"
    assert huge["pid"] == huge["started_as"]  # started again in place (exec), not a child
    assert huge["temp_pages"] >= 24_000, huge  # the product is a temporary of its own, as in a train step
    if default["faults"] < default["temp_pages"] / 2:
        pytest.skip(f"glibc's defaults fault in only {default['faults']:.0f} of {default['temp_pages']} pages a "
                    "call here: nothing for the tunable to save")
    if huge["faults"] >= huge["temp_pages"] / 2 and "[madvise]" not in Path(
            "/sys/kernel/mm/transparent_hugepage/defrag").read_text():
        pytest.skip("the kernel gave no huge pages (defrag not madvise: none compacted for the asking)")
    assert huge["faults"] < huge["temp_pages"] / 20, (default, huge)


@pytest.fixture
def execs(monkeypatch):
    """``os.execv`` recorded, not run; the environment as the restart would find it in a CPU-only process."""
    calls = []
    monkeypatch.setattr(os, "execv", lambda path, argv: calls.append((path, list(argv), os.environ.get(
        "GLIBC_TUNABLES"))))
    for name in ("GLIBC_TUNABLES", hm.OPT_OUT, hm.RESTARTED):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setattr(hm, "glibc_version", lambda: (2, 36))
    monkeypatch.setattr(hm, "THP", SimpleNamespace(read_text=lambda: "always [madvise] never\n"))
    return calls


def test_the_restart_runs_the_same_command_with_the_tunable_added(execs, monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=4")
    hm.restart_with_huge_pages()
    assert execs == [(sys.executable, sys.orig_argv, "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1")]
    assert os.environ[hm.RESTARTED] == "1"  # the started process will not restart again


def test_a_failed_restart_leaves_the_environment_as_it_was(execs, monkeypatch):
    def fail(path, argv):
        raise OSError("no interpreter")

    monkeypatch.setattr(os, "execv", fail)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=4")
    hm.restart_with_huge_pages()
    assert os.environ["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=4" and hm.RESTARTED not in os.environ


@pytest.mark.parametrize("case", ["opted out", "restarted", "set already", "set otherwise", "interactive", "not glibc",
                                  "old glibc", "THP never", "THP always", "no THP", "accelerator"])
def test_no_restart_where_huge_pages_would_not_help(execs, monkeypatch, case):
    if case == "opted out":
        monkeypatch.setenv(hm.OPT_OUT, "0")
    elif case == "restarted":  # e.g. a setuid interpreter, whose glibc dropped the tunable: no endless restarts
        monkeypatch.setenv(hm.RESTARTED, "1")
    elif case in ("set already", "set otherwise"):  # the user's own value (0: glibc's way to say no) stands
        monkeypatch.setenv("GLIBC_TUNABLES", f"glibc.malloc.arena_max=4:glibc.malloc.hugetlb={int(case == 'set already')}")
    elif case == "interactive":
        monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    elif case in ("not glibc", "old glibc"):
        monkeypatch.setattr(hm, "glibc_version", lambda: None if case == "not glibc" else (2, 34))
    elif case in ("THP never", "THP always"):
        mode = "always madvise [never]" if case == "THP never" else "[always] madvise never"
        monkeypatch.setattr(hm, "THP", SimpleNamespace(read_text=lambda: mode + "\n"))
    elif case == "no THP":
        monkeypatch.setattr(hm, "THP", Path("/nonexistent/transparent_hugepage/enabled"))
    else:
        monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert hm.why_no_huge_pages() is not None
    hm.restart_with_huge_pages()
    assert execs == []


@pytest.mark.parametrize("platforms,cpu", [("cpu", True), ("cpu,cuda", True), ("cuda", False), ("tpu,cpu", False)])
def test_only_a_process_whose_jax_runs_on_the_cpu(monkeypatch, platforms, cpu):
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    assert hm.runs_on_the_cpu() is cpu


@pytest.mark.parametrize("installed", [None, "cuda plugin", "plugin entry point", "libtpu"])
def test_without_jax_platforms_an_installed_accelerator_plugin_decides(monkeypatch, tmp_path, installed):
    """JAX_PLATFORMS unset (most users): jax[cuda]'s plugin in the ``jax_plugins`` namespace, a ``jax_plugins``
    entry point or libtpu means JAX will not run on the CPU."""
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    (tmp_path / "xla_cuda12").mkdir()
    (tmp_path / "xla_cuda12" / "__init__.py").write_text("")
    real = hm.importlib.util.find_spec
    found = {"libtpu": object() if installed == "libtpu" else None,
             "jax_plugins": SimpleNamespace(submodule_search_locations=[str(tmp_path)]) if installed == "cuda plugin"
             else None}
    monkeypatch.setattr(hm.importlib.util, "find_spec", lambda name: found[name] if name in found else real(name))
    monkeypatch.setattr(hm.importlib.metadata, "entry_points", lambda group: (
        [SimpleNamespace(name="cuda")] if installed == "plugin entry point" and group == "jax_plugins" else []))
    assert hm.runs_on_the_cpu() is (installed is None)


def test_jaxformer_train_restarts_before_anything_else(monkeypatch):
    """The console script is ``cli.run`` (as ``python -m jaxformer.cli``), which restarts ``train`` before ``main``."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"jaxformer": "jaxformer.cli:run"}
    for command, expected in ((["train", "cfg.yaml"], ["restart", "main"]), (["serve", "RUN"], ["main"])):
        calls = []
        monkeypatch.setattr(sys, "argv", ["jaxformer", *command])
        monkeypatch.setattr(hm, "restart_with_huge_pages", lambda: calls.append("restart"))
        monkeypatch.setattr(cli, "main", lambda: calls.append("main") or 0)
        with pytest.raises(SystemExit) as e:
            cli.run()
        assert e.value.code == 0 and calls == expected, command  # train only: the command measured with it
