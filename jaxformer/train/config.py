"""The experiment schema: one YAML file validated into frozen pydantic models.

::

    seed: 0
    steps: 2000
    batch_size: 32          # global, in sequences
    seq_len: 256
    model: {preset: llama_tiny, n_layers: 4}     # or every ModelConfig field, or {hf: DIR}
    data: {source: stdlib}
    optimizer: {lr: 3.0e-3, weight_decay: 0.1}
    schedule: {kind: cosine, warmup_steps: 100}
    mesh: {data: -1}
    checkpoint: {every: 500, keep: 3}
    logging: {every: 10}
    eval: {every: 500, max_tokens: 65536}

Unknown keys and wrong types fail before anything runs with
``FILE: dotted.key: message`` (:class:`ConfigError`; an unknown key with the
closest known one, ``did you mean model.d_model?``). ``key.sub=value``
overrides (values parsed as YAML) are applied to the raw mapping before
validation; an error at a key an override set names the override, not the file.
:func:`dump` writes the resolved config (the model with every
field, no preset) that a run directory keeps.

``model: {hf: path/to/checkpoint}`` fine-tunes a Hugging Face checkpoint: the model
is the one its ``config.json`` describes (only fields that leave the weights as
they are may be set beside ``hf``: :data:`HF_MODEL_OVERRIDES`), training starts
from its parameters and the data is tokenized with its tokenizer
(``data.tokenizer: hf``, the default then). A relative path is resolved against
the YAML file's directory. The resolved config keeps the full model and the
directory as ``hf_source``, so a run directory is read back without it.

``model: {hf: DIR, lora: {rank: 8, alpha: 16, dropout: 0.0, targets: [...], rslora: false}}`` trains low-rank
adapters on the frozen checkpoint instead (:mod:`jaxformer.train.lora`); ``model: {hf: DIR, adapter: PEFT_DIR}``
continues training a peft adapter (its ``adapter_config.json`` gives the LoRA settings, its weights step 0's
adapter; recorded as ``adapter_source``).
"""

from __future__ import annotations

import difflib
import math
import os
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PositiveInt, ValidationError, ValidationInfo, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from jaxformer.model import LoRAConfig, ModelConfig, presets
from jaxformer.model.config import FLAT_KEYS, AttentionImpl, Dtype, flat_key, merge, migrate


class ConfigError(ValueError):
    """A config file or override that does not validate; the message names file and dotted key."""


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DataConfig(_Section):
    """Where tokens come from and how they are cut into training sequences."""

    source: Literal["stdlib", "text", "bin"] = "stdlib"
    path: str | None = Field(None, description="text: a file or directory; bin: a .bin token file")
    glob: str = Field("**/*", description="text directories: which files to read")
    tokenizer: Literal["bytes", "bpe", "hf"] = Field(
        "bytes", description="hf: the tokenizer of the Hugging Face checkpoint in model.hf (the default then)")
    bpe_vocab_size: int = Field(1024, gt=260, description="tokenizer='bpe': trained on the train split")
    bin_dtype: Literal["uint16", "uint32"] = "uint16"
    bin_vocab_size: int | None = Field(None, gt=0, description="source='bin': token ids are < this")
    bin_eos_id: int | None = Field(None, ge=0, description="source='bin': document separator, if any")
    val_fraction: float = Field(0.02, ge=0.0, lt=1.0)
    shuffle: bool = True

    @model_validator(mode="after")
    def _check(self):
        if self.source in ("text", "bin") and not self.path:
            raise ValueError(f"source={self.source!r} needs data.path")
        if self.source == "stdlib" and self.path:
            raise ValueError("source='stdlib' takes no path (the corpus is the interpreter's stdlib)")
        if self.source == "bin":
            if self.tokenizer != "bytes":
                raise ValueError("source='bin' is pre-tokenized; leave tokenizer at 'bytes'")
            if self.bin_vocab_size is None:
                raise ValueError("source='bin' needs data.bin_vocab_size")
            if self.bin_eos_id is not None and self.bin_eos_id >= self.bin_vocab_size:
                raise ValueError(f"bin_eos_id={self.bin_eos_id} is not a token id below "
                                 f"bin_vocab_size={self.bin_vocab_size}")
        return self


