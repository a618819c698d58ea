"""peft LoRA adapters in and out: ``adapter_config.json`` + ``adapter_model.safetensors`` <-> jaxformer's LoRA.

::

    config, graphdef, state = load_pretrained("path/to/base")
    state = load_adapter("path/to/adapter", config, state)     # merged into the base: same config, same graphdef
    lora_config, graphdef, state = apply_adapter("path/to/adapter", config, state)   # unmerged (nnx.LoRAParam)
    save_adapter("out/", lora_config, state, base_model_name_or_path="path/to/base")  # for PeftModel.from_pretrained
    config, state = merge_lora(lora_config, state)             # W + s A B, the adapters gone

The layout is peft's for the ``llama`` family (``llama``, ``mistral``, ``qwen2``: one set of module names)::

    base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_A.weight   [R, in]
    base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_B.weight   [out, R]
    base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight

and jaxformer's (:mod:`jaxformer.nn.lora`) ``A [*I, R] = lora_A.T.reshape(*I, R)``,
``B [R, *O] = lora_B.T.reshape(R, *O)``, with peft's scale ``lora_alpha / r`` (``use_rslora``:
``lora_alpha / sqrt(r)``). ``adapter_config.json`` is written with the keys and defaults peft
:data:`PEFT_VERSION` writes. What peft can express and jaxformer cannot (DoRA, bias training, a target
the model does not have, per-layer ranks or layers, extra trained modules, ...) is a
:class:`PeftAdapterError` naming ``adapter_config.json`` and the key; a weights file that is missing a
tensor, has one more, or a wrong shape is one naming the tensors.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer.interop.rules import HFConfigError, Reader, read_json_object
from jaxformer.model.config import LoRAConfig, ModelConfig
from jaxformer.model.functional import abstract_init
from jaxformer.model.layout import per_layer_config, stack_layers, unstack_layers
from jaxformer.nn.lora import LORA_SUFFIX, DropoutKey, lora_delta

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_VERSION = "0.21.2"
"""The peft release whose ``adapter_config.json`` keys and defaults :func:`save_adapter` writes (and whose
output the committed fixtures, ``tests/interop/fixtures/peft``, hold)."""

PEFT_MODULES = {"w_q": "self_attn.q_proj", "w_k": "self_attn.k_proj", "w_v": "self_attn.v_proj",
                "w_o": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
                "w_down": "mlp.down_proj"}
"""jaxformer's projection -> the module peft adapts in a ``LlamaForCausalLM`` layer (``model.layers.{i}.``)."""

PREFIX = "base_model.model."
"""What peft puts before the base model's own module names in ``adapter_model.safetensors``."""

_SAFE_INIT = (True, False, "gaussian", "eva", "orthogonal")  # init schemes that leave the base weights as they are


class PeftAdapterError(ValueError):
    """An adapter jaxformer cannot reproduce exactly; the message names the file and the key or tensors."""


# -- which models: the llama family (peft's names for its projections)

def _check_family(config: ModelConfig, what: str) -> None:
    from jaxformer.interop.llama import LlamaFamily

    if config.kind != "decoder":
        raise PeftAdapterError(f"{what}: peft adapters are read and written for decoder models of the llama family "
                               f"(llama, mistral, qwen2); this model is kind={config.kind!r}")
    try:
        LlamaFamily().config_to_hf(config.base)
    except HFConfigError as e:
        raise PeftAdapterError(f"{what}: peft adapters are read and written for the llama family (llama, mistral, "
                               f"qwen2: peft's module names for their projections); this model is not one ({e})"
                               ) from None


def peft_key(layer: int, target: str, which: str) -> str:
    """The name peft gives adapter ``which`` (``"A"`` / ``"B"``) of projection ``target`` in layer ``layer``."""
    return f"{PREFIX}model.layers.{layer}.{PEFT_MODULES[target]}.lora_{which}.weight"


def _module_name(layer: int, target: str) -> str:
    return f"model.layers.{layer}.{PEFT_MODULES[target]}"


# -- adapter_config.json in

