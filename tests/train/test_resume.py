"""A run killed with SIGKILL mid-way and resumed gives exactly the per-step losses of an uninterrupted run."""

from __future__ import annotations

from tests.train.helpers import killed_and_resumed, make_corpus, tiny_raw, write_config


def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    cfg = write_config(tmp_path / "cfg.yaml", tiny_raw(corpus, steps=8, checkpoint={"every": 2, "keep": 3}))
    want, got = killed_and_resumed(cfg, tmp_path, steps=8)
    assert got == want  # exact: same floats, step by step
