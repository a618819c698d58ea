"""A run killed with SIGKILL mid-way and resumed gives exactly the per-step losses of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from jaxformer.train.metrics import read_metrics
from tests.train.helpers import make_corpus, tiny_raw, write_config

REPO = Path(__file__).resolve().parents[2]

KILLER = """
import os, signal, sys, time
from pathlib import Path
from jaxformer.train import config as C
from jaxformer.train.loop import train

cfg, run, kill_at = C.load(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])

def hook(step, row):
    if step == kill_at:  # step kill_at-1 has a checkpoint being written: wait until it is committed
        done = run / "checkpoints" / str(kill_at - 1) / "commit_success.txt"
        deadline = time.time() + 120
        while not done.exists() and time.time() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)

train(cfg, run, on_step=hook)
"""


def _env(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.pop("XLA_FLAGS", None)
    return env


def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    cfg = write_config(tmp_path / "cfg.yaml", tiny_raw(corpus, steps=8, checkpoint={"every": 2, "keep": 3}))
    env = _env(tmp_path)
    cli = [sys.executable, "-m", "jaxformer.cli", "train", str(cfg), "--run-dir"]

    ref = subprocess.run(cli + [str(tmp_path / "ref")], env=env, capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]

    run = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", KILLER, str(cfg), str(run), "5"], env=env,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (run / "checkpoints" / "4").is_dir() and not (run / "checkpoints" / "8").exists()

    resumed = subprocess.run(cli + [str(run)], env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at step 4" in resumed.stdout

    want = [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / "ref") if "loss" in r]
    got = [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run) if "loss" in r]
    assert [s for s, *_ in want] == list(range(1, 9))
    assert got == want  # exact: same floats, step by step
