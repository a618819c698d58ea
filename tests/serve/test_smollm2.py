"""Real weights: SmolLM2-135M-Instruct (the GGUF the interop tests use) served, its chat template rendered as
transformers renders it and its greedy chat answer equal to transformers' (the committed reference,
tests/interop/fixtures/gguf/smollm2.*, recorded by tests/interop/make_gguf_fixtures.py). About 20 s (the
135M model loads and compiles in a server process): marked slow."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.interop import gguf_reference as ref
from tests.serve.conftest import Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    try:
        file = ref.fetch()
    except RuntimeError as e:
        pytest.skip(f"SmolLM2 GGUF not available: {e}")
    fixtures = ref.ROOT / "tests" / "interop" / "fixtures" / "gguf"
    with np.load(fixtures / "smollm2.npz") as z:
        expected = {k: z[k] for k in z.files}
    meta = json.loads((fixtures / "smollm2.json").read_text())
    server = Server(["--hf", str(file), "--max-context", "128", "--max-batch", "2"],
                    tmp_path_factory.mktemp("log") / "server.log")
    yield server, expected, meta
    assert server.stop() == 0, server.log()


def test_greedy_chat_equals_transformers(smollm2):
    server, expected, meta = smollm2
    p = next(i for i, q in enumerate(meta["prompts"]) if q["kind"] == "chat")
    [messages] = meta["chat"]
    want = meta["prompts"][p]["continuation"]  # transformers' greedy answer, decoded with its special tokens
    assert want.endswith("<|im_end|>")  # the end of the turn: SmolLM2's EOS, not returned as text
    client = server.client()
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=messages, temperature=0,
                                         max_tokens=ref.NEW_TOKENS)
    # the prompt is transformers' rendering of the template (same count here, same tokens below)
    assert out.usage.prompt_tokens == len(expected[f"p{p}_ids"])
    assert out.usage.completion_tokens == len(expected[f"p{p}_generated"])
    assert out.choices[0].message.content == want.removesuffix("<|im_end|>")
    assert out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=messages, temperature=0, max_tokens=ref.NEW_TOKENS,
        stream=True) if c.choices)
    assert streamed == out.choices[0].message.content
    # the same tokens as a prompt of ids (transformers' rendering, encoded): the same answer
    from jaxformer.interop.tokenizer import load_tokenizer

    tok = load_tokenizer(ref.fetch())
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == meta["prompts"][p]["text"]
    # ... and its encoding (what the server sends the engine: Service.render_chat) is transformers' ids
    assert [int(t) for t in tok.encode(meta["prompts"][p]["text"])] == expected[f"p{p}_ids"].tolist()
    ids = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=expected[f"p{p}_ids"].tolist(),
                                    temperature=0, max_tokens=ref.NEW_TOKENS)
    assert ids.choices[0].text == out.choices[0].message.content and ids.usage == out.usage
