"""Run the two-process training of ``tests/train/test_multihost.py`` many times: how often it hangs, and where.

Two CPU processes (jax.distributed, gloo collectives) train a tiny model for 3 steps on a 2 x 2 mesh and save
checkpoints at steps 2 and 3, as the slow test does once. A rare deadlock needs many runs to be seen or ruled out;
a run whose worker is still going after ``--timeout`` seconds is a hang, and that worker's threads' stacks (from
faulthandler, the frames of this repository and orbax) are printed before it is killed.

    python experiments/multihost_repeat.py --runs 20            # ~20 s a run on 2 cores; a hang costs --timeout
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.train.test_multihost import run_workers  # noqa: E402


def stacks(err: str) -> str:
    """The faulthandler dump at the end of a worker's stderr, its frames in this repository and orbax only."""
    start = err.find("Thread 0x")
    if start < 0:
        return "(no stacks)"
    keep = [line for line in err[start:].splitlines()
            if line.startswith(("Thread", "Current thread")) or str(ROOT) in line and "site-packages" not in line
            or "orbax" in line or "multihost_utils" in line]
    return "\n".join(keep)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--timeout", type=float, default=75.0, help="seconds before a run counts as hung")
    a = p.parse_args(argv)
    hangs = failures = 0
    for n in range(a.runs):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            codes, outs, _ = run_workers(Path(d), a.timeout)
            print(f"run {n}: exit codes {codes}, {time.perf_counter() - t0:.0f} s", flush=True)
            if None in codes:
                hangs += 1
                for i, (_, err) in enumerate(outs):
                    print(f"--- worker {i} ---\n{stacks(err)}")
            elif any(codes):
                failures += 1
                for i, (_, err) in enumerate(outs):
                    print(f"--- worker {i} stderr ---\n{err[-3000:]}")
    print(f"{hangs} hung and {failures} failed of {a.runs} runs (timeout {a.timeout:g} s; CPU: {os.cpu_count()} "
          f"cores)")
    return 1 if hangs or failures else 0


if __name__ == "__main__":
    sys.exit(main())
