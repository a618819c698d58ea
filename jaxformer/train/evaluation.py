"""Evaluation: validation loss and bits per byte over the validation windows, compressor baselines,
and the evaluation of a saved run (``jaxformer eval``)."""

from __future__ import annotations

import gzip
import lzma
import math
from pathlib import Path

from jaxformer.train import config as C
from jaxformer.train import sharding as shd
from jaxformer.train.corpus import Corpus, build_corpus
from jaxformer.train.eval_windows import EvalSet, eval_windows
from jaxformer.train.run_dir import load_run, tokenizer_path
from jaxformer.train.step import Trainer

LN2 = math.log(2.0)


def evaluate(trainer: Trainer, params, evalset: EvalSet, *, batch_size: int, token_bytes) -> dict:
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


def has_validation(corpus: Corpus) -> bool:
    """Whether the corpus has a validation split to evaluate (at least one input and one target)."""
    return len(corpus.val_stream) >= 2


def eval_set(cfg: C.ExperimentConfig, corpus: Corpus, max_tokens: int | None) -> EvalSet | None:
    """The config's validation windows scoring about ``max_tokens`` tokens; None if there is no validation split."""
    if not has_validation(corpus):
        return None
    return eval_windows(corpus.val_stream, seq_len=cfg.seq_len, tokenizer=corpus.tokenizer,
                        max_tokens=max_tokens, stride=cfg.eval.stride)


def eval_batch_size(cfg: C.ExperimentConfig, mesh) -> int:
    """``eval.batch_size`` (default: the micro-batch), rounded to a multiple of the batch shards."""
    b = cfg.eval.batch_size or cfg.batch_size // cfg.optimizer.grad_accum
    shards = shd.batch_shards(mesh)
    return max(shards, b // shards * shards)


def evaluate_validation(cfg: C.ExperimentConfig, trainer: Trainer, params, corpus: Corpus, *,
                        max_tokens: int | None, compressors: bool) -> dict | None:
    """:func:`evaluate` on :func:`eval_set` (plus :func:`compressor_bpb` of the scored bytes when
    ``compressors`` and the tokens are bytes); None if there is no validation split."""
    evalset = eval_set(cfg, corpus, max_tokens)
    if evalset is None:
        return None
    tok = corpus.tokenizer
    ev = evaluate(trainer, params, evalset, batch_size=eval_batch_size(cfg, trainer.mesh),
                  token_bytes=tok.token_bytes)
    if compressors and tok.token_bytes is not None:
        ev.update(compressor_bpb(tok.decode_bytes(evalset.target_ids())))
    return ev


def eval_line(step: int, ev: dict) -> str:
    """One line for the progress bar: the validation loss, bits per byte and compressor baselines."""
    parts = [f"eval @ {step}: val_loss {ev['val_loss']:.4f}"]
    if "val_bpb" in ev:
        parts.append(f"val_bpb {ev['val_bpb']:.4f} ({ev['val_bytes']:,} bytes)")
    if "gzip9_bpb" in ev:
        parts.append(f"gzip -9 {ev['gzip9_bpb']:.4f}  xz -9e {ev['xz9e_bpb']:.4f}")
    return "  ".join(parts)


def evaluate_run(run_dir: str | Path, *, max_tokens: int | None = -1, compressors: bool = False) -> dict:
    """Validation loss / bits per byte of a run's newest checkpoint.

    ``max_tokens``: -1 uses the config's final evaluation size, None the whole validation split.
    """
    cfg, trainer, params, _, meta = load_run(run_dir)
    corpus = build_corpus(cfg.data, tokenizer_path=tokenizer_path(cfg, Path(run_dir)))
    limit = cfg.eval.final_max_tokens if max_tokens == -1 else max_tokens
    ev = evaluate_validation(cfg, trainer, params, corpus, max_tokens=limit, compressors=compressors)
    if ev is None:
        raise ValueError(f"{run_dir}: the validation split is empty (data.val_fraction={cfg.data.val_fraction})")
    return {"step": int(meta["step"]), **ev}