class OptimizerConfig(_Section):
    """AdamW or Muon, gradient clipping, accumulation and which parameters get weight decay.

    ``name: muon`` orthogonalises the momentum of every hidden weight matrix
    (attention and MLP projections; Newton-Schulz, Jordan et al. 2024) and keeps
    AdamW for embeddings, the LM head, norms and biases. Its updates are scaled
    to AdamW's RMS (``muon_rms``; Liu et al. 2025), so both groups share ``lr``,
    the schedule and ``weight_decay``.
    """

    name: Literal["adamw", "muon"] = "adamw"
    lr: float = Field(1e-3, ge=0.0)
    b1: float = Field(0.9, ge=0.0, lt=1.0)
    b2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: float = Field(0.1, ge=0.0)
    decay_norms: bool = False
    decay_biases: bool = False
    decay_embeddings: bool = False
    clip_norm: float | None = Field(1.0, gt=0.0)
    grad_accum: int = Field(1, ge=1, description="micro-batches per step (batch_size must divide)")
    parallel_parts: Literal["auto"] | PositiveInt = Field(
        "auto", description="parts each micro-batch is computed in side by side: independent parts of one program, "
        "their gradients summed (XLA's CPU runtime runs independent ops on separate threads, and most of a small "
        "model's ops on one); each part's gradients are alive before the sum (memory), and the program compiles "
        "longer; 'auto': on CPU devices 4 for a micro-batch of >= 40 GFLOP a device whose rows split in four, for "
        "models of <= 30 M parameters, else 2 for >= 4 GFLOP whose rows split in two, for <= 100 M parameters, else "
        "1; always 1 for a model with scan_layers (jaxformer.train.step.AUTO_PARTS)")
    z_loss: float = Field(0.0, ge=0.0)
    muon_momentum: float = Field(0.95, ge=0.0, lt=1.0, description="name='muon': Nesterov momentum")
    muon_rms: float = Field(0.2, gt=0.0, description="name='muon': update RMS per unit lr (AdamW's is ~0.2)")


class ScheduleConfig(_Section):
    """Linear warmup from 0 to ``optimizer.lr``, then ``kind`` down to ``min_lr_ratio * lr``."""

    kind: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    decay_steps: int | None = Field(None, gt=0, description="None: the run's total steps")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _check(self):
        if self.kind != "constant" and self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"decay_steps={self.decay_steps} counts the warmup's steps too, so it must exceed "
                             f"warmup_steps={self.warmup_steps} (else the rate drops to min_lr_ratio * lr as "
                             f"the warmup ends)")
        return self


