"""GPT-2 (``jaxformer.interop.gpt2``) against transformers' own checkpoint (``fixtures/gpt2``).

The fixture is a tiny random ``GPT2LMHeadModel`` (2 layers, D=32, 4 heads, gelu_new, tied) whose
float32 logits transformers recorded on a right-padded batch; see ``make_fixtures.py``.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxformer.interop import HFConfigError, HFWeightsError, load_pretrained, save_pretrained
from jaxformer.interop import hf as hf_mod
from jaxformer.model import presets
from jaxformer.model.functional import apply
from tests.interop import decoder_checks as dc
from tests.interop.common import ATOL, BF16_RTOL, fixture, max_diff

forward = jax.jit(apply, static_argnums=0)


@pytest.fixture(scope="module")
def gpt2():
    d, expected, _ = fixture("gpt2")
    return (d, expected, *load_pretrained(d))


def logits_of(graphdef, state, expected):
    return forward(graphdef, state, jnp.asarray(expected["input_ids"], jnp.int32))


def test_config_translation(gpt2):
    _, _, config, _, _ = gpt2
    assert (config.kind, config.positions.kind, config.norm.kind, config.norm.placement) == ("decoder", "learned", "layernorm",
                                                                                  "pre")
    assert (config.d_model, config.n_layers, config.attention.n_heads, config.resolved_d_ff) == (32, 2, 4, 128)
    assert config.ffn.activation == "gelu_tanh" and config.tie_embeddings and config.use_bias
    assert config.max_seq_len == 32 and config.attention.scale is None and config.norm.eps == 1e-5


def test_float32_logits_match_transformers(gpt2):
    _, expected, _, graphdef, state = gpt2
    # right padding: a causal model's valid positions never see the padding after them
    assert max_diff(logits_of(graphdef, state, expected), expected["logits"], expected["attention_mask"]) < ATOL


@pytest.mark.slow  # 2.5 s; the same rounding and bf16 compute run by default on llama, mistral, bloom (LayerNorm,
# biases), bert (learned positions) and marian: test_llama.py's, test_bloom.py's, test_bert.py's, test_marian.py's
def test_bfloat16_load_is_close(gpt2):
    d, expected, *_ = gpt2
    config, graphdef, state = load_pretrained(d, dtype="bfloat16")
    assert config.compute_dtype == "bfloat16"
    assert {v.dtype for v in dc.flat(state).values()} == {np.dtype(jnp.bfloat16)}
    mask = expected["attention_mask"].astype(bool)
    tol = BF16_RTOL * float(expected["logits"][mask].std())
    assert max_diff(logits_of(graphdef, state, expected), expected["logits"], mask) < tol


def test_kv_cache_decoding_matches_transformers(gpt2):
    """Teacher-forced, token by token: the contiguous cache and the paged cache (as the engine calls it)
    give transformers' logits at every valid position and its logits at each greedy step."""
    _, expected, config, graphdef, state = gpt2
    tokens, mask, gen_prompt = dc.batch(expected)
    for run in (dc.contiguous_teacher_forced, dc.paged_teacher_forced):
        fixture_diff, gen_diff = dc.compare(run(config, graphdef, state, tokens), expected, mask, gen_prompt)
        assert fixture_diff < ATOL and gen_diff < ATOL, (run.__name__, fixture_diff, gen_diff)


def test_greedy_generation_matches_transformers(gpt2):
    _, expected, config, graphdef, state = gpt2
    assert dc.trusted_steps(expected) == 6  # every step of this fixture has a clear winner
    want, ours = dc.greedy(config, graphdef, state, expected)
    assert ours == want


def test_save_then_load_is_exact(gpt2, tmp_path):
    d, expected, config, graphdef, state = gpt2
    hf_config = json.loads((d / "config.json").read_text())
    out = save_pretrained(tmp_path / "out", config, state, hf_config=hf_config)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "gpt2" and written["architectures"] == ["GPT2LMHeadModel"]
    assert written["eos_token_id"] == hf_config["eos_token_id"]  # kept from hf_config
    assert set(load_file(out / "model.safetensors")) == set(load_file(d / "model.safetensors"))  # tied: no lm_head
    config2, _, state2 = load_pretrained(out)
    assert config2 == config
    ours, back = dc.flat(state), dc.flat(state2)
    assert ours.keys() == back.keys()
    for p in ours:
        np.testing.assert_array_equal(back[p], ours[p], err_msg=str(p))


