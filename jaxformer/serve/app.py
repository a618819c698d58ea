"""The HTTP side: FastAPI routes speaking the OpenAI API over one :class:`EngineWorker`.

``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /metrics``.
A request is checked (:mod:`jaxformer.serve.protocol`), tokenized, checked against the context and the
page pool (400 naming the limit), split into choices (prompt ``p``'s choice ``c`` is choice ``p * n + c``,
sampled with seed ``seed + p * n + c``: ``jaxformer generate`` gives its prompt ``i`` seed ``seed + i``) and
submitted; a full queue answers 429 at once. Each choice's tokens become text through a
:class:`~jaxformer.serve.text.TextStream`, streamed (server-sent events) or gathered; a stop string ends the
choice and cancels its engine request, and so does a client that goes away.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from jaxformer.decode.prompts import completion_context, encode_prompt, stop_token_ids
from jaxformer.decode.sampling import SamplingParams
from jaxformer.serve import protocol as P
from jaxformer.serve.text import TextStream, prefix_lengths
from jaxformer.serve.worker import Choice, EngineWorker, Job, QueueFull, ShuttingDown

FINISH = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}
DISCONNECT_POLL_S = 0.5


@dataclasses.dataclass
class _State:
    """One choice as the handler sees it."""

    index: int
    rid: int
    prompt: list[int]
    prompt_text: str
    stream: TextStream
    tokens: list[int] = dataclasses.field(default_factory=list)  # every token the engine sent
    finish_reason: str | None = None
    error: str | None = None
    scores: object = None  # TokenLogprobs over prompt + tokens
    cancel_sent: bool = False
    covered: int = 0  # generated tokens already in an emitted chunk
    token_offsets: list[int] | None = None  # text offset of every generated token, once the choice is done

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Service:
    """What the routes need: the worker, the tokenizer and the limits (see the module docstring)."""

    def __init__(self, worker: EngineWorker, tokenizer, *, name: str, metrics):
        self.worker, self.tok, self.name, self.metrics = worker, tokenizer, name, metrics
        engine = worker.engine
        self.max_context, self.vocab_size = engine.max_context, engine.config.vocab_size
        self.page_size, self.num_pages, self.window = engine.manager.page_size, engine.manager.num_pages, engine.window
        self.stop_tokens = stop_token_ids(tokenizer)
        self.created = int(time.time())
        self._pieces: dict[int, str] = {}
        chat = getattr(tokenizer, "hf", tokenizer)  # a run's HFTextTokenizer wraps the checkpoint's own
        self.chat = chat if getattr(chat, "chat_template", None) is not None else None

    # -- requests in
    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise P.APIError(400, f"'model' must be a string, got {P._kind(model)}", param="model",
                             code="invalid_type")
        if model is not None and model != self.name:
            raise P.APIError(404, f"The model {model!r} does not exist; this server serves {self.name!r} "
                             "(GET /v1/models)", param="model", code="model_not_found")

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """As ``jaxformer generate`` encodes a prompt: the checkpoint's specials (``encode_prompt``), else BOS."""
        return prompt if isinstance(prompt, list) else encode_prompt(self.tok, prompt)

    def render_chat(self, messages: list[dict]) -> list[int]:
        """``messages`` through the checkpoint's chat template, encoded as transformers' ``apply_chat_template``
        does (no specials added: the template writes them)."""
        if self.chat is None:
            raise P.APIError(400, f"model {self.name!r} has no chat template (a checkpoint's tokenizer_config.json "
                             "chat_template or chat_template.jinja); use /v1/completions with a prompt",
                             param="messages", code="no_chat_template")
        try:
            text = self.chat.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # jinja2's TemplateError: the template refused these messages
            raise P.APIError(400, f"messages: the chat template failed: {e}", param="messages",
                             code="chat_template_error") from None
        return [int(t) for t in self.tok.encode(text)]

    def max_new(self, prompt: list[int], sampling: P.Sampling, field: str) -> int:
        """The choice's ``max_new_tokens`` (0: score only; default: what the context and the pool leave);
        400 naming the limit when it cannot fit alone. ``field``: where the prompt came from."""
        n, L = len(prompt), self.page_size
        if n == 0:  # text a tokenizer with no BOS cannot spell (or that is all specials), or an empty chat turn
            raise P.APIError(400, "the prompt encodes to no tokens (this tokenizer adds none of its own and spells "
                             "none of its text)", param=field, code="invalid_value")
        if n > self.max_context or (n == self.max_context and sampling.max_tokens != 0):
            raise P.APIError(400, f"This model's maximum context length is {self.max_context} tokens; the prompt "
                             f"has {n} tokens", param=field, code="context_length_exceeded")
        m = sampling.max_tokens
        if m is None:
            m = self.max_context - n
            if self.window is None:
                m = max(1, min(m, self.num_pages * L - n + 1))
        if n + m > self.max_context:
            raise P.APIError(400, f"This model's maximum context length is {self.max_context} tokens; the request "
                             f"asks for {n + m} ({n} in the prompt, {m} in the completion): lower max_tokens",
                             param="max_tokens", code="context_length_exceeded")
        if m > 0:
            need = self.worker.engine.pages_needed(n, m)
            if need > self.num_pages:
                raise P.APIError(400, f"the request needs {need} KV-cache pages of {L} tokens ({n} prompt + {m} new "
                                 f"tokens) and the pool has num_pages={self.num_pages} (jaxformer serve --num-pages); "
                                 "lower max_tokens", param="max_tokens", code="too_many_pages")
        return m

    def choices(self, prompts: list[list[int]], sampling: P.Sampling, field: str) -> list[Choice]:
        total = len(prompts) * sampling.n
        if total > self.worker.max_queue:
            raise P.APIError(400, f"the request has {total} choices (prompts x n) and at most max_queue="
                             f"{self.worker.max_queue} may wait", param="n", code="too_many_choices")
        base = secrets.randbelow(P.SEED_LIMIT - total + 1) if sampling.seed is None else sampling.seed
        if base + total > P.SEED_LIMIT:
            raise P.APIError(400, f"seed: choice i samples with seed + i, so seed + {total} choices must be "
                             f"<= 2**32; got seed={base}", param="seed", code="invalid_value")
        out = []
        for p, ids in enumerate(prompts):
            m = self.max_new(ids, sampling, field)
            for c in range(sampling.n):
                j = p * sampling.n + c
                params = None if m == 0 else SamplingParams(
                    temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=base + j,
                    max_new_tokens=m, stop_tokens=self.stop_tokens)
                out.append(Choice(ids, params, top=sampling.top_logprobs))
        return out

    # -- text out
    def piece(self, token: int) -> str:
        if token not in self._pieces:
            self._pieces[token] = self.tok.decode([token])
        return self._pieces[token]

    def text_stream(self, prompt: list[int], stop=()) -> TextStream:
        """The text of a choice continuing ``prompt``, decoded after its last tokens (a SentencePiece decoder
        would drop its first space alone), stop strings ``stop``, the stop tokens not text."""
        return TextStream(self.tok.decode, stop, self.stop_tokens, completion_context(self.tok.decode, prompt))

    def piece_bytes(self, token: int) -> list[int]:
        """The bytes token ``token`` stands for (a part of a character included), where the tokenizer can say;
        else its :meth:`piece`'s UTF-8."""
        of = getattr(self.tok, "piece_bytes", None)
        return list(of(token) if of is not None else self.piece(token).encode("utf-8"))

    def offsets(self, tokens: list[int], base: int, limit: int, context: list[int] = ()) -> list[int]:
        """Character offset of each token in the returned text: ``base`` plus the length its predecessors
        decode to after ``context`` (at most ``limit``)."""
        return [base + min(n, limit) for n in prefix_lengths(self.tok.decode, tokens, context)]

    def update(self, st: _State, tokens, result, scores) -> str:
        """Feed one update to a choice; the text it makes certain."""
        if st.done:
            return ""
        st.tokens += tokens
        delta = st.stream.add(tokens)
        if st.stream.stopped and not st.cancel_sent:
            self.worker.cancel([st.rid], ended=True)  # a stop string ended it: the engine need not go on
            st.cancel_sent = True
        if result is not None:
            if result.finish_reason == "error":
                st.error = result.error or "the engine failed"
            if not st.stream.stopped:
                delta += st.stream.finish()
            st.finish_reason = "stop" if st.stream.stopped else FINISH.get(result.finish_reason, "stop")
            st.scores = scores
            st.tokens = list(result.tokens)
        return delta

    def logprobs(self, st: _State, sampling: P.Sampling, chat: bool, a: int, b: int, with_prompt: bool):
        """The ``logprobs`` object of a choice's generated tokens ``[a, b)``, and of its prompt's when
        ``with_prompt``; None when none were asked for. Only for a finished choice (its tokens final)."""
        if sampling.top_logprobs is None or st.scores is None:
            return None
        n, width = len(st.prompt), sampling.top_logprobs
        s = P.scored(st.prompt + st.tokens, st.scores, 0 if with_prompt else n + a, n + b)
        if chat:  # the end of the turn (a stop token, always the last one) is not part of the message
            if s.tokens and s.tokens[-1] in self.stop_tokens:
                s = s[:-1]
            return P.chat_logprobs(s, self.piece, width, self.piece_bytes)
        offsets = self.offsets(st.prompt, 0, len(st.prompt_text)) if with_prompt else []
        if st.token_offsets is None:  # one pass per choice, however many chunks a stream slices it into
            base = len(st.prompt_text) if sampling.echo else 0
            st.token_offsets = self.offsets(st.tokens, base, len(st.stream.text),
                                            completion_context(self.tok.decode, st.prompt))
        return P.completion_logprobs(s, self.piece, offsets + st.token_offsets[a:b], width)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise P.APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise P.APIError(400, f"the request body must be a JSON object, got {P._kind(body)}", code="invalid_json")
    return body


