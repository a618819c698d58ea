"""A run directory: what a run leaves there, what a new config may do to it, and reading it back.

``RUN_DIR`` holds ``config.yaml`` (the resolved config), ``checkpoints/`` (orbax),
``metrics.jsonl`` (+ ``tb/``), for a BPE run ``tokenizer.json``, and for a run from a Hugging
Face checkpoint ``hf_source/`` (its config.json and tokenizer files). A resume compares
the new config with the saved one: a checkpoint whose arrays do not fit is refused naming
the keys that changed, a change of trajectory only warns, a run past ``steps`` is refused
and a finished one is left as it is. All of that is decided from the run's files and its
newest checkpoint (:func:`saved_step`), before the corpus and tokenizer are built, and nothing
is written until it is known (:func:`write_run_files`). :func:`load_run` reads a run back for
``jaxformer eval`` and ``jaxformer generate``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path

import jax

from jaxformer.train import config as C
from jaxformer.train import sharding as shd
from jaxformer.train.checkpoint import Checkpointer, IncompatibleCheckpointError
from jaxformer.train.metrics import read_metrics
from jaxformer.train.step import Trainer, make_trainer
from jaxformer.train.tokenizers import BPETokenizer, ByteTokenizer, HFTextTokenizer

TRAJECTORY = ("seed", "batch_size", "seq_len", "model", "data", "optimizer", "schedule")
"""Config sections whose change alters the training trajectory (a resume warns about them)."""


# -- a run from a Hugging Face checkpoint keeps its config.json and tokenizer in RUN/hf_source/

HF_SOURCE = "hf_source"
"""The run directory's copy of the checkpoint's config.json and tokenizer files."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "source.spm", "target.spm",
                   "chat_template.jinja", "chat_template.json")
COPIED = ("config.json", "generation_config.json", *TOKENIZER_FILES)


def source_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / HF_SOURCE


def from_gguf_file(cfg: C.ExperimentConfig) -> bool:
    """Whether ``model.hf`` names a file (a GGUF base), not a checkpoint directory: nothing to copy, its tokenizer
    read from the file."""
    return cfg.hf_source is not None and Path(cfg.hf_source).is_file()


def tokenizer_dir(cfg: C.ExperimentConfig, run_dir: str | Path) -> Path:
    """Where a run from ``model.hf`` reads its tokenizer: its own copy once made, else the checkpoint (a GGUF
    file always: it holds its tokenizer, and no copy is made)."""
    copy = source_dir(run_dir)
    return copy if copy.is_dir() and not from_gguf_file(cfg) else Path(cfg.hf_source)


