"""BLOOM: ALiBi, a LayerNorm after the embedding, fused per-head ``query_key_value``, tied head.

HF names (``BloomForCausalLM``; a bare ``BloomModel`` lacks the ``transformer.`` prefix)::

    transformer.word_embeddings.weight                          [V, D]
    transformer.word_embeddings_layernorm.{weight,bias}         [D]
    transformer.h.{i}.input_layernorm.{weight,bias}             [D]
    transformer.h.{i}.self_attention.query_key_value.weight     [3D, D]   rows [N, 3, H]: per head q, k, v
    transformer.h.{i}.self_attention.query_key_value.bias       [3D]      [N, 3, H]
    transformer.h.{i}.self_attention.dense.{weight,bias}        [D, D], [D]
    transformer.h.{i}.post_attention_layernorm.{weight,bias}    [D]
    transformer.h.{i}.mlp.dense_h_to_4h.{weight,bias}           [4D, D], [4D]
    transformer.h.{i}.mlp.dense_4h_to_h.{weight,bias}           [D, 4D], [D]
    transformer.ln_f.{weight,bias}                              [D]
    lm_head.weight                                              [V, D]   (tied: absent, or skipped)

``query_key_value``'s output is viewed as ``[B, T, N, 3, H]`` (modeling_bloom ``_reshape``): unlike
GPT-2's ``[q | k | v]`` columns, the three projections are interleaved per head.

ALiBi: BLOOM adds ``slope * key_position`` (positions counted over the attention mask) where
jaxformer adds ``-slope * |q - k|``; under a causal mask the two differ by ``slope * q`` per query
row, which softmax ignores. The slopes (``build_alibi_tensor``, including head counts that are not
powers of two) equal :func:`jaxformer.ops.positional.alibi_slopes`.

The MLP is always ``4D`` wide with BLOOM's tanh GELU (``gelu_tanh``; its constant 0.79788456 is
``sqrt(2/pi)`` to 8 digits). ``pretraining_tp`` / ``slow_but_exact`` only split the same matmuls
(accepted); ``apply_residual_connection_post_layernorm=True`` is refused. BLOOM has no context length
in its config (ALiBi); ``max_seq_len`` reads as 2048, BLOOM's training context (override it with
``load_pretrained(..., max_seq_len=...)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxformer.interop.rules import (
    Family,
    HFConfigError,
    Reader,
    Rule,
    linear,
    mha_problems,
    same,
    set_options,
    transposed,
    xp,
)
from jaxformer.model.config import ModelConfig

ARCH = "BloomForCausalLM"
MAX_SEQ_LEN = 2048


def fused_per_head_qkv(hf: str, paths: tuple, D: int, N: int, H: int) -> Rule:
    """``query_key_value.weight [N*3*H, D]`` (rows ``[N, 3, H]``) <-> ``w_q, w_k, w_v [D, N, H]``."""

    def load(w):
        w = w.reshape(N, 3, H, D)
        return tuple(w[:, j].transpose(2, 0, 1) for j in range(3))

    def save(q, k, v):
        return (xp(q).stack([a.transpose(1, 2, 0) for a in (q, k, v)], axis=1).reshape(N * 3 * H, D),)

    return Rule((hf,), paths, load, save)


def fused_per_head_bias(hf: str, paths: tuple, N: int, H: int) -> Rule:
    """``query_key_value.bias [N*3*H]`` (``[N, 3, H]``) <-> ``b_q, b_k, b_v [N, H]``."""

    def load(b):
        b = b.reshape(N, 3, H)
        return tuple(b[:, j] for j in range(3))

    def save(q, k, v):
        return (xp(q).stack([q, k, v], axis=1).reshape(N * 3 * H),)

    return Rule((hf,), paths, load, save)


@dataclasses.dataclass(frozen=True)
class BloomFamily(Family):
    name: str = "bloom"
    model_types: tuple[str, ...] = ("bloom",)
    prefixes: tuple[str, ...] = ("transformer.",)

    def config_from_hf(self, hf: Mapping[str, Any], where: str) -> ModelConfig:
        r = Reader(hf, where)
        # BloomConfig: an old "n_embed" wins over hidden_size; n_layer / n_head are the stored names
        D = r.first("n_embed", "hidden_size", default=64)
        N = r.first("n_head", "num_attention_heads", default=8)
        L = r.first("n_layer", "num_hidden_layers", default=2)
        for key, value in (("hidden_size", D), ("n_head", N), ("n_layer", L)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise r.error(key, f"not a positive int ({value!r})")
        if D % N:
            raise r.error("n_head", f"hidden_size={D} is not divisible by n_head={N}")
        if r.get("apply_residual_connection_post_layernorm", False):
            raise r.error("apply_residual_connection_post_layernorm",
                          "True is not supported (the residual path would carry the normed hidden states)")
        return ModelConfig(
            kind="decoder", vocab_size=r.get("vocab_size", 250880, types=int), d_model=D, n_layers=L,
            max_seq_len=MAX_SEQ_LEN, attention=dict(n_heads=N), positions=dict(kind="alibi"),
            ffn=dict(activation="gelu_tanh", d_ff=4 * D),
            norm=dict(kind="layernorm", placement="pre", eps=float(r.get("layer_norm_epsilon", 1e-5)), embed=True),
            tie_embeddings=bool(r.get("tie_word_embeddings", True)), use_bias=True,
        )

    def config_to_hf(self, config: ModelConfig) -> dict[str, Any]:
        c = config
        problems = []
        if (c.kind, c.positions.kind, c.norm.kind, c.norm.placement) != ("decoder", "alibi", "layernorm", "pre"):
            problems.append(f"kind={c.kind!r}, positions.kind={c.positions.kind!r}, norm.kind={c.norm.kind!r}, "
                            f"norm.placement={c.norm.placement!r} (needs decoder, alibi, layernorm, pre)")
        if c.ffn.activation != "gelu_tanh" or c.resolved_d_ff != 4 * c.d_model:
            problems.append(f"ffn.activation={c.ffn.activation!r}, ffn.d_ff={c.resolved_d_ff} (needs gelu_tanh, "
                            "4 * d_model)")
        if not c.norm.embed:
            problems.append("norm.embed=False (BLOOM norms the embedding)")
        if not c.use_bias or c.resolved_qkv_bias is not True:
            problems.append(f"use_bias={c.use_bias}, attention.qkv_bias={c.attention.qkv_bias} (BLOOM has every bias)")
        problems += mha_problems(c)
        problems += set_options(c, ("norm.sandwich", "scale_embeddings", "attention.softcap", "attention.scale",
                                    "logits_softcap", "hf_options.head_transform", "hf_options.head_bias",
                                    "sparsity.window"))
        if (c.attention.qkv_sharing != "none" or c.hf_options.type_vocab_size or not c.residual
                or not c.norm.resolved_final):
            problems.append("attention.qkv_sharing / hf_options.type_vocab_size / residual=False / norm.final=False")
        if problems:
            raise HFConfigError("not expressible as a bloom config.json: " + "; ".join(problems))
        return dict(
            model_type="bloom", architectures=[ARCH], vocab_size=c.vocab_size, hidden_size=c.d_model,
            n_layer=c.n_layers, n_head=c.attention.n_heads, layer_norm_epsilon=c.norm.eps,
            tie_word_embeddings=c.tie_embeddings, apply_residual_connection_post_layernorm=False,
            pretraining_tp=1, slow_but_exact=False,
        )

    def rules(self, config: ModelConfig) -> list[Rule]:
        c = config
        D, N, H, F = c.d_model, c.attention.n_heads, c.resolved_head_dim, c.resolved_d_ff
        out = [same("transformer.word_embeddings.weight", ("embed", "embedding")),
               same("transformer.word_embeddings_layernorm.weight", ("embed_norm", "scale")),
               same("transformer.word_embeddings_layernorm.bias", ("embed_norm", "bias")),
               same("transformer.ln_f.weight", ("decoder", "final_norm", "scale")),
               same("transformer.ln_f.bias", ("decoder", "final_norm", "bias"))]
        if not c.tie_embeddings:
            out.append(transposed("lm_head.weight", ("head", "kernel")))
        for i in range(c.n_layers):
            hf, jx = f"transformer.h.{i}.", ("decoder", "blocks", i)
            att = jx + ("self_attn",)
            out += [
                same(hf + "input_layernorm.weight", jx + ("attn_residual", "norm", "scale")),
                same(hf + "input_layernorm.bias", jx + ("attn_residual", "norm", "bias")),
                fused_per_head_qkv(hf + "self_attention.query_key_value.weight",
                                   (att + ("w_q",), att + ("w_k",), att + ("w_v",)), D, N, H),
                fused_per_head_bias(hf + "self_attention.query_key_value.bias",
                                    (att + ("b_q",), att + ("b_k",), att + ("b_v",)), N, H),
                linear(hf + "self_attention.dense.weight", att + ("w_o",), (N, H), (D,)),
                same(hf + "self_attention.dense.bias", att + ("b_o",)),
                same(hf + "post_attention_layernorm.weight", jx + ("mlp_residual", "norm", "scale")),
                same(hf + "post_attention_layernorm.bias", jx + ("mlp_residual", "norm", "bias")),
                linear(hf + "mlp.dense_h_to_4h.weight", jx + ("mlp", "w_in"), (D,), (F,)),
                same(hf + "mlp.dense_h_to_4h.bias", jx + ("mlp", "b_in")),
                linear(hf + "mlp.dense_4h_to_h.weight", jx + ("mlp", "w_out"), (F,), (D,)),
                same(hf + "mlp.dense_4h_to_h.bias", jx + ("mlp", "b_out")),
            ]
        return out

    def ignored(self, config: ModelConfig) -> tuple[str, ...]:
        return self.ignore + (("lm_head.",) if config.tie_embeddings else ())

    def tied_copies(self, config: ModelConfig) -> dict[str, str]:
        if not config.tie_embeddings:
            return {}
        return {"lm_head.weight": "transformer.word_embeddings.weight"}


FAMILIES = (BloomFamily(),)
