"""``jaxformer train | eval | info | generate | translate | sweep | export | serve``: parse and dispatch.

Each command is a few lines over the package that does the work (``jaxformer.train``, ``jaxformer.study``,
``jaxformer.decode``, ``jaxformer.interop``, ``jaxformer.serve``). ``eval``, ``generate`` and ``serve`` take a
run directory or ``--hf DIR`` (a Hugging Face checkpoint directory or GGUF file; ``--adapter PEFT_DIR``: a
peft LoRA adapter merged in). Bad input is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import warnings
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def _source(a, hf_help: str) -> None:
    """The run directory / ``--hf DIR`` / ``--dtype`` / ``--adapter`` arguments of eval, generate and serve."""
    a("run_dir", nargs="?")
    a("--hf", metavar="DIR", help=hf_help)
    a("--dtype", default="float32", choices=DTYPES, help="with --hf: parameter and compute dtype")
    a("--adapter", metavar="PEFT_DIR", help="with --hf: a peft LoRA adapter to apply (merged)")


def _train(a) -> None:
    a("config", help="experiment YAML, e.g. experiments/configs/stdlib_bytes.yaml")
    a("overrides", nargs="*", help="key.sub=value overrides (values parsed as YAML)")
    a("--run-dir", help="default: runs/<config name>; an existing run directory resumes")
    a("--steps", type=int, help="total number of steps (overrides the config)")
    a("--json", action="store_true", help="end with the final metrics as one JSON line")


def _eval(a) -> None:
    from jaxformer.train.evaluation import add_eval_options

    _source(a, "a Hugging Face checkpoint directory instead of a run (with --text)")
    add_eval_options(a)
    a("--json", action="store_true", help="print the results as one JSON line (default: readable)")


def _info(a) -> None:
    a("target", help="an experiment YAML, a run directory (its config.yaml) or a preset name")
    a("overrides", nargs="*", help="key.sub=value overrides; for a preset, experiment keys (mesh.fsdp=8, "
      "batch_size=64, seq_len=4096) or model keys (n_layers=4, model.n_layers=4)")
    a("--devices", type=int, help="plan for this many devices, none need be present (default: those present); "
      "the mesh must use all of them")
    a("--compile", action="store_true", help="also compile the train step on the devices present and show XLA's "
      "memory analysis beside the estimate (seconds for small models)")


def _sweep(a) -> None:
    a("sweep_file", help="a sweep YAML, e.g. experiments/studies/positions.yaml")
    a("--out", help="default: runs/sweeps/<sweep name> (with --quick: <sweep name>-quick)")
    a("--shard", help="I/N: run points I, I+N, I+2N, ... (a job array); --report gathers all shards")
    a("--dry-run", action="store_true", help="list the points and their resolved configs; run nothing")
    a("--quick", action="store_true", help="each point for a few steps with tiny evaluations (smoke test)")
    a("--report", action="store_true", help="only gather what the points wrote into the report")


def _generate(a) -> None:
    from jaxformer.decode.prompts import add_generate_options

    _source(a, "a Hugging Face checkpoint directory instead of a run directory (decoder-only models; prompts get "
            "the specials its tokenizer adds; stops at its EOS)")
    a("--prompt", action="append", default=[], help="prompt text (repeatable)")
    a("--prompts-file", help='one request per line: text, or JSON {"prompt": ..., "temperature": ...}; writes '
      "one JSON line per request")
    a("--output", help="JSON lines output path (default: stdout)")
    add_generate_options(a)
    a("--window", type=int, help="sliding KV window W <= the model's context (RoPE/ALiBi models): generate past "
      "the context, each new token seeing the last W positions")


def _translate(a) -> None:
    a("--hf", metavar="DIR", required=True, help="the checkpoint directory (config.json, model.safetensors, "
      "source.spm / target.spm / vocab.json)")
    a("--text", action="append", default=[], help="a source sentence (repeatable); one translation per line is "
      "printed, in order")
    a("--beams", type=int, help="beam search with N beams; 1: greedy (default: the checkpoint's "
      "generation_config.json num_beams, else greedy)")
    a("--max-new-tokens", type=int, help="default: the checkpoint's max_length - 1, at most the model's context - 1")
    a("--dtype", default="float32", choices=DTYPES)


def _export(a) -> None:
    a("run_dir")
    a("--hf", metavar="OUT", help="the directory to write (config.json, model.safetensors, tokenizer files)")
    a("--peft", metavar="OUT", help="a LoRA run: the directory to write its adapter to (adapter_config.json, "
      "adapter_model.safetensors), as peft's save_pretrained does")
    a("--dtype", choices=DTYPES, help="the saved tensors' dtype (default: the run's model.param_dtype)")


def _serve(a) -> None:
    from jaxformer.serve.options import add_serve_options  # the options alone: no server dependency

    _source(a, "a Hugging Face checkpoint directory (or .gguf file) instead of a run")
    add_serve_options(a)


# command -> (its line in `jaxformer --help`, the function declaring its arguments on add_argument)
ARGUMENTS = {
    "train": ("train (or resume) an experiment", _train),
    "eval": ("validation loss and bits per byte of a run's newest checkpoint, or of a Hugging Face checkpoint on a "
             "text file (--hf DIR --text FILE)", _eval),
    "info": ("parameters, FLOPs/token and memory per device", _info),
    "sweep": ("run every point of a sweep file (resumable), then write its report", _sweep),
    "generate": ("sample from a run's newest checkpoint or a Hugging Face checkpoint (--hf DIR) (continuous-"
                 "batching engine, paged KV cache)", _generate),
    "translate": ("translate with a Hugging Face encoder-decoder checkpoint (Marian)", _translate),
    "export": ("write a run's newest checkpoint as a Hugging Face checkpoint (a LoRA run: merged), or a LoRA run's "
               "adapter as a peft adapter (--peft OUT)", _export),
    "serve": ("an OpenAI-compatible HTTP server (completions, chat, streaming, logprobs, /metrics) over the "
              "continuous-batching engine", _serve),
}


def _parser(command: str | None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``jaxformer`` parser (its help lists the commands) and each command's own parser; only ``command``'s
    arguments are declared (some need their package imported)."""
    p = argparse.ArgumentParser(prog="jaxformer", description="Train, evaluate and sample Transformers.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (help_, declare) in ARGUMENTS.items():
        c = sub.add_parser(name, help=help_)
        if name == command:
            declare(c.add_argument)
    return p, sub.choices


def cmd_train(args) -> int:
    from jaxformer.train import config as C
    from jaxformer.train.loop import train
    from jaxformer.train.run_dir import format_summary

    steps = [] if args.steps is None else ["--steps", str(args.steps)]
    cfg = C.load(args.config, list(args.overrides) + ([] if args.steps is None else [f"steps={args.steps}"]))
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / Path(args.config).stem
    again = shlex.join(["jaxformer", "train", args.config, "--run-dir", str(run_dir), *args.overrides, *steps])
    summary = train(cfg, run_dir, resume_command=again, exit_on_signal=True)  # Interrupted: 130 / 143
    print(json.dumps({k: v for k, v in summary.items() if k != "sample"}) if args.json
          else format_summary(summary, run_dir))
    return 0


def cmd_eval(args) -> int:
    from jaxformer.train.evaluation import EvalOptions, evaluate_source, format_eval

    ev = evaluate_source(args.run_dir, args.hf, EvalOptions.from_args(args))
    print(json.dumps(ev) if args.json else format_eval(ev))
    return 0


def cmd_translate(args) -> int:
    from flax import nnx

    from jaxformer.decode.translate import pad_sources, translate
    from jaxformer.interop.hf import check_kind, load_pretrained
    from jaxformer.interop.marian import translation_settings
    from jaxformer.interop.tokenizer import load_tokenizer

    if not args.text:
        raise ValueError("translate: give --text TEXT (repeatable)")
    check_kind(args.hf, "encoder-decoder", "translate")
    config, graphdef, state = load_pretrained(args.hf, dtype=args.dtype)
    kw = translation_settings(args.hf, config.max_seq_len, beams=args.beams, max_new_tokens=args.max_new_tokens)
    src_tok, tgt_tok = load_tokenizer(args.hf, side="source"), load_tokenizer(args.hf, side="target")
    src, lengths = pad_sources([src_tok.encode_prompt(t) for t in args.text], kw["pad_id"])
    for row in translate(nnx.merge(graphdef, state), src, lengths, **kw):
        print(tgt_tok.decode(row[1:]), flush=True)
    return 0


def cmd_export(args) -> int:
    from jaxformer.train.export import export_command

    print(export_command(args.run_dir, hf=args.hf, peft=args.peft, dtype=args.dtype))
    return 0


def cmd_info(args) -> int:
    from jaxformer.train.info import compiled_memory, describe_experiment, format_info, target_config

    cfg = target_config(args.target, args.overrides, args.devices)
    info = describe_experiment(cfg, args.devices)
    if args.compile:
        info["xla"] = compiled_memory(cfg, args.devices)
    print(format_info(args.target, info))
    return 0


def cmd_generate(args) -> int:
    """Continue prompts on the continuous-batching engine over a paged KV cache (see
    :func:`jaxformer.decode.prompts.run_prompts` and, for what is printed, ``report_records``)."""
    from jaxformer.decode.engine import check_window
    from jaxformer.decode.prompts import GenerateOptions, read_prompts_file, report_records, run_prompts
    from jaxformer.train.run_dir import load_decoder

    if not args.prompt and not args.prompts_file:
        raise ValueError("generate: give --prompt TEXT (repeatable) or --prompts-file FILE")
    model, graphdef, params, tok, _ = load_decoder(args.run_dir, hf=args.hf, adapter=args.adapter,
                                                   dtype=args.dtype, command="generate")
    window = check_window(args.window, model)  # ValueError: exit 2, saying why
    prompts = list(args.prompt) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    records = run_prompts(graphdef, params, model, tok, prompts, GenerateOptions.from_args(args, window=window))
    return report_records(records, model, window=window, jsonl=bool(args.prompts_file), output=args.output)


def cmd_sweep(args) -> int:
    from jaxformer.study.report import write_report
    from jaxformer.study.sweep import default_out, dry_run_text, load_sweep, parse_shard, run_sweep

    sweep = load_sweep(args.sweep_file)
    out = Path(args.out) if args.out else default_out(sweep, args.quick)
    if args.dry_run:
        print(dry_run_text(sweep, out, shard=args.shard, quick=args.quick), end="")
        return 0
    if not args.report:
        run_sweep(sweep, out, shard=parse_shard(args.shard) if args.shard else (0, 1), quick=args.quick)
        if args.shard:  # shards may finish together: one report, by --report, once all of them are done
            print(f"shard {args.shard} done; when every shard is, gather them: jaxformer sweep {args.sweep_file} "
                  f"--out {out} --report")
            return 0
    print(f"report: {write_report(sweep, out)}")
    return 0


def cmd_serve(args) -> int:
    """Load a run or ``--hf`` checkpoint as ``generate`` does and serve it (:mod:`jaxformer.serve`)."""
    try:
        from jaxformer.serve.server import serve
    except ImportError as e:
        raise ValueError(f"serve needs the serve extra: pip install 'jaxformer[serve]' ({e})") from None
    from jaxformer.serve.options import ServeOptions
    from jaxformer.train.run_dir import load_decoder

    model, graphdef, params, tok, name = load_decoder(args.run_dir, hf=args.hf, adapter=args.adapter,
                                                      dtype=args.dtype, command="serve")
    try:
        return serve(graphdef, params, model, tok, ServeOptions.from_args(args, name))
    except KeyboardInterrupt:  # SIGINT: uvicorn shut down gracefully, then re-raised it
        return 130


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "info": cmd_info, "generate": cmd_generate, "sweep": cmd_sweep,
            "export": cmd_export, "translate": cmd_translate, "serve": cmd_serve}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, commands = _parser(argv[0] if argv else None)
    if not argv or argv[0] not in commands:
        parser.parse_args(argv[:1])  # exits: the help for -h, else argparse's "invalid choice" error
    # intermixed: key.sub=value overrides may come before or after the command's options
    args = commands[argv[0]].parse_intermixed_args(argv[1:], argparse.Namespace(command=argv[0]))
    from jaxformer.train.checkpoint import IncompatibleCheckpointError
    from jaxformer.train.config import ConfigError, parse_override
    from jaxformer.train.loop import Interrupted, NonFiniteError

    def show(message, *_, **__):  # warnings as one line, not a source excerpt
        print(f"jaxformer {args.command}: warning: {message}", file=sys.stderr)

    try:
        for text in getattr(args, "overrides", ()):
            parse_override(text)  # "override 'optimizer.lr' is not key.sub=value (...)" before any work
        with warnings.catch_warnings():
            warnings.showwarning = show  # restored on exit
            return COMMANDS[args.command](args)
    except (ConfigError, NonFiniteError, IncompatibleCheckpointError, FileNotFoundError, ValueError) as e:
        print(f"jaxformer {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:  # SIGINT / SIGTERM: checkpointed, and its line (where, how to resume) printed
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