class _Reader(Reader):
    """:class:`jaxformer.interop.rules.Reader` over ``adapter_config.json``, raising :class:`PeftAdapterError`."""

    def error(self, key: str, message: str) -> PeftAdapterError:
        return PeftAdapterError(f"{self.where}: {key}: {message}")


def read_adapter_config(path: str | os.PathLike, config: ModelConfig) -> LoRAConfig:
    """``path/adapter_config.json`` as a :class:`LoRAConfig` for the base model ``config`` (``targets`` None
    when the adapter has every projection).

    Refuses (:class:`PeftAdapterError` naming the file and key) anything the library cannot compute
    exactly: another ``peft_type`` than ``LORA``; ``use_dora``; ``bias`` other than ``"none"`` or
    ``lora_bias``; ``modules_to_save``; ``rank_pattern`` / ``alpha_pattern``; ``layers_to_transform``;
    ``exclude_modules``; ``target_parameters``; ``trainable_token_indices``; ``layer_replication``;
    ``fan_in_fan_out``; QALoRA, aLoRA and the other variants; an ``init_lora_weights`` that changes the base
    weights (PiSSA, OLoRA, CorDA, LoftQ); a ``target_modules`` entry that is not one of the model's
    projections (``q_proj`` ... ``down_proj``) or a pattern that picks only some layers; and any key it does
    not know set to a value other than null / false / empty.
    """
    file = Path(path) / ADAPTER_CONFIG
    if not Path(path).is_dir():
        raise FileNotFoundError(f"{path}: not a directory (a peft adapter is a directory with {ADAPTER_CONFIG} and "
                                f"{ADAPTER_WEIGHTS})")
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing; a peft adapter directory needs {ADAPTER_CONFIG}")
    _check_family(config, str(file))
    raw = read_json_object(file, PeftAdapterError)
    r = _Reader(raw, str(file))

    def expect(key, ok, default, why):
        value = raw.get(key, default)
        if not ok(value):
            raise r.error(key, f"{value!r}: {why}")
        return value

    expect("peft_type", lambda v: v == "LORA", None, "only LoRA adapters are read (peft_type 'LORA')")
    expect("task_type", lambda v: v in (None, "CAUSAL_LM"), None,
           "only causal-LM adapters are read (task_type 'CAUSAL_LM' or null)")
    expect("use_dora", lambda v: not v, False, "DoRA (a learned magnitude per column) is not supported")
    expect("bias", lambda v: v == "none", "none", "trained biases are not supported (bias 'none' only)")
    expect("lora_bias", lambda v: not v, False, "a bias on lora_B is not supported")
    expect("fan_in_fan_out", lambda v: not v, False, "the llama family's projections are nn.Linear [out, in]")
    unsupported = {"modules_to_save": "extra fully trained modules", "rank_pattern": "per-module ranks",
                   "alpha_pattern": "per-module alphas", "layers_to_transform": "adapters on some layers only",
                   "exclude_modules": "excluded modules", "target_parameters": "adapters on nn.Parameters",
                   "trainable_token_indices": "trained token embeddings", "layer_replication": "replicated layers",
                   "use_qalora": "QALoRA", "alora_invocation_tokens": "aLoRA (activated LoRA)",
                   "use_bdlora": "block-diagonal LoRA", "arrow_config": "Arrow routing", "kasa_config": "KaSA",
                   "monteclora_config": "MonteCLoRA", "velora_config": "VeLoRA", "lora_ga_config": "LoRA-GA"}
    for key, what in unsupported.items():
        value = raw.get(key)
        if value not in (None, False, {}, [], ""):
            raise r.error(key, f"{value!r}: {what} is not supported")
    init = raw.get("init_lora_weights", True)
    if init not in _SAFE_INIT:
        raise r.error("init_lora_weights", f"{init!r}: this initialisation changes the base model's weights (the "
                                           "adapter is only valid on that changed base); supported: "
                                           f"{list(_SAFE_INIT)}")
    if raw.get("loftq_config") not in (None, {}):
        raise r.error("loftq_config", f"{raw['loftq_config']!r}: LoftQ changes the base weights")
    known = {"alpha_pattern", "auto_mapping", "base_model_name_or_path", "bias", "corda_config", "eva_config",
             "ensure_weight_tying", "fan_in_fan_out", "inference_mode", "init_lora_weights", "layers_pattern",
             "loftq_config", "lora_alpha", "lora_dropout", "megatron_config", "megatron_core", "peft_type",
             "peft_version", "qalora_group_size", "r", "revision", "target_modules", "task_type", "use_dora",
             "use_rslora", "lora_bias", *unsupported}
    for key in sorted(set(raw) - known):
        if raw[key] not in (None, False, {}, [], ""):
            raise r.error(key, f"{raw[key]!r}: an option jaxformer does not know (peft {PEFT_VERSION}'s keys are "
                               "read); only null / false / empty values of unknown keys are accepted")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise r.error("r", f"{rank!r}: must be a positive integer")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise r.error("lora_alpha", f"{alpha!r}: must be a positive number")
    dropout = raw.get("lora_dropout", 0.0)
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise r.error("lora_dropout", f"{dropout!r}: must be in [0, 1)")
    rslora = raw.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise r.error("use_rslora", f"{rslora!r}: must be true or false")
    targets = _targets(r, raw.get("target_modules"), config)
    if set(targets) == set(config.projections):
        targets = None  # every projection: as LoRAConfig spells it
    return LoRAConfig(rank=rank, alpha=float(alpha), dropout=float(dropout), targets=targets, rslora=rslora)


