"""``jaxformer train | eval | info | generate | translate | sweep | export | serve``: a thin argparse layer over
``jaxformer.train`` (``serve``: over :mod:`jaxformer.serve`).

``eval`` and ``generate`` take a run directory or ``--hf DIR`` (a Hugging Face checkpoint directory; with
``--adapter PEFT_DIR`` a peft LoRA adapter merged in); ``translate --hf DIR`` runs a translation checkpoint
(Marian); ``export RUN --hf OUT`` writes a run as one (a LoRA run merged), ``export RUN --peft OUT`` a LoRA
run's adapter as peft writes it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import warnings
from pathlib import Path


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``jaxformer`` parser (its help lists the commands) and each command's own parser."""
    p = argparse.ArgumentParser(prog="jaxformer", description="Train, evaluate and sample Transformers.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train (or resume) an experiment")
    t.add_argument("config", help="experiment YAML, e.g. experiments/configs/stdlib_bytes.yaml")
    t.add_argument("overrides", nargs="*", help="key.sub=value overrides (values parsed as YAML)")
    t.add_argument("--run-dir", help="default: runs/<config name>; an existing run directory resumes")
    t.add_argument("--steps", type=int, help="total number of steps (overrides the config)")
    t.add_argument("--json", action="store_true", help="end with the final metrics as one JSON line")

    e = sub.add_parser("eval", help="validation loss and bits per byte of a run's newest checkpoint, "
                       "or of a Hugging Face checkpoint on a text file (--hf DIR --text FILE)")
    e.add_argument("run_dir", nargs="?")
    e.add_argument("--hf", metavar="DIR", help="a Hugging Face checkpoint directory instead of a run (with --text)")
    e.add_argument("--text", metavar="FILE", help="with --hf: the UTF-8 text file to score")
    e.add_argument("--adapter", metavar="PEFT_DIR", help="with --hf: a peft LoRA adapter to apply (merged)")
    e.add_argument("--batch-size", type=int, default=8, help="with --hf: windows per batch")
    e.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="with --hf: parameter and compute dtype")
    e.add_argument("--max-tokens", type=int, default=-1, help="validation tokens (default: the config's final eval; "
                   "with --hf: the whole text)")
    e.add_argument("--all", action="store_true", help="the whole validation split")
    e.add_argument("--compressors", action="store_true", help="also gzip -9 / xz -9e bits per byte")
    e.add_argument("--seq-len", type=int, help="evaluate on windows of this many tokens (another context length "
                   "than the run's; adds the loss per position bucket); --max-tokens defaults to 65536 then; "
                   "with --hf: the window length (default: the model's context, at most 1024)")
    e.add_argument("--stride", type=int, help="with --seq-len: sliding windows this far apart (as eval.stride)")
    e.add_argument("--bucket", type=int, help="with --seq-len: positions per bucket (default: half the trained length)")
    e.add_argument("--json", action="store_true", help="print the results as one JSON line (default: readable)")

    i = sub.add_parser("info", help="parameters, FLOPs/token and memory per device")
    i.add_argument("target", help="an experiment YAML, a run directory (its config.yaml) or a preset name")
    i.add_argument("overrides", nargs="*", help="key.sub=value overrides; for a preset, experiment keys "
                   "(mesh.fsdp=8, batch_size=64, seq_len=4096) or model keys (n_layers=4, model.n_layers=4)")
    i.add_argument("--devices", type=int, help="plan for this many devices, none need be present "
                   "(default: those present); the mesh must use all of them")
    i.add_argument("--compile", action="store_true", help="also compile the train step on the devices present "
                   "and show XLA's memory analysis beside the estimate (seconds for small models)")

    w = sub.add_parser("sweep", help="run every point of a sweep file (resumable), then write its report")
    w.add_argument("sweep_file", help="a sweep YAML, e.g. experiments/studies/positions.yaml")
    w.add_argument("--out", help="default: runs/sweeps/<sweep name> (with --quick: <sweep name>-quick)")
    w.add_argument("--shard", help="I/N: run points I, I+N, I+2N, ... (a job array); --report gathers all shards")
    w.add_argument("--dry-run", action="store_true", help="list the points and their resolved configs; run nothing")
    w.add_argument("--quick", action="store_true", help="each point for a few steps with tiny evaluations (smoke test)")
    w.add_argument("--report", action="store_true", help="only gather what the points wrote into the report")

    g = sub.add_parser("generate", help="sample from a run's newest checkpoint or a Hugging Face checkpoint "
                       "(--hf DIR) (continuous-batching engine, paged KV cache)")
    add_generate_args(g)

    r = sub.add_parser("translate", help="translate with a Hugging Face encoder-decoder checkpoint (Marian)")
    r.add_argument("--hf", metavar="DIR", required=True, help="the checkpoint directory (config.json, "
                   "model.safetensors, source.spm / target.spm / vocab.json)")
    r.add_argument("--text", action="append", default=[], help="a source sentence (repeatable); one translation "
                   "per line is printed, in order")
    r.add_argument("--beams", type=int, help="beam search with N beams; 1: greedy (default: the checkpoint's "
                   "generation_config.json num_beams, else greedy)")
    r.add_argument("--max-new-tokens", type=int, help="default: the checkpoint's max_length - 1, at most the "
                   "model's context - 1")
    r.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))

    x = sub.add_parser("export", help="write a run's newest checkpoint as a Hugging Face checkpoint (a LoRA run: "
                       "merged), or a LoRA run's adapter as a peft adapter (--peft OUT)")
    x.add_argument("run_dir")
    x.add_argument("--hf", metavar="OUT", help="the directory to write (config.json, "
                   "model.safetensors, tokenizer files)")
    x.add_argument("--peft", metavar="OUT", help="a LoRA run: the directory to write its adapter to "
                   "(adapter_config.json, adapter_model.safetensors), as peft's save_pretrained does")
    x.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="the saved tensors' dtype (default: the run's model.param_dtype)")

    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming, logprobs, "
                       "/metrics) over the continuous-batching engine")
    add_serve_args(v)
    return p, sub.choices


