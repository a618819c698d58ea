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


def test_config_translation():
    cfgs = {name: load_pretrained(fixture(name)[0])[0] for name in NAMES}
    llama = cfgs["llama"]
    assert (llama.n_heads, llama.resolved_kv_heads, llama.resolved_head_dim, llama.resolved_d_ff) == (4, 2, 8, 64)
    assert not llama.tie_embeddings and llama.norm == "rmsnorm" and llama.activation == "swiglu"
    assert llama.rope_scaling is None and llama.attention_window is None
    l3 = cfgs["llama3"]
    assert l3.tie_embeddings and l3.rope_base == 500000.0
    assert (l3.rope_scaling.kind, l3.rope_scaling.factor, l3.rope_scaling.original_max_position) == \
        ("llama3", 8.0, 64)
    assert cfgs["llama3_legacy"] == l3  # the two config forms read the same
    assert "rope_parameters" in read_config(fixture("llama3")[0])
    assert "rope_scaling" in read_config(fixture("llama3_legacy")[0])
    assert cfgs["qwen2"].qkv_bias and not cfgs["qwen2"].use_bias
    assert cfgs["mistral"].attention_window == (3, 0)  # sliding_window 4: itself and the 3 before


def test_float32_logits_match_transformers(loaded):
    name, _, expected, config, graphdef, state = loaded
    logits = forward(graphdef, state, jnp.asarray(expected["input_ids"], jnp.int32))
    diff = max_diff(logits, expected["logits"], expected["attention_mask"])
    assert diff < ATOL, (name, diff)


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
    if config.tie_embeddings:
        assert "lm_head.weight" not in json.dumps(sorted(p.name for p in out.iterdir()))


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
