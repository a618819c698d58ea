"""The optimiser: AdamW (or Muon + AdamW) with a weight-decay mask, warmup + cosine/linear decay, clipping.

Gradient accumulation lives in the train step (a scan over micro-batches), so
the optimiser sees one summed gradient per step. Parameters are classified by
their path in the state tree: ``embedding`` leaves are embeddings, anything
under a module whose name contains ``norm`` is a norm, leaves named ``b_*`` or
``bias`` are biases; everything else (the matrices) always gets weight decay.
"""

from __future__ import annotations

import jax
import optax

from jaxformer.train.config import OptimizerConfig, ScheduleConfig


def make_schedule(opt: OptimizerConfig, sched: ScheduleConfig, total_steps: int) -> optax.Schedule:
    """Step -> learning rate: linear warmup from 0, then ``sched.kind`` to ``min_lr_ratio * lr``."""
    peak, warm = opt.lr, sched.warmup_steps
    decay = max((sched.decay_steps or total_steps) - warm, 1)
    end = peak * sched.min_lr_ratio
    if sched.kind == "cosine":
        after = optax.cosine_decay_schedule(peak, decay, alpha=sched.min_lr_ratio)
    elif sched.kind == "linear":
        after = optax.linear_schedule(peak, end, decay)
    else:
        after = optax.constant_schedule(peak)
    if warm == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), after], [warm])


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def param_kind(path) -> str:
    """``"embedding" | "norm" | "bias" | "weight"`` for a parameter at ``path`` (a jax key path)."""
    names = [_key_name(k) for k in path if _key_name(k) != "value"]
    leaf = names[-1] if names else ""
    if any("norm" in n for n in names[:-1]):
        return "norm"
    if leaf == "embedding":
        return "embedding"
    if leaf == "bias" or leaf.startswith("b_"):
        return "bias"
    return "weight"


def decay_mask(params, opt: OptimizerConfig):
    """A pytree of bools like ``params``: True where weight decay applies."""
    allowed = {"weight": True, "norm": opt.decay_norms, "bias": opt.decay_biases,
               "embedding": opt.decay_embeddings}
    return jax.tree_util.tree_map_with_path(lambda p, _: allowed[param_kind(p)], params)


# How many trailing axes of each hidden matrix are its input (reduction) and output axes; leading
# axes beyond them (the ``layers`` axis of scanned stacks) are batch axes, orthogonalised one by one.
_MATRIX_AXES = {"w_q": (1, 2), "w_k": (1, 2), "w_v": (1, 2), "w_o": (2, 1)}


def muon_dimensions(params):
    """Per leaf: ``MuonDimensionNumbers`` for hidden weight matrices (``w_*``), None for the rest.

    Embeddings, the LM head (``kernel``), norms and biases get None: Muon is for
    the matrices between hidden states, AdamW keeps the others.
    """
    def dims(path, x):
        names = [_key_name(k) for k in path if _key_name(k) != "value"]
        leaf = names[-1] if names else ""
        if param_kind(path) != "weight" or not leaf.startswith("w_"):
            return None
        n_in, n_out = _MATRIX_AXES.get(leaf, (1, 1))
        lead = len(x.shape) - n_in - n_out
        if lead < 0:
            return None
        return optax.contrib.MuonDimensionNumbers(tuple(range(lead, lead + n_in)),
                                                  tuple(range(lead + n_in, len(x.shape))))
    return jax.tree_util.tree_map_with_path(dims, params)


def _muon(opt: OptimizerConfig, schedule, params):
    dims = muon_dimensions(params)
    labels = jax.tree.map(lambda d: "adam" if d is None else "muon", dims,
                          is_leaf=lambda d: d is None or isinstance(d, optax.contrib.MuonDimensionNumbers))
    muon = optax.contrib.muon(
        schedule, beta=opt.muon_momentum, eps=opt.eps, weight_decay=opt.weight_decay,
        consistent_rms=opt.muon_rms, nesterov=True,
        # Inside the partition this sees only the Muon leaves (the rest are masked nodes).
        muon_weight_dimension_numbers=muon_dimensions)
    return optax.partition({"muon": muon, "adam": _adamw(opt, schedule, params)}, labels)


def _adamw(opt: OptimizerConfig, schedule, params):
    return optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay,
                       mask=decay_mask(params, opt))


def make_optimizer(opt: OptimizerConfig, sched: ScheduleConfig, total_steps: int, params):
    """``(optax transformation, schedule)`` for ``params`` (used only for their structure and shapes)."""
    schedule = make_schedule(opt, sched, total_steps)
    parts = []
    if opt.clip_norm is not None:
        parts.append(optax.clip_by_global_norm(opt.clip_norm))
    parts.append(_muon(opt, schedule, params) if opt.name == "muon" else _adamw(opt, schedule, params))
    return optax.chain(*parts), schedule
