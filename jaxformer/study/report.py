"""A sweep's report: ``summary.jsonl`` (one row per finished point), ``report.md`` (mean ± spread over
seeds per setting, paired differences with intervals, the tuning table) and the PNG plots of
:mod:`jaxformer.study.plots` (matplotlib, from the ``experiments`` extra).

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
import os
from pathlib import Path

from jaxformer.study.plots import CURVE_PLOTS, draw_plots
from jaxformer.study.rows import (arms, fmt, gather, label, mean_spread, probe, probe_keys, quick_warning,
                                  setting_key, settings)
from jaxformer.study.stats import PairedDifference, paired_difference
from jaxformer.study.sweep import (SUMMARY_FILE, TUNING_FILE, Sweep, chosen_values, format_value, read_rows, run_dir,
                                   tune_grid, tune_metric, tuning_results)


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
    by = {setting_key({"values": v}, keys): rs for v, rs in settings(sweep, rows)}
    out = []
    for values, rs in settings(sweep, rows):
        ref = baseline_of(sweep, values)
        if ref is None:
            continue
        base_rows = by.get(setting_key({"values": ref}, keys), [])

        def per_seed(rows_):
            return {r["seed"]: r.get(metric) for r in rows_ if not r["diverged"]}

        out.append((values, ref, paired_difference(per_seed(rs), per_seed(base_rows),
                                                   confidence=sweep.spec.report.confidence)))
    return out


def edge_keys(tune_keys: dict, chosen: dict) -> list[str]:
    """The tuned keys whose chosen value is the smallest or largest of its numeric list: there the arm's best
    may lie beyond what was tried (a key of non-numbers or one value has no edge)."""
    out = []
    for k, vals in tune_keys.items():
        nums = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(nums) == len(vals) > 1 and chosen.get(k) in (min(nums), max(nums)):
            out.append(k)
    return out


def tuning_lines(sweep: Sweep, out: Path) -> list[str]:
    """The report's tuning section: per arm the tuning metric at each tried value, the chosen one bold and
    marked "(edge)" when it is the smallest or largest value tried of a numeric key."""
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
    edges = set()
    for values in arms(sweep):
        results = {json.dumps(t, sort_keys=True): m for t, m, _ in tuning_results(sweep, out, values)}
        try:
            best = chosen_values(sweep, out, values)
        except ValueError:
            best = None
        cells = [format_value(values.get(k)) for k in sweep.spec.varied]
        for c in combos:
            m = results.get(json.dumps(c, sort_keys=True))
            cell = "n/a" if m is None else f"{m:.4f}"
            edge = edge_keys(tune.keys, c) if best == c else []
            edges.update(edge)
            cells.append(f"**{cell}**" + (" (edge)" if edge else "") if best == c else cell)
        lines.append("| " + " | ".join(cells) + " |")
    if edges:
        lines += ["", "(edge): the arm's best is the smallest or largest value tried of "
                  f"{', '.join(f'`{k}`' for k in sorted(edges))}, so its optimum may lie beyond the grid: "
                  "widen `tune.keys` before reading its row as tuned."]
    return lines


SUPERSEDED = "superseded.jsonl"


def write_report(sweep: Sweep, out: str | Path) -> Path:
    """Write ``summary.jsonl`` (``tuning.jsonl`` with ``tune:``), ``report.md`` and the plots into ``out``;
    returns the report's path. The rows come from the run directories, else from the row files as they were
    (:func:`jaxformer.study.sweep.read_point`), so a report rebuilt from ``summary.jsonl`` alone reproduces
    its tables; a row of the old files that is not reported now (a row without a run directory that is not one
    of the sweep's points as its file now defines them: another config, a value its arm no longer chooses, a
    renamed point; or one whose run directory now holds another run) is moved to ``superseded.jsonl``, never
    dropped. A run directory's row passes the same check (:func:`jaxformer.study.sweep.is_current`): a run of an
    older design is not reported (the runner refuses to go on beside one:
    :func:`jaxformer.study.sweep.check_finished`)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = {SUMMARY_FILE: gather(sweep, out)}
    if sweep.spec.tune is not None:
        files[TUNING_FILE] = gather(sweep, out, tuning=True)
    reported = {r["name"]: r for rows in files.values() for r in rows}
    def replaced(r):  # an old row that is not what is reported under its name now
        now = reported.get(r["name"])
        return now is None or any(r.get(k) != now.get(k) for k in ("config", "tuned", "seed"))

    superseded = [r for name in files for r in read_rows(out / name) if replaced(r)]
    if superseded:
        _write_rows(out / SUPERSEDED, read_rows(out / SUPERSEDED) + superseded)
    for name, rows in files.items():
        _write_rows(out / name, rows)
    rows = files[SUMMARY_FILE]
    plots = draw_plots(sweep, out, rows) if rows else []
    path = out / "report.md"
    path.write_text(report_markdown(sweep, rows, plots, out=out, superseded=len(superseded)))
    return path


