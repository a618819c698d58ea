"""Study 9: long context. Claim: "dense attention is O(n^2) (512 -> 128K is 62,500x the work); sparse
attention is O(n); FlashAttention keeps the math but not the n x n matrix".

Time and memory of one self-attention call vs length, for dense (XLA, the T x T
matrix), blockwise (this library's FlashAttention-style path in plain JAX: all T x T work, O(T)
memory) and block-sparse (Longformer window 512 + 2 global tokens: O(T) work), forward and
forward+backward, from 512 up to the longest length that fits the memory limit; the Pallas kernels
run where an accelerator is present (``experiments/bench/gpu_suite.py``), not on this CPU. Every case
is ``experiments/bench/sparse.py``'s worker in a fresh subprocess (no code copied): median wall time,
XLA's temp bytes (the scratch beyond inputs and outputs) and the resident-set peak. Exponents are the
least-squares slopes of log(time) and log(temp) vs log(T) over the lengths each path ran from ``FIT_FROM``
(2,048) up, where a call's fixed overhead no longer dominates (the table gives the all-lengths fit beside it).

    python experiments/studies/long_context.py                      # the study (~10 min on 2 cores)
    python experiments/studies/long_context.py --dry-run            # list the cases
    python experiments/studies/long_context.py --quick              # toy lengths, in-process (tests)
    python experiments/studies/long_context.py --out experiments/results/studies/long_context
    python experiments/studies/long_context.py --from-results experiments/results/studies/long_context/results.jsonl \
        --out experiments/results/studies/long_context        # re-render the table and plots, no run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments" / "bench"))

import sparse as bench  # noqa: E402  (experiments/bench/sparse.py: worker, run_case, slope)

IMPLS = {"dense": "dense", "blockwise": "blockwise", "sparse": "sparse"}
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
FIT_FROM = 2048  # the shortest length the exponents are fitted from (below it, call overhead bends the curves)


def cases(lengths, modes, repeats: int, mem_limit_gb: float):
    for mode in modes:
        for T in lengths:
            for impl in IMPLS:
                yield dict(workload="longformer", impl=impl, T=T, mode=mode, heads=1, head_dim=64, block=64,
                           repeats=repeats if T <= 4096 else max(1, repeats // 2), mem_limit_gb=mem_limit_gb)


def fit(results, key: str, min_t: int = FIT_FROM) -> dict:
    """``{(impl, mode): exponent}`` of ``key`` (seconds or temp_bytes) vs T, over the lengths >= ``min_t``."""
    return {k: bench.slope(v) for k, v in fit_points(results, key, min_t).items()}


def slope_interval(points, confidence: float = 0.95) -> tuple[float, float] | None:
    """The ``confidence`` interval of the least-squares slope of log(y) vs log(T) over ``points`` ``(T, y)``:
    slope ± t(n - 2) x its standard error (the residuals' spread); None below 3 points."""
    from jaxformer.study.stats import t_quantile

    pts = [(math.log(t), math.log(y)) for t, y in points]
    n = len(pts)
    if n < 3:
        return None
    b = bench.slope(points)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    resid = sum((y - my - b * (x - mx)) ** 2 for x, y in pts)
    half = t_quantile(0.5 + confidence / 2, n - 2) * math.sqrt(resid / (n - 2) / sxx)
    return b - half, b + half


def fit_points(results, key: str, min_t: int = FIT_FROM) -> dict:
    """``{(impl, mode): [(T, value)]}`` that :func:`fit` fits."""
    out = {}
    for r in results:
        pts = out.setdefault((r["impl"], r["mode"]), [])
        if r["T"] >= min_t and r.get(key, 0) > 0 and "skipped" not in r and "error" not in r:
            pts.append((r["T"], r[key]))
    return out


def plot(results, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for key, ylabel, name in (("seconds", "seconds per call", "time_vs_length.png"),
                              ("temp_bytes", "XLA temp bytes (scratch beyond inputs/outputs)",
                               "memory_vs_length.png")):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
        for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
            for i, impl in enumerate(IMPLS):
                pts = [(r["T"], r[key]) for r in results if r["impl"] == impl and r["mode"] == mode
                       and r.get(key, 0) > 0 and "error" not in r and ("skipped" not in r or key == "temp_bytes")]
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=f"C{i}", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length T")
            ax.set_ylabel(ylabel)
            ax.set_title(mode, fontsize=9)
            if ax.get_lines():
                ax.legend(fontsize=8)
        fig.suptitle("Self-attention vs length: dense O(T²), blockwise O(T²) work / O(T) memory, "
                     "sparse (window 512 + 2 global) O(T)", fontsize=9)
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(name)
    return made


def table(results) -> str:
    lines = ["| T | pass | dense s | blockwise s | sparse s | dense temp MiB | blockwise temp MiB | sparse temp MiB |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    by = {(r["T"], r["mode"], r["impl"]): r for r in results}
    for mode in ("fwd", "fwd+bwd"):
        for T in sorted({r["T"] for r in results}):
            row = [by.get((T, mode, i), {}) for i in IMPLS]
            if not any(row):
                continue
            secs = [bench._fmt_s(r) if r else "-" for r in row]
            temps = [bench._mib(r) if r else "-" for r in row]
            lines.append(f"| {T} | {mode} | " + " | ".join(secs + temps) + " |")
    shortest = min(r["T"] for r in results)
    lines += ["", "| exponent (log-log slope) | fitted over | pass | dense | blockwise | sparse |",
              "|---|---|---|---:|---:|---:|"]
    for what, key in (("time", "seconds"), ("XLA temp", "temp_bytes")):
        for min_t in sorted({FIT_FROM, shortest}, reverse=True):
            f = fit(results, key, min_t)
            span = f"T >= {min_t:,}" if min_t > shortest else "every T"
            pts = fit_points(results, key, min_t)
            for mode in ("fwd", "fwd+bwd"):
                cells = []
                for i in IMPLS:
                    b, ci = f.get((i, mode)), slope_interval(pts.get((i, mode), []))
                    cells.append("-" if b is None else f"{b:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""))
                lines.append(f"| {what} | {span} | {mode} | " + " | ".join(cells) + " |")
    lines += ["", "[95% interval]: the least-squares slope's, Student's t with n - 2 degrees of freedom on the "
              "residuals of the log-log fit (one time per length, the median of its `repeats` timed calls in "
              "results.jsonl: the spread of the points about a straight line, not the timing noise of each point)"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-t", type=int, default=LENGTHS[-1])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mem-limit-gb", type=float, default=6.0, help="a case whose XLA temp exceeds this is not run")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--quick", action="store_true", help="T = 128, 256, forward only, in-process")
    ap.add_argument("--out", type=Path, help="directory for results.jsonl, table.md and the plots")
    ap.add_argument("--from-results", type=Path, help="a results.jsonl of an earlier run: re-render its table "
                    "(and with --out its plots) without running anything")
    args = ap.parse_args(argv)
    if args.from_results:
        results = [json.loads(x) for x in args.from_results.read_text().splitlines() if x.strip()]
        text = table(results)
        print(text)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "table.md").write_text(text + "\n")
            plot(results, args.out)
        return 0
    lengths = (128, 256) if args.quick else tuple(t for t in LENGTHS if t <= args.max_t)
    todo = list(cases(lengths, ("fwd",) if args.quick else ("fwd", "fwd+bwd"), 1 if args.quick else args.repeats,
                      args.mem_limit_gb))
    if args.dry_run:
        for c in todo:
            print(json.dumps(c))
        print(f"{len(todo)} cases")
        return 0
    results = []
    for c in todo:
        r = bench.worker(c) if args.quick else bench.run_case(c)
        results.append(r)
        print(f"T={c['T']:>6} {c['mode']:<8} {c['impl']:<9} {bench._fmt_s(r):>9} s  temp {bench._mib(r)} MiB",
              file=sys.stderr, flush=True)
    text = table(results)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
        (args.out / "table.md").write_text(text + "\n")
        plot(results, args.out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    raise SystemExit(main())
