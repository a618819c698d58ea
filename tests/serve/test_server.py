"""``jaxformer serve`` on a tiny Llama 3 checkpoint (the committed fixture, logits sharpened), one real server
process for the module, driven with the official ``openai`` client and raw HTTP.

The server's pool is small on purpose (12 pages of 16 tokens for a 256-token context), so concurrent
requests are preempted and recomputed, and a request can need more pages than exist.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from flax import nnx

from jaxformer.cli import main
from tests.serve.conftest import CHAT_TEMPLATE, Server

NUM_PAGES, PAGE, CONTEXT, QUEUE = 12, 16, 256, 24
PROMPTS = ["the quick brown", "a lazy dog sat on", "jump over the fox"]
SCORED = "the lazy dog sat on the fox"


@pytest.fixture(scope="module")
def server(peaked_dir, tmp_path_factory):
    s = Server(["--hf", str(peaked_dir), "--max-batch", "8", "--max-queue", str(QUEUE), "--num-pages",
                str(NUM_PAGES), "--page-size", str(PAGE), "--max-context", str(CONTEXT)],
               tmp_path_factory.mktemp("log") / "server.log")
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def model(peaked_dir):
    from jaxformer.interop.hf import load_pretrained
    from jaxformer.interop.tokenizer import load_tokenizer

    config, graphdef, state = load_pretrained(peaked_dir)
    return config, graphdef, state, load_tokenizer(peaked_dir)


def generate(peaked_dir, tmp_path, capsys, prompts, *args) -> list[dict]:
    """``jaxformer generate --hf DIR --prompts-file F`` records (one per prompt)."""
    f, out = tmp_path / "prompts.txt", tmp_path / "out.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    assert main(["generate", "--hf", str(peaked_dir), "--prompts-file", str(f), "--output", str(out), *args]) == 0
    if capsys is not None:
        capsys.readouterr()
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def greedy(peaked_dir, tmp_path_factory):
    """``jaxformer generate --temperature 0 --max-new-tokens 12`` records for PROMPTS and SCORED (one run:
    one set of compiled programs in this process)."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        return generate(peaked_dir, tmp_path_factory.mktemp("greedy"), None, [*PROMPTS, SCORED], "--temperature",
                        "0", "--max-new-tokens", "12")


def test_models_health_and_metrics(server):
    assert server.http.get("/health").json() == {"status": "ok", "pid": server.proc.pid}
    [card] = server.client().models.list().data
    assert card.id == "tiny-llama3" and card.owned_by == "jaxformer"
    m = server.metrics()
    assert m["jaxformer_kv_pages_total"] == NUM_PAGES and m["jaxformer_requests_running"] == 0
    for name in ("jaxformer_requests_waiting", "jaxformer_kv_pages_used", "jaxformer_kv_pages_free",
                 "jaxformer_preemptions_total", "jaxformer_prompt_tokens_total", "jaxformer_generation_tokens_total",
                 "jaxformer_time_to_first_token_seconds_count", "jaxformer_time_per_output_token_seconds_count"):
        assert name in m, name


