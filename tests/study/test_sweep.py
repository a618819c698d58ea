"""``jaxformer sweep``: grid expansion, point names, shards, skip-finished, resume after a kill, divergence
recorded, bad sweep files named by file and key; ``jaxformer eval --seq-len`` against the run's own
evaluation; and every study file under ``experiments/studies/`` parses, expands and runs one point."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxformer.cli import main
from jaxformer.model.config import get_key
from jaxformer.train import config as C
from jaxformer.study.sweep import (POINT_FILE, load_sweep, parse_shard, point_name, quick_config, run_sweep,
                                   shard_points)
from tests.study.checkpoints import needs_checkpoint
from tests.train.helpers import make_corpus, tiny_raw, write_config

REPO = Path(__file__).resolve().parents[2]
STUDIES = sorted((REPO / "experiments" / "studies").glob("*.yaml"))


def write_sweep(tmp: Path, spec: dict, base: dict | None = None) -> Path:
    """``tmp/base.yaml`` (a tiny experiment) and ``tmp/sweep.yaml`` naming it relatively."""
    if base is None:
        base = tiny_raw(make_corpus(tmp / "corpus"), eval={"at_end": True, "max_tokens": 128})
    write_config(tmp / "base.yaml", base)
    path = tmp / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": "base.yaml", **spec}, sort_keys=False))
    return path


# -- expansion and names ------------------------------------------------------------------------

def test_a_sectioned_override_merges_with_a_flat_base(tmp_path):
    """The base file written with flat keys, the sweep's override in sections: the section merges field by
    field (the base's n_kv_heads stays), whatever the order of the keys."""
    base = tiny_raw(make_corpus(tmp_path / "corpus"))
    base["model"] = {**base["model"], "n_heads": 4, "n_kv_heads": 4}
    for overrides in ({"model": {"attention": {"n_heads": 8}}}, {"model": {"n_layers": 1, "attention": {"n_heads": 8}}}):
        path = write_sweep(tmp_path, {"overrides": overrides, "axes": {"model.d_model": [64]}}, base=base)
        m = load_sweep(path).points[0].config.model
        assert (m.attention.n_heads, m.attention.n_kv_heads) == (8, 4), overrides


def test_grid_is_the_product_of_axes_zip_groups_and_seeds(tmp_path):
    path = write_sweep(tmp_path, {
        "overrides": {"steps": 7, "model.n_layers": 1, "model.n_kv_heads": 1, "optimizer": {"lr": 0.01}},
        "axes": {"model.position": ["rope", "alibi"], "model.norm": ["layernorm", "rmsnorm"]},
        "zip": [{"model.n_heads": [1, 4], "model.head_dim": [16, 8]}],
        "seeds": [3, 5]})
    sweep = load_sweep(path)
    assert len(sweep.points) == 2 * 2 * 2 * 2
    names = [p.name for p in sweep.points]
    assert len(set(names)) == len(names)
    assert names[0] == "position-rope_norm-layernorm_n_heads-1_head_dim-16_seed-3"
    for p in sweep.points:
        m = p.config.model
        # flat axis keys of before the sections land in their sections; the point names keep them
        assert (m.positions.kind, m.norm.kind, m.attention.n_heads, m.attention.head_dim) == tuple(
            p.values[k] for k in sweep.spec.varied)
        assert tuple(get_key(m, k.removeprefix("model.")) for k in sweep.spec.varied) == tuple(
            p.values[k] for k in sweep.spec.varied)
        assert (m.attention.n_heads, m.attention.head_dim) in ((1, 16), (4, 8))  # zipped, never crossed
        assert p.config.seed == p.seed and p.config.steps == 7 and m.n_layers == 1
        assert p.config.optimizer.lr == 0.01 and p.config.optimizer.b2 == 0.95  # nested override merges
    assert {p.seed for p in sweep.points} == {3, 5}


def test_point_names_use_the_full_key_when_two_axes_share_a_last_part():
    assert point_name({"model.n_layers": 2, "optimizer.lr": 0.001}, 0) == "n_layers-2_lr-0.001_seed-0"
    assert point_name({"a.x": None, "b.x": [64, 0]}, 1) == "a_x-none_b_x-64x0_seed-1"
    assert point_name({}, 2) == "seed-2"


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 30), shards=st.integers(1, 8))
def test_shards_partition_the_points_exactly(n, shards):
    points = list(range(n))
    parts = [shard_points(points, (i, shards)) for i in range(shards)]
    assert sorted(x for part in parts for x in part) == points  # every point once, none twice
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.parametrize("text", ["2/2", "1", "-1/3", "a/b", "3/0"])
def test_bad_shard_is_refused(text):
    with pytest.raises(ValueError, match="--shard"):
        parse_shard(text)


