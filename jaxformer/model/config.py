"""ModelConfig: one frozen, validated description of a Transformer, in sections.

Top level: ``kind``, ``vocab_size``, ``d_model``, ``n_layers`` (``n_encoder_layers``), ``max_seq_len``,
the dtypes, tying, biases, scan/remat, ``lora``. Sections, each what one part of the model is built
from: ``attention`` (:class:`AttentionConfig`), ``positions`` (:class:`PositionConfig`), ``ffn``
(:class:`FFNConfig`), ``norm`` (:class:`NormConfig`), ``sparsity`` (:class:`SparsityConfig`),
``hf_options`` (:class:`HFOptions`: what only published checkpoints need). In YAML and overrides::

    model: {preset: llama_tiny, d_model: 128, attention: {n_heads: 4, n_kv_heads: 2}}
    jaxformer train exp.yaml model.attention.n_heads=8 model.norm.placement=post

Fields left ``None`` are derived (see the ``resolved_*`` properties), so a preset overridden with a
new ``d_model`` re-derives the head dim and the FFN width. Unknown keys raise (``extra="forbid"``);
every validation error is a ``ValueError`` (pydantic's ``ValidationError``) naming the field and values.
The flat keys of before the sections (``n_heads``, ``norm_position``, ``attention_window``, ...) are
still read everywhere a config is: :func:`migrate` moves each into its section (:data:`FLAT_KEYS`).

Sparse self-attention (Longformer, BigBird): ``sparsity.window`` is the local band ``(left, right)``
(combined with causality in a decoder), widened by ``sparsity.global_tokens`` (absolute positions in each
row) and ``sparsity.random_blocks``; see :class:`jaxformer.ops.masks.MaskSpec`. A decoder whose only
pattern is the band is a sliding window (Mistral, Qwen2) of ``sparsity.causal_window`` positions, which
KV caches apply; global tokens and random blocks refuse a cache.

``lora`` (:class:`LoRAConfig`) adds low-rank adapters to the self-attention and MLP projections of
every block (:mod:`jaxformer.nn.lora`); the base model is the same config with ``lora=None``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jaxformer.nn.config import (
    AttentionConfig,
    AttentionImpl,
    FFNConfig,
    NormConfig,
    PositionConfig,
    RandomBlocksConfig,
    RopeScalingConfig,
    SparsityConfig,
)
from jaxformer.ops.masks import MaskSpec

__all__ = ["AttentionConfig", "FFNConfig", "HFOptions", "LoRAConfig", "ModelConfig", "NormConfig", "PositionConfig",
           "RandomBlocksConfig", "RopeScalingConfig", "SparsityConfig", "FLAT_KEYS", "SECTIONS", "get_key", "merge",
           "migrate"]

Dtype = Literal["float32", "bfloat16", "float16"]


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


class HFOptions(BaseModel):
    """Options only published checkpoints need (BERT, Marian); all off by default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type_vocab_size: int = Field(
        0, ge=0, description="> 0: a token-type (segment) embedding table [type_vocab_size, D] added to the "
        "token embedding, before norm.embed (BERT); token_types default to 0")
    head_transform: bool = Field(
        False, description="BERT's MLM head transform before the output projection: norm(act(x W + b)), "
        "W [D, D] (b iff use_bias), act = ffn.activation (not gated), norm = norm.kind with norm.eps")
    head_bias: bool = Field(
        False, description="a bias [V] added to the logits, tied or untied head (BERT's cls.predictions.bias, "
        "Marian's final_logits_bias)")


SECTIONS: dict[str, type[BaseModel]] = {
    "attention": AttentionConfig, "positions": PositionConfig, "ffn": FFNConfig, "norm": NormConfig,
    "sparsity": SparsityConfig, "hf_options": HFOptions,
}
"""ModelConfig's sections by field name."""

FLAT_KEYS: dict[str, tuple[str, str]] = {
    "n_heads": ("attention", "n_heads"), "n_kv_heads": ("attention", "n_kv_heads"),
    "head_dim": ("attention", "head_dim"), "attn_scale": ("attention", "scale"),
    "attn_softcap": ("attention", "softcap"), "qkv_sharing": ("attention", "qkv_sharing"),
    "qkv_bias": ("attention", "qkv_bias"), "attention_impl": ("attention", "impl"),
    "position": ("positions", "kind"), "rope_base": ("positions", "rope_base"),
    "rope_scaling": ("positions", "rope_scaling"), "rope_interleaved": ("positions", "rope_interleaved"),
    "sinusoidal_layout": ("positions", "sinusoidal_layout"),
    "activation": ("ffn", "activation"), "d_ff": ("ffn", "d_ff"), "ffn_multiple_of": ("ffn", "multiple_of"),
    "norm": ("norm", "kind"), "norm_position": ("norm", "placement"), "norm_eps": ("norm", "eps"),
    "sandwich_norm": ("norm", "sandwich"), "final_norm": ("norm", "final"), "embed_norm": ("norm", "embed"),
    "attention_window": ("sparsity", "window"), "global_tokens": ("sparsity", "global_tokens"),
    "random_blocks": ("sparsity", "random_blocks"),
    "type_vocab_size": ("hf_options", "type_vocab_size"), "head_transform": ("hf_options", "head_transform"),
    "head_bias": ("hf_options", "head_bias"),
}
"""The flat keys of ModelConfig before it had sections, each with its ``(section, field)`` now. Old
``config.yaml`` files, experiment files, sweep axes and ``model.KEY=value`` overrides may still use them:
:func:`migrate` moves them into their sections (``norm`` is both: a string is the old flat key, the norm's
kind; a mapping is the section)."""