def _write_rows(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


def report_markdown(sweep: Sweep, rows: list[dict], plots: list[str], *, out: Path | None = None,
                    superseded: int = 0) -> str:
    """The report's text (``out``: the sweep's directory, where the tuning rows are read from;
    ``superseded``: how many old rows this report moved to ``superseded.jsonl``)."""
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
    below = spec.report.trained_below
    if below is not None:
        head.append(f"trained ({metric} < {below:g})")
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for values, rs in settings(sweep, rows):
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
        if below is not None:
            trained = [r for r in ok if isinstance(r.get(metric), (int, float)) and r[metric] < below]
            cells.append(f"{len(trained)} of {len(rs)}")
        lines.append("| " + " | ".join(cells) + " |")
    if spec.eval_lengths:
        lines += ["", f"{metric} at each evaluation length (trained at seq_len "
                  f"{sweep.points[0].config.seq_len}; n/a: the model cannot run that length)", ""]
        head = [k.split(".")[-1] for k in keys] + [str(n) for n in spec.eval_lengths]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for values, rs in settings(sweep, rows):
            cells = [format_value(values.get(k)) for k in keys]
            for n in spec.eval_lengths:
                evs = [r.get("eval_lengths", {}).get(str(n), {}) for r in rs if not r["diverged"]]
                cells.append(fmt(*mean_spread([e.get(metric) for e in evs])))
            lines.append("| " + " | ".join(cells) + " |")
    if spec.probes and probe_keys(rows):
        pkeys = probe_keys(rows)
        order = ("; order_*: nats per token on the last quarter of each validation window inside one document, "
                 "intact and with the tokens before it shuffled, and the second minus the first"
                 if "order_gain" in pkeys else "")
        lines += ["", "Probes (attention: mean over layers, one validation batch; dead_fraction: FFN units never "
                  f"positive on the validation windows, ReLU FFNs only{order}): at initialisation → after training",
                  ""]
        head = [k.split(".")[-1] for k in keys] + pkeys
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for values, rs in settings(sweep, rows):
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
    missing = [r["name"] for r in rows if out is not None and not (run_dir(out, r["name"]) / "metrics.jsonl").exists()]
    if missing:
        lines += ["", f"{len(missing)} of {len(rows)} rows come from the row files alone (no run directory here "
                  f"with their metrics.jsonl, e.g. `{missing[0]}`): the tables above are theirs; the curve plots "
                  f"({', '.join(f'{n}.png' for n in CURVE_PLOTS)}) were not redrawn"]
    if superseded:
        lines += ["", f"{superseded} row(s) of the previous row files are not points of the sweep file as it now "
                  f"reads (another config, a value its arm no longer chooses, renamed, or run again): moved to "
                  f"`{SUPERSEDED}`, not reported"]
    if plots:
        lines += [""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def add_sweep_options(a) -> None:
    """``jaxformer sweep``'s arguments on a parser's ``add_argument`` ``a``."""
    a("sweep_file", help="a sweep YAML, e.g. experiments/studies/positions.yaml")
    a("--out", help="default: runs/sweeps/<sweep name> (with --quick: <sweep name>-quick)")
    a("--shard", help="I/N: run points I, I+N, I+2N, ... (a job array); --report gathers all shards")
    a("--dry-run", action="store_true", help="list the points and their resolved configs; run nothing")
    a("--quick", action="store_true", help="each point for a few steps with tiny evaluations (smoke test)")
    a("--report", action="store_true", help="only gather what the points wrote into the report (their run "
      "directories, else the rows of --out's summary.jsonl / tuning.jsonl: the tables rebuild from those alone)")
    a("--supersede", action="store_true", help="a finished final run whose arm's tuning now chooses another value "
      "(a widened grid): move it to OUT/superseded_points/ and run it again, instead of refusing")


def sweep_command(args) -> int:
    """``jaxformer sweep FILE``: run the points (or one shard of them, or none: ``--dry-run``, ``--report``),
    then write the report."""
    from jaxformer.study.sweep import default_out, dry_run_text, load_sweep, parse_shard, run_sweep

    sweep = load_sweep(args.sweep_file)
    out = Path(args.out) if args.out else default_out(sweep, args.quick)
    if args.dry_run:
        print(dry_run_text(sweep, out, shard=args.shard, quick=args.quick), end="")
        return 0
    if not args.report:
        run_sweep(sweep, out, shard=parse_shard(args.shard) if args.shard else (0, 1), quick=args.quick,
                  supersede=args.supersede)
        if args.shard:  # shards may finish together: one report, by --report, once all of them are done
            print(f"shard {args.shard} done; when every shard is, gather them: jaxformer sweep {args.sweep_file} "
                  f"--out {out} --report")
            return 0
    print(f"report: {write_report(sweep, out)}")
    return 0