def test_greedy_completions_equal_generate(server, greedy, model):
    records = greedy[:3]
    server.wait_metrics(lambda m: (m["jaxformer_requests_waiting"], m["jaxformer_requests_running"]) == (0, 0))
    before = server.metrics()
    out = server.client().completions.create(model="tiny-llama3", prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for c, r in zip(out.choices, records):
        assert c.text == r["completion"] and c.finish_reason == ("stop" if r["stopped_by"] == "stop_token"
                                                                  else "length")
    assert out.usage.completion_tokens == sum(len(r["tokens"]) for r in records)
    assert out.usage.prompt_tokens == sum(r["num_prompt_tokens"] for r in records)
    # /metrics counted this request's sequences: its prompt and generated tokens (the usage above, computed by
    # generate), a first-token latency per choice, a time per output token per choice of 2+ tokens
    after = server.metrics()
    grew = {k: after[k] - before[k] for k in ("jaxformer_prompt_tokens_total", "jaxformer_generation_tokens_total",
                                               "jaxformer_time_to_first_token_seconds_count",
                                               "jaxformer_time_per_output_token_seconds_count")}
    assert grew == {"jaxformer_prompt_tokens_total": sum(r["num_prompt_tokens"] for r in records),
                    "jaxformer_generation_tokens_total": sum(len(r["tokens"]) for r in records),
                    "jaxformer_time_to_first_token_seconds_count": 3,
                    "jaxformer_time_per_output_token_seconds_count": sum(len(r["tokens"]) > 1 for r in records)}
    ids = [model[3].encode_prompt(p).tolist() for p in PROMPTS[:2]]  # the same prompts as token ids
    again = server.client().completions.create(model="tiny-llama3", prompt=ids[0], max_tokens=12, temperature=0)
    assert again.choices[0].text == records[0]["completion"]
    both = server.client().completions.create(model="tiny-llama3", prompt=ids, max_tokens=12, temperature=0)
    assert [c.text for c in both.choices] == [r["completion"] for r in records[:2]]
    # top_p 0 keeps the most likely token alone (OpenAI's API and transformers accept it), and so does top_k 1:
    # greedy even at the highest temperature, where neither filter draws other tokens for these prompts and seed
    hot = dict(model="tiny-llama3", prompt=PROMPTS, max_tokens=12, temperature=2.0, n=2, seed=3)
    greedy_texts = [r["completion"] for r in records for _ in range(2)]
    assert [c.text for c in server.client().completions.create(**hot).choices] != greedy_texts
    assert [c.text for c in server.client().completions.create(**hot, top_p=0).choices] == greedy_texts
    assert [c.text for c in server.client().completions.create(**hot, extra_body={"top_k": 1}).choices
            ] == greedy_texts


def test_sampled_choices_take_seed_plus_index_as_generate_gives_prompts(server, peaked_dir, tmp_path, capsys):
    sampling = dict(temperature=2.0, top_p=0.95)  # the sharpened logits need heat to differ
    records = generate(peaked_dir, tmp_path, capsys, [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2, "--temperature", "2.0",
                       "--top-p", "0.95", "--top-k", "40", "--seed", "11", "--max-new-tokens", "10")
    out = server.client().completions.create(model="tiny-llama3", prompt=PROMPTS[:2], n=2, seed=11, max_tokens=10,
                                             extra_body={"top_k": 40}, **sampling)
    assert [c.text for c in out.choices] == [r["completion"] for r in records]
    assert len({c.text for c in out.choices}) > 2  # the seeds differ
    first = server.client().completions.create(model="tiny-llama3", prompt=PROMPTS[1], seed=13, max_tokens=10,
                                               extra_body={"top_k": 40}, **sampling)
    assert first.choices[0].text == records[2]["completion"]  # seed 13: choice 2 of seed 11's request


def _stream_texts(chunks, chat: bool) -> tuple[dict[int, str], dict[int, str], list]:
    texts, finish, usage = {}, {}, []
    for ch in chunks:
        if ch.usage is not None:
            usage.append(ch.usage)
        for c in ch.choices:
            piece = (c.delta.content or "") if chat else c.text
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish, usage


def test_streaming_equals_non_streaming(server):
    client = server.client()
    kw = dict(model="tiny-llama3", prompt=PROMPTS[:2], n=2, seed=3, temperature=2.0, max_tokens=20)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts, finish, [usage] = _stream_texts(chunks, chat=False)
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage == whole.usage and sum(bool(c.choices) for c in chunks) > 20  # token by token, not one blob
    messages = [{"role": "user", "content": "the quick brown fox"}]
    whole = client.chat.completions.create(model="tiny-llama3", messages=messages, temperature=0, max_tokens=15)
    chunks = list(client.chat.completions.create(model="tiny-llama3", messages=messages, temperature=0, max_tokens=15,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    texts, finish, _ = _stream_texts(chunks, chat=True)
    assert texts == {0: whole.choices[0].message.content} and finish == {0: whole.choices[0].finish_reason}
    raw = server.post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 3, "stream": True}).text
    assert raw.endswith("data: [DONE]\n\n") and all(b.startswith("data: ") for b in raw.strip().split("\n\n"))


def test_stop_strings_end_the_text_before_them(server):
    client = server.client()
    full = client.completions.create(model="tiny-llama3", prompt=PROMPTS[1], max_tokens=40, temperature=0).choices[0]
    assert len(full.text) > 20
    stop = full.text[12:15]
    expected = full.text[:full.text.find(stop)]
    for stream in (False, True):
        kw = dict(model="tiny-llama3", prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=[stop, "zzzz"])
        if stream:
            texts, finish, _ = _stream_texts(client.completions.create(stream=True, **kw), chat=False)
            text, reason = texts[0], finish[0]
        else:
            c = client.completions.create(**kw).choices[0]
            text, reason = c.text, c.finish_reason
        assert (text, reason) == (expected, "stop"), stream
    missing = client.completions.create(model="tiny-llama3", prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                        stop="zzzz").choices[0]
    assert (missing.text, missing.finish_reason) == (full.text, full.finish_reason)


def test_a_stop_string_keeps_the_log_probabilities(server):
    """A choice a stop string ends (the engine request cancelled early) is a finished answer: it has its
    log-probabilities (the unstopped run's first tokens: through the one that completed the stop string),
    and counts as finished with "stop", not as cancelled, in /metrics."""
    client = server.client()
    kw = dict(model="tiny-llama3", prompt=PROMPTS[1], max_tokens=40, temperature=0, logprobs=1)
    full = client.completions.create(**kw).choices[0]
    stop = full.text[12:15]
    before = server.metrics()
    for stream in (False, True):
        if stream:
            chunks = [c.choices[0] for c in client.completions.create(stream=True, stop=[stop], **kw) if c.choices]
            lp = [c.logprobs for c in chunks if c.logprobs is not None]
            assert lp, "a stopped stream sent no logprobs"
            tokens, logprobs = sum((x.tokens for x in lp), []), sum((x.token_logprobs for x in lp), [])
            text, reason = "".join(c.text for c in chunks), [c.finish_reason for c in chunks if c.finish_reason][0]
        else:
            c = client.completions.create(stop=[stop], **kw).choices[0]
            assert c.logprobs is not None
            tokens, logprobs, text, reason = c.logprobs.tokens, c.logprobs.token_logprobs, c.text, c.finish_reason
        k = len(tokens)
        assert (text, reason) == (full.text[:full.text.find(stop)], "stop"), stream
        assert 0 < k < len(full.logprobs.tokens) and tokens == full.logprobs.tokens[:k], stream
        assert stop in "".join(tokens) and stop not in "".join(tokens[:-1]), stream  # through the stop's end
        assert logprobs == pytest.approx(full.logprobs.token_logprobs[:k], abs=1e-6), stream
    after = server.wait_metrics(lambda m: m.get('jaxformer_sequences_finished_total{finish_reason="stop"}', 0)
                                >= before.get('jaxformer_sequences_finished_total{finish_reason="stop"}', 0) + 2)
    assert after["jaxformer_sequences_cancelled_total"] == before["jaxformer_sequences_cancelled_total"]


def _forward_logprobs(model, tokens: list[int]) -> np.ndarray:
    """log-softmax of the model's logits on ``tokens`` (one forward pass, no cache): row k scores token k + 1.
    Compared at rtol 1e-5: float32 logits of a few tens summed in another order (padding, XLA's fusion)."""
    config, graphdef, state, _ = model
    logits = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, jnp.asarray([tokens], jnp.int32))
    return np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))