def flat_key(key: str, value=None) -> tuple[str, str] | None:
    """``(section, field)`` when ``key`` (with ``value``) is a flat key of before the sections, else None."""
    if key == "norm" and isinstance(value, (dict, BaseModel)):
        return None
    return FLAT_KEYS.get(key)


def migrate(raw: dict) -> dict:
    """A copy of a ModelConfig mapping with every flat key of before the sections moved into its section
    (``n_heads`` -> ``attention.n_heads``, ``norm_position`` -> ``norm.placement``, ...; see
    :data:`FLAT_KEYS`). ValueError when a value is given both ways, naming both keys."""
    out = dict(raw)
    moved: dict[str, dict] = {}
    for key in list(out):
        where = flat_key(key, out[key])
        if where is None:
            continue
        section, name = where
        moved.setdefault(section, {})[name] = out.pop(key)
    for section, values in moved.items():
        given = out.get(section)
        if isinstance(given, BaseModel):
            given = given.model_dump(exclude_unset=True)
        given = dict(given or {})
        both = sorted(k for k in values if k in given)
        if both:
            old = [k for k, v in FLAT_KEYS.items() if v[0] == section and v[1] in both]
            raise ValueError(f"{', '.join(f'{section}.{k}' for k in both)} given twice: in the section and as the "
                             f"flat key(s) {old} of before the sections; keep the section's")
        out[section] = {**given, **values}
    return out