def copy_files(src: str | Path, dst: str | Path, names=COPIED) -> list[str]:
    """Copy the files of ``names`` that ``src`` has into ``dst`` (created); returns the names copied."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    done = []
    for name in names:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            done.append(name)
    return done


def copy_source(cfg: C.ExperimentConfig, run_dir: str | Path) -> None:
    """``RUN/hf_source/``: the checkpoint's config.json and tokenizer files (once; atomically); none for a GGUF
    file, which has no such files (its tokenizer is read from it)."""
    dst = source_dir(run_dir)
    if cfg.hf_source is None or dst.is_dir() or from_gguf_file(cfg):
        return
    tmp = dst.with_name(f".{HF_SOURCE}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    copy_files(cfg.hf_source, tmp)
    os.replace(tmp, dst)


def tokenizer_path(cfg: C.ExperimentConfig, run_dir: Path) -> Path | None:
    """Where the run keeps its trained tokenizer (BPE), or reads a checkpoint's (``hf``: its
    ``hf_source/`` copy once made, the checkpoint directory before)."""
    if cfg.data.tokenizer == "hf":
        return tokenizer_dir(cfg, Path(run_dir))
    return run_dir / "tokenizer.json" if cfg.data.tokenizer == "bpe" else None


def saved_tokenizer_path(cfg: C.ExperimentConfig, run_dir: Path) -> Path | None:
    """:func:`tokenizer_path` if the run already saved its tokenizer there, else None."""
    path = tokenizer_path(cfg, run_dir)
    return path if path is not None and path.exists() else None


def changed_keys(cfg: C.ExperimentConfig, run_dir: Path) -> list[tuple[str, object, object]]:
    """``(dotted key, saved value, new value)`` where ``cfg`` differs from ``RUN_DIR/config.yaml`` (if any)."""
    saved = run_dir / "config.yaml"
    return C.diff(C.load(saved), cfg) if saved.exists() else []


def refuse_stale_tokenizer(cfg: C.ExperimentConfig, run_dir: Path, changed) -> None:
    """ValueError if the run saved a BPE tokenizer and ``cfg`` asks another ``data.bpe_vocab_size`` than it was
    trained with (``changed``: :func:`changed_keys`): the run would go on with its own tokenizer while the
    resolved config it writes claimed the new size."""
    saved = saved_tokenizer_path(cfg, run_dir)
    sizes = [(a, b) for k, a, b in changed if k == "data.bpe_vocab_size"]
    if cfg.data.tokenizer == "bpe" and saved is not None and sizes:
        (was, now), = sizes
        raise ValueError(f"{saved} was trained with data.bpe_vocab_size={was} (the run's config.yaml); this config "
                         f"asks {now}, and a run keeps its tokenizer: nothing was changed. Resume with "
                         f"data.bpe_vocab_size={was}, or give a new --run-dir.")


def describe_changes(changed, keys=None) -> str:
    return ", ".join(f"{k} (saved {a!r}, now {b!r})" for k, a, b in changed if keys is None or k in keys)


@contextlib.contextmanager
def _refusing_misfits(run_dir: Path, changed):
    """An IncompatibleCheckpointError inside names the keys of ``changed`` that shape the arrays."""
    try:
        yield
    except IncompatibleCheckpointError as e:
        if not changed:
            raise
        shaping = [k for k, _, _ in changed if k.split(".")[0] in ("model", "optimizer")] or None
        raise IncompatibleCheckpointError(
            f"{run_dir} holds a run whose arrays do not fit this config, which differs from the run's "
            f"config.yaml in {describe_changes(changed, shaping)}; nothing was changed. Use a new --run-dir, "
            f"or resume with the run's own config.") from e


def saved_step(ckpt: Checkpointer, trainer: Trainer, run_dir: Path, changed) -> int | None:
    """The step of the newest checkpoint, from its metadata alone (no arrays, no data: known before the
    corpus is built), or None; a checkpoint that does not fit is refused as by :func:`restore`."""
    with _refusing_misfits(run_dir, changed):
        meta = ckpt.latest_meta(trainer.abstract_state)
    return None if meta is None else int(meta["step"])


class UnrestorableRunError(ValueError):
    """A run directory whose checkpoints are all unreadable: neither resumed nor started over."""


def refuse_unreadable_only(ckpt: Checkpointer, run_dir: Path) -> None:
    """Raise :class:`UnrestorableRunError` if ``ckpt``'s directory holds checkpoints set aside as unreadable
    (``STEP.corrupt``) and none that restores: training from step 0 there would overwrite the run's metrics
    and start from a data position its failed restores had moved, so the user decides."""
    aside = sorted(p.name for p in ckpt.directory.glob("*.corrupt")) if ckpt.directory.is_dir() else []
    if aside:
        raise UnrestorableRunError(
            f"{run_dir}: no checkpoint restores (set aside as unreadable: {', '.join(aside)} in {ckpt.directory}); "
            f"nothing else was changed. To train from step 0 in this directory remove {ckpt.directory} and "
            f"{run_dir / 'metrics.jsonl'}, or give a new --run-dir.")


def restore(ckpt: Checkpointer, trainer: Trainer, data_iter, run_dir: Path, changed) -> tuple | None:
    """``(state, meta)`` of the newest readable checkpoint (``data_iter`` restored too), or None when the run
    has no checkpoint.

    A checkpoint that does not fit the new config is refused naming what ``changed``
    (:func:`changed_keys`); a resume across a trajectory change warns; a run whose every checkpoint is
    unreadable is refused (:func:`refuse_unreadable_only`), not started over.
    """
    with _refusing_misfits(run_dir, changed):
        restored = ckpt.restore_latest(trainer.abstract_state, trainer.state_shardings, data_iter)
    if restored is None:
        refuse_unreadable_only(ckpt, run_dir)
    trajectory = [k for k, _, _ in changed if k.split(".")[0] in TRAJECTORY and k != "steps"]
    if restored is not None and trajectory:
        warnings.warn(f"{run_dir}: config differs from the saved run in {describe_changes(changed, trajectory)}; "
                      f"continuing with the new values", RuntimeWarning, stacklevel=3)
    return restored


def last_train_row(run_dir: Path, step: int) -> dict:
    """The train row ``metrics.jsonl`` holds for ``step`` (empty if none)."""
    rows = [r for r in read_metrics(run_dir) if "loss" in r and r.get("step") == step]
    return rows[-1] if rows else {}


def finished_summary(cfg: C.ExperimentConfig, run_dir: Path, step: int, *, can_evaluate: bool = True) -> dict | None:
    """The recorded results of a run at ``step >= cfg.steps``, or None if its final evaluation is missing.

    A run past ``cfg.steps`` is refused (training cannot go backwards, and its files stay as they are).
    Only a final evaluation counts (rows ``"final": true``; a periodic one at that step does not;
    rows written before the flag existed count); with no validation split none is expected.
    """
    if step > cfg.steps:
        raise ValueError(f"{run_dir} is already at step {step}, past steps={cfg.steps}; nothing was changed. "
                         f"Give --steps above {step} to train further, or a new --run-dir to start over.")
    final = [r for r in read_metrics(run_dir) if "val_loss" in r and r.get("step") == step and r.get("final", True)]
    if cfg.eval.at_end and can_evaluate and not final:
        return None  # stopped between the last checkpoint and the final evaluation: do that evaluation now
    ev = {k: v for k, v in final[-1].items() if k != "final"} if final else {}
    return {**last_train_row(run_dir, step), **ev, "step": step}


def write_run_files(cfg: C.ExperimentConfig, run_dir: Path, tokenizer) -> None:
    """Save the resolved config and a newly trained tokenizer, or the Hugging Face checkpoint's
    config.json and tokenizer files (``hf_source/``) (process 0 only)."""
    if jax.process_index() != 0:
        return
    C.dump(cfg, run_dir / "config.yaml")
    if cfg.hf_source is not None:
        copy_source(cfg, run_dir)
    if cfg.model.lora is not None:  # the base's path and weights' hash: later reads refuse another base
        from jaxformer.train.lora import record_base

        record_base(cfg, run_dir)
    path = tokenizer_path(cfg, run_dir)
    if cfg.data.tokenizer == "bpe" and not path.exists():
        tokenizer.save(path)


def config_path(run_dir: str | Path) -> Path:
    """``RUN_DIR/config.yaml``; FileNotFoundError saying which is missing, the directory or its config."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise FileNotFoundError(f"no such run directory: {run_dir}")
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    return path


