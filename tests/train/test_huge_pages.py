"""``restart_with_huge_pages``: glibc's malloc asks for transparent huge pages on the memory it maps, so the
temporary buffer an XLA CPU program maps afresh at every call faults in 2 MiB pages, not 4 KiB ones
(experiments/results/train_throughput.md: a CPU train step 1.2-1.3x faster); the ``jaxformer`` command restarts
itself that way first thing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

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
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hm.OPT_OUT)}
    return {**env, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO), **extra}


def probe(**env) -> dict:
    proc = subprocess.Popen([sys.executable, "-c", PROBE], env=clean_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return {**json.loads(out.strip().splitlines()[-1]), "started_as": proc.pid}


def test_huge_pages_fault_in_the_temporary_buffer_in_far_fewer_pages(monkeypatch):
    """Counted work, not time: page faults per call against the temporary buffer's 4 KiB pages (24,414).
    glibc's defaults fault in (nearly) every one of them at every call; with huge pages, under a twentieth
    (2 MiB pages: a 512th, plus what the kernel could not give as huge pages)."""
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv(hm.OPT_OUT, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    if (why := hm.huge_pages_would_help()) is not None:
        pytest.skip(f"no restart with huge pages on this machine: {why}")
    default, huge = probe(**{hm.OPT_OUT: "0"}), probe()
    assert default["tunables"] is None and huge["tunables"] == hm.TUNABLE
    assert huge["pid"] == huge["started_as"]  # started again in place (exec), not a child
    assert huge["temp_pages"] >= 24_000, huge  # the product is a temporary of its own, as in a train step
    if default["faults"] < default["temp_pages"] / 2:
        pytest.skip(f"glibc's defaults fault in only {default['faults']:.0f} of {default['temp_pages']} pages a "
                    "call here (the kernel's huge pages for every mapping?): nothing for the tunable to save")
    assert huge["faults"] < huge["temp_pages"] / 20, (default, huge)


@pytest.fixture
def execs(monkeypatch):
    """``os.execv`` recorded, not run; the environment as the restart would find it in a CPU-only process."""
    calls = []
    monkeypatch.setattr(os, "execv", lambda path, argv: calls.append((path, list(argv), os.environ.get(
        "GLIBC_TUNABLES"))))
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv(hm.OPT_OUT, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setattr(hm, "glibc_version", lambda: (2, 36))
    monkeypatch.setattr(hm, "THP", type("T", (), {"read_text": lambda self: "always [madvise] never\n"})())
    return calls


def test_the_restart_runs_the_same_command_with_the_tunable_added(execs, monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=4")
    hm.restart_with_huge_pages()
    assert execs == [(sys.executable, sys.orig_argv, f"glibc.malloc.arena_max=4:{hm.TUNABLE}")]


@pytest.mark.parametrize("case", ["opted out", "set already", "not glibc", "old glibc", "THP never", "no THP",
                                  "accelerator"])
def test_no_restart_where_huge_pages_would_not_help(execs, monkeypatch, case):
    if case == "opted out":
        monkeypatch.setenv(hm.OPT_OUT, "0")
    elif case == "set already":
        monkeypatch.setenv("GLIBC_TUNABLES", f"glibc.malloc.arena_max=4:{hm.TUNABLE}")
    elif case in ("not glibc", "old glibc"):
        monkeypatch.setattr(hm, "glibc_version", lambda: None if case == "not glibc" else (2, 34))
    elif case == "THP never":
        monkeypatch.setattr(hm, "THP", type("T", (), {"read_text": lambda self: "always madvise [never]\n"})())
    elif case == "no THP":
        monkeypatch.setattr(hm, "THP", Path("/nonexistent/transparent_hugepage/enabled"))
    else:
        monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert hm.huge_pages_would_help() is not None
    hm.restart_with_huge_pages()
    assert execs == []


@pytest.mark.parametrize("platforms,cpu", [("cpu", True), ("cpu,cuda", True), ("cuda", False), ("tpu,cpu", False)])
def test_only_a_process_whose_jax_runs_on_the_cpu(monkeypatch, platforms, cpu):
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    assert hm.runs_on_the_cpu() is cpu


def test_the_jaxformer_command_restarts_before_anything_else(monkeypatch):
    """The console script is ``cli.run`` (as ``python -m jaxformer.cli``), which restarts before ``main``."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"jaxformer": "jaxformer.cli:run"}
    calls = []
    monkeypatch.setattr(hm, "restart_with_huge_pages", lambda: calls.append("restart"))
    monkeypatch.setattr(cli, "main", lambda: calls.append("main") or 0)
    with pytest.raises(SystemExit) as e:
        cli.run()
    assert e.value.code == 0 and calls == ["restart", "main"]
