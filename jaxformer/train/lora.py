"""LoRA training: the adapter alone is trained, the checkpoint it adapts stays frozen where it is.

``model: {hf: DIR, lora: {...}}`` (or ``adapter: PEFT_DIR``) builds the checkpoint's model with
adapters (:mod:`jaxformer.nn.lora`) and splits its state with NNX's filters: the adapter
(``nnx.LoRAParam``) is the train state's ``params``, with an optimiser state for it alone; the rest,
the frozen base (``nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))``, in ``model.param_dtype``, e.g.
bfloat16, plus the adapters' dropout keys), is :attr:`Trainer.frozen`, an argument of the jitted step
that is never differentiated, updated, donated or checkpointed. A checkpoint holds the adapter, its
optimiser state and the data state (kilobytes to megabytes); the base is read again from
``hf_source`` on every resume, eval, generate and export, and :data:`BASE_RECORD` (``RUN/base.json``,
written at step 0: the path and a SHA-256 of its weight files) makes every later read refuse, naming
the path, a base that moved or changed.

Dropout (``lora.dropout > 0``): each step draws fresh keys for every adapter from the run's rng, the
step and the micro-batch (:func:`jaxformer.train.step.dropout_keys`), so a resumed run repeats the uninterrupted one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer.nn.lora import is_dropout_key
from jaxformer.train import config as C
from jaxformer.train.step import Trainer

BASE_RECORD = "base.json"
"""``RUN/base.json``: ``{"path", "sha256", "files", "bytes"}`` of the base a LoRA run adapts."""


# -- the base's identity

def weight_files(path: str | os.PathLike) -> list[Path]:
    """The files holding a checkpoint's weights: a GGUF file, or the directory's safetensors (with the index
    of a sharded one)."""
    from jaxformer.interop.gguf import is_gguf
    from jaxformer.interop.hf import INDEX, safetensors_files

    path = Path(path)
    if is_gguf(path):
        return [path]
    index = [path / INDEX] if (path / INDEX).is_file() else []
    return index + [path / f for f in safetensors_files(path)]


def file_stats(path: str | os.PathLike) -> list[list[int]]:
    """``[size, mtime_ns]`` of each weight file of the checkpoint at ``path``: what says, without reading a
    byte, that the files are the ones hashed before."""
    return [[(st := f.stat()).st_size, st.st_mtime_ns] for f in weight_files(path)]


def base_digest(path: str | os.PathLike) -> dict:
    """``{"path", "files", "bytes", "sha256", "stats"}`` of the base checkpoint at ``path`` (its weight files'
    bytes, and their :func:`file_stats`)."""
    h, total, names = hashlib.sha256(), 0, []
    for f in weight_files(path):
        names.append(f.name)
        with open(f, "rb") as fh:
            for chunk in iter(functools.partial(fh.read, 1 << 24), b""):
                h.update(chunk)
                total += len(chunk)
    return {"path": str(path), "files": names, "bytes": total, "sha256": h.hexdigest(), "stats": file_stats(path)}


def record_base(cfg: C.ExperimentConfig, run_dir: str | Path) -> None:
    """Write ``RUN/base.json`` for a LoRA run (once: a resume keeps the record of step 0)."""
    file = Path(run_dir) / BASE_RECORD
    if file.exists():
        return
    tmp = file.with_name(f".{BASE_RECORD}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(base_digest(cfg.hf_source), indent=2) + "\n")
    os.replace(tmp, file)


def check_base(cfg: C.ExperimentConfig, run_dir: str | Path) -> None:
    """Refuse (ValueError naming the path) a base that is not the one ``RUN/base.json`` recorded: another
    path in the config, a path that is gone (moved), weights that changed. Files whose sizes and modification
    times are those recorded are taken as unchanged (a GB-sized base is not re-hashed on every command); any
    other difference re-hashes them."""
    run_dir = Path(run_dir)
    file = run_dir / BASE_RECORD
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing; a LoRA run records the base checkpoint it adapts there at "
                                "step 0 (its path and a hash of its weights)")
    rec = json.loads(file.read_text())
    path = rec["path"]
    if str(cfg.hf_source) != path:
        raise ValueError(f"{run_dir}: the config's hf_source {cfg.hf_source} is not the base this LoRA run adapts "
                         f"({path}, recorded in {file}); an adapter only fits the weights it was trained on")
    try:
        files = weight_files(path)
        missing = [str(f) for f in files if not f.is_file()]
    except (OSError, ValueError, KeyError) as e:
        missing = [f"{path} ({e})"]
    if not Path(path).exists() or missing:
        raise ValueError(f"{run_dir}: the base checkpoint {path} this LoRA run adapts is gone (moved or deleted?; "
                         f"missing: {missing or [path]}); the run's checkpoints hold the adapter only. Put the "
                         f"checkpoint back at {path}")
    if rec.get("stats") == file_stats(path):
        return  # the same files (sizes and modification times) as when hashed: not read again
    now = base_digest(path)
    if now["sha256"] != rec["sha256"]:
        raise ValueError(f"{run_dir}: the base checkpoint {path} changed since this LoRA run started (SHA-256 of "
                         f"{', '.join(rec['files'])}: recorded {rec['sha256'][:16]}..., now {now['sha256'][:16]}...); "
                         f"the adapter only fits the weights it was trained on. Restore the original checkpoint at "
                         f"{path}")


# -- the base in, the adapter at step 0

def attach_base(cfg: C.ExperimentConfig, trainer: Trainer, run_dir: str | Path | None = None) -> Trainer:
    """Read the frozen base from ``cfg.hf_source`` onto the trainer's shardings (``trainer.frozen``; the
    dropout keys zeros). With ``run_dir``, first refuse a base that is not the one the run recorded
    (:func:`check_base`). Returns the trainer."""
    from jaxformer.train.pretrained import load_checkpoint

    if run_dir is not None:
        check_base(cfg, run_dir)
    flat_sh = dict(nnx.traversals.flatten_mapping(trainer.frozen_shardings))
    keys = {p: s for p, s in flat_sh.items() if is_dropout_key(p)}
    state = load_checkpoint(cfg, cfg.model.base, nnx.traversals.unflatten_mapping(
        {p: s for p, s in flat_sh.items() if p not in keys}))
    flat = dict(nnx.traversals.flatten_mapping(nnx.to_pure_dict(state)))
    abstract = dict(nnx.traversals.flatten_mapping(trainer.train_step.frozen_abstract))
    for p, s in keys.items():
        flat[p] = jax.device_put(jnp.zeros(abstract[p].shape, abstract[p].dtype), s)
    trainer.frozen = nnx.traversals.unflatten_mapping(flat)
    return trainer


def initial_state(cfg: C.ExperimentConfig, trainer: Trainer):
    """Step 0 of a LoRA run: the base attached, the adapter fresh from ``cfg.seed`` (B = 0: the model is the
    base exactly) or read from ``cfg.adapter_source`` (a peft adapter), a fresh optimiser state."""
    attach_base(cfg, trainer)
    if cfg.adapter_source is None:
        return trainer.init_state(cfg.seed)
    from jaxformer.interop.peft import read_adapter

    lcfg, adapter = read_adapter(cfg.adapter_source, cfg.model.base)
    if lcfg.lora != cfg.model.lora:
        raise ValueError(f"{cfg.adapter_source}: adapter_config.json says {lcfg.lora}, the run's config "
                         f"{cfg.model.lora}")
    adapter = jax.tree.map(lambda a, s: jax.device_put(a, s), adapter, trainer.state_shardings["params"])
    return trainer.init_state_from(adapter, cfg.seed)


__all__ = ["BASE_RECORD", "attach_base", "base_digest", "check_base", "initial_state", "record_base",
           "weight_files"]
