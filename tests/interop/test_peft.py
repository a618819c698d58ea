"""peft adapters in and out (jaxformer.interop.peft) against adapters peft itself made.

The fixtures (``tests/interop/fixtures/peft/``, ``make_peft_fixtures.py``, peft 0.21.2) put a LoRA adapter with
random non-zero A and B on the tiny random Llama and Qwen2 fixtures and record peft's logits: the library,
reading the same files with its own code, must give them within ``ATOL`` = 1e-4 (measured: ~1e-5), unmerged,
merged and with scanned layers; writing the adapter back must give peft's own files byte for byte.
"""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxformer.interop import load_pretrained, save_pretrained
from jaxformer.interop.hf import config_from_hf, read_config
from jaxformer.interop.peft import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PeftAdapterError, apply_adapter, load_adapter,
                                    merge_lora, read_adapter_config, save_adapter)
from jaxformer.model import apply
from tests.interop.common import ATOL, FIXTURES, fixture, max_diff

PEFT = FIXTURES / "peft"


def peft_fixture(name):
    with np.load(PEFT / name / "expected.npz") as z:
        expected = {k: z[k] for k in z.files}
    return PEFT / name, expected, json.loads((PEFT / name / "meta.json").read_text())


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request):
    base_dir, base_expected, _ = fixture(request.param)
    adapter, expected, meta = peft_fixture(request.param)
    config, graphdef, state = load_pretrained(base_dir)
    return dict(name=request.param, base_dir=base_dir, base_logits=base_expected["logits"], adapter=adapter,
                expected=expected, meta=meta, config=config, graphdef=graphdef, state=state)


def test_adapter_applied_unmerged_matches_peft(case):
    e = case["expected"]
    lcfg, graphdef, state = apply_adapter(case["adapter"], case["config"], case["state"])
    lora = case["meta"]["lora_config"]
    assert (lcfg.lora.rank, lcfg.lora.alpha, lcfg.lora.rslora) == (lora["r"], lora["lora_alpha"], lora["use_rslora"])
    assert lcfg.lora.scale == pytest.approx(case["meta"]["scale"])
    logits = apply(graphdef, state, jnp.asarray(e["input_ids"]))
    assert max_diff(logits, e["logits"], e["attention_mask"]) < ATOL
    # the adapter moves the logits by far more than the tolerance: a wrong scale or layout cannot pass
    assert max_diff(e["logits"], case["base_logits"], e["attention_mask"]) > 1.0


def test_adapter_merged_matches_peft_and_its_merge(case):
    e = case["expected"]
    merged = load_adapter(case["adapter"], case["config"], case["state"])
    logits = apply(case["graphdef"], merged, jnp.asarray(e["input_ids"]))
    assert max_diff(logits, e["logits"], e["attention_mask"]) < ATOL
    assert max_diff(logits, e["merged_logits"], e["attention_mask"]) < ATOL


def test_scanned_layers_apply_and_merge_the_adapter(case):
    if case["name"] != "llama":
        pytest.skip("the layouts are the same for every fixture: llama's (all seven targets) is enough")
    e = case["expected"]
    config, graphdef, state = load_pretrained(case["base_dir"], scan_layers=True)
    lcfg, lgraphdef, lstate = apply_adapter(case["adapter"], config, state)
    assert max_diff(apply(lgraphdef, lstate, jnp.asarray(e["input_ids"])), e["logits"], e["attention_mask"]) < ATOL
    base, merged = merge_lora(lcfg, lstate)
    assert base.lora is None and base.scan_layers
    assert max_diff(apply(graphdef, merged, jnp.asarray(e["input_ids"])), e["logits"], e["attention_mask"]) < ATOL


def test_merged_export_stands_alone_and_equals_the_adapter_applied(case, tmp_path):
    e = case["expected"]
    lcfg, graphdef, state = apply_adapter(case["adapter"], case["config"], case["state"])
    with pytest.raises(ValueError, match="merge them first"):
        save_pretrained(tmp_path / "refused", lcfg, state)
    base, merged = merge_lora(lcfg, state)
    save_pretrained(tmp_path / "merged", base, merged)
    _, g2, s2 = load_pretrained(tmp_path / "merged")
    ours = apply(graphdef, state, jnp.asarray(e["input_ids"]))
    assert max_diff(apply(g2, s2, jnp.asarray(e["input_ids"])), ours, e["attention_mask"]) < 1e-5


