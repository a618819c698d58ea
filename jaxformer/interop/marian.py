"""Marian (``MarianMTModel``: the Helsinki-NLP opus-mt translation models): a post-LN encoder-decoder.

HF names (``MarianMTModel``; a bare ``MarianModel`` lacks the ``model.`` prefix and the head)::

    model.shared.weight                                        [V, D]   source = target = output table
    model.{encoder,decoder}.embed_tokens.weight                [V, D]   tied copies of shared (often not saved)
    model.{encoder,decoder}.embed_positions.weight             [P, D]   fixed sinusoids (not saved since 2020)
    model.encoder.layers.{i}.self_attn.{q,k,v,out}_proj.{weight,bias}   [D, D], [D]
    model.encoder.layers.{i}.self_attn_layer_norm.{weight,bias}         [D]
    model.encoder.layers.{i}.fc1.{weight,bias}                 [F, D], [F]
    model.encoder.layers.{i}.fc2.{weight,bias}                 [D, F], [D]
    model.encoder.layers.{i}.final_layer_norm.{weight,bias}    [D]
    model.decoder.layers.{i}.*                                 the same, plus
    model.decoder.layers.{i}.encoder_attn.{q,k,v,out}_proj.*   cross-attention
    model.decoder.layers.{i}.encoder_attn_layer_norm.*
    lm_head.weight                                             [V, D]   tied to shared (absent, or a copy)
    final_logits_bias                                          [1, V]   a buffer added to the logits

The model: ``x = embed(tokens) * sqrt(D)`` (``scale_embedding``) ``+ pe[pos]`` with pe the sinusoid
table in halves (``sin`` in ``pe[:, :D/2]``, ``cos`` in ``pe[:, D/2:]``, frequencies
``10000^(-2i/D)``: ``MarianSinusoidalPositionalEmbedding``); post-LN blocks (``x = LN(x + f(x))``,
LayerNorm eps 1e-5), biases everywhere, no embedding norm and no final norm (MBart has both: not this
family); attention scaled by ``head_dim^-0.5``; logits ``x @ shared.T + final_logits_bias``. In
jaxformer: ``kind="encoder_decoder"``, ``norm.placement="post"``, ``positions.kind="sinusoidal"``,
``positions.sinusoidal_layout="halves"``, ``use_bias``, ``hf_options.head_bias``.

Loading checks what no rule loads but the model relies on: a stored position table must be the
sinusoid jaxformer computes (a learnt or interleaved table would otherwise be silently replaced), and
stored tied copies (``embed_tokens``, ``lm_head`` when tied) must equal ``model.shared.weight``; when
``shared`` itself is missing it is read from one of them. A missing ``final_logits_bias`` (a bare
``MarianModel``) is zeros, as transformers does. An untied head (``tie_word_embeddings: false``) is
saved with the ``embed_tokens`` copies: transformers >= 5 ties them to ``shared`` only under
``tie_word_embeddings`` and would otherwise start them at random.

Refused (an :class:`HFConfigError` naming the key): separate source/target vocabularies
(``share_encoder_decoder_embeddings: false``, ``decoder_vocab_size != vocab_size``), different
encoder/decoder widths or head counts, and the legacy keys for variants jaxformer does not build
(``normalize_before``, ``normalize_embedding``, ``add_final_layer_norm``, ``add_bias_logits``,
``layernorm_embedding``, ``static_position_embeddings: false``).

Generation: :func:`translation_kwargs` reads ``config.json`` / ``generation_config.json`` into the
fields of a :class:`jaxformer.decode.TranslationConfig` that reproduce ``MarianMTModel.generate``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxformer.interop.rules import (
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
from jaxformer.model.config import ModelConfig, get_key

ARCH = "MarianMTModel"
LN_EPS = 1e-5                  # torch.nn.LayerNorm's default; Marian has no key for it
POSITION_ATOL = 5e-3           # a stored sinusoid table vs ours (bf16 storage rounds by up to 2^-9)
SHARED = "model.shared.weight"
TIED_COPIES = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")
POSITIONS = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight")
BIAS = "final_logits_bias"
# legacy (pre-2020 BartConfig-style) keys: value jaxformer reproduces
LEGACY = {"normalize_before": False, "normalize_embedding": False, "add_final_layer_norm": False,
          "add_bias_logits": False, "layernorm_embedding": False, "static_position_embeddings": True}
ACTIVATIONS_TO_MARIAN = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "swish"}
# generation options translate does not implement: the only value accepted
UNSUPPORTED_GENERATION = {"min_length": 0, "min_new_tokens": 0, "no_repeat_ngram_size": 0, "repetition_penalty": 1.0,
                          "encoder_no_repeat_ngram_size": 0, "forced_bos_token_id": None, "num_return_sequences": 1,
                          "do_sample": False, "diversity_penalty": 0.0, "begin_suppress_tokens": None,
                          "exponential_decay_length_penalty": None, "encoder_repetition_penalty": 1.0,
                          "sequence_bias": None, "num_beam_groups": 1}


def marian_sinusoids(n_pos: int, dim: int) -> np.ndarray:
    """``MarianSinusoidalPositionalEmbedding.create_weight`` (float64 math, float32 result) for even ``dim``."""
    j = np.arange(dim)
    enc = np.arange(n_pos)[:, None] / np.power(10000, 2 * (j // 2) / dim)[None, :]
    return np.concatenate([np.sin(enc[:, 0::2]), np.cos(enc[:, 1::2])], axis=1).astype(np.float32)


def _bare(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _lookup(present: Mapping[str, np.ndarray], name: str) -> str | None:
    """The key ``name`` has in ``present``: itself, or without ``model.`` (a bare ``MarianModel``)."""
    for key in (name, _bare(name)):
        if key in present:
            return key
    return None


@dataclasses.dataclass(frozen=True)
class MarianFamily(Family):
    name: str = "marian"
    model_types: tuple[str, ...] = ("marian",)
    prefixes: tuple[str, ...] = ("model.",)
    ignore: tuple[str, ...] = tuple(p for n in POSITIONS + TIED_COPIES for p in (n, _bare(n)))

    def config_from_hf(self, hf: Mapping[str, Any], where: str) -> ModelConfig:
        r = Reader(hf, where)
        archs = r.get("architectures", types=list) or []
        other = [a for a in archs if a not in (ARCH, "MarianModel")]
        if other:
            raise r.error("architectures", f"{other} is not supported (supported: {ARCH}, MarianModel)")
        V = r.need("vocab_size", int)
        dec_v = r.get("decoder_vocab_size", types=int)
        if dec_v is not None and dec_v != V:
            raise r.error("decoder_vocab_size", f"{dec_v} != vocab_size={V}: separate target vocabularies "
                                                "are not supported")
        r.expect("share_encoder_decoder_embeddings", [True], default=True)
        for key, value in LEGACY.items():
            r.expect(key, [value], default=value)
        D = r.need("d_model", int)
        pairs = {}
        for ours, enc, dec in (("heads", "encoder_attention_heads", "decoder_attention_heads"),
                               ("d_ff", "encoder_ffn_dim", "decoder_ffn_dim")):
            a, b = r.need(enc, int), r.need(dec, int)
            if a != b:
                raise r.error(dec, f"{b} != {enc}={a}: the encoder and decoder must have the same shape")
            pairs[ours] = a
        if D % pairs["heads"] or D % 2:
            raise r.error("d_model", f"{D} must be even and divisible by the heads ({pairs['heads']})")
        return ModelConfig(
            kind="encoder_decoder", vocab_size=V, d_model=D, n_layers=r.need("decoder_layers", int),
            n_encoder_layers=r.need("encoder_layers", int),
            max_seq_len=r.get("max_position_embeddings", 1024, types=int),
            attention=dict(n_heads=pairs["heads"]), positions=dict(kind="sinusoidal", sinusoidal_layout="halves"),
            ffn=dict(activation=activation_from_hf(r, "activation_function", "gelu"), d_ff=pairs["d_ff"]),
            norm=dict(kind="layernorm", placement="post", eps=LN_EPS), hf_options=dict(head_bias=True),
            scale_embeddings=bool(r.expect("scale_embedding", [True, False], default=False)),
            tie_embeddings=bool(r.expect("tie_word_embeddings", [True, False], default=True)), use_bias=True,
        )

    def config_to_hf(self, config: ModelConfig) -> dict[str, Any]:
        c = config
        problems = []
        want = {"kind": "encoder_decoder", "norm.kind": "layernorm", "norm.placement": "post",
                "positions.kind": "sinusoidal", "positions.sinusoidal_layout": "halves", "use_bias": True,
                "hf_options.head_bias": True, "norm.eps": LN_EPS}
        problems += [f"{k}={get_key(c, k)!r} (needs {v!r})" for k, v in want.items() if get_key(c, k) != v]
        if c.ffn.activation not in ACTIVATIONS_TO_MARIAN:
            problems.append(f"ffn.activation={c.ffn.activation!r} (needs one of {sorted(ACTIVATIONS_TO_MARIAN)})")
        if c.attention.qkv_bias is False:
            problems.append("attention.qkv_bias=False")
        problems += mha_problems(c)
        problems += set_options(c, ("norm.sandwich", "norm.embed", "attention.softcap", "attention.scale",
                                    "logits_softcap", "hf_options.head_transform", "sparsity.window",
                                    "sparsity.random_blocks", "norm.final"))
        if (c.sparsity.global_tokens or c.attention.qkv_sharing != "none" or c.hf_options.type_vocab_size
                or not c.residual):
            problems.append("sparsity.global_tokens / attention.qkv_sharing / hf_options.type_vocab_size / "
                            "residual=False")
        if problems:
            raise HFConfigError("not expressible as a marian config.json: " + "; ".join(problems))
        F = c.resolved_d_ff
        return dict(
            model_type="marian", architectures=[ARCH], is_encoder_decoder=True,
            vocab_size=c.vocab_size, decoder_vocab_size=c.vocab_size, share_encoder_decoder_embeddings=True,
            d_model=c.d_model, encoder_layers=c.n_encoder_layers, decoder_layers=c.n_layers,
            encoder_attention_heads=c.attention.n_heads, decoder_attention_heads=c.attention.n_heads,
            encoder_ffn_dim=F, decoder_ffn_dim=F, activation_function=ACTIVATIONS_TO_MARIAN[c.ffn.activation],
            max_position_embeddings=c.max_seq_len, scale_embedding=c.scale_embeddings,
            tie_word_embeddings=c.tie_embeddings,
        )

    def hf_defaults(self, config: ModelConfig) -> dict[str, Any]:
        """The Helsinki-NLP convention (``</s>`` = 0, ``<pad>`` = V - 1 starts the target); transformers'
        own defaults (pad 58100) do not fit a smaller vocabulary."""
        pad, eos = config.vocab_size - 1, 0
        return dict(pad_token_id=pad, eos_token_id=eos, decoder_start_token_id=pad, forced_eos_token_id=eos,
                    bos_token_id=None)

    def rules(self, config: ModelConfig) -> list[Rule]:
        c = config
        D, N, H, F = c.d_model, c.attention.n_heads, c.resolved_head_dim, c.resolved_d_ff
        out = [Rule((BIAS,), (("logits_bias",),), lambda b: (b.reshape(-1),), lambda b: (b.reshape(1, -1),))]
        if c.tie_embeddings:
            out.append(same(SHARED, ("embed", "embedding")))
        else:  # transformers >= 5 ties embed_tokens to shared only under tie_word_embeddings: write the copies
            out += [Rule((SHARED,) + TIED_COPIES, (("embed", "embedding"),), lambda s, e, d: (s,),
                         lambda x: (x, x, x)),
                    transposed("lm_head.weight", ("head", "kernel"))]

        def attention(hf: str, jx: tuple) -> list[Rule]:
            rules = [linear(f"{hf}.out_proj.weight", jx + ("w_o",), (N, H), (D,)),
                     same(f"{hf}.out_proj.bias", jx + ("b_o",))]
            for p in "qkv":
                rules += [linear(f"{hf}.{p}_proj.weight", jx + (f"w_{p}",), (D,), (N, H)),
                          reshaped(f"{hf}.{p}_proj.bias", jx + (f"b_{p}",), (N, H))]
            return rules

        def norm(hf: str, jx: tuple) -> list[Rule]:
            return [same(f"{hf}.weight", jx + ("norm", "scale")), same(f"{hf}.bias", jx + ("norm", "bias"))]

        for stack, n in (("encoder", c.n_encoder_layers), ("decoder", c.n_layers)):
            for i in range(n):
                hf, jx = f"model.{stack}.layers.{i}.", (stack, "blocks", i)
                out += attention(hf + "self_attn", jx + ("self_attn",))
                out += norm(hf + "self_attn_layer_norm", jx + ("attn_residual",))
                if stack == "decoder":
                    out += attention(hf + "encoder_attn", jx + ("cross_attn",))
                    out += norm(hf + "encoder_attn_layer_norm", jx + ("cross_residual",))
                out += [linear(hf + "fc1.weight", jx + ("mlp", "w_in"), (D,), (F,)),
                        same(hf + "fc1.bias", jx + ("mlp", "b_in")),
                        linear(hf + "fc2.weight", jx + ("mlp", "w_out"), (F,), (D,)),
                        same(hf + "fc2.bias", jx + ("mlp", "b_out"))]
                out += norm(hf + "final_layer_norm", jx + ("mlp_residual",))
        return out

    def ignored(self, config: ModelConfig) -> tuple[str, ...]:
        return self.ignore + (("lm_head.",) if config.tie_embeddings else ())

    def optional(self, config: ModelConfig) -> tuple[str, ...]:
        return (SHARED, BIAS) + TIED_COPIES

    def _copies(self, present: Mapping[str, np.ndarray], tied: bool) -> list[str]:
        names = list(TIED_COPIES) + (["lm_head.weight"] if tied else [])
        return [k for k in (_lookup(present, n) for n in names) if k is not None]

    def fill(self, name: str, present: Mapping[str, np.ndarray]) -> np.ndarray:
        sources = [k for k in [SHARED] + self._copies(present, tied=False) if k in present]
        if not sources:
            raise HFWeightsError(f"{SHARED} is missing, and so are its tied copies {list(TIED_COPIES)}")
        if name == SHARED or name in TIED_COPIES:
            return present[sources[0]]
        if name == BIAS:  # a bare MarianModel: transformers starts final_logits_bias at zeros too
            return np.zeros((1, present[sources[0]].shape[0]), np.float32)
        return super().fill(name, present)

    def verify(self, config: ModelConfig, present: Mapping[str, np.ndarray]) -> None:
        for name in POSITIONS:
            key = _lookup(present, name)
            if key is None:
                continue
            table = np.asarray(present[key], np.float32)
            if table.shape != (config.max_seq_len, config.d_model):
                raise HFWeightsError(f"{key}: shape {table.shape}, expected {(config.max_seq_len, config.d_model)} "
                                     "(max_position_embeddings, d_model)")
            want = marian_sinusoids(config.max_seq_len, config.d_model)
            diff = float(np.abs(table - want).max())
            if diff > POSITION_ATOL:
                raise HFWeightsError(f"{key} is not Marian's sinusoid table (max |diff| {diff:.3g} > "
                                     f"{POSITION_ATOL}); jaxformer computes the positions and would ignore it")
        copies = self._copies(present, config.tie_embeddings)
        if copies:
            ref_key = SHARED if SHARED in present else copies[0]
            ref = np.asarray(present[ref_key])
            for key in copies:
                if key != ref_key and not np.array_equal(np.asarray(present[key]), ref):
                    raise HFWeightsError(f"{key} differs from {ref_key}, but a Marian model with this config.json "
                                         "ties them (share_encoder_decoder_embeddings, tie_word_embeddings)")


def translation_kwargs(path: str | os.PathLike, *, beam: bool = False) -> dict[str, Any]:
    """The fields of a :class:`jaxformer.decode.TranslationConfig` (``TranslationConfig(**kw)``) that
    reproduce ``MarianMTModel.generate`` for the checkpoint at ``path``: greedy, or with ``beam`` its beam
    settings too (interop does not import decode, so a plain dict).

    From ``generation_config.json`` over ``config.json``: ``start_id`` (``decoder_start_token_id``),
    ``eos_id``, ``pad_id``, ``suppress_ids`` (single-token ``bad_words_ids``, e.g. ``[[pad]]``: never
    generated, and ``suppress_tokens``), ``force_eos`` (``forced_eos_token_id`` == eos: the last allowed
    token is ``</s>``), ``max_new_tokens`` when the checkpoint sets it (``max_length - 1``: transformers'
    ``max_length`` counts the start token); with ``beam`` also ``length_penalty``, ``early_stopping`` and
    ``num_beams`` when set. Refuses (an :class:`HFConfigError` naming the key) a generation option
    translate does not implement.
    """
    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    gen_file = path / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    where = str(gen_file if gen_file.is_file() else path / "config.json")
    merged = {**hf, **gen}
    r = Reader(merged, where)
    eos = r.need("eos_token_id")
    if isinstance(eos, list):
        if len(eos) != 1:
            raise r.error("eos_token_id", f"{eos}: one end token is supported")
        eos = eos[0]
    pad = r.get("pad_token_id", types=int)
    out: dict[str, Any] = dict(start_id=r.need("decoder_start_token_id", int), eos_id=int(eos),
                               pad_id=eos if pad is None else pad)
    bad = r.get("bad_words_ids", types=list) or []
    if any(not isinstance(b, list) or len(b) != 1 for b in bad):
        raise r.error("bad_words_ids", f"{bad}: only single-token entries are supported")
    suppress = [b[0] for b in bad] + list(r.get("suppress_tokens", types=list) or [])
    out["suppress_ids"] = tuple(sorted(set(int(i) for i in suppress)))
    forced = r.get("forced_eos_token_id")
    if isinstance(forced, list):
        forced = forced[0] if len(forced) == 1 else forced
    if forced not in (None, eos):
        raise r.error("forced_eos_token_id", f"{forced} != eos_token_id={eos} is not supported")
    out["force_eos"] = forced is not None
    if beam:
        out["length_penalty"] = float(r.get("length_penalty", 1.0))
        out["early_stopping"] = r.expect("early_stopping", [False, True, "never"], default=False)
    for key, neutral in UNSUPPORTED_GENERATION.items():
        value = merged.get(key)
        if value is not None and value != neutral:
            raise r.error(key, f"{value!r} is not supported by jaxformer.decode.translate (only {neutral!r})")
    if beam and merged.get("num_beams") is not None:
        out["num_beams"] = r.get("num_beams", types=int)
    if merged.get("max_new_tokens") is not None:
        out["max_new_tokens"] = r.get("max_new_tokens", types=int)
    elif merged.get("max_length") is not None:
        out["max_new_tokens"] = r.get("max_length", types=int) - 1   # the target counts its start token
    return out



def translation_settings(path: str | os.PathLike, max_seq_len: int, *, beams: int | None = None,
                         max_new_tokens: int | None = None) -> dict[str, Any]:
    """The :class:`jaxformer.decode.TranslationConfig` fields of ``jaxformer translate``: the
    checkpoint's :func:`translation_kwargs` with ``num_beams`` (``beams``, else the checkpoint's, else 1: greedy,
    whose config leaves the beam-only ``length_penalty`` and ``early_stopping`` at their defaults) and ``max_new_tokens`` (given, else the checkpoint's, at most
    ``max_seq_len - 1``) resolved."""
    if beams is not None and beams < 1:
        raise ValueError(f"translate: --beams {beams} must be >= 1")
    kw = translation_kwargs(path, beam=True)
    num_beams = kw.pop("num_beams", 1)
    if beams is not None:
        num_beams = beams
    limit = max_seq_len - 1
    wanted = kw.pop("max_new_tokens", limit)
    kw["max_new_tokens"] = min(wanted if max_new_tokens is None else max_new_tokens, limit)
    if num_beams == 1:
        kw = {k: v for k, v in kw.items() if k not in ("length_penalty", "early_stopping")}
    return {**kw, "num_beams": num_beams}

FAMILIES = (MarianFamily(),)
