"""Sweeps: many ordinary runs from one file (``jaxformer sweep``), one after another, resumable.

A sweep file names a base experiment and the axes to vary::

    base: ../configs/stdlib_bytes.yaml        # relative to the sweep file
    overrides: {steps: 600, model.n_layers: 2} # nested sections or dotted keys
    axes:                                      # the grid is the product of the axes ...
      model.position: [none, sinusoidal, rope]
    zip:                                       # ... and of each zip group (its lists move together)
      - {model.n_heads: [1, 4], model.head_dim: [128, 32]}
    seeds: [0, 1]
    eval_lengths: [64, 128, 256]              # evaluate every finished run at these context lengths
    eval_max_tokens: 65536                    # scored tokens per length
    probes: [attention, mlp, order]           # attention statistics, per-block gradient norms, dead FFN
                                              # units, the loss with each window's prefix shuffled, at
                                              # initialisation and at the end
    divergence_margin: 0.02                   # the train-loss rule of blew_up (null: non-finite only)
    tune:                                      # per arm, search these keys first (fair tuning) ...
      keys: {optimizer.lr: [1.0e-3, 3.0e-3, 1.0e-2]}
      metric: val_bpb                          # ... pick each arm's best value (mode: min | max) ...
      seeds: 1                                 # ... from runs of its first N seeds, then run the arm there
    report: {metric: val_bpb, x: model.position, plots: [loss_curves, final_metric],
             baseline: {model.position: rope}} # paired differences (same seed) vs this arm, 95% t intervals

Every point is an ordinary run directory ``OUT/<point name>/`` (what ``jaxformer train`` writes) plus
``sweep_point.json``, its row of the summary. A point with that file is finished and skipped; one
without resumes from its checkpoints, so a killed sweep re-run with the same command loses at most one
checkpoint interval of one point; a finished point whose recorded config differs from the sweep file's
is refused, naming the keys. With ``tune:`` every arm (a setting of the varied keys) first runs the
tuning grid (points ``tune-<arm>_<tuned values>_seed-<s>``, each an ordinary point); its final points
then run at the value with the best tuning metric, recorded in their rows as ``tuned``; a final point
whose config is that of a finished tuning point (the same seed at the chosen value) is not trained again:
that run directory is copied, its row recorded with ``copy_of`` naming the tuning point (training is
deterministic for a given config, so a second run would repeat the first).
``shard=(i, n)`` runs points ``i, i+n, i+2n, ...`` of the tuning points followed by the final ones (a job array);
:func:`jaxformer.study.report.write_report` gathers what every shard wrote (a point without a run directory
there, from the row ``summary.jsonl`` or ``tuning.jsonl`` recorded for it: :func:`read_point`; the runner
itself only counts run directories as finished, refuses to go on beside one that disagrees with the sweep file,
and with ``supersede`` moves aside and re-runs a final point whose arm's tuning now chooses another value). A
run that diverges
(non-finite loss, or its last train losses above its first by ``divergence_margin``: :func:`blew_up`)
is recorded as diverged, and the sweep goes on; the train-loss verdict of a finished point is taken again
from its logged losses whenever the sweep reads it, so changing the margin never needs a re-run (a row read
from the row files alone keeps the verdict it was recorded with).
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import re
import shutil
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from jaxformer.train import config as C

PLOTS = ("loss_curves", "val_curves", "final_metric", "metric_vs_eval_length", "loss_by_position", "probes",
         "sinusoidal_table", "rope_decay", "alibi_bias")
PROBES = ("attention", "mlp", "order")
DEFAULT_MARGIN = 0.02  # SweepConfig.divergence_margin's default
LOSS_RULE = "final train loss"  # how blew_up's train-loss verdict begins
POINT_FILE = "sweep_point.json"


METRICS = ("val_bpb", "val_loss", "loss", "tokens_per_s", "wall_s")
"""The summary row's columns a study may compare (``report.metric``, ``tune.metric``)."""
Metric = Literal[METRICS]  # type: ignore[valid-type]


class ReportConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    metric: Metric = Field("val_bpb", description="the summary column the table and plots compare")
    x: str | None = Field(None, description="the axis on the x of the final_metric plot (default: the first)")
    plots: tuple[Literal[PLOTS], ...] = ("loss_curves", "final_metric")  # type: ignore[valid-type]
    baseline: dict[str, Any] | None = Field(None, description="values of varied keys naming the baseline arm: "
                                            "every other arm gets its paired difference to the baseline arm "
                                            "that agrees on the keys not named here")
    confidence: float = Field(0.95, gt=0, lt=1, description="of the paired difference's t interval")
    panels: tuple[str, ...] = Field((), description="varied keys that split the training / validation curve, "
                                    "final-metric, tuning and probe plots into panels, one per combination of "
                                    "their values (the lines of a panel are the other keys' settings, one colour "
                                    "each, the same in every panel; one legend below the panels); the "
                                    "final-metric and probe plots leave out their x key")
    trained_below: float | None = Field(None, description="a run trained when it did not diverge and its metric "
                                        "ended below this (e.g. the unigram entropy in bits/byte: a run stuck at "
                                        "byte frequencies is finite, so not diverged, but has not trained); the "
                                        "table gets a 'trained' column, k of n seeds")


