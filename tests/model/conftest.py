"""Shared model fixtures: one eager init per tiny preset and one jitted apply for the whole session.

Eager init reuses compiled ops across presets (they share shapes), which is far cheaper
on CPU than compiling a jitted init per model; ``rbg`` keys compile faster than threefry.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxformer.model import Transformer, apply, init, presets

TINY = ("gpt2_tiny", "llama_tiny", "bloom_tiny", "vaswani_tiny")
B, T = 2, 8


def key(seed: int = 0):
    return jax.random.key(seed, impl="rbg")


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


def random_model(cfg, seed: int, std: float = 0.2):
    """A Transformer for ``cfg`` with numpy-drawn parameters (norm scales ~ 1 + N(0, 0.1^2),
    everything else N(0, std^2)): no compilation spent on init."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg)))
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        x = rng.standard_normal(leaf.shape)
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        x = 1.0 + 0.1 * x if "scale" in names else std * x
        return jnp.asarray(x, leaf.dtype)

    return graphdef, jax.tree_util.tree_map_with_path(fill, state)


def tokens(seed: int, shape=(B, T), vocab: int = 256):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)
