"""Study 8's per-block gradient table: each block's gradient norm at initialisation, from the rows' attention
probe (``probes.init.grad_norm_layers``: the mean-loss gradient norm of each block's parameters, first block
first), for every setting of the sweep: seed 0's blocks, and over every seed the first block's range at
initialisation and median after training.

    python experiments/studies/tables/residual_gradients.py [RESULTS_DIR]

``RESULTS_DIR`` (default ``experiments/results/studies/residuals``) holds the sweep's rows as a report reads
them: run directories or ``points/``, else ``summary.jsonl`` (``jaxformer.study.rows.gather``: only rows of the
sweep file as it now reads, in its point order).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SWEEP = REPO / "experiments" / "studies" / "residuals.yaml"
DEFAULT = REPO / "experiments" / "results" / "studies" / "residuals"
KEYS = ("model.norm_position", "model.init_std", "model.n_layers", "model.residual")


def fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.3g}"


def table(rows: list[dict]) -> str:
    """The markdown table of ``rows`` (sweep rows with the attention probe), a line per setting in their order."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r["values"][k] for k in KEYS), []).append(r)
    lines = ["| norm | init std | n_layers | residual | seed 0: blocks 1, 2, 3 | seed 0: last block | "
             "first block, every seed [min, max] | first block after training, median |",
             "|---|---|---|---|---|---|---|---|"]
    for (norm, std, n, res), group in groups.items():
        seed0 = next((r for r in group if r["seed"] == 0), None)
        blocks = seed0["probes"]["init"]["grad_norm_layers"] if seed0 else None
        init = [r["probes"]["init"]["grad_norm_layers"][0] for r in group]
        final = [r["probes"]["final"]["grad_norm_layers"][0] for r in group]
        head = f"{', '.join(fmt(g) for g in blocks[:3])} | {fmt(blocks[-1])}" if blocks else "(no seed 0) | "
        lines.append(f"| {norm} | {std} | {n} | {str(res).lower()} | {head} | [{fmt(min(init))}, {fmt(max(init))}] "
                     f"| {statistics.median(final):.2g} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from jaxformer.study.rows import gather
    from jaxformer.study.sweep import load_sweep

    argv = sys.argv[1:] if argv is None else argv
    print(table(gather(load_sweep(SWEEP), Path(argv[0]) if argv else DEFAULT)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
