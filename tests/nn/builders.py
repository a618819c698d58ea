"""The nn modules built from the few numbers a test varies: each packs them into the module's config
section (:class:`jaxformer.nn.AttentionConfig`, :class:`jaxformer.nn.FFNConfig`, ...), as
:func:`jaxformer.model.stack.make_block` does from a ModelConfig."""

from __future__ import annotations

from jaxformer.nn import Attention, AttentionConfig, AttentionInit, FFNConfig, GatedMLP, PositionConfig, make_mlp


def attention(d_model, n_heads, n_kv_heads=None, head_dim=None, *, position="none", scale=None, softcap=None,
              share="none", qkv_bias=None, impl="auto", use_bias=False, **kwargs) -> Attention:
    """``Attention(d_model, AttentionConfig(...), positions=PositionConfig(kind=position) or None,
    init=AttentionInit(bias=use_bias), **kwargs)``."""
    cfg = AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, scale=scale, softcap=softcap,
                          qkv_sharing=share, qkv_bias=qkv_bias, impl=impl)
    positions = None if position == "none" else PositionConfig(kind=position)
    return Attention(d_model, cfg, positions=positions, init=AttentionInit(bias=use_bias), **kwargs)


def mlp(d_model, d_ff, activation, **kwargs):
    """``make_mlp(d_model, FFNConfig(activation=activation, d_ff=d_ff), **kwargs)``."""
    return make_mlp(d_model, FFNConfig(activation=activation, d_ff=d_ff), **kwargs)


def gated_mlp(d_model, d_ff, activation, **kwargs) -> GatedMLP:
    return GatedMLP(d_model, FFNConfig(activation=activation, d_ff=d_ff), **kwargs)
