"""Shared model fixtures: one eager init per tiny preset and one jitted apply for the whole session.

Eager init reuses compiled ops across presets (they share shapes), which is far cheaper
on CPU than compiling a jitted init per model.
"""

import jax
import pytest

from jaxformer.model import apply, init, presets

from .helpers import TINY, key


@pytest.fixture(scope="session")
def tiny_models():
    """preset name -> (config, graphdef, state) from ``init`` (eager)."""
    out = {}
    for name in TINY:
        cfg = presets.get(name)
        out[name] = (cfg, *init(cfg, key(0)))
    return out


@pytest.fixture(scope="session")
def japply():
    """``jax.jit(apply)`` shared by every test so identical shapes compile once."""
    return jax.jit(apply, static_argnums=0)
