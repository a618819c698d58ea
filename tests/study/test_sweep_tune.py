"""``tune:`` in a sweep file (per-arm search, then the final runs at each arm's best value) and the report's
paired differences against a baseline arm. The runner's flow is tested with a stand-in for training
(``run_point`` returns a metric computed from the point's config), so the choice is known in advance."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import yaml
import pytest

from jaxformer.train import config as C
from jaxformer.study import sweep as S
from jaxformer.study.report import differences, report_markdown, write_report
from jaxformer.study.stats import paired_difference
from tests.study.test_sweep import write_sweep

BEST = {"rope": 3e-3, "alibi": 1e-2}  # the learning rate each arm does best at, in the stand-in


def fake_metric(cfg: C.ExperimentConfig) -> float:
    """A made-up val_bpb: lowest at the arm's BEST rate, plus a per-seed offset shared by the arms."""
    return 1.0 + abs(math.log(cfg.optimizer.lr / BEST[cfg.model.positions.kind])) + 0.01 * cfg.seed + (
        0.05 if cfg.model.positions.kind == "alibi" else 0.0)


@pytest.fixture
def fake_training(monkeypatch):
    import jaxformer.train.loop as L

    ran = []

    def run_point(sweep, point, run_dir, *, quick=False):
        run_dir.mkdir(parents=True, exist_ok=True)
        ran.append(point.name)
        row = {"name": point.name, "values": point.values, "seed": point.seed, "params": 1, "diverged": False,
               "val_bpb": fake_metric(point.config), "wall_s": 0.0, "quick": quick,
               "config": C.to_dict(point.config)}
        if point.tuned is not None:
            row["tuned"], row["tuning"] = point.tuned, point.tuning
        return row

    monkeypatch.setattr(S, "run_point", run_point)
    # a stand-in run compiles nothing: the real release after each point (gc.collect, jax.clear_caches, malloc_trim)
    # is time spent on nothing here, and drops what the worker compiled for other tests; the release after every
    # point is tests/study/test_sweep.py's test
    monkeypatch.setattr(L, "release_host_memory", lambda: None)
    return ran


def tune_sweep(tmp_path, **tune):
    return write_sweep(tmp_path, {"axes": {"model.position": ["rope", "alibi"]}, "seeds": [0, 1, 2],
                                  "tune": {"keys": {"optimizer.lr": [1e-3, 3e-3, 1e-2]}, **tune},
                                  "report": {"plots": ["final_metric"], "baseline": {"model.position": "rope"}}})


def test_tuning_points_are_the_grid_per_arm_before_the_final_points(tmp_path):
    sweep = S.load_sweep(tune_sweep(tmp_path, seeds=2))
    assert len(sweep.tune_points) == 2 * 3 * 2 and len(sweep.points) == 2 * 3
    t = sweep.tune_points[0]
    assert t.name == "tune-position-rope_lr-0.001_seed-0" and t.tuning and t.tuned == {"optimizer.lr": 1e-3}
    assert {(p.config.optimizer.lr, p.seed) for p in sweep.tune_points if p.values["model.position"] == "alibi"} == {
        (lr, s) for lr in (1e-3, 3e-3, 1e-2) for s in (0, 1)}
    assert all(not p.tuning and p.tuned is None for p in sweep.points)


@pytest.mark.parametrize("spec, match", [
    ({"axes": {"optimizer.lr": [1e-3]}, "tune": {"keys": {"optimizer.lr": [1e-3]}}}, r"also varied"),
    ({"tune": {"keys": {"optimizer.lr": [1e-3]}, "seeds": 2}}, r"tune.seeds=2 is more than the 1 seeds"),
    ({"tune": {"keys": {"optimizer.lr": []}}}, r"has no values"),
    ({"axes": {"model.position": ["rope"]}, "report": {"baseline": {"model.norm": "rmsnorm"}}},
     r"report.baseline keys \['model.norm'\] are not varied"),
])
def test_bad_tune_and_baseline_are_refused_naming_the_file(tmp_path, spec, match):
    with pytest.raises(C.ConfigError, match=r"sweep\.yaml"):
        S.load_sweep(write_sweep(tmp_path, spec))
    with pytest.raises(C.ConfigError, match=match):
        S.load_sweep(write_sweep(tmp_path, spec))