class TuneConfig(BaseModel):
    """Per-arm search before the final runs: every arm runs each combination of ``keys`` with its first
    ``seeds`` seeds, and its final points use the combination whose mean ``metric`` is best."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    keys: dict[str, list[Any]] = Field(min_length=1, description="dotted key -> values to try (their product)")
    metric: Metric | None = Field(None, description="the summary column to optimise (default: report.metric)")
    mode: Literal["min", "max"] = "min"
    seeds: int = Field(1, ge=1, description="tuning runs per value: the sweep's first N seeds")

    @field_validator("keys")
    @classmethod
    def _keys(cls, v):
        for key, values in v.items():
            if not values:
                raise ValueError(f"tune key {key!r} has no values")
            if key == "seed":
                raise ValueError("the seed cannot be tuned")
        return v


class SweepConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    base: str = Field(description="the base experiment YAML, relative to the sweep file")
    overrides: dict[str, Any] = Field(default_factory=dict)
    axes: dict[str, list[Any]] = Field(default_factory=dict)
    zip: list[dict[str, list[Any]]] = Field(default_factory=list)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    eval_lengths: list[int] = Field(default_factory=list)
    eval_max_tokens: int | None = Field(65536, gt=0, description="scored tokens per evaluation length")
    probes: list[Literal[PROBES]] = Field(default_factory=list)  # type: ignore[valid-type]
    divergence_margin: float | None = Field(
        DEFAULT_MARGIN, ge=0, description="a finite run is diverged when the mean of its last train losses exceeds that "
        "of its first by more than this fraction; null: only a non-finite loss is divergence (fine-tuning, "
        "where batch-to-batch loss differences outweigh what training moves)")
    tune: TuneConfig | None = None
    report: ReportConfig = ReportConfig()

    @field_validator("axes")
    @classmethod
    def _axes(cls, v):
        for key, values in v.items():
            if not values:
                raise ValueError(f"axis {key!r} has no values")
            if key == "seed":
                raise ValueError("vary the seed with `seeds:`, not an axis")
        return v

    @field_validator("zip")
    @classmethod
    def _zip(cls, v):
        for i, group in enumerate(v):
            lengths = {k: len(vals) for k, vals in group.items()}
            if not group or len(set(lengths.values())) != 1 or 0 in lengths.values():
                raise ValueError(f"zip group {i} must hold lists of one common, non-zero length; got {lengths}")
            if "seed" in group:
                raise ValueError("vary the seed with `seeds:`, not a zip key")
        return v

    @field_validator("eval_lengths")
    @classmethod
    def _lengths(cls, v):
        if any(n < 2 for n in v):
            raise ValueError(f"eval_lengths={v}: every length must be >= 2")
        return v

    @model_validator(mode="after")
    def _check(self):
        keys = list(self.axes) + [k for g in self.zip for k in g]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"keys varied twice (axes / zip): {dup}")
        if self.report.x is not None and self.report.x not in keys:
            raise ValueError(f"report.x={self.report.x!r} is not one of the varied keys {keys}")
        unknown = [k for k in self.report.panels if k not in keys]
        if unknown:
            raise ValueError(f"report.panels {unknown} are not varied keys {keys}")
        if keys and set(keys) <= set(self.report.panels):
            raise ValueError(f"report.panels {list(self.report.panels)} hold every varied key: nothing is left to "
                             "compare within a panel")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds={self.seeds} repeats a seed")
        if self.tune is not None:
            both = sorted(set(self.tune.keys) & set(keys))
            if both:
                raise ValueError(f"tune.keys {both} are also varied (axes / zip): tune another key")
            if self.tune.seeds > len(self.seeds):
                raise ValueError(f"tune.seeds={self.tune.seeds} is more than the {len(self.seeds)} seeds {self.seeds}")
        if self.report.baseline is not None:
            base = self.report.baseline
            unknown = sorted(set(base) - set(keys))
            if unknown:
                raise ValueError(f"report.baseline keys {unknown} are not varied keys {keys}")
            for key, values in self.axes.items():
                if key in base and base[key] not in values:
                    raise ValueError(f"report.baseline {key}={base[key]!r} is not one of its values {values}")
            for group in self.zip:  # an arm's baseline: its own zip setting with the named keys replaced
                named = [k for k in group if k in base]
                n = len(next(iter(group.values())))
                rows = [tuple(group[k][i] for k in group) for i in range(n)]
                wanted = [tuple(base[k] if k in base else group[k][i] for k in group) for i in range(n)]
                if named and not any(w in rows for w in wanted):
                    raise ValueError(f"report.baseline {({k: base[k] for k in named})} gives no arm of the zip group "
                                     f"{list(group)} a baseline that is one of its settings")
        return self

    @property
    def varied(self) -> list[str]:
        """The varied dotted keys in order: axes first, then zip groups."""
        return list(self.axes) + [k for g in self.zip for k in g]


@dataclass(frozen=True)
class Point:
    """One run of a sweep: its directory name, the varied values, the seed and the validated config
    (with ``tune:``: a final point's config holds the base's values of the tuned keys until
    :func:`tuned_point` resolves it; a tuning point's ``tuned`` holds the values it tries)."""

    name: str
    values: dict[str, Any]
    seed: int
    config: C.ExperimentConfig
    tuned: dict[str, Any] | None = None
    tuning: bool = False  # a point of the tuning grid (``tune:``), not a final one


@dataclass(frozen=True)
class Sweep:
    path: Path
    spec: SweepConfig
    points: list[Point]
    tune_points: list[Point] = field(default_factory=list)
    base: dict = field(default_factory=dict)  # the base experiment with the sweep's overrides, as raw YAML
    base_dir: Path | None = None

    @property
    def name(self) -> str:
        return self.path.stem

    def config(self, values: dict[str, Any], seed: int, where: str) -> C.ExperimentConfig:
        """The validated config of the base with ``values`` (dotted keys) set and ``seed``."""
        raw = copy.deepcopy(self.base)
        for k, v in values.items():
            _set(raw, k, v, f"{self.path}: axes")
        raw["seed"] = seed
        return C.from_dict(raw, where, base_dir=self.base_dir)


# -- loading and expanding ---------------------------------------------------------------------

def _set(raw: dict, dotted: str, value: Any, where: str) -> None:
    C.set_key(raw, dotted.split("."), copy.deepcopy(value), f"{where}: {dotted}")


def _merge(raw: dict, overrides: dict, where: str, prefix: str = "") -> None:
    """Apply ``overrides`` (nested sections merge key by key; dotted keys set one value; a model key of
    before the sections lands in its section, the base's own flat keys moved there first)."""
    if not prefix:
        C.migrate_model(raw, where)
    for k, v in overrides.items():
        key = ".".join(C.model_key(f"{prefix}{k}".split("."), v))
        if isinstance(v, dict) and "." not in k and isinstance(_get(raw, key), dict):
            _merge(raw, v, where, prefix=f"{key}.")
        else:
            _set(raw, key, v, where)


def _get(raw: dict, dotted: str):
    node: Any = raw
    for p in dotted.split("."):
        if not isinstance(node, dict) or p not in node:
            return None
        node = node[p]
    return node


def format_value(v: Any) -> str:
    """A value as it appears in a point name: ``None`` -> none, lists joined by x."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return "x".join(format_value(x) for x in v)
    if isinstance(v, dict):
        return "-".join(f"{k}{format_value(x)}" for k, x in v.items())
    return str(v)


def point_name(values: dict[str, Any], seed: int) -> str:
    """``position-rope_seed-0``: each varied key by its last part (the full key when two share it)."""
    last = [k.split(".")[-1] for k in values]
    parts = []
    for key, short in zip(values, last):
        label = short if last.count(short) == 1 else key.replace(".", "_")
        parts.append(f"{label}-{format_value(values[key])}")
    parts.append(f"seed-{seed}")
    return re.sub(r"[^A-Za-z0-9.+_-]", "", "_".join(parts))


def load_sweep(path: str | Path) -> Sweep:
    """Read, validate and expand a sweep file; every error names the file and the dotted key."""
    path = Path(path)
    try:
        raw = C.load_yaml(path.read_text()) or {}
    except OSError as e:
        raise C.ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise C.ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise C.ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    try:
        spec = SweepConfig.model_validate(raw)
    except ValidationError as e:
        raise C.ConfigError(C.format_errors(e, str(path), schema=SweepConfig)) from None
    base_path = (path.parent / spec.base).resolve()
    try:
        base = C.load_yaml(base_path.read_text()) or {}
    except OSError as e:
        raise C.ConfigError(f"{path}: base: cannot read {base_path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise C.ConfigError(f"{path}: base: {base_path}: not valid YAML: {e}") from None
    if not isinstance(base, dict):
        raise C.ConfigError(f"{path}: base: {base_path} is not a mapping")
    _merge(base, spec.overrides, f"{path}: overrides")

    sweep = Sweep(path, spec, [], [], base, base_path.parent)
    groups: list[list[dict[str, Any]]] = [[{k: v} for v in vals] for k, vals in spec.axes.items()]
    groups += [[{k: g[k][i] for k in g} for i in range(len(next(iter(g.values()))))] for g in spec.zip]
    names: set[str] = set()

    def add(points: list[Point], name: str, values: dict, seed: int, tuned: dict | None = None) -> None:
        if name in names:
            raise C.ConfigError(f"{path}: two points are both named {name!r}; give the values distinct spellings")
        names.add(name)
        cfg = sweep.config({**values, **(tuned or {})}, seed, f"{path} (point {name})")
        points.append(Point(name, values, seed, cfg, tuned, tuning=tuned is not None))

    for combo in itertools.product(*groups):
        values = {k: v for part in combo for k, v in part.items()}
        if spec.tune is not None:
            for tuned in tune_grid(spec.tune):
                for seed in spec.seeds[:spec.tune.seeds]:
                    add(sweep.tune_points, "tune-" + point_name({**values, **tuned}, seed), values, seed, tuned)
        for seed in spec.seeds:
            add(sweep.points, point_name(values, seed), values, seed)
    return sweep


def tune_grid(tune: TuneConfig) -> list[dict[str, Any]]:
    """Every combination of the tuned keys' values, in order."""
    keys = list(tune.keys)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(tune.keys[k] for k in keys))]


