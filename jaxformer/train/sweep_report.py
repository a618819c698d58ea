"""A sweep's report: ``summary.jsonl`` (one row per finished point), ``report.md`` (mean ± spread over
seeds per setting) and PNG plots (matplotlib, imported only here, from the ``experiments`` extra).

Plots (``report.plots`` of the sweep file):

* ``loss_curves``: train loss vs step, one line per setting (mean over seeds, smoothed: an exponential
  moving average over about 10 logged rows, so one batch's bump does not read as a difference);
* ``val_curves``: ``report.metric`` of the periodic evaluations (``eval.every``) vs step, one line per
  setting (mean over seeds), the final evaluation (on its own, larger token set) as a separate marker;
* ``final_metric``: ``report.metric`` per value of ``report.x`` with the seeds' spread as error bars;
* ``metric_vs_eval_length``: ``report.metric`` at each of ``eval_lengths`` (log-log);
* ``loss_by_position``: bits per byte (else loss) by position bucket at the longest evaluation length;
* ``probes``: the attention probe (logit variance, entropy ratio, gradient norm at W_q/W_k) vs ``report.x``,
  at initialisation and after training;
* ``sinusoidal_table``, ``rope_decay``, ``alibi_bias``: the encodings themselves, from ``jaxformer.ops``
  at the first point's sizes (the table, RoFormer's relative upper bound vs distance, ALiBi's biases).

A sweep run with ``--quick`` (every point a few steps: a smoke test) says so in the report's title and
across every plot (and in each PNG's ``Title`` metadata), so it is never read as a result.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np

from jaxformer.train.metrics import read_metrics
from jaxformer.train.sweep import (QUICK_STEPS, Sweep, chosen_values, format_value, read_point, tune_grid,
                                   tune_metric, tuning_results)
from jaxformer.train.sweep_stats import PairedDifference, paired_difference

PROBE_KEYS = ("logit_var", "entropy_ratio", "max_weight", "qk_grad_norm", "grad_norm_first_block", "dead_fraction")


def probe_keys(rows: list[dict]) -> list[str]:
    """The probe columns the rows have (attention statistics and/or dead FFN units)."""
    have = {k for r in rows for when in r.get("probes", {}).values() for k in when}
    return [k for k in PROBE_KEYS if k in have]


def gather(sweep: Sweep, out: Path, *, tuning: bool = False) -> list[dict]:
    """The rows of every finished point (any shard), in the sweep's point order (``params`` filled in
    from the point's config for rows written before it was recorded); ``tuning``: of the tuning points."""
    from jaxformer.model import count_params

    rows = []
    for p in sweep.tune_points if tuning else sweep.points:
        r = read_point(out, p)
        if r is not None:
            r.setdefault("params", count_params(p.config.model))
            rows.append(r)
    return rows


def baseline_of(sweep: Sweep, values: dict) -> dict | None:
    """The baseline arm an arm is compared with: its values with ``report.baseline``'s keys set to the
    baseline's; None without a baseline, or for a baseline arm itself."""
    base = sweep.spec.report.baseline
    if base is None:
        return None
    ref = {**values, **base}
    return None if setting_key({"values": ref}, sweep.spec.varied) == setting_key({"values": values},
                                                                                  sweep.spec.varied) else ref


def differences(sweep: Sweep, rows: list[dict], metric: str) -> list[tuple[dict, dict, PairedDifference | None]]:
    """``(arm values, baseline values, paired difference of metric)`` for every arm with a baseline
    (seeds that diverged in either arm are left out of the pairs)."""
    keys = sweep.spec.varied
    by = {setting_key({"values": v}, keys): rs for v, rs in _settings(sweep, rows)}
    out = []
    for values, rs in _settings(sweep, rows):
        ref = baseline_of(sweep, values)
        if ref is None:
            continue
        base_rows = by.get(setting_key({"values": ref}, keys), [])

        def per_seed(rows_):
            return {r["seed"]: r.get(metric) for r in rows_ if not r["diverged"]}

        out.append((values, ref, paired_difference(per_seed(rs), per_seed(base_rows),
                                                   confidence=sweep.spec.report.confidence)))
    return out