def add_serve_args(v: argparse.ArgumentParser) -> None:
    v.add_argument("run_dir", nargs="?")
    v.add_argument("--hf", metavar="DIR", help="a Hugging Face checkpoint directory (or .gguf file) instead of a run")
    v.add_argument("--adapter", metavar="PEFT_DIR", help="a peft LoRA adapter (adapter_config.json + "
                   "adapter_model.safetensors), merged into the model's weights")
    v.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="with --hf: parameter and compute dtype")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--served-model-name", help="the model's name in the API (default: the directory's name)")
    v.add_argument("--max-batch", type=int, default=8, help="sequences decoded together per engine step")
    v.add_argument("--max-queue", type=int, default=64, help="sequences that may wait; more are answered 429")
    v.add_argument("--num-pages", type=int, help="KV pages per layer (default: max-batch sequences of max-context)")
    v.add_argument("--page-size", type=int, default=16)
    v.add_argument("--max-context", type=int, help="longest sequence (prompt + completion); default: the "
                   "model's context, at most 2048")
    v.add_argument("--chunk-size", type=int, default=16, help="prefill tokens per sequence per step (a step with a "
                   "prefill chunk runs every row at its width: small keeps decoding streams smooth)")
    v.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds running requests get to finish "
                   "after SIGTERM before they are cancelled")
    v.add_argument("--precompile", action="store_true", help="compile every engine step shape before serving "
                   "(steady latency from the first request; minutes for a large model)")
    v.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def add_generate_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("run_dir", nargs="?")
    g.add_argument("--hf", metavar="DIR", help="a Hugging Face checkpoint directory instead of a run directory "
                   "(decoder-only models; prompts get the specials its tokenizer adds; stops at its EOS)")
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="with --hf: parameter and compute dtype")
    g.add_argument("--adapter", metavar="PEFT_DIR", help="with --hf: a peft LoRA adapter to apply (merged)")
    g.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    g.add_argument("--prompts-file", help='one request per line: text, or JSON {"prompt": ..., "temperature": ...}; '
                                          "writes one JSON line per request")
    g.add_argument("--output", help="JSON lines output path (default: stdout)")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-pages", type=int, help="KV pages per layer (default: max-batch full-length sequences)")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--max-batch", type=int, default=8)
    g.add_argument("--window", type=int, help="sliding KV window W <= the model's context (RoPE/ALiBi models): "
                                              "generate past the context, each new token seeing the last W positions")


