"""ModelConfig validation, presets, parameter count and FLOPs (abstract shapes only: nothing allocated)."""

import jax
import pytest
import yaml
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from jaxformer.model import ModelConfig, abstract_init, apply, count_params, flops_per_token, matmul_params, presets
from jaxformer.model.transformer import Transformer
from jaxformer.nn import LOGICAL_AXES
from jaxformer.ops.positional import RopeScaling


def n_leaves(config) -> int:
    """Parameters actually created: the sum of the abstract state's leaf sizes."""
    return sum(x.size for x in jax.tree.leaves(abstract_init(config)[1]))


# ---------------------------------------------------------------- validation
# Sectioned keys, as presets and YAML write them (the flat keys of before are tested in test_config_sections).
# Pydantic prefixes a section's errors with its path ("attention.scale"), so each names where to look.
@pytest.mark.parametrize("kwargs,pattern", [
    (dict(attention=dict(n_heads=8, n_kv_heads=3)), r"attention\n.*n_heads=8 not divisible by n_kv_heads=3"),
    (dict(d_model=100, attention=dict(n_heads=8)), r"d_model=100 not divisible by attention.n_heads=8; set "
                                                    r"attention.head_dim"),
    (dict(d_model=96, attention=dict(n_heads=8, head_dim=3), positions=dict(kind="rope")),
     r"positions.kind='rope' needs an even head dim, got head_dim=3"),
    (dict(d_model=24, attention=dict(n_heads=8), positions=dict(kind="rope")), r"even head dim, got head_dim=3"),
    (dict(kind="encoder_decoder"), r"n_encoder_layers > 0.*n_encoder_layers=None"),
    (dict(n_encoder_layers=2), r"n_encoder_layers=2 only applies to kind='encoder_decoder'"),
    (dict(ffn=dict(activation="tanh")), r"ffn.activation\n.*activation='tanh' is not one of"),
    (dict(norm=dict(placement="post", sandwich=True)), r"norm\n.*sandwich needs placement='pre'"),
    (dict(positions=dict(kind="alibi", rope_scaling=dict(kind="linear", factor=2.0))),
     r"positions\n.*rope_scaling is set but kind='alibi'"),
    (dict(param_dtype="float64"), r"param_dtype"),
    (dict(d_model=0), r"d_model"),
    (dict(unknown_key=1), r"unknown_key"),
    (dict(attention=dict(unknown=1)), r"attention.unknown"),
    (dict(attention=dict(n_heads=4, n_kv_heads=2, qkv_sharing="qk")),
     r"qkv_sharing='qk' shares W_q with W_k, so it needs n_kv_heads = n_heads, got n_kv_heads=2"),
    (dict(attention=dict(qkv_sharing="kv")), r"attention.qkv_sharing"),
    (dict(attention=dict(scale=0.0)), r"attention.scale"),
    (dict(hf_options=dict(type_vocab_size=-1)), r"hf_options.type_vocab_size"),
    (dict(hf_options=dict(head_transform=True), ffn=dict(activation="swiglu")),
     r"hf_options.head_transform needs a non-gated activation.*ffn.activation='swiglu'"),
    (dict(positions=dict(sinusoidal_layout="halves")), r"sinusoidal_layout='halves' is set but kind='rope'"),
    (dict(positions=dict(kind="sinusoidal", sinusoidal_layout="split")), r"positions.sinusoidal_layout"),
    (dict(attention=dict(qkv_bias="maybe")), r"attention.qkv_bias"),
    (dict(n_heads=8, attention=dict(n_heads=4)), r"attention.n_heads given twice.*\['n_heads'\]"),
    (dict(norm_position="post", sandwich_norm=True), r"sandwich needs placement='pre'"),  # flat keys, migrated
])
def test_config_rejects(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ModelConfig(**kwargs)
    assert issubclass(ValidationError, ValueError)


def test_config_defaults_and_derived_values():
    cfg = ModelConfig(d_model=96, attention=dict(n_heads=6, n_kv_heads=2), ffn=dict(activation="swiglu", multiple_of=32))
    assert (cfg.resolved_head_dim, cfg.resolved_kv_heads, cfg.resolved_d_ff) == (16, 2, 256)
    assert cfg.norm.resolved_final  # pre-norm default
    assert not ModelConfig(norm=dict(placement="post")).norm.resolved_final
    assert ModelConfig(d_model=20, attention=dict(n_heads=4, head_dim=8)).resolved_head_dim == 8
    scaled = ModelConfig(positions=dict(rope_scaling=dict(kind="yarn", factor=4.0)))
    assert scaled.positions.rope == RopeScaling(kind="yarn", factor=4.0)
    with pytest.raises(ValidationError):  # frozen
        cfg.d_model = 8


def test_checkpoint_options_default_off_and_derive():
    cfg = ModelConfig()
    assert (cfg.attention.qkv_bias, cfg.hf_options.type_vocab_size, cfg.hf_options.head_transform, cfg.hf_options.head_bias, cfg.positions.sinusoidal_layout) == (
        None, 0, False, False, "interleaved")
    assert not cfg.resolved_qkv_bias and ModelConfig(use_bias=True).resolved_qkv_bias
    assert ModelConfig(qkv_bias=True).resolved_qkv_bias
    assert not ModelConfig(use_bias=True, qkv_bias=False).resolved_qkv_bias
    # the sliding window W of a causal band (W-1, right): HF Mistral's sliding_window
    assert cfg.sparsity.causal_window is None and ModelConfig(attention_window=(None, 0)).sparsity.causal_window is None
    assert ModelConfig(attention_window=(4095, 0)).sparsity.causal_window == 4096
    assert ModelConfig(attention_window=(7, None)).sparsity.causal_window == 8


def test_checkpoint_options_from_yaml_and_preset_overrides():
    text = """
kind: encoder
vocab_size: 64
d_model: 32
n_heads: 4
position: sinusoidal
sinusoidal_layout: halves
qkv_bias: false
use_bias: true
type_vocab_size: 2
head_transform: true
head_bias: true
"""
    cfg = ModelConfig.model_validate(yaml.safe_load(text))
    assert (cfg.positions.sinusoidal_layout, cfg.attention.qkv_bias, cfg.hf_options.type_vocab_size, cfg.hf_options.head_transform, cfg.hf_options.head_bias) == (
        "halves", False, 2, True, True)
    assert ModelConfig.model_validate(yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json")))) == cfg
    mistral = presets.get("llama_tiny", attention_window=[3, 0], qkv_bias=True)
    assert mistral.sparsity.causal_window == 4 and mistral.resolved_qkv_bias
    for name in ("attention.qkv_bias", "hf_options.type_vocab_size", "hf_options.head_transform",
                 "hf_options.head_bias", "positions.sinusoidal_layout"):
        section, field = name.split(".")
        assert type(getattr(cfg, section)).model_fields[field].description, name


def test_presets_get_overrides_and_names():
    assert set(presets.names()) >= {"vaswani_base", "gpt2_small", "llama_7b", "llama3_1b", "bloom_560m",
                                    "vaswani_tiny", "gpt2_tiny", "llama_tiny", "bloom_tiny"}
    llama = presets.llama_7b()
    assert llama.resolved_d_ff == 11008 and llama.resolved_kv_heads == 32
    half = presets.get("llama_7b", d_model=2048, n_heads=16)  # derived fields re-derive
    assert half.resolved_head_dim == 128 and half.resolved_d_ff == 5632
    assert presets.get("llama_7b", d_model=2048, attention=dict(n_heads=16)) == half  # a section merges field by field
    assert half.positions == llama.positions and half.ffn.multiple_of == 256
    assert presets.get("llama_tiny").resolved_kv_heads < presets.get("llama_tiny").attention.n_heads
    assert presets.get("llama3_1b").resolved_kv_heads == 8
    with pytest.raises(ValueError, match="unknown preset 'gpt5'"):
        presets.get("gpt5")
    with pytest.raises(ValueError, match="n_layer"):
        presets.get("gpt2_small", n_layer=3)


# ---------------------------------------------------------------- parameter count
# Published sizes (model cards / papers): GPT-2 small 124,439,808 (tied embeddings, 1024
# learned positions); LLaMA-7B 6,738,415,616; Llama-3.2-1B 1,235,814,400 (tied);
# BLOOM-560m 559,214,592. Vaswani base is quoted as "65M" (Table 3); the formula's exact
# value with one shared 37000-token table and no final norms is 63,082,496.
PUBLISHED = {"gpt2_small": 124_439_808, "llama_7b": 6_738_415_616, "llama3_1b": 1_235_814_400,
             "bloom_560m": 559_214_592, "vaswani_base": 63_082_496}

# Checkpoints that need the loading options, as Hugging Face counts them (model.num_parameters()):
# BertForMaskedLM bert-base-uncased 109,514,298 (no pooler; token types, MLM transform, output bias;
# the decoder weight is tied); Qwen2-0.5B 494,032,768 (biases on q, k, v only, tied); Mistral-7B-v0.1
# 7,241,732,096 (the sliding window adds nothing).
HF_CHECKPOINTS = {
    "bert_base_mlm": (dict(kind="encoder", vocab_size=30522, d_model=768, n_layers=12, n_heads=12, d_ff=3072,
                           activation="gelu", norm_position="post", norm_eps=1e-12, embed_norm=True,
                           position="learned", max_seq_len=512, use_bias=True, type_vocab_size=2,
                           head_transform=True, head_bias=True), 109_514_298),
    "qwen2_0_5b": (dict(vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, d_ff=4864,
                        activation="swiglu", norm="rmsnorm", norm_eps=1e-6, rope_base=1e6, max_seq_len=32768,
                        qkv_bias=True, tie_embeddings=True), 494_032_768),
    "mistral_7b": (dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
                        activation="swiglu", norm="rmsnorm", max_seq_len=32768, attention_window=(4095, 0),
                        tie_embeddings=False), 7_241_732_096),
}


@pytest.mark.parametrize("name", sorted(HF_CHECKPOINTS))
def test_hf_checkpoint_param_count_formula_tree_and_published(name):
    fields, published = HF_CHECKPOINTS[name]
    cfg = ModelConfig(**fields)
    assert count_params(cfg) == published
    assert n_leaves(ModelConfig(**fields, scan_layers=True)) == published


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_big_preset_param_count_formula_tree_and_published(name):
    cfg = presets.get(name)
    assert count_params(cfg) == PUBLISHED[name]
    # Built scanned (one abstract block, much faster to trace: 2.7 s for the 6- and 12-layer ones unscanned), as
    # the checkpoints above are; the hypothesis test below checks scanned and unscanned trees count alike.
    assert n_leaves(presets.get(name, scan_layers=True)) == PUBLISHED[name]


def test_scanned_stack_has_layers_axis_and_same_count():
    cfg = presets.get("llama_7b", scan_layers=True)
    _, state = abstract_init(cfg)
    assert sum(x.size for x in jax.tree.leaves(state)) == 6_738_415_616
    axes = {path: v.get_metadata()["out_sharding"] for path, v in nnx.to_flat_state(state)}
    w_q = axes[("decoder", "blocks", "self_attn", "w_q")]
    assert w_q == ("layers", "embed", "heads", "head_dim")
    assert axes[("embed", "embedding")] == ("vocab", "embed")
    assert all(set(a) <= set(LOGICAL_AXES) | {None} for a in axes.values())
    # one rules table must name every logical axis (None: replicated); flax leaves unnamed ones as is
    rules = (("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"), ("kv_heads", "tensor"),
             ("head_dim", None), ("mlp", "tensor"), ("layers", None))
    with nnx.logical_axis_rules(rules):
        specs = dict(nnx.to_flat_state(nnx.get_partition_spec(state)))
    P = jax.sharding.PartitionSpec
    assert specs[("decoder", "blocks", "self_attn", "w_q")].get_value() == P(None, "fsdp", "tensor", None)


configs = st.builds(
    dict,
    kind=st.sampled_from(["decoder", "encoder", "encoder_decoder"]),
    norm=st.sampled_from(["layernorm", "rmsnorm"]),
    norm_position=st.sampled_from(["pre", "post", "deepnorm"]),
    sandwich=st.booleans(),
    position=st.sampled_from(["rope", "alibi", "sinusoidal", "learned", "none"]),
    activation=st.sampled_from(["relu", "gelu_tanh", "swiglu", "geglu"]),
    tie=st.booleans(), bias=st.booleans(), embed_norm=st.booleans(),
    kv=st.sampled_from([1, 2, 4]), final_norm=st.sampled_from([None, True, False]),
    scan=st.booleans(), sharing=st.sampled_from(["none", "qk", "qkv"]),
    qkv_bias=st.sampled_from([None, True, False]), types=st.sampled_from([0, 3]),
    head_transform=st.booleans(), head_bias=st.booleans(),
)


@given(configs)
def test_count_params_equals_created_params(c):
    cfg = ModelConfig(
        kind=c["kind"], vocab_size=97, d_model=32, n_layers=2,
        n_encoder_layers=3 if c["kind"] == "encoder_decoder" else None, n_heads=4,
        n_kv_heads=c["kv"] if c["sharing"] == "none" else 4, qkv_sharing=c["sharing"],
        norm=c["norm"], norm_position=c["norm_position"],
        sandwich_norm=c["sandwich"] and c["norm_position"] == "pre", position=c["position"],
        activation=c["activation"], tie_embeddings=c["tie"], use_bias=c["bias"],
        embed_norm=c["embed_norm"], final_norm=c["final_norm"], max_seq_len=16, scan_layers=c["scan"],
        qkv_bias=c["qkv_bias"], type_vocab_size=c["types"], head_bias=c["head_bias"],
        head_transform=c["head_transform"] and c["activation"] not in ("swiglu", "geglu"),
    )
    assert count_params(cfg) == n_leaves(cfg)


def test_flops_per_token_gpt2_small():
    """6 N_matmul + 12 L T d_attn, with the terms written out by hand for GPT-2 small at T=1024."""
    L, D, F, V, T = 12, 768, 3072, 50257, 1024
    n_matmul = L * (4 * D * D + 2 * D * F) + D * V  # attention + MLP weights + tied head
    assert flops_per_token(presets.gpt2_small(), T) == 6 * n_matmul + 12 * L * T * D
    # Kaplan et al.'s C ~ 6N for the non-embedding N (85M) + head: within 15% at T=1024.
    assert abs(flops_per_token(presets.gpt2_small(), T) / (6 * 124_439_808) - 1) < 0.15
    with pytest.raises(ValueError, match="seq_len=0"):
        flops_per_token(presets.gpt2_small(), 0)


def test_matmul_params_count_the_head_transform():
    bert = ModelConfig(**HF_CHECKPOINTS["bert_base_mlm"][0])
    L, D, F, V = 12, 768, 3072, 30522
    assert matmul_params(bert) == L * (4 * D * D + 2 * D * F) + D * V + D * D
    assert matmul_params(bert.replace(head_transform=False)) == L * (4 * D * D + 2 * D * F) + D * V


def test_flops_per_token_encoder_decoder_counts_cross_attention():
    cfg = presets.vaswani_base()
    D, F, V, T = 512, 2048, 37000, 64
    enc = 6 * (4 * D * D + 2 * D * F)
    dec = 6 * (8 * D * D + 2 * D * F)
    assert flops_per_token(cfg, T) == 6 * (enc + dec + D * V) + 12 * T * D * (6 + 2 * 6)


@pytest.mark.no_typecheck
def test_wrong_token_rank_and_dtype_raise():
    model = nnx.eval_shape(lambda: Transformer(presets.get("gpt2_tiny")))
    x3 = jax.ShapeDtypeStruct((2, 3, 4), "int32")
    with pytest.raises(ValueError, match=r"tokens must be int \[B, T\]; got tokens.shape=\(2, 3, 4\)"):
        nnx.eval_shape(lambda m, t: m(t), model, x3)
    with pytest.raises(ValueError, match="integer array; got dtype float32"):
        nnx.eval_shape(lambda m, t: m(t), model, jax.ShapeDtypeStruct((2, 3), "float32"))
    with pytest.raises(ValueError, match=r"T=200 exceeds max_seq_len=128"):
        nnx.eval_shape(lambda m, t: m(t), model, jax.ShapeDtypeStruct((1, 200), "int32"))
    with pytest.raises(ValueError, match=r"segment_ids.shape=\(2, 5\) must be \[B, T\]"):
        nnx.eval_shape(lambda m, t, s: m(t, segment_ids=s), model, jax.ShapeDtypeStruct((2, 3), "int32"),
                       jax.ShapeDtypeStruct((2, 5), "int32"))
    with pytest.raises(ValueError, match="positions .* are required with cache"):
        nnx.eval_shape(lambda m, t: m(t, cache=[None, None]), model, jax.ShapeDtypeStruct((2, 3), "int32"))
    encdec = nnx.eval_shape(lambda: Transformer(presets.get("vaswani_tiny")))
    with pytest.raises(ValueError, match=r"model\(src_tokens, tgt_tokens\)"):
        nnx.eval_shape(lambda m, t: m(t), encdec, jax.ShapeDtypeStruct((2, 3), "int32"))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_big_preset_forward_traces_under_jit(name):
    """Full-size presets are too big to run here: trace init + jitted forward abstractly instead."""
    cfg = presets.get(name, scan_layers=True)
    graphdef, state = abstract_init(cfg)
    tokens = jax.ShapeDtypeStruct((2, 16), jax.numpy.int32)
    fwd = jax.jit(lambda state, tokens, *tgt: apply(graphdef, state, tokens, *tgt))
    tgt = (tokens,) if cfg.kind == "encoder_decoder" else ()
    out = jax.eval_shape(fwd, state, tokens, *tgt)
    assert out.shape == (2, 16, cfg.vocab_size) and out.dtype == jax.numpy.float32