def tuning_lines(sweep: Sweep, out: Path) -> list[str]:
    """The report's tuning section: per arm the tuning metric at each tried value, the chosen one bold."""
    tune = sweep.spec.tune
    metric = tune_metric(sweep)
    combos = tune_grid(tune)
    tkeys = list(tune.keys)
    lines = ["", f"Tuning (per arm, before the final runs): mean {metric} over the first {tune.seeds} seed(s) at "
             f"each value of {', '.join(f'`{k}`' for k in tkeys)}; the final runs use the "
             f"{'lowest' if tune.mode == 'min' else 'highest'} (**bold**; n/a: diverged or unfinished)", ""]
    head = [k.split(".")[-1] for k in sweep.spec.varied] + [format_value(list(c.values())) if len(c) > 1 else
                                                             format_value(next(iter(c.values()))) for c in combos]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for values in _arms(sweep):
        results = {json.dumps(t, sort_keys=True): m for t, m, _ in tuning_results(sweep, out, values)}
        try:
            best = chosen_values(sweep, out, values)
        except ValueError:
            best = None
        cells = [format_value(values.get(k)) for k in sweep.spec.varied]
        for c in combos:
            m = results.get(json.dumps(c, sort_keys=True))
            cell = "n/a" if m is None else f"{m:.4f}"
            cells.append(f"**{cell}**" if best == c else cell)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _arms(sweep: Sweep) -> list[dict]:
    """Every setting of the varied keys, in the sweep's order."""
    keys = sweep.spec.varied
    return list({setting_key({"values": p.values}, keys): p.values for p in sweep.points}.values())


def setting_key(row: dict, keys: list[str]) -> tuple:
    return tuple(json.dumps(row["values"].get(k)) for k in keys)


def label(values: dict, keys: list[str]) -> str:
    return ", ".join(f"{k.split('.')[-1]}={format_value(values.get(k))}" for k in keys) or "all"


def mean_spread(xs: list[float]) -> tuple[float | None, float | None]:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def fmt(m: float | None, s: float | None, digits: int = 4) -> str:
    if m is None:
        return "n/a"
    return f"{m:.{digits}f}" + (f" ± {s:.{digits}f}" if s is not None else "")


def _settings(sweep: Sweep, rows: list[dict]) -> list[tuple[dict, list[dict]]]:
    """``(values, rows over seeds)`` per setting, in the sweep's order."""
    keys = sweep.spec.varied
    groups: dict[tuple, tuple[dict, list[dict]]] = {}
    for p in sweep.points:
        groups.setdefault(setting_key({"values": p.values}, keys), (p.values, []))
    for r in rows:
        groups[setting_key(r, keys)][1].append(r)
    return [g for g in groups.values() if g[1]]


def probe(row: dict, when: str, key: str) -> float | None:
    """A probe value of a row (None where the row lacks it: diverged, or another set of probes)."""
    return row.get("probes", {}).get(when, {}).get(key)


def _color(sweep: Sweep, values: dict) -> str:
    """One colour per setting, the same in every plot (a setting missing from one plot shifts nothing)."""
    keys = sweep.spec.varied
    order = list(dict.fromkeys(setting_key({"values": p.values}, keys) for p in sweep.points))
    i = order.index(setting_key({"values": values}, keys))
    if len(order) <= 10:
        return f"C{i}"
    import matplotlib

    return matplotlib.colors.to_hex(matplotlib.colormaps["tab20"](i % 20))  # 11-20 settings: still one each


def quick_warning(rows: list[dict]) -> str | None:
    """``QUICK SMOKE RUN (2 steps per point): not a result`` when any point ran with ``--quick``, else None."""
    quick = [r for r in rows if r.get("quick")]
    if not quick:
        return None
    steps = sorted({r.get("config", {}).get("steps", QUICK_STEPS) for r in quick})
    n = " or ".join(str(s) for s in steps)
    return f"QUICK SMOKE RUN ({n} step{'s' if steps != [1] else ''} per point): not a result"


