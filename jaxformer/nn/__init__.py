"""Flax NNX modules: they own parameters (tagged with logical axes) and call ``jaxformer.ops``."""

from jaxformer.nn.attention import Attention, AttentionInit, KVCacheLayer
from jaxformer.nn.config import AttentionConfig, FFNConfig, NormConfig, PositionConfig, SparsityConfig
from jaxformer.nn.block import NORM_POSITIONS, Block, Residual
from jaxformer.nn.embedding import Embed, HeadTransform, LearnedPositions, LMHead
from jaxformer.nn.mlp import MLP, GatedMLP, make_mlp
from jaxformer.nn.norms import NORMS, LayerNorm, RMSNorm, make_norm
from jaxformer.nn.params import LOGICAL_AXES, as_dtype, param

__all__ = [
    "LOGICAL_AXES", "NORMS", "NORM_POSITIONS", "Attention", "AttentionConfig", "AttentionInit", "Block", "FFNConfig",
    "NormConfig", "PositionConfig", "SparsityConfig", "Embed", "GatedMLP",
    "HeadTransform", "KVCacheLayer", "LMHead", "LayerNorm", "LearnedPositions", "MLP", "RMSNorm", "Residual",
    "as_dtype", "make_mlp", "make_norm", "param",
]