def test_logprobs_with_echo_equal_a_direct_forward_pass(server, model, greedy):
    tok, r = model[3], greedy[3]
    client = server.client()
    text, n = SCORED, 6
    ids = tok.encode_prompt(text).tolist()
    seq = ids + r["tokens"][:n]  # the prompt and its first n greedy tokens
    full = _forward_logprobs(model, seq)  # causal: its first rows are the prompt's alone
    scored = client.completions.create(model="tiny-llama3", prompt=text, max_tokens=0, echo=True, logprobs=3)
    lp = scored.choices[0].logprobs
    ref = full[:len(ids)]
    assert scored.choices[0].text == text and len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], ref[np.arange(len(ids) - 1), ids[1:]], rtol=1e-5, atol=1e-5)
    for k in range(1, len(ids)):  # the 3 likeliest, most likely first
        best = np.argsort(-ref[k - 1])[:3]
        assert list(lp.top_logprobs[k].values()) == pytest.approx(ref[k - 1, best].tolist(), rel=1e-5, abs=1e-5)
    assert lp.tokens == [tok.decode([i]) for i in ids] and lp.text_offset == sorted(lp.text_offset)
    # with generated tokens: the prompt's and the completion's, over the same forward pass
    assert r["stopped_by"] == "max_new_tokens" and 1 not in r["tokens"][:n]  # no EOS in the first n
    completion = tok.decode(r["tokens"][:n])
    out = client.completions.create(model="tiny-llama3", prompt=text, max_tokens=n, temperature=0, echo=True,
                                    logprobs=1).choices[0]
    ref = full
    assert out.text == text + completion and len(out.logprobs.tokens) == len(seq)
    np.testing.assert_allclose(out.logprobs.token_logprobs[1:], ref[np.arange(len(seq) - 1), seq[1:]], rtol=1e-5,
                               atol=1e-5)
    # greedy: each generated token is the likeliest one
    for k in range(len(ids), len(seq)):
        assert list(out.logprobs.top_logprobs[k].values())[0] == pytest.approx(out.logprobs.token_logprobs[k])
    # streamed: the chunks' logprobs concatenate to the non-streamed object (offsets into the whole text)
    chunks = [c.choices[0] for c in client.completions.create(
        model="tiny-llama3", prompt=text, max_tokens=n, temperature=0, echo=True, logprobs=1, stream=True)
        if c.choices and c.choices[0].logprobs is not None]
    for field in ("tokens", "token_logprobs", "text_offset"):
        assert sum((getattr(c.logprobs, field) for c in chunks), []) == getattr(out.logprobs, field), field
    assert "".join(c.text for c in chunks) == out.text
    plain = client.completions.create(model="tiny-llama3", prompt=text, max_tokens=n, temperature=0,
                                      logprobs=0).choices[0]
    assert plain.text == completion and plain.logprobs.token_logprobs == pytest.approx(
        out.logprobs.token_logprobs[len(ids):], abs=1e-6)
    chat = client.chat.completions.create(model="tiny-llama3", messages=[{"role": "user", "content": text}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2).choices[0]
    assert len(chat.logprobs.content) == 4 and all(len(e.top_logprobs) == 2 for e in chat.logprobs.content)
    assert "".join(e.token for e in chat.logprobs.content) == chat.message.content


def test_chat_uses_the_checkpoints_template(server, peaked_dir):
    """The messages rendered and encoded independently (jinja2 and ``tokenizers`` here, as transformers'
    ``apply_chat_template`` does: no specials added), then sent as token ids to /v1/completions (which equals
    ``generate``): the chat answer is the completion of exactly those tokens."""
    import jinja2
    from tokenizers import Tokenizer

    messages = [{"role": "system", "content": "a fox"}, {"role": "user", "content": "the quick brown"}]
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)  # an independent rendering
    text = env.from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True,
                                                 bos_token="<|begin_of_text|>")
    ids = Tokenizer.from_file(str(peaked_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert ids[0] == 0 and ids.count(0) == 1  # BOS, written by the template and read as the special token
    ref = server.client().completions.create(model="tiny-llama3", prompt=ids, temperature=0, max_tokens=10)
    out = server.client().chat.completions.create(model="tiny-llama3", messages=messages, temperature=0,
                                                  max_tokens=10)
    assert out.usage == ref.usage and out.usage.prompt_tokens == len(ids)
    assert out.choices[0].message.content == ref.choices[0].text and len(ref.choices[0].text) > 5
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"


def test_concurrent_requests_equal_their_solo_answers_through_preemption(server):
    client = server.client()
    # 6 distinct (3 texts, 2 lengths each): each is answered alone first, one after another (15 took ~2.5 s more)
    prompts = [f"{PROMPTS[i % 3]} {'the ' * (i % 2)}" for i in range(24)]
    alone = {p: client.completions.create(model="tiny-llama3", prompt=p, max_tokens=40, temperature=0).choices[0].text
             for p in dict.fromkeys(prompts)}
    solo = [alone[p] for p in prompts]
    before = server.metrics()["jaxformer_preemptions_total"]

    def one(i):
        return client.completions.create(model="tiny-llama3", prompt=prompts[i], max_tokens=40,
                                         temperature=0).choices[0].text

    with ThreadPoolExecutor(24) as pool:
        together = list(pool.map(one, range(24)))
    assert together == solo
    assert server.metrics()["jaxformer_preemptions_total"] > before  # 12 pages cannot hold 8 such sequences


def test_a_request_arriving_mid_batch_joins_it_and_ends_first(server):
    """Continuous batching: a short request sent while a long stream runs is answered while that stream is still
    sending (it joined the running batch at the next step; it did not wait for the batch to drain)."""
    server.wait_metrics(lambda m: (m["jaxformer_requests_waiting"], m["jaxformer_requests_running"]) == (0, 0))
    client = server.client()  # made before the clock runs
    arrivals, first = [], threading.Event()

    def read():
        with httpx.Client(base_url=server.url, timeout=60) as c, c.stream(
                "POST", "/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 150, "temperature": 0,
                                                 "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append((time.perf_counter(), line))
                    first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(30)
    short = client.completions.create(model="tiny-llama3", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    answered = time.perf_counter()
    reader.join(60)
    assert len(short.choices[0].text) > 0 and arrivals[-1][1] == "data: [DONE]"
    later = [line for t, line in arrivals if t > answered and line != "data: [DONE]"]
    assert later, len(arrivals)  # the long stream was still sending (~60 of its 150 chunks came after, here)


def _stream_lines(server, body):
    """An open streaming request: (response context, its line iterator)."""
    cm = server.http.stream("POST", "/v1/completions", json=body)
    r = cm.__enter__()
    return cm, r, r.iter_lines()


def test_a_dropped_stream_is_cancelled_and_frees_its_pages(server):
    server.wait_metrics(lambda m: m["jaxformer_requests_running"] == 0)
    before = server.metrics()
    cm, r, lines = _stream_lines(server, {"prompt": PROMPTS[0], "max_tokens": 150, "temperature": 0, "stream": True})
    assert r.status_code == 200
    got = []
    for line in lines:
        if line.startswith("data: "):
            got.append(line)
            if len(got) == 2:
                break
    held = server.metrics()
    assert held["jaxformer_kv_pages_used"] > 0
    cm.__exit__(None, None, None)  # the client goes away mid-stream
    after = server.wait_metrics(lambda m: m["jaxformer_sequences_cancelled_total"]
                                > before["jaxformer_sequences_cancelled_total"])
    after = server.wait_metrics(lambda m: m["jaxformer_kv_pages_used"] == 0 and m["jaxformer_requests_running"] == 0)
    assert after["jaxformer_kv_pages_free"] == NUM_PAGES
    assert after["jaxformer_generation_tokens_total"] - before["jaxformer_generation_tokens_total"] < 150


def test_a_non_streamed_client_that_goes_away_cancels_its_request(server):
    """A client waiting for a non-streamed answer that hangs up cancels the request: its choices leave the
    engine and every page goes back. The request is sent on a raw socket, closed once the engine runs it; its
    20 choices of 150 tokens need 10 of the 12 pages each, so they run about one at a time and the whole answer
    (3,000 tokens) is far off then."""
    import socket
    from urllib.parse import urlsplit

    server.wait_metrics(lambda m: (m["jaxformer_requests_waiting"], m["jaxformer_requests_running"]) == (0, 0))
    before = server.metrics()
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 150, "temperature": 0, "n": 20}).encode()
    url = urlsplit(server.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    server.wait_metrics(lambda m: m["jaxformer_requests_running"] > 0)
    sock.close()  # the client goes away, its answer unread
    after = server.wait_metrics(lambda m: m["jaxformer_sequences_cancelled_total"]
                                > before["jaxformer_sequences_cancelled_total"]
                                and (m["jaxformer_requests_waiting"], m["jaxformer_requests_running"]) == (0, 0))
    assert after["jaxformer_kv_pages_free"] == NUM_PAGES
    assert after["jaxformer_generation_tokens_total"] - before["jaxformer_generation_tokens_total"] < 20 * 150 / 2


def test_a_full_queue_answers_429_at_once(server):
    server.wait_metrics(lambda m: m["jaxformer_requests_running"] == 0)
    body = {"prompt": PROMPTS[2], "max_tokens": 150, "temperature": 0, "stream": True}
    opened, lock = [], threading.Lock()

    def one(_):
        t = time.perf_counter()
        client = httpx.Client(base_url=server.url, timeout=60)
        cm = client.stream("POST", "/v1/completions", json=body)
        r = cm.__enter__()
        with lock:
            opened.append((client, cm))
        return r.status_code, time.perf_counter() - t, (r.read() if r.status_code != 200 else b"")

    with ThreadPoolExecutor(QUEUE + 16) as pool:
        results = list(pool.map(one, range(QUEUE + 16)))
    server.wait_metrics(lambda m: m["jaxformer_requests_waiting"] > 0)  # the accepted beyond max_batch queue
    for client, cm in opened:  # every stream dropped: cancelled, pages freed
        cm.__exit__(None, None, None)
        client.close()
    codes = [c for c, _, _ in results]
    assert set(codes) == {200, 429} and codes.count(429) >= 8, codes
    refused = [(s, json.loads(b)) for c, s, b in results if c == 429]
    assert all(s < 5 for s, _ in refused)
    err = refused[0][1]["error"]
    assert err["code"] == "queue_full" and "max_queue=24" in err["message"] and set(err) == {"message", "type",
                                                                                             "param", "code"}
    idle = lambda m: (m["jaxformer_kv_pages_used"], m["jaxformer_requests_waiting"], m["jaxformer_requests_running"]
                      ) == (0, 0, 0)  # noqa: E731
    for _ in range(3):  # idle and staying idle (the dropped streams' cancels arrive one by one): the next test's
        server.wait_metrics(idle)  # requests must find the queue empty
        time.sleep(0.3)
    server.wait_metrics(idle)


BAD = [  # (body, status, param, words in the message)
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens", ">= 0"),
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "integer"),
    ({"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", "integer"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    ({"prompt": "x", "top_p": -0.5}, 400, "top_p", "[0.0, 1.0]"),
    ({"prompt": "x", "n": 0}, 400, "n", "[1, 128]"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
    ({"prompt": "x", "stop": 3}, 400, "stop", "string"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs", "[0, 20]"),
    ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ({"prompt": 5}, 400, "prompt", "expected a string"),
    ({"prompt": ""}, 400, "prompt", "empty"),
    ({"prompt": [1, 2, 999]}, 400, "prompt", "[999]"),
    ({"max_tokens": 3}, 400, "prompt", "expected a string"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
    ({"prompt": "x", "model": 3}, 400, "model", "must be a string"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "echo"),
]


def test_bad_requests_get_openai_errors_and_disturb_no_one(server):
    # an earlier test's requests may still be queued on a slow host (a client that timed out and retried):
    # start from an empty queue, or the solo request can meet a full one (429)
    server.wait_metrics(lambda m: (m["jaxformer_requests_waiting"], m["jaxformer_requests_running"]) == (0, 0))
    client = server.client()
    solo = client.completions.create(model="tiny-llama3", prompt=PROMPTS[0], max_tokens=60, temperature=0)
    result = {}
    t = threading.Thread(target=lambda: result.update(out=client.completions.create(
        model="tiny-llama3", prompt=PROMPTS[0], max_tokens=60, temperature=0)))
    t.start()
    for body, status, param, words in BAD:
        r = server.post("/v1/completions", body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, (body, err)
        assert words in err["message"], (body, err)
    for body, param in [({"messages": "hi"}, "messages"), ({"messages": [{"content": "x"}]}, "messages[0]"),
                        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
                        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs")]:
        r = server.post("/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert server.http.get("/v1/nothing").json()["error"]["message"] == "GET /v1/nothing: Not Found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    t.join()
    assert result["out"].choices[0].text == solo.choices[0].text


def test_requests_that_cannot_fit_get_400_naming_the_limit(server):
    r = server.post("/v1/completions", {"prompt": [2] * (CONTEXT + 1), "max_tokens": 1})
    assert r.status_code == 400 and f"maximum context length is {CONTEXT} tokens" in r.json()["error"]["message"]
    r = server.post("/v1/completions", {"prompt": [2] * 100, "max_tokens": CONTEXT - 99})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "(100 in the prompt, 157 in the completion)" in r.json()["error"]["message"]
    r = server.post("/v1/completions", {"prompt": [2] * 100, "max_tokens": 150})  # 249 tokens: 16 pages
    err = r.json()["error"]
    assert r.status_code == 400 and f"num_pages={NUM_PAGES}" in err["message"] and err["param"] == "max_tokens"
    ok = server.post("/v1/completions", {"prompt": [2] * 100, "max_tokens": 80})  # 179 tokens: 12 pages
    assert ok.status_code == 200, ok.text