class MeshConfig(_Section):
    """Device mesh ``(data, fsdp, tensor)``; one size may be -1 (all remaining devices)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    distributed: bool = Field(False, description="call jax.distributed.initialize() first")
    coordinator_address: str | None = None
    num_processes: int | None = Field(None, gt=0)
    process_id: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _check(self):
        sizes = (self.data, self.fsdp, self.tensor)
        if sum(s == -1 for s in sizes) > 1:
            raise ValueError(f"at most one mesh axis may be -1, got (data, fsdp, tensor)={sizes}")
        if any(s == 0 or s < -1 for s in sizes):
            raise ValueError(f"mesh sizes must be positive or -1, got (data, fsdp, tensor)={sizes}")
        return self

    def shape(self, n_devices: int) -> tuple[int, int, int]:
        """The concrete ``(data, fsdp, tensor)`` sizes for ``n_devices`` devices."""
        sizes = [self.data, self.fsdp, self.tensor]
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if n_devices % known:
                raise ValueError(f"mesh (data, fsdp, tensor)={tuple(sizes)}: {n_devices} devices "
                                 f"not divisible by {known}")
            sizes[sizes.index(-1)] = n_devices // known
        elif known > n_devices:
            raise ValueError(f"mesh (data, fsdp, tensor)={tuple(sizes)} needs {known} devices, "
                             f"only {n_devices} present")
        return tuple(sizes)


class CheckpointConfig(_Section):
    every: int = Field(500, gt=0, description="save every N steps (and always at the end)")
    keep: int = Field(3, gt=0, description="keep the last K checkpoints")
    async_save: bool = True


class LoggingConfig(_Section):
    every: int = Field(10, gt=0, description="write a metrics row every N steps")
    layer_grad_norms: bool = Field(False, description="add grad_norm_layers (each block's gradient norm, "
                                   "first block first) to the train rows")
    progress: bool = True
    tensorboard: bool = True
    peak_tflops: float | None = Field(None, gt=0.0, description="per-device peak for the mfu column (None: the "
                                      "datasheet bf16 peak of known GPUs/TPUs, a measured fp32 matmul on CPU)")


class SampleConfig(_Section):
    prompt: str = "def "
    max_new_tokens: int | None = Field(None, ge=0, description="None: until the model's context is full "
                                       "(generation always stops there)")
    temperature: float = Field(0.8, ge=0.0)
    top_k: int | None = Field(None, gt=0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)


class EvalConfig(_Section):
    every: int | None = Field(None, gt=0, description="evaluate every N steps (None: only at the end)")
    at_end: bool = True
    max_tokens: int | None = Field(65536, gt=0, description="validation tokens per evaluation (None: all)")
    final_max_tokens: int | None = Field(None, gt=0, description="the final evaluation (None: all)")
    batch_size: int | None = Field(None, gt=0, description="None: the training batch size")
    stride: int | None = Field(None, gt=0, description="sliding-window evaluation: windows of seq_len "
                               "tokens this far apart, each after the first scoring only its last `stride` "
                               "(None: seq_len, no overlap)")
    compare_compressors: bool = Field(False, description="report gzip -9 / xz -9e bits per byte too")
    sample: SampleConfig | None = None


HF_TOP_OVERRIDES = ("remat", "scan_layers", "max_seq_len", "compute_dtype", "param_dtype")
"""The top-level ModelConfig fields a ``model: {hf: DIR}`` block may set (they leave the weights as they are)."""
HF_MODEL_OVERRIDES = ("attention.impl", *HF_TOP_OVERRIDES)
"""The ModelConfig fields ``model: {hf: DIR, ...}`` may set: none of them changes the checkpoint's weights
(``scan_layers`` only their layout). ``attention.impl`` is :class:`HFModelConfig`'s ``attention_impl``."""


def _resolve_path(value: str, info: ValidationInfo) -> str:
    """``value`` made absolute against the config file's directory (``context["base_dir"]``, else the cwd)."""
    path = Path(value).expanduser()
    if not path.is_absolute():
        base = (info.context or {}).get("base_dir")
        path = Path(base or ".") / path
    return os.path.abspath(path)