def test_each_arm_runs_at_its_own_best_value(tmp_path, fake_training):
    path = tune_sweep(tmp_path)
    sweep = S.load_sweep(path)
    out = tmp_path / "out"
    rows = S.run_sweep(sweep, out, say=lambda s: None)
    assert fake_training[:6] == [p.name for p in sweep.tune_points]  # tuning first
    final = {r["name"]: r for r in rows if not r.get("tuning")}
    assert len(final) == 6
    for p in sweep.points:
        r = final[p.name]
        assert r["tuned"] == {"optimizer.lr": BEST[p.values["model.position"]]}
        assert r["config"]["optimizer"]["lr"] == BEST[p.values["model.position"]] and r["config"]["seed"] == p.seed
    # seed 0 at the chosen rate is a tuning point already: copied (directory and row), not trained again
    twins = {p.name: f"tune-{S.point_name({**p.values, **final[p.name]['tuned']}, 0)}" for p in sweep.points
             if p.seed == 0}
    assert len(fake_training) == 10 and not set(twins) & set(fake_training)
    for name, twin in twins.items():
        tuned_row = json.loads((out / twin / S.POINT_FILE).read_text())
        assert final[name]["copy_of"] == twin and final[name]["tuning"] is False
        assert {k: v for k, v in final[name].items() if k not in ("name", "tuning", "copy_of")} == {
            k: v for k, v in tuned_row.items() if k not in ("name", "tuning")}
        assert json.loads((out / name / S.POINT_FILE).read_text()) == final[name]
    # a second run skips everything, and the finished final points are checked against the tuned config
    said = []
    S.run_sweep(sweep, out, say=said.append)
    assert len(fake_training) == 10 and len(said) == 12 and all("finished, skipped" in s for s in said)


