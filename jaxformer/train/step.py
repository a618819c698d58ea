"""The train state, its sharded initialisation, and the jitted train and eval steps.

The compiled program depends on a :class:`StepSpec` alone (the model, the optimiser, the schedule and its
horizon, the batch size, what the step logs): :func:`train_step` and :func:`eval_step` are module-level
functions of ``(state or params, batch, spec)``, and :func:`make_trainer` jits them, with the mesh's
shardings, once per ``(spec, mesh)``.

The state is a plain dict pytree ``{"params", "opt_state", "step", "rng"}``;
``params`` is ``nnx.to_pure_dict`` of the model state (fp32 master weights;
the model computes in ``compute_dtype``). The step sums gradients over
``grad_accum`` micro-batches with a ``lax.scan`` (each micro-batch computed in ``parallel_parts``
independent parts side by side, :func:`in_parts`), normalises by the number of scored tokens in the
whole batch, and applies the optimiser once. It is jitted with explicit in/out shardings and the state
donated.

A LoRA run (``model.lora``; :mod:`jaxformer.train.lora`) trains the adapter alone: its state's
``params`` are the ``nnx.LoRAParam`` leaves, the frozen base lives beside the state in
:attr:`Trainer.frozen` (never in a checkpoint), and :meth:`Trainer.model_params` joins the two.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxformer.model import ModelConfig, Transformer, abstract_init, apply, count_params, flops_per_token, init
from jaxformer.nn.lora import is_dropout_key
from jaxformer.ops.losses import cross_entropy
from jaxformer.train import sharding as shd
from jaxformer.train.config import ExperimentConfig, OptimizerConfig, ScheduleConfig
from jaxformer.train.optim import make_optimizer
from jaxformer.train.packing import Batch



@dataclass(frozen=True)
class StepSpec:
    """What the compiled train and eval steps depend on; two experiments with equal specs share them.

    ``horizon`` is the steps the schedule decays over (``schedule.decay_steps``, else the run's ``steps``), so
    a resumed run given more steps under a fixed ``decay_steps`` reuses the compiled step.
    """

    model: ModelConfig
    optimizer: OptimizerConfig
    schedule: ScheduleConfig
    horizon: int
    batch_size: int
    layer_grad_norms: bool = False

    @classmethod
    def of(cls, cfg: ExperimentConfig) -> StepSpec:
        return cls(model=cfg.model, optimizer=cfg.optimizer, schedule=cfg.schedule,
                   horizon=cfg.schedule.decay_steps or cfg.steps, batch_size=cfg.batch_size,
                   layer_grad_norms=cfg.logging.layer_grad_norms)


@functools.lru_cache(maxsize=32)
def step_parts(spec: StepSpec, params_of: str = "model"):
    """``(graphdef, optimizer, schedule)`` of ``spec``: the model's graph and the optax transformation over the
    parameters it trains (``params_of="model"``: all of them; ``"adapter"``: a LoRA model's adapter)."""
    if params_of == "adapter":
        graphdef, trained, *_ = split_abstract(spec.model)
    else:
        graphdef, abstract = abstract_init(spec.model)
        trained = nnx.to_pure_dict(abstract)
    optimizer, schedule = make_optimizer(spec.optimizer, spec.schedule, spec.horizon, trained)
    return graphdef, optimizer, schedule


def train_step(state, batch, spec: StepSpec):
    """One optimiser step of the whole model: ``(new state, metrics)``. Gradients summed over
    ``spec.optimizer.grad_accum`` micro-batches, normalised by the scored tokens of the whole batch."""
    graphdef, optimizer, schedule = step_parts(spec)
    z_loss = spec.optimizer.z_loss
    grad_fn = jax.grad(lambda p, b, i: model_loss(graphdef, p, b, z_loss), has_aux=True)
    grads, ce_sum, n = accumulate(grad_fn, state["params"], batch, spec.optimizer.grad_accum,
                                  spec.optimizer.parallel_parts)
    return apply_step(spec, optimizer, schedule, state, grads, ce_sum, n)


@functools.lru_cache(maxsize=32)
def model_graphdef(config: ModelConfig):
    """The graphdef of ``config``'s model (abstract, cached)."""
    return abstract_init(config)[0]


def eval_step(params, batch, spec: StepSpec):
    """Summed nats and scored-token count of one batch (no z-loss); ``params`` the whole model's."""
    _, (ce_sum, n) = model_loss(model_graphdef(spec.model), params, batch, 0.0)
    return ce_sum, n


@dataclass
class Trainer:
    """Everything compiled for one experiment on one mesh (:func:`make_trainer`)."""

    spec: StepSpec
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
    frozen: Any = None  # LoRA: the frozen base (pure dict), set by jaxformer.train.lora.attach_base
    frozen_shardings: Any = None  # LoRA: its shardings (None: not a LoRA trainer)

    def init_state(self, seed: int = 0):
        """Fresh parameters and optimiser state from ``seed``, sharded on the mesh."""
        return self.init_fn(jax.random.key(seed))

    def init_state_from(self, params, seed: int = 0):
        """The state at step 0 with the given parameters (a pure dict shaped like ``abstract_state["params"]``,
        e.g. a pretrained checkpoint's; donated) and a fresh optimiser state."""
        return self.from_params_fn(params, jax.random.key(seed))

    def model_params(self, state) -> dict:
        """The whole model's parameters of a train state (what ``eval_step``, ``graphdef`` and decoding take):
        ``state["params"]``, joined with the frozen base of a LoRA run."""
        if self.frozen_shardings is None:
            return state["params"]
        if self.frozen is None:
            raise RuntimeError("a LoRA trainer's frozen base is not loaded: jaxformer.train.lora.attach_base first")
        return join(self.frozen, state["params"])


def model_loss(graphdef, params, batch: Batch, z_loss: float):
    """``(loss_sum, (ce_sum, n_tokens))`` of one packed :class:`~jaxformer.train.packing.Batch`: the summed loss (cross-entropy + z-loss,
    its mean times the tokens counted) to differentiate, the summed cross-entropy and the count (probes use it)."""
    logits = apply(graphdef, params, batch.tokens, positions=batch.positions, segment_ids=batch.segment_ids)
    loss, m = cross_entropy(logits, batch.targets, mask=batch.loss_mask, z_loss=z_loss)
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
    """The optimiser, shardings and jitted steps of ``cfg`` on ``mesh``, compiled once per process for each
    ``(StepSpec.of(cfg), mesh)`` (its ``parallel_parts`` resolved: :func:`resolve_parts`). A LoRA run
    (``model.lora``) gets its own trainer (its frozen base is per run) over the cached compiled functions."""
    spec = resolve_parts(StepSpec.of(cfg), mesh, cfg.seq_len)
    if cfg.model.lora is not None:
        return make_lora_trainer(spec, mesh)
    return _make_trainer(spec, mesh)


def in_parts(grad_fn, parts: int):
    """``grad_fn`` over ``parts`` strided parts of its micro-batch (rows ``j, j + parts, ...``: on a mesh, each
    device's rows of a part are its own), computed as independent subprograms and summed, so XLA may run them side
    by side (``optimizer.parallel_parts``). Part ``j`` of micro-batch ``i`` is handed the index ``i * parts + j``
    (its own dropout keys)."""
    if not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parallel_parts={parts!r}: a number of parts >= 1 (resolve \"auto\" first: "
                         f"resolve_parts(spec, mesh, seq_len), as make_trainer does)")
    if parts == 1:
        return grad_fn

    def summed(params, batch, i):
        outs = [grad_fn(params, jax.tree.map(lambda x: x.reshape(-1, parts, *x.shape[1:])[:, j], batch),
                        i * parts + j) for j in range(parts)]
        return jax.tree.map(lambda *xs: functools.reduce(jnp.add, xs), *outs)

    return summed


AUTO_PARTS = ((4, 40e9, 30_000_000), (2, 4e9, 100_000_000))
"""``parallel_parts: auto`` on CPU devices: rows of ``(parts, min FLOPs, max parameters)``, the first that a step meets
chosen: each device's rows of a micro-batch split into ``parts``, the micro-batch is worth at least ``min FLOPs``
training FLOPs a device, the model has at most ``max parameters``; a model with ``scan_layers`` always runs in one part.
Measured on 2-core AMD EPYC CPUs (``experiments/results/train_throughput.md``, paired in one process, each contender's
timed steps after an untimed one; Zen 3): two parts 1.01-1.06x a one-part step at 8.8-8.9 GFLOP (width 128) and
1.06-1.07x at nanoGPT's 23-46 GFLOP, level at 2.6-7.5 GFLOP (0.96-1.02x), 0.78-0.89x at 1.5 GFLOP (one row a part); with
``scan_layers`` 0.81-0.88x at 6-48 layers, 0.92-0.96x at 2-4 (1.4-9.6 GFLOP, widths 32-128; the cause not traced: each
part's layers then run as a loop of their own; ``remat`` alone 1.02x); four parts 1.13x at nanoGPT's 46 GFLOP, and on
Zen 2 1.10-1.14x at 92 GFLOP and 25 M parameters, where two gave 1.04-1.07x. The bars: the parts' program compiles
longer (nanoGPT's shape: 3.4 s in one part, 5.6 in two, 8.4 in four) and a micro-batch's gradients are alive side by
side before their sum (``parts - 1`` more copies of the trained parameters); four parts of 2-6 GFLOP each gained no more
than two or lost (nanoGPT's shape at 4 rows, Zen 2: 0.96x one part, two 1.03x), nor did four at 85 M parameters (1.05x,
as two). The data would place the two-part bar anywhere from 1.5 to ~8.8 GFLOP; 4 is at the low end of the level shapes,
so that no study point without ``scan_layers`` (7.1-34 GFLOP) changes its step. The 40 GFLOP and 30 M bars lie between
measured shapes (23 and 46 GFLOP; 25 and 85 M)."""


def auto_parts(model: ModelConfig, batch_size: int, grad_accum: int, seq_len: int, shards: int, cpu: bool) -> int:
    """What ``parallel_parts: auto`` resolves to: on CPU devices the first of :data:`AUTO_PARTS` that the
    micro-batch (``batch_size // grad_accum`` rows of ``seq_len`` tokens over ``shards`` devices) and the model
    meet; else 1; always 1 for a model with ``scan_layers``. The parts are independent subprograms, for XLA's
    CPU runtime to run side by side, and each part's activations are smaller; their gain needs the second core
    (pinned to one core they gain little or nothing), but how the runtime overlaps them is not settled
    (``experiments/results/train_throughput.md``)."""
    micro = batch_size // grad_accum
    rows = micro // shards if micro % shards == 0 else 0
    if not cpu or not rows or model.scan_layers:
        return 1
    work, size = flops_per_token(model, seq_len) * seq_len * rows, count_params(model)
    return next((parts for parts, min_flops, max_params in AUTO_PARTS
                 if rows % parts == 0 and work >= min_flops and size <= max_params), 1)


def resolve_parts(spec: StepSpec, mesh: jax.sharding.Mesh, seq_len: int) -> StepSpec:
    """``spec`` with ``optimizer.parallel_parts`` a number (:func:`auto_parts` for "auto", for batches of
    ``seq_len`` tokens a row on ``mesh``)."""
    parts = spec.optimizer.parallel_parts
    if parts == "auto":
        cpu = all(d.platform == "cpu" for d in mesh.devices.flat)
        parts = auto_parts(spec.model, spec.batch_size, spec.optimizer.grad_accum, seq_len, shd.batch_shards(mesh),
                           cpu)
    return dataclasses.replace(spec, optimizer=spec.optimizer.model_copy(update={"parallel_parts": parts}))


def accumulate(grad_fn, params, batch, accum: int, parts: int = 1):
    """``(grads, ce_sum, n)`` summed over ``accum`` micro-batches of ``batch`` (a ``lax.scan``), each computed in
    ``parts`` parts side by side (:func:`in_parts`); ``grad_fn(params, micro_batch, i) -> (grads, (ce_sum, n))``
    with ``i`` the micro-batch's (or part's) index."""
    grad_fn = in_parts(grad_fn, parts)
    if accum == 1:
        grads, (ce_sum, n) = grad_fn(params, batch, jnp.zeros((), jnp.int32))
        return grads, ce_sum, n
    micro = jax.tree.map(lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch)

    def body(carry, mb_i):
        g, c, k = carry
        gi, (ci, ki) = grad_fn(params, *mb_i)
        return (jax.tree.map(jnp.add, g, gi), c + ci, k + ki), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    zero = jnp.zeros((), jnp.float32)
    (grads, ce_sum, n), _ = jax.lax.scan(body, (zeros, zero, zero), (micro, jnp.arange(accum, dtype=jnp.int32)))
    return grads, ce_sum, n


def apply_step(spec: StepSpec, optimizer, schedule, state, grads, ce_sum, n):
    """``(new_state, metrics)``: the summed ``grads`` normalised by the scored tokens ``n``, the optimiser
    applied once to ``state["params"]``."""
    params = state["params"]
    denom = jnp.maximum(n, 1.0)
    grads = jax.tree.map(lambda g: g / denom, grads)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state["opt_state"], params)
    new_params = optax.apply_updates(params, updates)
    metrics = {"loss": ce_sum / denom, "grad_norm": grad_norm, "lr": schedule(state["step"]),
               "param_norm": optax.tree.norm(new_params), "n_tokens": n}
    if spec.layer_grad_norms:
        metrics["grad_norm_layers"] = block_grad_norms(grads)
    new_state = {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1, "rng": state["rng"]}
    return new_state, metrics


def _state_shardings(optimizer, params_abstract: dict, params_sh: dict, mesh) -> tuple[dict, Any]:
    """``(state shardings, replicated)`` of a train state over the trained ``params`` (their shardings given)."""
    repl = shd.replicated(mesh)
    o_sh = opt_state_shardings(jax.eval_shape(optimizer.init, params_abstract), params_abstract, params_sh, repl)
    return {"params": params_sh, "opt_state": o_sh, "step": repl, "rng": repl}, repl


def _state_builders(optimizer, fresh_params, state_sh: dict):
    """``(abstract_state, init_fn, from_params_fn)`` of a train state whose trained parameters are
    ``fresh_params(key)`` at init, or given (cast to their dtypes) from a checkpoint."""
    def state(params, key):
        return {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32),
                "rng": jax.random.key_data(key)}

    def build(key):
        key, init_key = jax.random.split(key)
        return state(fresh_params(init_key), key)

    abstract_state = jax.eval_shape(build, jax.random.key(0))

    def build_from(params, key):
        key, _ = jax.random.split(key)  # the rng a fresh init from the same seed carries
        return state(jax.tree.map(lambda p, a: p.astype(a.dtype), params, abstract_state["params"]), key)

    return (abstract_state, jax.jit(build, out_shardings=state_sh),
            jax.jit(build_from, out_shardings=state_sh, donate_argnums=0))


