"""BERT: the transformers fixture (``BertForMaskedLM``) loads to the same hidden states and MLM logits;
saving round-trips; the checkpoint variants (bare ``BertModel``, ``gamma``/``beta`` names, untied head)
and the refusals. Needs neither torch nor transformers (see ``make_fixtures.py``)."""

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

from jaxformer.interop import HFConfigError, HFWeightsError, load_pretrained, load_tokenizer, save_pretrained
from jaxformer.model.config import ModelConfig
from jaxformer.model.functional import abstract_init
from tests.interop.common import ATOL, BF16_RTOL, fixture, max_diff


@pytest.fixture(scope="module")
def bert():
    return fixture("bert")


def inputs(expected):
    mask = expected["attention_mask"]
    lengths = mask.sum(-1)
    assert (mask == (np.arange(mask.shape[1]) < lengths[:, None])).all(), "fixture padding is not right padding"
    return (jnp.asarray(expected["input_ids"], jnp.int32), jnp.asarray(lengths, jnp.int32),
            jnp.asarray(expected["token_type_ids"], jnp.int32), mask)


@functools.partial(jax.jit, static_argnums=0)
def run(graphdef, state, tokens, lengths, types):
    """``(model.encode(...), model(...))``; compiled once per config."""
    model = nnx.merge(graphdef, state)
    return model.encode(tokens, lengths=lengths, token_types=types), model(tokens, lengths=lengths, token_types=types)


def outputs(path, expected, dtype="float32"):
    """``(config, state, hidden [B, T, D], logits [B, T, V])`` of checkpoint ``path`` on the fixture's inputs."""
    config, graphdef, state = load_pretrained(path, dtype=dtype)
    hidden, logits = run(graphdef, state, *inputs(expected)[:3])
    return config, state, np.asarray(hidden, np.float32), np.asarray(logits, np.float32)


def random_state(config: ModelConfig, seed: int = 0):
    """Every parameter random (biases and norms too), built without compiling ``init``."""
    rng = np.random.default_rng(seed)
    flat = nnx.to_flat_state(abstract_init(config)[1])
    return nnx.from_flat_state([(p, v.replace(jnp.asarray(rng.normal(0.0, 0.3, v.shape), v.dtype)))
                                for p, v in flat])


