"""ModelConfig, the Transformer (decoder-only, encoder, encoder-decoder), presets and sizing helpers."""

from jaxformer.model import presets
from jaxformer.model.config import (
    AttentionConfig,
    FFNConfig,
    HFOptions,
    LoRAConfig,
    ModelConfig,
    NormConfig,
    PositionConfig,
    RandomBlocksConfig,
    RopeScalingConfig,
    SparsityConfig,
)
from jaxformer.model.counting import count_params, flops_per_token, lora_params, matmul_params
from jaxformer.model.functional import abstract_init, apply, init
from jaxformer.model.layout import per_layer_config, scanned_config, stack_layers, unstack_layers
from jaxformer.model.transformer import DecoderLM, Encoder, EncoderDecoder, Transformer

__all__ = [
    "AttentionConfig", "DecoderLM", "Encoder", "EncoderDecoder", "FFNConfig", "HFOptions", "LoRAConfig", "ModelConfig",
    "NormConfig", "PositionConfig", "RandomBlocksConfig", "RopeScalingConfig", "SparsityConfig", "Transformer",
    "abstract_init", "apply",
    "count_params", "flops_per_token", "init", "lora_params", "matmul_params", "per_layer_config", "presets",
    "scanned_config", "stack_layers", "unstack_layers",
]
