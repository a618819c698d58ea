"""The plots of a sweep's report (``report.plots`` of the sweep file; see :mod:`jaxformer.study.report`),
one function per name in :data:`PLOT_FUNCTIONS`, each ``(plt, sweep, out, rows) -> figure or None``."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np

from jaxformer.study.rows import (arms, label, line_keys, mean_spread, panel_groups, probe, probe_keys, quick_warning,
                                  setting_color, settings)
from jaxformer.study.sweep import Sweep, chosen_values, format_value, run_dir, tune_grid, tune_metric, tuning_results
from jaxformer.train.metrics import read_metrics


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _x_axis(sweep: Sweep) -> str | None:
    """``report.x``, else the first varied key that is not a panel key."""
    keys = line_keys(sweep) or sweep.spec.varied
    return sweep.spec.report.x or (keys[0] if keys else None)


def _final_panels(sweep: Sweep) -> list[str]:
    """The final-metric plot's panel keys: ``report.panels`` but its x key (whose values are its x axis)."""
    return [k for k in sweep.spec.report.panels if k != _x_axis(sweep)]


def _series(sweep: Sweep, rows: list[dict], keys: list[str]):
    """``(x, {series label: (its values, [(x value, rows)])})``: settings grouped by every one of ``keys``
    but ``x``."""
    x = _x_axis(sweep)
    others = [k for k in keys if k != x]
    series: dict[str, tuple[dict, list]] = {}
    for values, rs in settings(sweep, rows):
        series.setdefault(label(values, others), (values, []))[1].append((values.get(x), rs))
    return x, series


def _panels(plt, n: int, size=(7, 4.5)):
    """``(figure, axes)``: one axes of ``size`` inches, or ``n`` panels (2 per row) for ``report.panels``."""
    if n == 1:
        fig, ax = plt.subplots(figsize=size, layout="constrained")
        return fig, [ax]
    cols = 2
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.4 * rows + 0.9), layout="constrained", squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def _label_panels(fig, axes, titles, *, title: str, xlabel: str, ylabel: str, legend_outside: bool = True):
    """Titles, axis labels and the legend: on the one axes (the legend beside it when ``legend_outside``), or
    each panel titled by its ``report.panels`` values and labelled on x, the y label once, and one legend
    below the panels (every line once)."""
    if len(axes) == 1:
        ax = axes[0]
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if ax.get_legend_handles_labels()[1]:
            if legend_outside:  # beside the axes, not over the data
                ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
            else:
                ax.legend(fontsize=7)
        fig.suptitle(title, fontsize=10)  # over the figure: a long one is not clipped by a legend beside the axes
        return fig
    entries = {}
    for ax, name in zip(axes, titles):
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)  # on each panel: a figure-wide one would sit under the legend
        entries.update((lab, h) for h, lab in zip(*ax.get_legend_handles_labels())
                       if lab not in entries and not lab.startswith("_"))
    fig.supylabel(ylabel, fontsize=9)
    if entries:
        fig.legend(list(entries.values()), list(entries), loc="outside lower center", ncol=min(len(entries), 3),
                   fontsize=7)
    fig.suptitle(title, fontsize=10)
    return fig


def _x_values(sweep: Sweep) -> list:
    x = _x_axis(sweep)
    return list({json.dumps(p.values.get(x)): p.values.get(x) for p in sweep.points}.values())


def _categorical(sweep: Sweep) -> bool:
    """Whether ``report.x`` is categorical (not all numbers): its points are then not joined by lines."""
    return not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in _x_values(sweep))


def _line_style(sweep: Sweep, xs: list, style: str = "-") -> str:
    """``style`` for a series at these ``report.x`` values when they are numbers and adjacent in the sweep's
    grid of x values, else no line (points only): a categorical axis is not joined, and a series measured
    at 2 and 24 layers of a 1-24 grid does not draw a trend through the depths it skipped."""
    if _categorical(sweep):
        return "none"
    grid = sorted(_x_values(sweep))
    at = sorted(grid.index(v) for v in xs)
    return style if at == list(range(at[0], at[0] + len(at))) else "none"


LONG_TICK = 12  # characters: a categorical tick label longer than this is drawn slanted