@pytest.mark.parametrize("spec, match", [
    ({"axes": {"model.position": ["rope"]}, "sedes": [0]}, r"sweep\.yaml: sedes: unknown key; did you mean seeds\?"),
    ({"axes": {"model.position": []}}, r"sweep\.yaml: axes: .*axis 'model.position' has no values"),
    ({"zip": [{"model.n_heads": [1, 2], "model.head_dim": [8]}]}, r"sweep\.yaml: zip: .*one common"),
    ({"axes": {"model.norm": ["rmsnorm"]}, "report": {"x": "model.position"}}, r"report.x='model.position'"),
    ({"axes": {"model.position": ["rope", "spiral"]}},
     r"sweep\.yaml \(point position-spiral_seed-0\): model.positions.kind: Input should be"),
    ({"axes": {"model.n_layerz": [1]}}, r"sweep\.yaml \(point n_layerz-1_seed-0\): model.n_layerz: unknown key"),
    ({"eval_lengths": [1, 64]}, r"sweep\.yaml: eval_lengths: .*>= 2"),
    ({"axes": {"seed": [1, 2]}}, r"`seeds:`"),
    # a metric no summary row has: n/a everywhere, or with tune: the whole grid trained before the error
    ({"axes": {"model.position": ["rope"]}, "report": {"metric": "val_bpbb"}},
     r"sweep\.yaml: report\.metric: Input should be 'val_bpb', 'val_loss', 'loss', 'tokens_per_s' or 'wall_s'"),
    ({"axes": {"model.position": ["rope"]}, "tune": {"keys": {"optimizer.lr": [1e-3]}, "metric": "val_bpbb"}},
     r"sweep\.yaml: tune\.metric: Input should be 'val_bpb'"),
    # a baseline no arm is: every paired difference empty
    ({"axes": {"model.position": ["rope", "alibi"]}, "report": {"baseline": {"model.position": "ropee"}}},
     r"sweep\.yaml: report\.baseline model\.position='ropee' is not one of its values \['rope', 'alibi'\]"),
    ({"zip": [{"model.n_heads": [1, 2], "model.head_dim": [8, 16]}], "report": {"baseline": {"model.n_heads": 2,
                                                                                          "model.head_dim": 8}}},
     r"report\.baseline \{'model\.n_heads': 2, 'model\.head_dim': 8\} gives no arm of the zip group"),
])
def test_bad_sweep_files_name_file_and_key(tmp_path, spec, match):
    path = write_sweep(tmp_path, spec, base={"seq_len": 64, "model": {"preset": "llama_tiny"}})
    with pytest.raises(C.ConfigError, match=match):
        load_sweep(path)


def test_a_key_given_twice_in_a_sweep_or_its_base_is_refused(tmp_path):
    (tmp_path / "base.yaml").write_text("seq_len: 64\nmodel: {preset: llama_tiny}\nseq_len: 32\n")
    path = tmp_path / "s.yaml"
    path.write_text("base: base.yaml\naxes: {model.n_layers: [1]}\n")
    with pytest.raises(C.ConfigError, match=r"s\.yaml: base: .*base\.yaml: not valid YAML: key 'seq_len' on line 3 "
                                            r"given twice \(first on line 1\)"):
        load_sweep(path)
    path.write_text("base: base.yaml\naxes: {model.n_layers: [1]}\naxes: {model.n_layers: [2]}\n")
    with pytest.raises(C.ConfigError, match=r"s\.yaml: not valid YAML: key 'axes' on line 3 given twice"):
        load_sweep(path)


