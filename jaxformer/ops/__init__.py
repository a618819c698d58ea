"""Pure functions: jax / jnp only, no parameters held, no flax."""

from jaxformer.ops.activations import (
    ACTIVATIONS,
    activation_fn,
    ffn_hidden_size,
    geglu,
    gelu,
    is_gated,
    relu,
    silu,
    swiglu,
    swish,
)
from jaxformer.ops.attention import dot_product_attention, xla_attention
from jaxformer.ops.blockwise import blockwise_attention
from jaxformer.ops.losses import cross_entropy
from jaxformer.ops.masks import MaskSpec, RandomBlocks
from jaxformer.ops.normalization import DeepNormConstants, deepnorm_constants, layer_norm, rms_norm
from jaxformer.ops.positional import (
    RopeScaling,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    rope_frequencies,
    sinusoidal_positions,
)
from jaxformer.ops.sparse import sparse_attention

__all__ = [
    "ACTIVATIONS",
    "DeepNormConstants",
    "MaskSpec",
    "RandomBlocks",
    "RopeScaling",
    "activation_fn",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "blockwise_attention",
    "cross_entropy",
    "deepnorm_constants",
    "dot_product_attention",
    "ffn_hidden_size",
    "geglu",
    "gelu",
    "is_gated",
    "layer_norm",
    "relu",
    "rms_norm",
    "rope_frequencies",
    "silu",
    "sinusoidal_positions",
    "sparse_attention",
    "swiglu",
    "swish",
    "xla_attention",
]
