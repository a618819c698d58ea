"""Text in, JSON records out: the engine behind ``jaxformer generate --prompt / --prompts-file``.

The tokenizer is duck-typed (``encode(str) -> ids``, ``decode(ids) -> str``, optional
``bos_id`` / ``eos_id``; a prompt is ``[bos] + encode(text)``, or ``encode_prompt(text)`` when the
tokenizer has it, as a Hugging Face checkpoint's does), so this module needs nothing from
``jaxformer.train``.
A prompts file holds one request per line: plain text, or a JSON object
``{"prompt": ..., "max_new_tokens": ..., "temperature": ..., "top_k": ..., "top_p": ...,
"seed": ...}`` overriding the command line's sampling for that request. A bad
request (bad JSON, empty prompt, too long, invalid sampling) yields a record with
``"error"`` and the others run on.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from jaxformer.decode.engine import Engine
from jaxformer.decode.sampling import SamplingParams

OVERRIDES = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")


def read_prompts_file(path: str | Path) -> list[str | dict]:
    """Requests from a UTF-8 file (a byte-order mark at its start ignored), one per non-blank line (a JSON object
    with "prompt", or raw text).

    A line that starts with ``{`` but is not valid JSON stays a dict ``{"error": ...}``, answered
    with an error record.
    """
    out: list[str | dict] = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8-sig").splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                out.append({"error": f"{path}:{n}: invalid JSON: {e}", "prompt": line})
                continue
            out.append(obj)
        else:
            out.append(line)
    return out


def _request(item: str | dict, defaults: dict, index: int) -> tuple[str, SamplingParams]:
    if isinstance(item, str):
        item = {"prompt": item}
    if not isinstance(item, dict):
        raise ValueError(f"request {index}: expected a string or an object, got {type(item).__name__}")
    if "error" in item:
        raise ValueError(item["error"])
    unknown = sorted(set(item) - {"prompt", *OVERRIDES})
    if unknown:
        raise ValueError(f"request {index}: unknown keys {unknown}; allowed: prompt, {', '.join(OVERRIDES)}")
    prompt = item.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError(f"request {index}: \"prompt\" must be a string, got {prompt!r}")
    if not prompt:
        raise ValueError(f"request {index}: empty prompt")
    return prompt, dataclasses.replace(SamplingParams(), **{**defaults, **{k: item[k] for k in OVERRIDES if k in item}})


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """``jaxformer generate``'s sampling defaults (a prompts-file line may set its own) and engine sizing."""

    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0  # request i samples with seed + i
    num_pages: int | None = None  # default: max_batch sequences of the longest request
    page_size: int = 16
    max_batch: int = 8
    chunk_size: int = 256
    window: int | None = None

    @classmethod
    def from_args(cls, args, **given) -> GenerateOptions:
        """The options of a parsed command line (its attributes of the same names), ``given`` over them."""
        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**{**fields, **given})


def add_generate_options(a) -> None:
    """``jaxformer generate``'s prompt and output arguments and the :class:`GenerateOptions` (all but
    ``chunk_size``) on a parser's ``add_argument`` ``a``."""
    a("--prompt", action="append", default=[], help="prompt text (repeatable)")
    a("--prompts-file", help='one request per line: text, or JSON {"prompt": ..., "temperature": ...}; writes '
      "one JSON line per request")
    a("--output", help="write one JSON line per request to this path (with --prompt too; default: stdout "
      "with --prompts-file)")
    a("--window", type=int, help="sliding KV window W <= the model's context (RoPE/ALiBi models): generate past "
      "the context, each new token seeing the last W positions")
    a("--max-new-tokens", type=int, default=200)
    a("--temperature", type=float, default=0.8)
    a("--top-k", type=int)
    a("--top-p", type=float)
    a("--seed", type=int, default=0)
    a("--num-pages", type=int, help="KV pages per layer (default: max-batch full-length sequences)")
    a("--page-size", type=int, default=16)
    a("--max-batch", type=int, default=8)


