"""``stack_layers`` / ``unstack_layers``: the scanned layout ``[L, ...]`` against the per-layer one.

The reference for the layout is written here by plain indexing (block ``i`` of the per-layer state is
index ``i`` of every scanned leaf), and the logits of the two models on the converted weights must
agree: a permutation of the layers or a transposed leaf changes them (checked: a swap of two layers
moves the logits by far more than the tolerance).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxformer.model import (
    ModelConfig,
    abstract_init,
    per_layer_config,
    presets,
    scanned_config,
    stack_layers,
    unstack_layers,
)

V, T = 64, 8
# Scan vs a Python loop over the same fp32 blocks: the same math, only XLA's fusion and rounding may differ
# (measured max |diff|: 0 for the decoders here, 5e-7 for the encoder-decoder, on logits up to ~5 in
# magnitude); swapping two layers moves them by ~5.
ATOL = 2e-5


def decoder(n_layers: int, **kw) -> ModelConfig:
    return ModelConfig(vocab_size=V, d_model=16, n_layers=n_layers, n_heads=2, max_seq_len=T, init_std=0.3,
                       scan_layers=True, **kw)


def enc_dec() -> ModelConfig:
    """An encoder-decoder with stacks of different depths (3 encoder, 2 decoder layers)."""
    return presets.get("vaswani_tiny", vocab_size=V, d_model=16, n_heads=2, n_encoder_layers=3, max_seq_len=T,
                       scan_layers=True)


def random_pure(config: ModelConfig, seed: int) -> dict:
    """A pure dict shaped like ``config``'s state, every leaf drawn independently (no structure to hide a
    permutation behind): N(1, 0.3) for vectors (norm scales and biases), N(0, 0.3) for matrices."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (float(len(s.shape) == 1) + 0.3 * rng.standard_normal(s.shape)).astype(np.float32),
                        nnx.to_pure_dict(abstract_init(config)[1]))


def by_index(scanned: dict, config: ModelConfig) -> dict:
    """The per-layer pure dict of a scanned one, by plain indexing (the layout's definition)."""
    out = dict(scanned)
    for name, n in (("encoder", config.n_encoder_stack_layers), ("decoder", config.n_decoder_layers)):
        if n:
            blocks = scanned[name]["blocks"]
            out[name] = {**scanned[name], "blocks": {i: jax.tree.map(lambda a, i=i: a[i], blocks) for i in range(n)}}
    return out


def assert_same(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.mark.parametrize("config", [decoder(1), decoder(3, n_kv_heads=1),
                                    enc_dec()],
                         ids=["L1", "L3-gqa", "enc3-dec2"])
def test_round_trips_are_the_identity_and_the_layout_is_by_index(config):
    scanned = random_pure(config, 0)
    per_layer = unstack_layers(scanned, config)
    assert_same(per_layer, by_index(scanned, config))
    assert_same(stack_layers(per_layer, config), scanned)
    other = random_pure(per_layer_config(config), 1)  # from the per-layer side too
    assert_same(unstack_layers(stack_layers(other, config), config), other)
    # the structure is the per-layer model's own
    assert jax.tree.structure(per_layer) == jax.tree.structure(
        nnx.to_pure_dict(abstract_init(per_layer_config(config))[1]))


def test_states_keep_each_models_variable_metadata():
    """An ``nnx.State`` comes back as the other model's State: the ``"layers"`` sharding name appears
    on stacking and goes on unstacking; ``ShapeDtypeStruct`` leaves are converted too."""
    config = decoder(2)
    _, abstract = abstract_init(config)
    flat = dict(nnx.to_flat_state(unstack_layers(abstract, config)))
    want = dict(nnx.to_flat_state(abstract_init(per_layer_config(config))[1]))
    assert flat.keys() == want.keys()
    for p, v in flat.items():
        assert type(v) is type(want[p]) and v.get_value().shape == want[p].get_value().shape, p
        assert v.get_metadata()["out_sharding"] == want[p].get_metadata()["out_sharding"], p
    back = dict(nnx.to_flat_state(stack_layers(unstack_layers(abstract, config), config)))
    w_q = ("decoder", "blocks", "self_attn", "w_q")
    assert back[w_q].get_metadata()["out_sharding"] == ("layers", "embed", "heads", "head_dim")
    assert back[w_q].get_value().shape == (2, 16, 2, 8)


forward = jax.jit(lambda gd, st, *toks: nnx.merge(gd, st)(*toks), static_argnums=0)


# [1] slow, 1 s: a one-layer stack's layout is test_round_trips_...[L1]'s, and scanned logits (in their layer
# order too) are [3]'s, both default-run
@pytest.mark.parametrize("n_layers", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_scanned_logits_equal_the_per_layer_models(n_layers):
    config = decoder(n_layers)
    graphdef, per_layer_gd = abstract_init(config)[0], abstract_init(per_layer_config(config))[0]
    state = random_pure(config, n_layers)
    per_layer = unstack_layers(state, config)
    toks = jax.random.randint(jax.random.key(7), (2, T), 0, V)
    want = forward(graphdef, state, toks)
    np.testing.assert_allclose(forward(per_layer_gd, per_layer, toks), want, rtol=0, atol=ATOL)
    # and back: the per-layer model's weights stacked run as the same scanned model
    np.testing.assert_array_equal(forward(graphdef, stack_layers(per_layer, config), toks), want)
    if n_layers > 1:  # the comparison sees the order of the layers
        blocks = per_layer["decoder"]["blocks"]
        blocks[0], blocks[1] = blocks[1], blocks[0]
        assert float(jnp.abs(forward(per_layer_gd, per_layer, toks) - want).max()) > 1e-2


def test_encoder_decoder_logits_equal_the_per_layer_models():
    config = enc_dec()
    state = random_pure(config, 0)
    src = jax.random.randint(jax.random.key(1), (2, 7), 0, config.vocab_size)
    tgt = jax.random.randint(jax.random.key(2), (2, 5), 0, config.vocab_size)
    want = forward(abstract_init(config)[0], state, src, tgt)
    got = forward(abstract_init(per_layer_config(config))[0], unstack_layers(state, config), src, tgt)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


def test_wrong_layouts_are_refused_naming_the_leaf():
    config = decoder(2)
    scanned = random_pure(config, 0)
    with pytest.raises(ValueError, match=r"stack_layers: decoder.blocks has keys \['attn_residual'.*already scanned"):
        stack_layers(scanned, config)
    per_layer = unstack_layers(scanned, config)
    with pytest.raises(ValueError, match="unstack_layers: decoder.blocks has per-layer keys.*already per layer"):
        unstack_layers(per_layer, config)
    with pytest.raises(ValueError, match=r"decoder.blocks.attn_residual.norm.scale.shape=\(2, 16\): the leading "
                                         r"'layers' axis "
                                         r"must be decoder layers = 3"):
        unstack_layers(scanned, decoder(3))
    with pytest.raises(ValueError, match=r"blocks 0..2 \(decoder layers: 3\)"):
        stack_layers(per_layer, decoder(3))
    per_layer["decoder"]["blocks"][1]["mlp"]["w_in"] = np.zeros((16, 65), np.float32)
    with pytest.raises(ValueError, match=r"decoder.blocks.\*.mlp.w_in differs in shape between layers: "
                                         r"\[\(16, 64\), \(16, 65\)\]"):
        stack_layers(per_layer, config)
    assert scanned_config(per_layer_config(config)) == config
