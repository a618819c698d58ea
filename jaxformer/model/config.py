"""ModelConfig: one frozen, validated description of a Transformer.

Fields left ``None`` are derived (see the ``resolved_*`` properties), so a
preset overridden with a new ``d_model`` re-derives ``head_dim`` and ``d_ff``.
Unknown keys raise (``extra="forbid"``); every validation error is a
``ValueError`` (pydantic's ``ValidationError``) naming the field and values.

Sparse self-attention (Longformer, BigBird): ``attention_window`` is the local
band ``(left, right)`` (combined with ``causal`` in a decoder), widened by
``global_tokens`` (absolute positions in each row) and ``random_blocks``; see
:class:`jaxformer.ops.masks.MaskSpec`. Cross-attention is never sparse. A decoder
whose only pattern is the band is a sliding window (Mistral, Qwen2) of
``causal_window`` positions, which KV caches apply; global tokens and random
blocks refuse a cache.

``lora`` (:class:`LoRAConfig`) adds low-rank adapters to the self-attention and MLP projections of
every block (:mod:`jaxformer.nn.lora`); the base model is the same config with ``lora=None``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jaxformer.ops.activations import ACTIVATIONS, ffn_hidden_size, is_gated
from jaxformer.ops.masks import MaskSpec, RandomBlocks
from jaxformer.ops.positional import RopeScaling

Dtype = Literal["float32", "bfloat16", "float16"]


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


LORA_TARGETS = ("w_q", "w_k", "w_v", "w_o", "w_gate", "w_up", "w_down", "w_in", "w_out")
"""The projections LoRA can adapt, by their kernels' names: attention's W_q, W_k, W_v, W_o; a gated
MLP's W_gate, W_up, W_down; a plain MLP's W_in, W_out."""


class LoRAConfig(BaseModel):
    """Low-rank adapters (Hu et al. 2021) as ``peft`` defines them: rank R, scale ``alpha / R``
    (``rslora``: ``alpha / sqrt(R)``), dropout on the adapter's input, on ``targets`` (None: every
    projection of the model's self-attention and MLP, as Levanter and the QLoRA paper recommend)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0.0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    targets: tuple[str, ...] | None = Field(None, description=f"kernel names among {LORA_TARGETS}; None: all "
                                            "the model has")
    rslora: bool = Field(False, description="scale alpha / sqrt(rank) (Kalajdzievski 2023) instead of alpha / rank")

    @field_validator("targets")
    @classmethod
    def _check_targets(cls, v):
        if v is None:
            return v
        bad = [t for t in v if t not in LORA_TARGETS]
        if bad:
            raise ValueError(f"targets {bad} are not projections; known: {list(LORA_TARGETS)}")
        if not v:
            raise ValueError("targets is empty; leave it unset for every projection")
        if len(set(v)) != len(v):
            raise ValueError(f"targets {list(v)} repeat a projection")
        return tuple(v)

    @property
    def scale(self) -> float:
        """:func:`jaxformer.nn.lora.lora_scale`: ``alpha / rank`` (``rslora``: ``alpha / sqrt(rank)``)."""
        from jaxformer.nn.lora import lora_scale

        return lora_scale(self.alpha, self.rank, self.rslora)


