"""Fixtures of the interop tests. ``hf_llama_dir``: a tiny random Llama checkpoint with its tokenizer, written by
jaxformer itself (:mod:`tests.interop.hf_dirs`), so no test needs a download, torch or transformers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interop.hf_dirs import make_hf_llama


@pytest.fixture(scope="session")
def hf_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint with its tokenizer (shared by the session: do not modify it)."""
    return make_hf_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")
