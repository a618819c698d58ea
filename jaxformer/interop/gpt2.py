"""GPT-2: learned absolute positions, Conv1D weights, fused ``c_attn``, pre-LayerNorm, tied head.

HF names (``GPT2LMHeadModel``; a bare ``GPT2Model``, e.g. the original ``gpt2`` upload, lacks the
``transformer.`` prefix)::

    transformer.wte.weight                   [V, D]
    transformer.wpe.weight                   [n_positions, D]
    transformer.h.{i}.ln_1.{weight,bias}     [D]
    transformer.h.{i}.attn.c_attn.weight     [D, 3D]   Conv1D: [in, out], columns [q | k | v]
    transformer.h.{i}.attn.c_attn.bias       [3D]
    transformer.h.{i}.attn.c_proj.{weight,bias}  [D, D], [D]
    transformer.h.{i}.ln_2.{weight,bias}     [D]
    transformer.h.{i}.mlp.c_fc.{weight,bias}     [D, F], [F]
    transformer.h.{i}.mlp.c_proj.{weight,bias}   [F, D], [D]
    transformer.ln_f.{weight,bias}           [D]
    lm_head.weight                           [V, D]   (tied: absent, or a copy of wte that is skipped)

Conv1D already computes ``x @ W`` (no transpose, unlike ``nn.Linear``). Older checkpoints also carry
the causal-mask buffers ``h.{i}.attn.bias`` / ``h.{i}.attn.masked_bias``; they are skipped.

Options: ``n_inner`` (None: 4D) is ``d_ff``; ``activation_function`` (``gelu_new`` = ``gelu_tanh``,
``gelu``, ``relu``, ``silu``); ``scale_attn_weights=False`` is ``attention.scale=1.0``;
``reorder_and_upcast_attn`` only changes the precision of the attention scores (accepted).
Refused: ``scale_attn_by_inverse_layer_idx`` (a per-layer scale), ``add_cross_attention``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxformer.interop.rules import (
    ACTIVATIONS_TO_HF,
    Family,
    HFConfigError,
    Reader,
    Rule,
    activation_from_hf,
    conv1d,
    mha_problems,
    same,
    set_options,
    transposed,
    xp,
)
from jaxformer.model.config import ModelConfig

ARCH = "GPT2LMHeadModel"


def fused_conv1d_qkv(hf: str, paths: tuple, D: int, N: int, H: int) -> Rule:
    """``c_attn.weight [D, 3*N*H]`` (columns ``[q | k | v]``) <-> ``w_q, w_k, w_v [D, N, H]``."""

    def load(w):
        return tuple(w[:, j * N * H:(j + 1) * N * H].reshape(D, N, H) for j in range(3))

    def save(q, k, v):
        return (xp(q).concatenate([a.reshape(D, N * H) for a in (q, k, v)], axis=1),)

    return Rule((hf,), paths, load, save)


def fused_qkv_bias(hf: str, paths: tuple, N: int, H: int) -> Rule:
    """``c_attn.bias [3*N*H]`` (``[q | k | v]``) <-> ``b_q, b_k, b_v [N, H]``."""

    def load(b):
        return tuple(b[j * N * H:(j + 1) * N * H].reshape(N, H) for j in range(3))

    def save(q, k, v):
        return (xp(q).concatenate([a.reshape(N * H) for a in (q, k, v)]),)

    return Rule((hf,), paths, load, save)


@dataclasses.dataclass(frozen=True)
class GPT2Family(Family):
    name: str = "gpt2"
    model_types: tuple[str, ...] = ("gpt2",)
    prefixes: tuple[str, ...] = ("transformer.",)

    def config_from_hf(self, hf: Mapping[str, Any], where: str) -> ModelConfig:
        r = Reader(hf, where)
        D = r.first("n_embd", "hidden_size")
        N = r.first("n_head", "num_attention_heads")
        L = r.first("n_layer", "num_hidden_layers")
        P = r.first("n_positions", "max_position_embeddings", default=1024)
        for key, value in (("n_embd", D), ("n_head", N), ("n_layer", L), ("n_positions", P)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise r.error(key, f"missing or not a positive int ({value!r})")
        if D % N:
            raise r.error("n_head", f"n_embd={D} is not divisible by n_head={N}")
        if r.get("scale_attn_by_inverse_layer_idx", False):
            raise r.error("scale_attn_by_inverse_layer_idx", "True is not supported (a per-layer attention scale "
                                                             "1 / (layer_idx + 1))")
        if r.get("add_cross_attention", False):
            raise r.error("add_cross_attention", "True is not supported (GPT-2 with cross-attention is an "
                                                 "encoder-decoder's decoder)")
        d_ff = r.get("n_inner", types=int)
        return ModelConfig(
            kind="decoder", vocab_size=r.need("vocab_size", int), d_model=D, n_layers=L, max_seq_len=P,
            attention=dict(n_heads=N, scale=None if r.get("scale_attn_weights", True) else 1.0),
            positions=dict(kind="learned"),
            ffn=dict(activation=activation_from_hf(r, "activation_function", "gelu_new"),
                     d_ff=4 * D if d_ff is None else d_ff),
            norm=dict(kind="layernorm", placement="pre", eps=float(r.get("layer_norm_epsilon", 1e-5))),
            tie_embeddings=bool(r.get("tie_word_embeddings", True)), use_bias=True,
        )

    def config_to_hf(self, config: ModelConfig) -> dict[str, Any]:
        c = config
        problems = []
        if (c.kind, c.positions.kind, c.norm.kind, c.norm.placement) != ("decoder", "learned", "layernorm", "pre"):
            problems.append(f"kind={c.kind!r}, positions.kind={c.positions.kind!r}, norm.kind={c.norm.kind!r}, "
                            f"norm.placement={c.norm.placement!r} (needs decoder, learned, layernorm, pre)")
        if c.ffn.activation not in ACTIVATIONS_TO_HF:
            problems.append(f"ffn.activation={c.ffn.activation!r} (supported: {sorted(ACTIVATIONS_TO_HF)})")
        if not c.use_bias or c.resolved_qkv_bias is not True:
            problems.append(f"use_bias={c.use_bias}, attention.qkv_bias={c.attention.qkv_bias} (GPT-2 has every bias)")
        problems += mha_problems(c)
        if c.attention.scale not in (None, 1.0):
            problems.append(f"attention.scale={c.attention.scale} (only the default 1/sqrt(head_dim), or 1.0)")
        problems += set_options(c, ("norm.sandwich", "norm.embed", "scale_embeddings", "attention.softcap",
                                    "logits_softcap", "hf_options.head_transform", "hf_options.head_bias",
                                    "sparsity.window", "positions.rope_scaling"))
        if (c.attention.qkv_sharing != "none" or c.hf_options.type_vocab_size or not c.residual
                or not c.norm.resolved_final):
            problems.append("attention.qkv_sharing / hf_options.type_vocab_size / residual=False / norm.final=False")
        if problems:
            raise HFConfigError("not expressible as a gpt2 config.json: " + "; ".join(problems))
        return dict(
            model_type="gpt2", architectures=[ARCH], vocab_size=c.vocab_size, n_embd=c.d_model,
            n_layer=c.n_layers, n_head=c.attention.n_heads, n_inner=c.resolved_d_ff, n_positions=c.max_seq_len,
            activation_function=ACTIVATIONS_TO_HF[c.ffn.activation], layer_norm_epsilon=c.norm.eps,
            tie_word_embeddings=c.tie_embeddings, scale_attn_weights=c.attention.scale is None,
            scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False, add_cross_attention=False,
        )

    def rules(self, config: ModelConfig) -> list[Rule]:
        c = config
        D, N, H, F = c.d_model, c.attention.n_heads, c.resolved_head_dim, c.resolved_d_ff
        out = [same("transformer.wte.weight", ("embed", "embedding")),
               same("transformer.wpe.weight", ("pos_embed", "embedding")),
               same("transformer.ln_f.weight", ("decoder", "final_norm", "scale")),
               same("transformer.ln_f.bias", ("decoder", "final_norm", "bias"))]
        if not c.tie_embeddings:
            out.append(transposed("lm_head.weight", ("head", "kernel")))
        for i in range(c.n_layers):
            hf, jx = f"transformer.h.{i}.", ("decoder", "blocks", i)
            att = jx + ("self_attn",)
            out += [
                same(hf + "ln_1.weight", jx + ("attn_residual", "norm", "scale")),
                same(hf + "ln_1.bias", jx + ("attn_residual", "norm", "bias")),
                fused_conv1d_qkv(hf + "attn.c_attn.weight", (att + ("w_q",), att + ("w_k",), att + ("w_v",)),
                                 D, N, H),
                fused_qkv_bias(hf + "attn.c_attn.bias", (att + ("b_q",), att + ("b_k",), att + ("b_v",)), N, H),
                conv1d(hf + "attn.c_proj.weight", att + ("w_o",), (N, H), (D,)),
                same(hf + "attn.c_proj.bias", att + ("b_o",)),
                same(hf + "ln_2.weight", jx + ("mlp_residual", "norm", "scale")),
                same(hf + "ln_2.bias", jx + ("mlp_residual", "norm", "bias")),
                conv1d(hf + "mlp.c_fc.weight", jx + ("mlp", "w_in"), (D,), (F,)),
                same(hf + "mlp.c_fc.bias", jx + ("mlp", "b_in")),
                conv1d(hf + "mlp.c_proj.weight", jx + ("mlp", "w_out"), (F,), (D,)),
                same(hf + "mlp.c_proj.bias", jx + ("mlp", "b_out")),
            ]
        return out

    def ignored(self, config: ModelConfig) -> tuple[str, ...]:
        # causal-mask buffers of older checkpoints; a bare GPT2Model's names keep no prefix
        buffers = tuple(f"{p}h.{i}.attn.{b}" for p in ("transformer.", "") for i in range(config.n_layers)
                        for b in ("bias", "masked_bias"))
        return self.ignore + buffers + (("lm_head.",) if config.tie_embeddings else ())

    def tied_copies(self, config: ModelConfig) -> dict[str, str]:
        if not config.tie_embeddings:
            return {}
        return {"lm_head.weight": "transformer.wte.weight"}


FAMILIES = (GPT2Family(),)
