"""``jaxformer serve --hf BASE --adapter PEFT_DIR``: the adapter merged into the served model, checked against
peft's own logits (the committed fixture tests/interop/fixtures/peft/llama, recorded by
tests/interop/make_peft_fixtures.py) through the prompt log-probabilities the server reports."""

from __future__ import annotations

import numpy as np
import pytest

from tests.serve.conftest import FIXTURES, Server

ATOL = 1e-4  # float32 logits of two implementations (tests/interop's tolerance)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(["--hf", str(FIXTURES / "llama"), "--adapter", str(FIXTURES / "peft" / "llama")],
               tmp_path_factory.mktemp("log") / "server.log")
    yield s
    assert s.stop() == 0, s.log()


def _log_softmax(x):
    x = x.astype(np.float64)
    return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


def test_served_adapter_scores_as_peft(server):
    with np.load(FIXTURES / "peft" / "llama" / "expected.npz") as z:
        ids, logits = z["input_ids"][0].tolist(), z["logits"][0]  # row 0: no padding
    with np.load(FIXTURES / "llama" / "expected.npz") as z:
        assert z["input_ids"][0].tolist() == ids
        base = z["logits"][0]  # the base model's on the same tokens
    client = server.client()
    assert client.models.list().data[0].id == "llama+llama"
    out = client.completions.create(model="llama+llama", prompt=ids, max_tokens=0, echo=True, logprobs=0)
    got = np.asarray(out.choices[0].logprobs.token_logprobs[1:])
    k = np.arange(len(ids) - 1)
    np.testing.assert_allclose(got, _log_softmax(logits)[k, ids[1:]], atol=ATOL)
    assert np.abs(got - _log_softmax(base)[k, ids[1:]]).max() > 0.1  # the adapter moved them: it was applied