def write_report(sweep: Sweep, out: str | Path) -> Path:
    """Write ``summary.jsonl``, ``report.md`` and the plots into ``out``; returns the report's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = gather(sweep, out)
    with (out / "summary.jsonl").open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    if sweep.spec.tune is not None:
        with (out / "tuning.jsonl").open("w") as f:
            for r in gather(sweep, out, tuning=True):
                f.write(json.dumps(r) + "\n")
    plots = draw_plots(sweep, out, rows) if rows else []
    path = out / "report.md"
    path.write_text(report_markdown(sweep, rows, plots, out=out))
    return path


def report_markdown(sweep: Sweep, rows: list[dict], plots: list[str], *, out: Path | None = None) -> str:
    """The report's text (``out``: the sweep's directory, where the tuning rows are read from)."""
    spec, keys = sweep.spec, sweep.spec.varied
    metric = spec.report.metric
    n_seeds = len(spec.seeds)
    quick = quick_warning(rows)
    lines = [f"# Sweep `{sweep.name}`" + (f" — {quick}" if quick else ""), "",
             f"`jaxformer sweep {sweep.path}{' --quick' if quick else ''}` · {len(rows)} of {len(sweep.points)} "
             f"points finished · seeds {spec.seeds} · mean ± standard deviation over seeds", ""]
    tuned = spec.tune is not None
    head = [k.split(".")[-1] for k in keys] + (["tuned"] if tuned else []) + [
        "params", f"{metric}", "train loss", "tokens/s", "wall s", "diverged"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for values, rs in _settings(sweep, rows):
        ok = [r for r in rs if not r["diverged"]]
        cells = [format_value(values.get(k)) for k in keys]
        if tuned:
            cells.append(", ".join(f"{k.split('.')[-1]}={format_value(v)}" for k, v in (rs[0].get("tuned") or {}
                                                                                      ).items()) or "n/a")
        cells += [f"{rs[0]['params']:,}" if "params" in rs[0] else "n/a",
                  fmt(*mean_spread([r.get(metric) for r in ok])), fmt(*mean_spread([r.get("loss") for r in ok])),
                  fmt(*mean_spread([r.get("tokens_per_s") for r in ok]), digits=0),
                  fmt(*mean_spread([r.get("wall_s") for r in rs]), digits=0),
                  f"{len(rs) - len(ok)} of {len(rs)}" + ("" if len(rs) == n_seeds else f" (of {n_seeds} seeds)")]
        lines.append("| " + " | ".join(cells) + " |")
    if spec.eval_lengths:
        lines += ["", f"{metric} at each evaluation length (trained at seq_len "
                  f"{sweep.points[0].config.seq_len}; n/a: the model cannot run that length)", ""]
        head = [k.split(".")[-1] for k in keys] + [str(n) for n in spec.eval_lengths]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for values, rs in _settings(sweep, rows):
            cells = [format_value(values.get(k)) for k in keys]
            for n in spec.eval_lengths:
                evs = [r.get("eval_lengths", {}).get(str(n), {}) for r in rs if not r["diverged"]]
                cells.append(fmt(*mean_spread([e.get(metric) for e in evs])))
            lines.append("| " + " | ".join(cells) + " |")
    if spec.probes:
        lines += ["", "Probes (attention: mean over layers, one validation batch; dead_fraction: FFN units never "
                  "positive on the validation windows): at initialisation → after training", ""]
        pkeys = probe_keys(rows)
        head = [k.split(".")[-1] for k in keys] + pkeys
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for values, rs in _settings(sweep, rows):
            cells = [format_value(values.get(k)) for k in keys]
            for key in pkeys:
                a, b = (mean_spread([probe(r, when, key) for r in rs])[0] for when in ("init", "final"))
                cells.append(" → ".join("n/a" if v is None else f"{v:.3g}" for v in (a, b)))
            lines.append("| " + " | ".join(cells) + " |")
    diffs = differences(sweep, rows, metric)
    if diffs:
        conf = spec.report.confidence
        base = label(spec.report.baseline, list(spec.report.baseline))
        lines += ["", f"{metric}: each arm minus its baseline ({base}), paired by seed (same initialisation and "
                  f"data order), mean and {conf:.0%} interval (Student's t on the per-seed differences); *within noise*: the interval contains 0", ""]
        head = [k.split(".")[-1] for k in keys] + ["vs", "seeds paired", f"difference [{conf:.0%} interval]"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for values, ref, d in diffs:
            cells = [format_value(values.get(k)) for k in keys]
            cells += [label(ref, list(spec.report.baseline)), "0" if d is None else str(d.n),
                      "n/a" if d is None else d.format()]
            lines.append("| " + " | ".join(cells) + " |")
    if spec.tune is not None and out is not None:
        lines += tuning_lines(sweep, out)
    if plots:
        lines += [""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


# -- plots -------------------------------------------------------------------------------------

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _x_axis(sweep: Sweep) -> str | None:
    return sweep.spec.report.x or (sweep.spec.varied[0] if sweep.spec.varied else None)


def _series(sweep: Sweep, rows: list[dict]):
    """``(series label, [(x value, rows)])``: settings grouped by every varied key but ``x``."""
    x = _x_axis(sweep)
    others = [k for k in sweep.spec.varied if k != x]
    series: dict[str, list] = {}
    for values, rs in _settings(sweep, rows):
        series.setdefault(label(values, others), []).append((values.get(x), rs))
    return x, series


def _x_positions(sweep: Sweep, ax) -> dict:
    """``{json value: x position}`` for ``report.x`` over every point, set once per axes: numbers on a
    (log2 when wide) numeric axis, anything else categorical in the sweep's order."""
    x = _x_axis(sweep)
    values = list({json.dumps(p.values.get(x)): p.values.get(x) for p in sweep.points}.values())
    if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        if min(values) > 0 and max(values) / min(values) >= 8:
            ax.set_xscale("log", base=2)
        return {json.dumps(v): float(v) for v in values}
    ax.set_xticks(range(len(values)), [format_value(v) for v in values])
    return {json.dumps(v): float(i) for i, v in enumerate(values)}