def tune_metric(sweep: Sweep) -> str:
    return sweep.spec.tune.metric or sweep.spec.report.metric


def tuning_results(sweep: Sweep, out: Path, values: dict, *, recorded: bool = True
                   ) -> list[tuple[dict, float | None, list[dict]]]:
    """``(tuned values, mean metric over the tuning seeds or None, rows)`` per combination of one arm; a
    diverged or unfinished run counts as no value (None when any seed lacks one); ``recorded``: as
    :func:`read_point`."""
    metric = tune_metric(sweep)
    by: dict[str, tuple[dict, list[dict | None]]] = {}
    for p in sweep.tune_points:
        if p.values == values:
            row = read_point(sweep, out, p, recorded=recorded)
            by.setdefault(json.dumps(p.tuned, sort_keys=True), (p.tuned, []))[1].append(row)
    results = []
    for tuned, rows in by.values():
        ok = [r.get(metric) for r in rows if r is not None and not r["diverged"]]
        good = len(ok) == len(rows) and all(isinstance(x, (int, float)) and math.isfinite(x) for x in ok)
        results.append((tuned, statistics.fmean(ok) if good else None, [r for r in rows if r is not None]))
    return results


def chosen_values(sweep: Sweep, out: Path, values: dict, *, recorded: bool = True) -> dict | None:
    """The tuned values an arm's final points run at: the combination with the best mean tuning metric
    (ties: the first listed; combinations that diverged are never chosen), or None while any of its tuning
    points is unfinished. ValueError when every combination diverged."""
    results = tuning_results(sweep, out, values, recorded=recorded)
    n_seeds = sweep.spec.tune.seeds
    if any(len(rows) < n_seeds for _, _, rows in results):
        return None
    scored = [(m, i, tuned) for i, (tuned, m, _) in enumerate(results) if m is not None]
    if not scored:
        raise ValueError(f"{sweep.path}: every tuning run of arm {values} diverged or has no "
                         f"{tune_metric(sweep)}; widen tune.keys")
    sign = 1.0 if sweep.spec.tune.mode == "min" else -1.0
    return min(scored, key=lambda x: (sign * x[0], x[1]))[2]