def _category_ticks(ax, positions, labels: list[str]) -> None:
    """Categorical ticks at ``positions``; when a label is longer than ``LONG_TICK`` characters (a LoRA
    config, a list of targets) every label is slanted 30 degrees, right-aligned at its tick, so long
    neighbours do not print over one another (the constrained layout keeps them inside the figure, which
    grows by the slanted labels' height once per row of panels, however many panels call this, so the axes
    keep theirs)."""
    ax.set_xticks(positions, labels)
    longest = max(map(len, labels), default=0)
    if longest > LONG_TICK:
        for t in ax.get_xticklabels():
            t.set(rotation=30, ha="right", rotation_mode="anchor")
        fig = ax.get_figure()
        base = fig.__dict__.setdefault("_unslanted_height", fig.get_figheight())
        rows = ax.get_subplotspec().get_geometry()[0]
        extra = rows * 0.5 * longest * ax.xaxis.get_ticklabels()[0].get_fontsize() / 72
        fig.set_figheight(max(fig.get_figheight(), base + extra))


def _x_positions(sweep: Sweep, ax) -> dict:
    """``{json value: x position}`` for ``report.x`` over every point, set once per axes: numbers on a
    (log2 when wide) numeric axis, anything else categorical in the sweep's order."""
    values = _x_values(sweep)
    if values and not _categorical(sweep):
        if min(values) > 0 and max(values) / min(values) >= 8:
            ax.set_xscale("log", base=2)
        return {json.dumps(v): float(v) for v in values}
    _category_ticks(ax, range(len(values)), [format_value(v) for v in values])
    return {json.dumps(v): float(i) for i, v in enumerate(values)}


CURVE_PLOTS = ("loss_curves", "val_curves")  # drawn from each run directory's metrics.jsonl


def draw_plots(sweep: Sweep, out: Path, rows: list[dict]) -> list[str]:
    """Draw the sweep file's plots into ``out``; the names of the PNGs the report shows. A curve plot is not
    redrawn while a row's run directory is missing (a report rebuilt from ``summary.jsonl`` alone): the
    PNG drawn when the runs were there is kept and shown, not replaced by one with curves missing."""
    plt = _pyplot()
    made = []
    quick = quick_warning(rows)
    names = list(sweep.spec.report.plots) + (["tuning_curves"] if sweep.spec.tune is not None else [])
    runs_missing = any(not (run_dir(out, r["name"]) / "metrics.jsonl").exists() for r in rows)
    for name in names:
        if name in CURVE_PLOTS and runs_missing:
            if (out / f"{name}.png").exists():
                made.append(f"{name}.png")
            continue
        fig = PLOT_FUNCTIONS[name](plt, sweep, out, rows)
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
    groups = panel_groups(sweep, settings(sweep, rows))
    many = len(groups) == 1 and len(groups[0][1]) > 8
    fig, axes = _panels(plt, len(groups), size=(11 if many else 7, 4.5))
    keys = line_keys(sweep)

    def curve(r):
        return dict((m["step"], m["loss"]) for m in read_metrics(run_dir(out, r["name"]))
                    if "loss" in m and isinstance(m["loss"], float))

    for ax, (_, group) in zip(axes, groups):
        for values, rs in group:
            color, name = setting_color(sweep, values, keys), label(values, keys)
            curves = [c for c in (curve(r) for r in rs if not r["diverged"]) if c]
            if curves:
                steps = sorted(set.intersection(*(set(c) for c in curves)))
                ax.plot(steps, smooth([statistics.fmean(c[s] for c in curves) for s in steps]), label=name, lw=1.2,
                        color=color)
            for r in rs:
                if r["diverged"] and (c := curve(r)):
                    ax.plot(sorted(c), [c[s] for s in sorted(c)], ls="--", lw=0.8, color=color,
                            label=f"{name} (diverged, seed {r['seed']})")
        ax.set_yscale("log")
    return _label_panels(fig, axes, [t for t, _ in groups], title=f"{sweep.name}: training loss", xlabel="step",
                         ylabel=f"train loss (nats/token), mean over seeds, EMA over ~{SMOOTH_ROWS} rows",
                         legend_outside=many)


