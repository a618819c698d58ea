"""Nested validation windows: the same tokens scored at every length (jaxformer.train.eval_windows)."""

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxformer.train.eval_windows import eval_windows, nested_windows

TOK = SimpleNamespace(pad_id=0, eos_id=1)


def scored(evalset) -> list[tuple[int, int]]:
    """(input id, target id) pairs that the windows score, as a sorted multiset; with distinct ids in
    the stream each pair names one stream position."""
    pairs = []
    for b in evalset.batches(4):
        where = b.loss_mask
        pairs += list(zip(b.tokens[where].tolist(), b.targets[where].tolist()))
    return sorted(pairs)


def stream_of(n: int, eos_every: int) -> np.ndarray:
    s = np.arange(2, n + 2, dtype=np.int32)  # distinct ids (0 pad, 1 eos), so a pair names a position
    s[eos_every::eos_every] = TOK.eos_id
    return s


@settings(max_examples=30, deadline=None)
@given(st.integers(40, 400), st.integers(3, 50), st.sampled_from([16, 32, 64]), st.data())
def test_every_length_scores_the_same_targets(n, eos_every, span, data):
    stream = stream_of(n, eos_every)
    max_tokens = data.draw(st.sampled_from([None, span, 3 * span]))
    lengths = data.draw(st.lists(st.integers(2, span), min_size=2, max_size=4))
    sets = [scored(nested_windows(stream, seq_len=t, span=span, tokenizer=TOK, max_tokens=max_tokens))
            for t in lengths + [span]]
    assert all(s == sets[-1] for s in sets), lengths
    # at the span itself the windows are eval_windows' own (same starts, same scored targets)
    assert sets[-1] == scored(eval_windows(stream, seq_len=span, tokenizer=TOK, max_tokens=max_tokens))


def test_whole_split_scores_each_target_once_and_windows_tile_spans():
    stream = stream_of(200, 1000)  # no EOS: every target but the first input's is scored
    ev = nested_windows(stream, seq_len=24, span=64, tokenizer=TOK)
    got = scored(ev)
    assert len(got) == len(set(got)) == len(stream) - 1
    assert ev.rows.shape[1] == 25
    # span 64 -> windows of 24, 24, 16 (the last one shorter): the tiling restarts at each span
    assert (ev.segment_ids[:3] > 0).sum(axis=1).tolist() == [25, 25, 17]


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError, match=r"seq_len=65 must be in \[1, span=64\]"):
        nested_windows(stream_of(100, 7), seq_len=65, span=64, tokenizer=TOK)
