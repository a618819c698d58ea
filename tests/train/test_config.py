"""Experiment schema: presets + overrides, error messages naming file and dotted key, CLI overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from jaxformer.model import ModelConfig, presets
from jaxformer.train import config as C


def _write(tmp_path, text: str):
    p = tmp_path / "x.yaml"
    p.write_text(text)
    return p


def test_preset_plus_overrides_resolves_to_model_config(tmp_path):
    p = _write(tmp_path, "model: {preset: llama_tiny, n_layers: 4}\nseq_len: 64\n")
    cfg = C.load(p)
    want = presets.get("llama_tiny", n_layers=4)
    assert isinstance(cfg.model, ModelConfig)
    assert cfg.model == want
    assert cfg.model.n_layers == 4 and cfg.model.attention.n_kv_heads == want.attention.n_kv_heads


def test_full_model_fields_without_preset(tmp_path):
    p = _write(tmp_path, "model: {d_model: 64, n_heads: 2, n_layers: 1, max_seq_len: 64}\nseq_len: 64\n")
    assert C.load(p).model.d_model == 64


@pytest.mark.parametrize("text, expected", [
    ("model: {preset: llama_tiny}\nseq_len: 64\noptimizer: {lr: fast}\n",
     "x.yaml: optimizer.lr: Input should be a valid number"),
    ("model: {preset: llama_tiny}\nseq_len: 64\noptimizer: {lrr: 0.1}\n",
     "x.yaml: optimizer.lrr: unknown key; did you mean optimizer.lr?"),
    ("model: {preset: llama_tiny, n_layerz: 3}\nseq_len: 64\n",
     "x.yaml: model.n_layerz: unknown key; did you mean model.n_layers?"),
    ("model: {preset: llama_tiny, n_layers: many}\nseq_len: 64\n",
     "x.yaml: model.n_layers: Input should be a valid integer"),
    ("model: {preset: nope}\n", "x.yaml: model: unknown preset 'nope'"),
    ("model: {preset: llama_tiny}\nseq_len: 64\ncheckpoint: {every: 0}\n",
     "x.yaml: checkpoint.every: Input should be greater than 0"),
    ("model: {preset: llama_tiny}\nseq_len: 64\nstepz: 3\n", "x.yaml: stepz: unknown key; did you mean steps?"),
    ("model: {preset: llama_tiny}\nseq_len: 4096\n", "x.yaml: seq_len=4096 exceeds model.max_seq_len=128"),
    ("model: {preset: llama_tiny}\nseq_len: 64\neval: {stride: 65}\n", "x.yaml: eval.stride=65 exceeds seq_len=64"),
    ("model: {preset: llama_tiny}\nseq_len: 64\noptimizer: {name: sgd}\n", "x.yaml: optimizer.name: Input should be"),
])
def test_errors_name_file_and_dotted_key(tmp_path, text, expected):
    p = _write(tmp_path, text)
    with pytest.raises(C.ConfigError) as e:
        C.load(p)
    assert str(e.value).startswith(str(p.parent) + "/") and expected in str(e.value), str(e.value)


def test_every_error_is_reported(tmp_path):
    p = _write(tmp_path, "model: {preset: llama_tiny}\nseq_len: 64\noptimizer: {lr: x, b1: 2}\ndata: {zz: 1}\n")
    with pytest.raises(C.ConfigError) as e:
        C.load(p)
    msg = str(e.value)
    assert "optimizer.lr" in msg and "optimizer.b1" in msg and "data.zz: unknown key" in msg


def test_not_yaml_and_missing_file(tmp_path):
    with pytest.raises(C.ConfigError, match="not valid YAML"):
        C.load(_write(tmp_path, "model: [unclosed\n"))
    with pytest.raises(C.ConfigError, match="cannot read"):
        C.load(tmp_path / "missing.yaml")


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_decay_steps_must_exceed_the_warmup(tmp_path, kind):
    """``decay_steps`` counts the warmup's steps: at or under ``warmup_steps`` the rate would fall to its floor the
    step the warmup ends. A run shorter than its warmup (no ``decay_steps``) stays legal, as does ``constant``."""
    base = "model: {preset: llama_tiny}\nseq_len: 32\nsteps: 40\n"
    with pytest.raises(C.ConfigError, match=r"x\.yaml: schedule: decay_steps=10 counts the warmup's steps too, so it "
                                            r"must exceed warmup_steps=20"):
        C.load(_write(tmp_path, base + f"schedule: {{kind: {kind}, warmup_steps: 20, decay_steps: 10}}\n"))
    with pytest.raises(C.ConfigError, match=r"decay_steps=20 .* warmup_steps=20"):
        C.load(_write(tmp_path, base + f"schedule: {{kind: {kind}, warmup_steps: 20, decay_steps: 20}}\n"))
    assert C.load(_write(tmp_path, base + f"schedule: {{kind: {kind}, warmup_steps: 20, decay_steps: 21}}\n"))
    assert C.load(_write(tmp_path, base + f"schedule: {{kind: {kind}, warmup_steps: 50}}\n")).schedule.warmup_steps == 50
    assert C.load(_write(tmp_path, base + "schedule: {kind: constant, warmup_steps: 20, decay_steps: 10}\n"))


def test_a_section_error_an_override_took_part_in_names_the_override_too(tmp_path):
    """Values checked against each other (a section's or the top level's validator) fail at the section, not at
    the key an override set: the file is named, and after the message the overrides that set keys in it (a
    model's flat key as its section's), not the others."""
    p = _write(tmp_path, "model: {preset: llama_tiny, max_seq_len: 32}\nseq_len: 32\n")
    with pytest.raises(C.ConfigError, match=r"^.*x\.yaml: model: d_model=30 not divisible by attention\.n_heads=4; "
                                            r"set attention\.head_dim \(with the override 'model\.d_model=30'\)$"):
        C.load(p, ["model.d_model=30", "optimizer.lr=1e-3"])
    with pytest.raises(C.ConfigError, match=r"x\.yaml: seq_len=64 exceeds model\.max_seq_len=32 \(with the override "
                                            r"'seq_len=64'\)$"):
        C.load(p, ["optimizer.lr=1e-3", "seq_len=64"])  # the top level's check: the overrides its message names
    with pytest.raises(C.ConfigError, match=r"model\.attention: n_heads=4 not divisible by n_kv_heads=3 \(with the "
                                            r"override 'model\.n_kv_heads=3'\)$"):
        C.load(p, ["model.n_kv_heads=3", "model.n_layers=1"])
    with pytest.raises(C.ConfigError, match=r"x\.yaml: model\.attention: n_heads=4 not divisible by n_kv_heads=3$"):
        C.load(_write(tmp_path, "model: {preset: llama_tiny, n_kv_heads: 3}\nseq_len: 32\n"), ["model.n_layers=1"])


def test_a_key_given_twice_is_refused_naming_the_file_and_both_lines(tmp_path):
    """PyYAML keeps a repeated key's last value, which would drop a whole section unseen (here ``lr``)."""
    p = _write(tmp_path, "model: {preset: llama_tiny}\noptimizer: {lr: 0.003}\nseq_len: 32\noptimizer:\n"
                         "  weight_decay: 0.0\n")
    with pytest.raises(C.ConfigError, match=r"^.*x\.yaml: not valid YAML: key 'optimizer' on line 4 given twice "
                                            r"\(first on line 2\)$"):
        C.load(p)
    p = _write(tmp_path, "model:\n  preset: llama_tiny\n  d_model: 32\n  n_layers: 1\n  d_model: 64\nseq_len: 32\n")
    with pytest.raises(C.ConfigError, match=r"key 'd_model' on line 5 given twice \(first on line 3\)"):
        C.load(p)
    with pytest.raises(C.ConfigError, match=r"override 'optimizer=\{lr: 1, lr: 2\}': value is not YAML: key 'lr'"):
        C.load(_write(tmp_path, "model: {preset: llama_tiny}\nseq_len: 32\n"), ["optimizer={lr: 1, lr: 2}"])
    # a "<<" merge's keys may be overridden by the mapping that merges them: not a repeat
    p = _write(tmp_path, "common: &c {lr: 0.003, weight_decay: 0.0}\nmodel: {preset: llama_tiny}\nseq_len: 32\n"
                         "optimizer:\n  <<: *c\n  lr: 0.001\n")
    assert C.load_yaml(p.read_text())["optimizer"] == {"lr": 0.001, "weight_decay": 0.0}


