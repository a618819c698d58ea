"""MaskSpec.dense / dense_heads against a per-element Python reading of the definition; block_map exactness."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxformer.ops.masks import MaskSpec, RandomBlocks
from pallas_kernels.schedule import block_lists

# Half the profile's draws (6 in the default run, 100 nightly): each draw compiles the mask's ops for new shapes.
HALF = settings(max_examples=max(1, settings.default.max_examples // 2))


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


@HALF  # 12 -> 6 draws: 1 s
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


@HALF  # 12 -> 6 draws: 1 s
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


@pytest.mark.parametrize("impl", ["xla", "blockwise", "pallas"])
def test_kv_segments_without_q_segments_are_refused_by_every_path(impl):
    from jaxformer.ops import dot_product_attention

    q = k = v = np.zeros((2, 4, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"kv_segment_ids \(2, 4\) given without q_segment_ids"):
        dot_product_attention(q, k, v, mask=MaskSpec(kv_segment_ids=np.zeros((2, 4))), impl=impl)


def test_q_segments_without_kv_segments_need_square():
    with pytest.raises(ValueError, match="T=4 != S=6"):
        MaskSpec(q_segment_ids=np.zeros((2, 4))).validate(2, 4, 6)


@pytest.mark.parametrize("window", [(1,), (-1, 2), (1.5, 2)])
@pytest.mark.no_typecheck
def test_bad_window(window):
    with pytest.raises(ValueError, match="window"):
        MaskSpec(window=window)


# --------------------------------------------------------------------------- Longformer / BigBird patterns


def loop_pattern_mask(T, S, *, causal, window, glob, rblocks, offset, lengths, B, heads):
    """``[B, heads, T, S]`` one element at a time: hard constraints AND (band OR global q/k OR random block)."""
    off = S - T if offset is None else offset
    out = np.zeros((B, heads, T, S), bool)
    R = None if rblocks is None else rblocks.block_size
    for b in range(B):
        g = set() if glob is None else set(int(p) for p in np.atleast_2d(glob)[b % len(np.atleast_2d(glob))] if p >= 0)
        for h in range(heads):
            for i in range(T):
                qp = off + i
                if R is not None:
                    chosen = set(rblocks.table(qp // R, qp // R + 1, -(-S // R))[h % rblocks.heads, 0].tolist())
                for j in range(S):
                    left, right = window
                    band = (left is None or j >= qp - left) and (right is None or j <= qp + right)
                    if window != (None, None):
                        band = band or qp in g or j in g or (R is not None and j // R in chosen)
                    ok = band and (not causal or j <= qp) and (lengths is None or j < lengths[b])
                    out[b, h, i, j] = ok
    return out


def dense_heads(spec, T, S):
    """``spec.dense_heads`` in one jitted program (eager op-by-op dispatch compiles every op)."""
    return jax.jit(lambda s: s.dense_heads(T, S))(spec)


pattern_specs = dict(
    T=st.integers(1, 24), S=st.integers(1, 24), B=st.integers(1, 2), causal=st.booleans(),
    left=st.one_of(st.none(), st.integers(0, 6)), right=st.one_of(st.none(), st.integers(0, 6)),
    globals_kind=st.sampled_from(["none", "shared", "per_batch"]), random_kind=st.sampled_from(["none", "shared", "per_head"]),
    offset=st.one_of(st.none(), st.integers(0, 6)), seed=st.integers(0, 2**16),
)


def _pattern_spec(T, S, B, causal, left, right, globals_kind, random_kind, offset, seed, lengths=None):
    rng = np.random.default_rng(seed)
    glob = {"none": None, "shared": rng.integers(0, 26, (2,)), "per_batch": rng.integers(-1, 26, (B, 3))}[globals_kind]
    rblocks = None if random_kind == "none" else RandomBlocks(
        int(rng.integers(0, 4)), int(rng.integers(1, 7)), seed=int(rng.integers(0, 99)),
        num_heads=3 if random_kind == "per_head" else None)
    spec = MaskSpec(causal=causal, window=(left, right), global_tokens=glob, random_blocks=rblocks,
                    q_offset=offset, kv_lengths=lengths)
    return spec, glob, rblocks


@HALF  # 12 -> 6 draws: 2 s
@given(**pattern_specs)
def test_dense_heads_matches_pattern_definition(T, S, B, causal, left, right, globals_kind, random_kind, offset, seed):
    lengths = np.random.default_rng(seed + 1).integers(0, S + 1, (B,))
    spec, glob, rblocks = _pattern_spec(T, S, B, causal, left, right, globals_kind, random_kind, offset, seed, lengths)
    got = np.broadcast_to(np.asarray(dense_heads(spec, T, S)), (B, spec.num_heads, T, S))
    want = loop_pattern_mask(T, S, causal=causal, window=(left, right), glob=glob, rblocks=rblocks, offset=offset,
                             lengths=lengths, B=B, heads=spec.num_heads)
    np.testing.assert_array_equal(got, want)
    if spec.num_heads == 1:
        np.testing.assert_array_equal(np.broadcast_to(np.asarray(spec.dense(T, S)), (B, T, S)), want[:, 0])


@HALF  # 12 -> 6 draws: 0.5 s
@given(bq=st.sampled_from([1, 3, 4, 8]), bk=st.sampled_from([1, 2, 4, 8]), **pattern_specs)
def test_block_map_is_exact_with_patterns(bq, bk, T, S, B, causal, left, right, globals_kind, random_kind, offset,
                                          seed):
    """Union over sequences (and heads): a block is live iff some element in it is allowed."""
    spec, _, _ = _pattern_spec(T, S, B, causal, left, right, globals_kind, random_kind, offset, seed)
    dense = np.asarray(dense_heads(spec, T, S)).any(axis=0)  # [heads, T, S]
    nq, nk = -(-T // bq), -(-S // bk)

    def blocks(d):
        return np.array([[[d[h, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any() for j in range(nk)]
                          for i in range(nq)] for h in range(d.shape[0])])

    np.testing.assert_array_equal(spec.block_map(T, S, bq, bk, per_head=True), blocks(dense))
    np.testing.assert_array_equal(spec.block_map(T, S, bq, bk), blocks(dense).any(axis=0))
    # global_rows=False: rows of queries global in every sequence are left out, the rest stays exact
    qp = spec.static_offset(T, S) + np.arange(T)
    g = spec.global_array
    everywhere = np.zeros(T, bool) if g is None or not spec.patterns_active else np.all(
        [np.isin(qp, row) for row in g], axis=0)
    np.testing.assert_array_equal(spec.block_map(T, S, bq, bk, per_head=True, global_rows=False),
                                  blocks(dense & ~everywhere[None, :, None]))


def test_random_blocks_draw():
    rb = RandomBlocks(num_blocks=3, block_size=4, seed=7, num_heads=2)
    tbl = rb.table(0, 50, 20)
    assert tbl.shape == (2, 50, 3) and tbl.min() >= 0 and tbl.max() < 20
    assert (np.diff(tbl, axis=-1) > 0).all(), "distinct, ascending"
    np.testing.assert_array_equal(rb.table(10, 20, 20), tbl[:, 10:20])  # a row does not depend on the range asked
    assert (tbl[0] != tbl[1]).any(), "heads draw differently"
    assert (RandomBlocks(3, 4, seed=8).table(0, 50, 20) != RandomBlocks(3, 4, seed=7).table(0, 50, 20)).any()
    assert RandomBlocks(30, 4).table(0, 2, 5).shape == (1, 2, 5)  # more blocks asked than exist: all of them
    counts = np.bincount(RandomBlocks(3, 4, seed=1).table(0, 2000, 20).ravel(), minlength=20)
    assert counts.min() > 0.8 * 300 and counts.max() < 1.2 * 300  # uniform over key blocks (6000 draws / 20)


def test_pattern_is_the_same_for_a_chunk_with_an_offset():
    """Absolute positions: a query chunk at q_offset sees exactly the rows of the full mask."""
    spec = dict(causal=True, window=(3, 0), global_tokens=[2, 13], random_blocks=RandomBlocks(2, 4, seed=5))
    # one jitted program each (eager op-by-op dispatch compiles every op); the specs are constants of the program
    full = np.asarray(jax.jit(lambda: MaskSpec(**spec).dense(20, 20))()[0])
    chunk = np.asarray(jax.jit(lambda: MaskSpec(**spec, q_offset=8).dense(5, 20))()[0])
    np.testing.assert_array_equal(chunk, full[8:13])


def test_patterns_without_window_change_nothing():
    spec = MaskSpec(causal=True, global_tokens=[3], random_blocks=RandomBlocks(1, 2))
    np.testing.assert_array_equal(spec.dense(6, 6), MaskSpec(causal=True).dense(6, 6))
    assert spec.has_pattern and not spec.patterns_active


def test_spec_with_patterns_is_a_pytree():
    spec = MaskSpec(window=(1, 1), global_tokens=[[0, 4], [2, -1]], random_blocks=RandomBlocks(1, 2, seed=3),
                    kv_lengths=np.array([5, 6]))
    out = jax.jit(lambda s: s.dense(6, 6))(spec)
    np.testing.assert_array_equal(out, spec.dense(6, 6))
    assert jax.tree_util.tree_map(lambda x: x, spec).global_tokens == ((0, 4), (2, -1))


def test_block_lists_with_pad():
    live = np.array([[True, False, True, False], [False, False, False, False], [False, True, True, True]])
    idx, count = block_lists(live, pad=4)
    np.testing.assert_array_equal(idx, [[0, 2, 4], [4, 4, 4], [1, 2, 3]])
    np.testing.assert_array_equal(count, [2, 0, 3])


@pytest.mark.parametrize("kwargs, match", [
    (dict(global_tokens=[[0], [1], [2]]), r"global_tokens.shape=\(3, 1\).*B=2"),
    (dict(random_blocks=RandomBlocks(1, 2), q_offset=np.zeros((2,), np.int32)), r"random_blocks needs a static q_offset"),
])
def test_validate_patterns(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MaskSpec(**kwargs).validate(2, 4, 6)


def test_validate_random_heads():
    with pytest.raises(ValueError, match=r"num_heads=4 does not match the query heads N=8"):
        MaskSpec(random_blocks=RandomBlocks(1, 2, num_heads=4)).validate(1, 4, 4, 8)
    with pytest.raises(ValueError, match=r"dense_heads"):
        MaskSpec(window=(1, 1), random_blocks=RandomBlocks(1, 2, num_heads=4)).dense(4, 4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(global_tokens=[0.5, 2.0]), r"global_tokens must be int positions"),
    (dict(global_tokens=np.zeros((1, 2, 3), np.int32)), r"global_tokens must be int positions"),
    (dict(random_blocks=(1, 2)), r"random_blocks must be a RandomBlocks"),
])
@pytest.mark.no_typecheck
def test_bad_pattern_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MaskSpec(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_blocks=-1, block_size=2), r"num_blocks=-1"),
    (dict(num_blocks=1, block_size=0), r"block_size=0"),
    (dict(num_blocks=1, block_size=2, num_heads=0), r"num_heads=0"),
    (dict(num_blocks=1, block_size=2, seed=1.5), r"seed=1.5"),
])
@pytest.mark.no_typecheck
def test_bad_random_blocks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RandomBlocks(**kwargs)


def test_traced_global_tokens_are_refused():
    with pytest.raises(ValueError, match="global_tokens must be static"):
        jax.jit(lambda g: MaskSpec(global_tokens=g))(jnp.array([0, 1]))
