"""SIGINT and SIGTERM sent to a real ``python -m jaxformer.cli train`` process: the step that runs finishes and is
checkpointed, one line says where and how to resume, the exit code is 128 + the signal, and resuming gives the
per-step losses of an uninterrupted run; a second SIGINT exits at once; a signal before the first step exits with
one line, leaving a directory that the same command starts cleanly."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from jaxformer.train.metrics import read_metrics
from tests.train.helpers import make_corpus, tiny_raw, write_config

REPO = Path(__file__).resolve().parents[2]
STEPS = 40  # the interrupts come at steps ~5 and ~10; a run that ends before its signal fails the test
RESUME = re.compile(r"train: interrupted at step (\d+) \((SIGINT|SIGTERM)\): checkpoint saved in (\S+); "
                    r"resume with: (.+) \(exit code (\d+)\)$")


class Train:
    """A ``python -m jaxformer.cli train`` process whose stdout and stderr lines are read as they come."""

    def __init__(self, cfg: Path, run: Path, env: dict, *args: str):
        self.cmd = [sys.executable, "-m", "jaxformer.cli", "train", str(cfg), "--run-dir", str(run), *args]
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     preexec_fn=_default_signals)
        self.lines: queue.Queue = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(f, into), daemon=True)
                         for f, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()

    def _read(self, f, into: list[str]) -> None:
        for line in f:
            into.append(line.rstrip("\n"))
            self.lines.put((into is self.err, line))
        self.lines.put((into is self.err, None))

    def wait_for(self, pattern: str, *, stderr: bool = False, timeout: float = 120) -> str:
        """The first line (of stdout, or stderr) from now on matching ``pattern``."""
        while True:
            try:
                is_err, line = self.lines.get(timeout=timeout)
            except queue.Empty:
                self.proc.kill()
                raise AssertionError(f"no line matching {pattern!r} in {timeout} s") from None
            if line is None and is_err == stderr:
                self.finish()
                raise AssertionError(f"the process ended (rc {self.proc.returncode}) before a line matching "
                                     f"{pattern!r}:\n" + "\n".join(self.out[-5:] + self.err[-30:]))
            if line is not None and is_err == stderr and re.search(pattern, line):
                return line

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def finish(self, timeout: float = 120) -> int:
        rc = self.proc.wait(timeout=timeout)
        for t in self._readers:
            t.join(timeout=10)
        self.proc.stdout.close()
        self.proc.stderr.close()
        return rc


def _default_signals() -> None:
    """In the child: SIGINT and SIGTERM at their defaults, even when the tests run as a background job of a
    shell script (which starts them with SIGINT ignored, and an ignored signal stays ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.fixture
def default_signals():
    """SIGINT / SIGTERM of this process at Python's defaults for the test (as the ``python`` command sets them)."""
    before = {s: signal.signal(s, h) for s, h in ((signal.SIGINT, signal.default_int_handler),
                                                   (signal.SIGTERM, signal.SIG_DFL))}
    yield
    for s, h in before.items():
        signal.signal(s, h)


def _env(cache: Path) -> dict:
    # XLA_FLAGS kept (conftest's fast CPU compile): every process here compiles the same way, so losses agree
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
                JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def _rows(run: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run) if "loss" in r]


def _ckpt_steps(run: Path) -> list[int]:
    return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


def _resume_line(err: list[str], signame: str, code: int, cfg: Path, run: Path) -> int:
    """The one resume line of an interrupted run: the step it names (and what it says checked)."""
    found = [m for m in map(RESUME.match, err) if m]
    assert len(found) == 1, "\n".join(err)
    m = found[0]
    assert m[2] == signame and int(m[5]) == code and Path(m[3]) == run / "checkpoints"
    assert m[4].startswith(f"jaxformer train {cfg} --run-dir {run}")
    assert not any("Traceback" in line for line in err), "\n".join(err)
    return int(m[1])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("interrupt")
    raw = tiny_raw(make_corpus(tmp / "corpus"), steps=STEPS, checkpoint={"every": 20, "keep": 3},
                   logging={"every": 1, "progress": True, "peak_tflops": 1.0})
    return tmp, write_config(tmp / "cfg.yaml", raw), _env(tmp / "jax_cache")


@pytest.fixture(scope="module")
def reference(setup):
    """A signal before the first step (during the first compile: a cache of its own, empty), then the same
    command again, which runs uninterrupted: ``(the signalled process's rc and stderr, run dir, rows)``."""
    tmp, cfg, env = setup
    run = tmp / "reference"
    first = Train(cfg, run, _env(tmp / "cold_cache"))
    first.wait_for(r"^train: .* new run in ")  # the start line: the first step compiles next
    first.signal(signal.SIGINT)
    rc = first.finish()
    early = (rc, list(first.err), _ckpt_steps(run), _rows(run))
    again = Train(cfg, run, env)
    assert again.finish() == 0, "\n".join(again.err[-30:])
    assert any(f"new run in {run}" in line for line in again.out)
    return early, run, _rows(run)


