"""The OpenAI API's request fields, checked, and its response bodies, built: no HTTP here.

A bad field is an :class:`APIError` whose :meth:`~APIError.body` is OpenAI's error object
``{"error": {"message", "type", "param", "code"}}``, naming the field and what it must be. ``null`` means
the default, as in OpenAI's API. Fields the server does not implement are refused when they would change
the answer (``presence_penalty: 0.5``) and ignored when they would not (``presence_penalty: 0``, ``user``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

MAX_N = 128
MAX_LOGPROBS = 20
SEED_LIMIT = 2**32


class APIError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _kind(value) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__) if value is not None else "null"


def _int(body: dict, name: str, default, *, low: int | None = None, high: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise APIError(400, f"{name}: expected an integer, got {_kind(v)} {v!r}", param=name, code="invalid_type")
    if (low is not None and v < low) or (high is not None and v > high):
        where = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise _bad(name, f"{v} must be {where}")
    return v


def _number(body: dict, name: str, default: float, *, low: float, high: float, open_low: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise APIError(400, f"{name}: expected a number, got {_kind(v)} {v!r}", param=name, code="invalid_type")
    if v < low or v > high or (open_low and v == low):
        raise _bad(name, f"{v} must be in {'(' if open_low else '['}{low}, {high}]")
    return float(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(400, f"{name}: expected a boolean, got {_kind(v)} {v!r}", param=name, code="invalid_type")
    return v


UNSUPPORTED = (("presence_penalty", (0, 0.0)), ("frequency_penalty", (0, 0.0)), ("logit_bias", ({},)),
               ("suffix", ("",)), ("tools", ([],)), ("functions", ([],)), ("tool_choice", ("none", "auto")),
               ("function_call", ("none", "auto")),
               # vLLM's and text-generation-inference's sampling extensions, which harnesses send to such servers
               ("min_p", (0, 0.0)), ("repetition_penalty", (1, 1.0)), ("length_penalty", (1, 1.0)),
               ("ignore_eos", (False,)), ("min_tokens", (0,)), ("stop_token_ids", ([],)), ("bad_words", ([],)),
               ("use_beam_search", (False,)), ("include_stop_str_in_output", (False,)),
               ("skip_special_tokens", (True,)), ("guided_json", ()), ("guided_regex", ()), ("guided_choice", ()),
               ("guided_grammar", ()), ("structured_outputs", ()), ("prompt_logprobs", ()),
               ("truncate_prompt_tokens", ()))
"""``(field, values that change nothing)``: a field the server does not implement, refused (400) with any other
value; ``None`` (JSON ``null``) always means the default."""


def _unsupported(body: dict, name: str, inert) -> None:
    v = body.get(name)
    if v is not None and v not in inert:
        raise APIError(400, f"{name}: not supported by this server (got {v!r})", param=name, code="unsupported")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The sampling fields of a completion or chat request, checked. ``max_tokens`` None: up to the
    context; ``seed`` None: the server draws one; ``top_logprobs`` None: no log-probabilities."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    n: int
    stream: bool
    include_usage: bool
    top_logprobs: int | None
    echo: bool


def parse_sampling(body: dict, *, chat: bool) -> Sampling:
    """The fields both endpoints share (and ``logprobs`` / ``echo``, which differ between them)."""
    for name, inert in UNSUPPORTED:
        _unsupported(body, name, inert)
    n = _int(body, "n", 1, low=1, high=MAX_N)
    best_of = _int(body, "best_of", None, low=1)
    if best_of is not None and best_of != n:
        raise APIError(400, f"best_of: {best_of} != n={n} is not supported (every sampled choice is returned)",
                       param="best_of", code="unsupported")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise APIError(400, f"response_format: only {{'type': 'text'}} is supported, got {fmt!r}",
                       param="response_format", code="unsupported")
    max_tokens = _int(body, "max_tokens", None if chat else 16, low=0)
    if chat:
        max_tokens = _int(body, "max_completion_tokens", max_tokens, low=0)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > 16:
            raise _bad("stop", f"at most 16 stop strings, got {len(stop)}")
        stop = tuple(stop)
    else:
        raise APIError(400, f"stop: expected a string or an array of strings, got {_kind(stop)} {stop!r}",
                       param="stop", code="invalid_type")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, f"stream_options: expected an object, got {_kind(options)}", param="stream_options",
                       code="invalid_type")
    stream = _bool(body, "stream")
    include_usage = _bool(options or {}, "include_usage")
    if chat:
        echo, want = False, _bool(body, "logprobs")
        top = _int(body, "top_logprobs", None, low=0, high=MAX_LOGPROBS)
        if top is not None and not want:
            raise _bad("top_logprobs", "needs logprobs: true")
        top_logprobs = (top or 0) if want else None
    else:
        echo = _bool(body, "echo")
        top_logprobs = _int(body, "logprobs", None, low=0, high=MAX_LOGPROBS)
    if max_tokens == 0 and not echo:
        raise _bad("max_tokens", "0 generates nothing; give max_tokens >= 1 (0 goes with echo: true, to score "
                                 "the prompt)")
    seed = _int(body, "seed", None, low=0, high=SEED_LIMIT - 1)
    return Sampling(max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, low=0.0, high=2.0),
                    top_p=_number(body, "top_p", 1.0, low=0.0, high=1.0),
                    top_k=max(_int(body, "top_k", 0, low=-1), 0), seed=seed, stop=stop, n=n, stream=stream,
                    include_usage=include_usage, top_logprobs=top_logprobs, echo=echo)


def parse_prompt(body: dict, vocab_size: int) -> list[str | list[int]]:
    """``prompt``: a string, an array of strings, an array of token ids, or an array of such arrays."""
    p = body.get("prompt")
    if isinstance(p, str):
        out = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        out = list(p)
    elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        out = [list(p)]
    elif isinstance(p, list) and p and all(isinstance(x, list) and x and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x) for x in p):
        out = [list(x) for x in p]
    else:
        raise APIError(400, "prompt: expected a string, an array of strings, an array of token ids or an array of "
                       f"such arrays (none empty), got {_kind(p)} {str(p)[:80]!r}", param="prompt",
                       code="invalid_type" if p is not None else "missing")
    for x in out:
        if x == "":
            raise _bad("prompt", "empty prompt")
        if isinstance(x, list) and (bad := [t for t in x if not 0 <= t < vocab_size]):
            raise _bad("prompt", f"token ids {bad[:5]} are not in the vocabulary [0, {vocab_size})")
    return out


def parse_messages(body: dict) -> list[dict]:
    """``messages``: ``[{"role": str, "content": str | [{"type": "text", "text": str}, ...] | null}, ...]``,
    content parts joined into one string (what a chat template renders)."""
    ms = body.get("messages")
    if not isinstance(ms, list) or not ms:
        raise APIError(400, f"messages: expected a non-empty array of messages, got {_kind(ms)}", param="messages",
                       code="invalid_type" if ms is not None else "missing")
    out = []
    for i, m in enumerate(ms):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"{where}: expected an object with a string role, got {str(m)[:80]!r}",
                           param=where, code="invalid_type")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise APIError(400, f"{where}.content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) "
                                   f"are supported, got {str(part)[:80]!r}", param=f"{where}.content",
                                   code="unsupported")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is not None and not isinstance(content, str):
            raise APIError(400, f"{where}.content: expected a string or an array of text parts, got "
                           f"{_kind(content)}", param=f"{where}.content", code="invalid_type")
        out.append({**m, "content": content if content is not None else ""})
    return out


# -- responses

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclasses.dataclass
class Scored:
    """Log-probabilities of some tokens: ``tokens`` (ids), ``logprobs`` (None where there is none: a
    sequence's first token), ``top``: per token ``[(id, logprob), ...]`` most likely first (or None)."""

    tokens: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None]

    def __getitem__(self, s: slice) -> Scored:
        return Scored(self.tokens[s], self.logprobs[s], self.top[s])

    def __len__(self) -> int:
        return len(self.tokens)