def test_length_plots_leave_out_diverged_seeds_and_the_table_plot_draws_the_models_layout(tmp_path):
    """The evaluation-length plot averages the seeds the report's length table averages (not the diverged ones:
    a seed that diverged but stayed finite is still evaluated at every length); the sinusoidal table is the
    model's own layout ("halves" here: tensor2tensor's, not the default interleaved one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jaxformer.ops.positional import sinusoidal_positions
    from jaxformer.study import plots

    base = {"seq_len": 16, "model": {"preset": "llama_tiny", "position": "sinusoidal", "sinusoidal_layout": "halves",
                                     "max_seq_len": 64}}
    sweep = load_sweep(write_sweep(tmp_path, {"axes": {"model.n_layers": [1]}, "seeds": [0, 1],
                                              "eval_lengths": [16, 32]}, base=base))
    rows = [{"name": p.name, "values": p.values, "seed": p.seed, "diverged": p.seed == 1,
             "eval_lengths": {"16": {"val_bpb": 1.0 + 8 * p.seed}, "32": {"val_bpb": 2.0 + 8 * p.seed}}}
            for p in sweep.points]
    fig = plots._plot_metric_vs_eval_length(plt, sweep, tmp_path, rows)
    drawn = [list(ln.get_ydata()) for ln in fig.axes[0].get_lines() if list(ln.get_xdata()) == [16, 32]]
    assert drawn and all(y == [1.0, 2.0] for y in drawn), drawn  # the line and its caps: seed 1's 9 and 10 left out
    plt.close(fig)
    fig = plots._plot_sinusoidal_table(plt, sweep, tmp_path, rows)
    drawn = np.asarray(fig.axes[0].images[0].get_array())
    np.testing.assert_allclose(drawn, sinusoidal_positions(np.arange(drawn.shape[0]), drawn.shape[1], layout="halves"))
    plt.close(fig)


def test_a_missing_base_names_the_sweep_file(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("base: nowhere.yaml\n")
    with pytest.raises(C.ConfigError, match=r"s\.yaml: base: cannot read .*nowhere\.yaml"):
        load_sweep(path)


# -- running ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """A two-point sweep run to the end through the CLI: (sweep path, out dir)."""
    tmp = tmp_path_factory.mktemp("sweep")
    path = write_sweep(tmp, {"overrides": {"steps": 4}, "axes": {"model.position": ["rope", "learned"]},
                             "eval_lengths": [16, 64], "eval_max_tokens": 256, "probes": ["attention", "mlp"],
                             "report": {"plots": ["loss_curves", "final_metric", "metric_vs_eval_length",
                                                  "loss_by_position", "probes", "rope_decay"]}})
    out = tmp / "out"
    assert main(["sweep", str(path), "--out", str(out)]) == 0
    return path, out


def test_sweep_writes_run_dirs_summary_report_and_plots(ran):
    path, out = ran
    sweep = load_sweep(path)
    rows = [json.loads(line) for line in (out / "summary.jsonl").read_text().splitlines()]
    assert [r["name"] for r in rows] == [p.name for p in sweep.points]
    for r in rows:
        assert (out / r["name"] / "config.yaml").exists() and (out / r["name"] / "checkpoints").is_dir()
        assert r["step"] == 4 and not r["diverged"] and r["val_bpb"] > 0 and r["tokens_per_s"] > 0
        assert set(r["probes"]) == {"init", "final"} and r["probes"]["init"]["qk_grad_norm"] > 0
        assert 0 <= r["probes"]["final"]["dead_fraction"] < 1 and len(r["probes"]["init"]["grad_norm_layers"]) == 2
    rope, learned = rows
    assert set(learned["eval_lengths"]["64"]) == {"na"}
    assert "max_seq_len=32" in learned["eval_lengths"]["64"]["na"]
    assert rope["eval_lengths"]["64"]["val_tokens"] > 0
    # every length scores the same tokens (the same bytes), so lengths differ only by context
    assert rope["eval_lengths"]["16"]["val_tokens"] == rope["eval_lengths"]["64"]["val_tokens"]
    assert rope["eval_lengths"]["16"]["val_bytes"] == rope["eval_lengths"]["64"]["val_bytes"]
    assert learned["eval_lengths"]["16"]["val_bytes"] == rope["eval_lengths"]["16"]["val_bytes"]
    report = (out / "report.md").read_text()
    assert "| rope |" in report and "n/a" in report
    for plot in ("loss_curves", "final_metric", "metric_vs_eval_length", "loss_by_position", "probes",
                 "rope_decay"):
        assert (out / f"{plot}.png").stat().st_size > 1000


def test_probe_plot_is_log_scaled_only_where_every_value_is_positive(ran, tmp_path):
    """A probe that reads 0 (``order`` of a model without positions: ``positions_order``'s first quick point) is
    drawn on a linear axis, without matplotlib's warning that log scale has nothing positive to show."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jaxformer.study.plots import _plot_probes

    path, out = ran
    rows = [json.loads(line) for line in (out / "summary.jsonl").read_text().splitlines()]
    for r in rows:
        for when in ("init", "final"):
            r["probes"][when]["qk_grad_norm"] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = _plot_probes(plt, load_sweep(path), tmp_path, rows)
    scales = {ax.get_title(): ax.get_yscale() for ax in fig.axes if ax.get_visible()}
    plt.close(fig)
    assert scales["qk_grad_norm"] == "linear" and scales["logit_var"] == "log", scales


def test_a_finished_sweep_is_skipped_point_by_point(ran, capsys):
    path, out = ran
    files = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.suffix != ".png"
             and p.name not in ("summary.jsonl", "report.md")}
    said = []
    run_sweep(load_sweep(path), out, say=said.append)
    assert all("finished, skipped" in s for s in said) and len(said) == 2
    assert {p: p.stat().st_mtime_ns for p in files} == files


def test_a_finished_point_with_another_config_is_refused(ran, tmp_path):
    """Old results are never reported as new ones: a changed sweep file, or --quick into a full run's --out."""
    path, out = ran
    spec = yaml.safe_load(path.read_text())
    spec["overrides"]["steps"] = 5
    changed = path.with_name("changed.yaml")
    changed.write_text(yaml.safe_dump(spec))
    with pytest.raises(C.ConfigError, match=r"point position-rope_seed-0 finished with another config: "
                                            r"steps \(saved 4, now 5\)"):
        run_sweep(load_sweep(changed), out, say=lambda s: None)
    with pytest.raises(C.ConfigError, match="was run without --quick"):
        run_sweep(load_sweep(path), out, quick=True, say=lambda s: None)


