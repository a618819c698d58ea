"""The training loop: build, resume, step, log, evaluate, checkpoint; and the run-directory tools.

``train(cfg, run_dir)`` resumes from ``RUN_DIR/checkpoints`` when a readable
checkpoint exists. Metrics of step ``s`` are read back while step ``s+1``
runs, so the host never stalls the device except before a checkpoint, where
every pending step is checked: a non-finite loss, gradient norm or parameter
norm stops the run with :class:`NonFiniteError` naming the step, and no
checkpoint is written after it.
"""

from __future__ import annotations

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
from jaxformer.train.checkpoint import Checkpointer
from jaxformer.train.data import BPETokenizer, ByteTokenizer, build_corpus, eval_windows, TrainIterator
from jaxformer.train.metrics import MetricsWriter, ProgressBar
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
    """Train (or resume) ``cfg`` in ``run_dir``; returns the final metrics (train, eval, baselines)."""
    run_dir = Path(run_dir)
    shd.maybe_initialize_distributed(cfg.mesh)
    main = jax.process_index() == 0
    run_dir.mkdir(parents=True, exist_ok=True)
    saved = run_dir / "config.yaml"
    if saved.exists():
        changed = [k for k in C.diff(C.load(saved), cfg) if k.split(".")[0] in _TRAJECTORY]
        if changed:
            warnings.warn(f"{run_dir}: config differs from the saved run in {', '.join(changed)}; "
                          f"continuing with the new values", RuntimeWarning, stacklevel=2)
    if main:
        C.dump(cfg, saved)

    mesh = shd.make_mesh(cfg.mesh)
    corpus = build_corpus(cfg.data, tokenizer_path=_tokenizer_path(cfg, run_dir))
    tok = corpus.tokenizer
    _check_vocab(cfg, tok)
    it = TrainIterator(corpus, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed,
                       shuffle=cfg.data.shuffle, process_index=jax.process_index(),
                       process_count=jax.process_count())
    trainer = make_trainer(cfg, mesh)
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
    restored = ckpt.restore_latest(trainer.abstract_state, trainer.state_shardings, it)
    if restored is not None:
        state, meta = restored
        start = int(meta["step"])
    else:
        state, start = trainer.init_state(cfg.seed), 0
    writer = MetricsWriter(run_dir, tensorboard=cfg.logging.tensorboard, resume_step=start, enabled=main)
    bar = ProgressBar(cfg.steps, start, enabled=cfg.logging.progress and main, show=main, console=console)
    if start:
        bar.print(f"resumed {run_dir} at step {start}")
    evalset = _eval_set(cfg, corpus, cfg.eval.max_tokens)
    eval_bs = _eval_batch(cfg, mesh)
    meta = {"config": C.to_dict(cfg)}
    tokens_per_step = cfg.batch_size * cfg.seq_len

    last_saved = start if restored is not None else None
    pending: list[tuple[int, dict]] = []
    timer = {"t": None, "step": start}
    last: dict = {}

    def drain(keep: int) -> None:
        nonlocal last
        while len(pending) > keep:
            s, m = pending.pop(0)
            m = {k: float(v) for k, v in jax.device_get(m).items()}
            if not all(math.isfinite(m[k]) for k in ("loss", "grad_norm", "param_norm")):
                ckpt.wait()
                where = f"step {last_saved}" if last_saved is not None else "none"
                raise NonFiniteError(
                    f"non-finite training at step {s}: loss={m['loss']} grad_norm={m['grad_norm']} "
                    f"param_norm={m['param_norm']}; last good checkpoint: {where} in {ckpt.directory}")
            now = time.perf_counter()
            tps = None
            if timer["t"] is not None and s > timer["step"]:
                tps = tokens_per_step * (s - timer["step"]) / (now - timer["t"])
            if timer["t"] is None or s % cfg.logging.every == 0:
                timer["t"], timer["step"] = now, s
            log = s % cfg.logging.every == 0 or s == cfg.steps
            row = {"step": s, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"],
                   "tokens_per_s": tps, "param_norm": m["param_norm"]}
            if log:
                writer.write(row)
            bar.update(s, m["loss"], tps, log)
            last = row
            if on_step is not None:
                on_step(s, row)

    try:
        for step in range(start, cfg.steps):
            state, m = trainer.train_step(state, shd.put_batch(next(it), mesh))
            s = step + 1
            pending.append((s, m))
            drain(keep=1)
            paused = time.perf_counter()
            if s % cfg.checkpoint.every == 0 or s == cfg.steps:
                drain(keep=0)
                paused = time.perf_counter()
                ckpt.save(s, state, it, meta)
                last_saved = s
            if cfg.eval.every and s % cfg.eval.every == 0 and s != cfg.steps and evalset is not None:
                ev = evaluate(trainer, state["params"], evalset, batch_size=eval_bs, token_bytes=tok.token_bytes)
                writer.write({"step": s, **ev}, prefix="eval")
                bar.print(_eval_line(s, ev))
            if timer["t"] is not None:
                timer["t"] += time.perf_counter() - paused
        drain(keep=0)
        ckpt.wait()
        bar.close()
        summary = {"step": max(start, cfg.steps), **{k: v for k, v in last.items() if k != "step"}}
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
        return summary
    finally:
        bar.close()
        ckpt.close()
        writer.close()


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