def load_run(run_dir: str | Path, overrides=()):
    """``(cfg, trainer, params, tokenizer, meta)`` from a run directory's config and newest checkpoint."""
    run_dir = Path(run_dir)
    cfg = C.load(config_path(run_dir), overrides)
    mesh = shd.make_mesh(cfg.mesh)
    trainer = make_trainer(cfg, mesh)
    restored = Checkpointer(run_dir / "checkpoints", read_only=True).restore_latest(
        trainer.abstract_state, trainer.state_shardings)
    if restored is None:
        raise FileNotFoundError(f"no readable checkpoint in {run_dir / 'checkpoints'}")
    state, meta = restored
    if cfg.model.lora is not None:  # the frozen base, from where the run recorded it (refused if moved or changed)
        from jaxformer.train.lora import attach_base

        attach_base(cfg, trainer, run_dir)
    return cfg, trainer, trainer.model_params(state), run_tokenizer(cfg, run_dir), meta


def run_tokenizer(cfg: C.ExperimentConfig, run_dir: Path):
    """The tokenizer a run was trained with (None for pre-tokenized ``bin`` data)."""
    if cfg.data.source == "bin":
        return None
    if cfg.data.tokenizer == "hf":
        return HFTextTokenizer.load(tokenizer_path(cfg, run_dir))
    if cfg.data.tokenizer == "bpe":
        return BPETokenizer.load(run_dir / "tokenizer.json")
    return ByteTokenizer()


