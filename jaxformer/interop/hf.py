"""Hugging Face checkpoints in and out: ``config.json`` + safetensors <-> ``(ModelConfig, graphdef, state)``.

::

    config, graphdef, state = load_pretrained("path/to/Llama-3.2-1B")        # float32
    logits = nnx.merge(graphdef, state)(tokens)
    save_pretrained("out/", config, state)          # transformers' from_pretrained reads it back
    tok = load_tokenizer("path/to/Llama-3.2-1B")    # tokenizer.json, or a SentencePiece model
    config, graphdef, state = load_pretrained("model.Q4_K_M.gguf")          # a GGUF file: jaxformer.interop.gguf

Families (``model_type``): ``gpt2``; ``llama``, ``mistral``, ``qwen2`` (one module:
GQA, RoPE scaling, QKV biases, sliding window); ``bert``; ``bloom``; ``marian``.
Anything a family cannot reproduce exactly (an option, an activation, a RoPE
scaling type) is an :class:`HFConfigError` naming ``config.json`` and the key;
never a silent mismatch.

Loading reads tensor by tensor from memory-mapped safetensors (one file or shards
listed in ``model.safetensors.index.json``), so peak memory stays near the model's
own size: every header is checked first (each tensor present, none unexpected,
each shape the one the config implies), and only then is a byte read, so a bad
checkpoint fails before anything is half-built. With ``shardings`` (a state-shaped
tree of ``jax.sharding.Sharding``, e.g. from ``nnx.get_named_sharding``) each tensor
goes straight onto its devices.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxformer.interop.rules import Family, HFConfigError, HFWeightsError, Rule, read_json_object
from jaxformer.model.config import SECTIONS, ModelConfig
from jaxformer.model.functional import abstract_init
from jaxformer.model.layout import per_layer_config, stack_layers, unstack_layers
from jaxformer.nn.params import as_dtype

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 1024**3
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' dtype names the loader reads


def families() -> dict[str, Family]:
    """``model_type -> Family`` for every family this module reads and writes."""
    from jaxformer.interop import bert, bloom, gpt2, llama, marian

    out: dict[str, Family] = {}
    for module in (gpt2, llama, bert, bloom, marian):
        for family in module.FAMILIES:
            for model_type in family.model_types:
                out[model_type] = family
    return out


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """``path/config.json`` as a dict; a clear error when the directory or file is missing or not JSON.
    A GGUF file's metadata as the same dict (:func:`jaxformer.interop.gguf.read_config`)."""
    from jaxformer.interop import gguf

    if gguf.is_gguf(path):
        return gguf.read_config(path)
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a directory (a Hugging Face checkpoint is a directory with "
                                f"{CONFIG} and *.safetensors)")
    file = path / CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing; a Hugging Face checkpoint directory needs {CONFIG}")
    return read_json_object(file)


def config_where(path: str | os.PathLike) -> str:
    """What config errors name: ``path/config.json``, or the GGUF file itself."""
    from jaxformer.interop.gguf import is_gguf

    return str(path) if is_gguf(path) else str(Path(path) / CONFIG)


# model_type -> kind, for families jaxformer may not read: a clear refusal either way
OTHER_KINDS = {"bert": "encoder", "roberta": "encoder", "distilbert": "encoder", "electra": "encoder",
               "marian": "encoder-decoder", "t5": "encoder-decoder", "bart": "encoder-decoder",
               "mbart": "encoder-decoder", "pegasus": "encoder-decoder"}


def check_kind(path: str | os.PathLike, want: str, command: str) -> None:
    """ValueError naming the model type, its kind and the command that runs it, unless ``path``'s model is a
    ``want`` (``"decoder"`` or ``"encoder-decoder"``)."""
    hf = read_config(path)
    model_type = hf.get("model_type")
    kind = OTHER_KINDS.get(model_type) or config_from_hf(hf, config_where(path)).kind.replace("_", "-")
    if kind != want:
        what = {"decoder": "a decoder-only (causal LM)", "encoder-decoder": "a Marian encoder-decoder"}[want]
        hint = {"encoder-decoder": " (translation: jaxformer translate --hf DIR --text ...)",
                "decoder": " (a decoder: jaxformer generate --hf DIR)"}.get(kind, "")
        raise ValueError(f"{command} --hf: {path} is a {model_type} checkpoint, an {kind} model; {command} needs "
                         f"{what} checkpoint{hint}")