@functools.lru_cache(maxsize=16)
def _make_trainer(spec: StepSpec, mesh: jax.sharding.Mesh) -> Trainer:
    mcfg: ModelConfig = spec.model
    shd.check_batch(spec.batch_size, spec.optimizer.grad_accum, mesh.shape, spec.optimizer.parallel_parts)
    graphdef, optimizer, schedule = step_parts(spec)
    abstract_model = abstract_init(mcfg)[1]
    abstract_params = nnx.to_pure_dict(abstract_model)
    p_sh = shd.param_shardings(abstract_params, shd.logical_axes(abstract_model), mesh)
    state_sh, repl = _state_shardings(optimizer, abstract_params, p_sh, mesh)
    abstract_state, init_fn, from_params_fn = _state_builders(
        optimizer, lambda key: nnx.to_pure_dict(init(mcfg, key)[1]), state_sh)
    b_sh = Batch(*[shd.batch_sharding(mesh)] * len(Batch._fields))
    step = jax.jit(functools.partial(train_step, spec=spec), in_shardings=(state_sh, b_sh),
                   out_shardings=(state_sh, repl), donate_argnums=0)
    evaluate = jax.jit(functools.partial(eval_step, spec=spec), in_shardings=(p_sh, b_sh), out_shardings=repl)
    return Trainer(spec, mesh, graphdef, optimizer, schedule, state_sh, abstract_state, init_fn, step, evaluate,
                   from_params_fn)


