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

from jaxformer.decode.engine import Engine, pages_per_sequence
from jaxformer.decode.sampling import SamplingParams

OVERRIDES = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")


def read_prompts_file(path: str | Path) -> list[str | dict]:
    """Requests from a file, one per non-blank line (a JSON object with "prompt", or raw text).

    A line that starts with ``{`` but is not valid JSON stays a dict ``{"error": ...}``, answered
    with an error record.
    """
    out: list[str | dict] = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
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


def run_prompts(graphdef, state, config, tokenizer, prompts: Sequence[str | dict], *, max_new_tokens: int = 200,
                temperature: float = 0.8, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                num_pages: int | None = None, page_size: int = 16, max_batch: int = 8, chunk_size: int = 128,
                window: int | None = None) -> list[dict[str, Any]]:
    """Generate for every prompt on one continuous-batching :class:`Engine`; one record per prompt.

    Request ``i`` samples with ``seed + i`` unless it sets its own. The engine's ``max_context`` is what
    the requests can reach (the longest prompt plus its new tokens, at most the model's context), and
    ``num_pages`` defaults to enough for ``max_batch`` sequences each holding that many. Prompts are computed
    ``chunk_size`` tokens per step (128: a 512-token prompt on a 135M model in 0.66 s against 0.81 s in chunks of
    64, 2 CPU cores; ``experiments/results/decode_cpu.md``). ``window``: a sliding
    KV window, so generation may run past the context (RoPE / ALiBi models; see
    :mod:`jaxformer.decode.engine`). Each record: ``index, prompt, completion, tokens,
    finish_reason ("stop" | "length" | "error"), stopped_by ("stop_token" |
    "max_new_tokens" | "context" | "error"), error, num_prompt_tokens, num_preemptions``.
    """
    eos = getattr(tokenizer, "eos_id", None)
    stop = () if eos is None else (int(eos),)
    records: list[dict[str, Any]] = []
    requests: list[tuple[list[int], SamplingParams] | None] = []
    for i, item in enumerate(prompts):
        defaults = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k or 0,
                        top_p=1.0 if top_p is None else top_p, seed=seed + i, stop_tokens=stop)
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
    L = page_size
    if num_pages is None:
        num_pages = max_batch * pages_per_sequence(context, L, window)
    engine = Engine(graphdef, state, config, num_pages=num_pages, page_size=L, max_batch=max_batch,
                    chunk_size=chunk_size, max_context=context, window=window)
    ids = [None if r is None else engine.submit(*r, request_id=i) for i, r in enumerate(requests)]
    results = engine.run()
    for rec, rid in zip(records, ids):
        if rid is None:
            continue
        r = results[rid]
        rec.update(finish_reason=r.finish_reason, stopped_by=r.stopped_by, error=r.error, tokens=r.tokens,
                   completion=tokenizer.decode([t for t in r.tokens if t != (eos if eos is not None else -1)]),
                   num_preemptions=r.num_preemptions)
    return records


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A prompt's token ids as every generation path encodes it: a checkpoint's tokenizer adds its own
    specials (``encode_prompt``); any other gets its BOS (if it has one) before ``encode(text)``."""
    if hasattr(tokenizer, "encode_prompt"):
        return [int(t) for t in tokenizer.encode_prompt(text)]
    bos = getattr(tokenizer, "bos_id", None)
    return ([] if bos is None else [int(bos)]) + [int(t) for t in tokenizer.encode(text)]


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