# slow, 3.6 s; default-run: `--report` gathering a shard's rows (test_one_point_of_every_study_runs_quick), and
# `--report` rewriting a sweep's row files without duplicates (test_sweep_tune.py's
# test_a_report_rebuilds_from_its_row_files_alone)
@pytest.mark.slow
def test_report_only_gathers_shards(ran, tmp_path):
    path, out = ran
    assert main(["sweep", str(path), "--out", str(out), "--report"]) == 0
    assert len((out / "summary.jsonl").read_text().splitlines()) == 2


def test_a_quick_sweeps_report_says_so_in_its_title_and_on_every_plot(ran, tmp_path):
    """The same points, marked as --quick ran them (2 steps each): the title, the command and every PNG
    (its pixels and its Title metadata) say it is a smoke run; the real sweep's report says nothing of it."""
    from PIL import Image

    from jaxformer.study.report import write_report

    path, out = ran
    quick = tmp_path / "quick"
    shutil.copytree(out, quick)
    sweep = load_sweep(path)
    for p in sweep.points:  # each row as --quick writes it: its point's quick config
        file = quick / p.name / POINT_FILE
        row = json.loads(file.read_text())
        row["quick"], row["config"] = True, C.to_dict(quick_config(p.config))
        file.write_text(json.dumps(row))
    report = write_report(sweep, quick).read_text()
    title, _, command = report.splitlines()[:3]
    assert title == "# Sweep `sweep` — QUICK SMOKE RUN (2 steps per point): not a result"
    assert command.startswith(f"`jaxformer sweep {sweep.path} --quick` · 2 of 2 points finished")
    plots = sorted(p.name for p in quick.glob("*.png"))
    assert len(plots) == 6
    for name in plots:
        marked, plain = Image.open(quick / name), Image.open(out / name)
        assert marked.text.get("Title") == "QUICK SMOKE RUN (2 steps per point): not a result", name
        assert "Title" not in plain.text and marked.size == plain.size
        changed = np.abs(np.asarray(marked, np.int16) - np.asarray(plain, np.int16)).max(-1) > 40
        assert changed.sum() > 2000, name  # the watermark's letters, across the figure
    assert "QUICK" not in (out / "report.md").read_text()


# slow case, ~6 s: a third point (1e-3) that trains after the two that diverged in the same process (not
# default-run any more); a point that trains and is not marked diverged is the module sweep's (`ran`:
# test_sweep_writes_run_dirs_summary_report_and_plots, default)
@pytest.mark.parametrize("lrs", [[1e30, 3.0], pytest.param([1e30, 3.0, 1e-3], marks=pytest.mark.slow)],
                         ids=["nan-blown_up", "nan-blown_up-trains"])
def test_a_diverging_point_is_recorded_and_the_sweep_goes_on(tmp_path, lrs):
    base = tiny_raw(make_corpus(tmp_path / "corpus"), steps=3, eval={"at_end": True, "max_tokens": 64},
                    optimizer={"lr": 1e30, "clip_norm": None, "weight_decay": 0.0})
    path = write_sweep(tmp_path, {"axes": {"optimizer.lr": lrs}}, base=base)
    rows = run_sweep(load_sweep(path), tmp_path / "out", say=lambda s: None)
    assert [r["diverged"] for r in rows] == [True, True, False][:len(lrs)]
    assert rows[0]["diverged_reason"].startswith("non-finite training at step")  # NaN/inf: the run stops
    assert "above the first" in rows[1]["diverged_reason"] and rows[1]["loss"] > 10  # finite, but blown up
    assert json.loads((tmp_path / "out" / rows[0]["name"] / POINT_FILE).read_text())["diverged"]


def test_the_sweep_releases_host_memory_after_every_point(tmp_path, monkeypatch):
    """Each point's compiled programs and freed heap are let go before the next point runs
    (``release_host_memory``; without it a process of SmolLM2-135M LoRA fine-tunes ran out of memory mappings
    and aborted in LLVM at its 12th point). The runs are stand-ins here: the order of runs and releases is what
    is checked."""
    import jaxformer.study.sweep as S
    import jaxformer.train.loop as L

    events = []

    def fake_run(sweep, point, run_dir, *, quick=False):
        events.append(point.name)
        run_dir.mkdir(parents=True, exist_ok=True)
        return {"name": point.name, "values": point.values, "seed": point.seed, "diverged": False, "wall_s": 0.0}

    monkeypatch.setattr(S, "run_point", fake_run)
    monkeypatch.setattr(L, "release_host_memory", lambda: events.append("release"))
    path = write_sweep(tmp_path, {"axes": {"optimizer.lr": [1e-3, 3e-3, 1e-2]}})
    names = [p.name for p in load_sweep(path).points]
    run_sweep(load_sweep(path), tmp_path / "out", say=lambda s: None)
    assert events == [e for n in names for e in (n, "release")]


