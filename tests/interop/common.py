"""Shared helpers of the Hugging Face interop tests: the committed fixtures and how logits are compared.

Fixtures (``tests/interop/fixtures/<name>/``, made by ``make_fixtures.py`` with transformers itself):
the checkpoint directory (config.json, safetensors, tokenizer files), ``expected.npz`` (the inputs and
transformers' outputs) and ``meta.json``. Tolerances: float32 loads compare within ``ATOL`` = 1e-4
absolute (the issue's bound; measured differences are ~1e-6). bfloat16 loads (parameters *and* compute
in bf16: 8 bits of mantissa, ~0.4% per rounding, some hundred roundings deep) within ``BF16_RTOL`` times
the standard deviation of transformers' float32 logits; measured max |diff| / std on 2026-12-01: gpt2 0.041,
bert 0.059 (hidden states 0.039),
bloom 0.044, bloom_6heads 0.046, qwen2 0.062, llama3 0.067, llama 0.092, mistral 0.104 (the RMSNorm
models, whose random fixture weights give larger activations). The bf16 *parameters* are checked exactly
(the float32 ones rounded to nearest even) separately.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures"
ATOL = 1e-4
BF16_RTOL = 0.15  # of the logits' standard deviation, max over positions (measured up to 0.104)


def fixture(name: str) -> tuple[Path, dict[str, np.ndarray], dict]:
    """``(checkpoint dir, expected arrays, meta)`` of fixture ``name``."""
    d = FIXTURES / name
    assert d.is_dir(), f"fixture {d} is missing: run tests/interop/make_fixtures.py (see its docstring)"
    with np.load(d / "expected.npz") as z:
        expected = {k: z[k] for k in z.files}
    meta = json.loads((d / "meta.json").read_text()) if (d / "meta.json").is_file() else {}
    return d, expected, meta


def max_diff(ours, theirs, mask=None) -> float:
    """max |ours - theirs| over the positions where ``mask`` [B, T] is nonzero (all when None)."""
    diff = np.abs(np.asarray(ours, np.float64) - np.asarray(theirs, np.float64))
    if mask is not None:
        diff = diff[np.asarray(mask).astype(bool)]
    return float(diff.max())


REGEN_RTOL = 1e-5
"""A regenerated fixture's float arrays against the committed ones: within this fraction of each array's largest
entry. torch's CPU kernels differ by ISA (AVX2 / AVX-512) and build, and the differences grow through the layers:
bert's logits 1.6e-6 apart and a LoRA adapter's 2.0e-6 of 4.1 regenerated on an AVX2-only Zen 2 with torch 2.14.1
against fixtures made with 2.13.0; a changed generator or config moves them by orders of magnitude more."""


def assert_regenerated(fresh: dict[str, np.ndarray], committed: dict[str, np.ndarray], where: str) -> None:
    """The same arrays: integers exactly, floats within :data:`REGEN_RTOL` of each array's largest entry."""
    assert fresh.keys() == committed.keys(), where
    for k in committed:
        if not np.issubdtype(committed[k].dtype, np.floating):
            np.testing.assert_array_equal(fresh[k], committed[k], err_msg=f"{where}/{k}")
            continue
        scale = float(np.abs(committed[k]).max()) or 1.0
        np.testing.assert_allclose(fresh[k], committed[k], rtol=0, atol=REGEN_RTOL * scale, err_msg=f"{where}/{k}")