@pytest.mark.parametrize("overrides", [dict(tie_embeddings=False, activation="gelu"), dict(attn_scale=1.0)])
def test_round_trip_of_untied_and_unscaled_models(overrides, tmp_path):
    """A jaxformer model with an untied head (lm_head.weight written and read) or without the
    1/sqrt(head_dim) scale (scale_attn_weights=False) comes back identical."""
    cfg = presets.get("gpt2_tiny", vocab_size=48, d_model=16, n_heads=2, n_layers=1, max_seq_len=8, **overrides)
    _, state = dc.random_state(cfg)
    out = save_pretrained(tmp_path, cfg, state)
    written = json.loads((out / "config.json").read_text())
    assert written["tie_word_embeddings"] == cfg.tie_embeddings
    assert written["scale_attn_weights"] == (cfg.attention.scale is None)
    assert ("lm_head.weight" in load_file(out / "model.safetensors")) == (not cfg.tie_embeddings)
    config, _, back = load_pretrained(out)
    assert hf_mod._behaviour(config) == hf_mod._behaviour(cfg)  # the same model (d_ff now explicit, ...)
    for p, v in dc.flat(state).items():
        np.testing.assert_array_equal(dc.flat(back)[p], v, err_msg=str(p))


def test_old_bare_checkpoint_with_buffers_and_a_tied_head_copy(gpt2, tmp_path):
    """The original ``gpt2`` upload's layout: a bare GPT2Model (no ``transformer.`` prefix) with the
    causal-mask buffers ``h.{i}.attn.bias`` / ``masked_bias`` and a copy of the tied ``lm_head``."""
    d, expected, _, graphdef, state = gpt2
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(d / "model.safetensors").items()}
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = np.tril(np.ones((32, 32), np.uint8))[None, None]
        tensors[f"h.{i}.attn.masked_bias"] = np.asarray(-1e4, np.float32)
    tensors["lm_head.weight"] = tensors["wte.weight"]
    dst = tmp_path / "old"
    dst.mkdir()
    shutil.copy(d / "config.json", dst / "config.json")
    save_file(tensors, str(dst / "model.safetensors"))
    _, _, loaded = load_pretrained(dst)
    for p, v in dc.flat(state).items():
        np.testing.assert_array_equal(dc.flat(loaded)[p], v, err_msg=str(p))
    # a stray tensor is still refused
    save_file({**tensors, "h.0.attn.extra": np.zeros(3, np.float32)}, str(dst / "model.safetensors"))
    with pytest.raises(HFWeightsError, match=r"unexpected tensors.*h\.0\.attn\.extra"):
        load_pretrained(dst)


@pytest.mark.parametrize("key, value, match", [
    ("scale_attn_by_inverse_layer_idx", True, "per-layer attention scale"),
    ("add_cross_attention", True, "cross-attention"),
    ("activation_function", "gelu_fast", "not supported"),
    ("n_head", 5, "not divisible"),
])
def test_unsupported_options_name_the_key_and_file(gpt2, tmp_path, key, value, match):
    d = gpt2[0]
    dst = tmp_path / "bad"
    shutil.copytree(d, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, key: value}))
    with pytest.raises(HFConfigError, match=rf"config\.json: {key}: .*{match}"):
        load_pretrained(dst)


def test_harmless_options_are_accepted(gpt2, tmp_path):
    """``reorder_and_upcast_attn`` only upcasts the attention scores (jaxformer keeps them in float32)."""
    d, expected, *_ = gpt2
    dst = tmp_path / "ok"
    shutil.copytree(d, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "reorder_and_upcast_attn": True}))
    load_pretrained(dst)


def test_config_to_hf_refuses_what_gpt2_cannot_express(tmp_path):
    with pytest.raises(HFConfigError, match="not expressible as a gpt2 config.json.*positions.kind='rope'"):
        save_pretrained(tmp_path, presets.get("llama_tiny"), None, model_type="gpt2")
    assert not any(tmp_path.iterdir())  # refused before writing anything