def draw_plots(sweep: Sweep, out: Path, rows: list[dict]) -> list[str]:
    plt = _pyplot()
    made = []
    quick = quick_warning(rows)
    names = list(sweep.spec.report.plots) + (["tuning_curves"] if sweep.spec.tune is not None else [])
    for name in names:
        fig = globals()[f"_plot_{name}"](plt, sweep, out, rows)
        if fig is None:
            continue
        if quick:  # across the middle of the figure, over the axes: not to be cropped away or missed
            fig.text(0.5, 0.5, quick.replace(": ", "\n"), ha="center", va="center", rotation=20, fontsize=22,
                     color="red", alpha=0.35, weight="bold", zorder=10)
        fig.savefig(out / f"{name}.png", dpi=110, metadata={"Title": quick} if quick else None)
        plt.close(fig)
        made.append(f"{name}.png")
    return made


def _plot_loss_curves(plt, sweep, out, rows):
    """Mean over the seeds that did not diverge (solid); diverged seeds each dashed, in the same colour."""
    many = len(_settings(sweep, rows)) > 8
    fig, ax = plt.subplots(figsize=(11 if many else 7, 4.5), layout="constrained")

    def curve(r):
        return dict((m["step"], m["loss"]) for m in read_metrics(out / r["name"])
                    if "loss" in m and isinstance(m["loss"], float))

    for values, rs in _settings(sweep, rows):
        color, name = _color(sweep, values), label(values, sweep.spec.varied)
        curves = [c for c in (curve(r) for r in rs if not r["diverged"]) if c]
        if curves:
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            ax.plot(steps, smooth([statistics.fmean(c[s] for c in curves) for s in steps]), label=name, lw=1.2,
                    color=color)
        for r in rs:
            if r["diverged"] and (c := curve(r)):
                ax.plot(sorted(c), [c[s] for s in sorted(c)], ls="--", lw=0.8, color=color,
                        label=f"{name} (diverged, seed {r['seed']})")
    ax.set_xlabel("step")
    ax.set_ylabel(f"train loss (nats/token), mean over seeds, EMA over ~{SMOOTH_ROWS} rows")
    ax.set_yscale("log")
    if many:  # beside the axes, not over the curves
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=7)
    ax.set_title(f"{sweep.name}: training loss")
    return fig


