"""Tiny experiments for the training tests: a small text corpus and a 2-layer model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from jaxformer.train import config as C

TINY_MODEL = {"preset": "llama_tiny", "vocab_size": 264, "d_model": 32, "n_layers": 2, "n_heads": 4,
              "n_kv_heads": 2, "max_seq_len": 32}


def make_corpus(root: Path, n_files: int = 40) -> Path:
    """A directory of small, varied Python-like text files (deterministic)."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        lines = [f"def f{i}_{j}(x):\n    return x * {j} + {i}  # line {j}\n" for j in range(3 + i % 7)]
        (root / f"mod_{i:03d}.py").write_text("".join(lines))
    return root


def tiny_raw(corpus: Path, **top) -> dict:
    raw = {
        "seed": 0, "steps": 4, "batch_size": 8, "seq_len": 32,
        "model": dict(TINY_MODEL),
        "data": {"source": "text", "path": str(corpus), "val_fraction": 0.2},
        "optimizer": {"lr": 3e-3},
        "schedule": {"kind": "cosine", "warmup_steps": 1, "decay_steps": 100},
        "mesh": {"data": 1},
        "checkpoint": {"every": 2, "keep": 5},
        "logging": {"every": 1, "progress": False, "tensorboard": False},
        "eval": {"max_tokens": 256, "at_end": False},
    }
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(raw.get(k), dict):
            raw[k] = {**raw[k], **v}
        else:
            raw[k] = v
    return raw


def tiny_config(corpus: Path, **top) -> C.ExperimentConfig:
    return C.from_dict(tiny_raw(corpus, **top), "<test>")


def write_config(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def finished_run(tmp: Path) -> tuple[Path, Path]:
    """A tiny run trained to the end through the CLI, with its final evaluation: (config path, run dir)."""
    from jaxformer.cli import main

    cfg = write_config(tmp / "cfg.yaml", tiny_raw(make_corpus(tmp / "corpus"), eval={"at_end": True}))
    run = tmp / "run"
    assert main(["train", str(cfg), "--run-dir", str(run)]) == 0
    return cfg, run


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


def subprocess_env(tmp_path):
    """The environment of a test's training subprocesses: conftest's XLA_FLAGS (fast CPU compiles) kept, since
    every process of a comparison compiles the same way, and one compilation cache across them."""
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
                JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def killed_and_resumed(cfg: Path, tmp_path: Path, steps: int, kill_at: int = 5) -> tuple[list, list]:
    """Train ``cfg`` to the end in ``tmp_path/ref``; train it again in ``tmp_path/run``, SIGKILL the process at
    step ``kill_at`` (the checkpoint of step ``kill_at - 1`` committed), resume it with the same command.
    Returns ``(uninterrupted, resumed)`` per-step ``(step, loss, grad_norm)`` rows."""
    env = subprocess_env(tmp_path)
    cli = [sys.executable, "-m", "jaxformer.cli", "train", str(cfg), "--run-dir"]
    ref = subprocess.run(cli + [str(tmp_path / "ref")], env=env, capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]

    run = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", KILLER, str(cfg), str(run), str(kill_at)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    saved = kill_at - 1
    assert (run / "checkpoints" / str(saved)).is_dir() and not (run / "checkpoints" / str(steps)).exists()

    resumed = subprocess.run(cli + [str(run)], env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming at step {saved}" in resumed.stdout

    from jaxformer.train.metrics import read_metrics

    def rows(d):
        return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(d) if "loss" in r]

    want = rows(tmp_path / "ref")
    assert [s for s, *_ in want] == list(range(1, steps + 1))
    return want, rows(run)