def _plot_tuning_curves(plt, sweep, out, rows):
    """The tuning metric against the tuned value, one line per arm (the chosen value ringed); a numeric
    single key on a log axis when it spans 8x or more, anything else categorical."""
    tune = sweep.spec.tune
    combos = tune_grid(tune)
    numeric = len(tune.keys) == 1 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                          for c in combos for v in c.values())
    groups = panel_groups(sweep, arms(sweep), values_of=lambda values: values)
    fig, axes = _panels(plt, len(groups))
    keys = line_keys(sweep)
    if numeric:
        xs = [float(next(iter(c.values()))) for c in combos]
    else:
        xs = list(range(len(combos)))
    for ax, (_, group) in zip(axes, groups):
        if not numeric:
            _category_ticks(ax, xs, [format_value(list(c.values())) for c in combos])
        elif min(xs) > 0 and max(xs) / min(xs) >= 4:  # a learning-rate grid is geometric
            ax.set_xscale("log")
        drawn = []  # (x, y, colour) of every point on these axes, for the off-scale marks
        for values in group:
            res = {json.dumps(t, sort_keys=True): m for t, m, _ in tuning_results(sweep, out, values)}
            ys = [res.get(json.dumps(c, sort_keys=True)) for c in combos]
            keep = [(x, y) for x, y in zip(xs, ys) if y is not None]
            if not keep:
                continue
            color = setting_color(sweep, values, keys)
            ax.plot([x for x, _ in keep], [y for _, y in keep], marker="o", color=color,
                    ls="-" if numeric else "none", label=label(values, keys))
            drawn += [(x, y, color) for x, y in keep]
            try:
                best = chosen_values(sweep, out, values)
            except ValueError:
                best = None
            if best is not None:
                i = combos.index(best)
                ax.plot([xs[i]], [ys[i]], marker="o", ms=12, mfc="none", color=color)
        _mark_off_scale(ax, drawn)
    return _label_panels(fig, axes, [t for t, _ in groups],
                         title=f"{sweep.name}: tuning (ringed: the value each arm's final runs use)",
                         xlabel=", ".join(tune.keys),
                         ylabel=f"{tune_metric(sweep)} (mean over {tune.seeds} tuning seed(s))")


OFF_SCALE = 6.0  # a point further above the best than this many times the median's distance is off the scale