def test_a_sweep_resumes_elsewhere_from_its_points_rows_and_metrics(tmp_path, fake_training):
    """What the long studies carry between machines: each finished point's sweep_point.json and metrics.jsonl
    (no checkpoints). Copied into a fresh --out, every point is skipped and the report is the same."""
    sweep = S.load_sweep(tune_sweep(tmp_path))
    out, moved = tmp_path / "out", tmp_path / "moved"
    S.run_sweep(sweep, out, say=lambda s: None)
    for p in sweep.tune_points + sweep.points:  # a metrics file, as a real run leaves one
        (out / p.name / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    first = write_report(sweep, out).read_text()
    for f in out.glob("*/*"):
        if f.name in (S.POINT_FILE, "metrics.jsonl"):
            (moved / f.parent.name).mkdir(parents=True, exist_ok=True)
            (moved / f.parent.name / f.name).write_bytes(f.read_bytes())
    ran = len(fake_training)
    said = []
    S.run_sweep(sweep, moved, say=said.append)
    assert len(fake_training) == ran and all("finished, skipped" in s for s in said)
    assert write_report(sweep, moved).read_text() == first


def test_a_report_rebuilds_from_its_row_files_alone(tmp_path, fake_training):
    """A study's committed results may keep summary.jsonl and tuning.jsonl without the run directories:
    `--report` there reproduces every table, keeps both files' rows and the curve plots drawn from the runs;
    a row the sweep file no longer gives (its config changed) is moved to superseded.jsonl, not reported."""
    from jaxformer.cli import main

    path = write_sweep(tmp_path, {"axes": {"model.position": ["rope", "alibi"]}, "seeds": [0, 1, 2],
                                  "tune": {"keys": {"optimizer.lr": [1e-3, 3e-3, 1e-2]}},
                                  "report": {"plots": ["loss_curves", "final_metric"],
                                             "baseline": {"model.position": "rope"}}})
    sweep = S.load_sweep(path)
    out, rows_only = tmp_path / "out", tmp_path / "rows_only"
    S.run_sweep(sweep, out, say=lambda s: None)
    for p in sweep.tune_points + sweep.points:
        (out / p.name / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0 + p.seed}) + "\n")
    first = write_report(sweep, out).read_text()
    rows_only.mkdir()
    for name in ("summary.jsonl", "tuning.jsonl", "loss_curves.png"):
        (rows_only / name).write_bytes((out / name).read_bytes())
    curves = (out / "loss_curves.png").read_bytes()
    assert main(["sweep", str(path), "--out", str(rows_only), "--report"]) == 0
    for name in ("summary.jsonl", "tuning.jsonl"):
        assert S.read_rows(rows_only / name) == S.read_rows(out / name) and len(S.read_rows(out / name)) == 6
    rebuilt = (rows_only / "report.md").read_text()
    note = "6 of 6 rows come from the row files alone"
    assert note in rebuilt and note not in first
    line = next(x for x in rebuilt.splitlines() if x.startswith(note))
    assert rebuilt.replace(f"\n\n{line}", "") == first  # every table as it was
    assert (rows_only / "loss_curves.png").read_bytes() == curves and (rows_only / "final_metric.png").exists()
    assert not (rows_only / "superseded.jsonl").exists()
    kept = tmp_path / "kept"  # the committed layout: each run's row and metrics under points/
    for p in sweep.tune_points + sweep.points:
        (kept / "points" / p.name).mkdir(parents=True)
        for name in (S.POINT_FILE, "metrics.jsonl"):
            (kept / "points" / p.name / name).write_bytes((out / p.name / name).read_bytes())
    assert write_report(sweep, kept).read_text() == first
    assert (kept / "loss_curves.png").read_bytes() == curves
    # an old row under a name whose run directory now holds another run is moved aside, not overwritten
    old = S.read_rows(out / "summary.jsonl")
    old[0]["tuned"] = {"optimizer.lr": 0.5}
    (out / "summary.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    write_report(sweep, out)
    assert S.read_rows(out / "superseded.jsonl") == [old[0]]
    assert S.read_rows(out / "summary.jsonl")[0]["tuned"] != {"optimizer.lr": 0.5}

    path.with_name("untuned.yaml").write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "tune": None}))
    untuned = S.load_sweep(path.with_name("untuned.yaml"))
    base_lr = untuned.points[0].config.optimizer.lr  # without tune: the final rows' tuned rates are not its points'
    at_base = [r["tuned"]["optimizer.lr"] == base_lr for r in S.read_rows(rows_only / "summary.jsonl")]
    assert any(at_base) and not all(at_base)
    assert [S.read_point(untuned, rows_only, p) is not None for p in untuned.points] == at_base

    stale = S.read_rows(rows_only / "summary.jsonl")
    stale[4]["config"]["steps"] += 1  # as if the sweep file had changed since that row was run
    (rows_only / "summary.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stale))
    assert main(["sweep", str(path), "--out", str(rows_only), "--report"]) == 0
    kept = S.read_rows(rows_only / "summary.jsonl")
    assert [r["name"] for r in kept] == [r["name"] for r in stale if r is not stale[4]]
    assert S.read_rows(rows_only / "superseded.jsonl") == [stale[4]]
    assert "5 of 6 points finished" in (rows_only / "report.md").read_text()
    assert "moved to `superseded.jsonl`" in (rows_only / "report.md").read_text()


def test_a_run_directory_of_an_older_design_is_not_reported(tmp_path, fake_training):
    """A run directory whose saved config is not its point's under the sweep file as it is now (the file changed
    after the run) is left out of the report, as a stale recorded row is; the runner still sees it, and refuses
    to go on beside it."""
    path = write_sweep(tmp_path, {"axes": {"model.position": ["rope", "alibi"]}, "seeds": [0, 1],
                                  "tune": {"keys": {"optimizer.lr": [1e-3, 3e-3]}}})
    sweep = S.load_sweep(path)
    out = tmp_path / "out"
    S.run_sweep(sweep, out, say=lambda s: None)
    final = next(p for p in sweep.points if p.seed == 1)
    row_file = out / final.name / S.POINT_FILE
    row = json.loads(row_file.read_text())
    assert S.read_point(sweep, out, final) is not None
    row["config"]["steps"] += 1  # as if the sweep file had said another step count when it ran
    row_file.write_text(json.dumps(row))
    assert S.read_point(sweep, out, final) is None
    assert S.read_point(sweep, out, final, recorded=False) is not None
    write_report(sweep, out)
    assert final.name not in [r["name"] for r in S.read_rows(out / "summary.jsonl")]
    assert len(S.read_rows(out / "summary.jsonl")) == len(sweep.points) - 1
    with pytest.raises(C.ConfigError, match="finished with another config"):
        S.run_sweep(sweep, out, say=lambda s: None)


def test_final_runs_at_a_value_the_tuning_no_longer_chooses_are_not_results(tmp_path, fake_training, monkeypatch):
    """Tuning finished again with another best value (a re-run tuning point): the finished final runs of that
    arm are refused, naming the key, also when the tuning finished in the same invocation; in a report
    rebuilt from the row files alone they are moved to superseded.jsonl."""
    path = tune_sweep(tmp_path)
    sweep = S.load_sweep(path)
    out, rows_only = tmp_path / "out", tmp_path / "rows_only"
    S.run_sweep(sweep, out, say=lambda s: None)
    write_report(sweep, out)
    rows_only.mkdir()
    for name in ("summary.jsonl", "tuning.jsonl"):
        (rows_only / name).write_bytes((out / name).read_bytes())
    monkeypatch.setitem(BEST, "alibi", 1e-3)  # alibi's tuning run at 1e-3, run again, now wins
    stale = S.point_name({"model.position": "alibi"}, 0)
    shutil.rmtree(out / f"tune-{S.point_name({'model.position': 'alibi', 'optimizer.lr': 1e-3}, 0)}")
    with pytest.raises(C.ConfigError, match=rf"point {stale} finished with another config: optimizer.lr "
                                            r"\(saved 0.01, now 0.001\) \(its arm's tuning now chooses another "
                                            r"value: --supersede"):
        S.run_sweep(sweep, out, say=lambda s: None)
    # --supersede: those finals are moved aside and run again at the new choice; the other arm's stay
    rope = {p.name: (out / p.name / S.POINT_FILE).read_bytes() for p in sweep.points
            if p.values == {"model.position": "rope"}}
    S.run_sweep(sweep, out, supersede=True, say=lambda s: None)
    alibi = [p for p in sweep.points if p.values == {"model.position": "alibi"}]
    assert sorted(d.name for d in (out / "superseded_points").iterdir()) == sorted(p.name for p in alibi)
    assert all(json.loads((out / "superseded_points" / p.name / S.POINT_FILE).read_text())["tuned"]
               == {"optimizer.lr": 1e-2} for p in alibi)
    assert all(S.read_point(sweep, out, p)["tuned"] == {"optimizer.lr": 1e-3} for p in alibi)
    assert {name: (out / name / S.POINT_FILE).read_bytes() for name in rope} == rope
    tuning = S.read_rows(rows_only / "tuning.jsonl")
    for r in tuning:
        if r["values"] == {"model.position": "alibi"} and r["tuned"] == {"optimizer.lr": 1e-3}:
            r["val_bpb"] = 0.5
    (rows_only / "tuning.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tuning))
    report = write_report(sweep, rows_only).read_text()
    assert "3 of 6 points finished" in report and "moved to `superseded.jsonl`" in report
    assert sorted(r["name"] for r in S.read_rows(rows_only / "superseded.jsonl")) == [
        S.point_name({"model.position": "alibi"}, seed) for seed in range(3)]
    # the sweep runs only where run directories are (recorded rows are not runs): every point runs again here
    S.run_sweep(sweep, rows_only, say=lambda s: None)
    alibi = [S.read_point(sweep, rows_only, p) for p in sweep.points if p.values == {"model.position": "alibi"}]
    assert len(alibi) == 3 and all(r is not None and r["tuned"] == {"optimizer.lr": 1e-3} for r in alibi)


def test_shards_wait_for_tuning_run_elsewhere_then_finish(tmp_path, fake_training):
    sweep = S.load_sweep(tune_sweep(tmp_path))
    out = tmp_path / "out"
    said = []
    S.run_sweep(sweep, out, shard=(1, 2), say=said.append)  # half the tuning points: every arm incomplete
    assert any("not all finished" in s for s in said) and "wait for tuning points" in said[-1]
    S.run_sweep(sweep, out, shard=(0, 2), say=lambda s: None)
    S.run_sweep(sweep, out, shard=(1, 2), say=lambda s: None)
    assert all(S.read_point(sweep, out, p) is not None for p in sweep.points + sweep.tune_points)
    copies = {p.name for p in sweep.points if S.read_point(sweep, out, p).get("copy_of")}
    assert len(copies) == 2  # seed 0 of each arm: its tuning run at the chosen rate
    assert sorted(fake_training) == sorted(p.name for p in sweep.points + sweep.tune_points if p.name not in copies)


def test_choice_modes_divergence_and_unfinished(tmp_path):
    sweep = S.load_sweep(tune_sweep(tmp_path))
    out = tmp_path / "out"
    arm = {"model.position": "rope"}

    def write(lr, value, diverged=False):
        p = next(p for p in sweep.tune_points if p.values == arm and p.tuned["optimizer.lr"] == lr)
        (out / p.name).mkdir(parents=True, exist_ok=True)
        (out / p.name / S.POINT_FILE).write_text(json.dumps({"val_bpb": value, "diverged": diverged}))

    write(1e-3, 2.0)
    write(3e-3, 1.5)
    assert S.chosen_values(sweep, out, arm) is None  # 1e-2 unfinished
    write(1e-2, 1.0, diverged=True)  # the lowest number, but diverged: never chosen
    assert S.chosen_values(sweep, out, arm) == {"optimizer.lr": 3e-3}
    maxed = S.load_sweep(tune_sweep(tmp_path / "max", mode="max"))
    assert S.chosen_values(maxed, out, arm) == {"optimizer.lr": 1e-3}
    for lr in (1e-3, 3e-3):
        write(lr, float("nan"))
    with pytest.raises(ValueError, match="every tuning run of arm .* diverged"):
        S.chosen_values(sweep, out, arm)


def test_report_shows_tuning_choice_curves_and_paired_differences(tmp_path, fake_training):
    sweep = S.load_sweep(tune_sweep(tmp_path))
    out = tmp_path / "out"
    S.run_sweep(sweep, out, say=lambda s: None)
    report = write_report(sweep, out).read_text()
    assert (out / "tuning_curves.png").stat().st_size > 1000
    assert len((out / "tuning.jsonl").read_text().splitlines()) == 6
    assert "| rope | lr=0.003 |" in report and "| alibi | lr=0.01 |" in report
    assert "**1.0000** |" in report  # rope's tuning row: 1.0 at its best rate (seed 0), in bold
    # alibi's best rate, 1e-2, is the largest tried: marked, and the note says which key to widen
    assert "**1.0500** (edge) |" in report and "**1.0000** (edge)" not in report
    assert "smallest or largest value tried of `optimizer.lr`" in report
    # the difference alibi - rope at their tuned rates is exactly 0.05 on every seed: a zero-width interval
    (values, ref, d), = differences(sweep, [json.loads(x) for x in (out / "summary.jsonl").read_text().splitlines()],
                                    "val_bpb")
    assert values == {"model.position": "alibi"} and ref == {"model.position": "rope"}
    assert d.n == 3 and d.mean == pytest.approx(0.05) and d.hi - d.lo == pytest.approx(0.0, abs=1e-9)
    assert "| alibi | position=rope | 3 | +0.0500 [+0.0500, +0.0500] |" in report


def test_a_chosen_value_at_either_end_of_a_numeric_grid_is_an_edge():
    from jaxformer.study.report import edge_keys

    keys = {"optimizer.lr": [3e-3, 1e-3, 1e-2], "model.norm": ["rms", "layer"], "optimizer.b2": [0.95]}
    assert edge_keys(keys, {"optimizer.lr": 1e-2}) == ["optimizer.lr"]  # the largest, though not listed last
    assert edge_keys(keys, {"optimizer.lr": 1e-3}) == ["optimizer.lr"]
    assert edge_keys(keys, {"optimizer.lr": 3e-3}) == []  # listed first, but inside the range
    assert edge_keys(keys, {"model.norm": "rms", "optimizer.b2": 0.95}) == []  # no order; one value


def test_trained_column_counts_finished_runs_below_the_threshold(tmp_path):
    """``report.trained_below``: a run stuck at byte frequencies is finite (not diverged) yet has not trained;
    the column counts the seeds that did not diverge and ended below the threshold."""
    sweep = S.load_sweep(write_sweep(tmp_path, {"axes": {"model.position": ["rope", "alibi"]}, "seeds": [0, 1, 2],
                                                "report": {"trained_below": 4.5}}))
    metric = {("rope", 0): 3.0, ("rope", 1): 4.4, ("rope", 2): 4.6, ("alibi", 0): 3.1, ("alibi", 1): 4.7,
              ("alibi", 2): 3.2}
    rows = [{"name": p.name, "values": p.values, "seed": p.seed, "params": 1, "loss": 1.0, "tokens_per_s": 1.0,
             "wall_s": 1.0, "val_bpb": metric[p.values["model.position"], p.seed],
             "diverged": (p.values["model.position"], p.seed) == ("alibi", 2)} for p in sweep.points]
    text = report_markdown(sweep, rows, [])
    assert "| trained (val_bpb < 4.5) |" in text.splitlines()[4]
    table = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| rope")
             or line.startswith("| alibi")}
    assert table["rope"].endswith("| 0 of 3 | 2 of 3 |")  # 3.0 and 4.4 below 4.5; 4.6 not
    assert table["alibi"].endswith("| 1 of 3 | 1 of 3 |")  # 3.2 below but diverged; 4.7 above
    plain = S.load_sweep(write_sweep(tmp_path / "plain", {"axes": {"model.position": ["rope", "alibi"]},
                                                          "seeds": [0, 1, 2]}))
    assert "trained (" not in report_markdown(plain, rows, [])


def test_differences_pair_by_seed_and_leave_out_diverged(tmp_path):
    sweep = S.load_sweep(write_sweep(tmp_path, {"axes": {"model.position": ["rope", "alibi"],
                                                         "model.norm": ["layernorm", "rmsnorm"]},
                                                "seeds": [0, 1, 2, 3],
                                                "report": {"baseline": {"model.position": "rope"}}}))
    rng = np.random.default_rng(1)
    rows = []
    for p in sweep.points:
        rows.append({"name": p.name, "values": p.values, "seed": p.seed, "val_bpb": float(rng.normal(2, 0.1)),
                     "diverged": p.seed == 3 and p.values["model.position"] == "alibi"})
    diffs = differences(sweep, rows, "val_bpb")
    assert [(v["model.position"], v["model.norm"], r["model.norm"]) for v, r, _ in diffs] == [
        ("alibi", "layernorm", "layernorm"), ("alibi", "rmsnorm", "rmsnorm")]  # paired within the same norm
    for values, ref, d in diffs:
        arm = {r["seed"]: r["val_bpb"] for r in rows if r["values"] == values and not r["diverged"]}
        base = {r["seed"]: r["val_bpb"] for r in rows if r["values"] == ref}
        want = np.array([arm[s] - base[s] for s in (0, 1, 2)])
        assert d.seeds == (0, 1, 2) and d.mean == pytest.approx(want.mean())
        assert d == paired_difference(arm, base)
    text = report_markdown(sweep, rows, [])
    assert "paired by seed" in text and "95% interval" in text


def test_smoothing_is_the_adjusted_exponential_moving_average():
    from jaxformer.study.plots import smooth

    rng = np.random.default_rng(0)
    x = rng.normal(size=37)
    a = 2.0 / (10 + 1)
    want = [sum((1 - a) ** (t - i) * x[i] for i in range(t + 1)) / sum((1 - a) ** (t - i) for i in range(t + 1))
            for t in range(len(x))]  # the definition, in float64, term by term
    np.testing.assert_allclose(smooth(list(x), 10), want, rtol=1e-12)
    assert smooth([3.0, 3.0, 3.0]) == [3.0, 3.0, 3.0]


def test_validation_curves_are_drawn_from_the_periodic_evaluations(tmp_path, monkeypatch):
    from jaxformer.study import plots as P
    from jaxformer.study.rows import gather

    sweep = S.load_sweep(write_sweep(tmp_path, {"axes": {"model.position": ["rope", "alibi"]}, "seeds": [0, 1],
                                                "report": {"plots": ["loss_curves", "val_curves"]}}))
    out = tmp_path / "out"
    for p in sweep.points:
        d = out / p.name
        d.mkdir(parents=True)
        lines = [{"step": s, "loss": 5.0 - s / 10} for s in range(1, 11)]
        lines += [{"step": s, "val_loss": 4.0 - s / 20, "val_bpb": 3.0 - s / 20 + 0.01 * p.seed, "final": False}
                  for s in (5, 10)] + [{"step": 10, "val_bpb": 2.4, "final": True}]
        (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        (d / S.POINT_FILE).write_text(json.dumps({"name": p.name, "values": p.values, "seed": p.seed, "params": 1,
                                                  "diverged": False, "val_bpb": 2.4, "quick": False}))
    drawn = []
    real = P.PLOT_FUNCTIONS["val_curves"]

    def spy(plt, sweep_, out_, rows_):
        fig = real(plt, sweep_, out_, rows_)
        drawn.append([(line.get_label(), list(line.get_ydata())) for line in fig.axes[0].get_lines()])
        return fig

    monkeypatch.setitem(P.PLOT_FUNCTIONS, "val_curves", spy)
    report = write_report(sweep, out).read_text()
    assert "val_curves.png" in report and (out / "val_curves.png").stat().st_size > 1000
    lines = dict((label, ys) for label, ys in drawn[0] if not label.startswith("_"))
    # mean over the two seeds at steps 5 and 10 (seed offsets 0 and 0.01)
    np.testing.assert_allclose(lines["position=rope"], [2.755, 2.505], rtol=1e-12)
    for p in sweep.points:  # without periodic or final evaluations there is nothing to draw
        (out / p.name / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    import matplotlib.pyplot as plt
    assert real(plt, sweep, out, gather(sweep, out)) is None


def test_report_panels_split_the_plots_one_panel_per_value(tmp_path):
    """Issue 25's readable plots: ``report.panels`` gives each value of a key its own panel, whose lines are the
    other keys' settings (one colour each, the same in every panel: a line's colour names its arm), with the
    panel's own rows' means, and one legend below the panels listing each line once; the final-metric plot
    keeps its x key on its axis."""
    import matplotlib.colors as mcolors
    import matplotlib.pyplot as plt

    from jaxformer.study import plots as P

    spec = {"axes": {"model.position": ["rope", "alibi"], "model.n_layers": [1, 2]}, "seeds": [0, 1],
            "tune": {"keys": {"optimizer.lr": [1.0e-3, 3.0e-3]}},
            "report": {"plots": ["loss_curves", "val_curves", "final_metric"], "panels": ["model.n_layers"]}}
    sweep = S.load_sweep(write_sweep(tmp_path, spec))
    out = tmp_path / "out"

    def bpb(values, seed):  # a different value per arm and seed
        return 2.0 + (values["model.position"] == "alibi") + values["model.n_layers"] / 10 + seed / 100

    for p in sweep.points + sweep.tune_points:
        d = out / p.name
        d.mkdir(parents=True)
        v = bpb(p.values, p.seed) + (0.5 if p.tuned and p.tuned["optimizer.lr"] == 3.0e-3 else 0.0)
        lines = [{"step": s, "loss": v + 1 - s / 100} for s in range(1, 11)]
        lines += [{"step": 5, "val_bpb": v + 0.5, "final": False}, {"step": 10, "val_bpb": v, "final": True}]
        (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        (d / S.POINT_FILE).write_text(json.dumps({"name": p.name, "values": p.values, "seed": p.seed, "params": 1,
                                                  "diverged": False, "val_bpb": v, "quick": False,
                                                  "tuned": p.tuned}))
    from jaxformer.study.rows import gather
    rows = gather(sweep, out)
    assert len(rows) == 8
    fig = P.PLOT_FUNCTIONS["final_metric"](plt, sweep, out, rows)  # x: the position, one point each per panel
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["n_layers=1", "n_layers=2"]
    for ax, layers in zip(axes, (1, 2)):  # each panel's means are its own rows' (2 seeds: + 0.005)
        assert [t.get_text() for t in ax.get_xticklabels()] == ["rope", "alibi"]
        (line,) = [ln for ln in ax.get_lines() if ln.get_marker() == "o"]
        np.testing.assert_allclose(np.asarray(line.get_ydata(), float), [2.005 + layers / 10, 3.005 + layers / 10],
                                   rtol=1e-12)
        (dots,) = [ln for ln in ax.get_lines() if ln.get_marker() == "."]  # each seed's own value
        want = sorted(r["val_bpb"] for r in rows if r["values"]["model.n_layers"] == layers)
        np.testing.assert_allclose(sorted(np.asarray(dots.get_ydata(), float)), want, rtol=1e-12)
    plt.close(fig)
    for name in ("loss_curves", "val_curves", "tuning_curves"):
        fig = P.PLOT_FUNCTIONS[name](plt, sweep, out, rows)
        axes = [ax for ax in fig.axes if ax.get_visible()]
        assert [ax.get_title() for ax in axes] == ["n_layers=1", "n_layers=2"], name
        colours = []
        for ax in axes:
            lines = {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}
            assert sorted(lines) == ["position=alibi", "position=rope"], (name, sorted(lines))
            colours.append({k: mcolors.to_hex(ln.get_color()) for k, ln in lines.items()})
        assert colours[0] == colours[1] and len(set(colours[0].values())) == 2, name
        (legend,) = fig.legends
        assert sorted(t.get_text() for t in legend.get_texts()) == ["position=alibi", "position=rope"], name
        plt.close(fig)
    # the final-metric plot's x key is its axis, not a panel: one plot, a line per position
    spec_x = {**spec, "report": {**spec["report"], "x": "model.n_layers"}}
    sweep_x = S.load_sweep(write_sweep(tmp_path / "x", spec_x))
    fig = P.PLOT_FUNCTIONS["final_metric"](plt, sweep_x, out, rows)
    (ax,) = fig.axes
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == ["position=alibi", "position=rope"]
    plt.close(fig)
    for bad, words in (({"panels": ["model.d_model"]}, "not varied keys"),
                       ({"panels": ["model.position", "model.n_layers"]}, "nothing is left")):
        with pytest.raises(ValueError, match=words):
            S.load_sweep(write_sweep(tmp_path, {**spec, "report": {"plots": ["final_metric"], **bad}}))


@pytest.mark.parametrize("axis, values, joined", [("model.position", ["rope", "alibi", "none"], False),
                                                  ("model.n_layers", [1, 2, 4], True)])
def test_final_metric_and_probe_points_are_joined_only_on_a_numeric_axis(tmp_path, axis, values, joined):
    """Issue 25's readable plots: a categorical axis (activations, positions) shows points, not a line through
    them; a numeric one (depth) keeps its line, but only between adjacent values of its grid. The plotted
    means are the rows' own."""
    import matplotlib.pyplot as plt

    from jaxformer.study import plots as P

    sweep = S.load_sweep(write_sweep(tmp_path, {"axes": {axis: values}, "seeds": [0], "probes": ["mlp"],
                                                "report": {"plots": ["final_metric", "probes"]}}))
    rows = [{"name": p.name, "values": p.values, "seed": p.seed, "params": 1, "diverged": False,
             "val_bpb": 2.0 + i / 10, "quick": False,
             "probes": {"init": {"dead_fraction": 0.0}, "final": {"dead_fraction": i / 1000}}}
            for i, p in enumerate(sweep.points)]
    for name in ("final_metric", "probes"):
        fig = P.PLOT_FUNCTIONS[name](plt, sweep, tmp_path, rows)
        lines = [ln for ln in fig.axes[0].get_lines() if ln.get_marker() == "o"]  # not the error bars' caps
        assert lines, name
        assert all((ln.get_linestyle() != "None") == joined for ln in lines), (name, [ln.get_linestyle()
                                                                                      for ln in lines])
        if name == "final_metric":
            np.testing.assert_allclose(np.asarray(lines[0].get_ydata(), float), [2.0, 2.1, 2.2], rtol=1e-12)
        plt.close(fig)
        # a series without the middle value: its two points are not joined across the value it skipped
        fig = P.PLOT_FUNCTIONS[name](plt, sweep, tmp_path, [rows[0], rows[2]])
        lines = [ln for ln in fig.axes[0].get_lines() if ln.get_marker() == "o"]
        assert lines and all(ln.get_linestyle() == "None" for ln in lines), name
        plt.close(fig)


@pytest.mark.parametrize("values, slanted", [(["rope", "alibi", "none"], False),
                                             ([{"max_tokens": 1024}, {"max_tokens": 2048, "every": 4},
                                               {"max_tokens": 4096, "every": 8, "stride": 16}], True)])
def test_long_categorical_tick_labels_are_slanted_and_stay_in_the_figure(tmp_path, values, slanted):
    """Study 11's final_metric plot printed "rank16-alpha32" over "rank16-alpha32-targetsw_qxw_kxw_vxw_o": a
    categorical axis whose labels are long slants them (short ones stay level), and as drawn no two labels'
    boxes overlap and each lies inside the figure."""
    import matplotlib.pyplot as plt

    from jaxformer.study import plots as P

    axis = "model.position" if not slanted else "eval"  # values as long as study 11's LoRA configs
    sweep = S.load_sweep(write_sweep(tmp_path, {"axes": {axis: values}, "seeds": [0],
                                                "report": {"plots": ["final_metric"]}}))
    rows = [{"name": p.name, "values": p.values, "seed": p.seed, "params": 1, "diverged": False,
             "val_bpb": 2.0 + i / 10, "quick": False} for i, p in enumerate(sweep.points)]
    fig = P.PLOT_FUNCTIONS["final_metric"](plt, sweep, tmp_path, rows)
    fig.canvas.draw()
    labels = [t for t in fig.axes[0].get_xticklabels() if t.get_text()]
    assert len(labels) == 3
    assert all((t.get_rotation() != 0) == slanted for t in labels)
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in labels]
    figure_box = fig.bbox
    for b in boxes:
        assert b.x0 >= figure_box.x0 - 1 and b.y0 >= figure_box.y0 - 1 and b.x1 <= figure_box.x1 + 1, b
    if not slanted:  # level labels: their boxes are the text's own
        assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:]))
    else:  # slanted: the baselines of neighbours are parallel lines far enough apart for the text's height
        import math

        height = max(t.get_fontsize() for t in labels) * fig.dpi / 72
        xs = [t.get_unitless_position()[0] for t in labels]
        gap = (fig.axes[0].transData.transform((xs[1], 0))[0] - fig.axes[0].transData.transform((xs[0], 0))[0])
        assert gap * math.sin(math.radians(labels[0].get_rotation())) > 1.5 * height
        # every panel of a figure slants its own labels: the figure grows once, not once per call
        height_inches = fig.get_figheight()
        P._category_ticks(fig.axes[0], xs, [t.get_text() for t in labels])
        assert fig.get_figheight() == height_inches
    plt.close(fig)


