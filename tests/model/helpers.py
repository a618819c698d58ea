"""Helpers shared by the model tests (fixtures live in conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer.model import Transformer

TINY = ("gpt2_tiny", "llama_tiny", "bloom_tiny", "vaswani_tiny")
B, T = 2, 8


def key(seed: int = 0):
    """An ``rbg`` key: the same init code path, cheaper to compile on CPU than threefry."""
    return jax.random.key(seed, impl="rbg")


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