# -- LoRA runs: the adapter trained, the base frozen beside the state (jaxformer.train.lora reads it)

def join(frozen: dict, adapter: dict) -> dict:
    """The whole model's pure dict from its frozen part and its adapter (disjoint leaves)."""
    out = dict(frozen)
    for k, v in adapter.items():
        out[k] = join(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def dropout_key_paths(frozen_abstract: dict) -> list[tuple]:
    """Flat paths of the dropout keys (``.../w_q_lora/key``) in the frozen part."""
    return [p for p in nnx.traversals.flatten_mapping(frozen_abstract) if is_dropout_key(p)]


def dropout_keys(frozen: dict, paths: list[tuple], rng, step, micro) -> dict:
    """``frozen`` with every dropout key replaced by ``fold_in(k, layer)``, ``k`` drawn from ``(rng, step,
    micro)`` and the adapter's place in a block (its path without the layer index): a different mask per
    adapter, layer, step and micro-batch, and the same masks per layer and with ``scan_layers`` (whose
    ``[L, 2]`` leaves get layers 0..L-1)."""
    if not paths:
        return frozen
    base = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(rng), step), micro)
    places = sorted({tuple(k for k in p if not isinstance(k, int)) for p in paths}, key=str)
    flat = dict(nnx.traversals.flatten_mapping(frozen))
    for p in paths:
        k = jax.random.fold_in(base, places.index(tuple(x for x in p if not isinstance(x, int))))
        layer = [x for x in p if isinstance(x, int)]
        shape = flat[p].shape
        if layer:  # per layer: blocks/{i}/.../key [2]
            flat[p] = jax.random.key_data(jax.random.fold_in(k, layer[0])).reshape(shape)
        else:  # scanned: blocks/.../key [L, 2]
            keys = jax.vmap(lambda i, k=k: jax.random.fold_in(k, i))(jnp.arange(math.prod(shape[:-1])))
            flat[p] = jax.random.key_data(keys).reshape(shape)
    return nnx.traversals.unflatten_mapping(flat)


