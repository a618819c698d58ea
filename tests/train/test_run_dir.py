"""The run directory survives what a user types: a refused resume, --steps below the run, a finished run re-run.

Nothing may be written into an existing run directory until the new config is known to fit it; a run that
already reached its steps is left as it is; metric rows are never duplicated. Driven through
``jaxformer.cli.main`` as a user would.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from jaxformer.cli import main
from jaxformer.train import config as C
from jaxformer.train.metrics import read_metrics
from tests.train.helpers import finished_run, make_corpus, tiny_raw, write_config


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 4-step run with a final evaluation: (config path, run dir)."""
    return finished_run(tmp_path_factory.mktemp("rundir"))


def test_refused_resume_leaves_the_run_dir_byte_identical(finished, tmp_path, capsys):
    cfg, run = finished
    before = snapshot(run)
    capsys.readouterr()
    assert main(["train", str(cfg), "--run-dir", str(run), "model.d_model=64"]) == 2
    err = capsys.readouterr().err
    assert "model.d_model (saved 32, now 64)" in err and "nothing was changed" in err
    assert snapshot(run) == before
    # eval and generate read the untouched config; resuming is silent about config changes
    assert main(["eval", str(run), "--max-tokens", "64"]) == 0
    assert main(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "3"]) == 0
    capsys.readouterr()
    assert main(["train", str(cfg), "--run-dir", str(run)]) == 0
    out = capsys.readouterr()
    assert "differs" not in out.err and "already finished at step 4" in out.out
    assert snapshot(run) == before


