"""Marian (``MarianMTModel``) against transformers' own outputs: encoder, decoder logits, generate.

Fixtures (``make_fixtures.py``): ``marian`` (a random 2+2-layer model, its outputs, greedy and 3-beam
``generate``) and ``marian_generate`` (``generate`` on the same model with ``</s>`` made likely, so
hypotheses finish early and compete under length penalties / early stopping). Measured (float32):
encoder max |diff| 1.9e-6, logits 1.5e-6; bfloat16 logits within ``BF16_RTOL`` of their spread; every
generated token equal (the recorded greedy steps' smallest top-2 margin is 0.07: no near-tie).
``check_marian_live.py`` is the other direction (jaxformer writes, transformers reads), run by hand.
"""

from __future__ import annotations

import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxformer.decode.translate import TranslationConfig, beam_translate, greedy_translate
from jaxformer.interop import HFConfigError, HFWeightsError, load_pretrained, load_tokenizer, save_pretrained
from jaxformer.interop.hf import config_from_hf, read_config
from jaxformer.interop.marian import MarianFamily, marian_sinusoids, translation_kwargs
from jaxformer.model import presets
from jaxformer.model.config import ModelConfig
from jaxformer.model.functional import abstract_init
from jaxformer.model.transformer import Transformer
from jaxformer.ops.positional import sinusoidal_positions
from tests.interop.common import ATOL, BF16_RTOL, fixture, max_diff
from tests.interop.decoder_checks import random_state


@pytest.fixture(scope="module")
def marian():
    d, expected, meta = fixture("marian")
    config, graphdef, state = load_pretrained(d)
    return d, expected, meta, config, graphdef, state


@functools.partial(jax.jit, static_argnums=0)
def _encode_decode(graphdef, state, src, lengths, tgt):
    model = nnx.merge(graphdef, state)
    memory = model.encode(src, lengths=lengths)
    return memory, model.decode(tgt, memory, memory_lengths=lengths)


def _forward(graphdef, state, expected):
    """``(encoder output, logits)`` of the fixture's inputs, source padding given as lengths."""
    memory, logits = _encode_decode(graphdef, state, jnp.asarray(expected["input_ids"], jnp.int32),
                                    jnp.asarray(expected["attention_mask"].sum(1), jnp.int32),
                                    jnp.asarray(expected["decoder_input_ids"], jnp.int32))
    return np.asarray(memory, np.float32), np.asarray(logits)


def _flat(state) -> dict:
    return {p: np.asarray(v.get_value() if isinstance(v, nnx.Variable) else v) for p, v in nnx.to_flat_state(state)}


def test_config(marian):
    d, _, _, config, _, _ = marian
    assert config.kind == "encoder_decoder" and (config.n_encoder_layers, config.n_layers) == (2, 2)
    assert (config.norm.placement, config.positions.kind, config.positions.sinusoidal_layout) == ("post", "sinusoidal", "halves")
    assert config.ffn.activation == "silu" and config.scale_embeddings and config.hf_options.head_bias and config.tie_embeddings


def test_positions_are_marians_table():
    """jaxformer's "halves" sinusoids are MarianSinusoidalPositionalEmbedding's table."""
    ours = np.asarray(sinusoidal_positions(jnp.arange(64), 32, layout="halves"))
    assert np.abs(ours - marian_sinusoids(64, 32)).max() < 1e-5


def test_encoder_and_logits_match_transformers(marian):
    _, expected, _, _, graphdef, state = marian
    memory, logits = _forward(graphdef, state, expected)
    enc = max_diff(memory, expected["encoder_last_hidden_state"], expected["attention_mask"])
    dec = max_diff(logits, expected["logits"], expected["decoder_attention_mask"])
    assert enc < ATOL and dec < ATOL, (enc, dec)


def test_bfloat16_within_tolerance(marian):
    d, expected, _, _, _, _ = marian
    config, graphdef, state = load_pretrained(d, dtype="bfloat16")
    assert config.compute_dtype == "bfloat16"
    _, logits = _forward(graphdef, state, expected)
    mask = expected["decoder_attention_mask"].astype(bool)
    spread = float(expected["logits"][mask].std())
    assert max_diff(logits, expected["logits"], mask) < BF16_RTOL * spread


def test_greedy_and_beam_match_generate(marian):
    d, expected, _, config, graphdef, state = marian
    model = nnx.merge(graphdef, state)
    src, lengths = expected["input_ids"], expected["attention_mask"].sum(1)
    steps = expected["generated_ids"].shape[1] - 1   # max_new_tokens=8 in the recorded calls
    greedy = greedy_translate(model, src, lengths,
                              config=TranslationConfig(**translation_kwargs(d)).replace(max_new_tokens=steps))
    np.testing.assert_array_equal(greedy, expected["generated_ids"])
    # no near-tie: the smallest top-2 margin of the recorded greedy steps is well above float32 noise
    assert expected["generated_top2_margin"].min() > 1e-2
    beam = beam_translate(model, src, lengths, config=TranslationConfig(**translation_kwargs(d, beam=True)).replace(
        max_new_tokens=steps, num_beams=3))
    np.testing.assert_array_equal(beam, expected["beam_ids"])


