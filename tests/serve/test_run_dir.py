"""``jaxformer serve RUN_DIR``: a tiny run trained here (byte tokenizer, 32-token context), served by a real
process. Bytes are the hard case for streaming: a character may take up to four tokens."""

from __future__ import annotations

import json

import pytest

from jaxformer.cli import main
from tests.serve.conftest import Server
from tests.train.helpers import TINY_MODEL, make_corpus, tiny_raw, write_config


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two steps of `jaxformer train`; init_std 0.3 keeps the logits peaked (greedy is never a near tie)."""
    tmp = tmp_path_factory.mktemp("serve_run")
    raw = tiny_raw(make_corpus(tmp / "corpus", n_files=8), steps=2, model={**TINY_MODEL, "init_std": 0.3},
                   checkpoint={"every": 2, "keep": 1})
    out = tmp / "tiny-run"
    assert main(["train", str(write_config(tmp / "tiny.yaml", raw)), "--run-dir", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def server(run, tmp_path_factory):
    s = Server([str(run), "--max-batch", "4", "--page-size", "8"], tmp_path_factory.mktemp("log") / "server.log")
    yield s
    assert s.stop() == 0, s.log()


def test_greedy_equals_jaxformer_generate(server, run, capsys):
    capsys.readouterr()
    for prompt in ("def ", "x = "):
        assert main(["generate", str(run), "--prompt", prompt, "--max-new-tokens", "12", "--temperature", "0"]) == 0
        printed = capsys.readouterr().out
        out = server.client().completions.create(model="tiny-run", prompt=prompt, max_tokens=12, temperature=0)
        assert printed == prompt + out.choices[0].text + "\n"


# slow (3 s): no delta holds half a character, in-process and default-run, in tests/serve/test_text.py (the server's
# TextStream over byte decodes, multi-byte text fed 1-3 bytes at a time and random byte streams); the server's
# streams equal its non-streamed choices (n=2, hot sampling) in tests/serve/test_server.py
@pytest.mark.slow
def test_streamed_bytes_never_split_a_character(server):
    """Hot sampling over 256 bytes draws many multi-byte UTF-8 sequences, whole and broken: every stream
    concatenates to its non-streamed text, which has whole non-ASCII characters in it."""
    client = server.client()
    kw = dict(model="tiny-run", prompt="d\u00e9f \u20ac", n=6, seed=7, temperature=2.0, max_tokens=20)
    whole = {c.index: c.text for c in client.completions.create(**kw).choices}
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == whole
    assert any(ord(ch) > 127 and ch != "\ufffd" for text in whole.values() for ch in text), whole


def test_chat_without_a_template_and_over_the_context_are_400(server):
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"
    assert "has no chat template" in r.json()["error"]["message"]
    r = server.post("/v1/completions", {"prompt": "x" * 40, "max_tokens": 1})
    assert r.status_code == 400 and "maximum context length is 32 tokens" in r.json()["error"]["message"]
    assert json.loads(server.http.get("/v1/models").text)["data"][0]["max_model_len"] == 32