def copy_checkpoint(src, dst, *, tensors=None, config=None):
    """A copy of checkpoint ``src`` with ``tensors(dict) -> dict`` / ``config(dict) -> dict`` applied."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    if tensors is not None:
        save_file(tensors(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"),
                  metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((src / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(config(cfg)))
    return dst


def test_fixture_float32(bert):
    path, expected, _ = bert
    config, _, hidden, logits = outputs(path, expected)
    assert (config.kind, config.norm.placement, config.ffn.activation, config.norm.eps) == ("encoder", "post", "gelu", 1e-12)
    assert config.hf_options.type_vocab_size == 2 and config.hf_options.head_transform and config.hf_options.head_bias and config.tie_embeddings
    mask = expected["attention_mask"]
    assert max_diff(hidden, expected["hidden_states"], mask) < ATOL
    assert max_diff(logits, expected["logits"], mask) < ATOL


def test_fixture_bfloat16(bert):
    path, expected, _ = bert
    config, state, hidden, logits = outputs(path, expected, dtype="bfloat16")
    assert config.param_dtype == config.compute_dtype == "bfloat16"
    assert all(v.dtype == jnp.bfloat16 for _, v in nnx.to_flat_state(state))
    mask = expected["attention_mask"]
    for ours, name in ((hidden, "hidden_states"), (logits, "logits")):
        spread = float(expected[name][mask.astype(bool)].std())
        assert max_diff(ours, expected[name], mask) < BF16_RTOL * spread, name


def test_round_trip(bert, tmp_path):
    path, _, _ = bert
    config, _, state = load_pretrained(path)
    out = save_pretrained(tmp_path / "out", config, state)
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == "bert" and hf["architectures"] == ["BertForMaskedLM"]
    assert (hf["hidden_act"], hf["layer_norm_eps"], hf["type_vocab_size"]) == ("gelu", 1e-12, 2)
    assert sorted(load_file(str(out / "model.safetensors"))) == sorted(load_file(str(path / "model.safetensors")))
    config2, _, state2 = load_pretrained(out)
    assert config2 == config
    for (p, a), (q, b) in zip(nnx.to_flat_state(state), nnx.to_flat_state(state2), strict=True):
        assert p == q and np.array_equal(np.asarray(a[...]), np.asarray(b[...])), p


def test_untied_round_trip(tmp_path):
    """An untied head saves cls.predictions.decoder.{weight,bias} and reads back exactly; a checkpoint
    without decoder.bias (as transformers 4 wrote) takes cls.predictions.bias."""
    config = ModelConfig(kind="encoder", vocab_size=40, d_model=16, n_layers=1, n_heads=2, d_ff=24,
                         activation="gelu_tanh", norm_position="post", norm_eps=1e-6, embed_norm=True,
                         position="learned", max_seq_len=12, use_bias=True, tie_embeddings=False, type_vocab_size=3,
                         head_transform=True, head_bias=True)
    state = random_state(config)
    out = save_pretrained(tmp_path / "out", config, state)
    tensors = load_file(str(out / "model.safetensors"))
    assert np.array_equal(tensors["cls.predictions.bias"], tensors["cls.predictions.decoder.bias"])
    assert json.loads((out / "config.json").read_text())["hidden_act"] == "gelu_new"
    v4 = copy_checkpoint(out, tmp_path / "v4", tensors=lambda t: {
        k: v for k, v in t.items() if k != "cls.predictions.decoder.bias"})
    for d in (out, v4):
        config2, _, state2 = load_pretrained(d)
        assert config2 == config
        for (p, a), (_, b) in zip(nnx.to_flat_state(state), nnx.to_flat_state(state2), strict=True):
            assert np.array_equal(np.asarray(a[...]), np.asarray(b[...])), (d, p)


def test_old_names_and_buffers(bert, tmp_path):
    """LayerNorm.gamma / .beta (bert-base-uncased's names), the position_ids buffer, the pooler, the NSP
    head and the tied decoder copies are read or skipped as transformers does."""
    path, expected, _ = bert

    def old(t):
        t = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
             for k, v in t.items()}
        D, V = t["bert.embeddings.word_embeddings.weight"].shape[1], t["cls.predictions.bias"].shape[0]
        return {**t, "bert.embeddings.position_ids": np.arange(32)[None],
                "bert.pooler.dense.weight": np.ones((D, D), np.float32),
                "bert.pooler.dense.bias": np.ones(D, np.float32),
                "cls.seq_relationship.weight": np.ones((2, D), np.float32),
                "cls.seq_relationship.bias": np.ones(2, np.float32),
                "cls.predictions.decoder.weight": t["bert.embeddings.word_embeddings.weight"],
                "cls.predictions.decoder.bias": t["cls.predictions.bias"]}  # tied in transformers 4: equal

    d = copy_checkpoint(path, tmp_path / "old", tensors=old,
                        config=lambda c: {**c, "architectures": ["BertForPreTraining"]})
    _, _, hidden, logits = outputs(d, expected)
    assert max_diff(hidden, expected["hidden_states"], expected["attention_mask"]) < ATOL
    assert max_diff(logits, expected["logits"], expected["attention_mask"]) < ATOL

    both = copy_checkpoint(d, tmp_path / "both", tensors=lambda t: {
        **t, "bert.embeddings.LayerNorm.weight": t["bert.embeddings.LayerNorm.gamma"]})
    with pytest.raises(HFWeightsError, match="LayerNorm.gamma and bert.embeddings.LayerNorm.weight"):
        load_pretrained(both)
    # a stored copy that differs from what the config ties it to: transformers would use the copy
    stale = copy_checkpoint(d, tmp_path / "stale", tensors=lambda t: {
        **t, "cls.predictions.decoder.bias": np.zeros_like(t["cls.predictions.bias"])})
    with pytest.raises(HFWeightsError, match=r"cls\.predictions\.decoder\.bias differs from cls\.predictions\.bias"):
        load_pretrained(stale)


def bare(t):
    """BertForMaskedLM tensors as a bare BertModel saves them: no bert. prefix, no cls.*, a pooler."""
    t = {k.removeprefix("bert."): v for k, v in t.items() if not k.startswith("cls.")}
    D = t["embeddings.word_embeddings.weight"].shape[1]
    return {**t, "pooler.dense.weight": np.ones((D, D), np.float32), "pooler.dense.bias": np.ones(D, np.float32)}


def test_bare_bert_model_loads_the_encoder(bert, tmp_path):
    path, expected, _ = bert
    d = copy_checkpoint(path, tmp_path / "bare", tensors=bare, config=lambda c: {**c, "architectures": ["BertModel"]})
    config, _, hidden, _ = outputs(d, expected)
    assert not config.hf_options.head_transform and not config.hf_options.head_bias and config.tie_embeddings
    assert max_diff(hidden, expected["hidden_states"], expected["attention_mask"]) < ATOL
    config, _, state = load_pretrained(d)
    out = save_pretrained(tmp_path / "out", config, state)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertModel"]
    assert "embeddings.word_embeddings.weight" in load_file(str(out / "model.safetensors"))
    assert load_pretrained(out)[0] == config


def test_bare_checkpoint_without_head_is_refused(bert, tmp_path):
    path, _, _ = bert
    d = copy_checkpoint(path, tmp_path / "bare", tensors=bare)   # config.json still says BertForMaskedLM
    with pytest.raises(HFWeightsError, match=r"missing tensors: .*cls\.predictions\.bias"):
        load_pretrained(d)


@pytest.mark.parametrize("key,value", [
    ("position_embedding_type", "relative_key"),
    ("position_embedding_type", "relative_key_query"),
    ("is_decoder", True),
    ("add_cross_attention", True),
    ("hidden_act", "gelu_fast"),
    ("hidden_act", "mish"),
    ("architectures", ["BertForSequenceClassification"]),
    ("num_attention_heads", 5),
])
def test_unsupported_config(bert, tmp_path, key, value):
    path, _, _ = bert
    d = copy_checkpoint(path, tmp_path / "bad", config=lambda c: {**c, key: value})
    with pytest.raises(HFConfigError, match=rf"config\.json: {key}: "):
        load_pretrained(d)


def test_config_to_hf_refuses_what_bert_cannot_express(bert):
    path, _, _ = bert
    config, _, state = load_pretrained(path)
    for update in (dict(norm_position="pre"), dict(head_bias=False), dict(type_vocab_size=0),
                   dict(activation="swiglu", head_transform=False, head_bias=False),
                   dict(n_kv_heads=2), dict(attn_softcap=30.0)):
        bad = config.replace(**update)
        with pytest.raises(HFConfigError, match="bert config.json"):
            save_pretrained("/nonexistent/never-written", bad, state, model_type="bert")


def test_tokenizer(bert):
    path, expected, meta = bert
    tok = load_tokenizer(path)
    ids = tok.encode_prompt(meta["text"])
    np.testing.assert_array_equal(ids, expected["text_ids"])
    cls, sep = meta["special_tokens"]["cls_token"][1], meta["special_tokens"]["sep_token"][1]
    assert ids[0] == cls and ids[-1] == sep
    np.testing.assert_array_equal(tok.encode(meta["text"]), expected["text_ids"][1:-1])
    assert tok.pad_id == meta["special_tokens"]["pad_token"][1]
    assert tok.decode(ids) == meta["text"].lower()