def tuned_point(sweep: Sweep, point: Point, out: Path, *, recorded: bool = True) -> Point | None:
    """A final point with its arm's chosen tuned values in its config (itself without ``tune:``), or None
    while its arm's tuning is unfinished (other shards may still be running it)."""
    if sweep.spec.tune is None or point.tuning:
        return point
    chosen = chosen_values(sweep, out, point.values, recorded=recorded)
    if chosen is None:
        return None
    cfg = sweep.config({**point.values, **chosen}, point.seed, f"{sweep.path} (point {point.name})")
    return replace(point, config=cfg, tuned=chosen)


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` with ``0 <= I < N`` -> ``(I, N)``."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not 0 <= int(m[1]) < int(m[2]):
        raise ValueError(f"--shard {text!r}: expected I/N with 0 <= I < N, e.g. 0/4")
    return int(m[1]), int(m[2])


def shard_points(points: list[Point], shard: tuple[int, int]) -> list[Point]:
    """Every N-th point starting at I: the shards of one sweep partition its points."""
    i, n = shard
    return points[i::n]


QUICK_STEPS = 2


def quick_config(cfg: C.ExperimentConfig) -> C.ExperimentConfig:
    """The same point for :data:`QUICK_STEPS` steps with tiny evaluations (smoke tests)."""
    raw = C.to_dict(cfg)
    raw.update(steps=QUICK_STEPS)
    raw["checkpoint"].update(every=1)
    raw["logging"].update(every=1, progress=False, tensorboard=False)
    raw["eval"].update(every=None, max_tokens=cfg.seq_len, final_max_tokens=cfg.seq_len, stride=None,
                       compare_compressors=False, sample=None)
    return C.from_dict(raw, "<quick>")


# -- running -----------------------------------------------------------------------------------

def default_out(sweep: Sweep, quick: bool) -> Path:
    return Path("runs") / "sweeps" / (sweep.name + ("-quick" if quick else ""))


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


SUMMARY_FILE, TUNING_FILE = "summary.jsonl", "tuning.jsonl"  # what a report writes: the rows, final and tuning
ROW_FILES = (SUMMARY_FILE, TUNING_FILE)


def read_point(sweep: Sweep, out: Path, point: Point, *, recorded: bool = True) -> dict | None:
    """A finished point's row (None when unfinished), its train-loss divergence judged with the sweep
    file's ``divergence_margin`` (:func:`run_dir` says where). Without its run directory, the row ``out``'s
    ``summary.jsonl`` or ``tuning.jsonl`` recorded for it (:func:`recorded_row`): a study's committed results
    keep the rows, not always the runs, and a report rebuilt from them must neither lose them nor invent any.
    ``recorded=False`` (what :func:`run_sweep` reads): run directories only, so a point whose directory was
    deleted runs again."""
    where = run_dir(out, point.name)
    if not (where / POINT_FILE).exists():
        return recorded_row(sweep, out, point) if recorded else None
    row = json.loads((where / POINT_FILE).read_text())
    if recorded and row.get("config") is not None and not is_current(sweep, out, point, row):
        return None  # a run of an older design of the sweep (the runner refuses it: check_finished)
    return rejudged(row, where, sweep.spec.divergence_margin)


def run_dir(out: Path, name: str) -> Path:
    """Where point ``name``'s finished run is read from: ``out/name``, or ``out/points/name`` where only that
    holds one (a study's committed results keep each run's sweep_point.json and metrics.jsonl there)."""
    here, kept = out / name, out / "points" / name
    return kept if not (here / POINT_FILE).exists() and (kept / POINT_FILE).exists() else here


def recorded_row(sweep: Sweep, out: Path, point: Point) -> dict | None:
    """``point``'s row in ``out``'s row files, as recorded (its divergence verdict included), if its saved
    config is the one the sweep file gives that point now (at the row's own tuned values, which must be its
    arm's choice where that is known; a ``--quick`` row at the quick config); else None, so a row of an older
    design of the sweep is never reported as new."""
    row = _recorded(out).get(point.name)
    if row is None or row.get("config") is None:
        return None
    return copy.deepcopy(row) if is_current(sweep, out, point, row) else None


def is_current(sweep: Sweep, out: Path, point: Point, row: dict) -> bool:
    """Whether ``row`` (with its saved config) is ``point`` as the sweep file defines it now: the same config,
    at the row's own tuned values, which must be its arm's choice where that is known (a ``--quick`` row at
    the quick config)."""
    if bool(row.get("tuning")) != point.tuning:
        return False
    if sweep.spec.tune is not None and not point.tuning:  # a final row at a value its arm no longer chooses
        try:
            chosen = chosen_values(sweep, out, point.values)
        except ValueError:
            chosen = None
        if chosen is not None and row.get("tuned") != chosen:
            return False
    if point.tuning or sweep.spec.tune is None:  # the point's config is whole already
        cfg = point.config
    else:  # a final point's: at the row's tuned values, which must be a combination of the current grid
        tuned = row.get("tuned") or {}
        if tuned not in tune_grid(sweep.spec.tune):
            return False
        cfg = sweep.config({**point.values, **tuned}, point.seed, f"{sweep.path} ({point.name})")
    try:
        saved = C.from_dict(row["config"], f"{out} ({point.name})")
    except C.ConfigError:  # a config of a schema the library no longer reads: not this point's
        return False
    return not C.diff(saved, quick_config(cfg) if row.get("quick") else cfg, located=False)


def _recorded(out: Path) -> dict[str, dict]:
    """Every row of ``out``'s row files by point name (re-read when a file changes)."""
    stamp = tuple((f.stat().st_mtime_ns, f.stat().st_size) if f.exists() else None
                  for f in (out / n for n in ROW_FILES))
    key = str(out.resolve())
    if _RECORDED.get(key, (None,))[0] != stamp:
        _RECORDED[key] = (stamp, {r["name"]: r for n in ROW_FILES for r in read_rows(out / n)})
    return _RECORDED[key][1]


def read_rows(path: Path) -> list[dict]:
    """The named rows of a row file (none when it does not exist)."""
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if isinstance(r, dict) and "name" in r]


_RECORDED: dict[str, tuple[tuple, dict[str, dict]]] = {}


def rejudged(row: dict, run_dir: Path, margin: float | None) -> dict:
    """``row`` with its train-loss verdict taken again from the run's logged losses under ``margin``
    (a stop on a non-finite loss stays diverged)."""
    from jaxformer.train.metrics import read_metrics

    reason = row.get("diverged_reason") or ""
    if row.get("diverged") and not reason.startswith(LOSS_RULE):
        return row
    losses = [r["loss"] for r in read_metrics(run_dir) if isinstance(r.get("loss"), float)]
    verdict = blew_up(losses, margin)
    row = {k: v for k, v in row.items() if k != "diverged_reason"}
    row["diverged"] = verdict is not None
    if verdict is not None:
        row["diverged_reason"] = verdict
    return row


def check_finished(point: Point, done: dict, cfg: C.ExperimentConfig, quick: bool, where: Path) -> None:
    """A finished point's file must hold this point's config (a changed sweep file or a --quick run in
    the same --out is refused, naming the keys), so old results are never reported as new ones."""
    saved = done.get("config")
    if saved is None:
        return  # written before configs were recorded: nothing to compare
    if bool(done.get("quick")) != quick:
        raise C.ConfigError(f"{where}: point {point.name} was run {'with' if done.get('quick') else 'without'} "
                            f"--quick; use another --out for {'quick' if quick else 'full'} runs")
    changed = C.diff(C.from_dict(saved, str(where)), cfg, located=False)
    if changed:
        keys = ", ".join(f"{k} (saved {a!r}, now {b!r})" for k, a, b in changed)
        hint = (" (its arm's tuning now chooses another value: --supersede moves it aside and runs it again)"
                if not point.tuning and point.tuned is not None and done.get("tuned") != point.tuned else "")
        raise C.ConfigError(f"{where}: point {point.name} finished with another config: {keys}{hint}. Use a new "
                            f"--out, or delete that point's directory to run it again")


def run_sweep(sweep: Sweep, out: str | Path, *, shard: tuple[int, int] = (0, 1), quick: bool = False,
              supersede: bool = False, say=print) -> list[dict]:
    """Run this shard's points one after another (finished ones skipped); their summary rows.

    ``supersede``: a finished final point whose arm's tuning now chooses another value (its tuning grid was
    widened, or a tuning point ran again) has its run directory moved to ``out/superseded_points/`` and runs
    again at the new value; without it such a point is refused (``check_finished``), as is every other
    disagreement between a finished point and the sweep file."""
    from jaxformer.train.loop import release_host_memory

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mine = shard_points(sweep.tune_points + sweep.points, shard)  # tuning first: final points need it

    def finished(point: Point) -> dict | None:
        """The point's row if it finished as the sweep file now gives it (else ConfigError), None if it must
        run: unfinished, or superseded just now."""
        done = read_point(sweep, out, point, recorded=False)
        if done is None or (resolved := tuned_point(sweep, point, out, recorded=False)) is None:
            return done
        where = run_dir(out, point.name)
        if supersede and not point.tuning and done.get("config") is not None and done.get("tuned") != resolved.tuned:
            kept = out / "superseded_points" / point.name
            kept.parent.mkdir(exist_ok=True)
            shutil.rmtree(kept, ignore_errors=True)
            shutil.move(str(where), kept)
            say(f"{point.name}: ran at {done.get('tuned')}, its arm now chooses {resolved.tuned}: moved to {kept}, "
                "runs again")
            return None
        check_finished(resolved, done, quick_config(resolved.config) if quick else resolved.config, quick,
                       where / POINT_FILE)
        return done

    for point in mine:  # refuse before any work if a finished point disagrees with the sweep file
        finished(point)
    rows, waiting = [], []
    for i, point in enumerate(mine, 1):
        # a final point's arm may have finished its tuning in this very run, after the check above
        done = finished(point)
        if done is not None:
            say(f"[{i}/{len(mine)}] {point.name}: finished, skipped")
            rows.append(done)
            continue
        resolved = tuned_point(sweep, point, out, recorded=False)
        if resolved is None:
            say(f"[{i}/{len(mine)}] {point.name}: its arm's tuning points are not all finished (another shard?); "
                "skipped for now")
            waiting.append(point.name)
            continue
        point = resolved
        twin = finished_twin(sweep, point, out, quick)
        if twin is not None:
            rows.append(copy_twin(out, point, twin))
            say(f"[{i}/{len(mine)}] {point.name}: the same run as the finished tuning point {twin.name}; copied")
            continue
        say(f"[{i}/{len(mine)}] {point.name}" + (f" at the tuned {point.tuned}" if point.tuned else ""))
        row = run_point(sweep, point, out / point.name, quick=quick)
        _write_json(out / point.name / POINT_FILE, row)
        release_host_memory()  # the run's compiled programs and freed heap, before the next run makes its own
        metric = row.get(sweep.spec.report.metric)
        say(f"[{i}/{len(mine)}] {point.name}: " + ("diverged" if row["diverged"] else
                                                    f"{sweep.spec.report.metric} {metric:.4f}" if metric is not None
                                                    else "done") + f" in {row['wall_s']:.0f} s")
        rows.append(row)
    if waiting:
        say(f"{len(waiting)} final point(s) wait for tuning points of other shards; when those are done, run "
            "this shard again")
    return rows


def finished_twin(sweep: Sweep, point: Point, out: Path, quick: bool) -> Point | None:
    """The finished tuning point that is ``point`` (a final point at its arm's chosen values) run already:
    the same values, seed and tuned values, so the same config; else None. Its saved config is checked
    (:func:`check_finished`) as this shard's own finished points are: another shard may have written it."""
    if point.tuning or point.tuned is None:
        return None
    for t in sweep.tune_points:
        path = run_dir(out, t.name) / POINT_FILE  # a committed points/ run is a twin too
        if (t.values, t.seed, t.tuned) == (point.values, point.seed, point.tuned) and path.exists():
            check_finished(t, json.loads(path.read_text()), quick_config(t.config) if quick else t.config, quick,
                           path)
            return t
    return None


def copy_twin(out: Path, point: Point, twin: Point) -> dict:
    """Copy ``twin``'s run directory to ``point``'s (replacing an unfinished one) and write ``point``'s row:
    the twin's, renamed, not a tuning row, with ``copy_of``."""
    dst, tmp = out / point.name, out / f".{point.name}.copy{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(run_dir(out, twin.name), tmp, symlinks=True)
    row = json.loads((run_dir(out, twin.name) / POINT_FILE).read_text())
    row.update(name=point.name, tuning=False, copy_of=twin.name)
    _write_json(tmp / POINT_FILE, row)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    return row


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def blew_up(losses: list[float], margin: float | None = DEFAULT_MARGIN) -> str | None:
    """Why a run with these logged train losses diverged, else None: a non-finite loss, or (unless
    ``margin`` is None) the mean of its last few losses above the mean of its first few by more than
    ``margin`` (a flat run that does not learn is not diverged)."""
    if not losses:
        return None
    if not all(math.isfinite(x) for x in losses):
        return "non-finite train loss"
    if margin is None:
        return None
    k = max(1, min(5, len(losses) // 4))
    first, last = statistics.fmean(losses[:k]), statistics.fmean(losses[-k:])
    if last > first * (1 + margin):
        return f"{LOSS_RULE} {last:.4f} (mean of the last {k} rows) above the first {first:.4f}"
    return None


def run_point(sweep: Sweep, point: Point, run_dir: Path, *, quick: bool = False) -> dict:
    """Train (or resume) one point, then its length evaluations and probes: its summary row.

    A run stopped by a non-finite loss keeps its initialisation probe only (its last checkpoint is from
    before the blow-up); a finite run that diverged is evaluated and probed like any other.
    """
    from jaxformer.model import count_params
    from jaxformer.train.loop import NonFiniteError, train
    from jaxformer.train.metrics import read_metrics

    cfg = quick_config(point.config) if quick else point.config
    t0 = time.perf_counter()
    row: dict[str, Any] = {"name": point.name, "values": point.values, "seed": point.seed,
                           "params": count_params(cfg.model), "diverged": False}
    if point.tuned is not None:
        row["tuned"] = point.tuned
        row["tuning"] = point.tuning
    try:
        summary = train(cfg, run_dir)
        stopped = False
    except NonFiniteError as e:
        summary, stopped = {}, True
        row.update(diverged=True, diverged_reason=str(e))
    train_rows = [r for r in read_metrics(run_dir) if "loss" in r]
    for k in ("step", "loss", "val_loss", "val_bpb", "val_tokens", "gzip9_bpb", "xz9e_bpb"):
        if summary.get(k) is not None:
            row[k] = summary[k]
    row["tokens_per_s"] = _median(r.get("tokens_per_s") for r in train_rows)
    reason = None if stopped else blew_up([r["loss"] for r in train_rows if isinstance(r["loss"], float)],
                                          sweep.spec.divergence_margin)
    if reason is not None:
        row.update(diverged=True, diverged_reason=reason)
    if sweep.spec.eval_lengths and not stopped:
        row["eval_lengths"] = eval_lengths(run_dir, cfg, sweep.spec.eval_lengths,
                                           max_tokens=None if quick else sweep.spec.eval_max_tokens, quick=quick)
    if sweep.spec.probes:
        row["probes"] = probe_run(run_dir, sweep.spec.probes, cfg=cfg, final=not stopped)
    row["wall_s"] = time.perf_counter() - t0
    row["quick"] = quick
    row["config"] = C.to_dict(cfg)
    return row


def eval_lengths(run_dir: Path, cfg: C.ExperimentConfig, lengths: list[int], *, max_tokens: int | None,
                 quick: bool = False) -> dict:
    """``{str(length): evaluation}`` at each length; a length the model cannot run is ``{"na": reason}``.

    Every length scores the same tokens: windows of each length tile the same spans of the longest
    length (``evaluate_run_at_length(span=...)``), so ``val_tokens`` and ``val_bytes`` agree across lengths
    and a difference between lengths is the context, not the text sampled."""
    from jaxformer.train.evaluation import evaluate_run_at_length, learned_table_refusal

    span = max(lengths)
    out = {}
    for n in lengths:
        refusal = learned_table_refusal(cfg.model, n)
        if refusal is not None:
            out[str(n)] = {"na": refusal}
            continue
        out[str(n)] = evaluate_run_at_length(run_dir, n, max_tokens=span if quick else max_tokens, span=span)
    return out


def probe_run(run_dir: Path, probes=("attention",), *, cfg: C.ExperimentConfig | None = None,
              final: bool = True) -> dict:
    """The ``probes`` at initialisation (the run's seed) and, when ``final``, at the run's end:
    ``attention`` (:func:`jaxformer.study.probes.attention_probe` on the first batch of validation
    windows), ``mlp`` (:func:`jaxformer.study.probes.mlp_probe` over the validation windows of
    ``eval.max_tokens``) and ``order`` (:func:`jaxformer.study.probes.order_probe` over the same windows).
    Without ``final`` only ``cfg`` is needed (no checkpoint is read)."""
    from jaxformer.train import sharding as shd
    from jaxformer.train.corpus import build_corpus
    from jaxformer.train.evaluation import eval_batch_size, eval_set
    from jaxformer.study.probes import attention_probe, mlp_probe, order_probe
    from jaxformer.train.run_dir import load_run, tokenizer_path
    from jaxformer.train.step import make_trainer

    if final:
        cfg, trainer, params, _, _ = load_run(run_dir)
    else:
        trainer, params = make_trainer(cfg, shd.make_mesh(cfg.mesh)), None
    corpus = build_corpus(cfg.data, tokenizer_path=tokenizer_path(cfg, run_dir))
    evalset = eval_set(cfg, corpus, cfg.eval.max_tokens)
    if evalset is None:
        raise ValueError(f"{run_dir}: probes need a validation split")
    batches = list(evalset.batches(eval_batch_size(cfg, trainer.mesh)))
    out = {}
    for when, p in (("init", trainer.init_state(cfg.seed)["params"]), ("final", params)):
        if p is None:
            continue
        out[when] = {}
        if "attention" in probes:
            out[when].update(attention_probe(trainer.graphdef, p, batches[0]))
        if "mlp" in probes:
            out[when].update(mlp_probe(trainer.graphdef, p, batches))
        if "order" in probes:
            out[when].update(order_probe(trainer.graphdef, p, batches))
    return out



def dry_run_text(sweep: Sweep, out: Path, *, shard: str | None = None, quick: bool = False) -> str:
    """``jaxformer sweep --dry-run``: the points (of ``shard`` ``I/N``, if given) with what each changes from the
    first point, then the first point's resolved config."""
    every = sweep.tune_points + sweep.points  # tuning points run first (their arms' final points need them)
    mine = shard_points(every, parse_shard(shard) if shard else (0, 1))
    first = quick_config(sweep.points[0].config) if quick else sweep.points[0].config
    tuning = f" ({len(sweep.tune_points)} tuning, {len(sweep.points)} final)" if sweep.tune_points else ""
    lines = [f"{sweep.path}: {len(every)} points{tuning}" + (f", {len(mine)} in shard {shard}" if shard else "")
             + f" -> {out}"]
    for p in mine:
        cfg = quick_config(p.config) if quick else p.config
        changed = [f"{k}={b!r}" for k, a, b in C.diff(first, cfg)]
        at = " (at its arm's tuned values)" if sweep.tune_points and not p.tuning else ""
        lines.append(f"  {p.name}: {cfg.steps} steps, {cfg.model.n_layers} layers, d_model {cfg.model.d_model}"
                     + (f"; vs the first point: {', '.join(changed)}" if changed else "") + at)
    return ("\n".join(lines) + "\nthe first point, resolved (the others differ only where listed):\n"
            + yaml.safe_dump(C.to_dict(first), sort_keys=False))

__all__ = ["PLOTS", "Point", "Sweep", "SweepConfig", "TuneConfig", "chosen_values", "default_out", "dry_run_text",
           "is_current", "load_sweep", "parse_shard", "point_name", "quick_config", "read_point", "run_sweep",
           "shard_points", "tune_grid", "tuned_point", "tuning_results"]
