"""LLaMA, Llama 3 (both config forms), Qwen2 and Mistral (``jaxformer.interop.llama``) against transformers.

Fixtures (``make_fixtures.py``): tiny random ``LlamaForCausalLM`` (GQA 4:2, untied, 3 safetensors shards
with an index), Llama 3 (rope_type llama3 with original_max_position 64, so one frequency is kept, one
smoothed and six divided by the factor; tied head) written by transformers 5 (``rope_parameters``) and
hand-edited into the legacy form (``rope_theta`` + ``rope_scaling``), ``Qwen2ForCausalLM`` (q/k/v biases)
and ``MistralForCausalLM`` with ``sliding_window=4`` over 10 tokens (positions 4-9 differ by 2.5-4.4 from
full attention, so a wrong window cannot pass).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxformer.interop import HFConfigError, load_pretrained, save_pretrained
from jaxformer.interop.hf import read_config
from jaxformer.model.functional import apply
from tests.interop import decoder_checks as dc
from tests.interop.common import ATOL, BF16_RTOL, fixture, max_diff

NAMES = ("llama", "llama3", "llama3_legacy", "qwen2", "mistral")
forward = jax.jit(apply, static_argnums=0)


@pytest.fixture(scope="module", params=NAMES)
def loaded(request):
    d, expected, meta = fixture(request.param)
    return (request.param, d, expected, *load_pretrained(d))


def flat(state) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def families(*slow: str):
    """``loaded`` over every fixture, those named in ``slow`` marked slow."""
    return pytest.mark.parametrize("loaded", [pytest.param(n, marks=pytest.mark.slow) if n in slow else n
                                              for n in NAMES], indirect=True)


def test_config_translation():
    cfgs = {name: load_pretrained(fixture(name)[0])[0] for name in NAMES}
    llama = cfgs["llama"]
    assert (llama.attention.n_heads, llama.resolved_kv_heads, llama.resolved_head_dim, llama.resolved_d_ff) == (4, 2, 8, 64)
    assert not llama.tie_embeddings and llama.norm.kind == "rmsnorm" and llama.ffn.activation == "swiglu"
    assert llama.positions.rope_scaling is None and llama.sparsity.window is None
    l3 = cfgs["llama3"]
    assert l3.tie_embeddings and l3.positions.rope_base == 500000.0
    assert (l3.positions.rope_scaling.kind, l3.positions.rope_scaling.factor, l3.positions.rope_scaling.original_max_position) == \
        ("llama3", 8.0, 64)
    assert cfgs["llama3_legacy"] == l3  # the two config forms read the same
    assert "rope_parameters" in read_config(fixture("llama3")[0])
    assert "rope_scaling" in read_config(fixture("llama3_legacy")[0])
    assert cfgs["qwen2"].attention.qkv_bias and not cfgs["qwen2"].use_bias
    assert cfgs["mistral"].sparsity.window == (3, 0)  # sliding_window 4: itself and the 3 before


def test_float32_logits_match_transformers(loaded):
    name, _, expected, config, graphdef, state = loaded
    logits = forward(graphdef, state, jnp.asarray(expected["input_ids"], jnp.int32))
    diff = max_diff(logits, expected["logits"], expected["attention_mask"])
    assert diff < ATOL, (name, diff)


# slow: 2 s; the same rounding and bf16 compute run by default on llama and mistral (the largest measured difference)
@families("llama3", "llama3_legacy", "qwen2")
def test_bfloat16_load_is_close(loaded):
    name, d, expected, *_ = loaded
    config, graphdef, state = load_pretrained(d, dtype="bfloat16")
    ours, full = flat(state), flat(loaded[5])
    assert all(ours[p].dtype == jnp.bfloat16 and np.array_equal(ours[p], full[p].astype(jnp.bfloat16))
               for p in full)  # each parameter is the float32 one rounded to bf16
    mask = expected["attention_mask"].astype(bool)
    logits = forward(graphdef, state, jnp.asarray(expected["input_ids"], jnp.int32))
    tol = BF16_RTOL * float(expected["logits"][mask].std())
    assert max_diff(logits, expected["logits"], mask) < tol, name


# slow: 4 s + llama's 3.6 s; mistral runs by default: llama's weights layout and GQA 4:2 with RoPE, plus its window in
# both caches; without a band, the contiguous cache's greedy tokens equal full recomputes on a RoPE model
# (test_kv_cache.py) and the paged engine's equal the contiguous cache's (test_engine.py), default-run, and llama's
# full forward equals transformers' (its logits test).
# llama3's scaling is only its RoPE frequencies (its logits test), qwen2's q/k/v biases decode as gpt2's and bloom's
# do (their default-run tests)
@families("llama", "llama3", "qwen2")
def test_kv_cache_decoding_matches_transformers(loaded):
    """Teacher-forced with the contiguous cache and the paged cache: every valid position and every
    greedy step's logits equal transformers' (for Mistral, the window applies inside the caches)."""
    if loaded[0] == "llama3_legacy":
        pytest.skip("same ModelConfig and weights as llama3 (test_config_translation, the logits test)")
    name, _, expected, config, graphdef, state = loaded
    tokens, mask, gen_prompt = dc.batch(expected)
    for run in (dc.contiguous_teacher_forced, dc.paged_teacher_forced):
        fixture_diff, gen_diff = dc.compare(run(config, graphdef, state, tokens), expected, mask, gen_prompt)
        assert fixture_diff < ATOL and gen_diff < ATOL, (name, run.__name__, fixture_diff, gen_diff)


# slow: 4 s + llama's 2.8 s; the engine on mistral (llama's layout and GQA, with its window) and on gpt2 runs by
# default
@families("llama", "llama3", "qwen2")
def test_greedy_generation_matches_transformers(loaded):
    if loaded[0] == "llama3_legacy":
        pytest.skip("same ModelConfig and weights as llama3 (test_config_translation, the logits test)")
    name, _, expected, config, graphdef, state = loaded
    want, ours = dc.greedy(config, graphdef, state, expected)
    assert len(want) >= 3, (name, "the fixture has too few clear greedy steps to check")
    assert ours == want, name


def test_round_trip_is_exact_and_keeps_the_config_form(loaded, tmp_path):
    name, d, expected, config, graphdef, state = loaded
    original = read_config(d)
    out = save_pretrained(tmp_path / name, config, state, hf_config=original)
    written = read_config(out)
    assert written["model_type"] == original["model_type"] and written["architectures"] == original["architectures"]
    back_config, _, back = load_pretrained(out)
    assert back_config == config
    a, b = flat(state), flat(back)
    assert a.keys() == b.keys() and all(np.array_equal(a[p], b[p]) for p in a)
    stored = set(load_file(str(out / "model.safetensors"))) if (out / "model.safetensors").is_file() else set()
    assert ("lm_head.weight" in stored) == (not config.tie_embeddings)  # a tied head is not stored
    # every rope key agrees (transformers 5 reads rope_parameters first, older versions rope_theta)
    assert written["rope_theta"] == written["rope_parameters"]["rope_theta"] == config.positions.rope_base
    assert written["max_position_embeddings"] == original["max_position_embeddings"]


def test_mixed_sliding_layers_are_refused(tmp_path):
    d, *_ = fixture("qwen2")
    for f in d.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = read_config(d)
    n = cfg["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True, "sliding_window": 4,
                                                      "max_window_layers": n - 1, "layer_types": None}))
    with pytest.raises(HFConfigError, match="max_window_layers"):
        load_pretrained(tmp_path)
    types = ["full_attention"] * (n - 1) + ["sliding_attention"]
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True, "sliding_window": 4,
                                                      "layer_types": types}))
    with pytest.raises(HFConfigError, match="layer_types"):
        load_pretrained(tmp_path)


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("keys, window", [
    ({"use_sliding_window": False, "sliding_window": 4}, None),
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}, 4),   # layer i slides iff i >= 0
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}, None),  # ... iff i >= 2: none
    ({"use_sliding_window": True, "sliding_window": 4}, None),  # max_window_layers defaults to 28 > 2 layers
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2,
      "layer_types": ["sliding_attention"] * 2}, 4),  # layer_types wins over max_window_layers
])
def test_qwen2_sliding_layers_read_as_transformers_reads_them(tmp_path, keys, window):
    """Qwen2Config.__post_init__ (transformers 5.24): sliding_window only with use_sliding_window, and
    layer i slides iff layer_types[i] == 'sliding_attention', by default iff i >= max_window_layers."""
    d = _copy(fixture("qwen2")[0], tmp_path / "q")
    cfg = {k: v for k, v in read_config(d).items() if k not in ("layer_types", "max_window_layers")}
    (d / "config.json").write_text(json.dumps({**cfg, **keys}))
    config = load_pretrained(d)[0]
    assert config.sparsity.causal_window == window


def test_qwen2_window_is_written_so_every_layer_slides(tmp_path):
    d, *_ = fixture("qwen2")
    config, _, state = load_pretrained(d, attention_window=(3, 0))
    written = read_config(save_pretrained(tmp_path / "out", config, state, hf_config=read_config(d)))
    assert written["use_sliding_window"] and written["sliding_window"] == 4 and written["max_window_layers"] == 0
    assert written["layer_types"] == ["sliding_attention"] * config.n_layers
    assert load_pretrained(tmp_path / "out")[0].sparsity.causal_window == 4


def test_mistral_ignores_bias_keys_and_layer_types_as_transformers_does(tmp_path):
    d = _copy(fixture("mistral")[0], tmp_path / "m")
    cfg = read_config(d)
    (d / "config.json").write_text(json.dumps({**cfg, "attention_bias": True, "mlp_bias": True,
                                               "layer_types": ["full_attention"] * cfg["num_hidden_layers"]}))
    config = load_pretrained(d)[0]
    assert not config.use_bias and not config.resolved_qkv_bias and config.sparsity.causal_window == 4


def test_a_biased_model_with_a_window_is_not_written_as_mistral(tmp_path):
    d, *_ = fixture("mistral")
    config, _, state = load_pretrained(d)
    biased = config.model_copy(update=dict(use_bias=True))
    from jaxformer.model.functional import abstract_init

    _, state = abstract_init(biased)  # refused from the config alone, before a parameter is read
    with pytest.raises(HFConfigError, match="use_bias=True with a sliding window"):
        save_pretrained(tmp_path / "out", biased, state)


def test_a_stored_tied_head_must_equal_the_embedding(tmp_path):
    d = _copy(fixture("llama3")[0], tmp_path / "l3")
    assert read_config(d)["tie_word_embeddings"]
    tensors = load_file(str(d / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    save_file({**tensors, "lm_head.weight": embed.copy()}, str(d / "model.safetensors"), metadata={"format": "pt"})
    load_pretrained(d)  # an equal copy is harmless
    save_file({**tensors, "lm_head.weight": embed + 1.0}, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"lm_head\.weight differs from model\.embed_tokens\.weight"):
        load_pretrained(d)


def test_rotary_buffers_of_every_layer_are_skipped(tmp_path):
    d = _copy(fixture("llama3")[0], tmp_path / "l3")
    tensors = load_file(str(d / "model.safetensors"))
    n = read_config(d)["num_hidden_layers"]
    buffers = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32) for i in range(n)}
    save_file({**tensors, **buffers}, str(d / "model.safetensors"), metadata={"format": "pt"})
    assert load_pretrained(d)[0] == load_pretrained(fixture("llama3")[0])[0]