def test_generate_with_early_eos():
    """Hypotheses that finish early, length penalties and every early_stopping mode (see the module doc)."""
    d, _, _ = fixture("marian")
    gen_dir, expected, meta = fixture("marian_generate")
    _, graphdef, state = load_pretrained(d)
    model = nnx.merge(graphdef, state)
    model.logits_bias[...] = model.logits_bias[...].at[meta["eos_token_id"]].add(meta["boost"])
    kw = translation_kwargs(d, beam=True)
    for case in meta["cases"]:
        common = TranslationConfig(max_new_tokens=case["max_new_tokens"], start_id=kw["start_id"],
                                   eos_id=kw["eos_id"], pad_id=kw["pad_id"], suppress_ids=kw["suppress_ids"],
                                   force_eos=kw["force_eos"])
        if case["num_beams"] == 1:
            ours = greedy_translate(model, expected["src"], expected["src_lengths"], config=common)
        else:
            ours = beam_translate(model, expected["src"], expected["src_lengths"], config=common.replace(
                num_beams=case["num_beams"], length_penalty=case["length_penalty"],
                early_stopping=case["early_stopping"]))
        np.testing.assert_array_equal(ours, expected[case["name"]], err_msg=str(case))


def test_translation_kwargs(marian):
    d = marian[0]
    assert translation_kwargs(d) == dict(start_id=80, eos_id=0, pad_id=80, suppress_ids=(80,), force_eos=True)
    assert translation_kwargs(d, beam=True)["early_stopping"] is False


def test_tokenizer_encodes_like_marian_tokenizer(marian):
    d, expected, meta, _, _, _ = marian
    tok = load_tokenizer(d)
    np.testing.assert_array_equal(tok.encode_prompt(meta["text"]), expected["text_ids"])
    assert (tok.eos_id, tok.pad_id) == (0, 80)
    assert tok.decode(expected["text_ids"]) == meta["text"]