def family_for(hf: Mapping[str, Any], where: str) -> Family:
    model_type = hf.get("model_type")
    table = families()
    if model_type not in table:
        raise HFConfigError(f"{where}: model_type: {model_type!r} is not supported "
                            f"(supported: {sorted(table)})")
    return table[model_type]


def config_from_hf(hf: Mapping[str, Any], where: str = CONFIG, *, dtype: str = "float32") -> ModelConfig:
    """A ``config.json`` dict as a :class:`ModelConfig` with ``param_dtype = compute_dtype = dtype``."""
    config = family_for(hf, where).config_from_hf(hf, where)
    return config.model_copy(update=dict(param_dtype=dtype, compute_dtype=dtype))


# -- safetensors headers

def safetensors_files(path: str | os.PathLike) -> list[str]:
    """The safetensors files of the checkpoint directory ``path``, by name: its shards (those
    ``model.safetensors.index.json`` lists) or ``model.safetensors``; :class:`HFWeightsError` naming what is
    missing."""
    path = Path(path)
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise HFWeightsError(f"{index}: not a safetensors index with a weight_map ({e})") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise HFWeightsError(f"{index} lists shards that are missing from {path}: {missing}")
        return files
    if (path / SINGLE).is_file():
        return [SINGLE]
    found = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".h5", ".msgpack"))
    hint = f" (found {found}: only safetensors is read; convert with transformers' save_pretrained)" if found else ""
    raise HFWeightsError(f"{path}: no {SINGLE} or {INDEX}{hint}")


class _Tensors:
    """Every tensor of a checkpoint: name -> (file, shape, dtype), read from headers only."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self._open = safe_open
        files = safetensors_files(path)
        self.where: dict[str, str] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.dtype: dict[str, str] = {}
        self.path = path
        for file in files:
            try:
                with safe_open(str(path / file), framework="np") as f:
                    for name in f.keys():
                        if name in self.where:
                            raise HFWeightsError(f"tensor {name} is in both {self.where[name]} and {file}")
                        sl = f.get_slice(name)
                        self.where[name], self.shape[name], self.dtype[name] = \
                            file, tuple(sl.get_shape()), sl.get_dtype()
            except HFWeightsError:
                raise
            except Exception as e:  # safetensors raises its own error types for a corrupt header
                raise HFWeightsError(f"{path / file}: cannot read the safetensors header ({e})") from None

    def file_name(self, name: str) -> str:
        """A tensor's name as the checkpoint spells it (a GGUF file's differ: see gguf.GGUFTensors)."""
        return name

    def read(self, name: str) -> np.ndarray:
        # A fresh memory map per tensor, closed at once: get_tensor copies the bytes out, and the pages a
        # still-open map has touched count in the process's resident set (RssFile) until it is unmapped,
        # so keeping one handle per file held the whole checkpoint resident beside the loaded state
        # (peak ~2.1x the checkpoint for a 1B bf16 load; ~1.1x with this, see experiments/bench/hf_load.py).
        with self._open(str(self.path / self.where[name]), framework="np") as f:
            return f.get_tensor(name)


def _tensors(path: Path):
    """The checkpoint's tensors by name: safetensors headers, or a GGUF file's tensors under HF names."""
    from jaxformer.interop import gguf

    return gguf.open_tensors(path) if gguf.is_gguf(path) else _Tensors(path)


def _flat_params(state) -> dict[tuple, Any]:
    return {tuple(p): v for p, v in nnx.to_flat_state(state)}


def _value(v):
    """A state leaf's array (an ``nnx.Variable`` or a plain array)."""
    return v.get_value() if isinstance(v, nnx.Variable) else v


def _hf_shapes(rules: list[Rule], params: Mapping[tuple, Any]) -> dict[str, tuple[int, ...]]:
    """The shape of every HF tensor the rules imply, from the jaxformer shapes (``save`` under eval_shape)."""
    out = {}
    for rule in rules:
        args = [jax.ShapeDtypeStruct(params[p].shape, np.float32) for p in rule.jax]
        outs = jax.eval_shape(rule.save, *args)
        for name, s in zip(rule.hf, outs, strict=True):
            out[name] = tuple(s.shape)
    return out


def _check_rules(family: Family, rules: list[Rule], params: Mapping[tuple, Any]) -> None:
    """Every parameter of the model is written by exactly one rule (a family bug otherwise)."""
    seen: dict[tuple, str] = {}
    for rule in rules:
        for p in rule.jax:
            if p not in params:
                raise AssertionError(f"{family.name}: rule for {rule.hf} writes {p}, not a parameter of the model")
            if p in seen:
                raise AssertionError(f"{family.name}: {p} written by both {seen[p]} and {rule.hf}")
            seen[p] = str(rule.hf)
    missing = sorted(map(str, set(params) - set(seen)))
    if missing:
        raise AssertionError(f"{family.name}: no rule writes {missing}")


