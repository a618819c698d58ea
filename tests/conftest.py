"""Strict JAX for every test: rank promotion raises, 8 fake CPU devices, fast CPU compiles.

Device count must be fixed before any backend initialises, so this runs at import.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile many tiny programs: cheap XLA CPU optimisation halves the suite's time and
# changes no result beyond float rounding (every tolerance in the suite allows for that).
# JAXFORMER_FAST_COMPILE=0 keeps XLA's default optimisation (tests/test_cpu_isa_matrix.py runs
# the gradient checks both ways).
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if (os.environ.get("JAXFORMER_FAST_COMPILE", "1") != "0"
        and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST_COMPILE).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_enable_x64", False)

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