def run_prompts(graphdef, state, config, tokenizer, prompts: Sequence[str | dict],
                options: GenerateOptions = GenerateOptions()) -> list[dict[str, Any]]:
    """Generate for every prompt on one continuous-batching :class:`Engine`; one record per prompt.

    Sampling and sizes from ``options`` (:class:`GenerateOptions`). Request ``i`` samples with ``seed + i``
    unless it sets its own. The engine's ``max_context`` is what
    the requests can reach (the longest prompt plus its new tokens, at most the model's context), and
    ``num_pages`` defaults to enough for ``max_batch`` sequences each holding that many. Prompts are computed
    ``chunk_size`` tokens per step (256: a 512-token prompt on a 135M model's engine steps in 0.66-0.73 s against
    0.77-0.79 s in chunks of 128 and 0.63 s in one of 512, 2 Intel cores; 512 would pad a 300-token prompt to 512
    rows; ``experiments/results/decode_cpu.md``). ``window``: a sliding
    KV window, so generation may run past the context (RoPE / ALiBi models; see
    :mod:`jaxformer.decode.engine`). Each record: ``index, prompt, completion, tokens,
    finish_reason ("stop" | "length" | "error"), stopped_by ("stop_token" |
    "max_new_tokens" | "context" | "error"), error, num_prompt_tokens, num_preemptions``.
    """
    o = options
    stop = stop_token_ids(tokenizer)  # the same ends as the server's
    records: list[dict[str, Any]] = []
    requests: list[tuple[list[int], SamplingParams] | None] = []
    for i, item in enumerate(prompts):
        defaults = dict(max_new_tokens=o.max_new_tokens, temperature=o.temperature, top_k=o.top_k or 0,
                        top_p=1.0 if o.top_p is None else o.top_p, seed=o.seed + i, stop_tokens=stop)
        text = item.get("prompt") if isinstance(item, dict) else item
        records.append(dict(index=i, prompt=text if isinstance(text, str) else None, completion="",
                            tokens=[], finish_reason="error", stopped_by="error", error=None, num_prompt_tokens=0,
                            num_preemptions=0))
        try:
            text, params = _request(item, defaults, i)
            token_ids = encode_prompt(tokenizer, text)
        except (ValueError, TypeError) as e:
            records[-1]["error"] = str(e)
            requests.append(None)
            continue
        records[-1]["num_prompt_tokens"] = len(token_ids)
        requests.append((token_ids, params))
    context = requests_context([r for r in requests if r is not None], config.max_seq_len)
    engine = Engine(graphdef, state, config, num_pages=o.num_pages, page_size=o.page_size, max_batch=o.max_batch,
                    chunk_size=o.chunk_size, max_context=context, window=o.window)
    ids = [None if r is None else engine.submit(*r, request_id=i) for i, r in enumerate(requests)]
    results = engine.run()
    for i, (rec, rid) in enumerate(zip(records, ids)):
        if rid is None:
            continue
        r = results[rid]
        context = completion_context(tokenizer.decode, requests[i][0])
        rec.update(finish_reason=r.finish_reason, stopped_by=r.stopped_by, error=r.error, tokens=r.tokens,
                   completion=decode_completion(tokenizer.decode, context, [t for t in r.tokens if t not in stop]),
                   num_preemptions=r.num_preemptions)
    return records


CONTEXT_TOKENS = 4
"""How many of the prompt's last tokens a completion is decoded after (:func:`completion_context`)."""


def completion_context(decode, prompt: Sequence[int], n: int = CONTEXT_TOKENS) -> list[int]:
    """The prompt's last ``n`` tokens, which a completion is decoded after and then cut from: a decoder that drops
    the first space of what it decodes (SentencePiece's, Llama-2's and Mistral's) would drop the space between
    the prompt and the completion's first word. Empty (the completion decoded alone) where they decode to no
    text or end in an incomplete character, which the completion's first tokens may finish."""
    ctx = [int(t) for t in prompt[len(prompt) - min(n, len(prompt)):]]
    text = decode(ctx) if ctx else ""
    return ctx if text and not text.endswith("\ufffd") else []


