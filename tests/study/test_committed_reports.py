"""Every landed study page's sweep report rebuilds from what is committed (issue 25's "--report reproduces each
page's tables from its summary.jsonl"): `write_report` over a copy of the folder's row files, with its
`points/` where it keeps them, gives its `report.md` byte for byte. The plots are not redrawn here (seconds
each; their code has its own tests): the names the committed report shows stand in for them.

A report change that alters the text (a heading, a column, a number's format) fails here until the committed
reports are regenerated with it; a study whose re-run is still landing is listed in PENDING."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from jaxformer.study import report as R
from jaxformer.study.sweep import POINT_FILE, check_finished, load_sweep
from jaxformer.train import config as C
from tests.study.checkpoints import fine_tunes_a_checkpoint, needs_checkpoint

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "experiments" / "results" / "studies"
# (sweep file stem, results folder): the pages whose re-run has landed
LANDED = [("sqrt_dk", "sqrt_dk"), ("qkv_sharing", "qkv_sharing"), ("heads", "heads"), ("heads_alibi", "heads/alibi"),
          ("positions", "positions"), ("norms", "norms"), ("activations", "activations"),
          ("residuals", "residuals"), ("activations_full", "activations/full"),
          ("norm_placement", "norm_placement"), ("norm_placement_stress", "norm_placement/stress"),
          ("lora", "lora"), ("residuals_rates", "residuals/rates"),
          ("positions_order", "positions/order"), ("residuals_rates_deep", "residuals/rates_deep")]
PENDING: list[str] = []  # landing over several sessions


def _rebuilt(stem: str, folder: str, tmp_path: Path, monkeypatch, edit=None) -> tuple[Path, str]:
    """``write_report`` over a copy of ``folder``'s row files (each row, and each ``points/*/sweep_point.json``,
    through ``edit``, a function of its JSON text, where given): (its output folder, the committed report.md)."""
    needs_checkpoint(REPO / "experiments" / "studies" / f"{stem}.yaml")
    committed = RESULTS / folder
    out = tmp_path / "out"
    out.mkdir()
    for name in ("summary.jsonl", "tuning.jsonl", "superseded.jsonl"):
        if (committed / name).exists():
            lines = (committed / name).read_text().splitlines()
            (out / name).write_text("".join((edit or str)(x) + "\n" for x in lines))
    if (committed / "points").is_dir() and edit is None:
        (out / "points").symlink_to(committed / "points")  # read only: each run's row and metrics
    elif (committed / "points").is_dir():
        shutil.copytree(committed / "points", out / "points")
        for row in (out / "points").glob(f"*/{POINT_FILE}"):
            row.write_text(edit(row.read_text()))
    want = (committed / "report.md").read_text()
    shown = re.findall(r"^!\[[^\]]*\]\(([^)]+\.png)\)$", want, flags=re.M)
    monkeypatch.setattr(R, "draw_plots", lambda sweep, out, rows: shown)
    monkeypatch.chdir(REPO)  # the report names its sweep file as given: relative, as the pages' commands do
    sweep = load_sweep(f"experiments/studies/{stem}.yaml")
    assert R.write_report(sweep, out).read_text() == want
    return out, want


@pytest.mark.parametrize("stem, folder", LANDED, ids=[s for s, _ in LANDED])
def test_a_landed_study_report_rebuilds_from_its_committed_rows(stem, folder, tmp_path, monkeypatch):
    out, _ = _rebuilt(stem, folder, tmp_path, monkeypatch)
    assert not (out / "superseded.jsonl").exists() or \
        (out / "superseded.jsonl").read_text() == (RESULTS / folder / "superseded.jsonl").read_text()


FINE_TUNING = [(s, f) for s, f in LANDED if fine_tunes_a_checkpoint(REPO / "experiments" / "studies" / f"{s}.yaml")]


def test_a_landed_study_fine_tunes_a_checkpoint():
    """The two tests below run on such studies only: they must not vanish unnoticed."""
    assert FINE_TUNING


def test_the_positions_tables_are_the_pages(capsys):
    """Study 4's tables its report does not print (experiments/studies/tables/positions.py), run as the page runs
    them: each arm's 1,024 - 128 gap, and (once the control's rows are committed) each order-probe line, is on the
    page as printed (the page writes minus signs as U+2212)."""
    _, lines = _run_table("positions", capsys)
    page = (RESULTS / "positions.md").read_text().replace("\u2212", "-")
    gaps = lines[:lines.index("")] if "" in lines else lines
    order = lines[lines.index("") + 3:] if "" in lines else []  # after the order table's header and rule
    assert len(gaps) == 5
    for line in gaps:
        arm, diff, seeds = (c.strip() for c in line.strip("|").split("|"))
        row = next(r for r in page.splitlines() if r.startswith(f"| {arm.split()[0]} |")
                   and ("✓" in r) == ("√d" in arm) and "1024" not in r and r.count("|") == 9)
        assert row.rstrip().endswith(f"| {diff} |") and seeds == "3", (line, row)
    assert len(order) == 3
    for line in order:
        assert line.replace("\u2212", "-") in page, line


@pytest.mark.parametrize("stem, folder", FINE_TUNING, ids=[s for s, _ in FINE_TUNING])
def test_rows_recorded_in_another_checkout_are_still_the_studys(stem, folder, tmp_path, monkeypatch):
    """A row records the checkpoint it fine-tuned as an absolute path (``hf_source``), resolved in the checkout
    that ran it; the same rows read in a clone elsewhere (CI's, another machine's) are the same points. The
    first CI run of the LoRA page found all 32 rows "not points of the sweep file" for that reason."""
    def moved(line: str) -> str:
        row = json.loads(line)
        if isinstance(row.get("config"), dict) and row["config"].get("hf_source"):
            row["config"]["hf_source"] = str(Path("/elsewhere/clone") / Path(row["config"]["hf_source"]).name)
        return json.dumps(row, indent=1) if "\n" in line else json.dumps(row)

    rows = (RESULTS / folder / "summary.jsonl").read_text().splitlines()
    assert rows and all(json.loads(x)["config"]["hf_source"] for x in rows)
    _rebuilt(stem, folder, tmp_path, monkeypatch, moved)


def test_every_study_sweep_is_landed_or_pending():
    stems = {p.stem for p in (REPO / "experiments" / "studies").glob("*.yaml")}
    listed = {s for s, _ in LANDED} | set(PENDING)
    assert stems == listed, stems ^ listed
    assert listed <= stems


def _run_table(name: str, capsys):
    """``experiments/studies/tables/<name>.py`` run as its page runs it (no arguments): the module and its
    table's rows (the printed lines after the header)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / "studies" / "tables" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([]) == 0
    return module, capsys.readouterr().out.splitlines()[2:]


