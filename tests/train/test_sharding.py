"""Sharding on 8 CPU devices: the rules table, real parameter sharding, and losses equal to one device."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxformer.train import config as C
from jaxformer.train import sharding as S
from jaxformer.train.corpus import build_corpus
from jaxformer.train.pipeline import TrainIterator
from jaxformer.train.step import make_trainer
from tests.train.helpers import make_corpus, tiny_config


def test_rules_table_and_fallbacks():
    mesh = {"data": 2, "fsdp": 2, "tensor": 2}
    assert S.spec_for(("embed", "mlp"), (64, 128), mesh) == P("fsdp", "tensor")
    assert S.spec_for(("vocab", "embed"), (264, 64), mesh) == P("tensor", "fsdp")
    assert S.spec_for(("embed", "kv_heads", "head_dim"), (64, 1, 16), mesh) == P("fsdp", None, None)  # 1 % 2
    assert S.spec_for(("layers", "embed", "heads", "head_dim"), (2, 64, 4, 16), mesh) == P(None, "fsdp", "tensor", None)
    assert S.spec_for(("embed", "embed"), (64, 64), mesh) == P("fsdp", None)  # a mesh axis used once
    assert S.spec_for(("embed",), (63,), mesh) == P(None)  # not divisible: replicated
    assert S.spec_for(("embed", "mlp"), (64, 128), {"data": 8, "fsdp": 1, "tensor": 1}) == P(None, None)
    with pytest.raises(ValueError, match="no rule"):
        S.spec_for(("nonsense",), (4,), mesh)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    corpus_dir = make_corpus(tmp_path_factory.mktemp("c"))
    cfg = tiny_config(corpus_dir, model={"d_model": 64, "n_heads": 4, "n_kv_heads": 2})
    corpus = build_corpus(cfg.data)
    it = TrainIterator(corpus, seq_len=32, batch_size=8, seed=0)
    batches = [next(it) for _ in range(4)]
    return cfg, batches


def _losses(cfg, batches, mesh_cfg, devices=None, init=None):
    mesh = S.make_mesh(mesh_cfg, devices)
    tr = make_trainer(cfg, mesh)
    state = tr.init_state() if init is None else jax.device_put(init, tr.state_shardings)
    losses = []
    for b in batches:
        state, m = tr.train_step(state, S.put_batch(b, mesh))
        losses.append((float(m["loss"]), float(m["grad_norm"])))
    return np.asarray(losses), state, mesh


# (8, 1, 1) and (2, 4, 1): 6 s (a step compiled and run each); a data-parallel step matching one device is
# test_parallel_parts.py's, and specs on mesh axes of size 1 (left out) are test_rules_table_and_fallbacks's.
# (2, 2, 2): 8 s; the same model on the same data x fsdp x tensor mesh against one device is the default run's
# tests/train/test_optim.py::test_muon_trains_on_a_sharded_mesh_like_one_device (Muon on the matrices, AdamW on the
# embedding and norms), which checks this case's sharded initialisation, parameter specs, shard shape and moments too
@pytest.mark.parametrize("shape", [pytest.param((8, 1, 1), marks=pytest.mark.slow),
                                   pytest.param((2, 4, 1), marks=pytest.mark.slow),
                                   pytest.param((2, 2, 2), marks=pytest.mark.slow)])
def test_meshes_match_one_device(setup, shape):
    cfg, batches = setup
    assert jax.device_count() == 8
    one = make_trainer(cfg, S.make_mesh(C.MeshConfig(data=1), jax.devices()[:1]))
    init = jax.device_get(one.init_state())
    ref, _, _ = _losses(cfg, batches, C.MeshConfig(data=1), jax.devices()[:1], init=init)
    got, state, mesh = _losses(cfg, batches, C.MeshConfig(data=shape[0], fsdp=shape[1], tensor=shape[2]), init=init)
    # fp32 reductions split across devices: equal to 1e-5 relative for 4 steps
    np.testing.assert_allclose(got, ref, rtol=1e-5, err_msg=f"mesh {shape}")
    specs = {k: v.sharding.spec for k, v in (
        ("w_q", state["params"]["decoder"]["blocks"][0]["self_attn"]["w_q"]),
        ("w_up", state["params"]["decoder"]["blocks"][0]["mlp"]["w_up"]),
        ("embed", state["params"]["embed"]["embedding"]))}
    mu = state["opt_state"][1][0].mu["decoder"]["blocks"][0]["mlp"]["w_up"]
    if shape == (2, 2, 2):
        # the sharded initialisation draws the same parameters as one device
        again = make_trainer(cfg, mesh).init_state(0)
        for x, y in zip(jax.tree.leaves(init), jax.tree.leaves(again)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(jax.device_get(y)))
        assert specs == {"w_q": P("fsdp", "tensor", None), "w_up": P("fsdp", "tensor"),
                         "embed": P("tensor", "fsdp")}
        assert mu.sharding.spec == P("fsdp", "tensor")  # optimiser state sharded like the params
        w = state["params"]["decoder"]["blocks"][0]["mlp"]["w_up"]
        assert w.addressable_shards[0].data.shape == (32, w.shape[1] // 2)
    if shape == (2, 4, 1):
        assert specs["w_up"] == P("fsdp", None) and mu.sharding.spec == P("fsdp", None)
    if shape == (8, 1, 1):
        assert all(s == P(None, None) or s == P(None, None, None) for s in specs.values())