def test_steps_below_the_run_are_refused_and_change_nothing(finished, capsys):
    cfg, run = finished
    before = snapshot(run)
    capsys.readouterr()
    assert main(["train", str(cfg), "--run-dir", str(run), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "already at step 4, past steps=2" in err and "nothing was changed" in err
    assert snapshot(run) == before


def test_a_finished_run_rerun_writes_nothing_and_duplicates_no_rows(finished, capsys):
    cfg, run = finished
    before = snapshot(run)
    for _ in range(2):
        assert main(["train", str(cfg), "--run-dir", str(run), "--steps", "4"]) == 0
    assert snapshot(run) == before
    steps = [(r["step"], "val_loss" in r) for r in read_metrics(run)]
    assert steps == [(1, False), (2, False), (3, False), (4, False), (4, True)]


def test_a_missing_final_evaluation_is_done_once(tmp_path, capsys):
    """A run stopped after its last checkpoint but before its final evaluation gets it on the next call."""
    cfg = write_config(tmp_path / "cfg.yaml", tiny_raw(make_corpus(tmp_path / "corpus"), eval={"at_end": False}))
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--run-dir", str(run)]) == 0
    assert not [r for r in read_metrics(run) if "val_loss" in r]
    capsys.readouterr()
    assert main(["train", str(cfg), "--run-dir", str(run), "eval.at_end=true", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["step"] == 4 and "val_loss" in summary and summary["loss"] > 0  # the train row it ended with
    assert main(["train", str(cfg), "--run-dir", str(run), "eval.at_end=true"]) == 0
    assert [r["step"] for r in read_metrics(run) if "val_loss" in r] == [4]


def test_start_line_and_summary_say_what_runs_and_where_it_went(tmp_path, capsys):
    cfg = write_config(tmp_path / "cfg.yaml", tiny_raw(make_corpus(tmp_path / "corpus"), steps=2,
                                                       eval={"at_end": True, "compare_compressors": True}))
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    start = out[0]
    for part in ("M parameters", "mesh data=1 fsdp=1 tensor=1", "256 tokens/step (8 x 32)", "2 steps",
                 f"new run in {run}"):
        assert part in start, start
    # the final eval line is long; non-interactive output must not split it
    ev = [line for line in out if line.startswith("eval @ 2:")]
    assert len(ev) == 1 and "gzip -9" in ev[0] and "xz -9e" in ev[0] and len(ev[0]) > 80
    done = out.index(next(line for line in out if line.startswith("done: step 2")))
    tail = "\n".join(out[done:])
    for path in (run / "config.yaml", run / "metrics.jsonl", run / "checkpoints"):
        assert str(path) in tail
    assert "(steps 2)" in tail


def test_config_dump_is_atomic(tmp_path):
    cfg = C.from_dict(tiny_raw(tmp_path), "<test>")
    path = tmp_path / "run" / "config.yaml"
    C.dump(cfg, path)
    C.dump(cfg, path)  # over an existing file
    assert C.load(path) == cfg and [p.name for p in path.parent.iterdir()] == ["config.yaml"]


def test_eval_prints_no_routine_library_notices(finished, caplog, capsys):
    """orbax's read-only notices (eval opens checkpoints read-only on purpose) are not shown."""
    _, run = finished
    with caplog.at_level(logging.WARNING):
        assert main(["eval", str(run), "--max-tokens", "64"]) == 0
    shown = [r.getMessage() for r in caplog.records if r.name == "absl" and r.levelno >= logging.WARNING]
    assert not shown, shown


def test_routine_notices_filter_drops_only_the_named_messages():
    from jaxformer.train.checkpoint import _RoutineNotices

    def rec(msg):
        return logging.LogRecord("absl", logging.WARNING, __file__, 1, msg, (), None)
    f = _RoutineNotices()
    assert not f.filter(rec("[elements_from_buffer_after_checkpoint] While restoring the last checkpoint, "
                            "we had to advance %d elements from the buffer."))
    assert not f.filter(rec("Given directory is read only=%s"))
    assert f.filter(rec("Checkpoint step 3 failed to save"))


# slow, 8 s (its own vocabulary's programs, compiled for train, resume and eval); default-run: a BPE run trained
# through the CLI and read back from its run dir (tests/interop/test_cli.py's test_export_of_a_run_trained_from_
# scratch), the saved BPE reused by build_corpus (test_data.py's test_bpe_tokenizer), and a resume reading the run's
# saved tokenizer, not its source, for a fine-tune's Hugging Face tokenizer (tests/interop/test_cli.py's
# test_finetune_resumes_without_the_checkpoint_and_exports_exactly); a BPE run's own resume is default-run only in
# those pieces
@pytest.mark.slow
def test_a_bpe_run_keeps_its_tokenizer_and_resumes(tmp_path, capsys):
    """The trained BPE is saved in the run directory (after the fit check) and reused by resume and eval."""
    cfg = write_config(tmp_path / "cfg.yaml", tiny_raw(make_corpus(tmp_path / "corpus"), steps=2,
                                                       data={"tokenizer": "bpe", "bpe_vocab_size": 300},
                                                       model={"vocab_size": 304}))
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--run-dir", str(run)]) == 0
    saved = (run / "tokenizer.json").read_bytes()
    assert main(["train", str(cfg), "--run-dir", str(run), "--steps", "3"]) == 0
    assert (run / "tokenizer.json").read_bytes() == saved
    assert main(["eval", str(run), "--max-tokens", "64"]) == 0


def test_another_bpe_vocab_size_over_a_saved_tokenizer_is_refused(tmp_path, capsys):
    """A run keeps the BPE it trained: a config asking another ``data.bpe_vocab_size`` in its directory (a resume,
    or a new start over a run stopped before its first step) is refused before anything is built or written,
    naming the tokenizer file and both sizes; the same size, or a run without a saved tokenizer, goes on."""
    from jaxformer.train.run_dir import refuse_stale_tokenizer

    run = tmp_path / "run"
    run.mkdir()
    raw = tiny_raw(tmp_path, data={"tokenizer": "bpe", "bpe_vocab_size": 300}, model={"vocab_size": 512})
    C.dump(C.from_dict(raw, "<test>"), run / "config.yaml")
    (run / "tokenizer.json").write_text("{}")  # only its presence is read
    saved = (run / "config.yaml").read_bytes()
    cfg = write_config(tmp_path / "cfg.yaml", {**raw, "data": {**raw["data"], "bpe_vocab_size": 500}})
    assert main(["train", str(cfg), "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert ("error: " + str(run / "tokenizer.json") + " was trained with data.bpe_vocab_size=300 (the run's "
            "config.yaml); this config asks 500, and a run keeps its tokenizer: nothing was changed.") in err
    assert (run / "config.yaml").read_bytes() == saved and sorted(p.name for p in run.iterdir()) == [
        "config.yaml", "tokenizer.json"]
    same = C.from_dict(raw, "<test>")
    refuse_stale_tokenizer(same, run, [])  # the saved size: goes on
    (run / "tokenizer.json").unlink()
    bigger = C.load(cfg)
    refuse_stale_tokenizer(bigger, run, [("data.bpe_vocab_size", 300, 500)])  # nothing saved to keep


def test_a_run_from_a_gguf_file_reads_its_tokenizer_from_the_file(tmp_path):
    """A GGUF base (a LoRA fine-tune of SmolLM2's file trains) has no config.json or tokenizer files to copy: no
    ``hf_source/`` is made (it was made empty, and then generate, eval and export read their tokenizer from it and
    failed), and the tokenizer comes from the file, also for a run an older version left an empty copy in."""
    from jaxformer.train.run_dir import copy_source, saved_tokenizer_path, tokenizer_dir
    from jaxformer.train.tokenizers import HFTextTokenizer
    from tests.interop import gguf_reference

    gguf = gguf_reference.fetch()
    raw = {**tiny_raw(tmp_path, data={"tokenizer": "hf"}), "model": {"hf": str(gguf), "lora": {"rank": 2, "alpha": 4}}}
    cfg = C.from_dict(raw, "<test>")
    run = tmp_path / "run"
    run.mkdir()
    copy_source(cfg, run)
    assert not (run / "hf_source").exists() and tokenizer_dir(cfg, run) == gguf
    (run / "hf_source").mkdir()  # what an older version left
    assert tokenizer_dir(cfg, run) == gguf == saved_tokenizer_path(cfg, run)
    tok = HFTextTokenizer.load(saved_tokenizer_path(cfg, run))
    assert tok.vocab_size == 49152 and tok.decode(tok.encode("The capital of France")) == "The capital of France"


def test_only_a_final_evaluation_finishes_a_run(tmp_path):
    """finished_summary: a periodic eval row at the last step is not the final one; legacy rows without
    the flag are; with no validation split no evaluation is expected."""
    import json

    from jaxformer.train.run_dir import finished_summary

    cfg = C.from_dict(tiny_raw(tmp_path, steps=4, eval={"at_end": True}), "<test>")
    train_row = {"step": 4, "loss": 2.5, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0, "param_norm": 3.0}

    def with_rows(*evals):
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (train_row, *evals)))
        return finished_summary(cfg, tmp_path, 4)

    assert with_rows({"step": 4, "val_loss": 2.0, "final": False}) is None
    assert with_rows({"step": 4, "val_loss": 2.0, "final": True})["val_loss"] == 2.0
    assert with_rows({"step": 4, "val_loss": 2.0})["loss"] == 2.5  # written before the flag existed
    assert with_rows() is None
    assert finished_summary(cfg, tmp_path, 4, can_evaluate=False)["loss"] == 2.5


def test_a_run_without_validation_split_is_finished_and_rerun_writes_nothing(tmp_path, capsys):
    cfg = write_config(tmp_path / "cfg.yaml", tiny_raw(make_corpus(tmp_path / "corpus"), steps=2,
                                                       data={"val_fraction": 0.0}, eval={"at_end": True},
                                                       logging={"tensorboard": True}))
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--run-dir", str(run)]) == 0
    before = snapshot(run)
    capsys.readouterr()
    assert main(["train", str(cfg), "--run-dir", str(run)]) == 0
    assert "already finished at step 2" in capsys.readouterr().out
    assert snapshot(run) == before
