"""BLOOM (``jaxformer.interop.bloom``) against transformers' own checkpoints.

``fixtures/bloom`` (D=32, 4 heads) and ``fixtures/bloom_6heads`` (D=48, 6 heads: ALiBi slopes of a
head count that is not a power of two) are tiny random ``BloomForCausalLM`` models whose float32
logits transformers recorded on a right-padded batch; see ``make_fixtures.py``.
"""

from __future__ import annotations

import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxformer.interop import HFConfigError, load_pretrained, save_pretrained
from jaxformer.interop import hf as hf_mod
from jaxformer.model import presets
from jaxformer.model.functional import apply
from jaxformer.ops.positional import alibi_slopes
from tests.interop import decoder_checks as dc
from tests.interop.common import ATOL, BF16_RTOL, fixture, max_diff

NAMES = ("bloom", "bloom_6heads")
forward = jax.jit(apply, static_argnums=0)


@pytest.fixture(scope="module", params=NAMES)
def bloom(request):
    d, expected, meta = fixture(request.param)
    return (d, expected, meta, *load_pretrained(d))


def logits_of(graphdef, state, expected):
    return forward(graphdef, state, jnp.asarray(expected["input_ids"], jnp.int32))


def bloom_slopes(num_heads: int) -> np.ndarray:
    """transformers' ``_get_alibi_slopes`` (modeling_bloom), transcribed."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** p for p in range(1, closest + 1)]
    if closest != num_heads:
        extra = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** p for p in range(1, 1 + 2 * min(closest, num_heads - closest), 2)]
    return np.asarray(slopes, np.float32)


@pytest.mark.parametrize("num_heads", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 40, 112])
def test_alibi_slopes_are_blooms(num_heads):
    np.testing.assert_allclose(alibi_slopes(num_heads), bloom_slopes(num_heads), rtol=1e-6)


def test_config_translation(bloom):
    _, _, meta, config, _, _ = bloom
    assert (config.kind, config.positions.kind, config.norm.kind, config.norm.placement) == ("decoder", "alibi", "layernorm",
                                                                                  "pre")
    assert config.norm.embed and config.tie_embeddings and config.use_bias and config.ffn.activation == "gelu_tanh"
    assert config.resolved_d_ff == 4 * config.d_model and config.n_layers == 2
    np.testing.assert_allclose(alibi_slopes(config.attention.n_heads), meta["alibi_slopes"], rtol=1e-6)


def test_float32_logits_match_transformers(bloom):
    _, expected, _, _, graphdef, state = bloom
    # right padding: BLOOM counts ALiBi positions over the mask, which leaves valid positions unshifted
    assert max_diff(logits_of(graphdef, state, expected), expected["logits"], expected["attention_mask"]) < ATOL


# slow case: 1 s; the bf16 load of bloom (and of every other family) runs by default
@pytest.mark.parametrize("bloom", ["bloom", pytest.param("bloom_6heads", marks=pytest.mark.slow)], indirect=True)
def test_bfloat16_load_is_close(bloom):
    d, expected, *_ = bloom
    _, graphdef, state = load_pretrained(d, dtype="bfloat16")
    assert {v.dtype for v in dc.flat(state).values()} == {np.dtype(jnp.bfloat16)}
    mask = expected["attention_mask"].astype(bool)
    tol = BF16_RTOL * float(expected["logits"][mask].std())
    assert max_diff(logits_of(graphdef, state, expected), expected["logits"], mask) < tol


# slow case: 3 s; bloom's (ALiBi in both caches) runs by default, bloom_6heads' slopes in its logits test and
# test_alibi_slopes_are_blooms
@pytest.mark.parametrize("bloom", ["bloom", pytest.param("bloom_6heads", marks=pytest.mark.slow)], indirect=True)
def test_kv_cache_decoding_matches_transformers(bloom):
    """Teacher-forced, token by token: the contiguous cache and the paged cache (as the engine calls it)
    give transformers' logits at every valid position and its logits at each greedy step."""
    _, expected, _, config, graphdef, state = bloom
    tokens, mask, gen_prompt = dc.batch(expected)
    for run in (dc.contiguous_teacher_forced, dc.paged_teacher_forced):
        fixture_diff, gen_diff = dc.compare(run(config, graphdef, state, tokens), expected, mask, gen_prompt)
        assert fixture_diff < ATOL and gen_diff < ATOL, (run.__name__, fixture_diff, gen_diff)