class _WithFrozen:
    """A LoRA trainer's ``train_step(state, batch)``: the jitted ``step(frozen, state, batch)`` given the
    trainer's frozen base (``lower`` works before it is loaded, for ``jaxformer info --compile``)."""

    def __init__(self, step, trainer: Trainer, frozen_abstract: dict):
        self.step, self.trainer, self.frozen_abstract = step, trainer, frozen_abstract

    def __call__(self, state, batch):
        if self.trainer.frozen is None:
            raise RuntimeError("a LoRA trainer's frozen base is not loaded: jaxformer.train.lora.attach_base first")
        return self.step(self.trainer.frozen, state, batch)

    def lower(self, state, batch):
        frozen = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self.frozen_abstract,
                              self.trainer.frozen_shardings)
        return self.step.lower(frozen, state, batch)


def split_abstract(config: ModelConfig):
    """``(graphdef, adapter, frozen, adapter axes, frozen axes)`` of the LoRA model ``config``: abstract pure
    dicts of its ``nnx.LoRAParam`` leaves and of the rest, and their logical axes."""
    graphdef, abstract = abstract_init(config)
    adapter, frozen = nnx.split_state(abstract, nnx.LoRAParam, ...)
    return (graphdef, nnx.to_pure_dict(adapter), nnx.to_pure_dict(frozen), shd.logical_axes(adapter),
            shd.logical_axes(frozen))


