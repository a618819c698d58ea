"""``experiments/bench/gpu_suite.py --dry-run``: every part of the GPU suite reports, on the CPU.

The dry run is the suite's own code at toy sizes with the kernels in interpret mode (the first case of
each list runs, the rest are traced), each part in its own subprocess under its time box, plus every
kernel case lowered for CUDA at its GPU size, so the suite cannot fail on a GPU for a reason the CPU
could have caught. A second run checks that a part past its time box is killed and reported while the
suite goes on.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "experiments" / "bench" / "gpu_suite.py"


def _suite(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(SUITE), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


# slow (25 s): run it before a device session and after any change to the suite (README, "GPU suite")
@pytest.mark.slow
def test_dry_run_every_part_reports(tmp_path):
    proc = _suite("--dry-run", "--out", str(tmp_path), timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    report = (tmp_path / "gpu_suite_dryrun.md").read_text()
    assert not (tmp_path / "gpu_suite.md").exists(), "a dry run must not write the results file"
    header = re.search(r"^## Run: (gpu_suite \| device: .*)$", report, re.M)
    assert header and "JAX " in header.group(1) and "Python " in header.group(1) and "DRY RUN" in header.group(1)
    assert re.search(r"\| 20\d\d-\d\d-\d\d \d\d:\d\d UTC \|", header.group(1))
    for part in "abcde":
        assert f"### ({part}) " in report, part
        status = re.search(rf"^\*\*\({part}\) (\S+)\*\* in [\d.]+ s: (.*)$", report, re.M)
        assert status, f"part {part} did not report"
        assert status.group(1) == "ok" or (part == "d" and status.group(1) == "skipped"), status.group(0)
    # (a): the first case of each list ran against its oracle, the others were traced
    assert re.search(r"\| all: window\+ALiBi\+softcap\+segments\+ragged \| bfloat16 \|.*\| ok \|", report)
    assert re.search(r"\| block-sparse Longformer\+BigBird GQA \|.*\| ok \|", report)
    assert re.search(r"\| paged GQA ragged \|.*\| ok \|", report)
    assert report.count("| traced |") >= 8
    # every kernel case, at its GPU size, lowers for CUDA (compiled Triton kernels, an abstract H200)
    assert report.count(" 3 kernels |") == 10 and report.count(" 1 kernels |") == 3
    assert report.count("- CUDA lowering, ") == 4 and "CUDA lowering, ours" in report
    assert "**FAIL**" not in report
    # (b): our kernel and the anchors side by side; cuDNN and Mosaic GPU cannot run on a CPU
    assert "| ours | cudnn | xla | jax-pallas-triton | jax-pallas-mgpu |" in report
    assert "Goals (issue 16):" in report
    # (c), (d), (e)
    assert "Goal (issue 16): paged decode >= 80% of copy bandwidth" in report
    assert "Goal (issue 16): train step MFU >= 45%" in report or "Skipped: jaxformer.model needs" in report
    assert "| fwd | table: " in report and "| dkv | table: " in report
    assert "KernelConfig(" in report or "(block_q, block_k) = " in report  # the proposed table
    assert "| e | ok |" in report.split("### Summary")[-1]


def test_a_part_past_its_time_box_is_stopped_and_the_suite_goes_on(tmp_path):
    proc = _suite("--dry-run", "--out", str(tmp_path), "--parts", "d,e", "--boxes", "d=0.2,e=0.2", timeout=120)
    report = (tmp_path / "gpu_suite_dryrun.md").read_text()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for part in "de":
        assert f"**({part}) STOPPED** in" in report and "killed at its time box (0.2 s)" in report, report
    assert "no header" in report  # the first part died before it could write the run's header