def cmd_train(args) -> int:
    from jaxformer.train import config as C
    from jaxformer.train.loop import train

    overrides = list(args.overrides) + ([f"steps={args.steps}"] if args.steps is not None else [])
    cfg = C.load(args.config, overrides)
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / Path(args.config).stem
    again = ["jaxformer", "train", args.config, "--run-dir", str(run_dir), *args.overrides]
    again += ["--steps", str(args.steps)] if args.steps is not None else []
    summary = train(cfg, run_dir, resume_command=shlex.join(again), exit_on_signal=True)  # Interrupted: 130 / 143
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "sample"}))
    else:
        print(format_summary(summary, run_dir))
    return 0


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


def cmd_eval(args) -> int:
    from jaxformer.train.evaluation import evaluate_hf_text, evaluate_run, evaluate_run_at_length

    limit = None if args.all else args.max_tokens
    _run_or_hf(args, "eval")
    _adapter_with_hf(args, "eval")
    if args.hf is not None:
        if args.text is None:
            raise ValueError("eval --hf DIR needs --text FILE (the text to score)")
        if args.bucket is not None:
            raise ValueError("eval: --bucket goes with a run directory, not --hf")
        return _print_eval(evaluate_hf_text(args.hf, args.text, seq_len=args.seq_len,
                                            max_tokens=None if limit == -1 else limit, stride=args.stride,
                                            batch_size=args.batch_size, dtype=args.dtype,
                                            compressors=args.compressors, adapter=args.adapter), args.json)
    if args.text is not None:
        raise ValueError("eval: --text FILE goes with --hf DIR (a run is evaluated on its validation split)")
    if args.seq_len is None:
        if args.stride is not None or args.bucket is not None:
            raise ValueError("eval: --stride and --bucket go with --seq-len N")
        return _print_eval(evaluate_run(args.run_dir, max_tokens=limit, compressors=args.compressors), args.json)
    if args.compressors:
        raise ValueError("eval: --compressors goes without --seq-len")
    limit = 65536 if limit == -1 else limit
    return _print_eval(evaluate_run_at_length(args.run_dir, args.seq_len, max_tokens=limit, stride=args.stride,
                                              bucket=args.bucket), args.json)


def _print_eval(result: dict, as_json: bool) -> int:
    print(json.dumps(result) if as_json else format_eval(result))
    return 0


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


def _run_or_hf(args, command: str) -> None:
    """Exactly one of a run directory and ``--hf DIR``."""
    if (args.run_dir is None) == (args.hf is None):
        raise ValueError(f"{command}: give a run directory or --hf DIR (a Hugging Face checkpoint), not "
                         + ("both" if args.hf is not None else "neither"))


def _adapter_with_hf(args, command: str) -> None:
    """``--adapter`` goes with ``--hf`` (a run's own adapter is in its checkpoints)."""
    if getattr(args, "adapter", None) is not None and args.hf is None:
        raise ValueError(f"{command}: --adapter PEFT_DIR goes with --hf DIR (the base it adapts); a LoRA run "
                         f"directory applies its own adapter")