def test_a_blown_up_tuning_point_is_marked_off_the_scale_not_drawn_to_it(tmp_path):
    """Study 11's tuning plot ran its y axis to 3.08 bits/byte for the one learning rate that blew up, which
    flattened the 0.97-1.05 differences the tuning chose from: a point far above the rest (further above the
    best than 6x the median's distance) is left off the y range and marked at the top edge with its value;
    the rest of the points stay inside."""
    import matplotlib.pyplot as plt

    from jaxformer.study import plots as P
    from jaxformer.study.rows import gather

    lrs = [1.0e-4, 1.0e-3, 1.0e-2, 1.0e-1]
    spec = {"axes": {"model.position": ["rope", "alibi"]}, "seeds": [0], "tune": {"keys": {"optimizer.lr": lrs}},
            "report": {"plots": ["final_metric"]}}
    sweep = S.load_sweep(write_sweep(tmp_path, spec))
    out = tmp_path / "out"
    metric = {"rope": [1.00, 0.97, 0.99, 3.08], "alibi": [1.02, 0.98, 1.01, 1.05]}

    def write_points():  # every point's run directory, its val_bpb from ``metric``
        for p in sweep.points + sweep.tune_points:
            d = out / p.name
            d.mkdir(parents=True, exist_ok=True)
            v = metric[p.values["model.position"]][lrs.index(p.tuned["optimizer.lr"])] if p.tuned else 1.0
            (d / "metrics.jsonl").write_text(json.dumps({"step": 10, "val_bpb": v, "final": True}) + "\n")
            (d / S.POINT_FILE).write_text(json.dumps({"name": p.name, "values": p.values, "seed": p.seed,
                                                      "params": 1, "diverged": False, "val_bpb": v,
                                                      "quick": False, "tuned": p.tuned}))

    write_points()
    fig = P.PLOT_FUNCTIONS["tuning_curves"](plt, sweep, out, gather(sweep, out))
    ax = fig.axes[0]
    low, top = ax.get_ylim()
    assert 1.05 < top < 1.2 and low < 0.97, (low, top)
    marks = [ln for ln in ax.get_lines() if ln.get_marker() == "^"]
    assert len(marks) == 1 and float(marks[0].get_xdata()[0]) == 1.0e-1 and float(marks[0].get_ydata()[0]) == top
    assert [t.get_text() for t in ax.texts] == ["3.08"]
    plt.close(fig)
    # nothing far above the rest: the axis holds every point, no marks
    metric["rope"][3] = 1.03
    write_points()
    fig = P.PLOT_FUNCTIONS["tuning_curves"](plt, sweep, out, gather(sweep, out))
    assert not [ln for ln in fig.axes[0].get_lines() if ln.get_marker() == "^"] and not fig.axes[0].texts
    assert fig.axes[0].get_ylim()[1] >= 1.05
    plt.close(fig)


