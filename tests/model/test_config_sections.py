"""ModelConfig in sections: the flat keys of before them are still read everywhere a config is (Python
keywords, YAML, presets, ``model.KEY=value`` overrides, sweep axes, old runs' ``config.yaml``), and a run
written by the old code resumes, evaluates, generates and exports with the numbers it printed then."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from flax import nnx

from jaxformer.cli import main
from jaxformer.model import ModelConfig, Transformer, presets
from jaxformer.model.config import FLAT_KEYS, SECTIONS, AttentionConfig, get_key, merge, migrate
from jaxformer.model.transformer import DecoderLM, Encoder, EncoderDecoder
from jaxformer.train import config as C

FLAT_RUN = Path(__file__).resolve().parents[1] / "fixtures" / "flat_run"

# one value per flat key that differs from its default and validates together with the others
FLAT = dict(n_heads=2, n_kv_heads=1, head_dim=8, attn_scale=0.5, attn_softcap=30.0, qkv_sharing="none", qkv_bias=True,
            attention_impl="xla", position="rope", rope_base=500.0, rope_scaling={"kind": "linear", "factor": 2.0},
            rope_interleaved=True, sinusoidal_layout="interleaved", activation="relu", d_ff=48,
            ffn_multiple_of=8, norm="rmsnorm", norm_position="pre", norm_eps=1e-6, sandwich_norm=True,
            final_norm=False, embed_norm=True, attention_window=(7, 0), global_tokens=(), random_blocks=None,
            type_vocab_size=2, head_transform=True, head_bias=True)


def test_every_flat_key_lands_in_its_section():
    assert set(FLAT) == set(FLAT_KEYS)
    cfg = ModelConfig(d_model=32, **FLAT)
    for key, value in FLAT.items():
        section, name = FLAT_KEYS[key]
        got = getattr(getattr(cfg, section), name)
        want = value if key != "rope_scaling" else cfg.positions.rope_scaling.model_validate(value)
        assert got == want, key
        assert get_key(cfg, key) == got
    assert set(SECTIONS) <= set(ModelConfig.model_fields)
    # the sectioned spelling builds the same config, and a dump reads back as itself
    assert ModelConfig(**migrate(dict(d_model=32, **FLAT))) == cfg
    assert ModelConfig(**cfg.model_dump()) == cfg


@pytest.mark.no_typecheck
def test_a_value_given_flat_and_in_its_section_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"attention\.n_heads given twice.*\['n_heads'\]"):
        ModelConfig(n_heads=2, attention={"n_heads": 4})
    # different fields of one section, some flat and some in it, join (the section a mapping or an object)
    assert ModelConfig(n_kv_heads=3, attention=AttentionConfig(n_heads=6), d_model=48).attention == AttentionConfig(
        n_heads=6, n_kv_heads=3)
    assert ModelConfig(n_kv_heads=3, attention={"n_heads": 6}, d_model=48).attention == AttentionConfig(n_heads=6,
                                                                                       n_kv_heads=3)


def test_norm_as_a_string_is_the_old_flat_key_and_as_a_mapping_the_section():
    assert ModelConfig(norm="rmsnorm").norm.kind == "rmsnorm"
    assert ModelConfig(norm={"kind": "rmsnorm", "eps": 1e-3}).norm.eps == 1e-3


def test_replace_and_presets_merge_sections_field_by_field():
    base = presets.get("llama_tiny")
    assert base.attention.n_kv_heads == 2
    changed = base.replace(n_heads=8, norm_eps=1e-3)  # flat keys: the section's other fields stay
    assert (changed.attention.n_heads, changed.attention.n_kv_heads, changed.norm.eps) == (8, 2, 1e-3)
    assert base.replace(attention={"n_heads": 8}) == changed.replace(norm={"eps": base.norm.eps})
    assert presets.get("llama_tiny", n_heads=8, norm={"eps": 1e-3}) == changed
    assert merge({"attention": {"n_heads": 4, "head_dim": 8}}, {"n_kv_heads": 2}) == {
        "attention": {"n_heads": 4, "head_dim": 8, "n_kv_heads": 2}}
    # a section given as an object merges as the fields it set
    assert merge({"attention": AttentionConfig(n_heads=8, n_kv_heads=2)}, {"n_heads": 4}) == {
        "attention": {"n_heads": 4, "n_kv_heads": 2}}
    assert base.replace(attention=AttentionConfig(n_heads=4)).attention.n_kv_heads == 2


def test_overrides_and_yaml_take_either_spelling(tmp_path):
    raw = {"steps": 2, "seq_len": 16, "model": {"preset": "llama_tiny", "n_heads": 2, "n_kv_heads": 1,
                                                 "max_seq_len": 32}}
    old = C.from_dict(raw, "x.yaml", ["model.norm_position=post", "model.attn_scale=0.5"])
    new = C.from_dict(raw, "x.yaml", ["model.norm.placement=post", "model.attention.scale=0.5"])
    assert old == new and old.model.norm.placement == "post" and old.model.attention.n_heads == 2
    # an override of a flat key replaces what the file set in the section, and the reverse
    sectioned = {**raw, "model": {"preset": "llama_tiny", "attention": {"n_heads": 2, "n_kv_heads": 1},
                                  "max_seq_len": 32}}
    assert C.from_dict(sectioned, "x.yaml", ["model.n_heads=4"]).model.attention.n_heads == 4
    assert C.from_dict(raw, "x.yaml", ["model.attention.n_heads=4", "model.attention.n_kv_heads=2"]
                       ).model.attention.n_heads == 4
    with pytest.raises(C.ConfigError, match=r"x.yaml: model.attention: n_heads=2 not divisible by n_kv_heads=3"):
        C.from_dict(raw, "x.yaml", ["model.n_kv_heads=3"])
    # a deeper flat key lands in its section, beside what the file set there
    scaled = {**raw, "model": {**raw["model"], "rope_scaling": {"kind": "linear", "factor": 2.0}}}
    assert C.from_dict(scaled, "x.yaml", ["model.rope_scaling.factor=4"]).model.positions.rope_scaling.factor == 4
    both = {**raw, "model": {**raw["model"], "attention": {"n_heads": 4}}}  # n_heads flat and in the section
    with pytest.raises(C.ConfigError, match=r"override 'model.n_layers=1': model: attention.n_heads given twice"):
        C.from_dict(both, "x.yaml", ["model.n_layers=1"])


def test_the_model_classes_by_kind():
    for name, cls in (("llama_tiny", DecoderLM), ("longformer_tiny", Encoder), ("vaswani_tiny", EncoderDecoder)):
        m = nnx.eval_shape(lambda name=name: Transformer(presets.get(name)))  # the class, no parameters drawn
        assert type(m) is cls and isinstance(m, Transformer)
    with pytest.raises(ValueError, match=r"Encoder builds kind='encoder', got config.kind='decoder'.*DecoderLM"):
        Encoder(presets.get("llama_tiny"))


def test_a_run_written_before_the_sections_resumes_evaluates_generates_and_exports(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(FLAT_RUN, run)
    want = json.loads((FLAT_RUN / "expected.json").read_text())
    assert "n_heads" in yaml.safe_load((run / "config.yaml").read_text())["model"]  # the old, flat form
    cfg = C.load(run / "config.yaml")
    assert (cfg.model.attention.n_heads, cfg.model.norm.eps) == (2, 1e-5)

    assert main(["eval", str(run), "--max-tokens", str(want["eval_step_4"]["max_tokens"]), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["step"] == 4 and out["val_loss"] == pytest.approx(want["eval_step_4"]["val_loss"], rel=1e-6)

    g = want["generate"]
    assert main(["generate", str(run), "--prompt", g["prompt"], "--max-new-tokens", str(g["max_new_tokens"])]) == 0
    assert capsys.readouterr().out.rstrip("\n") == g["text"]

    assert main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_attention_heads"] == 2

    assert main(["train", str(run / "config.yaml"), "--run-dir", str(run), "--steps", "6"]) == 0
    losses = {str(r["step"]): r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if "loss" in r}
    for step, loss in want["resume_to_6"].items():
        assert losses[step] == pytest.approx(loss, rel=1e-5), step
