"""BERT (``model_type`` ``bert``): a post-LN encoder with token-type embeddings and the MLM head.

HF names (``BertForMaskedLM``; ``{i}`` the layer)::

    bert.embeddings.word_embeddings.weight                  [V, D]
    bert.embeddings.position_embeddings.weight              [P, D]
    bert.embeddings.token_type_embeddings.weight            [T, D]
    bert.embeddings.LayerNorm.{weight,bias}                 [D]
    bert.encoder.layer.{i}.attention.self.{query,key,value}.weight   [D, D]   (+ .bias [D])
    bert.encoder.layer.{i}.attention.output.dense.weight    [D, D]   (+ .bias)
    bert.encoder.layer.{i}.attention.output.LayerNorm.{weight,bias}
    bert.encoder.layer.{i}.intermediate.dense.weight        [F, D]   (+ .bias)
    bert.encoder.layer.{i}.output.dense.weight              [D, F]   (+ .bias)
    bert.encoder.layer.{i}.output.LayerNorm.{weight,bias}
    cls.predictions.transform.dense.weight                  [D, D]   (+ .bias)
    cls.predictions.transform.LayerNorm.{weight,bias}       [D]
    cls.predictions.bias                                    [V]
    cls.predictions.decoder.{weight,bias}                   [V, D], [V]   (untied only)

jaxformer: ``kind="encoder"``, ``norm.placement="post"`` (no final norm), ``norm.embed``
(``LayerNorm(word + token_type + position)``), ``positions.kind="learned"`` (``max_seq_len =
max_position_embeddings``), ``use_bias``, ``hf_options`` ``type_vocab_size``, ``head_transform`` (dense + act +
LayerNorm) and ``head_bias``; ``layer_norm_eps`` is ``norm.eps`` everywhere; ``hidden_act`` is the
MLP's and the head transform's activation (``"gelu"`` is the exact, erf GELU). Padding: HF's
``attention_mask`` is right padding, i.e. ``lengths = attention_mask.sum(-1)``;
``token_type_ids`` are ``token_types``.

The output layer: tied (``tie_word_embeddings``, the default) it is the word embedding plus
``cls.predictions.bias``, and the ``cls.predictions.decoder.*`` copies some checkpoints store are
skipped. Untied, it is ``cls.predictions.decoder.weight`` plus ``cls.predictions.decoder.bias``
(what transformers >= 5 computes; ``cls.predictions.bias`` is then unused there, and a checkpoint
without ``decoder.bias``, as transformers 4 wrote, takes ``cls.predictions.bias``, which transformers
4 shared with it); saving writes both biases equal.

Checkpoints:

* ``BertForMaskedLM`` / ``BertForPreTraining``: encoder + MLM head. The pre-training checkpoint's
  NSP head (``cls.seq_relationship.*``) and the pooler (``bert.pooler.*``) are not modelled and are
  skipped, as are the ``position_ids`` / ``token_type_ids`` buffers older versions saved.
* ``BertModel`` (``architectures: ["BertModel"]``, names without ``bert.``, no ``cls.*``): the encoder
  alone, as a config with ``hf_options.head_transform=False, head_bias=False`` and a tied head: ``model.encode``
  gives transformers' ``last_hidden_state`` exactly; ``model(...)``'s logits (hidden states times
  the word embedding) are no head transformers has. ``pooler.*`` (the pooled [CLS] output) is not
  modelled and skipped. Saving such a config writes a ``BertModel`` (transformers then initialises
  the pooler it does not find). A checkpoint whose config names no architecture (or an MLM one)
  but lacks ``cls.*`` is refused, naming the missing tensors.
* Other heads (``BertForSequenceClassification``...) are refused by ``architectures``, so that a
  fine-tuned classifier is never silently dropped.
* Old exports name LayerNorm parameters ``gamma`` / ``beta`` (``bert-base-uncased`` does);
  they are read as ``weight`` / ``bias``, as transformers does.

Refused (an :class:`HFConfigError` naming the key): ``position_embedding_type`` other than
``absolute`` (relative_key / relative_key_query), ``is_decoder`` or ``add_cross_attention``
(``BertLMHeadModel`` / encoder-decoder use), an unsupported ``hidden_act``, ``hidden_size`` not
divisible by ``num_attention_heads``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxformer.interop.rules import (
    ACTIVATIONS_TO_HF,
    Family,
    HFConfigError,
    HFWeightsError,
    Reader,
    Rule,
    activation_from_hf,
    linear,
    mha_problems,
    reshaped,
    same,
    set_options,
    transposed,
)
from jaxformer.model.config import ModelConfig

MLM_ARCHS = ("BertForMaskedLM", "BertForPreTraining")
BARE_ARCH = "BertModel"
BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")


def _decoder_bias_rule() -> Rule:
    """Untied head: the logits bias is ``cls.predictions.decoder.bias`` (read), written to both names."""
    return Rule(("cls.predictions.bias", "cls.predictions.decoder.bias"), (("logits_bias",),),
                lambda _unused, b: (b,), lambda b: (b, b))


@dataclasses.dataclass(frozen=True)
class BertFamily(Family):
    name: str = "bert"
    model_types: tuple[str, ...] = ("bert",)
    prefixes: tuple[str, ...] = ("bert.", "")
    ignore: tuple[str, ...] = (*(p + b for p in ("bert.", "") for b in BUFFERS), "bert.pooler.", "pooler.",
                               "cls.seq_relationship.")

    def config_from_hf(self, hf: Mapping[str, Any], where: str) -> ModelConfig:
        r = Reader(hf, where)
        D = r.need("hidden_size", int)
        N = r.need("num_attention_heads", int)
        if D % N:
            raise r.error("num_attention_heads", f"{N} does not divide hidden_size={D}")
        r.expect("position_embedding_type", ["absolute"], "absolute")
        r.expect("is_decoder", [False], False)
        r.expect("add_cross_attention", [False], False)
        types = r.get("type_vocab_size", 2, types=int)
        if types < 1:
            raise r.error("type_vocab_size", f"{types} must be >= 1")
        archs = r.get("architectures", types=list) or []
        if not archs or any(a in MLM_ARCHS for a in archs):
            head = True
        elif set(archs) == {BARE_ARCH}:
            head = False
        else:
            raise r.error("architectures", f"{archs} is not supported (supported: {list(MLM_ARCHS)} for the "
                                           f"encoder with its MLM head, [{BARE_ARCH!r}] for the encoder alone; "
                                           "task heads such as classifier.* are not modelled)")
        tie = bool(r.get("tie_word_embeddings", True))
        if not head and not tie:
            raise r.error("tie_word_embeddings", f"False with architectures {archs}: a bare {BARE_ARCH} has no "
                                                 "output layer to untie")
        return ModelConfig(
            kind="encoder", vocab_size=r.need("vocab_size", int), d_model=D, n_layers=r.need("num_hidden_layers", int),
            max_seq_len=r.get("max_position_embeddings", 512, types=int),
            attention=dict(n_heads=N), positions=dict(kind="learned"),
            ffn=dict(activation=activation_from_hf(r, "hidden_act", "gelu"), d_ff=r.need("intermediate_size", int)),
            norm=dict(kind="layernorm", placement="post", eps=float(r.get("layer_norm_eps", 1e-12)), embed=True),
            hf_options=dict(type_vocab_size=types, head_transform=head, head_bias=head),
            use_bias=True, tie_embeddings=tie,
        )

    def config_to_hf(self, config: ModelConfig) -> dict[str, Any]:
        c = config
        problems = []
        if (c.kind, c.positions.kind, c.norm.kind, c.norm.placement) != ("encoder", "learned", "layernorm", "post"):
            problems.append(f"kind={c.kind!r}, positions.kind={c.positions.kind!r}, norm.kind={c.norm.kind!r}, "
                            f"norm.placement={c.norm.placement!r} (needs encoder, learned, layernorm, post)")
        if not c.norm.embed or not c.use_bias or not c.resolved_qkv_bias or c.norm.resolved_final:
            problems.append(f"norm.embed={c.norm.embed}, use_bias={c.use_bias}, "
                            f"attention.qkv_bias={c.attention.qkv_bias}, norm.final={c.norm.final} (needs "
                            "norm.embed, biases everywhere, no final norm)")
        if c.ffn.activation not in ACTIVATIONS_TO_HF:
            problems.append(f"ffn.activation={c.ffn.activation!r} (supported: {sorted(ACTIVATIONS_TO_HF)})")
        problems += mha_problems(c)
        if c.hf_options.type_vocab_size < 1:
            problems.append("hf_options.type_vocab_size=0 (BERT always has a token-type table: use 1)")
        if c.hf_options.head_transform and c.hf_options.head_bias:
            arch = MLM_ARCHS[0]
        elif not c.hf_options.head_transform and not c.hf_options.head_bias and c.tie_embeddings:
            arch = BARE_ARCH
        else:
            arch = None
            problems.append(f"hf_options.head_transform={c.hf_options.head_transform}, hf_options.head_bias="
                            f"{c.hf_options.head_bias}, tie_embeddings={c.tie_embeddings} (needs both head options "
                            "(BertForMaskedLM), or neither with tied embeddings (BertModel))")
        problems += set_options(c, ("norm.sandwich", "scale_embeddings", "attention.softcap", "attention.scale",
                                    "logits_softcap", "sparsity.window", "sparsity.random_blocks"))
        if c.sparsity.global_tokens or c.attention.qkv_sharing != "none" or not c.residual:
            problems.append(f"global_tokens={c.sparsity.global_tokens}, qkv_sharing={c.attention.qkv_sharing!r}, "
                            f"residual={c.residual}")
        if problems:
            raise HFConfigError("not expressible as a bert config.json: " + "; ".join(problems))
        return dict(
            model_type="bert", architectures=[arch], vocab_size=c.vocab_size, hidden_size=c.d_model,
            num_hidden_layers=c.n_layers, num_attention_heads=c.attention.n_heads, intermediate_size=c.resolved_d_ff,
            hidden_act=ACTIVATIONS_TO_HF[c.ffn.activation], max_position_embeddings=c.max_seq_len,
            type_vocab_size=c.hf_options.type_vocab_size, layer_norm_eps=c.norm.eps,
            tie_word_embeddings=c.tie_embeddings,
            position_embedding_type="absolute", is_decoder=False, add_cross_attention=False,
        )

    def rules(self, config: ModelConfig) -> list[Rule]:
        c = config
        D, N, H, F = c.d_model, c.attention.n_heads, c.resolved_head_dim, c.resolved_d_ff
        p = "bert." if c.hf_options.head_transform else ""  # a bare BertModel's names have no prefix

        def norm(hf: str, path: tuple) -> list[Rule]:
            return [same(hf + ".weight", path + ("scale",)), same(hf + ".bias", path + ("bias",))]

        def dense(hf: str, w: tuple, b: tuple, in_shape, out_shape) -> list[Rule]:
            return [linear(hf + ".weight", w, in_shape, out_shape), reshaped(hf + ".bias", b, out_shape)]

        out = [same(p + "embeddings.word_embeddings.weight", ("embed", "embedding")),
               same(p + "embeddings.position_embeddings.weight", ("pos_embed", "embedding")),
               same(p + "embeddings.token_type_embeddings.weight", ("type_embed", "embedding")),
               *norm(p + "embeddings.LayerNorm", ("embed_norm",))]
        for i in range(c.n_layers):
            hf, jx = f"{p}encoder.layer.{i}.", ("encoder", "blocks", i)
            att = jx + ("self_attn",)
            for name, x in (("query", "q"), ("key", "k"), ("value", "v")):
                out += dense(hf + f"attention.self.{name}", att + (f"w_{x}",), att + (f"b_{x}",), (D,), (N, H))
            out += [*dense(hf + "attention.output.dense", att + ("w_o",), att + ("b_o",), (N, H), (D,)),
                    *norm(hf + "attention.output.LayerNorm", jx + ("attn_residual", "norm")),
                    *dense(hf + "intermediate.dense", jx + ("mlp", "w_in"), jx + ("mlp", "b_in"), (D,), (F,)),
                    *dense(hf + "output.dense", jx + ("mlp", "w_out"), jx + ("mlp", "b_out"), (F,), (D,)),
                    *norm(hf + "output.LayerNorm", jx + ("mlp_residual", "norm"))]
        if c.hf_options.head_transform:
            out += [*dense("cls.predictions.transform.dense", ("head_transform", "w"), ("head_transform", "b"),
                           (D,), (D,)),
                    *norm("cls.predictions.transform.LayerNorm", ("head_transform", "norm"))]
            if c.tie_embeddings:
                out.append(same("cls.predictions.bias", ("logits_bias",)))
            else:
                out += [transposed("cls.predictions.decoder.weight", ("head", "kernel")), _decoder_bias_rule()]
        return out

    def ignored(self, config: ModelConfig) -> tuple[str, ...]:
        # a tied head's cls.predictions.decoder.{weight,bias} are copies of the word embedding and
        # cls.predictions.bias that older checkpoints store
        return self.ignore + (("cls.predictions.decoder.",) if config.tie_embeddings else ())

    def tied_copies(self, config: ModelConfig) -> dict[str, str]:
        if not config.tie_embeddings:
            return {}
        return {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
                "cls.predictions.decoder.bias": "cls.predictions.bias"}

    def optional(self, config: ModelConfig) -> tuple[str, ...]:
        if config.tie_embeddings or not config.hf_options.head_transform:
            return ()
        return ("cls.predictions.decoder.bias",)

    def fill(self, name: str, present: Mapping[str, Any]):
        if name == "cls.predictions.decoder.bias" and "cls.predictions.bias" in present:
            return present["cls.predictions.bias"]  # transformers 4 shared the two
        raise HFWeightsError(f"{name} is missing")

    def rename(self, name: str) -> str:
        for old, new in ((".LayerNorm.gamma", ".LayerNorm.weight"), (".LayerNorm.beta", ".LayerNorm.bias")):
            if name.endswith(old):
                return name[: -len(old)] + new
        return name


FAMILIES = (BertFamily(),)
