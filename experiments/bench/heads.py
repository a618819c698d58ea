"""The number of heads at a fixed width, side by side in one run: a whole jitted train step of the main job's
model with d_model split into 1 .. 64 heads (study 3's speed figures; every point has the same parameters and
projection FLOPs, so what changes is the attention's shape: more, smaller score matrices).

Calls alternate between the head counts in rounds so drift on a shared machine hits all of them; the table
shows the median step time per head count, its ratio to the baseline's (4 heads, the main job's) and the
interquartile range of that ratio over the rounds.

    python experiments/bench/heads.py                 # CPU-sized default: 1, 2, 4, 8, 16, 32, 64 heads
    python experiments/bench/heads.py --quick         # toy batch, one round, three head counts (tests)
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
from norms import TrainCase, alternate, iqr
from timing import cpu_line


def step_fns(config: str, heads: list[int], batch: int) -> dict[int, TrainCase]:
    """The main job's model with each head count (kv heads equal: study 3's ``n_kv_heads: null``)."""
    return {n: TrainCase(config, [f"model.attention.n_heads={n}", "model.attention.n_kv_heads=null",
                                  f"batch_size={batch}"]) for n in heads}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="experiments/configs/stdlib_bytes.yaml")
    p.add_argument("--heads", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--baseline", type=int, default=4)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="toy batch, one round, heads 1, 4, 16")
    args = p.parse_args(argv)
    if args.quick:
        args.heads, args.batch, args.rounds = [1, 4, 16], 2, 1
    if args.baseline not in args.heads:
        p.error(f"--baseline {args.baseline} is not among --heads {args.heads}")
    steps = step_fns(args.config, args.heads, args.batch)

    med, per = alternate(steps, lambda n: (), args.rounds, 2 if args.quick else 5)
    cfg = steps[args.baseline].cfg
    print(cpu_line())
    print(f"train step: {cfg.model.n_layers} layers, d_model {cfg.model.d_model}, {args.batch} x {cfg.seq_len} "
          f"tokens; ratios against {args.baseline} heads")
    print(f"{'heads':>5s} {'head dim':>8s} {'step':>11s} {'tokens/s':>9s} {'vs base':>7s} {'per-round IQR':>15s}")
    base = args.baseline
    for n in args.heads:
        q1, q3 = iqr([r[n] / r[base] for r in per])
        print(f"{n:5d} {cfg.model.d_model // n:8d} {med[n] * 1e3:9.2f}ms {args.batch * cfg.seq_len / med[n]:9,.0f} "
              f"{med[n] / med[base]:7.3f} {f'[{q1:.3f}, {q3:.3f}]':>15s}")
    print(f"(median of {args.rounds} alternating rounds of {2 if args.quick else 5} steps; per-round IQR: the "
          f"quartiles of each round's ratio of medians; {jax.default_backend()}, {jax.device_count()} device(s); "
          f"numpy {np.__version__}, jax {jax.__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
