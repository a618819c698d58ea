"""The device mesh ``(data, fsdp, tensor)`` and ONE rules table from logical axis names to mesh axes.

Parameters carry logical axis names (``jaxformer.nn.LOGICAL_AXES``) as NNX
metadata. :data:`RULES` maps each to mesh axes: FSDP shards parameters (and so
the optimiser state, which mirrors them) along ``embed``; tensor parallelism
shards heads, kv heads, the FFN hidden dim and the vocabulary; batches are
split over ``data x fsdp``. A dimension whose size the mesh axis does not
divide is replicated instead, and a mesh axis is used at most once per array.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxformer.train.config import MeshConfig

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

RULES: dict[str, tuple[str, ...]] = {
    "batch": BATCH_AXES,
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "head_dim": (),
    "layers": (),
}


def maybe_initialize_distributed(cfg: MeshConfig) -> None:
    """``jax.distributed.initialize`` when ``mesh.distributed`` (before any device is touched)."""
    if not cfg.distributed:
        return
    kwargs = {}
    if cfg.coordinator_address is not None:
        kwargs["coordinator_address"] = cfg.coordinator_address
    if cfg.num_processes is not None:
        kwargs["num_processes"] = cfg.num_processes
    if cfg.process_id is not None:
        kwargs["process_id"] = cfg.process_id
    if not jax.distributed.is_initialized():
        jax.distributed.initialize(**kwargs)


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all), sized from ``cfg``."""
    devices = jax.devices() if devices is None else list(devices)
    shape = cfg.shape(len(devices))
    n = math.prod(shape)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices[:n])


def spec_for(logical: tuple[str | None, ...], shape: tuple[int, ...], mesh_shape) -> P:
    """Mesh ``PartitionSpec`` for an array of ``shape`` whose dims carry ``logical`` names.

    ``mesh_shape``: ``{"data": .., "fsdp": .., "tensor": ..}`` (e.g. ``mesh.shape``).
    """
    if len(logical) != len(shape):
        raise ValueError(f"logical axes {logical} do not match shape {shape}")
    used: set[str] = set()
    out = []
    for name, size in zip(logical, shape):
        if name is None:
            out.append(None)
            continue
        if name not in RULES:
            raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(RULES)}")
        axes = tuple(a for a in RULES[name] if a not in used and mesh_shape[a] > 1)
        if not axes or size % math.prod(mesh_shape[a] for a in axes):
            out.append(None)
            continue
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else axes)
    return P(*out)


def logical_axes(state) -> dict:
    """Pure-dict tree (like ``nnx.to_pure_dict(state)``) of each parameter's logical axis names."""
    def names(v):
        axes = v.get_metadata().get("out_sharding") if isinstance(v, nnx.Variable) else None
        return tuple(axes) if axes else (None,) * np.ndim(v.get_value() if isinstance(v, nnx.Variable) else v)

    tree = jax.tree.map(names, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def param_shardings(abstract_params, axes_tree, mesh: Mesh):
    """NamedSharding per parameter, from its shape and logical axes."""
    return jax.tree.map(
        lambda a, ax: NamedSharding(mesh, spec_for(ax, tuple(a.shape), mesh.shape)),
        abstract_params, axes_tree)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """``[B, T]`` arrays split over ``data x fsdp`` along B."""
    return NamedSharding(mesh, P(BATCH_AXES))


def batch_shards(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def check_batch(batch_size: int, grad_accum: int, mesh_shape, parallel_parts: int = 1) -> None:
    """Raise ValueError unless every micro-batch (``batch_size // grad_accum``), and each of its
    ``parallel_parts`` parts, splits over ``data x fsdp``.

    ``mesh_shape``: ``{"data": .., "fsdp": .., "tensor": ..}``. The trainer and ``jaxformer info``
    both call this, so a plan that ``info`` accepts is one training accepts.
    """
    shards = mesh_shape["data"] * mesh_shape["fsdp"]
    where = " ".join(f"{a}={mesh_shape[a]}" for a in MESH_AXES)
    if batch_size % shards:
        raise ValueError(f"batch_size={batch_size} not divisible by data*fsdp={shards} on mesh {where}")
    micro = batch_size // grad_accum
    if micro % shards:
        raise ValueError(f"micro-batch batch_size/grad_accum={batch_size}/{grad_accum}={micro} "
                         f"not divisible by data*fsdp={shards} on mesh {where}")
    if micro % (parallel_parts * shards):
        raise ValueError(f"micro-batch batch_size/grad_accum={batch_size}/{grad_accum}={micro} does not split into "
                         f"parallel_parts={parallel_parts} parts of whole rows on each of data*fsdp={shards} devices "
                         f"(mesh {where})")


def put_batch(batch, mesh: Mesh):
    """A batch (any pytree, e.g. :class:`jaxformer.train.packing.Batch`) of host-local numpy ``[B_local, T]``
    arrays -> the same of global sharded jax arrays ``[B, T]``."""
    sh = batch_sharding(mesh)
    return jax.tree.map(lambda v: jax.make_array_from_process_local_data(sh, v), batch)


def put_global_batch(batch, mesh: Mesh):
    """A batch of numpy ``[B, T]`` arrays that every process holds in full -> global sharded jax arrays."""
    sh = batch_sharding(mesh)
    return jax.tree.map(lambda v: jax.make_array_from_callback(v.shape, sh, lambda idx: v[idx]), batch)