# default-run: the one ALiBi model through the Engine by default (tests/decode/test_window.py's [bloom] is slow)
def test_greedy_generation_matches_transformers():
    """Through the paged engine (``bloom`` only: ``bloom_6heads``' decoding is the slow case of the test above)."""
    d, expected, _ = fixture("bloom")
    config, graphdef, state = load_pretrained(d)
    assert dc.trusted_steps(expected) == 6  # every step of this fixture has a clear winner
    want, ours = dc.greedy(config, graphdef, state, expected)
    assert ours == want


def test_save_then_load_is_exact(bloom, tmp_path):
    d, expected, _, config, graphdef, state = bloom
    hf_config = json.loads((d / "config.json").read_text())
    out = save_pretrained(tmp_path / "out", config, state, hf_config=hf_config)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "bloom" and written["architectures"] == ["BloomForCausalLM"]
    assert written["pad_token_id"] == hf_config["pad_token_id"]  # kept from hf_config
    assert set(load_file(out / "model.safetensors")) == set(load_file(d / "model.safetensors"))
    config2, _, state2 = load_pretrained(out)
    assert config2 == config
    ours, back = dc.flat(state), dc.flat(state2)
    assert ours.keys() == back.keys()
    for p in ours:
        np.testing.assert_array_equal(back[p], ours[p], err_msg=str(p))


def test_untied_round_trip_and_qkv_layout(tmp_path):
    """A random jaxformer BLOOM (untied head, 3 heads) comes back identical, and the fused
    ``query_key_value`` rows are per head ``[q_h | k_h | v_h]``, as modeling_bloom splits them."""
    cfg = presets.get("bloom_tiny", vocab_size=40, d_model=12, n_heads=3, n_layers=1, tie_embeddings=False)
    _, state = dc.random_state(cfg)
    out = save_pretrained(tmp_path, cfg, state)
    tensors = load_file(out / "model.safetensors")
    assert "lm_head.weight" in tensors
    params = dc.flat(state)
    attn = ("decoder", "blocks", 0, "self_attn")
    w = tensors["transformer.h.0.self_attention.query_key_value.weight"]  # [3D, D] = [N, 3, H] x D
    b = tensors["transformer.h.0.self_attention.query_key_value.bias"]
    for j, name in enumerate("qkv"):
        for h in range(3):
            rows = slice((3 * h + j) * 4, (3 * h + j + 1) * 4)
            np.testing.assert_array_equal(w[rows], params[attn + (f"w_{name}",)][:, h].T)
            np.testing.assert_array_equal(b[rows], params[attn + (f"b_{name}",)][h])
    config, _, back = load_pretrained(out)
    assert hf_mod._behaviour(config) == hf_mod._behaviour(cfg)
    for p, v in params.items():
        np.testing.assert_array_equal(dc.flat(back)[p], v, err_msg=str(p))


@pytest.mark.parametrize("key, value, match", [
    ("apply_residual_connection_post_layernorm", True, "not supported"),
    ("n_head", 5, "not divisible"),
])
def test_unsupported_options_name_the_key_and_file(tmp_path, key, value, match):
    d, _, _ = fixture("bloom")
    dst = tmp_path / "bad"
    shutil.copytree(d, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, key: value}))
    with pytest.raises(HFConfigError, match=rf"config\.json: {key}: .*{match}"):
        load_pretrained(dst)


def test_tensor_parallel_options_are_accepted(tmp_path):
    """``pretraining_tp`` / ``slow_but_exact`` split the same matmuls into slices: same model."""
    d, _, _ = fixture("bloom")
    dst = tmp_path / "tp"
    shutil.copytree(d, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "pretraining_tp": 2, "slow_but_exact": True}))
    load_pretrained(dst)


@pytest.mark.parametrize("overrides, match", [
    (dict(embed_norm=False), "norm.embed=False"),
    (dict(d_ff=96), "d_ff=96"),
    (dict(activation="gelu"), "activation='gelu'"),
])
def test_config_to_hf_refuses_what_bloom_cannot_express(tmp_path, overrides, match):
    cfg = presets.get("bloom_tiny", **overrides)
    with pytest.raises(HFConfigError, match=rf"not expressible as a bloom config\.json.*{match}"):
        save_pretrained(tmp_path, cfg, None)
    assert not any(tmp_path.iterdir())  # refused before writing anything
