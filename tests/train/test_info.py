"""`jaxformer info`: the optimiser-state estimate == the bytes of the trainer's real optimiser state; planning
--devices N on a mesh (memory per device scales with fsdp/tensor, impossible layouts and batches refused)."""

from __future__ import annotations

import math
import re

import jax
import pytest

from jaxformer.train import config as C
from jaxformer.train import sharding as S
from jaxformer.train.config import MeshConfig
from jaxformer.train.info import (
    compiled_memory,
    describe_experiment,
    plan_mesh,
    preset_config,
)
from jaxformer.train.step import make_trainer
from tests.train.helpers import make_corpus, tiny_config, tiny_raw


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_optimizer_state_estimate_matches_the_trainer(tmp_path, name):
    cfg = tiny_config(make_corpus(tmp_path / "c", n_files=4), optimizer={"name": name})
    tr = make_trainer(cfg, S.make_mesh(cfg.mesh, jax.devices()[:1]))
    # moments are the parameter-sized leaves; counters and Newton-Schulz coefficients are not
    real = sum(math.prod(x.shape) * x.dtype.itemsize
               for x in jax.tree.leaves(tr.abstract_state["opt_state"]) if x.ndim >= 1 and x.size > 3)
    got = describe_experiment(cfg, n_devices=1)
    assert got["optimizer"] == name and got["bytes_optimizer"] == real


# muon: 4 s (a Muon step compiled); Muon's optimiser-state estimate against the trainer's real state is
# test_optimizer_state_estimate_matches_the_trainer[muon], and XLA's analysis of a compiled step is the adamw case
@pytest.mark.parametrize("name", ["adamw", pytest.param("muon", marks=pytest.mark.slow)])
def test_estimate_against_xlas_memory_analysis_of_the_compiled_step(tmp_path, name):
    """`jaxformer info --compile`: XLA's arguments are exactly the state (the estimate's parameters and
    optimiser moments, plus the scalar leaves: step, rng key, optimiser counters, < 64 bytes) and one
    batch; all of the donated state is reused for the new one. XLA's temporaries vs the estimate's
    gradients + activations, tolerance [1, 2]x: measured 1.35x here (tiny model, one CPU device),
    1.3-1.5x for experiments/configs/stdlib_bytes.yaml (see the train/info.py docstring)."""
    cfg = C.from_dict(tiny_raw(tmp_path, mesh={"data": 1}, optimizer={"name": name}))
    est, xla = describe_experiment(cfg), compiled_memory(cfg)
    batch = cfg.batch_size * cfg.seq_len * (4 * 4 + 1)  # inputs, targets, segment ids, positions int32; mask bool
    state = xla["arguments"] - batch
    assert 0 <= state - (est["bytes_params"] + est["bytes_optimizer"]) < 64
    # the rest of the outputs: the scalar metrics and the output tuple's table (8 bytes a leaf, ~70 leaves)
    assert xla["aliased"] == state and xla["outputs"] - xla["aliased"] < 1024
    assert 1.0 <= xla["temp"] / (est["bytes_grads"] + est["bytes_activations"]) <= 2.0
    assert xla["peak"] == xla["arguments"] + xla["outputs"] - xla["aliased"] + xla["temp"]
    assert compiled_memory(cfg, 1) == xla  # mesh data=1: one device planned, one used of the 8 present
    planned = C.from_dict(tiny_raw(tmp_path, mesh={"data": -1}))
    with pytest.raises(ValueError, match="--compile compiles on the 8 devices present .mesh data=8 fsdp=1 tensor=1.,"
                                         " not on the planned mesh data=4 fsdp=1 tensor=1"):
        compiled_memory(planned, 4)


# -- planning: --devices, the mesh, the batch ---------------------------------------------------

def _plan(name, overrides, devices):
    return describe_experiment(preset_config(name, overrides, devices), devices)


# llama_7b built scanned (one abstract block: ~2.5 s a plan less than tracing 32 blocks, three plans here): the same
# leaves stacked, so the same bytes on every mesh (a "layers" axis is never sharded) and the same activation formula;
# unscanned plans are llama_tiny's here (test_devices_alone_..., the estimates against a real trainer above), and a
# scanned stack holds the unscanned one's parameters (tests/model/test_config.py's scanned-stack and count tests)
SCANNED = ["scan_layers=true"]


@pytest.fixture(scope="module")
def llama_7b_one():
    """llama_7b planned for one device, the baseline of the two tests below."""
    return _plan("llama_7b", SCANNED, 1)