def test_overrides_are_yaml_parsed_and_validated(tmp_path):
    p = _write(tmp_path, "model: {preset: llama_tiny}\nseq_len: 64\n")
    cfg = C.load(p, ["optimizer.lr=3e-4", "model.n_layers=3", "mesh.data=2", "eval.sample={prompt: 'x'}",
                     "schedule.kind=linear"])
    assert cfg.optimizer.lr == pytest.approx(3e-4)
    assert cfg.model.n_layers == 3 and cfg.mesh.data == 2 and cfg.eval.sample.prompt == "x"
    assert cfg.schedule.kind == "linear"
    with pytest.raises(C.ConfigError, match=r"^override 'optimizer.lr=abc': optimizer.lr: Input should be a valid"):
        C.load(p, ["optimizer.lr=abc"])  # the command line's mistake, not the file's
    with pytest.raises(C.ConfigError, match=r"override .optimizer.lr. is not key.sub=value \(e.g. optimizer.lr=3e-4\)"):
        C.load(p, ["optimizer.lr"])


def test_dump_round_trips_without_preset(tmp_path):
    cfg = C.load(_write(tmp_path, "model: {preset: gpt2_tiny, d_model: 96, n_heads: 3}\nseq_len: 64\n"))
    out = tmp_path / "resolved.yaml"
    C.dump(cfg, out)
    raw = yaml.safe_load(out.read_text())
    assert "preset" not in raw["model"] and raw["model"]["d_model"] == 96
    assert C.load(out) == cfg
    assert C.diff(cfg, C.load(out, ["steps=7", "model.n_layers=1"])) == [
        ("model.n_layers", cfg.model.n_layers, 1), ("steps", cfg.steps, 7)]


