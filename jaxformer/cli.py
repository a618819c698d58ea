"""``jaxformer train | eval | info | generate | translate | sweep | export | serve``: parse and dispatch.

Each command is a pair of functions in the package that does the work: one declaring its arguments on a
parser's ``add_argument``, one running it from the parsed arguments (:data:`COMMANDS`); both are imported
only when that command is chosen. ``generate``, ``translate`` and ``serve`` join two packages, so they are
written here. ``eval``, ``generate`` and ``serve`` take a run directory or ``--hf DIR`` (a Hugging Face
checkpoint directory or GGUF file; ``--adapter PEFT_DIR``: a peft LoRA adapter merged in). Bad input is
one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

DTYPES = ("float32", "bfloat16", "float16")
HF_HELP = {
    "eval": "a Hugging Face checkpoint directory instead of a run (with --text)",
    "generate": "a Hugging Face checkpoint directory instead of a run directory (decoder-only models; prompts get "
                "the specials its tokenizer adds; stops at its EOS)",
    "serve": "a Hugging Face checkpoint directory (or .gguf file) instead of a run",
}
"""The commands that take a run directory or ``--hf DIR``, with what ``--hf`` means for each."""


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
    return report_records(records, model, window=window, jsonl=bool(args.prompts_file or args.output),
                          output=args.output)


def cmd_translate(args) -> int:
    """Translate each ``--text`` with a Marian checkpoint (greedy or beam search, its own settings)."""
    from flax import nnx

    from jaxformer.decode.translate import TranslationConfig, pad_sources, translate
    from jaxformer.interop.hf import check_kind, load_pretrained
    from jaxformer.interop.marian import translation_settings
    from jaxformer.interop.tokenizer import load_tokenizer

    if not args.text:
        raise ValueError("translate: give --text TEXT (repeatable)")
    check_kind(args.hf, "encoder-decoder", "translate")
    config, graphdef, state = load_pretrained(args.hf, dtype=args.dtype)
    settings = TranslationConfig(**translation_settings(args.hf, config.max_seq_len, beams=args.beams,
                                                        max_new_tokens=args.max_new_tokens))
    src_tok, tgt_tok = load_tokenizer(args.hf, side="source"), load_tokenizer(args.hf, side="target")
    src, lengths = pad_sources([src_tok.encode_prompt(t) for t in args.text], settings.pad)
    for row in translate(nnx.merge(graphdef, state), src, lengths, config=settings):
        print(tgt_tok.decode(row[1:]), flush=True)
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


# command -> (its line in `jaxformer --help`, "module:function" declaring its arguments, "module:function"
# running it, or a function of this file)
COMMANDS = {
    "train": ("train (or resume) an experiment", "jaxformer.train.loop:add_train_options",
              "jaxformer.train.loop:train_command"),
    "eval": ("validation loss and bits per byte of a run's newest checkpoint, or of a Hugging Face checkpoint on a "
             "text file (--hf DIR --text FILE)", "jaxformer.train.evaluation:add_eval_options",
             "jaxformer.train.evaluation:eval_command"),
    "info": ("parameters, FLOPs/token and memory per device", "jaxformer.train.info:add_info_options",
             "jaxformer.train.info:info_command"),
    "sweep": ("run every point of a sweep file (resumable), then write its report",
              "jaxformer.study.report:add_sweep_options", "jaxformer.study.report:sweep_command"),
    "generate": ("sample from a run's newest checkpoint or a Hugging Face checkpoint (--hf DIR) (continuous-"
                 "batching engine, paged KV cache)", "jaxformer.decode.prompts:add_generate_options", cmd_generate),
    "translate": ("translate with a Hugging Face encoder-decoder checkpoint (Marian)",
                  "jaxformer.decode.translate:add_translate_options", cmd_translate),
    "export": ("write a run's newest checkpoint as a Hugging Face checkpoint (a LoRA run: merged), or a LoRA run's "
               "adapter as a peft adapter (--peft OUT)", "jaxformer.train.export:add_export_options",
               "jaxformer.train.export:export_command"),
    "serve": ("an OpenAI-compatible HTTP server (completions, chat, streaming, logprobs, /metrics) over the "
              "continuous-batching engine", "jaxformer.serve.options:add_serve_options", cmd_serve),
}


def _function(where):
    """``where``, or the function a ``"module:function"`` names (its module imported now)."""
    if callable(where):
        return where
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)


def _parser(command: str | None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``jaxformer`` parser (its help lists the commands) and each command's own parser; only ``command``'s
    arguments are declared (some need their package imported)."""
    p = argparse.ArgumentParser(prog="jaxformer", description="Train, evaluate and sample Transformers.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (help_, declare, _) in COMMANDS.items():
        c = sub.add_parser(name, help=help_)
        if name != command:
            continue
        if name in HF_HELP:  # the model to load: a run directory, or --hf DIR [--dtype] [--adapter]
            c.add_argument("run_dir", nargs="?")
            c.add_argument("--hf", metavar="DIR", help=HF_HELP[name])
            c.add_argument("--dtype", default="float32", choices=DTYPES, help="with --hf: parameter and compute dtype")
            c.add_argument("--adapter", metavar="PEFT_DIR", help="with --hf: a peft LoRA adapter to apply (merged)")
        _function(declare)(c.add_argument)
    return p, sub.choices


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
            return _function(COMMANDS[args.command][2])(args)
    except (ConfigError, NonFiniteError, IncompatibleCheckpointError, FileNotFoundError, ValueError) as e:
        print(f"jaxformer {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:  # SIGINT / SIGTERM: checkpointed, and its line (where, how to resume) printed
        return e.exit_code


def run() -> None:
    """The ``jaxformer`` command (and ``python -m jaxformer.cli``): :func:`main`; for ``train``, in a process started
    again first where glibc's malloc should ask for huge pages
    (:func:`jaxformer.train.host_memory.restart_with_huge_pages`: a CPU train step 1.2-1.4x faster; the other
    commands are not measured with it yet)."""
    if sys.argv[1:2] == ["train"]:
        from jaxformer.train.host_memory import restart_with_huge_pages

        restart_with_huge_pages()
    sys.exit(main())


if __name__ == "__main__":
    run()