def test_saved_adapter_is_byte_for_byte_what_peft_wrote(case, tmp_path):
    lcfg, _, state = apply_adapter(case["adapter"], case["config"], case["state"])
    out = save_adapter(tmp_path / "out", lcfg, state, base_model_name_or_path=case["meta"]["base"])
    assert (out / ADAPTER_CONFIG).read_bytes() == (case["adapter"] / ADAPTER_CONFIG).read_bytes()
    ours, theirs = load_file(out / ADAPTER_WEIGHTS), load_file(case["adapter"] / ADAPTER_WEIGHTS)
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)


# -- refusals

def config_of(name):
    return config_from_hf(read_config(fixture(name)[0]))


def edited(tmp_path, name="llama", **changes):
    d = tmp_path / f"adapter{len(list(tmp_path.iterdir()))}"
    shutil.copytree(PEFT / name, d)
    cfg = json.loads((d / ADAPTER_CONFIG).read_text())
    cfg.update(changes)
    (d / ADAPTER_CONFIG).write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("changes, key, message", [
    (dict(use_dora=True), "use_dora", "DoRA"),
    (dict(bias="all"), "bias", "trained biases"),
    (dict(lora_bias=True), "lora_bias", "bias on lora_B"),
    (dict(target_modules=["q_proj", "lm_head"]), "target_modules", "'lm_head' is not a projection"),
    (dict(target_modules=r"model\.layers\.0\..*q_proj"), "target_modules", r"in layers \[0\] only"),
    (dict(rank_pattern={"q_proj": 8}), "rank_pattern", "per-module ranks"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save", "extra fully trained modules"),
    (dict(layers_to_transform=[0]), "layers_to_transform", "some layers only"),
    (dict(init_lora_weights="pissa"), "init_lora_weights", "changes the base model's weights"),
    (dict(peft_type="IA3"), "peft_type", "only LoRA adapters"),
    (dict(some_future_option={"on": 1}), "some_future_option", "an option jaxformer does not know"),
])
def test_what_the_library_cannot_express_is_refused_naming_the_key(tmp_path, changes, key, message):
    config = config_of("llama")
    d = edited(tmp_path, **changes)
    with pytest.raises(PeftAdapterError, match=rf"{d / ADAPTER_CONFIG}: {key}: .*{message}"):
        read_adapter_config(d, config)


@pytest.mark.parametrize("targets", ["all-linear", r".*\.(q|k|v|o|gate|up|down)_proj",
                                     ["self_attn.q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate_proj", "up_proj",
                                      "down_proj"]])
def test_peft_target_forms_name_the_same_projections(tmp_path, targets):
    config = config_of("llama")
    lora = read_adapter_config(edited(tmp_path, target_modules=targets), config)
    assert lora.targets is None  # every projection
    lora = read_adapter_config(edited(tmp_path, target_modules=r".*\.(q|v)_proj"), config)
    assert lora.targets == ("w_q", "w_v")


def test_weights_that_do_not_fit_the_config_are_refused_naming_the_tensors(tmp_path):
    config, _, state = load_pretrained(fixture("llama")[0])
    d = edited(tmp_path)
    tensors = load_file(d / ADAPTER_WEIGHTS)
    gone = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    extra = "base_model.model.lm_head.lora_A.weight"
    wrong = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[extra] = tensors.pop(gone)
    tensors[wrong] = np.zeros((5, 32), np.float32)
    save_file(tensors, str(d / ADAPTER_WEIGHTS))
    with pytest.raises(PeftAdapterError) as err:
        load_adapter(d, config, state)
    msg = str(err.value)
    assert str(d / ADAPTER_WEIGHTS) in msg and gone in msg and extra in msg
    assert f"{wrong}: (5, 32), expected (4, 32)" in msg


def test_a_model_peft_names_differently_is_refused(tmp_path):
    config = config_of("gpt2")
    with pytest.raises(PeftAdapterError, match="llama family"):
        read_adapter_config(PEFT / "llama", config)
    with pytest.raises(FileNotFoundError, match=f"{ADAPTER_CONFIG}: missing"):
        read_adapter_config(tmp_path, config)
