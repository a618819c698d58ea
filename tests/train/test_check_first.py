"""Refusals and no-ops are decided before the corpus and tokenizer are built (they took 20-39 s with the stdlib
corpus): an incompatible resume, --steps below the run's step, a finished run re-run. ``build_corpus`` is made to
fail, so any of them that still built the corpus fails here; a resume that trains shows the patch is on the path."""

from __future__ import annotations

import pytest

from jaxformer.cli import main
from jaxformer.train import loop
from tests.train.helpers import finished_run


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 4-step run with a final evaluation: (config path, run dir)."""
    return finished_run(tmp_path_factory.mktemp("check_first"))


@pytest.fixture
def no_corpus(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the corpus was built")
    monkeypatch.setattr(loop, "build_corpus", refuse)


@pytest.mark.parametrize("args,code,stream,says", [
    (["model.d_model=64"], 2, "err", "model.d_model (saved 32, now 64)"),
    (["--steps", "2"], 2, "err", "already at step 4, past steps=2"),
    ([], 0, "out", "already finished at step 4"),
])
def test_refusals_and_no_ops_do_not_build_the_corpus(finished, no_corpus, capsys, args, code, stream, says):
    cfg, run = finished
    capsys.readouterr()
    assert main(["train", str(cfg), "--run-dir", str(run), *args]) == code
    assert says in getattr(capsys.readouterr(), stream)  # errors on stderr, the no-op's line on stdout


def test_a_resume_that_trains_builds_the_corpus(finished, no_corpus):
    cfg, run = finished
    with pytest.raises(AssertionError, match="the corpus was built"):
        main(["train", str(cfg), "--run-dir", str(run), "--steps", "6"])
