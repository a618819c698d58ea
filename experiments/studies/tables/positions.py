"""Study 4's two tables that its report does not print, from the committed rows:

* the length gap: each encoding's bits/byte at 1,024 minus at 128 evaluated tokens (``positions.yaml``'s
  ``eval_lengths`` rows: the same 32,764 bytes at every length), paired by seed;
* the bag-of-words control (``positions_order.yaml``): the order probe's gain (the loss on each window's last
  quarter with the tokens before it shuffled, minus intact; nats per byte) after training, per arm, paired by seed
  as shuffled minus intact, and no positions minus RoPE.

Every interval is the reports' own (:func:`jaxformer.study.stats.paired_difference`: mean and 95% Student's t).

    python experiments/studies/tables/positions.py [RESULTS_DIR]      (default experiments/results/studies/positions)
"""

from __future__ import annotations

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DEFAULT = REPO / "experiments" / "results" / "studies" / "positions"
SHORT, LONG = 128, 1024


def _rows(sweep_file: str, folder: Path) -> list[dict]:
    from jaxformer.study.rows import gather
    from jaxformer.study.sweep import load_sweep

    return [r for r in gather(load_sweep(REPO / "experiments" / "studies" / sweep_file), folder) if not r["diverged"]]


def _arm(r: dict) -> str:
    v = r["values"]
    return v["model.position"] + (" ×√d" if v.get("model.scale_embeddings") else "")


def length_gaps(folder: Path) -> list[tuple[str, object]]:
    """``[(arm, PairedDifference of val_bpb at LONG minus at SHORT)]``, arms that ran LONG, in sweep order."""
    from jaxformer.study.stats import paired_difference

    at: dict[str, dict[int, dict[int, float]]] = {}
    for r in _rows("positions.yaml", folder):
        for n in (SHORT, LONG):
            e = r.get("eval_lengths", {}).get(str(n), {})
            if e.get("val_bpb") is not None:
                at.setdefault(_arm(r), {}).setdefault(n, {})[r["seed"]] = e["val_bpb"]
    return [(arm, paired_difference(v[LONG], v[SHORT])) for arm, v in at.items() if LONG in v]


def order_gains(folder: Path) -> tuple[list[tuple[str, dict, object]], object | None]:
    """``([(arm, {seed: gain}, PairedDifference shuffled - intact)], none minus rope PairedDifference)`` of the
    order probe after training (``folder / "order"``)."""
    from jaxformer.study.stats import paired_difference

    by: dict[str, dict[str, dict[int, float]]] = {}
    for r in _rows("positions_order.yaml", folder / "order"):
        final = r.get("probes", {}).get("final", {})
        for k in ("order_nll", "order_nll_shuffled", "order_gain"):
            by.setdefault(_arm(r), {}).setdefault(k, {})[r["seed"]] = final[k]
    arms = [(arm, v["order_gain"], paired_difference(v["order_nll_shuffled"], v["order_nll"])) for arm, v in by.items()]
    both = "none" in by and "rope" in by
    return arms, paired_difference(by["none"]["order_gain"], by["rope"]["order_gain"]) if both else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", default=str(DEFAULT))
    folder = Path(ap.parse_args(argv).results)
    print(f"| position | {LONG} − {SHORT}, bits/byte, paired [95% CI] | seeds |")
    print("|---|---|---|")
    for arm, d in length_gaps(folder):
        print(f"| {arm} | {d.mean:+.3f} [{d.lo:+.3f}, {d.hi:+.3f}] | {d.n} |")
    if (folder / "order").is_dir():
        arms, gap = order_gains(folder)
        print("\n| position | order gain per seed (nats/byte) | shuffled − intact, paired [95% CI] |")
        print("|---|---|---|")
        for arm, per_seed, d in arms:
            seeds = ", ".join(f"{per_seed[s]:+.4f}" for s in sorted(per_seed))
            print(f"| {arm} | {seeds} | {d.mean:+.4f} [{d.lo:+.4f}, {d.hi:+.4f}] |")
        if gap is not None:
            print(f"| none − rope | | {gap.mean:+.4f} [{gap.lo:+.4f}, {gap.hi:+.4f}] |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