def _mark_off_scale(ax, drawn: list[tuple[float, float, str]]) -> None:
    """Keep a blow-up from flattening the rest: a point above ``best + OFF_SCALE * (median - best)`` (a
    learning rate that diverged to 3 bits/byte where the others differ by 0.01) is left off the y range,
    marked by a triangle at the top edge in its series' colour with its value written beside it (several at
    one x: their values one under another). The line to it leaves through the top of the axes."""
    ys = sorted(y for _, y, _ in drawn)
    if len(ys) < 3:
        return
    best, median = ys[0], ys[len(ys) // 2]
    limit = best + OFF_SCALE * (median - best)
    inside = [y for y in ys if y <= limit]
    if median <= best or len(inside) == len(ys):
        return
    top = inside[-1] + 0.12 * (inside[-1] - best)
    ax.set_ylim(best - 0.06 * (inside[-1] - best), top)
    stacked: dict[float, int] = {}  # marks at one x: their values one under another
    for x, y, color in drawn:
        if y > limit:
            n = stacked[x] = stacked.get(x, -1) + 1
            ax.plot([x], [top], marker="^", ms=9, color=color, clip_on=False, zorder=5)
            ax.annotate(f"{y:.4g}", (x, top), xytext=(-7, -4 - 9 * n), textcoords="offset points", fontsize=7,
                        color=color, ha="right", va="top")  # left of the mark: the legend may sit right


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
    groups = panel_groups(sweep, settings(sweep, rows))
    fig, axes = _panels(plt, len(groups))
    keys = line_keys(sweep)
    drew = False
    for ax, (_, group) in zip(axes, groups):
        for values, rs in group:
            color, name = setting_color(sweep, values, keys), label(values, keys)
            curves, finals = [], []
            for r in rs:
                if r["diverged"]:
                    continue
                evals = [m for m in read_metrics(run_dir(out, r["name"])) if isinstance(m.get(metric), (int, float))
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
                ax.plot([max(s for s, _ in finals)], [statistics.fmean(v for _, v in finals)], marker="o",
                        mfc="none", color=color, ls="none", label=None if curves else f"{name} (final)")
                drew = True
    if not drew:
        plt.close(fig)
        return None
    return _label_panels(fig, axes, [t for t, _ in groups],
                         title=f"{sweep.name}: validation curves (open marker: the final evaluation)", xlabel="step",
                         ylabel=f"validation {metric} (mean over seeds)")


def _plot_final_metric(plt, sweep, out, rows):
    metric = sweep.spec.report.metric
    panels = _final_panels(sweep)
    groups = panel_groups(sweep, rows, values_of=lambda r: r["values"], keys=panels)
    fig, axes = _panels(plt, len(groups))
    x = _x_axis(sweep)
    others = [k for k in line_keys(sweep, panels) if k != x]
    for ax, (_, group) in zip(axes, groups):
        where = _x_positions(sweep, ax)
        _, series = _series(sweep, group, others)
        # on a categorical axis the series sit side by side at each value, not on top of one another
        dodge = 0.12 if _categorical(sweep) and len(series) > 1 else 0.0
        for i, (name, (values, pts)) in enumerate(series.items()):
            stats = [mean_spread([r.get(metric) for r in rs if not r["diverged"]]) for _, rs in pts]
            keep = [(v, m, s) for (v, _), (m, s) in zip(pts, stats) if m is not None]
            if not keep:
                continue
            xs = [where[json.dumps(v)] + dodge * (i - (len(series) - 1) / 2) for v, _, _ in keep]
            color = setting_color(sweep, values, others) if len(groups) > 1 else None  # one per line, every panel
            bars = ax.errorbar(xs, [m for _, m, _ in keep], yerr=[s or 0.0 for _, _, s in keep], marker="o",
                               capsize=3, label=name if others else None,
                               ls=_line_style(sweep, [v for v, _, _ in keep]), color=color)
            # each seed too: a mean and sd over seeds that trained and seeds that did not stand for no run
            at = {json.dumps(v): x_ for (v, _, _), x_ in zip(keep, xs)}
            seeds = [(at[json.dumps(v)], r[metric]) for v, rs in pts if json.dumps(v) in at for r in rs
                     if not r["diverged"] and isinstance(r.get(metric), (int, float)) and math.isfinite(r[metric])]
            ax.plot([a for a, _ in seeds], [b for _, b in seeds], ls="none", marker=".", ms=5, alpha=0.55,
                    color=bars.lines[0].get_color())
    return _label_panels(fig, axes, [t for t, _ in groups], title=f"{sweep.name}: final {metric}", xlabel=x or "",
                         ylabel=f"{metric} (mean ± sd over seeds; dots: each seed)", legend_outside=False)


def _plot_metric_vs_eval_length(plt, sweep, out, rows):
    metric, lengths = sweep.spec.report.metric, sweep.spec.eval_lengths
    if not lengths:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    for values, rs in settings(sweep, rows):
        rs = [r for r in rs if not r["diverged"]]  # as the report's table of these lengths
        ms = [mean_spread([r.get("eval_lengths", {}).get(str(n), {}).get(metric) for r in rs]) for n in lengths]
        keep = [(n, m, s) for n, (m, s) in zip(lengths, ms) if m is not None]
        if keep:
            ax.errorbar([n for n, _, _ in keep], [m for _, m, _ in keep], yerr=[s or 0 for _, _, s in keep],
                        marker="o", capsize=3, label=label(values, sweep.spec.varied), color=setting_color(sweep, values))
    ax.set_xscale("log", base=2)
    return _finish_vs_length(fig, ax, sweep, "evaluation context length (tokens)", f"{metric} (mean over seeds)",
                             f"{sweep.name}: {metric} vs evaluation length")


def _finish_vs_length(fig, ax, sweep, xlabel: str, ylabel: str, title: str):
    """The trained length marked, a log y axis, labels, legend and title: the length plots' common end."""
    ax.axvline(sweep.points[0].config.seq_len, color="grey", ls=":", lw=1, label="trained length")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes, not over the lines
    fig.suptitle(title, fontsize=10)
    return fig


def _plot_loss_by_position(plt, sweep, out, rows):
    lengths = sweep.spec.eval_lengths
    if not lengths:
        return None
    n = max(lengths)
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    key = "bpb"
    for values, rs in settings(sweep, rows):
        per = [r.get("eval_lengths", {}).get(str(n), {}).get("buckets") for r in rs if not r["diverged"]]
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
                color=setting_color(sweep, values))
    return _finish_vs_length(
        fig, ax, sweep, "position in the document (tokens before the prediction)",
        f"{'bits per byte' if key == 'bpb' else 'loss (nats/token)'} in the bucket (mean over seeds)",
        f"{sweep.name}: loss by position, {n}-token windows")


def _plot_probes(plt, sweep, out, rows):
    """One axes per probe (and per ``report.panels`` value but the x key's: a row each), the probe against
    ``report.x``, a colour per setting of the other keys (the same in every axes), dashed / open at
    initialisation and solid / filled after training; one legend below."""
    if not sweep.spec.probes:
        return None
    pkeys = probe_keys(rows)
    if not pkeys:
        return None
    panels = _final_panels(sweep)
    groups = panel_groups(sweep, rows, values_of=lambda r: r["values"], keys=panels)
    x = _x_axis(sweep)
    others = [k for k in line_keys(sweep, panels) if k != x]
    if len(groups) == 1:  # the probes wrap, three to a row
        cols = min(3, len(pkeys))
        cells = [(groups[0], key) for key in pkeys]
    else:  # a row per panel, a column per probe
        cols = len(pkeys)
        cells = [(group, key) for group in groups for key in pkeys]
    nrows = -(-len(cells) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.3 * cols, 3.1 * nrows + 0.9), squeeze=False,
                             layout="constrained")
    for ax in axes.flat[len(cells):]:
        ax.set_visible(False)
    entries = {}
    for ax, ((title, group), key) in zip(axes.flat, cells):
        where = _x_positions(sweep, ax)
        _, series = _series(sweep, group, others)
        for name, (values, pts) in series.items():
            color = setting_color(sweep, values, others)
            for when, ls, fill in (("final", "-", None), ("init", "--", "none")):  # the legend shows the solid
                vals = [mean_spread([probe(r, when, key) for r in rs])[0] for _, rs in pts]
                keep = [(v, m) for (v, _), m in zip(pts, vals) if m is not None]
                if keep:
                    (line,) = ax.plot([where[json.dumps(v)] for v, _ in keep], [m for _, m in keep],
                                      ls=_line_style(sweep, [v for v, _ in keep], ls), marker="o", mfc=fill,
                                      color=color)
                    entries.setdefault(name, line)
        ys = [y for line in ax.get_lines() for y in line.get_ydata()]
        if key == "dead_fraction":  # a fraction, often 0: linear, at least 0..0.1% so a lone unit reads as small
            top = max([1e-3] + [y * 1.2 for y in ys])
            ax.set_ylim(-0.03 * top, top)
        elif ys and min(ys) > 0:  # norms and ratios span decades; a probe that reads 0 or less stays linear
            ax.set_yscale("log")
        ax.set_xlabel(x or "", fontsize=8)
        ax.set_title(key if title is None else f"{key}: {title}", fontsize=8)
    if len(entries) > 1 or others:
        fig.legend(list(entries.values()), list(entries), loc="outside lower center", ncol=min(len(entries), 4),
                   fontsize=7)
    fig.suptitle(f"{sweep.name} probes: dashed / open at initialisation, solid / filled after training", fontsize=10)
    return fig


