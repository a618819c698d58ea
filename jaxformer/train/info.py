"""``jaxformer info``: parameter count, FLOPs per token, and a per-device memory estimate on the mesh.

It plans for ``--devices N`` devices (none need be present) on the mesh training would build
(:func:`plan_mesh`) and refuses what training would refuse: a mesh that is not N devices, a
batch that does not split over ``data x fsdp`` (:func:`~jaxformer.train.sharding.check_batch`).
A preset is planned as an experiment (:func:`preset_config`), so ``mesh.fsdp=8`` or
``batch_size=64`` apply to it as they would to a YAML file.

Memory per device (bytes), from the shapes alone (nothing is allocated):

* parameters, gradients (parameter dtype) and the optimiser's moments (fp32: two
  per AdamW leaf, one per Muon matrix), each leaf divided by the number of
  shards :mod:`~jaxformer.train.sharding` gives it;
* activations kept for the backward pass, rough: per layer and local token,
  ``(12 D + (3 if gated else 2) F) / tensor`` compute-dtype values plus the fp32
  attention probabilities ``N T / tensor``; with ``remat`` only each block's
  input ``D`` plus one block's worth; plus fp32 logits and their gradient
  ``2 V / tensor``.

A LoRA run (``model.lora``) keeps the frozen base in ``model.param_dtype`` and the adapter in float32;
gradients and optimiser moments exist for the adapter alone, so only the activations stay near a full
fine-tune's (backpropagating to the adapters of the first layer goes through every layer above it;
the frozen matmuls keep their inputs for the input gradients they pass down). The plan prints the
trainable fraction.

With ``--compile`` (:func:`compiled_memory`) XLA's own accounting of the compiled train step is
shown beside the estimate, on the devices present. Its arguments (the state and one batch) equal
the estimate's parameters + optimiser moments + batch to the few scalar leaves (step, rng key,
optimiser counters). Its temporaries are what the backend really keeps live at once, where the
estimate's gradients + activations are a backend-independent sketch: on CPU, for
``experiments/configs/stdlib_bytes.yaml`` and its variants (2-8 layers, seq_len 64, batch 24,
grad_accum 2, vocab 1024), XLA's temporaries measured 1.3-1.5x the sketch (the dense attention path
keeps about four ``N T`` fp32 values per token and layer where the sketch counts one), and 4x with
remat (the CPU backend's schedule keeps most of the recomputed activations). Compiling takes
seconds for such configs on CPU; a 7B preset is too heavy to compile on a laptop, so its estimate
stands alone.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxformer.model import ModelConfig, abstract_init, count_params, flops_per_token
from jaxformer.nn.params import as_dtype
from jaxformer.train import config as C
from jaxformer.train import sharding as shd
from jaxformer.train.config import ExperimentConfig, MeshConfig
from jaxformer.train.optim import muon_dimensions
from jaxformer.train.step import auto_parts, make_trainer


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
             grad_accum: int = 1, optimizer: str = "adamw", parallel_parts: int = 1) -> dict:
    """Sizes and the memory estimate (bytes per device) as a dict. With ``parallel_parts`` P, P gradient trees are
    alive before their sum (``bytes_grads`` counts them)."""
    _, abstract = abstract_init(model)
    trained_state, base_state, _ = nnx.split_state(abstract, nnx.LoRAParam if model.lora else nnx.Param,
                                                   nnx.Param, ...)  # the rest: LoRA's dropout keys
    params, base = nnx.to_pure_dict(trained_state), nnx.to_pure_dict(base_state)
    axes, base_axes = shd.logical_axes(trained_state), shd.logical_axes(base_state)
    n_trained = sum(math.prod(a.shape) for a in jax.tree.leaves(params))
    n_params = n_trained + sum(math.prod(a.shape) for a in jax.tree.leaves(base))
    g_bytes = _sharded_bytes(params, axes, mesh_shape)  # the trained parameters, and so their gradients
    base_bytes = _sharded_bytes(base, base_axes, mesh_shape) if base else 0
    p_bytes = g_bytes + base_bytes
    opt_bytes = _sharded_bytes(params, axes, mesh_shape, itemsize=4, copies=_moments(params, optimizer))
    shd.check_batch(batch_size, grad_accum, mesh_shape, parallel_parts)
    b_local = batch_size // grad_accum // (mesh_shape["data"] * mesh_shape["fsdp"])
    tp = mesh_shape["tensor"]
    D, F, N, V, L = (model.d_model, model.resolved_d_ff, model.attention.n_heads, model.vocab_size, model.n_layers)
    c = as_dtype(model.compute_dtype).itemsize
    per_layer = (12 * D + (3 if model.ffn.gated else 2) * F) * c / tp + N * seq_len * 4 / tp
    tokens = b_local * seq_len
    if model.remat:
        act = tokens * (L * D * c + per_layer)
    else:
        act = tokens * L * per_layer
    act += tokens * 2 * V * 4 / tp
    return {
        "params": n_params,
        "params_formula": count_params(model),
        "trainable": n_trained,
        "lora": None if model.lora is None else {**model.lora.model_dump(), "targets": list(model.lora_targets)},
        "flops_per_token": flops_per_token(model, seq_len),
        "mesh": dict(mesh_shape),
        "bytes_params": p_bytes,
        "bytes_base": base_bytes,
        "bytes_grads": g_bytes * parallel_parts,
        "bytes_optimizer": opt_bytes,
        "bytes_activations": int(act),
        "bytes_total": int(p_bytes + g_bytes * parallel_parts + opt_bytes + act),
        "batch_size": batch_size,
        "grad_accum": grad_accum,
        "parallel_parts": parallel_parts,
        "batch_per_device": b_local,
        "optimizer": optimizer,
        "seq_len": seq_len,
    }


def compiled_memory(cfg: ExperimentConfig, n_devices: int | None = None) -> dict:
    """XLA's memory accounting of ``cfg``'s compiled train step, bytes per device.

    ``jit(train_step).lower(state, batch).compile().memory_analysis()`` on the devices present (the
    mesh planned for ``n_devices`` must be the one they give): ``arguments`` (state and one batch),
    ``outputs`` (the new state and the metrics), ``aliased`` (outputs written into the donated
    state), ``temp`` (everything else live at once) and ``peak = arguments + outputs - aliased + temp``.
    """
    from jaxformer.train.packing import model_batch

    planned, present = plan_mesh(cfg.mesh, n_devices), plan_mesh(cfg.mesh)
    if planned != present:
        raise ValueError(f"--compile compiles on the {jax.device_count()} devices present (mesh "
                         f"{_mesh_text(present)}), not on the planned mesh {_mesh_text(planned)}")
    mesh = shd.make_mesh(cfg.mesh)
    trainer = make_trainer(cfg, mesh)
    state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                         trainer.abstract_state, trainer.state_shardings)
    rows = np.zeros((cfg.batch_size, cfg.seq_len + 1), np.int32)
    example = model_batch(rows, rows + 1, 0)  # the dtypes the data pipeline feeds the step
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shd.batch_sharding(mesh)), example)
    m = trainer.train_step.lower(state, batch).compile().memory_analysis()
    out = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
           "aliased": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes, "backend": jax.default_backend()}
    out["peak"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temp"]
    return out


def plan_mesh(mesh: MeshConfig, n_devices: int | None = None) -> dict:
    """``{"data", "fsdp", "tensor"}`` sizes for ``n_devices`` planned devices (None: those present).

    As training sizes it (:meth:`MeshConfig.shape`: one axis may be -1, the rest of the devices),
    but planned devices must all be used: a mesh whose product is not ``n_devices`` is refused
    (training on the devices present would silently leave the extra ones idle).
    """
    sizes = {"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor}
    text = _mesh_text(sizes)
    if n_devices is not None and n_devices < 1:
        raise ValueError(f"--devices must be at least 1, got {n_devices}")
    n = jax.device_count() if n_devices is None else n_devices
    where = f"--devices {n}" if n_devices is not None else f"{n} device{'s' * (n > 1)} present"
    known = math.prod(v for v in sizes.values() if v != -1)
    free = [a for a, v in sizes.items() if v == -1]
    if free:
        if n % known:
            raise ValueError(f"mesh {text} does not fit {where}: {n} is not a multiple of {known}, "
                             f"the product of the other axes")
        sizes[free[0]] = n // known
    elif known > n or (n_devices is not None and known != n):
        need = f"{known} device{'s' * (known > 1)}"
        raise ValueError(f"mesh {text} needs {need}, {where} (give axes whose product is {n}, "
                         f"or -1 for the one that takes the rest)")
    return sizes


def _mesh_text(sizes: dict) -> str:
    return " ".join(f"{a}={v}" for a, v in sizes.items())


def planned_parts(cfg: ExperimentConfig, n_devices: int | None = None) -> int:
    """``cfg``'s ``optimizer.parallel_parts``, "auto" resolved as training would on this machine's devices
    (:func:`jaxformer.train.step.auto_parts`; planned devices are taken to be of the default backend's kind)."""
    parts = cfg.optimizer.parallel_parts
    if parts != "auto":
        return parts
    mesh = plan_mesh(cfg.mesh, n_devices)
    return auto_parts(cfg.model, cfg.batch_size, cfg.optimizer.grad_accum, cfg.seq_len,
                      mesh["data"] * mesh["fsdp"], jax.default_backend() == "cpu")


def describe_experiment(cfg: ExperimentConfig, n_devices: int | None = None) -> dict:
    """:func:`describe` for ``cfg`` on ``n_devices`` planned devices (None: those present)."""
    return describe(cfg.model, mesh_shape=plan_mesh(cfg.mesh, n_devices),
                    batch_size=cfg.batch_size, seq_len=cfg.seq_len, grad_accum=cfg.optimizer.grad_accum,
                    optimizer=cfg.optimizer.name, parallel_parts=planned_parts(cfg, n_devices))


def preset_config(name: str, overrides=(), n_devices: int | None = None) -> ExperimentConfig:
    """An experiment around preset ``name`` to plan with :func:`describe_experiment`.

    ``overrides`` are ``key.sub=value``: keys of the experiment (``mesh.fsdp=8``, ``batch_size=64``,
    ``seq_len=4096``, ``optimizer.name=muon``, ``model.n_layers=4``) or, unqualified, of the
    model (``n_layers=4``). Unless given, ``seq_len`` is ``min(model.max_seq_len, 2048)`` and
    ``batch_size`` one sequence per device along ``data x fsdp`` (times ``grad_accum``) on the
    mesh planned for ``n_devices``. Any model kind is accepted (only training needs a decoder).
    """
    top = set(ExperimentConfig.model_fields)
    qualified = [o if o.partition("=")[0].strip().split(".")[0] in top else f"model.{o}" for o in overrides]
    raw = C.apply_overrides({"model": {"preset": name}}, qualified)
    accum = raw.get("optimizer", {}).get("grad_accum", 1) if isinstance(raw.get("optimizer"), dict) else 1
    accum = accum if isinstance(accum, int) and accum > 0 else 1
    # a first pass with sizes that always validate, to learn the model's context and the mesh
    first = C.from_dict({"seq_len": 2, "batch_size": accum, **raw}, name, planning=True)
    mesh = plan_mesh(first.mesh, n_devices)
    defaults = {"seq_len": min(first.model.max_seq_len, 2048),
                "batch_size": mesh["data"] * mesh["fsdp"] * first.optimizer.grad_accum}
    return C.from_dict({**defaults, **raw}, name, planning=True)


def _gib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def _lora_text(lora: dict | None) -> str:
    if lora is None:
        return ": a full fine-tune"
    scale = "alpha/sqrt(rank)" if lora["rslora"] else "alpha/rank"
    return (f": LoRA rank {lora['rank']}, alpha {lora['alpha']:g} ({scale}) on {', '.join(lora['targets'])}; "
            "the base frozen")


def format_info(name: str, d: dict) -> str:
    m = d["mesh"]
    lines = [
        f"{name}",
        f"  parameters        {d['params']:,}  (formula {d['params_formula']:,})",
        f"  trainable         {d['trainable']:,}  ({100 * d['trainable'] / max(d['params'], 1):.3g}% of the "
        f"parameters{_lora_text(d['lora'])})",
        f"  FLOPs/token       {d['flops_per_token']:,}  (train, seq_len {d['seq_len']})",
        f"  mesh              data={m['data']} fsdp={m['fsdp']} tensor={m['tensor']}  "
        f"batch/device {d['batch_per_device']}",
        "  memory per device (estimate):",
        f"    parameters      {_gib(d['bytes_params'])}" + (
            f"  (frozen base {_gib(d['bytes_base'])} + adapter {_gib(d['bytes_params'] - d['bytes_base'])})"
            if d["lora"] else ""),
        f"    gradients       {_gib(d['bytes_grads'])}" + ("  (the adapter's)" if d["lora"] else "")
        + (f"  ({d['parallel_parts']} parts' copies)" if d["parallel_parts"] > 1 else ""),
        f"    {d['optimizer'] + ' state':<16}{_gib(d['bytes_optimizer'])}",
        f"    activations     {_gib(d['bytes_activations'])}",
        f"    total           {_gib(d['bytes_total'])}",
    ]
    accum = f", grad_accum {d['grad_accum']}" if d["grad_accum"] > 1 else ""
    lines[4] += f"  (batch_size {d['batch_size']}{accum})"
    x = d.get("xla")
    if x is not None:
        sketch = d["bytes_grads"] + d["bytes_activations"]
        lines += [
            f"  memory per device (XLA, the compiled train step on {x['backend']}):",
            f"    arguments       {_gib(x['arguments'])}  (state + one batch)",
            f"    temporaries     {_gib(x['temp'])}  (estimate: gradients + activations {_gib(sketch)})",
            f"    outputs         {_gib(x['outputs'])}  ({_gib(x['aliased'])} into the donated state)",
            f"    peak            {_gib(x['peak'])}",
        ]
    return "\n".join(lines)


def target_config(target: str, overrides=(), n_devices: int | None = None) -> ExperimentConfig:
    """The experiment ``jaxformer info TARGET`` plans: a preset's (:func:`preset_config`), a run directory's
    ``config.yaml`` or an experiment file's, with ``overrides``; FileNotFoundError naming the closest presets."""
    import difflib

    from jaxformer.model import presets
    from jaxformer.train.run_dir import config_path

    if target in presets.names():
        return preset_config(target, overrides, n_devices)
    if Path(target).is_dir():  # a run directory: the config it keeps
        return C.load(config_path(target), overrides, planning=True)
    if Path(target).exists():
        return C.load(target, overrides, planning=True)
    close = difflib.get_close_matches(target, presets.names(), n=5)
    which = f"closest presets: {', '.join(close)}" if close else f"presets: {', '.join(presets.names())}"
    raise FileNotFoundError(f"no such file or preset: {target!r}; {which}")


def add_info_options(a) -> None:
    """``jaxformer info``'s arguments on a parser's ``add_argument`` ``a``."""
    a("target", help="an experiment YAML, a run directory (its config.yaml) or a preset name")
    a("overrides", nargs="*", help="key.sub=value overrides; for a preset, experiment keys (mesh.fsdp=8, "
      "batch_size=64, seq_len=4096) or model keys (n_layers=4, model.n_layers=4, model.attention.n_heads=8)")
    a("--devices", type=int, help="plan for this many devices, none need be present (default: those present); "
      "the mesh must use all of them")
    a("--compile", action="store_true", help="also compile the train step on the devices present and show XLA's "
      "memory analysis beside the estimate (seconds for small models)")


def info_command(args) -> int:
    """``jaxformer info TARGET``: parameters, FLOPs/token and memory per device (and XLA's, ``--compile``)."""
    cfg = target_config(args.target, args.overrides, args.devices)
    info = describe_experiment(cfg, args.devices)
    if args.compile:
        info["xla"] = compiled_memory(cfg, args.devices)
    print(format_info(args.target, info))
    return 0