def test_mesh_shape():
    assert C.MeshConfig(data=-1).shape(8) == (8, 1, 1)
    assert C.MeshConfig(data=2, fsdp=-1, tensor=2).shape(8) == (2, 2, 2)
    assert C.MeshConfig(data=1).shape(8) == (1, 1, 1)
    with pytest.raises(ValueError, match="needs 16 devices"):
        C.MeshConfig(data=4, fsdp=4).shape(8)
    with pytest.raises(ValueError, match="not divisible"):
        C.MeshConfig(data=-1, fsdp=3).shape(8)
    with pytest.raises(C.ConfigError, match="at most one mesh axis may be -1"):
        C.from_dict({"model": {"preset": "llama_tiny"}, "seq_len": 8, "mesh": {"data": -1, "fsdp": -1}}, "m")


def test_cross_field_checks():
    base = {"model": {"preset": "llama_tiny"}, "seq_len": 8}
    with pytest.raises(C.ConfigError, match="not divisible by optimizer.grad_accum=3"):
        C.from_dict({**base, "batch_size": 8, "optimizer": {"grad_accum": 3}}, "m")
    with pytest.raises(C.ConfigError, match="data: source='text' needs data.path"):
        C.from_dict({**base, "data": {"source": "text"}}, "m")
    with pytest.raises(C.ConfigError, match="model.kind='decoder'"):
        C.from_dict({"model": {"preset": "vaswani_tiny"}, "seq_len": 8}, "m")


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "experiments" / "configs").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_experiment_files_validate(path):
    C.load(path)  # raises ConfigError naming the file and key if a schema change broke it
