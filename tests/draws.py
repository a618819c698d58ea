"""How many examples a property test that compiles a program per draw takes from the hypothesis profile."""

from __future__ import annotations

from hypothesis import settings

DEFAULT_PROFILE_EXAMPLES = 12
"""The "jaxformer" profile's examples (tests/conftest.py): the default run, and CI."""


def few_draws() -> settings:
    """One draw in the default run (and in tests/test_cpu_isa_matrix.py's one-example cells), a quarter of a larger
    profile's (50 of the nightly 200): for tests whose pinned ``@example``s turn every feature on, so the default
    run's coverage does not hang on the draws. Read when the test module is imported (the profile is loaded by then)."""
    n = settings.default.max_examples
    return settings(max_examples=1 if n <= DEFAULT_PROFILE_EXAMPLES else n // 4)