def _plot_tuning_curves(plt, sweep, out, rows):
    """The tuning metric against the tuned value, one line per arm (the chosen value ringed); a numeric
    single key on a log axis when it spans 8x or more, anything else categorical."""
    tune = sweep.spec.tune
    combos = tune_grid(tune)
    numeric = len(tune.keys) == 1 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                          for c in combos for v in c.values())
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    if numeric:
        xs = [float(next(iter(c.values()))) for c in combos]
        if min(xs) > 0 and max(xs) / min(xs) >= 8:
            ax.set_xscale("log")
    else:
        xs = list(range(len(combos)))
        ax.set_xticks(xs, [format_value(list(c.values())) for c in combos])
    for values in _arms(sweep):
        res = {json.dumps(t, sort_keys=True): m for t, m, _ in tuning_results(sweep, out, values)}
        ys = [res.get(json.dumps(c, sort_keys=True)) for c in combos]
        keep = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if not keep:
            continue
        color = _color(sweep, values)
        ax.plot([x for x, _ in keep], [y for _, y in keep], marker="o", color=color,
                ls="-" if numeric else "none", label=label(values, sweep.spec.varied))
        try:
            best = chosen_values(sweep, out, values)
        except ValueError:
            best = None
        if best is not None:
            i = combos.index(best)
            ax.plot([xs[i]], [ys[i]], marker="o", ms=12, mfc="none", color=color)
    ax.set_xlabel(", ".join(tune.keys))
    ax.set_ylabel(f"{tune_metric(sweep)} (mean over {tune.seeds} tuning seed(s))")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"{sweep.name}: tuning (ringed: the value each arm's final runs use)")
    return fig


SMOOTH_ROWS = 10


def smooth(ys: list[float], rows: int = SMOOTH_ROWS) -> list[float]:
    """Exponential moving average with ``alpha = 2 / (rows + 1)`` (pandas' ``ewm(span=rows, adjust=True)``:
    each point the weighted mean of those so far, so the curve starts at the first value, not at 0)."""
    alpha = 2.0 / (rows + 1)
    out, num, den = [], 0.0, 0.0
    for y in ys:
        num = (1 - alpha) * num + y
        den = (1 - alpha) * den + 1.0
        out.append(num / den)
    return out