def scored(sequence: Sequence[int], lp, start: int, stop: int) -> Scored:
    """Tokens ``sequence[start:stop]`` with their log-probabilities from ``lp``
    (:class:`jaxformer.decode.scoring.TokenLogprobs` over ``sequence``: entry ``k - 1`` is token ``k``'s)."""
    tokens, logprobs, top = [], [], []
    for k in range(start, stop):
        tokens.append(int(sequence[k]))
        if k == 0:
            logprobs.append(None)
            top.append(None)
        else:
            logprobs.append(float(lp.logprobs[k - 1]))
            top.append([(int(i), float(v)) for i, v in zip(lp.top_ids[k - 1], lp.top_logprobs[k - 1])])
    return Scored(tokens, logprobs, top)


def completion_logprobs(s: Scored, piece, offsets: list[int], width: int) -> dict:
    """The completions API's ``logprobs`` object for scored tokens; ``piece(id) -> str``; ``offsets``: each
    token's character offset in the returned text; ``width``: top entries asked for."""
    def top(entry):
        if entry is None:
            return None
        out: dict[str, float] = {}
        for i, v in entry[:width]:
            out.setdefault(piece(i), v)  # two ids may print alike (partial UTF-8): keep the likelier
        return out

    return {"tokens": [piece(t) for t in s.tokens], "token_logprobs": s.logprobs,
            "top_logprobs": [top(e) for e in s.top], "text_offset": offsets}


def chat_logprobs(s: Scored, piece, width: int, piece_bytes=None) -> dict:
    """The chat API's ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``;
    ``piece_bytes(id) -> list[int]``: a token's own bytes (a part of a character too), ``token`` then what they
    read as; default: ``token`` is ``piece(id)`` and ``bytes`` its UTF-8, which cannot carry a part."""
    def entry(i: int, v: float) -> dict:
        if piece_bytes is None:
            text = piece(i)
            return {"token": text, "logprob": v, "bytes": list(text.encode("utf-8"))}
        raw = piece_bytes(i)  # the token as its bytes read (a SentencePiece piece's space included)
        return {"token": bytes(raw).decode("utf-8", errors="replace"), "logprob": v, "bytes": raw}

    return {"content": [{**entry(t, v), "top_logprobs": [entry(i, w) for i, w in (top or [])[:width]]}
                        for t, v, top in zip(s.tokens, s.logprobs, s.top)]}


def model_card(name: str, created: int, max_context: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "jaxformer", "max_model_len": max_context}