def create_app(service: Service) -> FastAPI:
    """The FastAPI application over ``service`` (its worker started and stopped with the app's lifespan)."""
    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not service.worker.alive and service.worker.error is None:
            service.worker.start()
        yield
        service.worker.stop()

    app = FastAPI(title="jaxformer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    metrics = service.metrics

    def error_response(e: P.APIError, endpoint: str) -> JSONResponse:
        metrics.requests.labels(endpoint, str(e.status)).inc()
        headers = {"Retry-After": "1"} if e.status in (429, 503) else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # 404 / 405 in OpenAI's error body too
        return error_response(P.APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                         code=None), "other")

    @app.get("/health")
    async def health():
        if not service.worker.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if not service.worker.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok", "pid": os.getpid()}  # the pid: which process answers on this port

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [P.model_card(service.name, service.created, service.max_context)]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    async def handle(request: Request, *, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            body = await _json_body(request)
            service.check_model(body)
            sampling = P.parse_sampling(body, chat=chat)
            if chat:
                prompts = [service.render_chat(P.parse_messages(body))]
                texts = [""]
            else:
                raw = P.parse_prompt(body, service.vocab_size)
                prompts = [service.encode_prompt(p) for p in raw]
                texts = [p if isinstance(p, str) else service.tok.decode(p) for p in raw]
            choices = service.choices(prompts, sampling, "messages" if chat else "prompt")
            loop = asyncio.get_running_loop()
            updates: asyncio.Queue = asyncio.Queue()

            def send(i, u):
                try:
                    loop.call_soon_threadsafe(updates.put_nowait, (i, u))
                except RuntimeError:  # the event loop is closed (shutdown): nobody is listening
                    pass

            rids = service.worker.submit(Job(choices, send))
        except P.APIError as e:
            return error_response(e, endpoint)
        except QueueFull as e:
            return error_response(P.APIError(429, str(e), type="rate_limit_error", code="queue_full"), endpoint)
        except ShuttingDown as e:
            return error_response(P.APIError(503, str(e), type="server_error", code="unavailable"), endpoint)
        n = sampling.n
        states = [_State(j, rid, prompts[j // n], texts[j // n], service.text_stream(prompts[j // n], sampling.stop))
                  for j, rid in enumerate(rids)]
        rid_prefix = "chatcmpl-" if chat else "cmpl-"
        meta = {"id": rid_prefix + uuid.uuid4().hex, "created": int(time.time()), "model": service.name}
        if sampling.stream:
            metrics.requests.labels(endpoint, "200").inc()
            return StreamingResponse(stream(states, updates, sampling, meta, chat),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await gather(request, states, updates, sampling, meta, chat, endpoint)

    def usage(states: list[_State], n: int) -> dict:
        prompt = sum(len(st.prompt) for st in states[::n])
        return P.usage(prompt, sum(st.stream.num_tokens for st in states))

    async def gather(request, states, updates, sampling, meta, chat, endpoint):
        clock = asyncio.get_running_loop().time
        checked = clock()
        try:
            while not all(st.done for st in states):
                try:
                    i, u = await asyncio.wait_for(updates.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    pass
                else:
                    service.update(states[i], u.tokens, u.result, u.logprobs)
                if clock() - checked >= DISCONNECT_POLL_S:  # also while tokens keep coming
                    checked = clock()
                    if await request.is_disconnected():
                        return Response(status_code=499)
        finally:
            service.worker.cancel([st.rid for st in states if not st.done])
        failed = next((st for st in states if st.error), None)
        if failed is not None:
            return error_response(P.APIError(500, f"generation failed: {failed.error}", type="server_error",
                                             code="engine_error"), endpoint)
        out = []
        for st in states:
            if chat:
                out.append({"index": st.index, "message": {"role": "assistant", "content": st.stream.text},
                            "logprobs": service.logprobs(st, sampling, chat, 0, st.stream.num_tokens, False),
                            "finish_reason": st.finish_reason})
            else:
                text = (st.prompt_text if sampling.echo else "") + st.stream.text
                out.append({"index": st.index, "text": text,
                            "logprobs": service.logprobs(st, sampling, chat, 0, st.stream.num_tokens, sampling.echo),
                            "finish_reason": st.finish_reason})
        metrics.requests.labels(endpoint, "200").inc()
        return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": out,
                "usage": usage(states, sampling.n)}

    async def stream(states, updates, sampling, meta, chat):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(st: _State, text: str, finish, logprobs) -> dict:
            if chat:
                delta = {"content": text} if text else {}
                c = {"index": st.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            else:
                c = {"index": st.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            return {**meta, "object": kind, "choices": [c]}

        want_logprobs = sampling.top_logprobs is not None  # they come from a pass over the finished choice
        held: dict[int, list[tuple[str, int, int, str | None]]] = {st.index: [] for st in states}
        try:
            if chat:
                for st in states:
                    yield _sse({**meta, "object": kind, "choices": [
                        {"index": st.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}]})
            if sampling.echo and not want_logprobs:
                for st in states:
                    yield _sse(chunk(st, st.prompt_text, None, None))
            while not all(st.done for st in states):
                i, u = await updates.get()
                st = states[i]
                was_done = st.done
                text = service.update(st, u.tokens, u.result, u.logprobs)
                if was_done or (not text and not st.done):
                    continue  # nothing certain yet (half a character, the start of a stop string)
                a, b, st.covered = st.covered, st.stream.num_tokens, st.stream.num_tokens
                if st.error:
                    yield _sse(P.APIError(500, f"generation failed: {st.error}", type="server_error",
                                          code="engine_error").body())
                    continue
                if want_logprobs:
                    held[i].append((text, a, b, st.finish_reason))
                    if not st.done:
                        continue
                    if sampling.echo:
                        yield _sse(chunk(st, st.prompt_text, None, service.logprobs(st, sampling, chat, 0, 0, True)))
                    for text, a, b, finish in held.pop(i):
                        yield _sse(chunk(st, text, finish, service.logprobs(st, sampling, chat, a, b, False)))
                else:
                    yield _sse(chunk(st, text, st.finish_reason, None))
            if sampling.include_usage:
                yield _sse({**meta, "object": kind, "choices": [], "usage": usage(states, sampling.n)})
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away (the stream task is cancelled): free its pages
            service.worker.cancel([st.rid for st in states if not st.done])

    return app