@functools.lru_cache(maxsize=8)
def lora_dropout(config: ModelConfig) -> tuple[Any, tuple]:
    """``(graphdef, dropout key paths)`` a LoRA model trains with: with dropout, the graphdef whose adapters
    are not deterministic (an attribute: :mod:`jaxformer.nn.lora`) and the paths of their keys; else the plain
    graphdef and no paths. Cached: the step reads it on every trace."""
    graphdef, _, frozen, _, _ = split_abstract(config)
    paths = tuple(dropout_key_paths(frozen))
    if paths:
        model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
        model.set_attributes(deterministic=False, raise_if_not_found=False)
        graphdef = nnx.graphdef(model)
    return graphdef, paths


def lora_train_step(frozen, state, batch, spec: StepSpec):
    """:func:`train_step` of a LoRA model: the gradient of the adapter (``state["params"]``) alone, the ``frozen``
    base joined in (its dropout keys drawn per step and micro-batch, or part: :func:`dropout_keys`)."""
    _, optimizer, schedule = step_parts(spec, "adapter")
    graphdef, paths = lora_dropout(spec.model)
    z_loss = spec.optimizer.z_loss

    def loss(adapter, b, i):
        f = dropout_keys(frozen, paths, state["rng"], state["step"], i)
        return model_loss(graphdef, join(f, adapter), b, z_loss)

    grads, ce_sum, n = accumulate(jax.grad(loss, has_aux=True), state["params"], batch, spec.optimizer.grad_accum,
                                  spec.optimizer.parallel_parts)
    return apply_step(spec, optimizer, schedule, state, grads, ce_sum, n)


