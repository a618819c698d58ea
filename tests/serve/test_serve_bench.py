"""``experiments/bench/serve.py``'s ceiling: the ratio the all-at-once run could reach if batched decode steps
were as cheap as one-row steps, from made-up step profiles, against the formula written out by hand."""

from __future__ import annotations

import collections

import pytest

from tests.bench_scripts import load_bench


def test_the_ceiling_prices_every_decode_step_at_a_one_row_step():
    ceiling = load_bench("serve").ceiling
    # two rounds summed: one after another 100 one-row steps of 20 ms and 4 s of prefill a round;
    # all at once 30 + 10 decode steps and 5 s of prefill a round
    seq = collections.Counter({("decode B=1", "s"): 4.0, ("decode B=1", "steps"): 200, ("with prefill", "s"): 8.0,
                               ("with prefill", "steps"): 8})
    together = collections.Counter({("decode B=16", "s"): 6.0, ("decode B=16", "steps"): 60,
                                    ("decode B=4", "s"): 1.0, ("decode B=4", "steps"): 20,
                                    ("with prefill", "s"): 10.0, ("with prefill", "steps"): 6})
    assert ceiling(seq, together, seq_s=6.0, rounds=2) == pytest.approx(6.0 / (5.0 + 40 * 0.020))
    with pytest.raises(ValueError, match="no one-row decode step"):
        ceiling(collections.Counter(), together, seq_s=6.0, rounds=2)