def _canonical(family: Family, present: list[str], expected: Mapping[str, Any]) -> dict[str, str]:
    """Present name -> the family's canonical name (:meth:`Family.rename` first, e.g. BERT's old
    ``LayerNorm.gamma``; then the head model's prefix added to a bare model's names). Two present names
    with one canonical name (``x`` and ``bert.x``) are an error, never a silent pick."""
    out = {}
    for name in present:
        key = family.rename(name)
        if key in expected:
            out[name] = key
            continue
        for prefix in family.prefixes:
            if prefix + key in expected:
                out[name] = prefix + key
                break
        else:
            out[name] = key
    seen: dict[str, str] = {}
    for name, canon in out.items():
        if canon in seen:
            raise HFWeightsError(f"tensors {seen[canon]} and {name} are both {canon}")
        seen[canon] = name
    return out


def load_pretrained(path: str | os.PathLike, *, dtype: str = "float32", shardings=None,
                    **overrides) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """Read a Hugging Face checkpoint directory into ``(config, graphdef, state)``.

    Args:
      path: a directory with ``config.json`` and ``model.safetensors`` (or shards +
        ``model.safetensors.index.json``), or a ``.gguf`` file (:mod:`jaxformer.interop.gguf`: its
        metadata read as the config, its tensors de-quantized to float32 first).
      dtype: ``"float32" | "bfloat16" | "float16"``: parameter and compute dtype.
      shardings: optional state-shaped tree of ``jax.sharding.Sharding`` (each tensor is
        placed straight onto its devices).
      overrides: ``ModelConfig`` fields to change after the translation that do not touch the
        weights (e.g. ``attention=dict(impl="blockwise")``, ``remat=True``; ``max_seq_len=4096`` for RoPE,
        ALiBi or sinusoidal positions: a learned table's size is fixed by its weights, and changing
        it fails the shape check; ``scan_layers=True``: the per-layer tensors are read, then stacked
        into the scanned state by :func:`jaxformer.model.stack_layers`, ``shardings`` then being
        the scanned state's).

    Raises:
      FileNotFoundError: no directory / no ``config.json``.
      HFConfigError: an unsupported ``model_type`` or option (names the file and key).
      HFWeightsError: a missing shard, a missing / unexpected tensor, a wrong shape.
    """
    path = Path(path)
    hf = read_config(path)
    where = config_where(path)
    family = family_for(hf, where)
    as_dtype(dtype)
    config = config_from_hf(hf, where, dtype=dtype)
    if overrides:
        config = config.replace(**overrides)
    if config.lora is not None:
        raise ValueError("load_pretrained reads a base model (lora=None); add an adapter with "
                         "jaxformer.interop.peft.apply_adapter / load_adapter")
    model_config = config
    if config.scan_layers:  # a checkpoint holds per-layer tensors: read those, stack them at the end
        config = per_layer_config(config)
    graphdef, abstract = abstract_init(config)
    params = _flat_params(abstract)
    rules = family.rules(config)
    _check_rules(family, rules, params)
    expected = _hf_shapes(rules, params)

    tensors = _tensors(path)
    names = _canonical(family, list(tensors.where), expected)
    present = {canon: name for name, canon in names.items()}
    optional = set(family.optional(config))
    copies = family.tied_copies(config)  # checked equal to their sources below
    missing = [n for n in expected if n not in present and n not in optional]
    skipped = family.ignored(config)
    unexpected = [n for n, canon in names.items()
                  if canon not in expected and canon not in copies and not canon.startswith(skipped)]
    wrong = [f"{present[n]} in {tensors.where[present[n]]}: {tensors.shape[present[n]]}, expected {s}"
             for n, s in expected.items() if n in present and tensors.shape[present[n]] != s]
    wrong += [f"{present[n]} in {tensors.where[present[n]]}: dtype {tensors.dtype[present[n]]}, expected a float "
              f"({', '.join(FLOAT_DTYPES)}; quantized checkpoints are not read)"
              for n in expected if n in present and tensors.dtype[present[n]] not in FLOAT_DTYPES]
    problems = []
    if missing:
        problems.append(f"missing tensors: {[tensors.file_name(n) for n in missing]}")
    if unexpected:
        problems.append(f"unexpected tensors (not part of a {family.name} model with this config): "
                        f"{[tensors.file_name(n) for n in unexpected]}")
    if wrong:
        problems.append("shapes that do not match config.json: " + "; ".join(wrong))
    if problems:
        raise HFWeightsError(f"{path}: " + " | ".join(problems))
    family.verify(config, _LazyTensors(tensors, present))
    for copy, source in family.tied_copies(config).items():
        if copy in present and source in present and not np.array_equal(tensors.read(present[copy]),
                                                                          tensors.read(present[source])):
            raise HFWeightsError(f"{path}: {present[copy]} differs from {present[source]}, but config.json ties "
                                 "them (tie_word_embeddings); transformers would use the stored copy, jaxformer "
                                 "only the source: set tie_word_embeddings to false, or drop the copy")

    target = as_dtype(dtype)
    flat_shardings = None if shardings is None or model_config.scan_layers else _flat_params(shardings)
    loaded: dict[tuple, Any] = {}
    cache: dict[str, np.ndarray] = {}

    def read(name: str) -> np.ndarray:
        if name in present:
            return tensors.read(present[name])
        if name not in cache:  # an optional tensor the checkpoint left out (e.g. a tied head)
            cache[name] = family.fill(name, _LazyTensors(tensors, present))
        return cache[name]

    for rule in rules:
        arrays = [np.asarray(read(n)) for n in rule.hf]
        arrays = [a.astype(np.float32) if a.dtype != np.float32 else a for a in arrays]
        outs = rule.load(*arrays)
        for p, a in zip(rule.jax, outs, strict=True):
            a = np.ascontiguousarray(a).astype(target, copy=False)
            if a.shape != params[p].shape:
                raise AssertionError(f"{family.name}: {rule.hf} -> {p} gave {a.shape}, model has {params[p].shape}")
            if model_config.scan_layers:
                loaded[p] = a  # on the host until stacked
                continue
            sharding = None if flat_shardings is None else flat_shardings[p]
            sharding = None if sharding is None else _value(sharding)
            loaded[p] = jax.device_put(a, sharding) if sharding is not None else jax.numpy.asarray(a)
        del arrays, outs
    if model_config.scan_layers:
        return model_config, *_stacked(model_config, loaded, shardings)
    state = nnx.from_flat_state([(p, params[p].replace(loaded[p])) for p in params])
    return config, graphdef, state


