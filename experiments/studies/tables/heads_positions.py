"""Study 3 on one axes: each head count's validation bits/byte minus 4 heads' (paired by seed, mean and 95%
Student's t interval), with RoPE (``heads.yaml``) and with ALiBi (``heads_alibi.yaml``): the page's reversal
(more, smaller heads cost under RoPE, help under ALiBi) in one table and one plot.

    python experiments/studies/tables/heads_positions.py [--plot PNG] [RESULTS_DIR]

``RESULTS_DIR`` (default ``experiments/results/studies/heads``) holds the RoPE sweep's rows and, in ``alibi/``,
the ALiBi control's, as a report reads them (``jaxformer.study.rows.gather``: run directories or ``points/``,
else ``summary.jsonl``); the differences are the reports' own (``jaxformer.study.stats.paired_difference``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DEFAULT = REPO / "experiments" / "results" / "studies" / "heads"
SWEEPS = (("RoPE", "heads.yaml", ""), ("ALiBi", "heads_alibi.yaml", "alibi"))
BASELINE = 4


def differences(results: Path) -> dict[str, list[tuple[int, object]]]:
    """``{encoding: [(n_heads, PairedDifference vs 4 heads)]}`` in each sweep's head order."""
    from jaxformer.study.rows import gather
    from jaxformer.study.stats import paired_difference
    from jaxformer.study.sweep import load_sweep

    out = {}
    for name, sweep_file, sub in SWEEPS:
        sweep = load_sweep(REPO / "experiments" / "studies" / sweep_file)
        by: dict[int, dict[int, float]] = {}
        for r in gather(sweep, results / sub if sub else results):
            if not r["diverged"]:
                by.setdefault(r["values"]["model.n_heads"], {})[r["seed"]] = r["val_bpb"]
        out[name] = [(n, paired_difference(vals, by[BASELINE])) for n, vals in by.items() if n != BASELINE]
    return out


def table(diffs) -> str:
    lines = [f"| encoding | n_heads | minus {BASELINE} heads, bits/byte [95% interval] | seeds |", "|---|---|---|---|"]
    for name, rows in diffs.items():
        for n, d in rows:
            lines.append(f"| {name} | {n} | {d.mean:+.4f} [{d.lo:+.4f}, {d.hi:+.4f}] | {d.n} |")
    return "\n".join(lines)


def plot(diffs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), layout="constrained")
    for i, (name, rows) in enumerate(diffs.items()):
        xs = [n * (1.06 if i else 1 / 1.06) for n, _ in rows]  # side by side where both have a head count
        ax.errorbar(xs, [d.mean for _, d in rows], yerr=[[d.mean - d.lo for _, d in rows],
                                                         [d.hi - d.mean for _, d in rows]],
                    marker="o", capsize=3, ls="none", color=f"C{i}", label=name)
    ax.axhline(0.0, color="grey", lw=1, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4, 8, 16, 32, 64], ["1", "2", "4", "8", "16", "32", "64"])
    ax.set_xlabel("heads at d_model 128 (head dim 128 / heads)")
    ax.set_ylabel(f"val bits/byte minus {BASELINE} heads' (paired, 95% t interval)")
    ax.legend(title="positions", fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle("heads: the cost of more, smaller heads depends on the positions (above 0: worse)", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="?", type=Path, default=DEFAULT)
    ap.add_argument("--plot", type=Path, help="also draw the differences into this PNG")
    args = ap.parse_args(argv)
    diffs = differences(args.results)
    print(table(diffs))
    if args.plot:
        plot(diffs, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