def _targets(r: _Reader, value, config: ModelConfig) -> tuple[str, ...]:
    """``target_modules`` as jaxformer's projection names (peft's matching: a list entry names a module by its
    last dotted components; a string is ``all-linear`` or a regular expression the whole name must match)."""
    have = [t for t in config.projections if t in PEFT_MODULES]
    L = config.n_layers
    if value == "all-linear":  # every nn.Linear but the output head
        return tuple(have)
    if isinstance(value, str):
        chosen = []
        for t in have:
            hits = [bool(re.fullmatch(value, _module_name(i, t))) for i in range(L)]
            if all(hits):
                chosen.append(t)
            elif any(hits):
                raise r.error("target_modules", f"{value!r} matches {PEFT_MODULES[t]} in layers "
                                                f"{[i for i, h in enumerate(hits) if h]} only; jaxformer adapts a "
                                                "projection in every layer or in none")
        if not chosen:
            raise r.error("target_modules", f"{value!r} matches none of the projections "
                                            f"{sorted(PEFT_MODULES[t].split('.')[-1] for t in have)}")
        return tuple(chosen)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise r.error("target_modules", f"{value!r}: expected a non-empty list of module names, 'all-linear' or a "
                                        "regular expression")
    chosen = []
    for name in value:
        hit = [t for t in have if PEFT_MODULES[t] == name or PEFT_MODULES[t].endswith("." + name)]
        if len(hit) != 1:
            raise r.error("target_modules", f"{name!r} is not a projection jaxformer can adapt in this model "
                                            f"(supported: {sorted(PEFT_MODULES[t].split('.')[-1] for t in have)})")
        chosen += hit
    return tuple(t for t in have if t in chosen)


# -- adapter tensors in

def _expected(config: ModelConfig) -> dict[str, tuple[int, str, str]]:
    """peft name -> ``(layer, projection, "A" | "B")`` for every adapter tensor of ``config``."""
    return {peft_key(i, t, w): (i, t, w) for i in range(config.n_layers) for t in config.lora_targets
            for w in ("A", "B")}


def _abstract_adapter(config: ModelConfig) -> dict:
    """The per-layer adapter's shapes (pure dict of ShapeDtypeStruct) of ``config`` (which has ``lora``)."""
    _, abstract = abstract_init(per_layer_config(config))
    return nnx.to_pure_dict(nnx.split_state(abstract, nnx.LoRAParam, ...)[0])


