"""A sweep's finished rows grouped for its report and plots: per setting (the varied keys' values) over seeds,
the labels and colours of the settings, mean ± spread, probe values and the quick-run warning."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from jaxformer.study.sweep import QUICK_STEPS, Sweep, format_value, read_point


PROBE_KEYS = ("logit_var", "entropy_ratio", "max_weight", "qk_grad_norm", "grad_norm_first_block", "dead_fraction",
              "order_nll", "order_nll_shuffled", "order_gain")


def probe_keys(rows: list[dict]) -> list[str]:
    """The probe columns the rows have (attention statistics and/or dead FFN units)."""
    have = {k for r in rows for when, vals in r.get("probes", {}).items() for k in vals
            if probe(r, when, k) is not None}
    return [k for k in PROBE_KEYS if k in have]


def gather(sweep: Sweep, out: Path, *, tuning: bool = False) -> list[dict]:
    """The rows of every finished point (any shard), in the sweep's point order (``params`` filled in
    from the point's config for rows written before it was recorded); ``tuning``: of the tuning points."""
    from jaxformer.model import count_params

    rows = []
    for p in sweep.tune_points if tuning else sweep.points:
        r = read_point(sweep, out, p)
        if r is not None:
            r.setdefault("params", count_params(p.config.model))
            rows.append(r)
    return rows


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


def settings(sweep: Sweep, rows: list[dict]) -> list[tuple[dict, list[dict]]]:
    """``(values, rows over seeds)`` per setting, in the sweep's order."""
    keys = sweep.spec.varied
    groups: dict[tuple, tuple[dict, list[dict]]] = {}
    for p in sweep.points:
        groups.setdefault(setting_key({"values": p.values}, keys), (p.values, []))
    for r in rows:
        groups[setting_key(r, keys)][1].append(r)
    return [g for g in groups.values() if g[1]]


DEAD_KEYS = ("dead_fraction", "dead_fraction_layers")


def probe(row: dict, when: str, key: str) -> float | None:
    """A probe value of a row (None where the row lacks it: diverged, or another set of probes). The dead-unit
    fraction only for a ReLU FFN (rows without a config: as recorded): with GeLU, SiLU or a gated FFN a unit
    never positive on the data still passes a gradient, so it is not dead, and the row keeps the count unread."""
    if key in DEAD_KEYS and (row.get("config") or {}).get("model", {}).get("ffn", {}).get("activation",
                                                                                          "relu") != "relu":
        return None
    return row.get("probes", {}).get(when, {}).get(key)


def line_keys(sweep: Sweep, panels: list[str] | None = None) -> list[str]:
    """The varied keys that tell a plot's lines apart: all but the ``panels`` keys (default
    ``report.panels``), which tell its panels apart."""
    panels = sweep.spec.report.panels if panels is None else panels
    return [k for k in sweep.spec.varied if k not in panels]


def panel_groups(sweep: Sweep, items: list, values_of=lambda item: item[0], keys: list[str] | None = None
                 ) -> list[tuple[str | None, list]]:
    """``items`` (default: ``(values, ...)`` pairs) grouped by their values of ``keys`` (default
    ``report.panels``), in the sweep's order: ``(panel title, items)`` per panel that has any; one group titled
    None when there are no panel keys."""
    keys = list(sweep.spec.report.panels if keys is None else keys)
    if not keys:
        return [(None, list(items))]
    groups = {setting_key({"values": p.values}, keys): (label(p.values, keys), []) for p in sweep.points}
    for item in items:
        groups[setting_key({"values": values_of(item)}, keys)][1].append(item)
    return [g for g in groups.values() if g[1]]


def setting_color(sweep: Sweep, values: dict, keys: list[str] | None = None) -> str:
    """One colour per setting of ``keys`` (default: every varied key), the same in every plot (a setting
    missing from one plot shifts nothing); a paneled plot passes :func:`line_keys`, so a line has one colour
    in every panel."""
    keys = sweep.spec.varied if keys is None else keys
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


def arms(sweep: Sweep) -> list[dict]:
    """Every setting of the varied keys, in the sweep's order."""
    keys = sweep.spec.varied
    return list({setting_key({"values": p.values}, keys): p.values for p in sweep.points}.values())