def test_fsdp_divides_parameter_and_optimizer_memory_by_its_size(llama_7b_one):
    one = llama_7b_one
    fsdp = _plan("llama_7b", ["mesh.fsdp=8", *SCANNED], 8)
    assert one["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1}
    assert fsdp["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    # fp32 llama_7b: 4 bytes per parameter on one device; every leaf has a d_model=4096 dim for fsdp
    assert one["bytes_params"] == 4 * 6_738_415_616
    assert fsdp["bytes_params"] * 8 == one["bytes_params"]
    assert fsdp["bytes_grads"] * 8 == one["bytes_grads"]
    assert fsdp["bytes_optimizer"] * 8 == one["bytes_optimizer"] == 8 * 6_738_415_616
    # one sequence per device by default: the same activations per device
    assert (one["batch_size"], one["batch_per_device"]) == (1, 1)
    assert (fsdp["batch_size"], fsdp["batch_per_device"]) == (8, 1)
    assert fsdp["bytes_activations"] == one["bytes_activations"]


def test_devices_alone_plans_data_parallel_as_training_would():
    one = _plan("llama_tiny", [], 1)  # the mesh is planned from the devices alone, whatever the model's size
    dp = _plan("llama_tiny", [], 8)
    assert dp["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}  # mesh.data=-1: the rest, as MeshConfig.shape
    assert dp["bytes_params"] == one["bytes_params"] and dp["batch_size"] == 8


def test_tensor_parallel_shards_weights_and_activations(llama_7b_one):
    one = llama_7b_one
    tp = _plan("llama_7b", ["mesh.tensor=8", *SCANNED], 8)
    assert tp["mesh"] == {"data": 1, "fsdp": 1, "tensor": 8}
    # every matrix splits 8 ways; only the 65 RMSNorm scales (d_model each) stay whole
    norms = 4 * 4096 * (2 * 32 + 1)
    assert tp["bytes_params"] == (one["bytes_params"] - norms) // 8 + norms
    assert one["bytes_activations"] / 8 <= tp["bytes_activations"] < one["bytes_activations"] / 7


def test_global_batch_splits_over_data_times_fsdp():
    a = _plan("llama_tiny", ["batch_size=16", "mesh.data=2", "mesh.fsdp=4"], 8)
    b = _plan("llama_tiny", ["batch_size=2"], 1)
    assert a["batch_per_device"] == b["batch_per_device"] == 2
    assert a["bytes_activations"] == b["bytes_activations"]


@pytest.mark.parametrize("sizes,devices,message", [
    ({"data": 2, "fsdp": 8}, 8, "mesh data=2 fsdp=8 tensor=1 needs 16 devices, --devices 8"),
    ({"data": 1, "fsdp": 2}, 8, "mesh data=1 fsdp=2 tensor=1 needs 2 devices, --devices 8"),
    ({"fsdp": 3}, 8, "mesh data=-1 fsdp=3 tensor=1 does not fit --devices 8: 8 is not a multiple of 3"),
    ({"data": 4, "fsdp": 4}, None, "mesh data=4 fsdp=4 tensor=1 needs 16 devices, 8 devices present"),
])
def test_impossible_meshes_are_refused(sizes, devices, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        plan_mesh(MeshConfig(**sizes), devices)


def test_planned_mesh_matches_training_when_devices_are_present():
    """Without --devices the devices present are used as training would (conftest: 8 CPU devices)."""
    for sizes in ({}, {"data": 1}, {"fsdp": 4}, {"data": 2, "fsdp": -1, "tensor": 2}):
        mesh = MeshConfig(**sizes)
        assert tuple(plan_mesh(mesh).values()) == mesh.shape(jax.device_count()) == S.make_mesh(mesh).devices.shape


@pytest.mark.parametrize("top,message", [
    ({"batch_size": 4}, "batch_size=4 not divisible by data*fsdp=8 on mesh data=1 fsdp=8 tensor=1"),
    ({"batch_size": 8, "optimizer": {"grad_accum": 2}},
     "micro-batch batch_size/grad_accum=8/2=4 not divisible by data*fsdp=8 on mesh data=1 fsdp=8 tensor=1"),
])
def test_a_batch_training_refuses_info_refuses_with_the_same_message(tmp_path, top, message):
    cfg = C.from_dict(tiny_raw(tmp_path, mesh={"data": 1, "fsdp": 8}, **top))
    with pytest.raises(ValueError, match=re.escape(message)):
        describe_experiment(cfg, 8)
    with pytest.raises(ValueError, match=re.escape(message)):
        make_trainer(cfg, S.make_mesh(cfg.mesh))


def test_preset_overrides_address_the_experiment_or_the_model():
    cfg = preset_config("llama_tiny", ["n_layers=3", "model.n_heads=2", "max_seq_len=64", "mesh.fsdp=2",
                                       "optimizer.name=muon", "optimizer.grad_accum=2"], 4)
    assert (cfg.model.n_layers, cfg.model.attention.n_heads, cfg.model.max_seq_len) == (3, 2, 64)
    assert cfg.mesh.fsdp == 2 and cfg.optimizer.name == "muon"
    assert cfg.seq_len == 64 and cfg.batch_size == 2 * 2 * 2  # min(max_seq_len, 2048); data*fsdp*grad_accum
    assert preset_config("llama_7b").seq_len == 2048 and preset_config("llama_7b", ["seq_len=512"]).seq_len == 512
    # planning sizes any model kind; training still refuses a non-decoder
    enc_dec = preset_config("vaswani_base", ["n_layers=2"], 2)
    assert enc_dec.model.kind == "encoder_decoder" and enc_dec.model.n_layers == 2 and enc_dec.batch_size == 2
    with pytest.raises(C.ConfigError, match="llama_tiny: model.mesh: unknown key"):
        preset_config("llama_tiny", ["model.mesh.fsdp=2"])
