"""The two layouts of a layer stack's parameters, and the pure functions between them.

Per layer (``scan_layers=False``) a stack's blocks are ``{0: block, 1: block, ...}``; scanned
(``scan_layers=True``, :class:`jaxformer.model.stack.Stack`) they are one block whose every leaf
carries a leading ``"layers"`` axis ``[L, ...]``, block ``i`` at index ``i``::

    per_layer["decoder"]["blocks"][i][...]["w_q"]  ==  scanned["decoder"]["blocks"][...]["w_q"][i]

Everything outside the blocks (embeddings, final norms, the head) is the same in both. A Hugging
Face checkpoint holds per-layer tensors, so loading, saving and the per-layer probes cross here.
``unstack_layers(stack_layers(s, c), c) == s`` exactly (only copies, no arithmetic).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer.model.config import ModelConfig
from jaxformer.model.functional import abstract_init

STACKS = ("encoder", "decoder")


def per_layer_config(config: ModelConfig) -> ModelConfig:
    """``config`` with ``scan_layers=False`` (the model whose state :func:`unstack_layers` returns)."""
    return config.model_copy(update=dict(scan_layers=False))


def scanned_config(config: ModelConfig) -> ModelConfig:
    """``config`` with ``scan_layers=True`` (the model whose state :func:`stack_layers` returns)."""
    return config.model_copy(update=dict(scan_layers=True))


def _layer_counts(config: ModelConfig) -> dict[str, int]:
    return {"encoder": config.n_encoder_stack_layers, "decoder": config.n_decoder_layers}


def _shape(a) -> tuple[int, ...]:
    return tuple(np.shape(a)) if not isinstance(a, jax.ShapeDtypeStruct) else tuple(a.shape)


def _stack_leaves(*xs):
    if isinstance(xs[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)
    if all(isinstance(x, np.ndarray) for x in xs):  # host arrays stay on the host (a checkpoint being read)
        return np.stack(xs)
    return jnp.stack(xs)


def _take(a, i: int):
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
    return a[i]


def _dotted(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _stack_pure(pure: Mapping, config: ModelConfig) -> dict:
    out = dict(pure)
    for name, n in _layer_counts(config).items():
        if not n or name not in pure or "blocks" not in pure[name]:
            continue
        blocks = pure[name]["blocks"]
        if set(blocks) != set(range(n)):
            raise ValueError(f"stack_layers: {name}.blocks has keys {sorted(blocks, key=str)}; a per-layer state of "
                             f"this config has blocks 0..{n - 1} ({name} layers: {n}) (already scanned?)")
        structs = [jax.tree.structure(blocks[i]) for i in range(n)]
        for i in range(1, n):
            if structs[i] != structs[0]:
                raise ValueError(f"stack_layers: {name}.blocks.{i} holds other parameters than {name}.blocks.0:"
                                 f" {structs[i]} vs {structs[0]}")
        leaves = [jax.tree_util.tree_leaves_with_path(blocks[i]) for i in range(n)]
        for j, (path, _) in enumerate(leaves[0]):
            shapes = [_shape(layer[j][1]) for layer in leaves]
            if len(set(shapes)) > 1:
                raise ValueError(f"stack_layers: {name}.blocks.*.{_dotted(path)} differs in shape between layers: "
                                 f"{shapes}")
        out[name] = {**pure[name], "blocks": jax.tree.map(_stack_leaves, *[blocks[i] for i in range(n)])}
    return out


def _unstack_pure(pure: Mapping, config: ModelConfig) -> dict:
    out = dict(pure)
    for name, n in _layer_counts(config).items():
        if not n or name not in pure or "blocks" not in pure[name]:
            continue
        blocks = pure[name]["blocks"]
        if any(isinstance(k, int) for k in blocks):
            raise ValueError(f"unstack_layers: {name}.blocks has per-layer keys {sorted(blocks, key=str)}; "
                             "expected a scanned state (one block, every leaf [L, ...]) (already per layer?)")
        for path, leaf in jax.tree_util.tree_leaves_with_path(blocks):
            shape = _shape(leaf)
            if not shape or shape[0] != n:
                raise ValueError(f"unstack_layers: {name}.blocks.{_dotted(path)}.shape={shape}: the leading "
                                 f"'layers' axis must be {name} layers = {n}")
        out[name] = {**pure[name], "blocks": {i: jax.tree.map(lambda a, i=i: _take(a, i), blocks)
                                              for i in range(n)}}
    return out


def _convert(state: Any, target: ModelConfig, fn, name: str) -> Any:
    if not isinstance(state, nnx.State):
        return fn(state, target)
    pure = fn(nnx.to_pure_dict(state), target)
    flat = dict(nnx.traversals.flatten_mapping(pure))
    abstract = dict(nnx.to_flat_state(abstract_init(target)[1]))  # the target's Variables and their metadata
    missing = sorted(map(str, set(flat) - set(abstract)))
    if missing:
        raise ValueError(f"{name}: {missing} are not parameters of the {target.scan_layers=} model")
    return nnx.from_flat_state([(p, abstract[p].replace(v)) for p, v in flat.items()])


def stack_layers(state: Any, config: ModelConfig) -> Any:
    """The per-layer state of ``config``'s model as the scanned model's state (block ``i`` at index ``i``
    of every leaf's new leading axis).

    ``state``: an ``nnx.State`` (returned as the scanned model's ``nnx.State``, its Variables' metadata,
    e.g. the ``"layers"`` sharding name, from that model) or a pure dict (returned as a pure dict; numpy
    leaves stay numpy, ``jax.ShapeDtypeStruct`` leaves gain the axis). ``config.scan_layers`` is not
    read: only the layer counts.
    """
    return _convert(state, scanned_config(config), _stack_pure, "stack_layers")


def unstack_layers(state: Any, config: ModelConfig) -> Any:
    """The scanned state of ``config``'s model as the per-layer model's state (the inverse of
    :func:`stack_layers`; same arguments)."""
    return _convert(state, per_layer_config(config), _unstack_pure, "unstack_layers")