def read_adapter(path: str | os.PathLike, config: ModelConfig) -> tuple[ModelConfig, dict]:
    """``(config with lora, adapter)``: the adapter of ``path`` for the base model ``config`` (its ``lora`` is
    replaced by the adapter's), as a pure dict of numpy float32 arrays (the ``nnx.LoRAParam`` leaves only;
    stacked when ``config.scan_layers``). Every tensor's name and shape is checked before one is read."""
    from safetensors import safe_open

    lora = read_adapter_config(path, config)
    lcfg = config.model_copy(update=dict(lora=lora))
    file = Path(path) / ADAPTER_WEIGHTS
    if not file.is_file():
        found = sorted(p.name for p in Path(path).iterdir() if p.suffix in (".bin", ".pt"))
        hint = f" (found {found}: only safetensors is read)" if found else ""
        raise FileNotFoundError(f"{file}: missing{hint}")
    expected = _expected(lcfg)
    shapes = _abstract_adapter(lcfg)
    try:
        with safe_open(str(file), framework="np") as f:
            header = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as e:  # safetensors' own error types for a corrupt file
        raise PeftAdapterError(f"{file}: cannot read the safetensors header ({e})") from None

    def peft_shape(i, t, w):
        leaf = shapes["decoder"]["blocks"][i][_sublayer(t)][t + LORA_SUFFIX]["a" if w == "A" else "b"].shape
        return (leaf[-1], math.prod(leaf[:-1])) if w == "A" else (math.prod(leaf[1:]), leaf[0])

    problems = []
    missing = sorted(set(expected) - set(header))
    unexpected = sorted(set(header) - set(expected))
    if missing:
        targets = sorted(PEFT_MODULES[t].split(".")[-1] for t in lcfg.lora_targets)
        problems.append(f"missing tensors (adapter_config.json targets {targets} in {config.n_layers} layers): "
                        f"{missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors (not adapters of the targets in adapter_config.json): "
                        f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    wrong = [f"{n}: {header[n]}, expected {peft_shape(*expected[n])}" for n in sorted(expected)
             if n in header and header[n] != peft_shape(*expected[n])]
    if wrong:
        problems.append(f"shapes that do not match r={lora.rank} and the base model: " + "; ".join(wrong[:8]))
    if problems:
        raise PeftAdapterError(f"{file}: " + " | ".join(problems))
    blocks: dict[int, dict] = {i: {} for i in range(config.n_layers)}
    with safe_open(str(file), framework="np") as f:
        for name, (i, t, w) in expected.items():
            x = np.asarray(f.get_tensor(name), np.float32)
            leaf = shapes["decoder"]["blocks"][i][_sublayer(t)][t + LORA_SUFFIX]["a" if w == "A" else "b"]
            ours = x.T.reshape(leaf.shape)  # lora_A [R, in] -> A [*I, R]; lora_B [out, R] -> B [R, *O]
            blocks[i].setdefault(_sublayer(t), {}).setdefault(t + LORA_SUFFIX, {})["a" if w == "A" else "b"] = ours
    adapter = {"decoder": {"blocks": blocks}}
    if config.scan_layers:
        adapter = stack_layers(adapter, lcfg)
    return lcfg, adapter


def _sublayer(target: str) -> str:
    return "self_attn" if PEFT_MODULES[target].startswith("self_attn.") else "mlp"


# -- the adapter inside a model state

def _pure(state) -> dict:
    return nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state


def _is_adapter(path) -> bool:
    names = [str(getattr(k, "key", k)) for k in path]
    return len(names) >= 2 and names[-2].endswith(LORA_SUFFIX) and names[-1] in ("a", "b")


def adapter_state(state) -> dict:
    """The adapter of a LoRA model's state (``nnx.State`` or pure dict; or already the adapter alone) as a
    pure dict: the ``nnx.LoRAParam`` leaves (``.../w_q_lora/a``, ``.../w_q_lora/b``, ...)."""
    if isinstance(state, nnx.State):
        return nnx.to_pure_dict(nnx.split_state(state, nnx.LoRAParam, ...)[0])
    flat = nnx.traversals.flatten_mapping(state)
    return nnx.traversals.unflatten_mapping({p: v for p, v in flat.items() if _is_adapter(p)})


def merge_lora(config: ModelConfig, state, *, dtype=None) -> tuple[ModelConfig, Any]:
    """``(config.base, state with every adapted kernel W replaced by W + s A B)``, the adapters (and their
    dropout keys) gone: a model that computes what the LoRA model computes (without dropout), in the base's
    own layout. ``state``: the LoRA model's ``nnx.State`` (an ``nnx.State`` of the base model is returned) or
    pure dict (a pure dict is returned). The sum is taken in float32 and cast to ``dtype`` (default: each
    kernel's own; an export that saves wider than a bfloat16 base passes float32 and rounds once, when saving)."""
    if config.lora is None:
        return config, state
    scale = config.lora.scale
    flat = dict(nnx.traversals.flatten_mapping(_pure(state)))
    out = {}
    for path, value in flat.items():
        if any(str(k).endswith(LORA_SUFFIX) for k in path):
            continue
        lora = path[:-1] + (path[-1] + LORA_SUFFIX,)
        if lora + ("a",) in flat:
            delta = lora_delta(flat[lora + ("a",)], flat[lora + ("b",)], scale, np.shape(value))
            value = (jnp.asarray(value, jnp.float32) + delta).astype(dtype or jnp.asarray(value).dtype)
        out[path] = value
    base = config.base
    pure = nnx.traversals.unflatten_mapping(out)
    if not isinstance(state, nnx.State):
        return base, pure
    _, abstract = abstract_init(base)
    nnx.replace_by_pure_dict(abstract, pure)
    return base, abstract


def with_adapter(config: ModelConfig, state, adapter: Mapping) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, state)`` of the LoRA model ``config`` from the base model's ``state`` (``nnx.State`` or pure
    dict, in ``config.scan_layers``' layout) and ``adapter`` (pure dict of the ``nnx.LoRAParam`` leaves);
    dropout keys (if any) are zeros."""
    graphdef, abstract = abstract_init(config)
    flat = dict(nnx.traversals.flatten_mapping(_pure(state)))
    flat.update(nnx.traversals.flatten_mapping(dict(adapter)))
    leaves = []
    for path, var in nnx.to_flat_state(abstract):
        path, want = tuple(path), var.get_value()
        if path in flat:
            value = jnp.asarray(flat[path])
        elif isinstance(var, DropoutKey):
            value = jnp.zeros(want.shape, want.dtype)
        else:
            raise ValueError(f"with_adapter: {'/'.join(map(str, path))} is in neither the base state nor the adapter")
        if value.shape != want.shape:
            raise ValueError(f"with_adapter: {'/'.join(map(str, path))} has shape {value.shape}, the model "
                             f"{want.shape}")
        leaves.append((path, var.replace(value)))
    return graphdef, nnx.from_flat_state(leaves)


def apply_adapter(path: str | os.PathLike, config: ModelConfig, state) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """The base model ``(config, state)`` (e.g. from ``load_pretrained``) with the peft adapter at ``path``
    added, unmerged: ``(config with lora, graphdef, state)``; the adapter is the ``nnx.LoRAParam`` leaves."""
    lcfg, adapter = read_adapter(path, config.base)
    graphdef, full = with_adapter(lcfg, state, adapter)
    return lcfg, graphdef, full


def load_adapter(path: str | os.PathLike, config: ModelConfig, state):
    """The base model's ``state`` (``nnx.State`` or pure dict, as ``load_pretrained`` returns it for ``config``)
    with the peft adapter at ``path`` merged into its kernels (``W + s A B``, float32 sum cast to the state's
    dtype): the same ``config`` and graphdef compute the adapted model. Returns the same kind as ``state``.
    Raises :class:`PeftAdapterError` / ``FileNotFoundError`` (naming the file and key or tensors)."""
    lcfg, adapter = read_adapter(path, config.base)
    flat = dict(nnx.traversals.flatten_mapping(_pure(state)))
    for apath, value in nnx.traversals.flatten_mapping(adapter).items():
        flat[apath] = value
    _, merged = merge_lora(lcfg, nnx.traversals.unflatten_mapping(flat))
    if not isinstance(state, nnx.State):
        return merged
    out = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(out, merged)
    return out


# -- adapters out

def adapter_config(config: ModelConfig, *, base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """``adapter_config.json`` for ``config.lora``, with every key peft :data:`PEFT_VERSION` writes (its
    defaults where jaxformer has no say)."""
    lora = config.lora
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    return {
        "alora_invocation_tokens": None, "alpha_pattern": {}, "arrow_config": None, "auto_mapping": None,
        "base_model_name_or_path": base_model_name_or_path, "bias": "none", "corda_config": None,
        "ensure_weight_tying": False, "eva_config": None, "exclude_modules": None, "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "kasa_config": None, "layer_replication": None,
        "layers_pattern": None, "layers_to_transform": None, "loftq_config": {}, "lora_alpha": alpha,
        "lora_bias": False, "lora_dropout": lora.dropout, "lora_ga_config": None, "megatron_config": None,
        "megatron_core": "megatron.core", "modules_to_save": None, "monteclora_config": None, "peft_type": "LORA",
        "peft_version": PEFT_VERSION, "qalora_group_size": 16, "r": lora.rank, "rank_pattern": {}, "revision": None,
        "target_modules": sorted(PEFT_MODULES[t].split(".")[-1] for t in config.lora_targets),
        "target_parameters": None, "task_type": "CAUSAL_LM", "trainable_token_indices": None, "use_bdlora": None,
        "use_dora": False, "use_qalora": False, "use_rslora": lora.rslora, "velora_config": None,
    }


def adapter_tensors(config: ModelConfig, adapter: Mapping) -> dict[str, np.ndarray]:
    """peft's tensors (name -> float32 ``[R, in]`` / ``[out, R]``) of a per-layer or scanned ``adapter`` of
    ``config`` (pure dict of the ``nnx.LoRAParam`` leaves)."""
    adapter = {k: v for k, v in adapter.items()}
    if config.scan_layers:
        adapter = unstack_layers(adapter, config)
    blocks = adapter["decoder"]["blocks"]
    out = {}
    for i in range(config.n_layers):
        for t in config.lora_targets:
            node = blocks[i][_sublayer(t)][t + LORA_SUFFIX]
            a, b = np.asarray(jax.device_get(node["a"]), np.float32), np.asarray(jax.device_get(node["b"]), np.float32)
            out[peft_key(i, t, "A")] = np.ascontiguousarray(a.reshape(-1, a.shape[-1]).T)  # [*I, R] -> [R, in]
            out[peft_key(i, t, "B")] = np.ascontiguousarray(b.reshape(b.shape[0], -1).T)   # [R, *O] -> [out, R]
    return out


def save_adapter(path: str | os.PathLike, config: ModelConfig, state, *,
                 base_model_name_or_path: str | None = None) -> Path:
    """Write the adapter of the LoRA model ``(config, state)`` as peft does: ``adapter_config.json`` +
    ``adapter_model.safetensors`` in ``path`` (created), which ``PeftModel.from_pretrained(base, path)`` loads.
    ``state``: the whole LoRA model's state or the adapter alone (``nnx.State`` or pure dict; a scanned
    state, ``config.scan_layers``, is written per layer). Returns the directory."""
    from safetensors.numpy import save_file

    if config.lora is None:
        raise ValueError("save_adapter: config.lora is None (a model without adapters)")
    _check_family(config, "save_adapter")
    tensors = adapter_tensors(config, adapter_state(state))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    cfg = adapter_config(config, base_model_name_or_path=base_model_name_or_path)
    (path / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True))  # as peft formats it
    return path


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PEFT_MODULES", "PEFT_VERSION", "PeftAdapterError", "adapter_config",
           "adapter_state", "adapter_tensors", "apply_adapter", "load_adapter", "merge_lora", "peft_key",
           "read_adapter", "read_adapter_config", "save_adapter", "with_adapter"]
