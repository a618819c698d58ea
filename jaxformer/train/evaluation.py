"""Evaluation: validation loss and bits per byte over the validation windows, compressor baselines,
the evaluation of a saved run (``jaxformer eval``), and of a saved run at another context length
with the loss per position bucket (``jaxformer eval --seq-len``)."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import lzma
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.model import apply
from jaxformer.train import config as C
from jaxformer.train import sharding as shd
from jaxformer.train.corpus import Corpus, build_corpus
from jaxformer.train.eval_windows import EvalSet, eval_windows, nested_windows
from jaxformer.train.run_dir import config_path, load_decoder, load_run, tokenizer_path
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


@functools.partial(jax.jit, static_argnums=0)
def token_nll(graphdef, params, batch):
    """Next-token negative log-likelihood (nats) of every position, fp32 ``[B, T]`` (0 where masked)."""
    logits = apply(graphdef, params, batch.tokens, positions=batch.positions,
                   segment_ids=batch.segment_ids)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, batch.targets[..., None], axis=-1)[..., 0]
    return jnp.where(batch.loss_mask, logz - picked, 0.0)


def learned_table_refusal(model_cfg, seq_len: int) -> str | None:
    """Why a model cannot be run on ``seq_len``-token windows (learned positions past their table), or None."""
    if model_cfg.positions.kind == "learned" and seq_len > model_cfg.max_seq_len:
        return (f"positions.kind='learned' has a table of max_seq_len={model_cfg.max_seq_len} positions: it has no "
                f"embedding for positions beyond it, so it cannot be evaluated at seq_len={seq_len}")
    return None


def evaluate_run_at_length(run_dir: str | Path, seq_len: int, *, max_tokens: int | None = 65536,
                           stride: int | None = None, bucket: int | None = None, span: int | None = None) -> dict:
    """Validation loss / bits per byte of a run's newest checkpoint on windows of ``seq_len`` tokens.

    The run may have been trained at another length: positions beyond the trained context are used
    as the encoding allows (RoPE, ALiBi, sinusoidal and none compute any position; a learned table
    refuses lengths past ``model.max_seq_len`` with a ValueError). ``max_tokens`` caps the scored
    tokens (evenly spaced windows; None: the whole split), ``stride`` as ``eval.stride``. ``span``
    (>= ``seq_len``, without ``stride``): the windows tile spans of ``span`` tokens
    (:func:`~jaxformer.train.eval_windows.nested_windows`), so calls at several lengths with the same
    ``span`` and ``max_tokens`` score exactly the same tokens (``val_tokens`` and ``val_bytes`` equal).

    Returns the overall figures and ``buckets``: the loss by *position in the document as the window
    holds it* (the number of tokens of its file a prediction has before it inside the window; a window
    that starts mid-file starts at 0: what a longer window adds), in buckets of ``bucket``
    positions (default half the trained length): ``[{"from", "to", "tokens", "loss", "bpb"}]``.
    """
    run_dir = Path(run_dir)
    trained = C.load(config_path(run_dir))
    refusal = learned_table_refusal(trained.model, seq_len)
    if refusal is not None:
        raise ValueError(f"{run_dir}: {refusal}")
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} must be >= 2")
    if bucket is not None and bucket <= 0:
        raise ValueError(f"bucket={bucket} must be > 0 positions")
    if stride is not None and not 1 <= stride <= seq_len:
        raise ValueError(f"stride={stride} must be in [1, seq_len={seq_len}]")
    if span is not None and (stride is not None or span < seq_len):
        raise ValueError(f"span={span} needs stride=None and span >= seq_len={seq_len}")
    overrides = [f"seq_len={seq_len}", "eval.stride=null"]
    if seq_len > trained.model.max_seq_len:
        overrides.append(f"model.max_seq_len={seq_len}")
    cfg, trainer, params, _, meta = load_run(run_dir, overrides)
    corpus = build_corpus(cfg.data, tokenizer_path=tokenizer_path(cfg, run_dir))
    if not has_validation(corpus):
        raise ValueError(f"{run_dir}: the validation split is empty (data.val_fraction={cfg.data.val_fraction})")
    if span is None:
        evalset = eval_windows(corpus.val_stream, seq_len=seq_len, tokenizer=corpus.tokenizer,
                               max_tokens=max_tokens, stride=stride)
    else:
        evalset = nested_windows(corpus.val_stream, seq_len=seq_len, span=span, tokenizer=corpus.tokenizer,
                                 max_tokens=max_tokens)
    width = bucket or max(1, trained.seq_len // 2)
    n_buckets = -(-seq_len // width)
    nats, count, nbytes = np.zeros(n_buckets), np.zeros(n_buckets), np.zeros(n_buckets)
    token_bytes = corpus.tokenizer.token_bytes
    for b in evalset.batches(eval_batch_size(cfg, trainer.mesh)):
        nll = np.asarray(token_nll(trainer.graphdef, params, b), np.float64)
        where = b.loss_mask
        idx = b.positions[where] // width
        nats += np.bincount(idx, nll[where], n_buckets)
        count += np.bincount(idx, None, n_buckets)
        if token_bytes is not None:
            nbytes += np.bincount(idx, token_bytes[b.targets[where]], n_buckets)
    out = {"step": int(meta["step"]), "seq_len": seq_len, "trained_seq_len": trained.seq_len,
           "val_loss": nats.sum() / max(count.sum(), 1.0), "val_tokens": int(count.sum())}
    if token_bytes is not None:
        out["val_bpb"] = nats.sum() / LN2 / max(nbytes.sum(), 1.0)
        out["val_bytes"] = int(nbytes.sum())
    out["buckets"] = [
        {"from": i * width, "to": min((i + 1) * width, seq_len), "tokens": int(count[i]),
         "loss": nats[i] / count[i], **({"bpb": nats[i] / LN2 / nbytes[i]} if token_bytes is not None and nbytes[i]
                                        else {})}
        for i in range(n_buckets) if count[i] > 0]
    return out


def evaluate_hf_text(path: str | Path, options: EvalOptions) -> dict:
    """Loss and bits per byte of a Hugging Face checkpoint on ``options.text`` (``jaxformer eval --hf DIR
    --text FILE``), with the peft adapter ``options.adapter`` merged in if given (``--adapter PEFT_DIR``),
    its parameters in ``options.dtype``.

    The file is one document tokenized with the checkpoint's tokenizer (its BOS first, if it has
    one), cut into windows of ``options.seq_len`` tokens (default: the model's context, at most 1024) as
    the validation windows of a run (:func:`eval_windows`: ``stride`` for sliding windows, ``max_tokens``
    for evenly spaced windows scoring about that many tokens; None or -1: all of it), ``batch_size`` at a
    time. Every token after the first is scored once. Bits per byte divide the nats by the UTF-8 bytes the
    scored tokens stand for (the tokenizer's ``token_bytes``); ``text_bytes`` is the file's size;
    ``compressors`` adds gzip's and xz's.
    """
    o = options
    adapter, stride = o.adapter, o.stride
    max_tokens = None if o.max_tokens == -1 else o.max_tokens
    text_file = Path(o.text)
    data = text_file.read_bytes()  # FileNotFoundError names the file
    config, graphdef, state, tok, _ = load_decoder(None, hf=path, adapter=adapter, dtype=o.dtype, command="eval")
    seq_len = min(config.max_seq_len, 1024) if o.seq_len is None else o.seq_len
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} must be >= 2")
    refusal = learned_table_refusal(config, seq_len)
    if refusal is not None:
        raise ValueError(f"{path}: {refusal}")
    if stride is not None and not 1 <= stride <= seq_len:
        raise ValueError(f"stride={stride} must be in [1, seq_len={seq_len}]")
    body = tok.encode(data.decode("utf-8", errors="replace"))
    stream = np.concatenate([[tok.bos_id] if tok.bos_id is not None else [], body]).astype(np.int32)
    if len(stream) < 2:
        raise ValueError(f"{text_file}: {len(stream)} token(s); nothing to score")
    evalset = eval_windows(stream, seq_len=seq_len, tokenizer=tok, max_tokens=max_tokens, stride=stride)
    token_bytes = tok.token_bytes
    nats, count, nbytes = 0.0, 0, 0
    for b in evalset.batches(o.batch_size):
        nll = np.asarray(token_nll(graphdef, state, b), np.float64)
        where = b.loss_mask
        nats += float(nll[where].sum())
        count += int(where.sum())
        nbytes += int(token_bytes[b.targets[where]].sum())
    out = {"model": str(path), "text": str(text_file), "seq_len": seq_len, "stride": stride or seq_len,
           "loss": nats / max(count, 1), "tokens": count, "bpb": nats / LN2 / max(nbytes, 1), "bytes": nbytes,
           "text_bytes": len(data)}
    if adapter is not None:
        out["adapter"] = str(adapter)
    if o.compressors:
        out.update(compressor_bpb(data))
    return out


def format_eval(ev: dict) -> str:
    """``jaxformer eval``'s results in a few lines (``--json``: the dict itself): loss and bits per byte,
    the compressors beside them, and with ``--seq-len`` a table of the loss per position bucket."""
    if "model" in ev:  # --hf DIR --text FILE
        head = [f"loss {ev['loss']:.4f} nats/token over {ev['tokens']:,} tokens",
                f"{ev['bpb']:.4f} bits/byte over {ev['bytes']:,} bytes"]
        model = ev["model"] + (f" + adapter {ev['adapter']}" if ev.get("adapter") else "")
        where = (f"  {model} on {ev['text']} ({ev['text_bytes']:,} bytes), windows of {ev['seq_len']} "
                 f"tokens, stride {ev['stride']}")
    else:
        head = [f"step {ev['step']:,}", f"val loss {ev['val_loss']:.4f} over {ev['val_tokens']:,} tokens"]
        if "val_bpb" in ev:
            head.append(f"val {ev['val_bpb']:.4f} bits/byte over {ev['val_bytes']:,} bytes")
        where = (f"  windows of {ev['seq_len']} tokens (trained at {ev['trained_seq_len']})"
                 if "seq_len" in ev else None)
    if "gzip9_bpb" in ev:
        head.append(f"gzip -9 {ev['gzip9_bpb']:.4f}, xz -9e {ev['xz9e_bpb']:.4f} bits/byte")
    lines = ["eval: " + " · ".join(head)] + ([where] if where else [])
    if ev.get("buckets"):
        lines.append("  positions       tokens      loss   bits/byte")
        lines += [f"  {b['from']:>5}-{b['to']:<7} {b['tokens']:>8,}  {b['loss']:8.4f}  "
                  + (f"{b['bpb']:10.4f}" if "bpb" in b else f"{'n/a':>10}") for b in ev["buckets"]]
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """What ``jaxformer eval`` scores, beside its model source (a run directory or ``--hf DIR``)."""

    text: str | None = None  # with --hf: the UTF-8 text file to score
    adapter: str | None = None  # with --hf: a peft adapter merged in
    dtype: str = "float32"  # with --hf
    batch_size: int = 8  # with --hf: windows per batch
    max_tokens: int | None = -1  # -1: the config's final eval (--hf: the whole text; --seq-len: 65536); None: all
    compressors: bool = False
    seq_len: int | None = None
    stride: int | None = None
    bucket: int | None = None

    @classmethod
    def from_args(cls, args) -> EvalOptions:
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        return cls(**{**given, "max_tokens": None if args.all else args.max_tokens})


def add_eval_options(a) -> None:
    """The :class:`EvalOptions` of a parser's ``add_argument`` ``a`` but ``adapter`` and ``dtype``, and
    ``--json``."""
    a("--json", action="store_true", help="print the results as one JSON line (default: readable)")
    a("--text", metavar="FILE", help="with --hf: the UTF-8 text file to score")
    a("--batch-size", type=int, default=8, help="with --hf: windows per batch")
    a("--max-tokens", type=int, default=-1, help="validation tokens (default: the config's final eval; with --hf: "
      "the whole text)")
    a("--all", action="store_true", help="the whole validation split")
    a("--compressors", action="store_true", help="also gzip -9 / xz -9e bits per byte")
    a("--seq-len", type=int, help="evaluate on windows of this many tokens (another context length than the "
      "run's; adds the loss per position bucket); --max-tokens defaults to 65536 then; with --hf: the window "
      "length (default: the model's context, at most 1024)")
    a("--stride", type=int, help="with --seq-len: sliding windows this far apart (as eval.stride)")
    a("--bucket", type=int, help="with --seq-len: positions per bucket (default: half the trained length)")


def evaluate_source(run_dir: str | Path | None, hf: str | Path | None = None,
                    options: EvalOptions = EvalOptions()) -> dict:
    """``jaxformer eval``: :func:`evaluate_hf_text` for ``hf``, else :func:`evaluate_run` or, with
    ``options.seq_len``, :func:`evaluate_run_at_length` of the run; ValueError naming an option that does not go
    with the source."""
    from jaxformer.train.run_dir import check_source

    o = options
    check_source(run_dir, hf=hf, adapter=o.adapter, command="eval")
    limit = o.max_tokens
    _refuse(limit is not None and limit != -1 and limit < 1
            and f"eval: --max-tokens {limit} must be >= 1 (or --all; the default: the config's final evaluation)")
    if hf is not None:
        _refuse(o.text is None and "eval --hf DIR needs --text FILE (the text to score)",
                o.bucket is not None and "eval: --bucket goes with a run directory, not --hf")
        return evaluate_hf_text(hf, o)
    _refuse(o.text is not None and "eval: --text FILE goes with --hf DIR (a run is evaluated on its validation split)")
    if o.seq_len is None:
        _refuse((o.stride, o.bucket) != (None, None) and "eval: --stride and --bucket go with --seq-len N")
        return evaluate_run(run_dir, max_tokens=limit, compressors=o.compressors)
    _refuse(o.compressors and "eval: --compressors goes without --seq-len")
    return evaluate_run_at_length(run_dir, o.seq_len, max_tokens=65536 if limit == -1 else limit, stride=o.stride,
                                  bucket=o.bucket)


def _refuse(*why) -> None:
    """ValueError with the first truthy message of ``why`` (each ``condition and "message"``)."""
    for message in why:
        if message:
            raise ValueError(message)


def eval_command(args) -> int:
    """``jaxformer eval (RUN_DIR | --hf DIR --text FILE)``: print :func:`evaluate_source`'s results."""
    import json

    ev = evaluate_source(args.run_dir, args.hf, EvalOptions.from_args(args))
    print(json.dumps(ev) if args.json else format_eval(ev))
    return 0