@pytest.mark.slow  # 8 s; a diverging point recorded while the sweep goes on is a default-run test
def test_a_sweep_where_every_point_diverged_still_reports(tmp_path):
    """The non-finite run keeps its initialisation probe; the report and its plots are written."""
    base = tiny_raw(make_corpus(tmp_path / "corpus"), steps=3, eval={"at_end": True, "max_tokens": 64},
                    optimizer={"lr": 1e30, "clip_norm": None, "weight_decay": 0.0})
    path = write_sweep(tmp_path, {"axes": {"model.norm": ["rmsnorm", "layernorm"]}, "probes": ["attention"],
                                  "report": {"plots": ["loss_curves", "final_metric", "probes"]}}, base=base)
    out = tmp_path / "out"
    rows = run_sweep(load_sweep(path), out, say=lambda s: None)
    assert all(r["diverged"] for r in rows)
    assert all(set(r["probes"]) == {"init"} for r in rows if "non-finite" in r["diverged_reason"])
    assert main(["sweep", str(path), "--out", str(out), "--report"]) == 0
    report = (out / "report.md").read_text()
    assert "2 of 2 points finished" in report
    assert report.count("| 1 of 1 |") == 2, report  # each row's diverged column: its one seed diverged


@pytest.mark.parametrize("losses, diverged", [
    ([5.5, 5.4, 5.6, 5.5, 5.45, 5.55, 5.5, 5.52], False),  # flat: did not learn, did not diverge
    ([5.5, 4.0, 3.0, 2.5, 2.4, 2.3, 2.2, 2.25], False),
    ([5.5, 4.0, 3.0, 5.0, 7.0, 9.0, 12.0, 15.0], True),
    ([5.5, float("nan")], True),
])
def test_divergence_rule(losses, diverged):
    from jaxformer.study.sweep import blew_up

    assert (blew_up(losses) is not None) == diverged
    assert (blew_up(losses, None) is not None) == any(x != x for x in losses), "margin None: non-finite only"


def test_finished_rows_are_judged_by_the_current_margin(tmp_path):
    """A finished point's train-loss verdict follows the sweep file's divergence_margin (no re-run); a stop
    on a non-finite loss stays diverged whatever the margin."""
    from jaxformer.study.sweep import LOSS_RULE, rejudged

    losses = [2.2, 2.7, 2.2, 2.5, 2.6, 2.5]  # a fine-tune: batch noise, the last batch 14% above the first
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": 4 * i + 4, "loss": x}) + "\n"
                                                    for i, x in enumerate(losses)))
    row = {"name": "p", "diverged": True, "diverged_reason": f"{LOSS_RULE} 2.5 above 2.2"}
    assert rejudged(row, tmp_path, 0.02)["diverged"]
    for margin in (None, 0.25):
        again = rejudged(row, tmp_path, margin)
        assert again["diverged"] is False and "diverged_reason" not in again
    assert rejudged({"name": "p", "diverged": False}, tmp_path, 0.02)["diverged"], "a tighter margin flags it"
    stopped = {"name": "p", "diverged": True, "diverged_reason": "non-finite loss at step 3"}
    assert rejudged(stopped, tmp_path, None) == stopped


KILLER = """
import os, signal, sys, time
from pathlib import Path
import jaxformer.train.loop as L
from jaxformer.study.sweep import load_sweep, run_sweep

sweep, out = load_sweep(sys.argv[1]), Path(sys.argv[2])
victim = out / sweep.points[1].name
orig = L.train

def train(cfg, run_dir, **kw):
    def hook(step, row):
        if Path(run_dir) == victim and step == 3:  # step 2's checkpoint is being written: wait for it
            done = victim / "checkpoints" / "2" / "commit_success.txt"
            deadline = time.time() + 120
            while not done.exists() and time.time() < deadline:
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)
    return orig(cfg, run_dir, on_step=hook)

L.train = train
run_sweep(sweep, out, say=print)
"""


