"""Tiny experiments for the training tests: a small text corpus and a 2-layer model."""

from __future__ import annotations

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