def _stacked(config: ModelConfig, loaded: dict[tuple, np.ndarray], shardings) -> tuple[nnx.GraphDef, nnx.State]:
    """The per-layer host arrays ``loaded`` (flat paths) stacked into the scanned model of ``config``,
    each leaf placed onto its sharding (if given). Peak host memory is about twice the blocks' size."""
    stacked = stack_layers(nnx.traversals.unflatten_mapping(loaded), config)
    loaded.clear()
    flat = dict(nnx.traversals.flatten_mapping(stacked))
    del stacked
    graphdef, abstract = abstract_init(config)
    params = _flat_params(abstract)
    flat_shardings = None if shardings is None else _flat_params(shardings)
    leaves = []
    for p, v in params.items():
        a = flat.pop(p)
        sharding = None if flat_shardings is None else _value(flat_shardings[p])
        leaves.append((p, v.replace(jax.device_put(a, sharding) if sharding is not None else jax.numpy.asarray(a))))
    return graphdef, nnx.from_flat_state(leaves)


class _LazyTensors(Mapping):
    """Read-on-access view of the checkpoint's tensors by canonical name (for :meth:`Family.fill`)."""

    def __init__(self, tensors: _Tensors, present: Mapping[str, str]):
        self._t, self._present = tensors, present

    def __getitem__(self, name):
        return self._t.read(self._present[name])

    def __iter__(self):
        return iter(self._present)

    def __len__(self):
        return len(self._present)


# -- saving

_NOT_SAVED = ("attention.impl", "remat", "scan_layers", "max_seq_len", "init_std", "init_scheme",
              "attention.q_init_scale", "ffn.multiple_of", "param_dtype", "compute_dtype")