class HFModelConfig(_Section):
    """``model: {hf: DIR, ...}``: a Hugging Face checkpoint directory and the fields changed beside it."""

    hf: str = Field(description="a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer)")
    attention_impl: AttentionImpl | None = Field(None, description="attention.impl (written either way)")
    remat: bool | None = None
    scan_layers: bool | None = None  # the checkpoint's per-layer weights are stacked at step 0
    max_seq_len: int | None = Field(None, gt=0)
    compute_dtype: Dtype | None = None
    param_dtype: Dtype | None = None
    lora: LoRAConfig | None = Field(None, description="train low-rank adapters on the frozen checkpoint")
    adapter: str | None = Field(None, description="a peft adapter directory to continue training (its "
                                "adapter_config.json gives the LoRA settings)")

    @model_validator(mode="before")
    @classmethod
    def _fixed_fields(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        v = dict(v)
        attention = v.pop("attention", None)  # the section's one settable field: attention.impl
        if isinstance(attention, dict):
            attention = dict(attention)
            if "impl" in attention:
                v["attention_impl"] = attention.pop("impl")
            fixed = [f"attention.{k}" for k in attention]
        else:
            fixed = [] if attention is None else ["attention"]
        fixed += [k for k in v if k not in cls.model_fields and (k in ModelConfig.model_fields or k in FLAT_KEYS)]
        if fixed:
            allowed = ", ".join(HF_MODEL_OVERRIDES)
            raise ValidationError.from_exception_data("HFModelConfig", [
                {"type": PydanticCustomError(
                    "hf_fixed", "is fixed by the checkpoint's config.json (model.hf); beside hf only "
                    "{allowed} may be set", {"allowed": allowed}), "loc": tuple(k.split(".")), "input": k}
                for k in fixed])
        return v

    @field_validator("hf", mode="after")
    @classmethod
    def _check_dir(cls, v: str, info: ValidationInfo) -> str:
        from jaxformer.interop.hf import config_from_hf, config_where, read_config

        path = _resolve_path(v, info)
        try:
            config_from_hf(read_config(path), config_where(path))
        except (FileNotFoundError, ValueError) as e:  # ValueError: HFConfigError
            raise ValueError(str(e)) from None
        return path

    @field_validator("adapter", mode="after")
    @classmethod
    def _adapter_path(cls, v: str | None, info: ValidationInfo) -> str | None:
        return None if v is None else _resolve_path(v, info)

    def resolve(self) -> ModelConfig:
        """The checkpoint's ModelConfig (float32 unless set) with the fields set here (``lora``: as given, or
        as ``adapter``'s ``adapter_config.json`` says)."""
        from jaxformer.interop.hf import config_from_hf, read_config

        model = config_from_hf(read_config(self.hf), str(Path(self.hf) / "config.json"),
                               dtype=self.param_dtype or "float32")
        fields = ("attention_impl", *HF_TOP_OVERRIDES)
        changes = {k: getattr(self, k) for k in fields if getattr(self, k) is not None}
        if model.positions.kind == "learned" and changes.get("max_seq_len", model.max_seq_len) != model.max_seq_len:
            raise ValidationError.from_exception_data("HFModelConfig", [{"type": PydanticCustomError(
                "hf_fixed", "positions.kind='learned': the checkpoint's position table has {n} rows; it cannot change",
                {"n": model.max_seq_len}), "loc": ("max_seq_len",), "input": self.max_seq_len}])
        if self.adapter is not None:
            if self.lora is not None:
                raise ValidationError.from_exception_data("HFModelConfig", [{"type": PydanticCustomError(
                    "hf_fixed", "give lora (a new adapter) or adapter (a peft adapter to continue), not both: the "
                    "adapter's adapter_config.json sets rank, alpha, dropout and targets", {}), "loc": ("lora",),
                    "input": self.lora}])
            from jaxformer.interop.peft import read_adapter_config

            try:
                changes["lora"] = read_adapter_config(self.adapter, model)
            except (FileNotFoundError, ValueError) as e:  # ValueError: PeftAdapterError
                raise ValidationError.from_exception_data("HFModelConfig", [{"type": PydanticCustomError(
                    "peft", "{message}", {"message": str(e)}), "loc": ("adapter",), "input": self.adapter}]) from None
        elif self.lora is not None:
            changes["lora"] = self.lora
        if not changes:
            return model
        return model.replace(**changes)


class ExperimentConfig(_Section):
    """A whole experiment. ``model`` may be ``{preset: NAME, **overrides}``, full fields or ``{hf: DIR, ...}``."""

    seed: int = 0
    steps: int = Field(1000, gt=0)
    batch_size: int = Field(32, gt=0)
    seq_len: int = Field(256, gt=1)
    model: ModelConfig
    hf_source: str | None = Field(None, description="the Hugging Face checkpoint directory the run starts from "
                                  "(set by model: {hf: DIR}): its parameters at step 0, its tokenizer; with "
                                  "model.lora the frozen base, read from there on every resume")
    adapter_source: str | None = Field(None, description="the peft adapter a LoRA run starts from (set by "
                                       "model: {hf: DIR, adapter: PEFT_DIR}): its weights at step 0")
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    eval: EvalConfig = EvalConfig()

    @model_validator(mode="before")
    @classmethod
    def _hf_model(cls, raw: Any) -> Any:
        """``model: {hf: DIR}`` also sets ``hf_source`` and defaults ``data.tokenizer`` to ``hf``."""
        if not (isinstance(raw, dict) and isinstance(raw.get("model"), dict) and "hf" in raw["model"]):
            return raw
        raw = dict(raw)
        if raw.get("hf_source") is None:
            raw["hf_source"] = raw["model"]["hf"]
        if raw.get("adapter_source") is None and raw["model"].get("adapter") is not None:
            raw["adapter_source"] = raw["model"]["adapter"]
        data = raw.get("data")
        if data is None or (isinstance(data, dict) and "tokenizer" not in data and data.get("source") != "bin"):
            raw["data"] = {**(data or {}), "tokenizer": "hf"}
        return raw

    @field_validator("hf_source", "adapter_source", mode="after")
    @classmethod
    def _absolute(cls, v: str | None, info: ValidationInfo) -> str | None:
        return None if v is None else _resolve_path(v, info)

    @field_validator("model", mode="before")
    @classmethod
    def _resolve_preset(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, dict) and "hf" in v:
            if "preset" in v:
                raise ValueError("give either hf (a Hugging Face checkpoint) or preset, not both")
            return HFModelConfig.model_validate(v, context=info.context).resolve()
        if isinstance(v, dict) and "preset" in v:
            v = dict(v)
            name = v.pop("preset")
            if name not in presets.names():
                raise ValueError(f"unknown preset {name!r}; known: {', '.join(presets.names())}")
            v = merge(presets.get(name).model_dump(), v)
        return v

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo):
        m = self.model
        planning = bool(info.context and info.context.get("planning"))
        if m.kind != "decoder" and not planning:
            raise ValueError(f"training supports model.kind='decoder' (a causal LM), got {m.kind!r}")
        if self.seq_len > m.max_seq_len:
            raise ValueError(f"seq_len={self.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
        accum, parts = self.optimizer.grad_accum, self.optimizer.parallel_parts
        if self.batch_size % accum:
            raise ValueError(f"batch_size={self.batch_size} not divisible by optimizer.grad_accum={accum}")
        if parts != "auto" and self.batch_size // accum % parts:
            raise ValueError(f"micro-batch batch_size/optimizer.grad_accum={self.batch_size}/{accum}="
                             f"{self.batch_size // accum} not divisible by optimizer.parallel_parts={parts}")
        if self.eval.stride is not None and self.eval.stride > self.seq_len:
            raise ValueError(f"eval.stride={self.eval.stride} exceeds seq_len={self.seq_len}")
        tok = self.data.tokenizer
        if self.hf_source is not None and self.data.source != "bin" and tok != "hf":
            raise ValueError(f"data.tokenizer={tok!r} conflicts with model.hf: a checkpoint is trained on with its "
                             f"own tokenizer; leave data.tokenizer unset or set it to 'hf'")
        if tok == "hf" and self.hf_source is None:
            raise ValueError("data.tokenizer='hf' is the tokenizer of a Hugging Face checkpoint; "
                             "give model: {hf: DIR}")
        if m.lora is not None and self.hf_source is None and not planning:
            raise ValueError("model.lora adapts a pretrained model: give model: {hf: DIR, lora: {...}} (training "
                             "adapters on a random base is not a LoRA run)")
        if self.adapter_source is not None and m.lora is None:
            raise ValueError(f"adapter_source={self.adapter_source!r} needs model.lora (the adapter's settings)")
        return self


# -- loading ----------------------------------------------------------------------------------

def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _section(annotation) -> type[BaseModel] | None:
    """The config section class a field holds (``SampleConfig | None`` -> SampleConfig), if any."""
    for t in (annotation, *typing.get_args(annotation)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def known_keys(loc: tuple, schema: type[BaseModel] | None = None) -> list[str]:
    """The keys the section at ``loc`` (a dotted key's parts, the key itself last) of ``schema`` (default
    :class:`ExperimentConfig`) accepts; [] if unknown."""
    section: type[BaseModel] | None = schema or ExperimentConfig
    for part in loc[:-1]:
        field = section.model_fields.get(part) if isinstance(part, str) else None
        section = None if field is None else _section(field.annotation)
        if section is None:
            return []
    names = list(section.model_fields)
    if section is ModelConfig:  # the model section may also be a preset, or a checkpoint with its few fields
        names += ["preset"] + [k for k in HFModelConfig.model_fields if k not in names]
    return names


def _unknown_key(loc: tuple, schema: type[BaseModel] | None) -> str:
    """``unknown key`` and, when one is close (difflib), ``; did you mean model.d_model?``."""
    key = loc[-1] if loc else None
    close = difflib.get_close_matches(key, known_keys(loc, schema), n=1) if isinstance(key, str) else []
    return "unknown key" + (f"; did you mean {_dotted((*loc[:-1], close[0]))}?" if close else "")


def _from_override(loc: tuple, etype: str, overrides) -> str | None:
    """The last ``key.sub=value`` override that set the value at ``loc`` (or, for an unknown key, created
    it), if any: the command line, not the file, is where that error was made."""
    for text in reversed(list(overrides)):
        parts = tuple(parse_override(text)[0])
        if loc[:len(parts)] == parts or (etype == "extra_forbidden" and parts[:len(loc)] == loc):
            return text
    return None


def _overrides_under(loc: tuple, overrides, msg: str) -> list[str]:
    """The ``key.sub=value`` overrides that set a key at or under ``loc`` (a model's flat key, e.g.
    ``model.n_kv_heads``, read as its section's, ``model.attention.n_kv_heads``, as :func:`parse_override` reads
    it); at the top level (``loc`` empty) only those whose key ``msg`` names."""
    out = []
    for text in overrides:
        parts = tuple(parse_override(text)[0])
        if parts[:len(loc)] == loc and (loc or ".".join(parts) in msg):
            out.append(text)
    return out


def format_errors(err: ValidationError, source: str, overrides=(), *, schema: type[BaseModel] | None = None) -> str:
    """``source: dotted.key: message`` per error, one per line; an error at a key a ``key.sub=value``
    override set names the override instead of ``source``; an error of a whole section (values checked
    against each other) that overrides set keys in names them after the message; an unknown key gets the
    closest known one of ``schema`` (the model validated: default :class:`ExperimentConfig`)."""
    lines = []
    for e in err.errors(include_url=False):
        loc = tuple(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = _unknown_key(loc, schema)
        override = _from_override(loc, e["type"], overrides) if loc else None
        where = source if override is None else f"override {override!r}"
        key = _dotted(loc)
        line = f"{where}: {key}: {msg}" if key else f"{where}: {msg}"
        given = _overrides_under(loc, overrides, msg) if override is None else []
        if given:
            line += f" (with the override{'s' * (len(given) > 1)} {', '.join(map(repr, given))})"
        lines.append(line)
    return "\n".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optimizer.lr=3e-4"`` -> ``(["optimizer", "lr"], 3e-4)``; the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not key.sub=value (e.g. optimizer.lr=3e-4)")
    key, _, raw = text.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not YAML: {e}") from None
    return model_key(parts, value), value


def model_key(parts: list[str], value: Any = None) -> list[str]:
    """A dotted key's parts with a flat model key of before the sections moved into its section
    (``model.n_heads`` -> ``model.attention.n_heads``; see :data:`jaxformer.model.config.FLAT_KEYS`)."""
    if len(parts) == 2 and parts[0] == "model" and (where := flat_key(parts[1], value)) is not None:
        return ["model", *where]
    if len(parts) > 2 and parts[0] == "model" and parts[1] != "norm" and parts[1] in FLAT_KEYS:
        return ["model", *FLAT_KEYS[parts[1]], *parts[2:]]  # model.rope_scaling.factor, ...
    return list(parts)


def migrate_model(raw: dict, where: str) -> None:
    """Move the flat keys of before the sections in ``raw["model"]`` (a raw experiment mapping) into their
    sections, in place; ConfigError starting with ``where`` for a value given both ways."""
    if isinstance(raw.get("model"), dict):
        try:
            raw["model"] = migrate(raw["model"])
        except ValueError as e:
            raise ConfigError(f"{where}: model: {e}") from None


def set_key(raw: dict, parts: list[str], value: Any, where: str) -> None:
    """Set ``value`` at the dotted key ``parts`` of the raw mapping ``raw`` (creating sections as needed; a
    model key in its section, with the raw model's flat keys moved first, so old and new spellings mix);
    ``where`` starts the error message."""
    parts = model_key(parts, value)
    if parts[0] == "model" and len(parts) > 1:
        migrate_model(raw, where)
    node = raw
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"{where}: {p!r} is not a section")
        node = child
    node[parts[-1]] = value


def apply_overrides(raw: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """A copy of ``raw`` with each ``key.sub=value`` set (creating sections as needed)."""
    out = _deepcopy(raw)
    for text in overrides:
        parts, value = parse_override(text)
        set_key(out, parts, value, f"override {text!r}")
    return out


def _deepcopy(x):
    if isinstance(x, dict):
        return {k: _deepcopy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_deepcopy(v) for v in x]
    return x


def from_dict(raw: Any, source: str = "<config>", overrides=(), *, planning: bool = False,
              base_dir: str | Path | None = None) -> ExperimentConfig:
    """Validate a raw mapping (plus overrides); errors name ``source`` and the dotted key.

    ``planning``: for ``jaxformer info``, which sizes encoder and encoder-decoder models too;
    only training needs ``model.kind='decoder'``. ``base_dir``: what relative paths in the
    config (``model.hf``) are relative to (default: the working directory).
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(raw).__name__}")
    overrides = list(overrides)
    raw = apply_overrides(raw, overrides)
    try:
        return ExperimentConfig.model_validate(raw, context={"planning": planning, "base_dir": base_dir})
    except ValidationError as e:
        raise ConfigError(format_errors(e, source, overrides)) from None


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that gives one key twice (YAML 1.2 forbids it; PyYAML keeps the
    last, which would drop a whole section of an experiment file without a word)."""


def _mapping_once(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    first: dict = {}
    for key_node, _ in node.value:  # the keys as written ("<<" merges, which they may override, not among them)
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key, line = loader.construct_object(key_node, deep=deep), key_node.start_mark.line + 1
        try:
            seen = first.get(key)
        except TypeError:  # an unhashable key: construct_mapping says so below
            continue
        if seen is not None:
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} on line {line} given twice (first "
                                                                f"on line {seen})")
        first[key] = line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_once)


def load_yaml(text: str) -> Any:
    """``text`` parsed as YAML by the safe loader, a key given twice in one mapping an error
    (:class:`yaml.YAMLError`, naming both lines)."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


def load(path: str | Path, overrides=(), *, planning: bool = False) -> ExperimentConfig:
    """Read and validate a YAML experiment file (``planning``: as :func:`from_dict`)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    try:
        raw = load_yaml(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return from_dict(raw, str(path), overrides, planning=planning, base_dir=path.parent)


def to_dict(cfg: ExperimentConfig) -> dict:
    """The resolved config as plain data (the model with every field)."""
    return cfg.model_dump(mode="json")


def dump(cfg: ExperimentConfig, path: str | Path) -> None:
    """Write the resolved config atomically (a temporary file renamed over ``path``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    os.replace(tmp, path)


SOURCE_KEYS = ("hf_source", "adapter_source")  # where a run's checkpoint was read: a path on one machine


def diff(a: BaseModel, b: BaseModel, *, located: bool = True) -> list[tuple[str, Any, Any]]:
    """``(dotted key, value in a, value in b)`` wherever two configs (experiment or model) differ, keys sorted.

    ``located=False``: the :data:`SOURCE_KEYS` (absolute paths, resolved where the config was read) compare by
    file or directory name only, so a config saved in a checkout elsewhere (another machine, CI's clone) is
    the same experiment. The architecture read from the checkpoint is still compared (``model.*``), its weights
    are not: two checkpoints of one name and one architecture in different folders are not told apart (a row
    holds no fingerprint of the weights)."""
    out: list[tuple[str, Any, Any]] = []

    def walk(x, y, prefix):
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y)):
                walk(x.get(k), y.get(k), f"{prefix}.{k}" if prefix else k)
        elif not located and prefix in SOURCE_KEYS and isinstance(x, str) and isinstance(y, str):
            if Path(x).name != Path(y).name:
                out.append((prefix, x, y))
        elif x != y:
            out.append((prefix, x, y))

    walk(a.model_dump(mode="json"), b.model_dump(mode="json"), "")
    return out
