"""MFU: the datasheet table, the CPU peak measured once per process, the formula, and the mfu column of
metrics.jsonl and the progress line."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from rich.console import Console

from jaxformer.model import flops_per_token
from jaxformer.train import config as C
from jaxformer.train.loop import train
from jaxformer.train.metrics import (ProgressBar, datasheet_peak_tflops, device_peak, measured_cpu_peak, mfu,
                                     read_metrics)
from tests.train.helpers import make_corpus, tiny_raw


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("mfu_corpus"))


@pytest.mark.parametrize("kind,tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0), ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5e", 197.0),
    ("TPU v5", 459.0), ("TPU v5p", 459.0), ("TPU v6 lite", 918.0), ("TPU v6e", 918.0),
    ("TPU v4 lite", None), ("NVIDIA GeForce RTX 4090", None), ("cpu", None),
])
def test_datasheet_table(kind, tflops):
    assert datasheet_peak_tflops(kind) == tflops


def test_mfu_formula():
    assert mfu(6e9, 1000.0, 1e13) == pytest.approx(0.6)  # 6 GFLOP/token x 1000 tokens/s over 10 TFLOP/s
    assert mfu(6e9, None, 1e13) is None and mfu(6e9, 1000.0, None) is None


def test_device_peak_counts_devices_on_accelerators_and_processes_on_cpu():
    gpus = [SimpleNamespace(platform="gpu", device_kind="NVIDIA H200", process_index=i // 4) for i in range(8)]
    peak, note = device_peak(gpus)
    assert peak == 8 * 989e12 and "datasheet" in note
    assert device_peak(gpus, override_tflops=100.0)[0] == 8 * 100e12
    assert device_peak([SimpleNamespace(platform="gpu", device_kind="NVIDIA T4", process_index=0)])[0] is None
    cpus = [SimpleNamespace(platform="cpu", device_kind="cpu", process_index=0) for _ in range(8)]  # one process
    peak, note = device_peak(cpus)
    assert peak == measured_cpu_peak() and "measured" in note
    assert device_peak(cpus, override_tflops=0.5)[0] == 0.5e12


def test_measured_cpu_peak_is_a_rate_measured_once():
    peak = measured_cpu_peak()
    assert math.isfinite(peak) and 1e8 < peak < 1e15  # between 0.1 GFLOP/s and 1 PFLOP/s
    assert measured_cpu_peak() is peak  # cached: measured once per process


def test_progress_line_shows_mfu():
    con = Console(record=True, width=200, force_terminal=False)
    bar = ProgressBar(10, 0, enabled=True, console=con)
    bar.update(5, 2.0, 1234.0, True, mfu=0.125)
    bar.update(6, 2.0, 1234.0, True)  # no peak known: no MFU field
    text = con.export_text()
    assert "step 5/10  loss 2.0000  1,234 tok/s  MFU 12.5%  elapsed" in text
    assert "step 6/10  loss 2.0000  1,234 tok/s  elapsed" in text


def test_metrics_rows_carry_mfu(corpus, tmp_path):
    """Every train row has mfu = flops_per_token x tokens_per_s / peak (the peak given here, so the check is
    exact); the first row, with no tokens/s yet, has mfu None; the start and progress lines say it. Without
    ``logging.layer_grad_norms`` (tests/study/test_probes.py's flag) no row carries per-block norms."""
    cfg = C.from_dict(tiny_raw(corpus, steps=3, logging={"peak_tflops": 0.01}), "<test>")
    train(cfg, tmp_path / "run")
    assert all("grad_norm_layers" not in r for r in read_metrics(tmp_path / "run"))
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    fpt = flops_per_token(cfg.model, cfg.seq_len)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["mfu"] is None
    for r in rows[1:]:
        assert r["mfu"] == pytest.approx(fpt * r["tokens_per_s"] / 0.01e12, rel=1e-9) and r["mfu"] > 0


def test_cpu_run_measures_its_peak(corpus, tmp_path, capsys):
    cfg = C.from_dict(tiny_raw(corpus, steps=2, logging={"progress": True}), "<test>")
    train(cfg, tmp_path / "run")
    out = capsys.readouterr().out
    assert "MFU vs" in out and "measured fp32 matmul" in out and "MFU " in out.split("MFU vs")[1]
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert all("mfu" in r for r in rows) and 0 < rows[-1]["mfu"] < 1