def _behaviour(config: ModelConfig) -> dict[str, Any]:
    """The fields that decide what the model computes, derived ones resolved (head_dim None -> D / N...), by
    dotted key (``attention.n_heads``)."""
    out = config.model_dump()
    drop = list(_NOT_SAVED)
    if config.positions.kind != "rope":  # fields that change nothing for this model
        drop += ["positions.rope_base", "positions.rope_scaling", "positions.rope_interleaved"]
    if config.positions.kind != "sinusoidal":
        drop.append("positions.sinusoidal_layout")
    for key in drop:
        *section, name = key.split(".")
        (out[section[0]] if section else out).pop(name)
    out["attention"].update(head_dim=config.resolved_head_dim, n_kv_heads=config.resolved_kv_heads,
                            qkv_bias=config.resolved_qkv_bias)
    out["ffn"]["d_ff"] = config.resolved_d_ff
    out["norm"]["final"] = config.norm.resolved_final
    return {f"{k}.{f}" if isinstance(v, dict) and k in SECTIONS else k: x
            for k, v in out.items() for f, x in (v.items() if isinstance(v, dict) and k in SECTIONS else [(k, v)])}


def guess_model_type(config: ModelConfig) -> str:
    """The HF family a jaxformer config most plainly is (``save_pretrained``'s default)."""
    if config.kind == "encoder_decoder":
        return "marian"
    if config.kind == "encoder":
        return "bert"
    if config.positions.kind == "alibi":
        return "bloom"
    if config.positions.kind == "learned":
        return "gpt2"
    if config.sparsity.banded:
        return "mistral"
    if config.attention.qkv_bias:
        return "qwen2"
    return "llama"


def save_pretrained(path: str | os.PathLike, config: ModelConfig, state, *, model_type: str | None = None,
                    hf_config: Mapping[str, Any] | None = None, dtype: str | None = None,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write ``config`` + ``state`` as a Hugging Face checkpoint that ``transformers`` loads (a scanned
    state, ``config.scan_layers``, is written per layer: :func:`jaxformer.model.unstack_layers`).

    Args:
      model_type: the HF family (default: ``hf_config["model_type"]`` or :func:`guess_model_type`).
      hf_config: extra ``config.json`` keys to keep (token ids, ``architectures``...), e.g. the
        config a fine-tuned model was loaded from; the architecture keys are always rewritten
        from ``config``.
      dtype: the saved tensors' dtype (default: ``config.param_dtype``).
      max_shard_bytes: files above this are split into shards with an index.
    Returns the directory.
    """
    from safetensors.numpy import save_file

    if config.lora is not None:
        raise ValueError("save_pretrained writes a model without adapters: merge them first "
                         "(jaxformer.interop.peft.merge_lora) or write the adapter alone (peft.save_adapter)")
    path = Path(path)
    model_type = model_type or (hf_config or {}).get("model_type") or guess_model_type(config)
    family = families().get(model_type)
    if family is None:
        raise HFConfigError(f"model_type={model_type!r} is not supported (supported: {sorted(families())})")
    hf = {**family.hf_defaults(config), **(hf_config or {}), **family.config_to_hf(config)}
    if config.positions.kind != "learned" and "max_position_embeddings" in (hf_config or {}):
        # only a learned table's size is part of the weights; otherwise keep the checkpoint's own context
        # length (a fine-tune's max_seq_len is a training choice, not the model's)
        hf["max_position_embeddings"] = hf_config["max_position_embeddings"]
    dtype = dtype or config.param_dtype
    target = as_dtype(dtype)
    hf["torch_dtype"] = hf["dtype"] = dtype
    # the saved config must read back as this config: check before writing anything
    back = config_from_hf(hf, f"(config written for {model_type})", dtype=config.param_dtype)
    ours, theirs = _behaviour(config), _behaviour(back)
    diff = {k: (theirs[k], v) for k, v in ours.items() if theirs[k] != v}
    if diff:
        raise HFConfigError(f"a {model_type} config.json cannot express this ModelConfig: "
                            + ", ".join(f"{k} (would read back as {a!r}, is {b!r})" for k, (a, b) in diff.items()))
    params = {p: np.asarray(jax.device_get(_value(v))) for p, v in _flat_params(state).items()}
    if config.scan_layers:  # a checkpoint holds per-layer tensors: unstack (on the host)
        config = per_layer_config(config)
        params = dict(nnx.traversals.flatten_mapping(unstack_layers(nnx.traversals.unflatten_mapping(params),
                                                                    config)))
    rules = family.rules(config)
    _check_rules(family, rules, params)
    tensors: dict[str, np.ndarray] = {}
    for rule in rules:
        outs = rule.save(*[params[p].astype(np.float32) for p in rule.jax])
        for name, a in zip(rule.hf, outs, strict=True):
            tensors[name] = np.ascontiguousarray(a).astype(target)
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].nbytes
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += n
    for stale in [path / SINGLE, path / INDEX, *path.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / SINGLE), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / file), metadata=meta)
            weight_map.update({name: file for name in shard})
        index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
        (path / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (path / CONFIG).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return path