def test_a_signal_before_the_first_step_exits_with_one_line_and_the_same_command_starts_cleanly(reference):
    (rc, err, steps, rows), run, ref = reference
    assert rc == 130 and len(err) == 1, err
    assert re.match(r"train: interrupted \(SIGINT\) before the first step: nothing to save; run again with: "
                    r"jaxformer train .* \(exit code 130\)$", err[0]), err
    assert steps == [] and rows == []
    assert [s for s, *_ in ref] == list(range(1, STEPS + 1))  # ... and the same command then ran them all


def test_sigint_then_sigterm_finish_the_step_checkpoint_it_and_resume_exactly(setup, reference):
    tmp, cfg, env = setup
    run = tmp / "run"

    first = Train(cfg, run, env)
    first.wait_for(r"^step 3/")
    first.signal(signal.SIGINT)
    assert first.finish() == 130
    n1 = _resume_line(first.err, "SIGINT", 130, cfg, run)
    assert 3 <= n1 < 20, n1  # before the first scheduled checkpoint (20): only the interrupt saved it
    assert _ckpt_steps(run) == [n1] and [s for s, *_ in _rows(run)] == list(range(1, n1 + 1))

    second = Train(cfg, run, env)
    second.wait_for(rf"resuming at step {n1} ")
    second.wait_for(rf"^step {n1 + 3}/")
    second.signal(signal.SIGTERM)
    assert second.finish() == 143
    n2 = _resume_line(second.err, "SIGTERM", 143, cfg, run)
    assert n1 + 3 <= n2 < STEPS and _ckpt_steps(run)[-1] == n2
    # steps 1 .. n1 before the interrupt and n1 + 1 .. n2 resumed from its checkpoint, against the uninterrupted
    # run's. No third process resuming from n2 to the end: 6 s for the same resume from an interrupt's checkpoint
    _, _, want = reference
    assert _rows(run) == want[:n2]  # exact: the same floats, step by step


def test_a_second_sigint_exits_at_once_without_the_checkpoint(setup):
    """Steps of ~0.5 s (a large batch): the second SIGINT comes while the step the first one waits for runs."""
    tmp, cfg, env = setup
    run = tmp / "twice"
    proc = Train(cfg, run, env, "batch_size=256")
    proc.wait_for(r"^step 1/")
    proc.signal(signal.SIGINT)
    proc.wait_for(r"^train: SIGINT: finishing the current step", stderr=True)
    proc.signal(signal.SIGINT)
    assert proc.finish() == 130
    assert len(proc.err) == 2 and re.match(r"train: second signal \(SIGINT\): exited at once, without the checkpoint "
                                           r"of this step; .* \(exit code 130\)$", proc.err[1]), proc.err
    assert _ckpt_steps(run) == []  # the step it stopped at was never saved


# -- a library call (a notebook, a test session): the steps stop checkpointed, and otherwise a signal does
#    what it did before train() was called (KeyboardInterrupt), instead of ending the process


def test_a_library_call_raises_interrupted_after_checkpointing_and_restores_the_handlers(tmp_path, default_signals):
    from jaxformer.train import config as C
    from jaxformer.train.loop import Interrupted, train

    cfg = C.from_dict(tiny_raw(make_corpus(tmp_path / "corpus"), steps=8, checkpoint={"every": 100},
                               logging={"peak_tflops": 1.0}), "<test>")

    def hook(step, row):  # called for step 2 while step 3 runs
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(Interrupted) as e:
        train(cfg, tmp_path / "run", on_step=hook)
    assert (e.value.step, e.value.signum, e.value.exit_code) == (3, signal.SIGINT, 130)
    assert _ckpt_steps(tmp_path / "run") == [3] and [s for s, *_ in _rows(tmp_path / "run")] == [1, 2, 3]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_library_call_interrupted_before_the_first_step_gets_a_plain_keyboard_interrupt(tmp_path, monkeypatch,
                                                                                          default_signals):
    from jaxformer.train import config as C
    from jaxformer.train import loop
    from jaxformer.train.loop import Interrupted

    build = loop.build_corpus

    def interrupted_build(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return build(*args, **kwargs)
    monkeypatch.setattr(loop, "build_corpus", interrupted_build)
    cfg = C.from_dict(tiny_raw(make_corpus(tmp_path / "corpus"), logging={"peak_tflops": 1.0}), "<test>")
    with pytest.raises(KeyboardInterrupt) as e:
        loop.train(cfg, tmp_path / "run")
    assert not isinstance(e.value, Interrupted)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_sigint_stays_ignored(tmp_path, default_signals):
    """A shell script's background job starts with SIGINT ignored: training does not start catching it."""
    from jaxformer.train import config as C
    from jaxformer.train.loop import train

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cfg = C.from_dict(tiny_raw(make_corpus(tmp_path / "corpus"), steps=4, logging={"peak_tflops": 1.0}), "<test>")
    summary = train(cfg, tmp_path / "run", on_step=lambda step, row: os.kill(os.getpid(), signal.SIGINT))
    assert summary["step"] == 4 and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