@pytest.mark.slow  # 40 s; a finished point skipped and a point's own resume are default-run tests
def test_killed_sweep_resumes_to_the_same_results(tmp_path):
    """SIGKILL mid-way through the second point; the same command again skips the first and resumes the
    second from its checkpoint: every final metric equals an uninterrupted sweep's."""
    base = tiny_raw(make_corpus(tmp_path / "corpus"), steps=4, checkpoint={"every": 2, "keep": 3},
                    eval={"at_end": True, "max_tokens": 128})
    path = write_sweep(tmp_path, {"axes": {"model.n_layers": [1, 2]}}, base=base)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.pop("XLA_FLAGS", None)
    cli = [sys.executable, "-m", "jaxformer.cli", "sweep", str(path), "--out"]
    ref = subprocess.run(cli + [str(tmp_path / "ref")], env=env, capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]

    out = tmp_path / "out"
    killed = subprocess.run([sys.executable, "-c", KILLER, str(path), str(out)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    names = [p.name for p in load_sweep(path).points]
    assert (out / names[0] / POINT_FILE).exists() and not (out / names[1] / POINT_FILE).exists()
    assert (out / names[1] / "checkpoints" / "2").is_dir() and not (out / names[1] / "checkpoints" / "4").exists()

    again = subprocess.run(cli + [str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{names[0]}: finished, skipped" in again.stdout and "resuming at step 2" in again.stdout

    def finals(d):
        keep = ("step", "loss", "val_loss", "val_bpb", "diverged")
        return [{k: r.get(k) for k in keep} for r in map(json.loads, (d / "summary.jsonl").read_text().splitlines())]
    assert finals(out) == finals(tmp_path / "ref")  # exact: same floats


# -- evaluation at another length ---------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(ran):
    """The module sweep's RoPE point (``ran``; its own run of 6 s before): a tiny run trained through the CLI at
    seq_len 32 (max_seq_len 32) to its final evaluation."""
    path, out = ran
    [run] = [out / p.name for p in load_sweep(path).points if p.values["model.position"] == "rope"]
    assert C.load(run / "config.yaml").seq_len == 32
    return run


def test_eval_at_the_trained_length_equals_the_runs_own_evaluation(trained):
    """Two code paths: the trainer's jitted eval step (sums) vs per-token NLLs bucketed on the host."""
    from jaxformer.train.evaluation import evaluate_run, evaluate_run_at_length

    want = evaluate_run(trained, max_tokens=None)
    got = evaluate_run_at_length(trained, 32, max_tokens=None, bucket=8)
    assert got["val_tokens"] == want["val_tokens"] and got["val_bytes"] == want["val_bytes"]
    np.testing.assert_allclose(got["val_loss"], want["val_loss"], rtol=1e-6)  # fp32 sums in another order
    np.testing.assert_allclose(got["val_bpb"], want["val_bpb"], rtol=1e-6)
    b = got["buckets"]
    assert [x["from"] for x in b] == [0, 8, 16, 24] and sum(x["tokens"] for x in b) == got["val_tokens"]
    pooled = sum(x["loss"] * x["tokens"] for x in b) / got["val_tokens"]
    np.testing.assert_allclose(pooled, got["val_loss"], rtol=1e-9)
    # buckets count positions in the *document* (a new one starts after each EOS), not in the window
    from jaxformer.train.corpus import build_corpus
    from jaxformer.train.eval_windows import eval_windows

    cfg = C.load(trained / "config.yaml")
    corpus = build_corpus(cfg.data)
    ev = eval_windows(corpus.val_stream, seq_len=32, tokenizer=corpus.tokenizer)
    eos, pad = corpus.tokenizer.eos_id, corpus.tokenizer.pad_id
    counts = np.zeros(4, int)
    for row in ev.rows:
        n = int(np.sum(row != pad))
        p = 0
        for i in range(min(n, 33) - 1):  # input i predicts token i+1
            if i > 0:
                p = 0 if row[i - 1] == eos else p + 1
            if row[i] != eos:
                counts[p // 8] += 1
    assert [x["tokens"] for x in b] == counts.tolist()
    assert counts[0] > counts[-1]  # document starts inside windows: short contexts are over-represented


def test_eval_beyond_the_trained_length_via_the_cli(trained, capsys):
    capsys.readouterr()
    assert main(["eval", str(trained), "--seq-len", "128", "--max-tokens", "512", "--json"]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["seq_len"] == 128 and ev["trained_seq_len"] == 32 and 0 < ev["val_tokens"] <= 512
    assert ev["buckets"][-1]["to"] <= 128 and ev["buckets"][0]["from"] == 0
    assert main(["eval", str(trained), "--seq-len", "128", "--max-tokens", "512"]) == 0  # readable: a bucket table
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [f"eval: step {ev['step']} · val loss {ev['val_loss']:.4f} over {ev['val_tokens']:,} "
                         f"tokens · val {ev['val_bpb']:.4f} bits/byte over {ev['val_bytes']:,} bytes",
                         "  windows of 128 tokens (trained at 32)"]
    first = ev["buckets"][0]
    assert len(lines) == 3 + len(ev["buckets"]) and lines[3].split() == [
        f"{first['from']}-{first['to']}", f"{first['tokens']:,}", f"{first['loss']:.4f}", f"{first['bpb']:.4f}"]


def test_learned_positions_beyond_their_table_are_a_clear_error(ran, capsys):
    path, out = ran  # the module sweep's learned-positions point (a table of 32), trained there
    [run] = [out / p.name for p in load_sweep(path).points if p.values["model.position"] == "learned"]
    assert C.load(run / "config.yaml").model.max_seq_len == 32
    capsys.readouterr()
    assert main(["eval", str(run), "--seq-len", "64"]) == 2
    err = capsys.readouterr().err
    assert "positions.kind='learned' has a table of max_seq_len=32 positions" in err and "seq_len=64" in err


# -- the study files ----------------------------------------------------------------------------

@pytest.mark.parametrize("study", STUDIES, ids=lambda p: p.stem)
def test_every_study_file_parses_expands_and_resolves(study, capsys):
    needs_checkpoint(study)
    assert main(["sweep", str(study), "--dry-run"]) == 0
    out = capsys.readouterr().out
    sweep = load_sweep(study)
    every = sweep.tune_points + sweep.points
    assert f"{len(every)} points" in out and all(p.name in out for p in every)


# Issue 25's rules for a study file, and the files that depart from one with the reason (a new study file must
# follow them or be listed here with its own reason):
UNTUNED = {  # no `tune:`
    "activations_full": "the main job's length at the rate activations.yaml's tuning chose for both arms",
    "norm_placement_stress": "a fixed stress rate (1e-2 unclipped) by design: which placements train at all",
    "residuals": "the issue's design (1,000 steps at one AdamW rate): whether a stack trains; residuals_rates.yaml "
                 "is its rate control",
    "residuals_rates": "a rate control: two lower rates as axes, the trained count per rate",
    "residuals_rates_deep": "the same rate control at 12 and 24 layers",
    "positions_order": "positions.yaml's tuned rate per arm, copied into the file",
}
ONE_SEED = {"residuals_rates": "a control: does any rate of the grid train (the trained column), not a difference",
            "residuals_rates_deep": "the same control at 12 and 24 layers"}
NO_BASELINE = {"norm_placement_stress": "reports how many seeds train per arm (trained_below), not a difference",
               "residuals_rates": "reports which rates train (trained_below), not a difference",
               "residuals_rates_deep": "the same, at 12 and 24 layers"}
assert set(UNTUNED) | set(ONE_SEED) | set(NO_BASELINE) <= {s.stem for s in STUDIES}  # no stale reason left listed


@pytest.mark.parametrize("study", STUDIES, ids=lambda p: p.stem)
def test_every_study_file_follows_the_review_rules(study):
    """Each arm tuned (or a reason in UNTUNED), three seeds or more, a baseline for the paired intervals (or the
    trained count instead), periodic validation and its curves."""
    needs_checkpoint(study)
    sweep, stem = load_sweep(study), study.stem
    spec = sweep.spec
    assert (spec.tune is not None) != (stem in UNTUNED), f"{stem}: tune: {spec.tune}, listed untuned: {stem in UNTUNED}"
    assert (len(spec.seeds) >= 3) != (stem in ONE_SEED), f"{stem}: seeds {spec.seeds}"
    assert bool(spec.report.baseline) != (stem in NO_BASELINE), f"{stem}: baseline {spec.report.baseline}"
    if not spec.report.baseline:
        assert spec.report.trained_below is not None, stem
    assert all(p.config.eval.every for p in sweep.points) and "val_curves" in spec.report.plots, stem


def _quick_one(study: Path, tmp: Path, shard: str):
    out = tmp / "out"
    assert main(["sweep", str(study), "--quick", "--shard", shard, "--out", str(out)]) == 0
    assert not (out / "report.md").exists()  # a shard leaves the report to --report
    assert main(["sweep", str(study), "--quick", "--out", str(out), "--report"]) == 0
    sweep = load_sweep(study)
    mine = shard_points(sweep.tune_points + sweep.points, parse_shard(shard))
    rows = [json.loads(x) for x in (out / "summary.jsonl").read_text().splitlines()]
    tuning = out / "tuning.jsonl"
    rows += [json.loads(x) for x in tuning.read_text().splitlines()] if tuning.exists() else []
    assert sorted(r["name"] for r in rows) == sorted(p.name for p in mine)
    assert all(r["step"] == 2 for r in rows)
    assert (out / "report.md").exists()


# A quick point (2 steps, then --report) of a study file takes 8-35 s on 2 Zen 2 cores (LoRA's, fine-tuning
# SmolLM2-135M, 123 s): the default run trains one committed study file end to end, `activations` (`probes:` and
# `tune:`, 20 s on a Zen 3), and slow-marks the rest (`pytest -m slow -k runs_quick`), `positions` (33 s) among
# them: its one feature beyond those, `eval_lengths`, runs through the CLI in the module sweep above (`ran`) and
# in the evaluation-length tests below, and `tune:` in test_sweep_tune.py. Every study file still parses, expands
# and meets the review's rules in the default run (the two tests above), each probe has its own tests
# (test_probes.py), and each arm's model is built and trained in its own unit tests (tests/model, tests/nn).
DEFAULT_QUICK = ("activations",)
assert set(DEFAULT_QUICK) <= {s.stem for s in STUDIES}, DEFAULT_QUICK  # a renamed study must not drop out unseen
QUICK_STUDIES = [s if s.stem in DEFAULT_QUICK else pytest.param(s, marks=pytest.mark.slow) for s in STUDIES]


@pytest.mark.parametrize("study", QUICK_STUDIES, ids=lambda p: p.stem)
def test_one_point_of_every_study_runs_quick(study, tmp_path):
    needs_checkpoint(study)
    sweep = load_sweep(study)
    _quick_one(study, tmp_path, f"0/{len(sweep.tune_points) + len(sweep.points)}")


@pytest.mark.slow
@pytest.mark.parametrize("study", STUDIES, ids=lambda p: p.stem)
def test_every_point_of_every_study_runs_quick(study, tmp_path):
    needs_checkpoint(study)
    _quick_one(study, tmp_path, "0/1")


def test_rope_relative_bound_is_roformers_curve():
    """At distance 0 every partial sum is j, so the bound is the mean of 1..d/2; it then decays
    (RoFormer §3.4.3): checked here against a direct double loop at a few distances."""
    from jaxformer.study.plots import rope_relative_bound

    d, m = 16, np.array([0, 1, 7, 300])
    got = rope_relative_bound(d, m)
    theta = [10000.0 ** (-2 * i / d) for i in range(d // 2)]
    for k, dist in enumerate(m):
        partial = [abs(sum(np.exp(1j * dist * theta[i]) for i in range(j))) for j in range(1, d // 2 + 1)]
        np.testing.assert_allclose(got[k], np.mean(partial), rtol=1e-12)
    assert got[0] == pytest.approx((d // 2 + 1) / 2)
    far = rope_relative_bound(128, np.arange(500, 1000)).mean()
    assert far < rope_relative_bound(128, np.array([0]))[0] / 3


STUDY_SCRIPTS = sorted((REPO / "experiments" / "studies").glob("*.py"))


# kv_cache (20 s) is slow-marked; long_context runs the same measurement-study driver in the default run
@pytest.mark.parametrize("script", [s if s.stem != "kv_cache" else pytest.param(s, marks=pytest.mark.slow)
                                    for s in STUDY_SCRIPTS], ids=lambda p: p.stem)
def test_benchmark_studies_dry_run_and_quick(script, tmp_path):
    """The two studies that are measurements rather than sweeps (long context, KV cache): they list their
    cases, and run at toy sizes end to end, writing their table and plots."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    env.pop("XLA_FLAGS", None)
    dry = subprocess.run([sys.executable, str(script), "--dry-run"], env=env, capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert dry.returncode == 0, dry.stderr[-2000:]
    quick = subprocess.run([sys.executable, str(script), "--quick", "--out", str(tmp_path)], env=env,
                           capture_output=True, text=True, timeout=600, cwd=REPO)
    assert quick.returncode == 0, quick.stderr[-3000:]
    table = (tmp_path / "table.md").read_text()
    assert table.count("|") > 10
    assert len(list(tmp_path.glob("*.png"))) == (3 if script.stem == "kv_cache" else 2)
    if script.stem == "kv_cache":  # the table comes back from results.json alone
        (tmp_path / "table.md").unlink()
        again = subprocess.run([sys.executable, str(script), "--table-from", str(tmp_path)], env=env,
                               capture_output=True, text=True, timeout=120, cwd=REPO)
        assert again.returncode == 0, again.stderr[-2000:]
        assert (tmp_path / "table.md").read_text() == table
        for png in tmp_path.glob("*.png"):  # and the plots (--plots-from: the lengths drawn again, no timing)
            png.unlink()
        plots = subprocess.run([sys.executable, str(script), "--plots-from", str(tmp_path)], env=env,
                               capture_output=True, text=True, timeout=120, cwd=REPO)
        assert plots.returncode == 0, plots.stderr[-2000:]
        assert sorted(p.name for p in tmp_path.glob("*.png")) == ["cache_vs_recompute.png", "engine_throughput.png",
                                                                    "memory_utilisation.png"]


def test_kv_cache_page_table_is_rendered_from_its_results(tmp_path):
    """Study 10's committed table (every figure the page quotes, ms per step included) is what its
    script renders from the committed results.json, not numbers derived by hand."""
    committed = REPO / "experiments" / "results" / "studies" / "kv_cache"
    shutil.copy(committed / "results.json", tmp_path / "results.json")
    shutil.copy(committed / "table.md", tmp_path / "table.md")
    spec = importlib.util.spec_from_file_location("kv_cache_study", REPO / "experiments" / "studies" / "kv_cache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.rerender(tmp_path) == (committed / "table.md").read_text().rstrip("\n")
    assert "ms per step" in (committed / "table.md").read_text()