def make_lora_trainer(spec: StepSpec, mesh: jax.sharding.Mesh) -> Trainer:
    """:func:`make_trainer` for ``model.lora``: the compiled functions cached, the
    trainer (its :attr:`~Trainer.frozen` base) one per call."""
    cached, frozen_abstract = _make_lora_trainer(spec, mesh)
    trainer = dataclasses.replace(cached)
    trainer.train_step = _WithFrozen(cached.train_step, trainer, frozen_abstract)
    return trainer


@functools.lru_cache(maxsize=8)
def _make_lora_trainer(spec: StepSpec, mesh: jax.sharding.Mesh) -> tuple[Trainer, dict]:
    mcfg = spec.model
    shd.check_batch(spec.batch_size, spec.optimizer.grad_accum, mesh.shape, spec.optimizer.parallel_parts)
    graphdef, adapter_abs, frozen_abs, adapter_axes, frozen_axes = split_abstract(mcfg)
    _, optimizer, schedule = step_parts(spec, "adapter")
    a_sh = shd.param_shardings(adapter_abs, adapter_axes, mesh)
    f_sh = shd.param_shardings(frozen_abs, frozen_axes, mesh)
    state_sh, repl = _state_shardings(optimizer, adapter_abs, a_sh, mesh)

    def fresh_adapter(key):  # the base's random init is dead code under jit: only the adapter is computed
        return nnx.to_pure_dict(nnx.state(Transformer(mcfg, rngs=nnx.Rngs(params=key)), nnx.LoRAParam))

    abstract_state, init_fn, from_params_fn = _state_builders(optimizer, fresh_adapter, state_sh)
    b_sh = Batch(*[shd.batch_sharding(mesh)] * len(Batch._fields))
    step = jax.jit(functools.partial(lora_train_step, spec=spec), in_shardings=(f_sh, state_sh, b_sh),
                   out_shardings=(state_sh, repl), donate_argnums=1)
    evaluate = jax.jit(functools.partial(eval_step, spec=spec), in_shardings=(join(f_sh, a_sh), b_sh),
                       out_shardings=repl)
    trainer = Trainer(spec, mesh, graphdef, optimizer, schedule, state_sh, abstract_state, init_fn, step,
                      evaluate, from_params_fn, frozen=None, frozen_shardings=f_sh)
    return trainer, frozen_abs
