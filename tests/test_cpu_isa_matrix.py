"""The attention gradient checks under several CPU instruction sets, with and without fast compiles.

XLA's CPU code differs between machines and compile flags, and a gradient that is finite on one
can be NaN on another: e.g. a softmax whose row max is differentiated through its argmax gives NaN
where recomputed logits round differently and no element equals the max (0/0), as on an AMD EPYC
(AVX-512) under the fast-compile flags of tests/conftest.py. XLA flags are per process, so each
cell of the matrix runs the family in a fresh pytest subprocess. ``--xla_cpu_max_isa`` caps the vector
instructions XLA may emit (a cap above what the CPU has changes nothing, so AVX512 on an AVX2
machine repeats the AVX2 cell).

The family: every attention path's forward and gradients with softcap + ALiBi + causal + GQA and
empty rows, against its independent reference, and the dense training path (hand-written derivative,
causal chunks) against autodiff of the reference.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAMILY = [
    "tests/nn/test_modules.py::test_attention_matches_reference_forward_and_grad",
    "tests/ops/test_attention.py::test_gradients_match_float64_reference",
    "tests/ops/test_attention.py::test_fully_masked_rows_are_zero_with_zero_gradients",
    # the training shape only (4 causal chunks, segments, a row that sees nothing): the other cases add time, not paths
    "tests/ops/test_attention.py::test_dense_training_path_matches_reference_values_and_gradients"
    "[256-256-True-None-True-None]",
    "tests/ops/test_attention_impls.py::test_impls_agree",
    "tests/ops/test_blockwise.py::test_causal_mqa_window_alibi_softcap",
    "tests/ops/test_blockwise.py::test_segments_lengths_and_empty_rows",
    "tests/ops/test_sparse.py::test_matches_dense_forward_and_gradients",
    "tests/pallas_kernels/test_flash_api.py::test_reference_matches_xla_attention",
]


# The default run holds one cell, AVX2 with the default compile (the commonest ISA below this machine's, as
# users compile): the default run itself runs the family under the fast-compile flags at the machine's own ISA
# (the AVX-512 EPYC case above). That cell runs the attention core's part of the family: the xla path's gradients
# against float64 (ALiBi, GQA, causal, lengths), the hand-written derivative on a fully masked row, and blockwise's
# softcap, ALiBi, window, segments, lengths and empty rows against the xla path (3.4 s of the family's 12 under the
# fast compile). ~25 s less than with the module's five cases and the dense path's 4-chunk training shape (45 s):
# those, with the sparse, impls-agree and Pallas-reference members, run in the six full-family cells, all
# slow-marked (40-50 s each): `pytest -m slow -k cpu_isa`.
CORE_PART = [t for t in FAMILY if t.startswith("tests/ops/test_blockwise.py") or t.endswith(
    ("::test_gradients_match_float64_reference", "::test_fully_masked_rows_are_zero_with_zero_gradients"))]
CELLS = [pytest.param(isa, fast, FAMILY, id=f"{isa}-{'fast' if fast else 'default'}-compile", marks=pytest.mark.slow)
         for isa in ("SSE4_2", "AVX2", "AVX512") for fast in (True, False)]
CELLS.append(pytest.param("AVX2", False, CORE_PART, id="AVX2-default-compile-core"))


@pytest.mark.parametrize("isa,fast_compile,family", CELLS)
def test_attention_gradients_under_cpu_isa(isa, fast_compile, family):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XLA_FLAGS"))}
    env.update(XLA_FLAGS=f"--xla_cpu_max_isa={isa}", JAXFORMER_FAST_COMPILE="1" if fast_compile else "0",
               # The ISA is what varies here: the pinned all-feature @examples plus one draw per property test.
               HYPOTHESIS_MAX_EXAMPLES="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:xdist", *family],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"XLA_FLAGS={env['XLA_FLAGS']} fast_compile={fast_compile}:\n{proc.stdout[-6000:]}"
