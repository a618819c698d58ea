"""``experiments/bench/heads.py`` (study 3's speed figures) end to end at toy size: a row per head count with its
head dim, its ratio to the baseline's step and the per-round interquartile range (one round: the ratio itself)."""

from __future__ import annotations

import re

import pytest

from tests.bench_scripts import load_bench


@pytest.mark.slow  # ~40 s (three train steps compiled)
def test_heads_bench_toy(capsys):
    assert load_bench("heads").main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "ratios against 4 heads" in out
    rows = {int(m[1]): m for m in re.finditer(
        r"^\s*(\d+)\s+(\d+)\s+[\d.]+ms\s+[\d,]+\s+(\d+\.\d+)\s+\[(\d+\.\d+), (\d+\.\d+)\]$", out, re.M)}
    assert sorted(rows) == [1, 4, 16]
    for n, m in rows.items():
        assert int(m[2]) == 128 // n  # the main job's d_model 128 split n ways
        ratio, q1, q3 = map(float, m.groups()[2:])
        assert q1 == q3 == pytest.approx(ratio, rel=1e-3)
    assert float(rows[4][3]) == 1.0


def test_heads_bench_refuses_a_baseline_it_does_not_run():
    with pytest.raises(SystemExit):
        load_bench("heads").main(["--heads", "1", "2", "--baseline", "4"])
