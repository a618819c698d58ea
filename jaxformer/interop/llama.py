"""LLaMA (incl. Llama 3's RoPE scaling), Mistral (sliding window) and Qwen2 (QKV biases): one layout.

HF names (``LlamaForCausalLM``; a bare ``LlamaModel`` lacks the ``model.`` prefix and the head)::

    model.embed_tokens.weight                          [V, D]
    model.layers.{i}.input_layernorm.weight            [D]
    model.layers.{i}.self_attn.{q,k,v}_proj.weight     [N*H | K*H, D]   (+ .bias: Qwen2)
    model.layers.{i}.self_attn.o_proj.weight           [D, N*H]
    model.layers.{i}.post_attention_layernorm.weight   [D]
    model.layers.{i}.mlp.{gate,up}_proj.weight         [F, D]
    model.layers.{i}.mlp.down_proj.weight              [D, F]
    model.norm.weight                                  [D]
    lm_head.weight                                     [V, D]   (absent when tied)

HF's q/k projections are already in ``rotate_half`` order (their conversion script
permuted Meta's interleaved weights), which is jaxformer's default RoPE pairing
(``positions.rope_interleaved=False``), so no permutation is needed here.

RoPE: ``rope_theta`` / ``rope_scaling`` at the top level (the form most published
checkpoints carry) or ``rope_parameters`` (what transformers >= 5 writes); types
``default``, ``linear`` and ``llama3``. Sliding window ``W`` (each token sees itself
and the ``W - 1`` before it) becomes ``sparsity.window = (W - 1, 0)``.
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
    activation_from_hf,
    linear,
    reshaped,
    same,
    set_options,
    transposed,
)
from jaxformer.model.config import ModelConfig, get_key

ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3")


def _rope(r: Reader, key: str, theta: float, scaling: Mapping | None) -> tuple[float, dict | None]:
    if scaling is None:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise r.error(f"{key}.rope_type", f"{kind!r} is not supported (supported: {list(ROPE_TYPES)})")
    if kind == "default":
        return float(theta), None
    if "factor" not in scaling:
        raise r.error(f"{key}.factor", "missing")
    out = dict(kind=kind, factor=float(scaling["factor"]))
    if kind == "llama3":
        for ours, theirs in (("original_max_position", "original_max_position_embeddings"),
                             ("low_freq_factor", "low_freq_factor"), ("high_freq_factor", "high_freq_factor")):
            if theirs not in scaling:
                raise r.error(f"{key}.{theirs}", "missing (required for rope_type 'llama3')")
            out[ours] = scaling[theirs]
    return float(theta), out


def rope_from_hf(r: Reader) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling dict for ModelConfig or None)`` from either config form.

    ``rope_parameters`` (transformers >= 5) and the legacy ``rope_theta`` + ``rope_scaling``; a file with
    both (as :func:`save_pretrained` writes, so every reader agrees) must say the same in each.
    """
    params = r.get("rope_parameters", types=dict)
    legacy = "rope_scaling" in r.hf or "rope_theta" in r.hf
    old = _rope(r, "rope_scaling", r.get("rope_theta", 10000.0), r.get("rope_scaling", types=dict)) \
        if legacy or params is None else None
    if params is None:
        return old
    new = _rope(r, "rope_parameters", params.get("rope_theta", r.get("rope_theta", 10000.0)), params)
    if old is not None and old != new:
        raise r.error("rope_parameters", f"says {new}, but rope_theta / rope_scaling say {old}")
    return new


def window_from_hf(r: Reader, model_type: str, n_layers: int) -> int | None:
    """The sliding window every layer uses, or None, read as transformers reads it; a per-layer mix is refused.

    * llama: never a window.
    * mistral: ``sliding_window`` (None: full attention) in every layer; ``layer_types`` is ignored, as
      ``MistralForCausalLM`` ignores it.
    * qwen2: ``sliding_window`` only with ``use_sliding_window``; layer ``i`` slides when
      ``layer_types[i] == "sliding_attention"``, or, without ``layer_types``, when ``i >= max_window_layers``
      (default 28). All layers or none: a mix is an error naming the key.
    """
    if model_type == "llama":
        return None
    window = r.get("sliding_window", types=int)
    if model_type == "mistral" or window is None:
        return window
    if not r.get("use_sliding_window", False):
        return None
    layer_types = r.get("layer_types", types=list)
    key = "layer_types"
    if layer_types is None:
        key = "max_window_layers"
        first = r.get("max_window_layers", 28, types=int)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    kinds = set(layer_types)
    if kinds == {"full_attention"}:
        return None
    if kinds != {"sliding_attention"}:
        raise r.error(key, f"{r.get(key)!r}: sliding attention in only some of the {n_layers} layers is not "
                           "supported (all layers slide, or none)")
    return window