def test_dead_units_are_reported_for_relu_ffns_only(tmp_path):
    """Issue 25: a unit that is never positive is dead only under ReLU (zero gradient below 0); with GeLU or a
    gated FFN it still learns, so the report's table and the probe plot show dead_fraction for ReLU arms alone
    (the raw rows keep the count), and drop the column when no arm is ReLU."""
    import matplotlib.pyplot as plt

    from jaxformer.study import plots as P

    sweep = S.load_sweep(write_sweep(tmp_path, {"axes": {"model.activation": ["relu", "gelu", "swiglu"]},
                                                "seeds": [0], "probes": ["mlp"], "report": {"plots": ["probes"]}}))
    rows = [{"name": p.name, "values": p.values, "seed": p.seed, "params": 1, "diverged": False, "val_bpb": 2.0,
             "quick": False, "config": C.to_dict(p.config),
             "probes": {"init": {"dead_fraction": 0.25 + i}, "final": {"dead_fraction": 0.5 + i}}}
            for i, p in enumerate(sweep.points)]
    table = report_markdown(sweep, rows, [])
    assert "| relu | 0.25 → 0.5 |" in table
    assert "| gelu | n/a → n/a |" in table and "| swiglu | n/a → n/a |" in table
    fig = P.PLOT_FUNCTIONS["probes"](plt, sweep, tmp_path, rows)
    plotted = sorted(float(y) for ln in fig.axes[0].get_lines() for y in ln.get_ydata())
    assert plotted == [0.25, 0.5]
    plt.close(fig)
    assert "dead_fraction" not in report_markdown(sweep, rows[1:], [])
