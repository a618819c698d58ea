"""``jaxformer train | eval | info | generate``: a thin argparse layer over ``jaxformer.train``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxformer", description="Train, evaluate and sample Transformers.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train (or resume) an experiment")
    t.add_argument("config", help="experiment YAML, e.g. experiments/configs/stdlib_bytes.yaml")
    t.add_argument("overrides", nargs="*", help="key.sub=value overrides (values parsed as YAML)")
    t.add_argument("--run-dir", help="default: runs/<config name>; an existing run directory resumes")
    t.add_argument("--steps", type=int, help="total number of steps (overrides the config)")

    e = sub.add_parser("eval", help="validation loss and bits per byte of a run's newest checkpoint")
    e.add_argument("run_dir")
    e.add_argument("--max-tokens", type=int, default=-1, help="validation tokens (default: the config's final eval)")
    e.add_argument("--all", action="store_true", help="the whole validation split")
    e.add_argument("--compressors", action="store_true", help="also gzip -9 / xz -9e bits per byte")

    i = sub.add_parser("info", help="parameters, FLOPs/token and memory per device")
    i.add_argument("target", help="an experiment YAML or a preset name")
    i.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    i.add_argument("--devices", type=int, help="plan for this many devices (default: those present)")

    g = sub.add_parser("generate", help="sample from a run's newest checkpoint (continuous-batching engine, paged KV cache)")
    add_generate_args(g)
    return p


def add_generate_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("run_dir")
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


def cmd_train(args) -> int:
    from jaxformer.train import config as C
    from jaxformer.train.loop import train

    overrides = list(args.overrides) + ([f"steps={args.steps}"] if args.steps is not None else [])
    cfg = C.load(args.config, overrides)
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / Path(args.config).stem
    summary = train(cfg, run_dir)
    print(json.dumps({k: v for k, v in summary.items() if k != "sample"}))
    return 0


def cmd_eval(args) -> int:
    from jaxformer.train.loop import evaluate_run

    limit = None if args.all else args.max_tokens
    print(json.dumps(evaluate_run(args.run_dir, max_tokens=limit, compressors=args.compressors)))
    return 0


def cmd_info(args) -> int:
    from jaxformer.model import presets
    from jaxformer.train import config as C
    from jaxformer.train.info import describe, describe_experiment, format_info

    if args.target in presets.names():
        model = presets.get(args.target)
        if args.overrides:
            model = C.from_dict({"model": {"preset": args.target}, "seq_len": 2}, args.target,
                                [f"model.{o}" for o in args.overrides]).model
        d = describe(model, mesh_shape={"data": 1, "fsdp": 1, "tensor": 1}, batch_size=1,
                     seq_len=min(model.max_seq_len, 2048))
    else:
        d = describe_experiment(C.load(args.target, args.overrides), args.devices)
    print(format_info(args.target, d))
    return 0


def cmd_generate(args) -> int:
    """Continue prompts on the continuous-batching engine over a paged KV cache."""
    from jaxformer.decode.serve import read_prompts_file, run_prompts, write_jsonl
    from jaxformer.train.loop import load_run

    if not args.prompt and not args.prompts_file:
        raise ValueError("generate: give --prompt TEXT (repeatable) or --prompts-file FILE")
    cfg, trainer, params, tok, _ = load_run(args.run_dir)
    if tok is None:
        raise ValueError(f"{args.run_dir}: source='bin' has no text tokenizer to encode prompts")
    prompts = list(args.prompt) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    records = run_prompts(trainer.graphdef, params, cfg.model, tok, prompts, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          num_pages=args.num_pages, page_size=args.page_size, max_batch=args.max_batch)
    if args.prompts_file:
        write_jsonl(records, args.output or sys.stdout)
    else:
        for r in records:
            if r["error"] is None:
                print(r["prompt"] + r["completion"])
            else:
                print(f"error: {r['error']}", file=sys.stderr)
    return 1 if any(r["error"] for r in records) else 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "info": cmd_info, "generate": cmd_generate}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    bad = [x for x in extra if "=" not in x or x.startswith("-") or not hasattr(args, "overrides")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    from jaxformer.train.checkpoint import IncompatibleCheckpointError
    from jaxformer.train.config import ConfigError
    from jaxformer.train.loop import NonFiniteError

    try:
        return COMMANDS[args.command](args)
    except (ConfigError, NonFiniteError, IncompatibleCheckpointError, FileNotFoundError, ValueError) as e:
        print(f"jaxformer {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