def load_decoder(args, command: str):
    """``(model config, graphdef, params, tokenizer, name)`` of the decoder ``generate`` and ``serve`` run: a
    run directory's newest checkpoint, or ``--hf DIR`` (with ``--adapter PEFT_DIR`` merged in)."""
    from jaxformer.train.run_dir import load_run

    _run_or_hf(args, command)
    _adapter_with_hf(args, command)
    if args.hf is None:
        cfg, trainer, params, tok, _ = load_run(args.run_dir)
        if tok is None:
            raise ValueError(f"{args.run_dir}: source='bin' has no text tokenizer to encode prompts")
        return cfg.model, trainer.graphdef, params, tok, Path(args.run_dir).resolve().name
    model, graphdef, params, tok = load_hf_decoder(args.hf, dtype=args.dtype, command=command)
    name = Path(args.hf).stem if Path(args.hf).is_file() else Path(args.hf).resolve().name
    if args.adapter is not None:  # merged into the kernels: the base model's graphdef computes the adapted model
        from jaxformer.interop.peft import load_adapter

        params = load_adapter(args.adapter, model, params)
        name = f"{name}+{Path(args.adapter).resolve().name}"
    return model, graphdef, params, tok, name


# model_type -> kind, for families jaxformer may not read: a clear refusal either way
_NOT_DECODERS = {"bert": "encoder", "roberta": "encoder", "distilbert": "encoder", "electra": "encoder",
                 "marian": "encoder-decoder", "t5": "encoder-decoder", "bart": "encoder-decoder",
                 "mbart": "encoder-decoder", "pegasus": "encoder-decoder"}


def load_hf_decoder(path: str, *, dtype: str, command: str):
    """``(model config, graphdef, state, tokenizer)`` of a decoder-only Hugging Face checkpoint (or GGUF file)."""
    from jaxformer.interop.hf import config_from_hf, config_where, load_pretrained, read_config
    from jaxformer.train.tokenizers import HFTextTokenizer

    hf = read_config(path)
    model_type = hf.get("model_type")
    kind = _NOT_DECODERS.get(model_type) or config_from_hf(hf, config_where(path)).kind.replace("_", "-")
    if kind != "decoder":
        hint = ""
        if kind == "encoder-decoder":
            hint = " (translation: jaxformer translate --hf DIR --text ...)"
        raise ValueError(f"{command} --hf: {path} is a {model_type} checkpoint, an {kind} model; {command} needs a "
                         f"decoder-only (causal LM) checkpoint{hint}")
    config, graphdef, state = load_pretrained(path, dtype=dtype)
    return config, graphdef, state, HFTextTokenizer.load(path)