@dataclasses.dataclass(frozen=True)
class LlamaFamily(Family):
    name: str = "llama"
    model_types: tuple[str, ...] = ("llama", "mistral", "qwen2")
    prefixes: tuple[str, ...] = ("model.",)
    ignore: tuple[str, ...] = ("model.rotary_emb.",)

    def config_from_hf(self, hf: Mapping[str, Any], where: str) -> ModelConfig:
        r = Reader(hf, where)
        model_type = r.need("model_type")
        D = r.need("hidden_size", int)
        N = r.need("num_attention_heads", int)
        L = r.need("num_hidden_layers", int)
        theta, scaling = rope_from_hf(r)
        attn_bias = bool(r.get("attention_bias", False))
        mlp_bias = bool(r.get("mlp_bias", False))
        if model_type == "qwen2":
            if attn_bias or mlp_bias:
                raise r.error("attention_bias" if attn_bias else "mlp_bias", "Qwen2 has fixed biases (q, k, v only)")
            use_bias, qkv_bias = False, True
        elif model_type == "mistral":  # MistralForCausalLM has no biases whatever these keys say
            use_bias, qkv_bias = False, None
        else:
            if attn_bias != mlp_bias:
                raise r.error("attention_bias", f"attention_bias={attn_bias} with mlp_bias={mlp_bias} is not "
                                                "supported (jaxformer biases attention and MLP together)")
            use_bias, qkv_bias = attn_bias, None
        window = window_from_hf(r, model_type, L)
        return ModelConfig(
            kind="decoder", vocab_size=r.need("vocab_size", int), d_model=D, n_layers=L,
            max_seq_len=r.get("max_position_embeddings", 2048, types=int),
            attention=dict(n_heads=N, n_kv_heads=r.get("num_key_value_heads", N, types=int),
                           head_dim=r.get("head_dim", types=int), qkv_bias=qkv_bias),
            positions=dict(kind="rope", rope_base=theta, rope_scaling=scaling),
            ffn=dict(activation=activation_from_hf(r, "hidden_act", "silu", gated=True),
                     d_ff=r.need("intermediate_size", int)),
            norm=dict(kind="rmsnorm", placement="pre", eps=float(r.get("rms_norm_eps", 1e-6))),
            sparsity=dict(window=None if window is None else (window - 1, 0)),
            tie_embeddings=bool(r.get("tie_word_embeddings", False)), use_bias=use_bias,
        )

    def config_to_hf(self, config: ModelConfig) -> dict[str, Any]:
        c = config
        problems = []
        if (c.kind, c.positions.kind, c.norm.kind, c.norm.placement) != ("decoder", "rope", "rmsnorm", "pre"):
            problems.append(f"kind={c.kind!r}, positions.kind={c.positions.kind!r}, norm.kind={c.norm.kind!r}, "
                            f"norm.placement={c.norm.placement!r} (needs decoder, rope, rmsnorm, pre)")
        if c.ffn.activation not in ("swiglu", "geglu"):
            problems.append(f"ffn.activation={c.ffn.activation!r} (needs swiglu, or geglu: hidden_act gelu)")
        if c.positions.rope_interleaved:
            problems.append("positions.rope_interleaved=True")
        window = None
        if c.sparsity.window is not None:
            left, _ = c.sparsity.window
            if c.sparsity.global_tokens or c.sparsity.random_blocks is not None or left is None:
                problems.append(f"sparsity.window={c.sparsity.window} with global/random blocks")
            else:
                window = left + 1
        qkv_bias = c.use_bias if c.attention.qkv_bias is None else c.attention.qkv_bias
        if qkv_bias and not c.use_bias:
            model_type = "qwen2"
        elif window is not None:
            model_type = "mistral"
        else:
            model_type = "llama"
        if qkv_bias != c.use_bias and model_type != "qwen2":
            problems.append(f"attention.qkv_bias={c.attention.qkv_bias} with use_bias={c.use_bias}")
        if model_type == "mistral" and c.use_bias:
            problems.append("use_bias=True with a sliding window (Mistral has no biases; Qwen2 only q/k/v biases)")
        problems += set_options(c, ("norm.sandwich", "norm.embed", "scale_embeddings", "attention.softcap",
                                    "attention.scale", "logits_softcap", "hf_options.head_transform",
                                    "hf_options.head_bias"))
        for field, ok in (("attention.qkv_sharing", c.attention.qkv_sharing == "none"),
                          ("hf_options.type_vocab_size", not c.hf_options.type_vocab_size),
                          ("residual", c.residual), ("norm.final", c.norm.resolved_final)):
            if not ok:
                problems.append(f"{field}={get_key(c, field)!r}")
        if problems:
            raise HFConfigError(f"not expressible as a {model_type} config.json: " + "; ".join(problems))
        hf = dict(
            model_type=model_type, architectures=[ARCH[model_type]], vocab_size=c.vocab_size,
            hidden_size=c.d_model, intermediate_size=c.resolved_d_ff, num_hidden_layers=c.n_layers,
            num_attention_heads=c.attention.n_heads, num_key_value_heads=c.resolved_kv_heads,
            hidden_act="gelu" if c.ffn.activation == "geglu" else "silu", max_position_embeddings=c.max_seq_len,
            rms_norm_eps=c.norm.eps, tie_word_embeddings=c.tie_embeddings, rope_theta=c.positions.rope_base,
            rope_scaling=None,
        )
        if c.attention.head_dim is not None:
            hf["head_dim"] = c.attention.head_dim
        if model_type != "qwen2":
            hf.update(attention_bias=c.use_bias, mlp_bias=c.use_bias)
        if c.positions.rope_scaling is not None:
            s = c.positions.rope_scaling
            if s.kind not in ("linear", "llama3"):
                raise HFConfigError(f"rope_scaling.kind={s.kind!r} is not expressible in a {model_type} config.json")
            hf["rope_scaling"] = dict(rope_type=s.kind, factor=s.factor)
            if s.kind == "llama3":
                hf["rope_scaling"].update(original_max_position_embeddings=s.original_max_position,
                                          low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
        if model_type == "mistral":
            hf["sliding_window"] = window
        if model_type == "qwen2":  # layer i slides iff layer_types[i] says so (max_window_layers: older readers)
            hf.update(use_sliding_window=window is not None, sliding_window=window,
                      max_window_layers=0 if window is not None else c.n_layers,
                      layer_types=["sliding_attention" if window is not None else "full_attention"] * c.n_layers)
        # transformers >= 5 reads rope_parameters first: write it too, so a stale one (from hf_config) never wins
        hf["rope_parameters"] = {"rope_theta": c.positions.rope_base, "rope_type": "default",
                                 **(hf["rope_scaling"] or {})}
        return hf

    def rules(self, config: ModelConfig) -> list[Rule]:
        c = config
        D, N, K, H, F = c.d_model, c.attention.n_heads, c.resolved_kv_heads, c.resolved_head_dim, c.resolved_d_ff
        qkv_bias = c.use_bias if c.attention.qkv_bias is None else c.attention.qkv_bias
        out = [same("model.embed_tokens.weight", ("embed", "embedding")),
               same("model.norm.weight", ("decoder", "final_norm", "scale"))]
        if not c.tie_embeddings:
            out.append(transposed("lm_head.weight", ("head", "kernel")))
        for i in range(c.n_layers):
            hf, jx = f"model.layers.{i}.", ("decoder", "blocks", i)
            out += [
                same(hf + "input_layernorm.weight", jx + ("attn_residual", "norm", "scale")),
                same(hf + "post_attention_layernorm.weight", jx + ("mlp_residual", "norm", "scale")),
                linear(hf + "self_attn.q_proj.weight", jx + ("self_attn", "w_q"), (D,), (N, H)),
                linear(hf + "self_attn.k_proj.weight", jx + ("self_attn", "w_k"), (D,), (K, H)),
                linear(hf + "self_attn.v_proj.weight", jx + ("self_attn", "w_v"), (D,), (K, H)),
                linear(hf + "self_attn.o_proj.weight", jx + ("self_attn", "w_o"), (N, H), (D,)),
                linear(hf + "mlp.gate_proj.weight", jx + ("mlp", "w_gate"), (D,), (F,)),
                linear(hf + "mlp.up_proj.weight", jx + ("mlp", "w_up"), (D,), (F,)),
                linear(hf + "mlp.down_proj.weight", jx + ("mlp", "w_down"), (F,), (D,)),
            ]
            if qkv_bias:
                out += [reshaped(hf + "self_attn.q_proj.bias", jx + ("self_attn", "b_q"), (N, H)),
                        reshaped(hf + "self_attn.k_proj.bias", jx + ("self_attn", "b_k"), (K, H)),
                        reshaped(hf + "self_attn.v_proj.bias", jx + ("self_attn", "b_v"), (K, H))]
            if c.use_bias:
                out += [same(hf + "self_attn.o_proj.bias", jx + ("self_attn", "b_o")),
                        same(hf + "mlp.gate_proj.bias", jx + ("mlp", "b_gate")),
                        same(hf + "mlp.up_proj.bias", jx + ("mlp", "b_up")),
                        same(hf + "mlp.down_proj.bias", jx + ("mlp", "b_down"))]
        return out

    def ignored(self, config: ModelConfig) -> tuple[str, ...]:
        """Old checkpoints' ``rotary_emb.inv_freq`` buffers (any layer; recomputed from rope_theta)."""
        return self.ignore + tuple(f"model.layers.{i}.self_attn.rotary_emb." for i in range(config.n_layers))

    def tied_copies(self, config: ModelConfig) -> dict[str, str]:
        return {"lm_head.weight": "model.embed_tokens.weight"} if config.tie_embeddings else {}


FAMILIES = (LlamaFamily(),)
