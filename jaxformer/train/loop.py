"""The training loop: build, resume, step, log, evaluate, checkpoint; and the run-directory tools.

``train(cfg, run_dir)`` resumes from ``RUN_DIR/checkpoints`` when a readable
checkpoint exists. Metrics of step ``s`` are read back while step ``s+1``
runs, so the host never stalls the device except before a checkpoint, where
every pending step is checked: a non-finite loss, gradient norm or parameter
norm stops the run with :class:`NonFiniteError` naming the step, and no
checkpoint is written after it.
"""

from __future__ import annotations

import contextlib
import gzip
import lzma
import math
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import jax

from jaxformer.train import config as C
from jaxformer.train import sharding as shd
from jaxformer.train.checkpoint import Checkpointer, IncompatibleCheckpointError
from jaxformer.train.data import BPETokenizer, ByteTokenizer, build_corpus, eval_windows, TrainIterator
from jaxformer.train.metrics import MetricsWriter, ProgressBar, read_metrics
from jaxformer.train.step import Trainer, make_trainer

LN2 = math.log(2.0)


_TRAJECTORY = ("seed", "batch_size", "seq_len", "model", "data", "optimizer", "schedule")
"""Config sections whose change alters the training trajectory (a resume warns about them)."""


class NonFiniteError(RuntimeError):
    """The loss (or gradient / parameter norm) became NaN or inf."""


def _check_vocab(cfg: C.ExperimentConfig, tokenizer) -> None:
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                         f"vocabulary {tokenizer.vocab_size} ({tokenizer.name}); raise model.vocab_size")


def _tokenizer_path(cfg: C.ExperimentConfig, run_dir: Path) -> Path | None:
    return run_dir / "tokenizer.json" if cfg.data.tokenizer == "bpe" else None


def evaluate(trainer: Trainer, params, evalset, *, batch_size: int, token_bytes) -> dict:
    """Mean validation loss (nats/token) and bits per byte over ``evalset``."""
    nats, n = 0.0, 0.0
    for b in evalset.batches(batch_size):
        s, k = trainer.eval_step(params, shd.put_global_batch(b, trainer.mesh))
        nats, n = nats + float(s), n + float(k)
    out = {"val_loss": nats / max(n, 1.0), "val_tokens": int(n)}
    if token_bytes is not None:
        n_bytes = int(token_bytes[evalset.target_ids()].sum())
        out["val_bpb"] = nats / LN2 / max(n_bytes, 1)
        out["val_bytes"] = n_bytes
    return out


def compressor_bpb(data: bytes) -> dict:
    """Bits per byte of ``gzip -9`` and ``xz -9e`` on ``data``."""
    n = max(len(data), 1)
    return {
        "gzip9_bpb": 8 * len(gzip.compress(data, 9)) / n,
        "xz9e_bpb": 8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) / n,
    }


def _eval_set(cfg: C.ExperimentConfig, corpus, max_tokens):
    if len(corpus.val_stream) < 2:
        return None
    return eval_windows(corpus.val_stream, seq_len=cfg.seq_len, tokenizer=corpus.tokenizer,
                        max_tokens=max_tokens, stride=cfg.eval.stride)