def cmd_translate(args) -> int:
    """Encode each ``--text`` as the checkpoint's tokenizer does (Marian: EOS appended), translate the batch
    greedily or by beam search with the checkpoint's generation settings (``translation_kwargs``), print one
    translation per line."""
    import numpy as np
    from flax import nnx

    from jaxformer.decode.translate import beam_translate, greedy_translate
    from jaxformer.interop.hf import CONFIG, config_from_hf, load_pretrained, read_config
    from jaxformer.interop.marian import translation_kwargs
    from jaxformer.interop.tokenizer import load_tokenizer

    if not args.text:
        raise ValueError("translate: give --text TEXT (repeatable)")
    if args.beams is not None and args.beams < 1:
        raise ValueError(f"translate: --beams {args.beams} must be >= 1")
    hf = read_config(args.hf)
    config = config_from_hf(hf, str(Path(args.hf) / CONFIG))
    if config.kind != "encoder_decoder" or hf.get("model_type") != "marian":
        raise ValueError(f"translate --hf: {args.hf} is a {hf.get('model_type')} checkpoint ({config.kind}); translate "
                         "needs a Marian encoder-decoder" + (" (a decoder: jaxformer generate --hf DIR)"
                                                            if config.kind == "decoder" else ""))
    kw = translation_kwargs(args.hf, beam=True)
    beams = args.beams if args.beams is not None else kw.pop("num_beams", 1)
    kw.pop("num_beams", None)
    limit = config.max_seq_len - 1
    max_new = min(kw.pop("max_new_tokens", limit) if args.max_new_tokens is None else args.max_new_tokens, limit)
    kw.pop("max_new_tokens", None)
    if beams == 1:
        kw = {k: v for k, v in kw.items() if k not in ("length_penalty", "early_stopping")}
    src_tok, tgt_tok = load_tokenizer(args.hf, side="source"), load_tokenizer(args.hf, side="target")
    rows = [np.asarray(src_tok.encode_prompt(t), np.int32) for t in args.text]
    lengths = np.asarray([len(r) for r in rows], np.int32)
    src = np.full((len(rows), int(lengths.max())), kw["pad_id"], np.int32)
    for i, r in enumerate(rows):
        src[i, :len(r)] = r
    _, graphdef, state = load_pretrained(args.hf, dtype=args.dtype)
    model = nnx.merge(graphdef, state)
    if beams > 1:
        out = beam_translate(model, src, lengths, max_new_tokens=max_new, num_beams=beams, **kw)
    else:
        out = greedy_translate(model, src, lengths, max_new_tokens=max_new, **kw)
    for row in out:
        print(tgt_tok.decode(row[1:]), flush=True)
    return 0


def cmd_export(args) -> int:
    from jaxformer.train.export import export_run
    from jaxformer.train.run_dir import config_path

    if (args.hf is None) == (args.peft is None):
        raise ValueError("export: give --hf OUT (a Hugging Face checkpoint) or --peft OUT (a LoRA run's adapter), "
                         + ("not both" if args.hf is not None else "one of them"))
    config_path(args.run_dir)  # "no such run directory" before anything is read
    if args.peft is not None:
        from jaxformer.train.export import export_peft

        if args.dtype is not None:
            raise ValueError("export --peft: the adapter is written in float32, as peft saves it; drop --dtype")
        out = export_peft(args.run_dir, args.peft)
        print(f"exported the adapter of step {out['step']} of {args.run_dir} as a peft adapter: {out['path']} "
              f"(adapter_config.json, adapter_model.safetensors: {out['tensors']} tensors; base {out['base']})")
        print(f"  next  jaxformer generate --hf {out['base']} --adapter {out['path']} --prompt '...'  ·  peft: "
              f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({out['base']!r}), {out['path']!r})")
        return 0
    out = export_run(args.run_dir, args.hf, dtype=args.dtype)
    files = ", ".join(["config.json", "*.safetensors", *out["tokenizer_files"]])
    print(f"exported step {out['step']} of {args.run_dir} as a {out['model_type']} checkpoint: {out['path']} ({files})")
    print(f"  next  jaxformer generate --hf {out['path']} --prompt '...'  ·  "
          f"transformers: AutoModelForCausalLM.from_pretrained({out['path']!r})")
    return 0


def cmd_info(args) -> int:
    import difflib

    from jaxformer.model import presets
    from jaxformer.train import config as C
    from jaxformer.train.info import (
        compiled_memory,
        describe_experiment,
        format_info,
        preset_config,
    )
    from jaxformer.train.run_dir import config_path

    if args.target in presets.names():
        cfg = preset_config(args.target, args.overrides, args.devices)
    elif Path(args.target).is_dir():  # a run directory: the config it keeps
        cfg = C.load(config_path(args.target), args.overrides, planning=True)
    elif Path(args.target).exists():
        cfg = C.load(args.target, args.overrides, planning=True)
    else:
        close = difflib.get_close_matches(args.target, presets.names(), n=5)
        which = f"closest presets: {', '.join(close)}" if close else f"presets: {', '.join(presets.names())}"
        raise FileNotFoundError(f"no such file or preset: {args.target!r}; {which}")
    info = describe_experiment(cfg, args.devices)
    if args.compile:
        info["xla"] = compiled_memory(cfg, args.devices)
    print(format_info(args.target, info))
    return 0


