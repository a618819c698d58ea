"""The train state, its sharded initialisation, and the jitted train and eval steps.

The state is a plain dict pytree ``{"params", "opt_state", "step", "rng"}``;
``params`` is ``nnx.to_pure_dict`` of the model state (fp32 master weights;
the model computes in ``compute_dtype``). The step sums gradients over
``grad_accum`` micro-batches with a ``lax.scan``, normalises by the number of
scored tokens in the whole batch, and applies the optimiser once. It is jitted
with explicit in/out shardings and the state donated.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxformer.model import ModelConfig, abstract_init, apply, init
from jaxformer.ops.losses import cross_entropy
from jaxformer.train import sharding as shd
from jaxformer.train.config import (CheckpointConfig, DataConfig, EvalConfig, ExperimentConfig, LoggingConfig,
                                     MeshConfig)
from jaxformer.train.optim import make_optimizer

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "mask")


@dataclass
class Trainer:
    """Everything compiled for one experiment on one mesh."""

    cfg: ExperimentConfig
    mesh: jax.sharding.Mesh
    graphdef: Any
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    state_shardings: dict
    abstract_state: dict
    init_fn: Any
    train_step: Any
    eval_step: Any
    from_params_fn: Any = None

    def init_state(self, seed: int = 0):
        """Fresh parameters and optimiser state from ``seed``, sharded on the mesh."""
        return self.init_fn(jax.random.key(seed))

    def init_state_from(self, params, seed: int = 0):
        """The state at step 0 with the given parameters (a pure dict shaped like ``abstract_state["params"]``,
        e.g. a pretrained checkpoint's; donated) and a fresh optimiser state."""
        return self.from_params_fn(params, jax.random.key(seed))


def model_loss(graphdef, params, batch, z_loss: float):
    """``(loss_sum, (ce_sum, n_tokens))`` of one packed batch: the summed loss (cross-entropy + z-loss,
    its mean times the tokens counted) to differentiate, the summed cross-entropy and the count (probes use it)."""
    logits = apply(graphdef, params, batch["inputs"], positions=batch["positions"],
                   segment_ids=batch["segment_ids"])
    loss, m = cross_entropy(logits, batch["targets"], mask=batch["mask"], z_loss=z_loss)
    n = m["n_tokens"].astype(jnp.float32)
    return loss * n, (m["ce"] * n, n)


def block_grad_norms(grads) -> jax.Array:
    """The gradient norm of each block of the (decoder) stack, ``[L]`` float32, first block first.

    Works for both layouts: blocks as ``{0: ..., 1: ...}`` or scanned (every leaf ``[L, ...]``).
    """
    stack = grads["decoder"] if "decoder" in grads else grads["encoder"]
    blocks = stack["blocks"]
    if all(isinstance(k, int) for k in blocks):
        return jnp.stack([optax.tree.norm(blocks[i]) for i in sorted(blocks)]).astype(jnp.float32)
    sq = [jnp.sum(jnp.square(g.astype(jnp.float32)), axis=tuple(range(1, g.ndim))) for g in jax.tree.leaves(blocks)]
    return jnp.sqrt(sum(sq))


def opt_state_shardings(abstract_opt, abstract_params, param_shardings, default):
    """Each optimiser-state leaf sharded like the parameter whose key path ends its own (same shape).

    Moments of every optax transformation (partitioned or masked ones included)
    sit at ``<state path>/<param path>``; scalars such as step counts, and states
    whose shape differs from their parameter's (factored ones), get ``default``.
    """
    by_path = {tuple(path): (tuple(a.shape), sh) for (path, a), sh in zip(
        jax.tree_util.tree_leaves_with_path(abstract_params), jax.tree.leaves(param_shardings))}

    def pick(path, leaf):
        for i in range(len(path)):
            hit = by_path.get(tuple(path[i:]))
            if hit is not None:  # the longest matching suffix names the parameter; a reshaped state is not sharded
                return hit[1] if hit[0] == tuple(leaf.shape) else default
        return default
    return jax.tree_util.tree_map_with_path(pick, abstract_opt)


def make_trainer(cfg: ExperimentConfig, mesh: jax.sharding.Mesh) -> Trainer:
    """Build the optimiser, shardings and jitted functions for ``cfg`` on ``mesh``.

    Cached per process on what the compiled steps depend on (model, optimiser,
    schedule, batch and sequence sizes, mesh), so e.g. a resumed run with more
    steps and a fixed ``schedule.decay_steps`` reuses the compiled step.
    """
    decay = cfg.schedule.decay_steps or cfg.steps
    key = cfg.model_copy(update={"steps": decay, "seed": 0, "hf_source": None, "data": DataConfig(),
                                 "mesh": MeshConfig(),
                                 "checkpoint": CheckpointConfig(),
                                 "logging": LoggingConfig(layer_grad_norms=cfg.logging.layer_grad_norms),
                                 "eval": EvalConfig()})
    return _make_trainer(key, mesh)


@functools.lru_cache(maxsize=16)
def _make_trainer(cfg: ExperimentConfig, mesh: jax.sharding.Mesh) -> Trainer:
    total_steps = cfg.steps
    mcfg: ModelConfig = cfg.model
    accum = cfg.optimizer.grad_accum
    shd.check_batch(cfg.batch_size, accum, mesh.shape)

    graphdef, abstract_model = abstract_init(mcfg)
    abstract_params = nnx.to_pure_dict(abstract_model)
    optimizer, schedule = make_optimizer(cfg.optimizer, cfg.schedule, total_steps, abstract_params)

    p_sh = shd.param_shardings(abstract_params, shd.logical_axes(abstract_model), mesh)
    repl = shd.replicated(mesh)
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    o_sh = opt_state_shardings(abstract_opt, abstract_params, p_sh, repl)
    state_sh = {"params": p_sh, "opt_state": o_sh, "step": repl, "rng": repl}

    def build(key):
        key, init_key = jax.random.split(key)
        params = nnx.to_pure_dict(init(mcfg, init_key)[1])
        return {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32),
                "rng": jax.random.key_data(key)}

    abstract_state = jax.eval_shape(build, jax.random.key(0))
    init_fn = jax.jit(build, out_shardings=state_sh)

    def build_from(params, key):
        key, _ = jax.random.split(key)  # the rng a fresh init from the same seed carries
        params = jax.tree.map(lambda p, a: p.astype(a.dtype), params, abstract_state["params"])
        return {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32),
                "rng": jax.random.key_data(key)}

    from_params_fn = jax.jit(build_from, out_shardings=state_sh, donate_argnums=0)
    z_loss = cfg.optimizer.z_loss

    def step(state, batch):
        params = state["params"]
        grad_fn = jax.grad(lambda p, b: model_loss(graphdef, p, b, z_loss), has_aux=True)
        if accum == 1:
            grads, (ce_sum, n) = grad_fn(params, batch)
        else:
            micro = jax.tree.map(lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch)

            def body(carry, mb):
                g, c, k = carry
                gi, (ci, ki) = grad_fn(params, mb)
                return (jax.tree.map(jnp.add, g, gi), c + ci, k + ki), None

            zeros = jax.tree.map(jnp.zeros_like, params)
            zero = jnp.zeros((), jnp.float32)
            (grads, ce_sum, n), _ = jax.lax.scan(body, (zeros, zero, zero), micro)
        denom = jnp.maximum(n, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        metrics = {"loss": ce_sum / denom, "grad_norm": grad_norm, "lr": schedule(state["step"]),
                   "param_norm": optax.tree.norm(new_params), "n_tokens": n}
        if cfg.logging.layer_grad_norms:
            metrics["grad_norm_layers"] = block_grad_norms(grads)
        new_state = {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1,
                     "rng": state["rng"]}
        return new_state, metrics

    b_sh = {k: shd.batch_sharding(mesh) for k in BATCH_KEYS}
    train_step = jax.jit(step, in_shardings=(state_sh, b_sh), out_shardings=(state_sh, repl),
                         donate_argnums=0)

    def evaluate(params, batch):
        """Summed nats and scored-token count of one batch (no z-loss)."""
        _, (ce_sum, n) = model_loss(graphdef, params, batch, 0.0)
        return ce_sum, n

    eval_step = jax.jit(evaluate, in_shardings=(p_sh, b_sh), out_shardings=repl)
    return Trainer(cfg, mesh, graphdef, optimizer, schedule, state_sh, abstract_state, init_fn,
                   train_step, eval_step, from_params_fn)
