"""Study 8's per-block gradient table: each block's gradient norm at initialisation, from the rows' attention
probe (``probes.init.grad_norm_layers``: the mean-loss gradient norm of each block's parameters, first block
first), for every setting of the sweep, seed 0 and the spread over seeds of the first block's.

    python experiments/studies/tables/residual_gradients.py [experiments/results/studies/residuals/summary.jsonl]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[2] / "results" / "studies" / "residuals" / "summary.jsonl"
KEYS = ("model.norm_position", "model.init_std", "model.n_layers", "model.residual")


def fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.3g}"


def table(rows: list[dict]) -> str:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r["values"][k] for k in KEYS), []).append(r)
    lines = ["| norm | init std | n_layers | residual | seed 0: blocks 1, 2, 3 | seed 0: last block | "
             "first block, every seed [min, max] | first block after training, median |",
             "|---|---|---|---|---|---|---|---|"]
    for key in groups:  # in the rows' order: the sweep's
        by_seed = sorted(groups[key], key=lambda r: r["seed"])
        first = by_seed[0]["probes"]["init"]["grad_norm_layers"]
        init = [r["probes"]["init"]["grad_norm_layers"][0] for r in by_seed]
        final = [r["probes"]["final"]["grad_norm_layers"][0] for r in by_seed]
        norm, std, n, res = key
        lines.append(f"| {norm} | {std} | {n} | {str(res).lower()} | {', '.join(fmt(g) for g in first[:3])} | "
                     f"{fmt(first[-1])} | [{fmt(min(init))}, {fmt(max(init))}] | {statistics.median(final):.2g} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0]) if argv else DEFAULT
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