def decode_completion(decode, context: Sequence[int], tokens: Sequence[int]) -> str:
    """``tokens``' text as it continues ``context`` (:func:`completion_context`): ``decode(context + tokens)``
    past ``decode(context)``, or ``decode(tokens)`` where the first does not start with the second."""
    if not context:
        return decode(list(tokens))
    head, full = decode(list(context)), decode([*context, *tokens])
    return full[len(head):] if full.startswith(head) else decode(list(tokens))


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A prompt's token ids as every generation path encodes it: a checkpoint's tokenizer adds its own
    specials (``encode_prompt``); any other gets its BOS (if it has one) before ``encode(text)``."""
    if hasattr(tokenizer, "encode_prompt"):
        return [int(t) for t in tokenizer.encode_prompt(text)]
    bos = getattr(tokenizer, "bos_id", None)
    return ([] if bos is None else [int(bos)]) + [int(t) for t in tokenizer.encode(text)]


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """The ids that end a choice: the tokenizer's EOS, and a Hugging Face checkpoint's
    ``generation_config.json`` ``eos_token_id`` (an int or a list: chat models often end a turn on another)."""
    ids = [] if getattr(tokenizer, "eos_id", None) is None else [int(tokenizer.eos_id)]
    path = getattr(tokenizer, "path", None)
    file = Path(path) / "generation_config.json" if path is not None else None
    if file is not None and file.is_file():
        eos = json.loads(file.read_text()).get("eos_token_id")
        ids += [eos] if isinstance(eos, int) else [i for i in eos or [] if isinstance(i, int)]
    return tuple(dict.fromkeys(ids))


def requests_context(requests: Sequence[tuple[Sequence[int], SamplingParams]], max_seq_len: int) -> int:
    """Longest sequence the requests can reach: a prompt plus its ``max_new_tokens``, at most ``max_seq_len``
    (an engine of this ``max_context`` gives each request what one of ``max_seq_len`` would)."""
    # an invalid max_new_tokens counts as 1, so its request still fails on that, not on the context
    need = [len(p) + (max(s.max_new_tokens, 1) if isinstance(s.max_new_tokens, int) else 1) for p, s in requests]
    return max(1, min(max(need, default=1), max_seq_len))


def write_jsonl(records: Sequence[dict], out: str | Path | IO[str] = sys.stdout) -> None:
    """One JSON object per line, to a path or an open text stream."""
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if isinstance(out, (str, Path)):
        Path(out).write_text(lines, encoding="utf-8")
    else:
        out.write(lines)


def report_records(records: Sequence[dict], config, *, window: int | None = None, jsonl: bool = False,
                   output: str | Path | None = None) -> int:
    """Print what :func:`run_prompts` answered as ``jaxformer generate`` does; return its exit code.

    ``jsonl`` (a prompts file, or ``--output``): one JSON line per request to ``output`` (default stdout), exit 1
    if any failed (the others were answered; the error is in its line). Else each prompt + completion
    (``----- completion i of n -----`` lines between several), an error as a usage error (exit 2). Notes on
    stderr: a completion the model's context cut (with the way on, ``--window``, where the positions allow it),
    and generation past the context with a sliding ``window``.
    """
    from jaxformer.decode.engine import RELATIVE_POSITIONS

    ctx = config.max_seq_len
    if window is not None and any(r["num_prompt_tokens"] + len(r["tokens"]) - 1 > ctx
                                  for r in records if r["error"] is None):  # a position past the context was fed
        print(f"note: generated past the model's {ctx}-token context with a sliding {window}-token window "
              f"(each new token sees the last {window} positions)", file=sys.stderr)
    if jsonl:
        write_jsonl(records, output or sys.stdout)
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
            hint = (f"pass --window N (N <= {ctx}) to continue with a sliding window"
                    if config.positions.kind in RELATIVE_POSITIONS else
                    f"this model's positions.kind={config.positions.kind!r} cannot go past it")
            print(f"note: {name} stopped at the model's {ctx}-token context after {len(r['tokens'])} new tokens; "
                  f"{hint}", file=sys.stderr)
    if any(r["error"] for r in records):
        return 1 if jsonl else 2
    return 0
