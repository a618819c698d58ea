"""Strict JAX for every test: rank promotion raises, 8 fake CPU devices, fast CPU compiles.

Device count must be fixed before any backend initialises, so this runs at import.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile many tiny programs, and XLA's backend compile is most of the suite's time: cheap XLA CPU
# optimisation halves it, and XLA's older (LLVM IR) fusion emitters compile about twice as fast again as the
# default MLIR ones (tests/nn + tests/model: backend compile 49 s -> 23 s for the same 476 programs, on an
# AMD EPYC Zen 3). Neither changes a result beyond float rounding (every tolerance in the suite allows for that).
# JAXFORMER_FAST_COMPILE=0 keeps XLA's default optimisation (tests/test_cpu_isa_matrix.py runs
# the gradient checks both ways).
_FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
                 " --xla_cpu_use_fusion_emitters=false")
if (os.environ.get("JAXFORMER_FAST_COMPILE", "1") != "0"
        and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST_COMPILE).strip()

# Shape annotations are checked at runtime under pytest only (the library has no checker dependency).
# jaxtyping's import hook wraps every function and dataclass of these packages in
# @jaxtyped(typechecker=beartype) as they are imported, so an annotation such as
# Float[Array, "B T N H"] is enforced on each call and its letters agree across arguments (a wrong
# rank, dtype kind or mismatched dim raises jaxtyping.TypeCheckError at the call). It must be installed
# before anything imports them, hence here. pep484 tower: an int is accepted where a float is
# annotated, as every static type checker reads `float`. JAXFORMER_TYPECHECK=0 switches it off.
TYPECHECKED = ("jaxformer.ops", "jaxformer.nn", "jaxformer.model", "jaxformer.typing", "pallas_kernels")
if os.environ.get("JAXFORMER_TYPECHECK", "1") != "0":
    from jaxtyping import install_import_hook

    install_import_hook(TYPECHECKED, "beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True))")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_enable_x64", False)

import pytest  # noqa: E402
from tests.bench_scripts import load_bench  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Property tests. "jaxformer" (the default, what CI runs) is reproducible: derandomize=True derives
# each test's seed from the test itself, so a red run is red again on any machine, and hypothesis
# prints the falsifying example. Compilation makes each example slow, so few examples are drawn;
# tests whose strategies have feature flags pin the all-features-on combinations with @example, so
# every mask feature, dtype and GQA ratio is reached whatever the draw. "nightly" draws many fresh
# random examples (run it with `HYPOTHESIS_PROFILE=nightly pytest -m ''`); its seed is printed on
# failure (print_blob) and `--hypothesis-seed=N` replays it.
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               print_blob=True)
settings.register_profile("jaxformer", max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "12")),
                          derandomize=True, **_COMMON)
settings.register_profile("nightly", max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "200")),
                          derandomize=False, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "jaxformer"))


@pytest.fixture(autouse=True)
def _no_typecheck(request):
    """``@pytest.mark.no_typecheck``: the test checks the library's own ValueError (what a caller without
    a checker gets), which a shape annotation would otherwise pre-empt with a TypeCheckError."""
    if request.node.get_closest_marker("no_typecheck") is None:
        yield
        return
    import jaxtyping

    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


# Every program a test process compiles keeps its machine code in memory mappings of its own (three a kernel), and
# JAX keeps the programs: one xdist worker of the default run held 41,381 mappings at its peak, against Linux's
# limit of 65,530 a process (vm.max_map_count), past which LLVM aborts the process mid-compile (the LoRA study's
# slow test did: experiments/results/sweep_memory.md). Past MAPPINGS_CLEARED_ABOVE, a module's end drops JAX's
# compiled programs (the next module compiles what it uses again; below it nothing is dropped, nothing recompiles).
MAPPINGS_CLEARED_ABOVE = 20_000


_procmem = load_bench("procmem")


def _mappings() -> int:
    try:
        return _procmem.proc_maps()
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True, scope="module")
def _bounded_compiled_programs():
    yield
    if _mappings() > MAPPINGS_CLEARED_ABOVE:
        jax.clear_caches()


def _xla_cpu_converts_fp16() -> bool:
    """XLA's CPU JIT converts float16 with F16C instructions; without them (an x86 CPU that lacks F16C, a
    virtual machine that hides it, or ``--xla_cpu_max_isa=SSE4_2``) it calls compiler-rt's
    ``__extendhfsf2`` / ``__truncsfhf2``, which jaxlib 0.10 does not link: "Symbols not found"
    (openxla/xla#6787). Nothing of ours can run float16 there, so those tests are skipped, not failed."""
    import platform
    import re

    cap = re.search(r"--xla_cpu_max_isa=(\S+)", os.environ.get("XLA_FLAGS", ""))
    if cap and cap.group(1).upper().startswith("SSE"):
        return False
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    try:
        with open("/proc/cpuinfo") as f:
            return " f16c" in f.read()
    except OSError:
        return True


def pytest_collection_modifyitems(config, items):
    import pytest

    if _xla_cpu_converts_fp16():
        return
    skip = pytest.mark.skip(reason="XLA's CPU JIT cannot convert float16 without F16C (openxla/xla#6787)")
    for item in items:
        if "fp16" in item.keywords:
            item.add_marker(skip)


class _WholeFiles:
    """``-n``'s default distribution sends a file's tests to both workers, so each compiles the programs the
    file's tests share and runs its module fixtures (the sweep, the trained runs, the servers) once more; whole
    files per worker did the same tests in 5% less CPU time and 9% less wall time (tests/ops, tests/nn,
    tests/model on 2 Zen 3 cores: 250 s of CPU against 264, 144 s against 159). An explicit ``--dist`` wins."""

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        args = config.invocation_params.args
        if config.getvalue("dist") != "load" or any(str(a).startswith(("--dist", "-d")) for a in args):
            return None
        from xdist.scheduler import LoadFileScheduling

        return LoadFileScheduling(config, log)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):  # its hook exists only with xdist (not under -p no:xdist)
        config.pluginmanager.register(_WholeFiles(), "jaxformer-whole-files")