def _plot_sinusoidal_table(plt, sweep, out, rows):
    from jaxformer.ops.positional import sinusoidal_positions

    m = sweep.points[0].config.model
    n = max([sweep.points[0].config.seq_len, *sweep.spec.eval_lengths])
    table = np.asarray(sinusoidal_positions(np.arange(n), m.d_model, layout=m.positions.sinusoidal_layout))
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    im = ax.imshow(table, aspect="auto", cmap="RdBu", vmin=-1, vmax=1, interpolation="nearest")
    ax.set_xlabel("dimension")
    ax.set_ylabel("position")
    fig.colorbar(im, ax=ax)
    ax.set_title(f"sinusoidal position table ({m.positions.sinusoidal_layout}, d_model {m.d_model}, {n} positions)")
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
        ax.plot(dist, rope_relative_bound(dim, dist, m.positions.rope_base), lw=1,
                label=f"head dim {dim}, base {m.positions.rope_base:g}" + (" (this model)" if dim == d else ""))
    ax.axvline(sweep.points[0].config.seq_len, color="grey", ls=":", lw=1, label="trained length")
    ax.set_xlabel("relative distance m")
    ax.set_ylabel("relative upper bound (1/(d/2)) Σ |S_j|")
    ax.legend(fontsize=7)
    ax.set_title("RoPE: long-term decay of the relative upper bound (RoFormer §3.4.3)")
    return fig


def _plot_alibi_bias(plt, sweep, out, rows):
    from jaxformer.ops.positional import alibi_slopes

    m = sweep.points[0].config.model
    slopes = np.asarray(alibi_slopes(m.attention.n_heads))
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
    fig.suptitle(f"ALiBi biases -slope·(i-j) on one colour scale, {n} positions, causal ({m.attention.n_heads} heads)",
                 fontsize=9)
    return fig


# report.plots names (study.sweep.PLOTS) and the tuning section's curves -> the function that draws each
PLOT_FUNCTIONS = {
    "loss_curves": _plot_loss_curves,
    "val_curves": _plot_val_curves,
    "final_metric": _plot_final_metric,
    "metric_vs_eval_length": _plot_metric_vs_eval_length,
    "loss_by_position": _plot_loss_by_position,
    "probes": _plot_probes,
    "sinusoidal_table": _plot_sinusoidal_table,
    "rope_decay": _plot_rope_decay,
    "alibi_bias": _plot_alibi_bias,
    "tuning_curves": _plot_tuning_curves,
}