def test_save_round_trip_is_exact(marian, tmp_path):
    """jaxformer writes the tensors transformers wrote (same names, same bytes) and reads them back."""
    d, _, _, config, _, state = marian
    out = save_pretrained(tmp_path / "m", config, state, hf_config=read_config(d))
    ours, theirs = load_file(str(out / "model.safetensors")), load_file(str(d / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    config2, _, state2 = load_pretrained(out)
    assert config2 == config
    a, b = _flat(state), _flat(state2)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_untied_unscaled_round_trip(tmp_path):
    config = ModelConfig(kind="encoder_decoder", vocab_size=50, d_model=16, n_layers=1, n_encoder_layers=2,
                         n_heads=2, d_ff=24, activation="gelu", norm="layernorm", norm_position="post",
                         position="sinusoidal", sinusoidal_layout="halves", max_seq_len=32, scale_embeddings=False,
                         tie_embeddings=False, use_bias=True, head_bias=True)
    _, state = random_state(config, seed=1)  # numpy normals: no init compiled op by op
    out = save_pretrained(tmp_path / "m", config, state)
    hf = read_config(out)
    assert (hf["pad_token_id"], hf["decoder_start_token_id"], hf["eos_token_id"]) == (49, 49, 0)
    saved = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" in saved  # and the embed_tokens copies transformers >= 5 needs when untied
    assert np.array_equal(saved["model.encoder.embed_tokens.weight"], saved["model.shared.weight"])
    config2, _, state2 = load_pretrained(out)
    assert config2 == config
    a, b = _flat(state), _flat(state2)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_unexpressible_config_is_refused(tmp_path):
    config = presets.get("vaswani_base", vocab_size=64, d_model=32, n_heads=4, n_layers=1, n_encoder_layers=1)
    _, state = abstract_init(config)   # refused from the config alone, before a parameter is read
    with pytest.raises(HFConfigError, match="sinusoidal_layout"):
        save_pretrained(tmp_path / "v", config, state)


def _copy(d, dst):
    shutil.copytree(d, dst)
    return dst


def _edit_config(path, **changes):
    hf = json.loads((path / "config.json").read_text())
    hf.update(changes)
    (path / "config.json").write_text(json.dumps(hf))


@pytest.mark.parametrize("key,value", [
    ("share_encoder_decoder_embeddings", False), ("decoder_vocab_size", 90), ("normalize_before", True),
    ("static_position_embeddings", False), ("activation_function", "tanh"), ("add_bias_logits", True),
    ("normalize_embedding", True), ("add_final_layer_norm", True), ("decoder_ffn_dim", 128),
    ("decoder_attention_heads", 2),
])
def test_unsupported_config_names_the_key(marian, tmp_path, key, value):
    d = marian[0]
    hf = {**read_config(d), key: value}
    with pytest.raises(HFConfigError, match=key):
        config_from_hf(hf, "config.json")
    ckpt = _copy(d, tmp_path / "c")
    _edit_config(ckpt, **{key: value})
    with pytest.raises(HFConfigError, match=key):
        load_pretrained(ckpt)


def test_stored_positions_and_tied_copies(marian, tmp_path):
    """Older checkpoints store the position tables and every tied copy: accepted when they agree, an error
    naming the tensor when not; a checkpoint with only a copy of ``shared`` loads from it."""
    d, expected, _, config, graphdef, state = marian
    tensors = load_file(str(d / "model.safetensors"))
    shared = tensors["model.shared.weight"]
    table = marian_sinusoids(config.max_seq_len, config.d_model)
    full = {**tensors, "model.encoder.embed_positions.weight": table, "model.decoder.embed_positions.weight": table,
            "model.encoder.embed_tokens.weight": shared, "model.decoder.embed_tokens.weight": shared,
            "lm_head.weight": shared}
    ckpt = _copy(d, tmp_path / "full")
    save_file(full, str(ckpt / "model.safetensors"))
    _, g2, s2 = load_pretrained(ckpt)
    np.testing.assert_array_equal(_forward(g2, s2, expected)[1], _forward(graphdef, state, expected)[1])

    only_copy = {k: v for k, v in tensors.items() if k != "model.shared.weight"}
    only_copy["model.encoder.embed_tokens.weight"] = shared
    save_file(only_copy, str(ckpt / "model.safetensors"))
    _, _, s3 = load_pretrained(ckpt)
    np.testing.assert_array_equal(_flat(s3)[("embed", "embedding")], shared)

    interleaved = np.asarray(sinusoidal_positions(jnp.arange(config.max_seq_len), config.d_model))
    save_file({**tensors, "model.decoder.embed_positions.weight": interleaved}, str(ckpt / "model.safetensors"))
    with pytest.raises(HFWeightsError, match="model.decoder.embed_positions.weight"):
        load_pretrained(ckpt)

    save_file({**tensors, "lm_head.weight": shared + 1}, str(ckpt / "model.safetensors"))
    with pytest.raises(HFWeightsError, match="lm_head.weight"):
        load_pretrained(ckpt)


def test_missing_bias_is_zeros_and_missing_layer_is_an_error(marian, tmp_path):
    d = marian[0]
    tensors = load_file(str(d / "model.safetensors"))
    ckpt = _copy(d, tmp_path / "c")
    save_file({k: v for k, v in tensors.items() if k != "final_logits_bias"}, str(ckpt / "model.safetensors"))
    _, _, state = load_pretrained(ckpt)
    assert not _flat(state)[("logits_bias",)].any()
    name = "model.decoder.layers.1.encoder_attn.k_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, str(ckpt / "model.safetensors"))
    with pytest.raises(HFWeightsError, match=name):
        load_pretrained(ckpt)


def test_family_is_registered():
    from jaxformer.interop.hf import families, guess_model_type

    assert isinstance(families()["marian"], MarianFamily)
    assert guess_model_type(presets.get("vaswani_base")) == "marian"


def test_translate_refuses_a_decoder_only_model():
    model = nnx.eval_shape(lambda: Transformer(presets.get("llama_tiny")))
    with pytest.raises(ValueError, match="encoder_decoder"):
        greedy_translate(model, np.zeros((1, 3), np.int32),
                         config=TranslationConfig(start_id=0, eos_id=1, max_new_tokens=2))


def test_translation_config_refuses_bad_settings(marian):
    with pytest.raises(ValueError, match="num_beams=0"):
        TranslationConfig(start_id=0, eos_id=1, num_beams=0)
    with pytest.raises(ValueError, match="early_stopping='soon'"):
        TranslationConfig(start_id=0, eos_id=1, early_stopping="soon")
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        TranslationConfig(start_id=0, eos_id=1, max_new_tokens=0)
    d, expected, _, config, graphdef, state = marian
    model = nnx.merge(graphdef, state)
    src, lengths = expected["input_ids"], expected["attention_mask"].sum(1)
    unset = TranslationConfig(**translation_kwargs(d))
    with pytest.raises(ValueError, match="max_new_tokens is unset"):
        greedy_translate(model, src, config=unset)
    with pytest.raises(ValueError, match="num_beams=3; use beam_translate"):
        greedy_translate(model, src, config=unset.replace(max_new_tokens=2, num_beams=3))
    with pytest.raises(TypeError, match="must be a jaxformer.decode.TranslationConfig; got dict"):
        beam_translate(model, src, config=translation_kwargs(d))
    # translate() searches with beams exactly when num_beams > 1; the greedy / beam test's sizes (its compiled steps
    # serve), where greedy and 3 beams find different translations (the fixture's generated_ids and beam_ids)
    from jaxformer.decode.translate import translate

    for beams, search in ((1, greedy_translate), (3, beam_translate)):
        settings = unset.replace(max_new_tokens=expected["generated_ids"].shape[1] - 1, num_beams=beams)
        np.testing.assert_array_equal(translate(model, src, lengths, config=settings),
                                      search(model, src, lengths, config=settings))
