"""The settings each NNX module is built from, as frozen, validated sections of ModelConfig.

:class:`AttentionConfig` (:class:`jaxformer.nn.Attention`), :class:`PositionConfig` (what attention and
the embeddings do with positions), :class:`FFNConfig` (:func:`jaxformer.nn.make_mlp`),
:class:`NormConfig` (the residual sublayers' norms), :class:`SparsityConfig` (self-attention's sparse
pattern). :class:`jaxformer.model.ModelConfig` holds one of each; a module takes only its own.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jaxformer.ops.activations import ACTIVATIONS, ffn_hidden_size, is_gated
from jaxformer.ops.masks import RandomBlocks
from jaxformer.ops.positional import RopeScaling


class RopeScalingConfig(BaseModel):
    """Serialisable mirror of :class:`jaxformer.ops.positional.RopeScaling`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["linear", "ntk", "llama3", "yarn"]
    factor: float = Field(ge=1.0)
    original_max_position: int = Field(2048, gt=0)
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None

    @model_validator(mode="after")
    def _check(self):
        self.to_ops()
        return self

    def to_ops(self) -> RopeScaling:
        return RopeScaling(**self.model_dump())


class RandomBlocksConfig(BaseModel):
    """BigBird random attention (serialisable mirror of :class:`jaxformer.ops.masks.RandomBlocks`).

    Each query block of ``block_size`` positions also sees ``num_blocks`` key
    blocks drawn from ``seed``: one pattern for all heads, or one per query head
    when ``per_head``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_blocks: int = Field(ge=0)
    block_size: int = Field(gt=0)
    seed: int = Field(0, ge=0)
    per_head: bool = False

    def to_ops(self, n_heads: int) -> RandomBlocks:
        return RandomBlocks(self.num_blocks, self.block_size, self.seed,
                            num_heads=n_heads if self.per_head else None)


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


AttentionImpl = Literal["auto", "xla", "blockwise", "pallas", "sparse"]


class AttentionConfig(_Section):
    """Multi-head attention (self and cross): N query heads over K key/value heads of width H."""

    n_heads: int = Field(4, gt=0)
    n_kv_heads: int | None = Field(None, description="None: n_heads (MHA); fewer: GQA; 1: MQA")
    head_dim: int | None = Field(None, gt=0, description="None: d_model // n_heads")
    scale: float | None = Field(None, gt=0.0, description="logit scale; None: 1/sqrt(head_dim). 1.0 drops the "
                                "scaling (the sqrt(d_k) study)")
    softcap: float | None = Field(None, gt=0.0, description="attention-logit soft cap: c * tanh(logits / c)")
    q_init_scale: float = Field(1.0, gt=0.0, description="W_q's init std is the model's times this (W_k's "
                                "unchanged). T5 folds the logit scale into W_q's init: scale 1.0 with "
                                "q_init_scale head_dim**-0.5 starts with the logits of the scaled attention")
    qkv_sharing: Literal["none", "qk", "qkv"] = Field(
        "none", description="self-attention projections: separate W_q, W_k, W_v ('none'); W_k = W_q "
        "(shared-QK, as in Reformer: 'qk'); W_k = W_v = W_q ('qkv'). Needs n_kv_heads = n_heads")
    qkv_bias: bool | None = Field(
        None, description="biases on the q/k/v projections (self- and cross-attention); None: follow the "
        "model's use_bias. True with use_bias=False is Qwen2 (q/k/v biases only); the output projection "
        "follows use_bias")
    impl: AttentionImpl = Field("auto", description="dot_product_attention's backend")

    @model_validator(mode="after")
    def _check(self):
        kv = self.resolved_kv_heads
        if kv <= 0 or self.n_heads % kv:
            raise ValueError(f"n_heads={self.n_heads} not divisible by n_kv_heads={self.n_kv_heads}")
        if self.qkv_sharing != "none" and kv != self.n_heads:
            raise ValueError(f"qkv_sharing={self.qkv_sharing!r} shares W_q with W_k, so it needs n_kv_heads = "
                             f"n_heads, got n_kv_heads={self.n_kv_heads} and n_heads={self.n_heads}")
        return self

    @property
    def resolved_kv_heads(self) -> int:
        """K: ``n_kv_heads`` or ``n_heads``."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    def resolved_head_dim(self, d_model: int) -> int:
        """H: ``head_dim`` or ``d_model // n_heads``."""
        return self.head_dim if self.head_dim is not None else d_model // self.n_heads


