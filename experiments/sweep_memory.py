"""What one process running a study's points one after another, as ``jaxformer sweep`` does, keeps of each.

After each point it prints the process's memory mappings (each compiled program's machine code takes three a
kernel; Linux allows ``vm.max_map_count``, 65,530 by default), its resident set as the sweep leaves it, its
high-water mark, and the arrays still alive (there should be none). ``--no-release`` runs the sweep without
its ``release_host_memory`` between points (compiled programs kept, glibc's freed heap not trimmed), to
compare; ``--points N`` stops after N points.
Results: ``experiments/results/sweep_memory.md``.

    python experiments/sweep_memory.py experiments/studies/lora.yaml --points 5 --no-release   # 75-135 s a point here
    python experiments/sweep_memory.py experiments/studies/lora.yaml --points 5
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "bench"))

import jax  # noqa: E402

import jaxformer.train.loop as loop  # noqa: E402
from jaxformer.study.sweep import load_sweep, run_sweep  # noqa: E402
from procmem import proc_kb, proc_maps  # noqa: E402


class Enough(Exception):
    pass


def max_map_count() -> str:
    try:
        return Path("/proc/sys/vm/max_map_count").read_text().strip()
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=Path, help="a sweep file (experiments/studies/*.yaml)")
    ap.add_argument("--points", type=int, default=None, help="stop after this many points (default: all)")
    ap.add_argument("--no-release", action="store_true", help="no release_host_memory between points")
    ap.add_argument("--full", action="store_true", help="the points as the study gives them (default: --quick's)")
    args = ap.parse_args(argv)
    if args.no_release:
        loop.release_host_memory = lambda: None  # run_sweep looks it up in the module at its call
    sweep = load_sweep(args.study)
    t0, done = time.perf_counter(), []
    print(f"{args.study.name}: {'without' if args.no_release else 'with'} release_host_memory between points; "
          f"JAX {jax.__version__}")
    print(f"vm.max_map_count {max_map_count()}; XLA_FLAGS {os.environ.get('XLA_FLAGS', '(none)')}")
    print("| point | s | mappings | resident GB | high-water GB | arrays alive |\n|---|---:|---:|---:|---:|---:|")

    def say(line: str) -> None:
        ran = re.match(r"\[\d+/\d+\] (\S+): .* in \d+ s$", line)
        if ran is None:
            return  # a point starting, skipped or copied
        done.append(line)
        alive = jax.live_arrays()
        name = ran.group(1)
        print(f"| {len(done)} {name} | {time.perf_counter() - t0:.0f} | {proc_maps():,} | {proc_kb('VmRSS') / 1e6:.2f} | "
              f"{proc_kb('VmHWM') / 1e6:.2f} | {len(alive)} ({sum(a.nbytes for a in alive) / 1e6:.0f} MB) |",
              flush=True)
        if args.points is not None and len(done) >= args.points:
            raise Enough

    with tempfile.TemporaryDirectory() as out:
        try:
            run_sweep(sweep, out, quick=not args.full, say=say)
        except Enough:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
