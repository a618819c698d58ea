"""`jaxformer info`'s optimiser-state estimate == the bytes of the real optimiser state the trainer builds."""

from __future__ import annotations

import math

import jax
import pytest

from jaxformer.train import sharding as S
from jaxformer.train.info import describe_experiment
from jaxformer.train.step import make_trainer
from tests.train.helpers import make_corpus, tiny_config


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_optimizer_state_estimate_matches_the_trainer(tmp_path, name):
    cfg = tiny_config(make_corpus(tmp_path / "c", n_files=4), optimizer={"name": name})
    tr = make_trainer(cfg, S.make_mesh(cfg.mesh, jax.devices()[:1]))
    # moments are the parameter-sized leaves; counters and Newton-Schulz coefficients are not
    real = sum(math.prod(x.shape) * x.dtype.itemsize
               for x in jax.tree.leaves(tr.abstract_state["opt_state"]) if x.ndim >= 1 and x.size > 3)
    got = describe_experiment(cfg, n_devices=1)
    assert got["optimizer"] == name and got["bytes_optimizer"] == real
