"""``StepSpec``: the compiled train step depends on it alone. Equal specs for configs that differ only where the
program does not (seed, run length under a fixed ``decay_steps``, data, checkpoints, logging cadence,
evaluation), different ones where it does, one compiled step per spec, and the schedule's learning rate over
the spec's horizon against the warmup-cosine formula written out."""

from __future__ import annotations

import math

import jax
import pytest

from jaxformer.train import config as C
from jaxformer.train import sharding as S
from jaxformer.train.step import StepSpec, make_trainer
from tests.train.helpers import make_corpus, tiny_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("spec") / "c", 4)


def test_the_spec_holds_what_changes_the_program(corpus):
    base = StepSpec.of(tiny_config(corpus))
    for same in (dict(steps=40), dict(seed=3), dict(checkpoint={"every": 7}), dict(eval={"max_tokens": 128}),
                 dict(logging={"every": 5}), dict(data={"val_fraction": 0.3}), dict(seq_len=16)):
        assert StepSpec.of(tiny_config(corpus, **same)) == base, same
    for other in (dict(optimizer={"lr": 1e-3}), dict(optimizer={"grad_accum": 2}), dict(schedule={"warmup_steps": 2}),
                  dict(batch_size=4), dict(model={"d_model": 64}), dict(logging={"layer_grad_norms": True}),
                  dict(schedule={"decay_steps": 50})):
        assert StepSpec.of(tiny_config(corpus, **other)) != base, other
    assert base.horizon == 100
    free = tiny_config(corpus, steps=40, schedule={"decay_steps": None})
    assert StepSpec.of(free).horizon == 40  # no decay_steps: the schedule decays over the run
    assert StepSpec.of(free) != StepSpec.of(tiny_config(corpus, steps=41, schedule={"decay_steps": None}))


def test_equal_specs_share_one_compiled_step(corpus):
    mesh = S.make_mesh(C.MeshConfig(data=1), jax.devices()[:1])
    a = make_trainer(tiny_config(corpus), mesh)
    b = make_trainer(tiny_config(corpus, steps=40, seed=5), mesh)  # a longer run under the same decay_steps
    assert a.spec == b.spec and a.train_step is b.train_step and a.eval_step is b.eval_step
    c = make_trainer(tiny_config(corpus, optimizer={"lr": 1e-3}), mesh)
    assert c.train_step is not a.train_step


def test_the_learning_rate_follows_warmup_then_cosine_over_the_horizon(corpus):
    cfg = tiny_config(corpus, steps=40, optimizer={"lr": 3e-3},
                      schedule={"kind": "cosine", "warmup_steps": 4, "decay_steps": 100, "min_lr_ratio": 0.1})
    trainer = make_trainer(cfg, S.make_mesh(C.MeshConfig(data=1), jax.devices()[:1]))
    peak, w, horizon, floor = 3e-3, 4, 100, 0.1

    def want(k):  # linear warmup from 0, then cosine from the peak to floor * peak at the horizon, flat after
        if k < w:
            return peak * k / w
        t = min(k - w, horizon - w) / (horizon - w)
        return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))

    for k in (0, 1, 3, 4, 5, 39, 50, 99, 100, 150):
        assert float(trainer.schedule(k)) == pytest.approx(want(k), rel=1e-5, abs=1e-12), k