def cmd_generate(args) -> int:
    """Continue prompts on the continuous-batching engine over a paged KV cache.

    Several ``--prompt`` completions print under ``----- completion i of n -----`` lines; a
    completion cut by the model's context gets a note on stderr; ``--window`` (RoPE/ALiBi
    models) continues past the context with a sliding KV window, said once on stderr when a
    sequence did go past it. A ``--prompt`` that cannot run (too long, bad sampling) is a usage
    error (exit 2); a bad line of ``--prompts-file`` gets an error record and exit 1. ``--hf DIR``
    samples a decoder-only Hugging Face checkpoint instead of a run (prompts encoded with its
    tokenizer's ``encode_prompt``, stopping at its EOS). The KV pool defaults to what the requests
    can use (``--max-batch`` sequences of the longest prompt plus its new tokens, at most the context).
    """
    from jaxformer.decode.engine import RELATIVE_POSITIONS, check_window
    from jaxformer.decode.prompts import read_prompts_file, run_prompts, write_jsonl

    if not args.prompt and not args.prompts_file:
        raise ValueError("generate: give --prompt TEXT (repeatable) or --prompts-file FILE")
    model, graphdef, params, tok, _ = load_decoder(args, "generate")
    window = check_window(args.window, model)  # ValueError: exit 2, saying why
    prompts = list(args.prompt) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    records = run_prompts(graphdef, params, model, tok, prompts, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          num_pages=args.num_pages, page_size=args.page_size, max_batch=args.max_batch,
                          window=window)
    jsonl = bool(args.prompts_file)
    if window is not None and any(r["num_prompt_tokens"] + len(r["tokens"]) - 1 > model.max_seq_len
                                  for r in records if r["error"] is None):  # a position past the context was fed
        print(f"note: generated past the model's {model.max_seq_len}-token context with a sliding "
              f"{window}-token window (each new token sees the last {window} positions)", file=sys.stderr)
    if jsonl:
        write_jsonl(records, args.output or sys.stdout)
    for r in records:
        name = f"request index={r['index']}" if jsonl else f"prompt {r['index'] + 1}"
        if not jsonl:
            if len(records) > 1:
                print(f"----- completion {r['index'] + 1} of {len(records)} -----", flush=True)
            if r["error"] is None:
                print(r["prompt"] + r["completion"], flush=True)
            else:  # a usage error, as argparse's and main's are
                which = f"prompt {r['index'] + 1}: " if len(records) > 1 else ""
                print(f"jaxformer generate: error: {which}{r['error']}", file=sys.stderr)
        if r["stopped_by"] == "context":
            hint = (f"pass --window N (N <= {model.max_seq_len}) to continue with a sliding window"
                    if model.position in RELATIVE_POSITIONS else
                    f"this model's position={model.position!r} cannot go past it")
            print(f"note: {name} stopped at the model's {model.max_seq_len}-token context after "
                  f"{len(r['tokens'])} new tokens; {hint}", file=sys.stderr)
    if any(r["error"] for r in records):
        return 1 if jsonl else 2  # a prompts file: its other requests were answered, the errors are in their records
    return 0


