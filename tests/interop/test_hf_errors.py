"""Bad checkpoints fail with an error naming the file and key, before a single tensor is read.

Checkpoints here are written by jaxformer's own ``save_pretrained`` from a random tiny LLaMA and then
damaged; the per-family tests check the numbers against transformers' fixtures.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxformer.interop import HFConfigError, HFWeightsError, load_pretrained, save_pretrained
from jaxformer.interop import hf as hf_mod
from jaxformer.model import presets
from jaxformer.model.functional import abstract_init, apply
from tests.interop.decoder_checks import random_state

CFG = presets.get("llama_tiny", vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, tie_embeddings=False)
forward = jax.jit(apply, static_argnums=0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    _, state = random_state(CFG)  # numpy normals: no init compiled op by op
    save_pretrained(d, CFG, state, max_shard_bytes=40_000)
    return d, state


@pytest.fixture
def ckpt(saved, tmp_path):
    """A fresh copy of the saved checkpoint to damage."""
    src, _ = saved
    dst = tmp_path / "ckpt"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.fixture
def reads(monkeypatch):
    """Counts tensor reads: a bad checkpoint must be refused from its headers alone."""
    calls = []
    real = hf_mod._Tensors.read

    def read(self, name):
        calls.append(name)
        return real(self, name)

    monkeypatch.setattr(hf_mod._Tensors, "read", read)
    return calls


def test_round_trip_through_shards_is_exact(saved):
    d, state = saved
    assert len(list(d.glob("model-*-of-*.safetensors"))) > 1 and (d / hf_mod.INDEX).is_file()
    config, graphdef, loaded = load_pretrained(d)
    ours = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}
    back = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(loaded)}
    assert ours.keys() == back.keys()
    for p in ours:
        np.testing.assert_array_equal(back[p], ours[p], err_msg=str(p))
    tokens = jnp.arange(24, dtype=jnp.int32).reshape(2, 12) % CFG.vocab_size
    np.testing.assert_array_equal(forward(graphdef, loaded, tokens), forward(graphdef, state, tokens))  # one compile


def test_not_a_directory_and_no_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"config\.json: missing"):
        load_pretrained(tmp_path)


def test_unknown_model_type_names_the_key_and_file(ckpt, reads):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    with pytest.raises(HFConfigError, match=r"config\.json: model_type: 'gpt_neox' is not supported"):
        load_pretrained(ckpt)
    assert reads == []


@pytest.mark.parametrize("rope, key", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_parameters.rope_type"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.original_max_position_embeddings"),
    ({"hidden_act": "gelu_fast"}, "hidden_act"),
    ({"attention_bias": True, "mlp_bias": False}, "attention_bias"),
])
def test_unsupported_options_name_the_key(ckpt, reads, rope, key):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, **rope}))
    with pytest.raises(HFConfigError, match=rf"config\.json: {key}"):
        load_pretrained(ckpt)
    assert reads == []


def _rewrite(ckpt, name, fn):
    """Apply ``fn(tensors) -> tensors`` to the shard holding ``name``; returns that shard's file name."""
    index = json.loads((ckpt / hf_mod.INDEX).read_text())
    file = index["weight_map"][name]
    tensors = fn(load_file(str(ckpt / file)))
    save_file(tensors, str(ckpt / file), metadata={"format": "pt"})
    return file, index


def test_wrong_shape_names_tensor_file_and_expected_shape(ckpt, reads):
    name = "model.layers.1.self_attn.k_proj.weight"
    file, _ = _rewrite(ckpt, name, lambda t: {**t, name: np.zeros((8, 32), np.float32)})
    with pytest.raises(HFWeightsError, match=rf"{name} in {file}: \(8, 32\), expected \(16, 32\)"):
        load_pretrained(ckpt)
    assert reads == []


def test_missing_and_unexpected_tensors_are_named(ckpt, reads):
    name = "model.layers.0.mlp.up_proj.weight"
    file, index = _rewrite(ckpt, name, lambda t: {**{k: v for k, v in t.items() if k != name},
                                                   "model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(HFWeightsError) as e:
        load_pretrained(ckpt)
    assert f"missing tensors: ['{name}']" in str(e.value)
    assert "unexpected tensors" in str(e.value) and "model.layers.0.mlp.extra.weight" in str(e.value)
    assert reads == []


def test_missing_shard_is_named(ckpt, reads):
    index = json.loads((ckpt / hf_mod.INDEX).read_text())
    gone = sorted(set(index["weight_map"].values()))[-1]
    (ckpt / gone).unlink()
    with pytest.raises(HFWeightsError, match=rf"lists shards that are missing .*'{gone}'"):
        load_pretrained(ckpt)
    assert reads == []


def test_incomplete_config_names_the_missing_key(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(HFConfigError, match=r"config\.json: hidden_size: missing"):
        load_pretrained(tmp_path)


def test_torch_only_checkpoint_is_refused_with_a_hint(ckpt):
    for f in list(ckpt.glob("*.safetensors")) + [ckpt / hf_mod.INDEX]:
        f.unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(HFWeightsError, match=r"no model\.safetensors .*pytorch_model\.bin.*only safetensors"):
        load_pretrained(ckpt)


def test_save_refuses_a_config_the_family_cannot_express(tmp_path):
    cfg = CFG.replace(attention=dict(softcap=30.0))
    _, state = abstract_init(CFG)  # refused from the config alone, before a parameter is read
    with pytest.raises(HFConfigError, match=r"attention.softcap=30.0"):
        save_pretrained(tmp_path, cfg, state, model_type="llama")
    assert not any(tmp_path.iterdir())
