"""``experiments/bench/decode.py``'s step-profile machinery has a pulse on a tiny model (no torch needed): the
length-scaling rows record the table width each step read, the step recorder times every model call, and
the id tokenizer round-trips."""

from __future__ import annotations

import pytest

from tests.bench_scripts import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("decode")


def test_length_scaling_rows_record_the_width_each_step_read(bench, llama, monkeypatch):
    cfg, graphdef, state = llama  # a 40-token context: 3 pages of 16 per slot
    from jaxformer.decode import engine as eng

    monkeypatch.setattr(eng, "MIN_TABLE_TOKENS", 16)  # one page: below the capacity, so the width shows
    rows = bench.bench_length_scaling(graphdef, state, cfg, lengths=(4, 33), batches=(1, 2), steps=2)
    assert [(r["n"], r["B"]) for r in rows] == [(4, 1), (4, 2), (33, 1), (33, 2)]
    assert [r["M"] for r in rows] == [1, 1, 3, 3] and all(r["capacity"] == 3 for r in rows)
    assert [r["Bs"] for r in rows] == [1, 2, 1, 2]
    assert all(r["ms"] >= r["jit"] > 0 for r in rows)


def test_id_tokenizer_and_cpu_line(bench):
    tok = bench.IdTokenizer()
    assert tok.encode_prompt("5 17 302") == [5, 17, 302] and tok.decode([5, 17]) == "5 17"
    assert bench.cpu_line().startswith("CPU: ") and "load average" in bench.cpu_line()