def test_the_residual_gradient_table_reads_every_setting_from_the_rows(capsys):
    """Study 8's per-block gradient table (experiments/studies/tables/residual_gradients.py), run as the page
    runs it: a line per setting of the sweep that has committed rows, in the sweep's order, its seed-0 columns
    seed 0's own probe figures; the probe's first-block figure is its per-block list's first entry."""
    import json

    module, lines = _run_table("residual_gradients", capsys)
    sweep = load_sweep(REPO / "experiments" / "studies" / "residuals.yaml")
    rows = {p.name: json.loads(f.read_text()) for p in sweep.points
            if (f := RESULTS / "residuals" / "points" / p.name / "sweep_point.json").exists()}
    order = list(dict.fromkeys(tuple(r["values"][k] for k in module.KEYS) for r in rows.values()))
    assert len(lines) == len(order) > 0
    for line, key in zip(lines, order):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:4] == [str(key[0]), str(key[1]), str(key[2]), str(key[3]).lower()]
        seed0 = next(r for r in rows.values() if tuple(r["values"][k] for k in module.KEYS) == key and r["seed"] == 0)
        layers = seed0["probes"]["init"]["grad_norm_layers"]
        assert cells[4] == ", ".join(module.fmt(g) for g in layers[:3]) and cells[5] == module.fmt(layers[-1])
    for r in rows.values():
        init = r["probes"]["init"]
        assert init["grad_norm_layers"][0] == pytest.approx(init["grad_norm_first_block"], rel=1e-6)
        assert len(init["grad_norm_layers"]) == r["values"]["model.n_layers"]


def test_the_heads_rope_vs_alibi_table_is_the_two_reports_differences(capsys):
    """Study 3's RoPE-vs-ALiBi table (experiments/studies/tables/heads_positions.py), run as the page runs it:
    every line's difference and interval is the one its own sweep's committed report prints against 4 heads."""
    module, lines = _run_table("heads_positions", capsys)
    reports = {"RoPE": (RESULTS / "heads" / "report.md").read_text(),
               "ALiBi": (RESULTS / "heads" / "alibi" / "report.md").read_text()}
    assert [ln.split("|")[1].strip() for ln in lines] == ["RoPE"] * 6 + ["ALiBi"] * 3
    for line in lines:
        name, heads, diff, seeds = (c.strip() for c in line.strip("|").split("|"))
        assert f"| {heads} | n_heads=4 | {seeds} | {diff}" in reports[name], line


@pytest.mark.parametrize("stem, folder", FINE_TUNING, ids=[s for s, _ in FINE_TUNING])
def test_the_runner_skips_a_moved_checkouts_finished_point_and_refuses_another_checkpoint(stem, folder,
                                                                                          monkeypatch):
    """What the runner checks before skipping a finished point (check_finished): the checkpoint's location may
    differ, its file name may not (another checkpoint: refused, naming ``hf_source``)."""
    needs_checkpoint(REPO / "experiments" / "studies" / f"{stem}.yaml")
    monkeypatch.chdir(REPO)
    sweep = load_sweep(f"experiments/studies/{stem}.yaml")
    point = (sweep.tune_points or sweep.points)[0]
    rows = RESULTS / folder / ("tuning.jsonl" if point.tuning else "summary.jsonl")
    done = json.loads(rows.read_text().splitlines()[0])
    assert done["name"] == point.name
    source = Path(done["config"]["hf_source"])
    done["config"]["hf_source"] = str(Path("/elsewhere/clone") / source.name)
    check_finished(point, done, point.config, False, Path("out"))
    done["config"]["hf_source"] = str(source.with_name("another-" + source.name))
    with pytest.raises(C.ConfigError, match=rf"point {point.name} finished with another config: hf_source"):
        check_finished(point, done, point.config, False, Path("out"))
