"""MaskSpec.dense against a per-element Python reading of its definition; block_map soundness."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxformer.ops.masks import MaskSpec


def loop_mask(T, S, *, causal=False, window=None, q_seg=None, kv_seg=None, lengths=None, offset=None, B=1):
    """Definition, one element at a time (independent of MaskSpec's vectorised code)."""
    out = np.zeros((B, T, S), bool)
    for b in range(B):
        off = (S - T) if offset is None else (offset[b] if np.ndim(offset) else offset)
        for i in range(T):
            qp = off + i
            for j in range(S):
                ok = True
                if causal and j > qp:
                    ok = False
                if window is not None:
                    left, right = window
                    if left is not None and j < qp - left:
                        ok = False
                    if right is not None and j > qp + right:
                        ok = False
                if q_seg is not None and q_seg[b, i] != kv_seg[b, j]:
                    ok = False
                if lengths is not None and j >= lengths[b]:
                    ok = False
                out[b, i, j] = ok
    return out


def test_causal_square_is_lower_triangular():
    np.testing.assert_array_equal(MaskSpec(causal=True).dense(5, 5)[0], np.tril(np.ones((5, 5), bool)))


def test_causal_bottom_right_when_t_ne_s():
    d = np.asarray(MaskSpec(causal=True).dense(3, 7)[0])
    assert d[-1].all(), "the last query sees every key"
    assert d[0].sum() == 5


@given(
    T=st.integers(1, 9), S=st.integers(1, 9), B=st.integers(1, 3),
    causal=st.booleans(),
    left=st.one_of(st.none(), st.integers(0, 6)), right=st.one_of(st.none(), st.integers(0, 6)),
    use_window=st.booleans(), use_seg=st.booleans(), use_len=st.booleans(),
    offset_kind=st.sampled_from(["none", "int", "array"]), seed=st.integers(0, 2**16),
)
def test_dense_matches_definition(T, S, B, causal, left, right, use_window, use_seg, use_len, offset_kind, seed):
    rng = np.random.default_rng(seed)
    window = (left, right) if use_window else None
    q_seg = rng.integers(0, 3, (B, T)) if use_seg else None
    kv_seg = rng.integers(0, 3, (B, S)) if use_seg else None
    lengths = rng.integers(0, S + 1, (B,)) if use_len else None
    offset = {"none": None, "int": int(rng.integers(0, 5)), "array": rng.integers(0, 5, (B,))}[offset_kind]
    spec = MaskSpec(causal=causal, window=window, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                    kv_lengths=lengths, q_offset=offset)
    got = np.broadcast_to(np.asarray(spec.dense(T, S)), (B, T, S))
    want = loop_mask(T, S, causal=causal, window=window, q_seg=q_seg, kv_seg=kv_seg,
                     lengths=lengths, offset=offset, B=B)
    np.testing.assert_array_equal(got, want)


@given(T=st.integers(1, 40), S=st.integers(1, 40), bq=st.sampled_from([1, 4, 8, 16]),
       bk=st.sampled_from([1, 4, 8, 16]), causal=st.booleans(),
       left=st.one_of(st.none(), st.integers(0, 20)), right=st.one_of(st.none(), st.integers(0, 20)),
       offset=st.one_of(st.none(), st.integers(0, 10)))
def test_block_map_is_exact_for_static_fields(T, S, bq, bk, causal, left, right, offset):
    """A block is live iff some element in it is allowed: sound (never drops work) and tight."""
    spec = MaskSpec(causal=causal, window=(left, right), q_offset=offset)
    dense = np.asarray(spec.dense(T, S)[0])
    live = spec.block_map(T, S, bq, bk)
    nq, nk = -(-T // bq), -(-S // bk)
    want = np.array([[dense[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any() for j in range(nk)] for i in range(nq)])
    np.testing.assert_array_equal(live, want)


def test_block_map_none_for_traced_offset():
    assert MaskSpec(causal=True, q_offset=np.array([1, 2])).block_map(4, 8, 2, 2) is None


def test_q_segment_ids_reused_for_keys_when_square():
    seg = np.array([[0, 0, 1, 1]])
    d = np.asarray(MaskSpec(q_segment_ids=seg).dense(4, 4)[0])
    np.testing.assert_array_equal(d, seg[0][:, None] == seg[0][None, :])


@pytest.mark.parametrize("kwargs, match", [
    (dict(q_segment_ids=np.zeros((2, 3))), r"q_segment_ids.shape=\(2, 3\).*\(2, 4\)"),
    (dict(q_segment_ids=np.zeros((2, 4)), kv_segment_ids=np.zeros((2, 5))), r"kv_segment_ids.shape=\(2, 5\).*\(2, 6\)"),
    (dict(kv_lengths=np.zeros((3,))), r"kv_lengths.shape=\(3,\).*B=2"),
    (dict(q_offset=np.zeros((3,), np.int32)), r"q_offset.shape=\(3,\)"),
])
def test_validate_names_shapes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MaskSpec(**kwargs).validate(2, 4, 6)


def test_q_segments_without_kv_segments_need_square():
    with pytest.raises(ValueError, match="T=4 != S=6"):
        MaskSpec(q_segment_ids=np.zeros((2, 4))).validate(2, 4, 6)


@pytest.mark.parametrize("window", [(1,), (-1, 2), (1.5, 2)])
def test_bad_window(window):
    with pytest.raises(ValueError, match="window"):
        MaskSpec(window=window)
