"""The plain progress lines (logs, CI, nohup: no terminal) say step/total, elapsed and ETA; the CPU peak that MFU is
measured against is the best of several probes spread over the first steps, and each row records it."""

from __future__ import annotations

import pytest
from rich.console import Console

from jaxformer.model import flops_per_token
from jaxformer.train import config as C
from jaxformer.train import metrics as M
from jaxformer.train.loop import train
from jaxformer.train.metrics import ProgressBar, hms, read_metrics
from tests.train.helpers import make_corpus, tiny_raw


class Clock:
    def __init__(self, *times: float):
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def _lines(con: Console) -> list[str]:
    return [line for line in con.export_text().splitlines() if line]


def test_hms():
    assert [hms(x) for x in (0, 12.4, 59.6, 72, 3599, 3725, 36000)] == [
        "0:00", "0:12", "1:00", "1:12", "59:59", "1:02:05", "10:00:00"]


def test_plain_line_has_step_of_total_elapsed_and_eta():
    """The ETA extrapolates the time per step since the first update (the first step, which compiles, is not
    counted): 49 steps in 11.76 s leave 2,200 steps at 0.24 s = 8:48."""
    con = Console(record=True, width=300, force_terminal=False)
    bar = ProgressBar(2250, 0, enabled=True, console=con, clock=Clock(2.0, 13.76, 541.76), started=0.0)
    bar.update(1, 5.5, None, True)
    bar.update(50, 5.28171, 4612.4, True, mfu=0.3271)
    bar.update(2250, 1.5, 4600.0, True, mfu=0.33)
    assert _lines(con) == [
        "step 1/2,250  loss 5.5000  - tok/s  elapsed 0:02  ETA -",
        "step 50/2,250  loss 5.2817  4,612 tok/s  MFU 32.7%  elapsed 0:14  ETA 8:48",
        "step 2,250/2,250  loss 1.5000  4,600 tok/s  MFU 33.0%  elapsed 9:02  ETA 0:00",
    ]


def test_eta_of_a_resumed_run_counts_the_steps_left_from_its_own_first_step():
    con = Console(record=True, width=300, force_terminal=False)
    bar = ProgressBar(100, 40, enabled=True, console=con, clock=Clock(10.0, 19.0, 20.0), started=4.0)
    bar.update(41, 2.0, None, False)  # not a logged step: no line, but the ETA counts from it
    bar.update(50, 2.0, 1000.0, True)
    bar.update(51, 2.0, 1000.0, False)
    assert _lines(con) == ["step 50/100  loss 2.0000  1,000 tok/s  elapsed 0:15  ETA 0:50"]


@pytest.fixture
def probes(monkeypatch):
    """The CPU probe returns 0.1, 0.4, 0.2, 0.3 TFLOP/s in turn; re-probes after every one of the first steps."""
    seq = iter([0.1e12, 0.4e12, 0.2e12, 0.3e12])
    calls = []

    def probe():
        calls.append(1)
        return next(seq)
    monkeypatch.setattr(M, "_cpu_probes", [])
    monkeypatch.setattr(M, "probe_cpu_matmul", probe)
    monkeypatch.setattr(M, "REPROBE_AFTER_S", (0.0, 0.0, 0.0))
    return calls


def test_cpu_peak_is_the_best_of_the_probes_and_each_row_records_it(probes, tmp_path, capsys):
    corpus = make_corpus(tmp_path / "corpus")
    cfg = C.from_dict(tiny_raw(corpus, steps=4, logging={"progress": True}), "<test>")
    train(cfg, tmp_path / "run")
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(probes) == M.CPU_PROBES == 4  # at start-up, then after steps 1, 2 and 3
    # step 1 is read back before the first re-probe; later rows are measured against the best so far
    assert [r["peak_tflops"] for r in rows] == pytest.approx([0.1, 0.4, 0.4, 0.4], rel=1e-12)
    fpt = flops_per_token(cfg.model, cfg.seq_len)
    for r in rows[1:]:
        assert r["mfu"] == pytest.approx(fpt * r["tokens_per_s"] / (r["peak_tflops"] * 1e12), rel=1e-9)
    out = capsys.readouterr().out
    assert "MFU vs 0.100 TFLOP/s per process (measured fp32 matmul)" in out.splitlines()[0]  # the start line
    assert "train: MFU vs 0.400 TFLOP/s per process (measured fp32 matmul, best of 4 probes)" in out
    # the process has made its probes: a later run reuses the best, probing no more
    assert M.measured_cpu_peak(again=True) == 0.4e12 and len(probes) == 4


def test_no_reprobe_when_the_peak_is_given(probes, tmp_path):
    cfg = C.from_dict(tiny_raw(make_corpus(tmp_path / "corpus"), steps=3, logging={"peak_tflops": 0.5}), "<test>")
    train(cfg, tmp_path / "run")
    assert probes == []
    assert {r["peak_tflops"] for r in read_metrics(tmp_path / "run") if "loss" in r} == {0.5}
