"""The training loop: build, resume, step, log, evaluate, checkpoint.

``train(cfg, run_dir)`` resumes from ``RUN_DIR/checkpoints`` when a readable
checkpoint exists (what a run directory holds and may be asked: :mod:`jaxformer.train.run_dir`).
Metrics of step ``s`` are read back while step ``s+1`` runs, so the host never
stalls the device except before a checkpoint, where every pending step is
checked: a non-finite loss, gradient norm or parameter norm stops the run with
:class:`NonFiniteError` naming the step, and no checkpoint is written after it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from pathlib import Path

import jax

from jaxformer.train import config as C
from jaxformer.train import sharding as shd
from jaxformer.train.checkpoint import Checkpointer
from jaxformer.train.corpus import Corpus, build_corpus
from jaxformer.train.evaluation import (eval_batch_size, eval_line, eval_set, evaluate, evaluate_validation,
                                        has_validation)
from jaxformer.train.metrics import MetricsWriter, ProgressBar, device_peak, mfu, plain_console
from jaxformer.train.pipeline import TrainIterator
from jaxformer.train.run_dir import (changed_keys, finished_summary, last_train_row, restore, saved_tokenizer_path,
                                     write_run_files)
from jaxformer.train.step import Trainer, make_trainer


class NonFiniteError(RuntimeError):
    """The loss (or gradient / parameter norm) became NaN or inf."""


def _check_vocab(cfg: C.ExperimentConfig, tokenizer) -> None:
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                         f"vocabulary {tokenizer.vocab_size} ({tokenizer.name}); raise model.vocab_size")


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
    changed = changed_keys(cfg, run_dir)
    mesh = shd.make_mesh(cfg.mesh)
    corpus = build_corpus(cfg.data, tokenizer_path=saved_tokenizer_path(cfg, run_dir))
    _check_vocab(cfg, corpus.tokenizer)
    it = _train_iterator(cfg, corpus)
    trainer = make_trainer(cfg, mesh)
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
    try:
        restored = restore(ckpt, trainer, it, run_dir, changed)
        start = int(restored[1]["step"]) if restored is not None else 0
        if restored is not None and start >= cfg.steps:
            finished = finished_summary(cfg, run_dir, start, can_evaluate=has_validation(corpus))
            if finished is not None:
                _say_finished(cfg, run_dir, start, console)
                return finished
        write_run_files(cfg, run_dir, corpus.tokenizer)  # the checkpoint fits: from here on the directory is ours
        if restored is not None:
            state = restored[0]
        elif cfg.hf_source is not None:  # step 0 of a fine-tune: the checkpoint's parameters
            from jaxformer.train.pretrained import initial_state
            state = initial_state(cfg, trainer)
        else:
            state = trainer.init_state(cfg.seed)
        return _run(cfg, run_dir, trainer, corpus, it, ckpt, state, start, on_step=on_step, console=console,
                    resumed=restored is not None, t0=t0)
    finally:
        ckpt.close()


def _train_iterator(cfg: C.ExperimentConfig, corpus: Corpus) -> TrainIterator:
    return TrainIterator(corpus, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed,
                         shuffle=cfg.data.shuffle, process_index=jax.process_index(),
                         process_count=jax.process_count())


def _say_finished(cfg: C.ExperimentConfig, run_dir: Path, step: int, console) -> None:
    if jax.process_index() == 0:
        (console or plain_console()).print(
            f"{run_dir} already finished at step {step} (steps={cfg.steps}): nothing to do. "
            f"Give --steps above {step} to train further; `jaxformer eval {run_dir}` re-evaluates.",
            highlight=False)


def _run(cfg: C.ExperimentConfig, run_dir: Path, trainer: Trainer, corpus: Corpus, it, ckpt: Checkpointer, state,
         start: int, *, on_step, console, resumed: bool, t0: float) -> dict:
    """Steps ``start .. cfg.steps``, periodic evaluations and checkpoints, the final evaluation and sample."""
    main = jax.process_index() == 0
    tok = corpus.tokenizer
    writer = MetricsWriter(run_dir, tensorboard=cfg.logging.tensorboard, resume_step=start, enabled=main)
    bar = ProgressBar(cfg.steps, start, enabled=cfg.logging.progress and main, show=main, console=console)
    try:
        peak, peak_note = device_peak(trainer.mesh.devices.flat, cfg.logging.peak_tflops) if main else (None, "")
        bar.print(start_line(cfg, trainer.mesh, run_dir, start if resumed else None, peak_note=peak_note))
        evalset = eval_set(cfg, corpus, cfg.eval.max_tokens)
        eval_bs = eval_batch_size(cfg, trainer.mesh)
        meta = {"config": C.to_dict(cfg)}
        log = _StepLog(cfg, writer, bar, on_step, ckpt, last_saved=start if resumed else None, peak_flops=peak)
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
                    writer.write({"step": s, **ev, "final": False}, prefix="eval")
                    bar.print(eval_line(s, ev))
        log.flush()
        ckpt.wait()
        bar.close()
        last = log.last or last_train_row(run_dir, start)  # no step ran: the row the run ended with
        summary = {"step": max(start, cfg.steps), **{k: v for k, v in last.items() if k != "step"}}
        final = evaluate_validation(cfg, trainer, state["params"], corpus, max_tokens=cfg.eval.final_max_tokens,
                                    compressors=cfg.eval.compare_compressors) if cfg.eval.at_end else None
        if final is not None:
            writer.write({"step": summary["step"], **final, "final": True}, prefix="eval")
            summary.update(final)
            bar.print(eval_line(summary["step"], final))
        if cfg.eval.sample is not None and (tok.bos_id is not None or hasattr(tok, "encode_prompt")):
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


def start_line(cfg: C.ExperimentConfig, mesh, run_dir: Path, resumed_at: int | None, *, peak_note: str = "") -> str:
    """One line on what is about to run: model size, devices and mesh, tokens per step, where it goes
    (and, given ``peak_note``, what the MFU column is measured against)."""
    from jaxformer.model import count_params

    n = count_params(cfg.model)
    devices = f"{mesh.size} {jax.default_backend()} device{'s' if mesh.size > 1 else ''}"
    layout = " ".join(f"{k}={v}" for k, v in mesh.shape.items())
    what = f"resuming at step {resumed_at}" if resumed_at is not None else "new run"
    return (f"train: {n / 1e6:.2f} M parameters ({cfg.model.n_layers} layers, d_model {cfg.model.d_model}) · "
            f"{devices}, mesh {layout} · {cfg.batch_size * cfg.seq_len:,} tokens/step "
            f"({cfg.batch_size} x {cfg.seq_len}) · {cfg.steps:,} steps · {what} in {run_dir}"
            + (f" · MFU vs {peak_note}" if peak_note else ""))


class _StepLog:
    """Step metrics read back one step late (the host never waits on the device except at a checkpoint):
    non-finite values stop the run, rows go to metrics.jsonl / TensorBoard / the progress bar."""

    def __init__(self, cfg: C.ExperimentConfig, writer: MetricsWriter, bar: ProgressBar, on_step,
                 ckpt: Checkpointer, *, last_saved: int | None, peak_flops: float | None = None):
        from jaxformer.model import flops_per_token

        self.cfg, self.writer, self.bar, self.on_step, self.ckpt = cfg, writer, bar, on_step, ckpt
        self.last_saved = last_saved
        self.pending: list[tuple[int, dict]] = []
        self.last: dict = {}
        self.t, self.t_step = None, None
        self.tokens_per_step = cfg.batch_size * cfg.seq_len
        self.peak_flops = peak_flops  # None: the device's peak is unknown, rows carry no mfu
        self.flops_per_token = flops_per_token(cfg.model, cfg.seq_len)

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
            m = {k: float(v) if getattr(v, "ndim", 0) == 0 else [float(x) for x in v]
                 for k, v in jax.device_get(m).items()}
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
            util = mfu(self.flops_per_token, tps, self.peak_flops)
            if self.peak_flops is not None:
                row["mfu"] = util
            if "grad_norm_layers" in m:
                row["grad_norm_layers"] = m["grad_norm_layers"]
            if log:
                self.writer.write(row)
            self.bar.update(s, m["loss"], tps, log, mfu=util)
            self.last = row
            if self.on_step is not None:
                self.on_step(s, row)


def sample_text(trainer: Trainer, params, tokenizer, *, prompt: str, max_new_tokens: int,
                temperature: float, top_k: int | None, top_p: float | None, seed: int) -> str:
    """Prompt + a continuation generated with the contiguous KV cache (``jaxformer.decode``)."""
    from jaxformer.decode.generate import generate

    if hasattr(tokenizer, "encode_prompt"):  # a checkpoint's tokenizer adds its own specials
        ids = [int(t) for t in tokenizer.encode_prompt(prompt)]
    else:
        ids = [tokenizer.bos_id] + [int(t) for t in tokenizer.encode(prompt)]
    out = generate(trainer.graphdef, params, trainer.cfg.model, [ids], max_new_tokens=max_new_tokens,
                   temperature=temperature, top_k=top_k or 0, top_p=top_p or 1.0, seed=seed,
                   stop_tokens=[] if tokenizer.eos_id is None else [tokenizer.eos_id])[0]
    return prompt + tokenizer.decode(out)


__all__ = ["NonFiniteError", "sample_text", "start_line", "train"]