class PositionConfig(_Section):
    """Where positions enter: RoPE or ALiBi inside attention, sinusoidal or learned tables on the embeddings."""

    kind: Literal["rope", "alibi", "sinusoidal", "learned", "none"] = "rope"
    rope_base: float = Field(10000.0, gt=1.0)
    rope_scaling: RopeScalingConfig | None = None
    rope_interleaved: bool = False
    sinusoidal_layout: Literal["interleaved", "halves"] = Field(
        "interleaved", description="kind='sinusoidal' only: sin/cos interleaved (pe[2i] = sin, pe[2i+1] = cos; "
        "Vaswani) or in halves (pe[:D/2] = sin, pe[D/2:] = cos; tensor2tensor, fairseq, Marian)")

    @model_validator(mode="after")
    def _check(self):
        if self.rope_scaling is not None and self.kind != "rope":
            raise ValueError(f"rope_scaling is set but kind={self.kind!r} (not 'rope')")
        if self.sinusoidal_layout != "interleaved" and self.kind != "sinusoidal":
            raise ValueError(f"sinusoidal_layout={self.sinusoidal_layout!r} is set but kind={self.kind!r} "
                             "(not 'sinusoidal')")
        return self

    @property
    def in_attention(self) -> str:
        """What self-attention does with positions: ``"rope"``, ``"alibi"`` or ``"none"`` (sinusoidal and
        learned positions are added to the embeddings)."""
        return self.kind if self.kind in ("rope", "alibi") else "none"

    @property
    def rope(self) -> RopeScaling | None:
        """``rope_scaling`` as :class:`jaxformer.ops.positional.RopeScaling` (None: unscaled)."""
        return None if self.rope_scaling is None else self.rope_scaling.to_ops()


class FFNConfig(_Section):
    """The position-wise feed-forward network: plain ``act(x W_in) W_out`` or gated (GLU variants)."""

    activation: str = "gelu"
    d_ff: int | None = Field(None, gt=0, description="None: ffn_hidden_size(d_model, activation, multiple_of)")
    multiple_of: int = Field(1, gt=0, description="the derived width is rounded up to a multiple of this")

    @field_validator("activation")
    @classmethod
    def _check_activation(cls, v: str) -> str:
        if v not in ACTIVATIONS:
            raise ValueError(f"activation={v!r} is not one of {ACTIVATIONS}")
        return v

    @property
    def gated(self) -> bool:
        return is_gated(self.activation)

    def width(self, d_model: int) -> int:
        """F: ``d_ff`` or ``ffn_hidden_size(d_model, activation, multiple_of)``."""
        return self.d_ff if self.d_ff is not None else ffn_hidden_size(d_model, self.activation, self.multiple_of)


class NormConfig(_Section):
    """Which norm, where the residual sublayers put it, and the optional extra norms."""

    kind: Literal["layernorm", "rmsnorm"] = "layernorm"
    placement: Literal["post", "pre", "deepnorm"] = "pre"
    eps: float = Field(1e-5, gt=0.0)
    sandwich: bool = Field(False, description="a second norm on each branch's output (pre-norm only)")
    final: bool | None = Field(None, description="a norm after the last block; None: True for pre-norm only")
    embed: bool = Field(False, description="a norm right after the token embedding (BLOOM)")

    @model_validator(mode="after")
    def _check(self):
        if self.sandwich and self.placement != "pre":
            raise ValueError(f"sandwich needs placement='pre', got placement={self.placement!r}")
        return self

    @property
    def resolved_final(self) -> bool:
        """Whether a norm follows the last block: ``final`` or (pre-norm only) True."""
        return self.final if self.final is not None else self.placement == "pre"


class SparsityConfig(_Section):
    """Sparse self-attention (Longformer, BigBird): a band, widened by global tokens and random blocks.

    A decoder band ``(W-1, right)`` with no global tokens and no random blocks is a sliding window of W
    (each token sees itself and the W-1 before it; HF Mistral's ``sliding_window=W``) and works with KV
    caches. Cross-attention is never sparse.
    """

    window: tuple[int | None, int | None] | None = Field(
        None, description="self-attention band (left, right); None side: unbounded")
    global_tokens: tuple[int, ...] = Field((), description="Longformer global positions (needs a window)")
    random_blocks: RandomBlocksConfig | None = Field(None, description="BigBird random blocks (needs a window)")

    @model_validator(mode="after")
    def _check(self):
        w = self.window
        if w is not None and any(side is not None and side < 0 for side in w):
            raise ValueError(f"window={w} sides must be >= 0 or None")
        for name in ("global_tokens", "random_blocks"):
            value = getattr(self, name)
            if value not in (None, ()) and not self.banded:
                raise ValueError(f"{name}={value!r} needs a bounded window (left, right), got window={w}: "
                                 "without a band the pattern changes nothing")
        if len(set(self.global_tokens)) != len(self.global_tokens):
            raise ValueError(f"global_tokens={self.global_tokens} has repeated positions")
        return self

    @property
    def banded(self) -> bool:
        """True when self-attention has a band (and so possibly a pattern)."""
        return self.window is not None and self.window != (None, None)

    @property
    def causal_window(self) -> int | None:
        """W, the sliding window of causal self-attention: ``window[0] + 1`` (each query sees itself and the
        W - 1 keys before it; the right side is moot under causality), or None when the band's left side is
        unbounded or there is no band. A KV cache of a decoder applies it (``KVCache.window``,
        ``PagedKVCache.window``, the engine's ``window``)."""
        w = self.window
        return None if w is None or w[0] is None else w[0] + 1
