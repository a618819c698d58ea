"""The training loop: build, resume, step, log, evaluate, checkpoint.

``train(cfg, run_dir)`` resumes from ``RUN_DIR/checkpoints`` when a readable
checkpoint exists (what a run directory holds and may be asked: :mod:`jaxformer.train.run_dir`).
Metrics of step ``s`` are read back while step ``s+1`` runs, so the host never
stalls the device except before a checkpoint, where every pending step is
checked: a non-finite loss, gradient norm or parameter norm stops the run with
:class:`NonFiniteError` naming the step, and no checkpoint is written after it.

SIGINT and SIGTERM (Ctrl-C, a scheduler's preemption) finish the step that runs, checkpoint it, print
one line saying where it is and how to resume, and raise :class:`Interrupted` (``jaxformer train`` exits
130 for SIGINT, 143 for SIGTERM); on the command line a second signal, or one that comes while there is
nothing to save (before the first step, after the last checkpoint), ends the process at once with one
line, leaving a directory that the same command resumes or starts cleanly (:class:`_Signals`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from jaxformer.train import config as C
from jaxformer.train import metrics as M
from jaxformer.train import sharding as shd
from jaxformer.train.checkpoint import Checkpointer
from jaxformer.train.corpus import Corpus, build_corpus
from jaxformer.train.evaluation import (eval_batch_size, eval_line, eval_set, evaluate, evaluate_validation,
                                        has_validation)
from jaxformer.train.host_memory import libc_function
from jaxformer.train.metrics import (MetricsWriter, ProgressBar, device_peak, measured_cpu_peak, mfu,
                                     peak_is_measured, plain_console)
from jaxformer.train.pipeline import TrainIterator
from jaxformer.train.run_dir import (changed_keys, finished_summary, last_train_row, refuse_stale_tokenizer, restore,
                                     saved_step, saved_tokenizer_path, write_run_files)
from jaxformer.train.step import Trainer, make_trainer


class NonFiniteError(RuntimeError):
    """The loss (or gradient / parameter norm) became NaN or inf."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped :func:`train` after the step it was running, once that step's checkpoint
    was committed. ``exit_code`` is 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), what a
    shell reports for a process the signal ended; ``jaxformer train`` exits with it."""

    def __init__(self, message: str, signum: int, step: int):
        super().__init__(message)
        self.signum, self.step, self.exit_code = signum, step, 128 + signum


SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Signals:
    """SIGINT / SIGTERM while :func:`train` runs (main thread only, which alone may set handlers; the
    handlers before are restored after; an ignored signal stays ignored).

    While steps run, the first signal asks the loop to stop after the current step and checkpoint it
    (:attr:`signum`). Otherwise (a second signal; before this process's first step; once its last
    checkpoint is committed) there is nothing to wait for: with ``exit_at_once`` (the command line) the
    process ends at once with one line, after any file being written under :meth:`writing`; without it (a
    library call: a notebook, a test session) the signal does what the handler before would have done
    (Python's KeyboardInterrupt for SIGINT). With ``exit_at_once`` a thread reads the signals from
    Python's wakeup fd, so the exit does not wait for a compile to return, and no KeyboardInterrupt is
    raised inside JAX (one raised in a compile callback crashed the process).
    """

    def __init__(self, run_dir: Path, resume_command: str | None, *, exit_at_once: bool):
        self.run_dir, self.exit_at_once = run_dir, exit_at_once
        self.resume = resume_command or "the same train() call"
        self.signum: int | None = None  # the first signal, once one came while steps ran
        self.step: int | None = None  # the newest step this process dispatched (None: none yet)
        self.done = False  # the last checkpoint is committed: nothing is left to save
        self._lock = threading.RLock()  # RLock: without exit_at_once the handler runs on the main thread
        self._old: dict = {}
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _Signals:
        if threading.current_thread() is not threading.main_thread():
            return self
        # a signal ignored on purpose (a background job of a shell script: SIGINT) stays ignored
        self._old = {s: signal.signal(s, self._handler) for s in SIGNALS if signal.getsignal(s) != signal.SIG_IGN}
        if self.exit_at_once:
            self._r, self._w = os.pipe()
            os.set_blocking(self._w, False)  # as set_wakeup_fd requires
            self._old_fd = signal.set_wakeup_fd(self._w)
            self._thread = threading.Thread(target=self._watch, name="jaxformer-signals", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: a handler not set from Python
        if self._thread is not None:
            signal.set_wakeup_fd(self._old_fd)
            os.write(self._w, b"\0")  # no signal is numbered 0: the watcher returns
            self._thread.join()
            os.close(self._r)
            os.close(self._w)

    @contextlib.contextmanager
    def writing(self):
        """Files written inside are whole when a signal ends the process (the exit waits for them)."""
        with self._lock:
            yield

    def finished(self) -> int | None:
        """The last checkpoint is committed: nothing is left to save from now on. Returns the signal that
        asked to stop before, if one did."""
        with self._lock:
            self.done = True
            return self.signum

    def interrupted(self, step: int) -> Interrupted:
        """The exception that ends a run stopped at ``step`` (checkpoint committed), its line printed."""
        code = 128 + self.signum
        line = (f"train: interrupted at step {step} ({signal.Signals(self.signum).name}): checkpoint saved in "
                f"{self.run_dir / 'checkpoints'}; resume with: {self.resume} (exit code {code})")
        print(line, file=sys.stderr, flush=True)
        return Interrupted(line, self.signum, step)

    def _stops_after_step(self, signum: int) -> bool:
        """Whether ``signum`` asks the loop to stop after the current step (said on stderr)."""
        with self._lock:
            if self.signum is not None or self.step is None or self.done:
                return False
            self.signum = signum
        again = "Ctrl-C again" if signum == signal.SIGINT else "a second signal"
        _say(f"train: {signal.Signals(signum).name}: finishing the current step, then saving a checkpoint "
             f"({again} {'exits' if self.exit_at_once else 'stops'} at once, without it)")
        return True

    def _handler(self, signum: int, frame) -> None:
        """The Python-level handler (main thread). With ``exit_at_once`` the watcher thread acts instead."""
        if self._thread is not None or self._stops_after_step(signum):
            return
        before = self._old[signum]
        if callable(before):
            before(signum, frame)  # Python's default_int_handler: KeyboardInterrupt
        elif before in (signal.SIG_DFL, None):
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)  # SIGTERM's default: the process ends

    def _watch(self) -> None:
        while True:
            for signum in os.read(self._r, 64):
                if signum == 0:
                    return
                if signum in SIGNALS and not self._stops_after_step(signum):
                    self._exit(signum)

    def _exit(self, signum: int) -> None:
        name, code, ckpts = signal.Signals(signum).name, 128 + signum, self.run_dir / "checkpoints"
        with self._lock:  # waits for files being written
            if self.signum is not None:
                why = (f"second signal ({name}): exited at once, {'with' if self.done else 'without'} the "
                       f"checkpoint of this step; resume from the newest complete checkpoint in {ckpts} with: "
                       f"{self.resume}")
            elif self.step is None:
                why = f"interrupted ({name}) before the first step: nothing to save; run again with: {self.resume}"
            else:
                why = (f"interrupted ({name}) after the last step, whose checkpoint is in {ckpts}; what was left "
                       f"(the final evaluation) runs with: {self.resume}")
            _say(f"train: {why} (exit code {code})")
            os._exit(code)


def _say(line: str) -> None:
    os.write(2, (line + "\n").encode())  # unbuffered: the watcher thread may call os._exit right after


def _check_vocab(cfg: C.ExperimentConfig, tokenizer) -> None:
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                         f"vocabulary {tokenizer.vocab_size} ({tokenizer.name}); raise model.vocab_size")


def release_host_memory() -> bool:
    """Free what finished runs left in this process: every compiled program (``jax.clear_caches``: a jitted
    function compiles again at its next call) and the heap memory glibc kept (``malloc_trim``). True where
    ``malloc_trim`` was called (Linux with glibc), False elsewhere (nothing trimmed).

    Call it between runs in one process: ``jaxformer sweep`` does after each point. Each compiled program holds
    its machine code in memory mappings of its own (three for each of its kernels), and Linux refuses a process
    more than ``vm.max_map_count`` of them (65,530 by default): a process fine-tuning SmolLM2-135M with LoRA
    point after point kept 1,865 more a point (8,300-11,400 under the test suite's fast-compile flags, where
    LLVM could not map its 12th point's program and the process aborted with most of its memory free). And
    glibc keeps what a run freed in its arenas: without the trim the same process's resident set went 5.5 ->
    9.5 GB over four full fine-tunes with no array alive. Measured in ``experiments/results/sweep_memory.md``."""
    import ctypes
    import gc

    gc.collect()  # arrays and jitted functions in reference cycles go first
    jax.clear_caches()
    trim = libc_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True


def train(cfg: C.ExperimentConfig, run_dir: str | Path, *, on_step: Callable[[int, dict], None] | None = None,
          console=None, resume_command: str | None = None, exit_on_signal: bool = False) -> dict:
    """Train (or resume) ``cfg`` in ``run_dir``; returns the final metrics (train, eval, baselines).

    Nothing is written into an existing run directory until its checkpoint is known to fit ``cfg``
    and ``cfg.steps`` lies at or beyond the run's step; a run that already reached ``cfg.steps``
    (and has its final evaluation) is left as it is. Those refusals and no-ops are decided from the run's
    files and its newest checkpoint's metadata before the corpus and tokenizer are built (seconds, not the
    half minute a BPE corpus takes).

    SIGINT / SIGTERM while steps run stop the run after the current step, checkpointed, and raise
    :class:`Interrupted`, whose line names ``resume_command`` (the command that resumes; default: "the
    same train() call"). Any other signal (a second one; one before the first step or after the last
    checkpoint) ends the process at once with one line if ``exit_on_signal`` (the command line), else
    does what it would have done without ``train`` (:class:`_Signals`).
    """
    t0 = time.perf_counter()
    run_dir = Path(run_dir)
    with _Signals(run_dir, resume_command, exit_at_once=exit_on_signal) as stop:
        shd.maybe_initialize_distributed(cfg.mesh)
        changed = changed_keys(cfg, run_dir)
        refuse_stale_tokenizer(cfg, run_dir, changed)
        mesh = shd.make_mesh(cfg.mesh)
        trainer = make_trainer(cfg, mesh)
        ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
        try:
            at = saved_step(ckpt, trainer, run_dir, changed)  # refuses a checkpoint that does not fit
            if at is not None and at >= cfg.steps:
                # refuses a run past cfg.steps; None: a final evaluation to do, unless there is no validation
                # split to do it on, which only the corpus can tell (below)
                finished = finished_summary(cfg, run_dir, at)
                if finished is not None and _restores(ckpt, trainer, at):
                    _say_finished(cfg, run_dir, at, console)
                    return finished
            corpus = build_corpus(cfg.data, tokenizer_path=saved_tokenizer_path(cfg, run_dir))
            _check_vocab(cfg, corpus.tokenizer)
            it = _train_iterator(cfg, corpus)
            restored = restore(ckpt, trainer, it, run_dir, changed)
            start = int(restored[1]["step"]) if restored is not None else 0
            if restored is not None and start >= cfg.steps:
                finished = finished_summary(cfg, run_dir, start, can_evaluate=has_validation(corpus))
                if finished is not None:
                    _say_finished(cfg, run_dir, start, console)
                    return finished
            with stop.writing():  # the checkpoint fits: from here on the directory is ours
                write_run_files(cfg, run_dir, corpus.tokenizer)
            if restored is not None:
                state = restored[0]
                if cfg.model.lora is not None:  # the frozen base, checked against the run's record of it
                    from jaxformer.train.lora import attach_base
                    attach_base(cfg, trainer, run_dir)
            elif cfg.model.lora is not None:  # step 0 of a LoRA run: the base frozen beside a fresh adapter
                from jaxformer.train.lora import initial_state
                state = initial_state(cfg, trainer)
            elif cfg.hf_source is not None:  # step 0 of a fine-tune: the checkpoint's parameters
                from jaxformer.train.pretrained import initial_state
                state = initial_state(cfg, trainer)
            else:
                state = trainer.init_state(cfg.seed)
            job = _Job(cfg, run_dir, trainer, ckpt, stop, on_step=on_step, console=console, t0=t0)
            return _run(job, corpus, it, state, start, resumed=restored is not None)
        finally:
            ckpt.close()


def _restores(ckpt: Checkpointer, trainer: Trainer, step: int) -> bool:
    """Whether the newest checkpoint, of ``step``, restores: one that does not (unreadable, or parameters
    that do not match their fingerprint) is set aside with a warning, and the run resumes from the one
    before (:meth:`~jaxformer.train.checkpoint.Checkpointer.restore_latest`)."""
    restored = ckpt.restore_latest(trainer.abstract_state, trainer.state_shardings)
    return restored is not None and int(restored[1]["step"]) == step


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


@dataclasses.dataclass(frozen=True)
class _Job:
    """What one :func:`train` call runs with: its config and directory, the trainer, the checkpointer, the
    signal watch, and the caller's ``on_step`` / ``console`` and start time ``t0``."""

    cfg: C.ExperimentConfig
    run_dir: Path
    trainer: Trainer
    ckpt: Checkpointer
    stop: _Signals
    on_step: Callable[[int, dict], None] | None = None
    console: Any = None
    t0: float = 0.0


def _run(job: _Job, corpus: Corpus, it, state, start: int, *, resumed: bool) -> dict:
    """Steps ``start .. cfg.steps``, periodic evaluations and checkpoints, the final evaluation and sample;
    a signal (``job.stop``) ends the steps early, checkpointed."""
    cfg, run_dir, trainer, ckpt, stop = job.cfg, job.run_dir, job.trainer, job.ckpt, job.stop
    on_step, console, t0 = job.on_step, job.console, job.t0
    main = jax.process_index() == 0
    tok = corpus.tokenizer
    with stop.writing():  # drops the rows an interrupted run wrote after its checkpoint: not to be cut
        writer = MetricsWriter(run_dir, tensorboard=cfg.logging.tensorboard, resume_step=start, enabled=main)
    bar = ProgressBar(cfg.steps, start, enabled=cfg.logging.progress and main, show=main, console=console, started=t0)
    try:
        peak, peak_note = device_peak(trainer.mesh.devices.flat, cfg.logging.peak_tflops) if main else (None, "")
        reprobe = _Reprobe(trainer.mesh.devices.flat, cfg.logging.peak_tflops, enabled=main)
        bar.print(start_line(cfg, trainer.mesh, run_dir, start if resumed else None, peak_note=peak_note)
                  + (f" · {corpus.split_note}" if corpus.split_note else ""))
        evalset = eval_set(cfg, corpus, cfg.eval.max_tokens)
        eval_bs = eval_batch_size(cfg, trainer.mesh)
        meta = {"config": C.to_dict(cfg)}
        log = _StepLog(cfg, writer, bar, on_step, ckpt, last_saved=start if resumed else None, peak_flops=peak)
        for step in range(start, cfg.steps):
            state, m = trainer.train_step(state, shd.put_batch(next(it), trainer.mesh))
            s = step + 1
            stop.step = s
            log.push(s, m)
            stopping = stop.signum is not None  # read once: a signal that comes later stops after the next step
            if stopping or s % cfg.checkpoint.every == 0 or s == cfg.steps:
                log.flush()
                with log.paused():
                    ckpt.save(s, state, it, meta)
                log.saved(s)
            if stopping:
                break
            reprobe(log)
            if cfg.eval.every and s % cfg.eval.every == 0 and s != cfg.steps and evalset is not None:
                with log.paused():
                    ev = evaluate(trainer, trainer.model_params(state), evalset, batch_size=eval_bs,
                                  token_bytes=tok.token_bytes)
                    writer.write({"step": s, **ev, "final": False}, prefix="eval")
                    bar.print(eval_line(s, ev))
        log.flush()
        ckpt.wait()
        if stop.finished() is not None:
            raise stop.interrupted(log.last_saved)
        if reprobe.note is not None and reprobe.note != peak_note:
            bar.print(f"train: MFU vs {reprobe.note}")
        bar.close()
        last = log.last or last_train_row(run_dir, start)  # no step ran: the row the run ended with
        summary = {"step": max(start, cfg.steps), **{k: v for k, v in last.items() if k != "step"}}
        final = evaluate_validation(cfg, trainer, trainer.model_params(state), corpus,
                                    max_tokens=cfg.eval.final_max_tokens,
                                    compressors=cfg.eval.compare_compressors) if cfg.eval.at_end else None
        if final is not None:
            writer.write({"step": summary["step"], **final, "final": True}, prefix="eval")
            summary.update(final)
            bar.print(eval_line(summary["step"], final))
        if cfg.eval.sample is not None and (tok.bos_id is not None or hasattr(tok, "encode_prompt")):
            summary["sample"] = sample_text(trainer, trainer.model_params(state), tok, cfg.eval.sample, cfg.seed)
            bar.print("--- sample ---\n" + summary["sample"] + "\n--------------")
        summary["wall_s"] = time.perf_counter() - t0
        return summary
    finally:
        bar.close()
        writer.close()


def start_line(cfg: C.ExperimentConfig, mesh, run_dir: Path, resumed_at: int | None, *, peak_note: str = "") -> str:
    """One line on what is about to run: model size, devices and mesh, tokens per step, where it goes
    (and, given ``peak_note``, what the MFU column is measured against)."""
    from jaxformer.model import count_params, lora_params

    n = count_params(cfg.model)
    lora = cfg.model.lora
    trained = (f", {lora_params(cfg.model):,} trained: LoRA rank {lora.rank} on a frozen base"
               if lora is not None else "")
    devices = f"{mesh.size} {jax.default_backend()} device{'s' if mesh.size > 1 else ''}"
    layout = " ".join(f"{k}={v}" for k, v in mesh.shape.items())
    what = f"resuming at step {resumed_at}" if resumed_at is not None else "new run"
    return (f"train: {n / 1e6:.2f} M parameters ({cfg.model.n_layers} layers, d_model {cfg.model.d_model}"
            f"{trained}) · "
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
                row["peak_tflops"] = self.peak_flops / 1e12  # what mfu is measured against, all devices
            if "grad_norm_layers" in m:
                row["grad_norm_layers"] = m["grad_norm_layers"]
            if log:
                self.writer.write(row)
            self.bar.update(s, m["loss"], tps, log, mfu=util)
            self.last = row
            if self.on_step is not None:
                self.on_step(s, row)


class _Reprobe:
    """On CPU (the peak measured, :func:`~jaxformer.train.metrics.peak_is_measured`), the matmul peak probed
    again :data:`~jaxformer.train.metrics.REPROBE_AFTER_S` seconds after the run's first step, between steps
    and outside the timed intervals, the best of the probes kept: the MFU of later rows is measured
    against it, and :attr:`note` says it."""

    def __init__(self, devices, override_tflops: float | None, *, enabled: bool):
        self.devices, self.override = list(devices), override_tflops
        self.left = list(M.REPROBE_AFTER_S) if enabled and peak_is_measured(self.devices, override_tflops) else []
        self.t0: float | None = None
        self.note: str | None = None

    def __call__(self, log: _StepLog) -> None:
        if not self.left:
            return
        now = time.perf_counter()
        if self.t0 is None:
            self.t0 = now
        if now - self.t0 < self.left[0]:
            return
        self.left.pop(0)
        log.flush()  # the steps dispatched so far are done: the probe has the cores to itself
        with log.paused():
            measured_cpu_peak(again=True)
            log.peak_flops, self.note = device_peak(self.devices, self.override)


def sample_text(trainer: Trainer, params, tokenizer, sample: C.SampleConfig, seed: int) -> str:
    """``sample.prompt`` + a continuation generated with the contiguous KV cache (``jaxformer.decode``), as
    ``eval.sample`` asks (``max_new_tokens`` None: until the model's context is full)."""
    from jaxformer.decode.generate import generate
    from jaxformer.decode.prompts import completion_context, decode_completion, encode_prompt

    model = trainer.spec.model
    ids = encode_prompt(tokenizer, sample.prompt)
    n_new = model.max_seq_len if sample.max_new_tokens is None else sample.max_new_tokens
    out = generate(trainer.graphdef, params, model, [ids], max_new_tokens=n_new,
                   temperature=sample.temperature, top_k=sample.top_k or 0, top_p=sample.top_p or 1.0, seed=seed,
                   stop_tokens=[] if tokenizer.eos_id is None else [tokenizer.eos_id])[0]
    return sample.prompt + decode_completion(tokenizer.decode, completion_context(tokenizer.decode, ids), out)


def add_train_options(a) -> None:
    """``jaxformer train``'s arguments on a parser's ``add_argument`` ``a``."""
    a("config", help="experiment YAML, e.g. experiments/configs/stdlib_bytes.yaml")
    a("overrides", nargs="*", help="key.sub=value overrides (values parsed as YAML)")
    a("--run-dir", help="default: runs/<config name>; an existing run directory resumes")
    a("--steps", type=int, help="total number of steps (overrides the config)")
    a("--json", action="store_true", help="end with the final metrics as one JSON line")


def train_command(args) -> int:
    """``jaxformer train CONFIG``: train (or resume) and print the summary (:func:`train`)."""
    import json
    import shlex

    from jaxformer.train.run_dir import format_summary

    steps = [] if args.steps is None else ["--steps", str(args.steps)]
    cfg = C.load(args.config, list(args.overrides) + ([] if args.steps is None else [f"steps={args.steps}"]))
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / Path(args.config).stem
    again = shlex.join(["jaxformer", "train", args.config, "--run-dir", str(run_dir), *args.overrides, *steps])
    summary = train(cfg, run_dir, resume_command=again, exit_on_signal=True)  # Interrupted: 130 / 143
    print(json.dumps({k: v for k, v in summary.items() if k != "sample"}) if args.json
          else format_summary(summary, run_dir))
    return 0


__all__ = ["Interrupted", "NonFiniteError", "add_train_options", "sample_text", "start_line", "train", "train_command"]
