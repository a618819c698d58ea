"""``jaxformer info``: parameter count, FLOPs per token, and a per-device memory estimate on the mesh.

Memory per device (bytes), from the shapes alone (nothing is allocated):

* parameters, gradients (parameter dtype) and the optimiser's moments (fp32: two
  per AdamW leaf, one per Muon matrix), each leaf divided by the number of
  shards :mod:`~jaxformer.train.sharding` gives it;
* activations kept for the backward pass, rough: per layer and local token,
  ``(12 D + (3 if gated else 2) F) / tensor`` compute-dtype values plus the fp32
  attention probabilities ``N T / tensor``; with ``remat`` only each block's
  input ``D`` plus one block's worth; plus fp32 logits and their gradient
  ``2 V / tensor``.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx

from jaxformer.model import ModelConfig, abstract_init, count_params, flops_per_token
from jaxformer.nn.params import as_dtype
from jaxformer.train import sharding as shd
from jaxformer.train.config import ExperimentConfig
from jaxformer.train.optim import muon_dimensions


def _sharded_bytes(abstract_params, axes_tree, mesh_shape: dict, itemsize: int | None = None,
                   copies=None) -> int:
    """Bytes per device of the leaves; ``copies``: a list with each leaf's number of copies (default 1)."""
    total = 0
    leaves = zip(jax.tree.leaves(abstract_params), jax.tree.leaves(axes_tree, is_leaf=_is_axes))
    for i, (a, ax) in enumerate(leaves):
        spec = shd.spec_for(ax, tuple(a.shape), mesh_shape)
        shards = 1
        for entry in spec:
            for name in (entry if isinstance(entry, tuple) else (entry,)):
                if name is not None:
                    shards *= mesh_shape[name]
        n = 1 if copies is None else copies[i]
        total += n * math.prod(a.shape) * (itemsize or np.dtype(a.dtype).itemsize) // shards
    return total


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(e, (str, type(None))) for e in x)


def _moments(params, optimizer: str) -> list[int]:
    """fp32 moments per leaf: AdamW keeps two, Muon one (its matrices; AdamW for the rest)."""
    if optimizer != "muon":
        return [2] * len(jax.tree.leaves(params))
    dims = jax.tree.leaves(muon_dimensions(params), is_leaf=lambda d: d is None or hasattr(d, "reduction_axis"))
    return [2 if d is None else 1 for d in dims]


def describe(model: ModelConfig, *, mesh_shape: dict, batch_size: int, seq_len: int,
             grad_accum: int = 1, optimizer: str = "adamw") -> dict:
    """Sizes and the memory estimate (bytes per device) as a dict."""
    _, abstract = abstract_init(model)
    params = nnx.to_pure_dict(abstract)
    axes = shd.logical_axes(abstract)
    n_params = sum(math.prod(a.shape) for a in jax.tree.leaves(params))
    p_bytes = _sharded_bytes(params, axes, mesh_shape)
    opt_bytes = _sharded_bytes(params, axes, mesh_shape, itemsize=4, copies=_moments(params, optimizer))
    b_local = max(1, batch_size // grad_accum // (mesh_shape["data"] * mesh_shape["fsdp"]))
    tp = mesh_shape["tensor"]
    D, F, N, V, L = (model.d_model, model.resolved_d_ff, model.n_heads, model.vocab_size, model.n_layers)
    c = as_dtype(model.compute_dtype).itemsize
    per_layer = (12 * D + (3 if model.gated else 2) * F) * c / tp + N * seq_len * 4 / tp
    tokens = b_local * seq_len
    if model.remat:
        act = tokens * (L * D * c + per_layer)
    else:
        act = tokens * L * per_layer
    act += tokens * 2 * V * 4 / tp
    return {
        "params": n_params,
        "params_formula": count_params(model),
        "flops_per_token": flops_per_token(model, seq_len),
        "mesh": dict(mesh_shape),
        "bytes_params": p_bytes,
        "bytes_grads": p_bytes,
        "bytes_optimizer": opt_bytes,
        "bytes_activations": int(act),
        "bytes_total": int(2 * p_bytes + opt_bytes + act),
        "batch_per_device": b_local,
        "optimizer": optimizer,
        "seq_len": seq_len,
    }


def describe_experiment(cfg: ExperimentConfig, n_devices: int | None = None) -> dict:
    n = jax.device_count() if n_devices is None else n_devices
    data, fsdp, tensor = cfg.mesh.shape(n)
    return describe(cfg.model, mesh_shape={"data": data, "fsdp": fsdp, "tensor": tensor},
                    batch_size=cfg.batch_size, seq_len=cfg.seq_len, grad_accum=cfg.optimizer.grad_accum,
                    optimizer=cfg.optimizer.name)


def _gib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def format_info(name: str, d: dict) -> str:
    m = d["mesh"]
    lines = [
        f"{name}",
        f"  parameters        {d['params']:,}  (formula {d['params_formula']:,})",
        f"  FLOPs/token       {d['flops_per_token']:,}  (train, seq_len {d['seq_len']})",
        f"  mesh              data={m['data']} fsdp={m['fsdp']} tensor={m['tensor']}  "
        f"batch/device {d['batch_per_device']}",
        "  memory per device (estimate):",
        f"    parameters      {_gib(d['bytes_params'])}",
        f"    gradients       {_gib(d['bytes_grads'])}",
        f"    {d['optimizer'] + ' state':<16}{_gib(d['bytes_optimizer'])}",
        f"    activations     {_gib(d['bytes_activations'])}",
        f"    total           {_gib(d['bytes_total'])}",
    ]
    return "\n".join(lines)
