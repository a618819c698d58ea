"""``experiments/bench/decode_matmul.py`` end to end at two row counts: every form, bf16 included, is checked
inside the bench against a float64 product (it raises on a wrong one), and a row of timings per row count."""

from __future__ import annotations

import re

import pytest

from tests.bench_scripts import load_bench


@pytest.mark.slow  # ~30 s: a 30-layer stack of SmolLM2-135M's matrices and its head (538 MB fp32) in four layouts
def test_decode_matmul_bench_every_form_checked(capsys):
    assert load_bench("decode_matmul").main(["--rows", "1", "3", "8", "--repeats", "1", "--bf16", "--head"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "x @ W bf16 / first" in out and "+ the head" in out
    rows = re.findall(r"^\| (\d+) \|((?: (?:[\d.]+|n/a) \|){11})$", out, re.M)
    assert [int(b) for b, _ in rows] == [1, 3, 8]
    assert "n/a" not in rows[0][1] and rows[2][1].count("n/a") == 2  # the multiply-and-reduce: 4 rows at most


@pytest.mark.slow  # ~10 s: 30 distinct [1536, 576] weights (106 MB) in a chain, checked inside against float64
def test_decode_matmul_bench_stream_table(capsys):
    assert load_bench("decode_matmul").main(["--rows", "2", "--repeats", "1", "--stream"]) == 0
    out = capsys.readouterr().out
    assert "a plain read of them (jitted sum)" in out
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \|$",
                      out, re.M)
    assert [int(r[0]) for r in rows] == [2] and float(rows[0][1]) > 0 and float(rows[0][4]) > 0  # the two chains' ms


def test_decode_attention_bench_table_and_its_check(capsys, monkeypatch):
    """``experiments/bench/decode_attention.py`` at toy sizes: a row per table width, every column a time; and
    its check bites: with the length mask dropped from the contiguous form's weights, the bench refuses to time."""
    bench = load_bench("decode_attention")
    assert bench.main(["--rows", "3", "--pages", "1", "2", "--layers", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "paged_attention (engine)" in out and "plain read" in out
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \|((?: [\d.]+ \|){9})$", out, re.M)
    assert [int(r[0]) for r in rows] == [1, 2] and all(float(t) > 0 for t in rows[1][2].split("|")[:-1])
    monkeypatch.setattr(bench, "decode_weights", lambda s, lengths: bench.jax.nn.softmax(s, axis=-1))
    with pytest.raises(AssertionError, match="contiguous keys"):
        bench.main(["--rows", "3", "--pages", "2", "--layers", "1", "--repeats", "1"])