def load_hf_decoder(path: str | Path, *, dtype: str, command: str):
    """``(model config, graphdef, state, tokenizer)`` of a decoder-only Hugging Face checkpoint (or GGUF file);
    another kind of model is refused naming its type (:func:`jaxformer.interop.hf.check_kind`)."""
    from jaxformer.interop.hf import check_kind, load_pretrained

    check_kind(path, "decoder", command)
    config, graphdef, state = load_pretrained(path, dtype=dtype)
    return config, graphdef, state, HFTextTokenizer.load(path)


def check_source(run_dir, *, hf=None, adapter=None, command: str) -> None:
    """A command's model source: exactly one of a run directory and ``--hf DIR``; ``--adapter`` only with
    ``--hf`` (a LoRA run's own adapter is in its checkpoints). ValueError saying which rule was broken."""
    if (run_dir is None) == (hf is None):
        raise ValueError(f"{command}: give a run directory or --hf DIR (a Hugging Face checkpoint), not "
                         + ("both" if hf is not None else "neither"))
    if adapter is not None and hf is None:
        raise ValueError(f"{command}: --adapter PEFT_DIR goes with --hf DIR (the base it adapts); a LoRA run "
                         f"directory applies its own adapter")


def load_decoder(run_dir: str | Path | None, *, hf: str | Path | None = None, adapter: str | Path | None = None,
                 dtype: str = "float32", command: str = "generate"):
    """``(model config, graphdef, params, tokenizer, name)`` of the decoder ``generate`` and ``serve`` run: a
    run directory's newest checkpoint, or the checkpoint ``hf`` (with the peft adapter ``adapter`` merged in)."""
    check_source(run_dir, hf=hf, adapter=adapter, command=command)
    if hf is None:
        cfg, trainer, params, tok, _ = load_run(run_dir)
        if tok is None:
            raise ValueError(f"{run_dir}: source='bin' has no text tokenizer to encode prompts")
        return cfg.model, trainer.graphdef, params, tok, Path(run_dir).resolve().name
    model, graphdef, params, tok = load_hf_decoder(hf, dtype=dtype, command=command)
    name = Path(hf).stem if Path(hf).is_file() else Path(hf).resolve().name
    if adapter is not None:  # merged into the kernels: the base model's graphdef computes the adapted model
        from jaxformer.interop.peft import load_adapter

        params = load_adapter(adapter, model, params)
        name = f"{name}+{Path(adapter).resolve().name}"
    return model, graphdef, params, tok, name


def format_summary(summary: dict, run_dir: Path) -> str:
    """The end of a training run in a few lines: the results, then where everything was written."""
    head = [f"step {summary['step']:,}"]
    if summary.get("loss") is not None:
        head.append(f"train loss {summary['loss']:.4f}")
    if "val_loss" in summary:
        head.append(f"val loss {summary['val_loss']:.4f}")
    if "val_bpb" in summary:
        bpb = f"val {summary['val_bpb']:.4f} bits/byte"
        if "gzip9_bpb" in summary:
            bpb += f" (gzip -9 {summary['gzip9_bpb']:.4f}, xz -9e {summary['xz9e_bpb']:.4f})"
        head.append(bpb)
    if "wall_s" in summary:
        m, s = divmod(round(summary["wall_s"]), 60)
        head.append(f"{m} min {s:02d} s")
    ckpts = sorted((p for p in (run_dir / "checkpoints").glob("*") if p.name.isdigit()), key=lambda p: int(p.name))
    lines = ["done: " + " · ".join(head),
             f"  run directory  {run_dir}",
             f"  config         {run_dir / 'config.yaml'}",
             f"  metrics        {run_dir / 'metrics.jsonl'}" + (
                 f"  (TensorBoard: tensorboard --logdir {run_dir / 'tb'})" if (run_dir / "tb").exists() else ""),
             f"  checkpoints    {run_dir / 'checkpoints'}" + (
                 f"  (steps {', '.join(p.name for p in ckpts)})" if ckpts else ""),
             f"  next           jaxformer eval {run_dir}  ·  jaxformer generate {run_dir} --prompt 'def '"]
    return "\n".join(lines)