def merge(base: dict, changes: dict) -> dict:
    """``base`` (a ModelConfig mapping) with ``changes`` applied: both migrated (:func:`migrate`), then
    each section merged field by field, so ``merge(preset, {"n_heads": 8})`` keeps the preset's other
    attention fields."""
    def plain(d: dict) -> dict:  # a section given as an object merges as the fields it set
        return {k: v.model_dump(exclude_unset=True) if k in SECTIONS and isinstance(v, BaseModel) else v
                for k, v in d.items()}

    out, changes = plain(migrate(base)), plain(migrate(changes))
    for key, value in changes.items():
        if key in SECTIONS and isinstance(out.get(key), dict) and isinstance(value, dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


class ModelConfig(BaseModel):
    """A Transformer: decoder-only LM, bidirectional encoder (MLM head), or encoder-decoder.

    The few values every part reads sit at the top; each part's own settings sit in its section
    (``attention``, ``positions``, ``ffn``, ``norm``, ``sparsity``, ``hf_options``), which is what the
    module building that part receives. The flat keys of before the sections (``n_heads``, ...) are
    still read (:func:`migrate`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["decoder", "encoder", "encoder_decoder"] = "decoder"
    vocab_size: int = Field(256, gt=0)
    d_model: int = Field(256, gt=0)
    n_layers: int = Field(4, gt=0, description="decoder-only / encoder-only stack; the decoder of an enc-dec")
    n_encoder_layers: int | None = Field(None, description="encoder_decoder only")
    max_seq_len: int = Field(2048, gt=0)
    attention: AttentionConfig = AttentionConfig()
    positions: PositionConfig = PositionConfig()
    ffn: FFNConfig = FFNConfig()
    norm: NormConfig = NormConfig()
    sparsity: SparsityConfig = SparsityConfig()
    hf_options: HFOptions = HFOptions()
    residual: bool = Field(True, description="False drops every sublayer's identity path x + (the residuals study)")
    scale_embeddings: bool = Field(False, description="multiply token embeddings by sqrt(d_model) (Vaswani)")
    tie_embeddings: bool = True
    use_bias: bool = Field(False, description="biases on the projections, the norms and the embeddings' head")
    logits_softcap: float | None = Field(None, gt=0.0)
    init_std: float = Field(0.02, gt=0.0)
    init_scheme: Literal["normal", "xavier"] = Field(
        "normal", description="the blocks' projections: N(0, init_std) ('normal') or Glorot normal ('xavier': "
        "DeepNorm's init with beta = 1, the norm-placement study's init control); the embeddings keep "
        "init_std, and norm.placement deepnorm always uses Xavier with its beta")
    param_dtype: Dtype = "float32"
    compute_dtype: Dtype = "float32"
    remat: bool = Field(False, description="recompute each block's activations in the backward pass. With "
                        "scan_layers on the CPU it is also faster when the attention probabilities (N T^2 per "
                        "sequence) outweigh the activations (T d_model): the scan otherwise stacks them per layer "
                        "(48 layers of width 32 at T 128: 304 vs 419 ms a step; 24 x 64: 214 vs 275 ms unscanned)")
    scan_layers: bool = Field(False, description="one block compiled and run by jax.lax.scan over the stacked "
                              "layers (compile time independent of depth); a CPU train step then runs each "
                              "micro-batch in one part (optimizer.parallel_parts 'auto')")
    lora: LoRAConfig | None = Field(None, description="low-rank adapters on the projections (None: none)")

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, raw):
        return migrate(raw) if isinstance(raw, dict) else raw

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
        a = self.attention
        if a.head_dim is None and self.d_model % a.n_heads:
            raise ValueError(
                f"d_model={self.d_model} not divisible by attention.n_heads={a.n_heads}; set attention.head_dim"
            )
        if self.positions.kind == "rope" and self.resolved_head_dim % 2:
            raise ValueError(f"positions.kind='rope' needs an even head dim, got head_dim={self.resolved_head_dim}")
        if self.positions.kind == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"positions.kind='sinusoidal' needs an even d_model, got d_model={self.d_model}")
        if self.hf_options.head_transform and self.ffn.gated:
            raise ValueError(f"hf_options.head_transform needs a non-gated activation (act(x W + b)), got "
                             f"ffn.activation={self.ffn.activation!r}")
        bad = [p for p in self.sparsity.global_tokens if not 0 <= p < self.max_seq_len]
        if bad:
            raise ValueError(f"sparsity.global_tokens={self.sparsity.global_tokens}: positions {bad} outside "
                             f"[0, max_seq_len={self.max_seq_len})")
        if self.lora is not None and self.lora.targets is not None:
            have = self.projections
            missing = [t for t in self.lora.targets if t not in have]
            if missing:
                raise ValueError(f"lora.targets {missing}: this model's projections are {list(have)}")
        return self

    def replace(self, **changes) -> ModelConfig:
        """This config with ``changes`` applied (flat keys of before the sections, whole sections as
        mappings merged field by field, or top-level fields) and validated again: pydantic's
        ``model_copy(update=...)`` neither validates nor knows the sections."""
        return ModelConfig(**merge(self.model_dump(exclude_unset=True), changes))

    # -- derived values
    @property
    def resolved_head_dim(self) -> int:
        """H: ``attention.head_dim`` or ``d_model // attention.n_heads``."""
        return self.attention.resolved_head_dim(self.d_model)

    @property
    def resolved_kv_heads(self) -> int:
        """K: ``attention.n_kv_heads`` or ``attention.n_heads``."""
        return self.attention.resolved_kv_heads

    @property
    def resolved_d_ff(self) -> int:
        """F: ``ffn.d_ff`` or ``ffn_hidden_size(d_model, ffn.activation, ffn.multiple_of)``."""
        return self.ffn.width(self.d_model)

    @property
    def resolved_qkv_bias(self) -> bool:
        """Whether the q/k/v projections have biases: ``attention.qkv_bias`` or ``use_bias``."""
        return self.use_bias if self.attention.qkv_bias is None else self.attention.qkv_bias

    @property
    def projections(self) -> tuple[str, ...]:
        """The kernels of a block's self-attention and MLP (what LoRA may target), in :data:`LORA_TARGETS`
        order."""
        out = ["w_q", "w_k", "w_v", "w_o"]
        sharing = self.attention.qkv_sharing
        if sharing != "none":
            out.remove("w_k")
        if sharing == "qkv":
            out.remove("w_v")
        return tuple(out + (["w_gate", "w_up", "w_down"] if self.ffn.gated else ["w_in", "w_out"]))

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
    def n_decoder_layers(self) -> int:
        """Layers with causal self-attention (0 for an encoder)."""
        return 0 if self.kind == "encoder" else self.n_layers

    @property
    def n_encoder_stack_layers(self) -> int:
        """Layers with bidirectional self-attention (0 for a decoder-only model)."""
        if self.kind == "encoder":
            return self.n_layers
        return self.n_encoder_layers or 0

    def self_attention_mask(self, *, causal: bool, segment_ids=None, lengths=None) -> MaskSpec:
        """The self-attention :class:`MaskSpec`: causal/segments/lengths plus the sparse pattern."""
        sp = self.sparsity
        return MaskSpec(
            causal=causal, window=sp.window if sp.banded else None,
            q_segment_ids=segment_ids, kv_lengths=lengths, global_tokens=sp.global_tokens or None,
            random_blocks=None if sp.random_blocks is None else sp.random_blocks.to_ops(self.attention.n_heads),
        )


def get_key(config: ModelConfig, key: str):
    """The value at ``key``: a top-level field, a dotted ``section.field``, or a flat key of before the
    sections (``attention_impl`` -> ``config.attention.impl``)."""
    where = FLAT_KEYS.get(key)
    parts = key.split(".") if where is None else where
    value = config
    for p in parts:
        value = getattr(value, p)
    return value