def _eval_batch(cfg: C.ExperimentConfig, mesh) -> int:
    b = cfg.eval.batch_size or cfg.batch_size // cfg.optimizer.grad_accum
    shards = shd.batch_shards(mesh)
    return max(shards, b // shards * shards)


def sample_text(trainer: Trainer, params, tokenizer, *, prompt: str, max_new_tokens: int,
                temperature: float, top_k: int | None, top_p: float | None, seed: int) -> str:
    """Prompt + a continuation generated with the contiguous KV cache (``jaxformer.decode``)."""
    from jaxformer.decode.generate import generate

    ids = [tokenizer.bos_id] + [int(t) for t in tokenizer.encode(prompt)]
    out = generate(trainer.graphdef, params, trainer.cfg.model, [ids], max_new_tokens=max_new_tokens,
                   temperature=temperature, top_k=top_k or 0, top_p=top_p or 1.0, seed=seed,
                   stop_tokens=[tokenizer.eos_id])[0]
    return prompt + tokenizer.decode(out)


def train(cfg: C.ExperimentConfig, run_dir: str | Path, *,
          on_step: Callable[[int, dict], None] | None = None, console=None) -> dict:
    """Train (or resume) ``cfg`` in ``run_dir``; returns the final metrics (train, eval, baselines).

    Nothing is written into an existing run directory until its checkpoint is known to fit ``cfg``
    and ``cfg.steps`` lies at or beyond the run's step; a run that already reached ``cfg.steps``
    (and has its final evaluation) is left as it is.
    """
    t0 = time.perf_counter()
    run_dir = Path(run_dir)
    shd.maybe_initialize_distributed(cfg.mesh)
    main = jax.process_index() == 0
    changed = _changed_keys(cfg, run_dir)

    mesh = shd.make_mesh(cfg.mesh)
    tok_path = _tokenizer_path(cfg, run_dir)
    corpus = build_corpus(cfg.data, tokenizer_path=tok_path if tok_path and tok_path.exists() else None)
    tok = corpus.tokenizer
    _check_vocab(cfg, tok)
    it = TrainIterator(corpus, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed,
                       shuffle=cfg.data.shuffle, process_index=jax.process_index(),
                       process_count=jax.process_count())
    trainer = make_trainer(cfg, mesh)
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
    try:
        try:
            restored = ckpt.restore_latest(trainer.abstract_state, trainer.state_shardings, it)
        except IncompatibleCheckpointError as e:
            if not changed:
                raise
            shaping = [k for k, _, _ in changed if k.split(".")[0] in ("model", "optimizer")] or None
            raise IncompatibleCheckpointError(
                f"{run_dir} holds a run whose arrays do not fit this config, which differs from the run's "
                f"config.yaml in {_describe_changes(changed, shaping)}; nothing was changed. Use a new --run-dir, "
                f"or resume with the run's own config.") from e
        start = int(restored[1]["step"]) if restored is not None else 0
        trajectory = [k for k, _, _ in changed if k.split(".")[0] in _TRAJECTORY and k != "steps"]
        if restored is not None and trajectory:
            warnings.warn(f"{run_dir}: config differs from the saved run in {_describe_changes(changed, trajectory)}; "
                          f"continuing with the new values", RuntimeWarning, stacklevel=2)
        if restored is not None and start >= cfg.steps:
            finished = _finished_summary(cfg, run_dir, start)
            if finished is not None:
                if main:
                    (console or _plain_console()).print(
                        f"{run_dir} already finished at step {start} (steps={cfg.steps}): nothing to do. "
                        f"Give --steps above {start} to train further; `jaxformer eval {run_dir}` re-evaluates.",
                        highlight=False)
                return finished
        # The checkpoint fits and the step count is sane: from here on the run directory is ours.
        if main:
            C.dump(cfg, run_dir / "config.yaml")
            if tok_path is not None and not tok_path.exists():
                tok.save(tok_path)
        state = restored[0] if restored is not None else trainer.init_state(cfg.seed)
        return _run(cfg, run_dir, trainer, corpus, it, ckpt, state, start, on_step=on_step, console=console,
                    resumed=restored is not None, t0=t0)
    finally:
        ckpt.close()


def _plain_console():
    from rich.console import Console

    return Console(soft_wrap=True)


def _changed_keys(cfg: C.ExperimentConfig, run_dir: Path) -> list[tuple[str, object, object]]:
    """``(dotted key, saved value, new value)`` where ``cfg`` differs from ``RUN_DIR/config.yaml`` (if any)."""
    saved = run_dir / "config.yaml"
    if not saved.exists():
        return []
    old = C.load(saved)
    a, b = C.to_dict(old), C.to_dict(cfg)

    def get(d, key):
        for part in key.split("."):
            d = d.get(part) if isinstance(d, dict) else None
        return d
    return [(k, get(a, k), get(b, k)) for k in C.diff(old, cfg)]


def _describe_changes(changed, keys=None) -> str:
    return ", ".join(f"{k} (saved {a!r}, now {b!r})" for k, a, b in changed if keys is None or k in keys)


def _finished_summary(cfg: C.ExperimentConfig, run_dir: Path, step: int) -> dict | None:
    """The recorded results of a run at ``step >= cfg.steps``, or None if its final evaluation is missing.

    A run past ``cfg.steps`` is refused (training cannot go backwards, and its files stay as they are).
    """
    if step > cfg.steps:
        raise ValueError(f"{run_dir} is already at step {step}, past steps={cfg.steps}; nothing was changed. "
                         f"Give --steps above {step} to train further, or a new --run-dir to start over.")
    rows = read_metrics(run_dir)
    train_rows = [r for r in rows if "loss" in r and r.get("step") == step]
    eval_rows = [r for r in rows if "val_loss" in r and r.get("step") == step]
    if cfg.eval.at_end and not eval_rows:
        return None  # stopped between the last checkpoint and the final evaluation: do that evaluation now
    out = {"step": step}
    for r in train_rows[-1:] + eval_rows[-1:]:
        out.update({k: v for k, v in r.items() if k != "step"})
    return out


def _run(cfg: C.ExperimentConfig, run_dir: Path, trainer: Trainer, corpus, it, ckpt: Checkpointer, state,
         start: int, *, on_step, console, resumed: bool, t0: float) -> dict:
    """Steps ``start .. cfg.steps``, periodic evaluations and checkpoints, the final evaluation and sample."""
    main = jax.process_index() == 0
    tok = corpus.tokenizer
    writer = MetricsWriter(run_dir, tensorboard=cfg.logging.tensorboard, resume_step=start, enabled=main)
    bar = ProgressBar(cfg.steps, start, enabled=cfg.logging.progress and main, show=main, console=console)
    try:
        bar.print(start_line(cfg, trainer.mesh, run_dir, start if resumed else None))
        evalset = _eval_set(cfg, corpus, cfg.eval.max_tokens)
        eval_bs = _eval_batch(cfg, trainer.mesh)
        meta = {"config": C.to_dict(cfg)}
        log = _StepLog(cfg, writer, bar, on_step, ckpt, last_saved=start if resumed else None)
        for step in range(start, cfg.steps):
            state, m = trainer.train_step(state, shd.put_batch(next(it), trainer.mesh))
            s = step + 1
            log.push(s, m)
            if s % cfg.checkpoint.every == 0 or s == cfg.steps:
                log.flush()
                with log.paused():
                    ckpt.save(s, state, it, meta)
                log.saved(s)
            if cfg.eval.every and s % cfg.eval.every == 0 and s != cfg.steps and evalset is not None:
                with log.paused():
                    ev = evaluate(trainer, state["params"], evalset, batch_size=eval_bs,
                                  token_bytes=tok.token_bytes)
                    writer.write({"step": s, **ev}, prefix="eval")
                    bar.print(_eval_line(s, ev))
        log.flush()
        ckpt.wait()
        bar.close()
        summary = {"step": max(start, cfg.steps), **{k: v for k, v in log.last.items() if k != "step"}}
        if cfg.eval.at_end and evalset is not None:
            final = _eval_set(cfg, corpus, cfg.eval.final_max_tokens)
            ev = evaluate(trainer, state["params"], final, batch_size=eval_bs, token_bytes=tok.token_bytes)
            if cfg.eval.compare_compressors and tok.token_bytes is not None:
                ev.update(compressor_bpb(tok.decode_bytes(final.target_ids())))
            writer.write({"step": summary["step"], **ev}, prefix="eval")
            summary.update(ev)
            bar.print(_eval_line(summary["step"], ev))
        if cfg.eval.sample is not None and tok.bos_id is not None:
            sp = cfg.eval.sample
            n_new = cfg.model.max_seq_len if sp.max_new_tokens is None else sp.max_new_tokens  # None: fill it
            summary["sample"] = sample_text(trainer, state["params"], tok, prompt=sp.prompt,
                                            max_new_tokens=n_new, temperature=sp.temperature,
                                            top_k=sp.top_k, top_p=sp.top_p, seed=cfg.seed)
            bar.print("--- sample ---\n" + summary["sample"] + "\n--------------")
        summary["wall_s"] = time.perf_counter() - t0
        return summary
    finally:
        bar.close()
        writer.close()


def start_line(cfg: C.ExperimentConfig, mesh, run_dir: Path, resumed_at: int | None) -> str:
    """One line on what is about to run: model size, devices and mesh, tokens per step, where it goes."""
    from jaxformer.model import count_params

    n = count_params(cfg.model)
    devices = f"{mesh.size} {jax.default_backend()} device{'s' if mesh.size > 1 else ''}"
    layout = " ".join(f"{k}={v}" for k, v in mesh.shape.items())
    what = f"resuming at step {resumed_at}" if resumed_at is not None else "new run"
    return (f"train: {n / 1e6:.2f} M parameters ({cfg.model.n_layers} layers, d_model {cfg.model.d_model}) · "
            f"{devices}, mesh {layout} · {cfg.batch_size * cfg.seq_len:,} tokens/step "
            f"({cfg.batch_size} x {cfg.seq_len}) · {cfg.steps:,} steps · {what} in {run_dir}")


class _StepLog:
    """Step metrics read back one step late (the host never waits on the device except at a checkpoint):
    non-finite values stop the run, rows go to metrics.jsonl / TensorBoard / the progress bar."""

    def __init__(self, cfg: C.ExperimentConfig, writer: MetricsWriter, bar: ProgressBar, on_step,
                 ckpt: Checkpointer, *, last_saved: int | None):
        self.cfg, self.writer, self.bar, self.on_step, self.ckpt = cfg, writer, bar, on_step, ckpt
        self.last_saved = last_saved
        self.pending: list[tuple[int, dict]] = []
        self.last: dict = {}
        self.t, self.t_step = None, None
        self.tokens_per_step = cfg.batch_size * cfg.seq_len

    def push(self, step: int, metrics) -> None:
        self.pending.append((step, metrics))
        self._drain(keep=1)

    def flush(self) -> None:
        self._drain(keep=0)

    def saved(self, step: int) -> None:
        self.last_saved = step

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (checkpoints, evaluations) does not count against tokens/s."""
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.t is not None:
                self.t += time.perf_counter() - t

    def _drain(self, keep: int) -> None:
        every = self.cfg.logging.every
        while len(self.pending) > keep:
            s, m = self.pending.pop(0)
            m = {k: float(v) for k, v in jax.device_get(m).items()}
            if not all(math.isfinite(m[k]) for k in ("loss", "grad_norm", "param_norm")):
                self.ckpt.wait()
                where = f"step {self.last_saved}" if self.last_saved is not None else "none"
                raise NonFiniteError(
                    f"non-finite training at step {s}: loss={m['loss']} grad_norm={m['grad_norm']} "
                    f"param_norm={m['param_norm']}; last good checkpoint: {where} in {self.ckpt.directory}")
            now = time.perf_counter()
            tps = None
            if self.t is not None and s > self.t_step:
                tps = self.tokens_per_step * (s - self.t_step) / (now - self.t)
            if self.t is None or s % every == 0:
                self.t, self.t_step = now, s
            log = s % every == 0 or s == self.cfg.steps
            row = {"step": s, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"],
                   "tokens_per_s": tps, "param_norm": m["param_norm"]}
            if log:
                self.writer.write(row)
            self.bar.update(s, m["loss"], tps, log)
            self.last = row
            if self.on_step is not None:
                self.on_step(s, row)


def _eval_line(step: int, ev: dict) -> str:
    parts = [f"eval @ {step}: val_loss {ev['val_loss']:.4f}"]
    if "val_bpb" in ev:
        parts.append(f"val_bpb {ev['val_bpb']:.4f} ({ev['val_bytes']:,} bytes)")
    if "gzip9_bpb" in ev:
        parts.append(f"gzip -9 {ev['gzip9_bpb']:.4f}  xz -9e {ev['xz9e_bpb']:.4f}")
    return "  ".join(parts)


# -- run-directory tools (eval / generate) -----------------------------------------------------

def load_run(run_dir: str | Path, overrides=()):
    """``(cfg, trainer, params, tokenizer, meta)`` from a run directory's config and newest checkpoint."""
    run_dir = Path(run_dir)
    path = run_dir / "config.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    cfg = C.load(path, overrides)
    mesh = shd.make_mesh(cfg.mesh)
    trainer = make_trainer(cfg, mesh)
    restored = Checkpointer(run_dir / "checkpoints", read_only=True).restore_latest(
        trainer.abstract_state, trainer.state_shardings)
    if restored is None:
        raise FileNotFoundError(f"no readable checkpoint in {run_dir / 'checkpoints'}")
    state, meta = restored
    return cfg, trainer, state["params"], _run_tokenizer(cfg, run_dir), meta


def _run_tokenizer(cfg: C.ExperimentConfig, run_dir: Path):
    if cfg.data.source == "bin":
        return None
    if cfg.data.tokenizer == "bpe":
        return BPETokenizer.load(run_dir / "tokenizer.json")
    return ByteTokenizer()


def evaluate_run(run_dir: str | Path, *, max_tokens: int | None = -1, compressors: bool = False) -> dict:
    """Validation loss / bits per byte of a run's newest checkpoint.

    ``max_tokens``: -1 uses the config's final evaluation size, None the whole validation split.
    """
    cfg, trainer, params, _, meta = load_run(run_dir)
    corpus = build_corpus(cfg.data, tokenizer_path=_tokenizer_path(cfg, Path(run_dir)))
    limit = cfg.eval.final_max_tokens if max_tokens == -1 else max_tokens
    evalset = _eval_set(cfg, corpus, limit)
    if evalset is None:
        raise ValueError(f"{run_dir}: the validation split is empty (data.val_fraction={cfg.data.val_fraction})")
    tok = corpus.tokenizer
    ev = evaluate(trainer, params, evalset, batch_size=_eval_batch(cfg, trainer.mesh), token_bytes=tok.token_bytes)
    if compressors and tok.token_bytes is not None:
        ev.update(compressor_bpb(tok.decode_bytes(evalset.target_ids())))
    return {"step": int(meta["step"]), **ev}


__all__ = ["NonFiniteError", "compressor_bpb", "evaluate", "evaluate_run", "load_run",
           "sample_text", "train"]