def _plot_val_curves(plt, sweep, out, rows):
    """Periodic validation ``report.metric`` vs step (mean over the seeds that did not diverge, at the
    steps they share); the final evaluation of each setting as an open marker at its last step."""
    metric = sweep.spec.report.metric
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    drew = False
    for values, rs in _settings(sweep, rows):
        color, name = _color(sweep, values), label(values, sweep.spec.varied)
        curves, finals = [], []
        for r in rs:
            if r["diverged"]:
                continue
            evals = [m for m in read_metrics(out / r["name"]) if isinstance(m.get(metric), (int, float))
                     and "final" in m]
            curves.append({m["step"]: m[metric] for m in evals if not m["final"]})
            finals += [(m["step"], m[metric]) for m in evals if m["final"]]
        curves = [c for c in curves if c]
        if curves:
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            ax.plot(steps, [statistics.fmean(c[s] for c in curves) for s in steps], marker=".", lw=1.2,
                    color=color, label=name)
            drew = True
        if finals:
            ax.plot([max(s for s, _ in finals)], [statistics.fmean(v for _, v in finals)], marker="o", mfc="none",
                    color=color, ls="none", label=None if curves else f"{name} (final)")
            drew = True
    if not drew:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_ylabel(f"validation {metric}, mean over seeds (open marker: final evaluation)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"{sweep.name}: validation curves")
    return fig


def _plot_final_metric(plt, sweep, out, rows):
    metric = sweep.spec.report.metric
    x, series = _series(sweep, rows)
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    where = _x_positions(sweep, ax)
    for name, pts in series.items():
        stats = [mean_spread([r.get(metric) for r in rs if not r["diverged"]]) for _, rs in pts]
        keep = [(v, m, s) for (v, _), (m, s) in zip(pts, stats) if m is not None]
        if not keep:
            continue
        xs = [where[json.dumps(v)] for v, _, _ in keep]
        ax.errorbar(xs, [m for _, m, _ in keep], yerr=[s or 0.0 for _, _, s in keep], marker="o", capsize=3,
                    label=name)
    ax.set_xlabel(x or "")
    ax.set_ylabel(f"{metric} (mean ± sd over seeds)")
    if len(series) > 1:
        ax.legend(fontsize=7)
    ax.set_title(f"{sweep.name}: final {metric}")
    return fig


def _plot_metric_vs_eval_length(plt, sweep, out, rows):
    metric, lengths = sweep.spec.report.metric, sweep.spec.eval_lengths
    if not lengths:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    for values, rs in _settings(sweep, rows):
        ms = [mean_spread([r.get("eval_lengths", {}).get(str(n), {}).get(metric) for r in rs]) for n in lengths]
        keep = [(n, m, s) for n, (m, s) in zip(lengths, ms) if m is not None]
        if keep:
            ax.errorbar([n for n, _, _ in keep], [m for _, m, _ in keep], yerr=[s or 0 for _, _, s in keep],
                        marker="o", capsize=3, label=label(values, sweep.spec.varied), color=_color(sweep, values))
    ax.set_xscale("log", base=2)
    return _finish_vs_length(fig, ax, sweep, "evaluation context length (tokens)", f"{metric} (mean over seeds)",
                             f"{sweep.name}: {metric} vs evaluation length")


def _finish_vs_length(fig, ax, sweep, xlabel: str, ylabel: str, title: str):
    """The trained length marked, a log y axis, labels, legend and title: the length plots' common end."""
    ax.axvline(sweep.points[0].config.seq_len, color="grey", ls=":", lw=1, label="trained length")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    ax.set_title(title)
    return fig


def _plot_loss_by_position(plt, sweep, out, rows):
    lengths = sweep.spec.eval_lengths
    if not lengths:
        return None
    n = max(lengths)
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    key = "bpb"
    for values, rs in _settings(sweep, rows):
        per = [r.get("eval_lengths", {}).get(str(n), {}).get("buckets") for r in rs]
        per = [b for b in per if b]
        if not per:
            continue
        key = "bpb" if all("bpb" in b for buckets in per for b in buckets) else "loss"
        by_from: dict[int, list] = {}
        for buckets in per:
            for b in buckets:
                by_from.setdefault(b["from"], []).append(b[key])
        centre = {b["from"]: 0.5 * (b["from"] + b["to"]) for buckets in per for b in buckets}
        xs = sorted(by_from)
        ax.plot([centre[x] for x in xs], [statistics.fmean(by_from[x]) for x in xs], marker=".",
                label=label(values, sweep.spec.varied),
                color=_color(sweep, values))
    return _finish_vs_length(
        fig, ax, sweep, "position in the document (tokens before the prediction)",
        f"{'bits per byte' if key == 'bpb' else 'loss (nats/token)'} in the bucket (mean over seeds)",
        f"{sweep.name}: loss by position, {n}-token windows")


def _plot_probes(plt, sweep, out, rows):
    if not sweep.spec.probes:
        return None
    x, series = _series(sweep, rows)
    pkeys = probe_keys(rows)
    if not pkeys:
        return None
    fig, axes = plt.subplots(1, len(pkeys), figsize=(4 * len(pkeys), 3.8), squeeze=False, layout="constrained")
    axes = axes[0]
    for ax, key in zip(axes, pkeys):
        where = _x_positions(sweep, ax)
        for i, (name, pts) in enumerate(series.items()):
            for when, ls in (("init", "--"), ("final", "-")):
                vals = [mean_spread([probe(r, when, key) for r in rs])[0] for _, rs in pts]
                keep = [(v, m) for (v, _), m in zip(pts, vals) if m is not None]
                if keep:
                    ax.plot([where[json.dumps(v)] for v, _ in keep], [m for _, m in keep], ls=ls, marker="o",
                            color=f"C{i % 10}", label=f"{name} ({when})")
        ax.set_yscale("symlog" if key == "dead_fraction" else "log", **({"linthresh": 1e-3}
                                                                        if key == "dead_fraction" else {}))
        ax.set_xlabel(x or "")
        ax.set_title(key, fontsize=9)
    axes[0].legend(fontsize=6)
    fig.suptitle(f"{sweep.name}: probes at initialisation (dashed) and after training (solid)", fontsize=9)
    return fig


def _plot_sinusoidal_table(plt, sweep, out, rows):
    from jaxformer.ops.positional import sinusoidal_positions

    m = sweep.points[0].config.model
    n = max([sweep.points[0].config.seq_len, *sweep.spec.eval_lengths])
    table = np.asarray(sinusoidal_positions(np.arange(n), m.d_model))
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    im = ax.imshow(table, aspect="auto", cmap="RdBu", vmin=-1, vmax=1, interpolation="nearest")
    ax.set_xlabel("dimension")
    ax.set_ylabel("position")
    fig.colorbar(im, ax=ax)
    ax.set_title(f"sinusoidal position table (d_model {m.d_model}, {n} positions)")
    return fig


def rope_relative_bound(head_dim: int, distances: np.ndarray, base: float = 10000.0) -> np.ndarray:
    """RoFormer's long-term-decay curve (Su et al. 2021, §3.4.3): ``(1/(d/2)) Σ_j |S_j|`` with
    ``S_j = Σ_{i<j} exp(i m θ_i)``, ``θ_i = base^(-2i/d)``, at each relative distance ``m``."""
    theta = base ** (-2.0 * np.arange(head_dim // 2) / head_dim)
    phases = np.exp(1j * np.outer(distances, theta))  # [M, d/2]
    partial = np.cumsum(phases, axis=1)
    return np.abs(partial).mean(axis=1)


def _plot_rope_decay(plt, sweep, out, rows):
    m = sweep.points[0].config.model
    d = m.resolved_head_dim
    dist = np.arange(0, max([1024, *sweep.spec.eval_lengths]))
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    for dim in sorted({d, 128}):
        ax.plot(dist, rope_relative_bound(dim, dist, m.rope_base), lw=1,
                label=f"head dim {dim}, base {m.rope_base:g}" + (" (this model)" if dim == d else ""))
    ax.axvline(sweep.points[0].config.seq_len, color="grey", ls=":", lw=1, label="trained length")
    ax.set_xlabel("relative distance m")
    ax.set_ylabel("relative upper bound (1/(d/2)) Σ |S_j|")
    ax.legend(fontsize=7)
    ax.set_title("RoPE: long-term decay of the relative upper bound (RoFormer §3.4.3)")
    return fig


def _plot_alibi_bias(plt, sweep, out, rows):
    from jaxformer.ops.positional import alibi_slopes

    m = sweep.points[0].config.model
    slopes = np.asarray(alibi_slopes(m.n_heads))
    n = 32
    pos = np.arange(n)
    dist = pos[:, None] - pos[None, :]
    cols = min(4, len(slopes))
    rows_n = math.ceil(len(slopes) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(3 * cols, 2.8 * rows_n), squeeze=False, layout="constrained")
    low = -float(slopes.max()) * (n - 1)  # one colour scale for every head: the slopes' spread shows
    im = None
    for h, ax in enumerate(axes.flat):
        if h >= len(slopes):
            ax.axis("off")
            continue
        bias = np.where(dist >= 0, -slopes[h] * dist, np.nan)  # causal: keys after the query are masked
        im = ax.imshow(bias, cmap="viridis", interpolation="nearest", vmin=low, vmax=0.0)
        ax.set_title(f"head {h}: slope {slopes[h]:.3g}", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    fig.suptitle(f"ALiBi biases -slope·(i-j) on one colour scale, {n} positions, causal ({m.n_heads} heads)",
                 fontsize=9)
    return fig