class ModelConfig(BaseModel):
    """A Transformer: decoder-only LM, bidirectional encoder (MLM head), or encoder-decoder."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["decoder", "encoder", "encoder_decoder"] = "decoder"
    vocab_size: int = Field(256, gt=0)
    d_model: int = Field(256, gt=0)
    n_layers: int = Field(4, gt=0, description="decoder-only / encoder-only stack; the decoder of an enc-dec")
    n_encoder_layers: int | None = Field(None, description="encoder_decoder only")
    n_heads: int = Field(4, gt=0)
    n_kv_heads: int | None = Field(None, description="None: n_heads (MHA); fewer: GQA; 1: MQA")
    head_dim: int | None = Field(None, description="None: d_model // n_heads")
    d_ff: int | None = Field(None, description="None: ffn_hidden_size(d_model, activation, ffn_multiple_of)")
    activation: str = "gelu"
    ffn_multiple_of: int = Field(1, gt=0)
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_position: Literal["post", "pre", "deepnorm"] = "pre"
    sandwich_norm: bool = False
    norm_eps: float = Field(1e-5, gt=0.0)
    final_norm: bool | None = Field(None, description="None: True for pre-norm, False otherwise")
    embed_norm: bool = Field(False, description="a norm right after the token embedding (BLOOM)")
    residual: bool = Field(True, description="False drops every sublayer's identity path x + (the residuals study)")
    position: Literal["rope", "alibi", "sinusoidal", "learned", "none"] = "rope"
    rope_base: float = Field(10000.0, gt=1.0)
    rope_scaling: RopeScalingConfig | None = None
    rope_interleaved: bool = False
    sinusoidal_layout: Literal["interleaved", "halves"] = Field(
        "interleaved", description="position='sinusoidal' only: sin/cos interleaved (pe[2i] = sin, pe[2i+1] = cos; "
        "Vaswani) or in halves (pe[:D/2] = sin, pe[D/2:] = cos; tensor2tensor, fairseq, Marian)")
    max_seq_len: int = Field(2048, gt=0)
    scale_embeddings: bool = Field(False, description="multiply token embeddings by sqrt(d_model) (Vaswani)")
    tie_embeddings: bool = True
    use_bias: bool = False
    qkv_bias: bool | None = Field(
        None, description="biases on the q/k/v projections (self- and cross-attention); None: follow use_bias. "
        "True with use_bias=False is Qwen2 (q/k/v biases only); the output projection follows use_bias")
    type_vocab_size: int = Field(
        0, ge=0, description="> 0: a token-type (segment) embedding table [type_vocab_size, D] added to the "
        "token embedding, before embed_norm (BERT); token_types default to 0")
    head_transform: bool = Field(
        False, description="BERT's MLM head transform before the output projection: norm(act(x W + b)), "
        "W [D, D] (b iff use_bias), act = activation (not gated), norm = norm with norm_eps")
    head_bias: bool = Field(
        False, description="a bias [V] added to the logits, tied or untied head (BERT's cls.predictions.bias, "
        "Marian's final_logits_bias)")
    attention_impl: Literal["auto", "xla", "blockwise", "pallas", "sparse"] = "auto"
    attention_window: tuple[int | None, int | None] | None = Field(
        None, description="self-attention band (left, right); None side: unbounded. A decoder band (W-1, right) "
        "with no global_tokens / random_blocks is a sliding window of W (each token sees itself and the W-1 "
        "before it; HF Mistral's sliding_window=W) and works with KV caches")
    global_tokens: tuple[int, ...] = Field((), description="Longformer global positions (needs attention_window)")
    random_blocks: RandomBlocksConfig | None = Field(
        None, description="BigBird random blocks (needs attention_window)")
    attn_softcap: float | None = Field(None, gt=0.0)
    attn_scale: float | None = Field(None, gt=0.0, description="attention logit scale; None: 1/sqrt(head_dim). "
                                     "1.0 drops the scaling (the sqrt(d_k) study)")
    qkv_sharing: Literal["none", "qk", "qkv"] = Field(
        "none", description="self-attention projections: separate W_q, W_k, W_v ('none'); W_k = W_q "
        "(shared-QK, as in Reformer: 'qk'); W_k = W_v = W_q ('qkv'). Needs n_kv_heads = n_heads")
    logits_softcap: float | None = Field(None, gt=0.0)
    init_std: float = Field(0.02, gt=0.0)
    param_dtype: Dtype = "float32"
    compute_dtype: Dtype = "float32"
    remat: bool = False
    scan_layers: bool = False
    lora: LoRAConfig | None = Field(None, description="low-rank adapters on the projections (None: none)")

    @field_validator("activation")
    @classmethod
    def _check_activation(cls, v: str) -> str:
        if v not in ACTIVATIONS:
            raise ValueError(f"activation={v!r} is not one of {ACTIVATIONS}")
        return v

    @model_validator(mode="after")
    def _check(self):
        if self.kind == "encoder_decoder":
            if self.n_encoder_layers is None or self.n_encoder_layers <= 0:
                raise ValueError(
                    f"kind='encoder_decoder' needs n_encoder_layers > 0, got n_encoder_layers={self.n_encoder_layers}"
                )
        elif self.n_encoder_layers is not None:
            raise ValueError(
                f"n_encoder_layers={self.n_encoder_layers} only applies to kind='encoder_decoder' "
                f"(kind={self.kind!r} uses n_layers)"
            )
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} not divisible by n_heads={self.n_heads}; set head_dim explicitly"
            )
        if self.head_dim is not None and self.head_dim <= 0:
            raise ValueError(f"head_dim={self.head_dim} must be > 0")
        kv = self.resolved_kv_heads
        if kv <= 0 or self.n_heads % kv:
            raise ValueError(f"n_heads={self.n_heads} not divisible by n_kv_heads={self.n_kv_heads}")
        if self.position == "rope" and self.resolved_head_dim % 2:
            raise ValueError(f"position='rope' needs an even head dim, got head_dim={self.resolved_head_dim}")
        if self.position == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"position='sinusoidal' needs an even d_model, got d_model={self.d_model}")
        if self.rope_scaling is not None and self.position != "rope":
            raise ValueError(f"rope_scaling is set but position={self.position!r} (not 'rope')")
        if self.d_ff is not None and self.d_ff <= 0:
            raise ValueError(f"d_ff={self.d_ff} must be > 0")
        if self.qkv_sharing != "none" and kv != self.n_heads:
            raise ValueError(f"qkv_sharing={self.qkv_sharing!r} shares W_q with W_k, so it needs n_kv_heads = "
                             f"n_heads, got n_kv_heads={self.n_kv_heads} and n_heads={self.n_heads}")
        if self.sinusoidal_layout != "interleaved" and self.position != "sinusoidal":
            raise ValueError(f"sinusoidal_layout={self.sinusoidal_layout!r} is set but position={self.position!r} "
                             "(not 'sinusoidal')")
        if self.head_transform and self.gated:
            raise ValueError(f"head_transform needs a non-gated activation (act(x W + b)), got "
                             f"activation={self.activation!r}")
        if self.sandwich_norm and self.norm_position != "pre":
            raise ValueError(f"sandwich_norm needs norm_position='pre', got norm_position={self.norm_position!r}")
        self._check_sparse()
        if self.lora is not None and self.lora.targets is not None:
            have = self.projections
            missing = [t for t in self.lora.targets if t not in have]
            if missing:
                raise ValueError(f"lora.targets {missing}: this model's projections are {list(have)}")
        return self

    def _check_sparse(self) -> None:
        w = self.attention_window
        if w is not None and any(side is not None and side < 0 for side in w):
            raise ValueError(f"attention_window={w} sides must be >= 0 or None")
        bounded = w is not None and w != (None, None)
        for name in ("global_tokens", "random_blocks"):
            value = getattr(self, name)
            if value not in (None, ()) and not bounded:
                raise ValueError(f"{name}={value!r} needs a bounded attention_window (left, right), "
                                 f"got attention_window={w}: without a band the pattern changes nothing")
        bad = [p for p in self.global_tokens if not 0 <= p < self.max_seq_len]
        if bad:
            raise ValueError(f"global_tokens={self.global_tokens}: positions {bad} outside "
                             f"[0, max_seq_len={self.max_seq_len})")
        if len(set(self.global_tokens)) != len(self.global_tokens):
            raise ValueError(f"global_tokens={self.global_tokens} has repeated positions")

    # -- derived values
    @property
    def resolved_head_dim(self) -> int:
        """H: ``head_dim`` or ``d_model // n_heads``."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def resolved_kv_heads(self) -> int:
        """K: ``n_kv_heads`` or ``n_heads``."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def resolved_d_ff(self) -> int:
        """F: ``d_ff`` or ``ffn_hidden_size(d_model, activation, ffn_multiple_of)``."""
        if self.d_ff is not None:
            return self.d_ff
        return ffn_hidden_size(self.d_model, self.activation, self.ffn_multiple_of)

    @property
    def resolved_final_norm(self) -> bool:
        """Whether a norm follows the last block: ``final_norm`` or (pre-norm only) True."""
        return self.final_norm if self.final_norm is not None else self.norm_position == "pre"

    @property
    def resolved_qkv_bias(self) -> bool:
        """Whether the q/k/v projections have biases: ``qkv_bias`` or ``use_bias``."""
        return self.use_bias if self.qkv_bias is None else self.qkv_bias

    @property
    def projections(self) -> tuple[str, ...]:
        """The kernels of a block's self-attention and MLP (what LoRA may target), in :data:`LORA_TARGETS`
        order."""
        out = ["w_q", "w_k", "w_v", "w_o"]
        if self.qkv_sharing != "none":
            out.remove("w_k")
        if self.qkv_sharing == "qkv":
            out.remove("w_v")
        return tuple(out + (["w_gate", "w_up", "w_down"] if self.gated else ["w_in", "w_out"]))

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """The projections adapted: ``lora.targets`` (in :data:`LORA_TARGETS` order), every projection when
        it is None, none without ``lora``."""
        if self.lora is None:
            return ()
        chosen = self.projections if self.lora.targets is None else self.lora.targets
        return tuple(t for t in LORA_TARGETS if t in chosen)

    @property
    def base(self) -> ModelConfig:
        """This model without its adapters (``lora=None``)."""
        return self if self.lora is None else self.model_copy(update=dict(lora=None))

    @property
    def gated(self) -> bool:
        return is_gated(self.activation)

    @property
    def n_decoder_layers(self) -> int:
        """Layers with causal self-attention (0 for an encoder)."""
        return 0 if self.kind == "encoder" else self.n_layers

    @property
    def n_encoder_stack_layers(self) -> int:
        """Layers with bidirectional self-attention (0 for a decoder-only model)."""
        if self.kind == "encoder":
            return self.n_layers
        return self.n_encoder_layers or 0

    @property
    def sparse_attention(self) -> bool:
        """True when self-attention has a band or a pattern."""
        return self.attention_window is not None and self.attention_window != (None, None)

    @property
    def causal_window(self) -> int | None:
        """W, the sliding window of causal self-attention: ``attention_window[0] + 1`` (each query sees
        itself and the W - 1 keys before it; the right side is moot under causality), or None when the
        band's left side is unbounded or there is no band. A KV cache of a decoder applies it
        (``KVCache.window``, ``PagedKVCache.window``, the engine's ``window``)."""
        w = self.attention_window
        return None if w is None or w[0] is None else w[0] + 1

    def self_attention_mask(self, *, causal: bool, segment_ids=None, lengths=None) -> MaskSpec:
        """The self-attention :class:`MaskSpec`: causal/segments/lengths plus the sparse pattern."""
        return MaskSpec(
            causal=causal, window=self.attention_window if self.sparse_attention else None,
            q_segment_ids=segment_ids, kv_lengths=lengths, global_tokens=self.global_tokens or None,
            random_blocks=None if self.random_blocks is None else self.random_blocks.to_ops(self.n_heads),
        )

    @property
    def rope(self) -> RopeScaling | None:
        return None if self.rope_scaling is None else self.rope_scaling.to_ops()
