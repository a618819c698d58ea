"""A run killed with SIGKILL mid-way and resumed gives exactly the per-step losses of an uninterrupted run."""

from __future__ import annotations

import pytest

from tests.train.helpers import killed_and_resumed, make_corpus, tiny_raw, write_config


@pytest.mark.slow  # 20 s (three processes); a real process interrupted and resumed to the uninterrupted run's
# rows exactly is a default-run test (test_interrupt.py), as is a resume past its checkpoint replaying the same
# losses with each row once (test_checkpoint.py: the data iterator restored, the metrics truncated)
def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    cfg = write_config(tmp_path / "cfg.yaml", tiny_raw(corpus, steps=8, checkpoint={"every": 2, "keep": 3}))
    want, got = killed_and_resumed(cfg, tmp_path, steps=8)
    assert got == want  # exact: same floats, step by step
