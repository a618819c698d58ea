"""Functional API: ``init(config, key) -> (graphdef, state)``, ``apply(graphdef, state, tokens, ...)``.

Both trace cleanly, so they work inside ``jax.jit``; the graphdef is static
(hashable), e.g. ``jax.jit(apply, static_argnums=0)`` or close over it::

    graphdef, state = init(cfg, jax.random.key(0))
    state = jax.jit(lambda k: init(cfg, k)[1])(key)        # compiled init
    logits = jax.jit(apply, static_argnums=0)(graphdef, state, tokens)
"""

from __future__ import annotations

from collections.abc import Mapping

from flax import nnx
from jaxtyping import Array, Float

from jaxformer.model.config import ModelConfig
from jaxformer.model.transformer import Transformer
from jaxformer.typing import AnyTokens, PRNGKey


def init(config: ModelConfig, key: PRNGKey) -> tuple[nnx.GraphDef, Mapping]:
    """Build the model's parameters from ``key``; returns ``(graphdef, state)``."""
    return nnx.split(Transformer(config, rngs=nnx.Rngs(params=key)))


def abstract_init(config: ModelConfig) -> tuple[nnx.GraphDef, Mapping]:
    """``(graphdef, state)`` with ``jax.ShapeDtypeStruct`` leaves; nothing is allocated."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))


def apply(graphdef: nnx.GraphDef, state: Mapping, tokens: AnyTokens, *args,
          **kwargs) -> Float[Array, "B _ V"] | tuple[Float[Array, "B _ V"], list]:
    """``Transformer.__call__`` on ``nnx.merge(graphdef, state)``; same arguments and results."""
    return nnx.merge(graphdef, state)(tokens, *args, **kwargs)