def cmd_sweep(args) -> int:
    from jaxformer.train import config as C
    from jaxformer.train.sweep import default_out, load_sweep, parse_shard, quick_config, run_sweep, shard_points

    sweep = load_sweep(args.sweep_file)
    shard = parse_shard(args.shard) if args.shard else (0, 1)
    out = Path(args.out) if args.out else default_out(sweep, args.quick)
    every = sweep.tune_points + sweep.points  # tuning points run first (their arms' final points need them)
    mine = shard_points(every, shard)
    if args.dry_run:
        first = quick_config(sweep.points[0].config) if args.quick else sweep.points[0].config
        base = C.to_dict(first)
        tuning = f" ({len(sweep.tune_points)} tuning, {len(sweep.points)} final)" if sweep.tune_points else ""
        print(f"{sweep.path}: {len(every)} points{tuning}" + (f", {len(mine)} in shard {args.shard}" if args.shard
                                                               else "") + f" -> {out}")
        for p in mine:
            cfg = quick_config(p.config) if args.quick else p.config
            changed = [f"{k}={b!r}" for k, a, b in C.diff(first, cfg)]
            at = " (at its arm's tuned values)" if sweep.tune_points and not p.tuning else ""
            print(f"  {p.name}: {cfg.steps} steps, {cfg.model.n_layers} layers, d_model {cfg.model.d_model}"
                  + (f"; vs the first point: {', '.join(changed)}" if changed else "") + at)
        import yaml

        print("the first point, resolved (the others differ only where listed):\n"
              + yaml.safe_dump(base, sort_keys=False), end="")
        return 0
    if not args.report:
        run_sweep(sweep, out, shard=shard, quick=args.quick)
        if args.shard:  # shards may finish together: one report, by --report, once all of them are done
            print(f"shard {args.shard} done; when every shard is, gather them: jaxformer sweep {args.sweep_file} "
                  f"--out {out} --report")
            return 0
    from jaxformer.train.sweep_report import write_report

    path = write_report(sweep, out)
    print(f"report: {path}")
    return 0


def cmd_serve(args) -> int:
    """Load a run or ``--hf`` checkpoint as ``generate`` does and serve it (:mod:`jaxformer.serve`) until
    SIGTERM / SIGINT."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ValueError(f"serve needs the serve extra: pip install 'jaxformer[serve]' ({e})") from None
    from jaxformer.serve.server import serve

    model, graphdef, params, tok, name = load_decoder(args, "serve")
    try:
        return serve(graphdef, params, model, tok, name=args.served_model_name or name, host=args.host,
                     port=args.port, max_batch=args.max_batch, max_queue=args.max_queue, num_pages=args.num_pages,
                     page_size=args.page_size, max_context=args.max_context, chunk_size=args.chunk_size,
                     shutdown_timeout=args.shutdown_timeout, precompile=args.precompile, log_level=args.log_level)
    except KeyboardInterrupt:  # SIGINT: uvicorn shut down gracefully, then re-raised it
        return 130


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "info": cmd_info, "generate": cmd_generate, "sweep": cmd_sweep,
            "export": cmd_export, "translate": cmd_translate, "serve": cmd_serve}


def _one_line_warning(command: str):
    """``warnings.showwarning`` for the command line: the message alone, not a source excerpt."""
    def show(message, category, filename, lineno, file=None, line=None):
        print(f"jaxformer {command}: warning: {message}", file=sys.stderr)
    return show


def main(argv: list[str] | None = None) -> int:
    parser, commands = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in commands:
        parser.parse_args(argv[:1])  # exits: the help for -h, else argparse's "invalid choice" error
    # intermixed: key.sub=value overrides may come before or after the command's options
    args = commands[argv[0]].parse_intermixed_args(argv[1:], argparse.Namespace(command=argv[0]))
    from jaxformer.train.checkpoint import IncompatibleCheckpointError
    from jaxformer.train.config import ConfigError, parse_override
    from jaxformer.train.loop import Interrupted, NonFiniteError

    try:
        for text in getattr(args, "overrides", ()):
            parse_override(text)  # "override 'optimizer.lr' is not key.sub=value (...)" before any work
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warning(args.command)  # restored on exit
            return COMMANDS[args.command](args)
    except (ConfigError, NonFiniteError, IncompatibleCheckpointError, FileNotFoundError, ValueError) as e:
        print(f"jaxformer {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:  # SIGINT / SIGTERM: checkpointed, and its line (where, how to resume) printed
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
