"""``experiments/bench/norms.py`` (study 5's speed figures) end to end at toy size: the table prints every row
with its ratio and the per-round interquartile range, and the range brackets the median ratio's rounds."""

from __future__ import annotations

import re

import pytest

from tests.bench_scripts import load_bench


def test_iqr_is_the_quartiles_by_linear_interpolation():
    iqr = load_bench("norms").iqr
    assert iqr([4.0, 1.0, 3.0, 2.0]) == pytest.approx((1.75, 3.25))  # positions 0.75 and 2.25 of 1, 2, 3, 4
    assert iqr([0.9]) == (0.9, 0.9)


@pytest.mark.slow  # ~40 s (two train steps compiled)
def test_norms_bench_toy(capsys):
    assert load_bench("norms").main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "per-round IQR" in out
    rows = [line for line in out.splitlines() if line.startswith(("op ", "train step"))]
    assert len(rows) == 3
    for line in rows:
        ratio, q1, q3 = map(float, re.search(r"(\d+\.\d+)\s+\[(\d+\.\d+), (\d+\.\d+)\]$", line).groups())
        assert q1 <= q3 and q1 == q3 == pytest.approx(ratio, rel=1e-3)  # one round: its ratio is the median's
