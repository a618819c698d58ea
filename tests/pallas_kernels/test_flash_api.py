"""pallas_kernels.flash_attention: the block schedule and tile math, the reference oracle, validation and dispatch.

The schedule's block ranges (``pallas_kernels.schedule.BlockSchedule``) and jaxformer's
``MaskSpec.block_map`` (which marks its band rows with the schedule's interval functions) are each
checked against a brute-force dense mask, so neither can drift from the definition.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from jaxformer.ops import MaskSpec, xla_attention
from pallas_kernels.flash_attention import (
    BlockSizes,
    flash_attention,
    reference,
    tiles,
)
from pallas_kernels.flash_attention.blocks import _is_pow2, check_block_sizes
from pallas_kernels.flash_attention.tiles import Logits
from pallas_kernels.kernel_mask import KernelMask
from pallas_kernels.schedule import BlockSchedule
from pallas_kernels.shapes import check_window

windows = st.sampled_from([None, (0, 0), (3, None), (None, 2), (5, 1), (0, None), (None, None), (40, 40)])
offsets = st.sampled_from([None, 0, 3, -4, 11])


def kernel_mask(T, S, causal=False, window=None, offset=None) -> KernelMask:
    """A checked KernelMask's static fields (offset None: bottom-right)."""
    return KernelMask(T, S, causal=causal, window=check_window(window), q_offset=S - T if offset is None else offset)


def dense_np(T, S, causal, window, offset, q_seg=None, kv_seg=None, lengths=None):
    """[B|1, T, S] numpy mask from the definitions."""
    qp = (np.arange(T) + (S - T if offset is None else offset))[:, None]
    kp = np.arange(S)[None, :]
    ok = np.ones((1, T, S), bool)
    if causal:
        ok &= kp <= qp
    if window is not None:
        if window[0] is not None:
            ok &= kp >= qp - window[0]
        if window[1] is not None:
            ok &= kp <= qp + window[1]
    if q_seg is not None:
        ok = ok & (q_seg[:, :, None] == kv_seg[:, None, :])
    if lengths is not None:
        ok = ok & (kp[None] < lengths[:, None, None])
    return ok


@given(T=st.integers(1, 40), S=st.integers(1, 40), bq=st.sampled_from([1, 2, 4, 16]),
       bk=st.sampled_from([1, 4, 8, 32]), causal=st.booleans(), window=windows, offset=offsets)
def test_block_ranges_match_maskspec_block_map(T, S, bq, bk, causal, window, offset):
    live = MaskSpec(causal=causal, window=window, q_offset=offset).block_map(T, S, bq, bk)
    # a block is live iff the dense mask has a True in it (MaskSpec fields here are all static)
    ok = dense_np(T, S, causal, window, offset)[0]
    for i in range(live.shape[0]):
        for j in range(live.shape[1]):
            assert live[i, j] == ok[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any()
    sched = BlockSchedule(kernel_mask(T, S, causal, window, offset), bq, bk)
    np.testing.assert_array_equal(sched.range_map(), live)
    for i in range(live.shape[0]):
        lo, hi = sched.kv_range(i)
        row = np.zeros(live.shape[1], bool)
        row[max(lo, 0):max(hi, 0)] = True
        np.testing.assert_array_equal(row, live[i], err_msg=f"q block {i}: [{lo}, {hi})")
        ulo, uhi = sched.kv_full_range(i)
        for j in range(live.shape[1]):
            whole = ok[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].all() and (j + 1) * bk <= S
            assert whole == (ulo <= j < uhi), (i, j, ulo, uhi)
    for j in range(live.shape[1]):
        lo, hi = sched.q_range(j)
        col = np.zeros(live.shape[0], bool)
        col[max(lo, 0):max(hi, 0)] = True
        np.testing.assert_array_equal(col, live[:, j], err_msg=f"kv block {j}: [{lo}, {hi})")


def test_block_ranges_traced_equal_static():
    sched = BlockSchedule(kernel_mask(37, 53, causal=True, window=(9, 2), offset=5), 8, 16)
    for fn in (sched.kv_range, sched.q_range, sched.kv_full_range):
        for idx in range(4):
            static = fn(idx)
            traced = jax.jit(fn)(jnp.int32(idx))
            assert tuple(int(x) for x in traced) == tuple(static)


MASK_DRAWS = dict(T=st.integers(1, 12), S=st.integers(1, 12), causal=st.booleans(), window=windows, offset=offsets,
                  use_seg=st.booleans(), use_len=st.booleans(), seed=st.integers(0, 99))


# 4 drawn examples beside a pinned one with every mask feature on (each example evaluates MaskSpec.dense at new
# shapes, 0.2 s); the slow test below draws the profile's number (12; nightly 200)
@settings(max_examples=4)
@example(T=7, S=9, causal=True, window=(5, 1), offset=3, use_seg=True, use_len=True, seed=4)
@given(**MASK_DRAWS)
def test_kernel_mask_allowed_matches_dense(T, S, causal, window, offset, use_seg, use_len, seed):
    _check_kernel_mask(T, S, causal, window, offset, use_seg, use_len, seed)


@pytest.mark.slow  # 2.2 s: 12 draws; the test above draws 4 beside its pinned all-features example
@given(**MASK_DRAWS)
def test_kernel_mask_allowed_matches_dense_many(T, S, causal, window, offset, use_seg, use_len, seed):
    _check_kernel_mask(T, S, causal, window, offset, use_seg, use_len, seed)


def _check_kernel_mask(T, S, causal, window, offset, use_seg, use_len, seed):
    rng = np.random.default_rng(seed)
    B = 2
    q_seg = rng.integers(0, 2, (B, T)) if use_seg else None
    kv_seg = rng.integers(0, 2, (B, S)) if use_seg else None
    lengths = rng.integers(0, S + 1, (B,)) if use_len else None
    spec = MaskSpec(causal=causal, window=window, q_offset=offset, q_segment_ids=q_seg,
                    kv_segment_ids=kv_seg, kv_lengths=lengths)
    want = np.broadcast_to(np.asarray(spec.dense(T, S)), (B, T, S))
    m = kernel_mask(T, S, causal, window, offset)
    Sp = S + 3  # padded keys must be masked by the true length
    got = m.allowed(  # numpy in, numpy out: the rule is plain array math
        np.arange(T)[None, :, None] + m.q_offset, np.arange(Sp)[None, None, :],
        q_segment=None if q_seg is None else q_seg[:, :, None],
        kv_segment=None if kv_seg is None else np.pad(kv_seg, ((0, 0), (0, 3)))[:, None, :],
        kv_length=None if lengths is None else lengths[:, None, None])
    got = np.broadcast_to(got, (B, T, Sp))
    np.testing.assert_array_equal(got[:, :, :S], want)
    assert not got[:, :, S:].any()


def test_logits_tile_order_and_derivative():
    """scale -> softcap -> alibi; the returned derivative is d logits / d qk."""
    qk = jnp.linspace(-9.0, 9.0, 24).reshape(4, 6)
    q_pos, k_pos = jnp.arange(4)[:, None] + 2, jnp.arange(6)[None, :]
    s, ds = Logits(scale=0.5, softcap=2.0).tile(qk, q_pos, k_pos, 0.25)
    want = 2.0 * np.tanh(np.asarray(qk) * 0.5 / 2.0) - 0.25 * np.abs(np.asarray(q_pos - k_pos))
    np.testing.assert_allclose(s, want, rtol=1e-6, atol=1e-6)
    num = jax.vmap(jax.vmap(jax.grad(lambda x: 2.0 * jnp.tanh(0.5 * x / 2.0))))(qk)
    np.testing.assert_allclose(ds, num, rtol=1e-5, atol=1e-6)


def test_empty_rows_lse():
    m = jnp.array([-jnp.inf, 1.0])
    l = jnp.array([0.0, 2.0])
    lse = tiles.finalize_lse(m, l)
    assert lse[0] == tiles.EMPTY_ROW_LSE and jnp.exp(-3.0 - lse[0]) == 0.0
    np.testing.assert_allclose(lse[1], 1.0 + np.log(2.0), rtol=1e-6)


# --------------------------------------------------------------------------- reference oracle

# fp32 vs the dense xla reference: identical math, different contraction order -> 1e-5.
# Small programs: XLA's cheapest CPU backend settings keep compile time down.
FWD_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-4)


REFERENCE_DRAWS = dict(T=st.integers(1, 9), S=st.integers(1, 9), K=st.sampled_from([1, 2]), G=st.sampled_from([1, 2]),
                       causal=st.booleans(), window=st.sampled_from([None, (2, 1), (None, 0)]), offset=offsets,
                       use_seg=st.booleans(), use_len=st.booleans(), use_alibi=st.booleans(),
                       softcap=st.sampled_from([None, 3.0]), seed=st.integers(0, 99))


# the pinned example alone (each example jits two differentiated programs, ~0.5 s): it turns every feature on
# at once, so coverage does not hang on a draw; the slow test below draws 8.
@settings(phases=[Phase.explicit])
@example(T=7, S=9, K=2, G=2, causal=True, window=(2, 1), offset=3, use_seg=True, use_len=True, use_alibi=True,
         softcap=3.0, seed=4)
@given(**REFERENCE_DRAWS)
def test_reference_matches_xla_attention(T, S, K, G, causal, window, offset, use_seg, use_len, use_alibi,
                                         softcap, seed):
    """The pallas_kernels oracle agrees with jaxformer's dense path under MaskSpec.dense, with gradients."""
    _check_reference(T, S, K, G, causal, window, offset, use_seg, use_len, use_alibi, softcap, seed)


@pytest.mark.slow  # 4 s: 8 draws; the test above runs its pinned all-features example alone
@settings(max_examples=8)
@given(**REFERENCE_DRAWS)
def test_reference_matches_xla_attention_many(T, S, K, G, causal, window, offset, use_seg, use_len, use_alibi,
                                              softcap, seed):
    _check_reference(T, S, K, G, causal, window, offset, use_seg, use_len, use_alibi, softcap, seed)


def _check_reference(T, S, K, G, causal, window, offset, use_seg, use_len, use_alibi, softcap, seed):
    B, N, H = 2, K * G, 8
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal(sh, np.float32) for sh in ((B, T, N, H), (B, S, K, H), (B, S, K, H),
                                                                   (B, T, N, H)))
    seg = (rng.integers(0, 2, (B, T)), rng.integers(0, 2, (B, S))) if use_seg else (None, None)
    lengths = jnp.asarray(rng.integers(0, S + 1, (B,))) if use_len else None
    slopes = jnp.asarray(rng.uniform(0.1, 1.0, (N,)), jnp.float32) if use_alibi else None
    spec = MaskSpec(causal=causal, window=window, q_offset=offset, q_segment_ids=seg[0], kv_segment_ids=seg[1],
                    kv_lengths=lengths)

    def ours(q, k, v):
        return reference(q, k, v, causal=causal, window=window, q_offset=offset, q_segment_ids=seg[0],
                         kv_segment_ids=seg[1], kv_lengths=lengths, alibi_slopes=slopes, softcap=softcap)

    def theirs(q, k, v):
        return xla_attention(q, k, v, mask=spec, alibi_slopes=slopes, softcap=softcap)

    def both(q, k, v, do):
        o1, vjp1 = jax.vjp(ours, q, k, v)
        o2, vjp2 = jax.vjp(theirs, q, k, v)
        return o1, o2, vjp1(do), vjp2(do)

    o1, o2, g1, g2 = jax.jit(both)(q, k, v, do)
    np.testing.assert_allclose(o1, o2, **FWD_TOL)
    for a, b in zip(g1, g2):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(a, b, **GRAD_TOL)


def test_reference_lse_and_empty_rows():
    q = jnp.ones((1, 3, 1, 4))
    k = v = jnp.ones((1, 5, 1, 4))
    out, lse = reference(q, k, v, kv_lengths=jnp.array([0]), return_lse=True)
    assert (out == 0).all() and jnp.isinf(lse).all() and (lse > 0).all()
    out, lse = reference(q, k, v, return_lse=True)
    np.testing.assert_allclose(lse, np.full((1, 1, 3), 4 * 0.5 + np.log(5)), rtol=1e-6)


# --------------------------------------------------------------------------- validation & dispatch


def _qkv(B=1, T=8, S=8, N=2, K=1, H=16, dtype=jnp.float32):
    return jnp.zeros((B, T, N, H), dtype), jnp.zeros((B, S, K, H), dtype), jnp.zeros((B, S, K, H), dtype)


@pytest.mark.parametrize("kwargs, shapes, match", [
    (dict(), dict(H=300), "head dim H=300"),
    (dict(), dict(N=3, K=2), "heads 3 not divisible by kv heads 2"),
    (dict(), dict(dtype=jnp.int32), "dtype=int32"),
    (dict(block_sizes=BlockSizes(24, 16)), dict(), "block_q=24 must be a power of two"),
    (dict(block_sizes=BlockSizes(16, 8)), dict(), "block_k=8 is below the minimum 16"),
    (dict(block_sizes=BlockSizes(16, 16, block_k_dq=0)), dict(), "block_k_dq=0 must be a positive int"),
    (dict(block_sizes=BlockSizes(512, 512)), dict(H=256), "need .* bytes"),
    (dict(q_segment_ids=jnp.zeros((1, 7), jnp.int32), kv_segment_ids=jnp.zeros((1, 8), jnp.int32)), dict(),
     r"q_segment_ids.shape=\(1, 7\) must be \(B, T\)=\(1, 8\)"),
    (dict(q_segment_ids=jnp.zeros((1, 8), jnp.int32), kv_segment_ids=jnp.zeros((1, 9), jnp.int32)), dict(),
     r"kv_segment_ids.shape=\(1, 9\) must be \(B, S\)=\(1, 8\)"),
    (dict(q_segment_ids=jnp.zeros((1, 8), jnp.int32)), dict(), "pass both q_segment_ids"),
    (dict(q_segment_ids=jnp.zeros((1, 8)), kv_segment_ids=jnp.zeros((1, 8))), dict(), "must be an integer type"),
    (dict(kv_lengths=jnp.zeros((2,), jnp.int32)), dict(), r"kv_lengths.shape=\(2,\) must be \(B,\)=\(1,\)"),
    (dict(q_offset=jnp.int32(3)), dict(), "q_offset must be a static Python int"),
    (dict(alibi_slopes=jnp.zeros((3,))), dict(), r"alibi_slopes.shape=\(3,\)"),
    (dict(window=(-1, 2)), dict(), "non-negative"),
    (dict(softcap=-1.0), dict(), "softcap=-1.0"),
    (dict(softcap=True), dict(), "softcap=True must be a positive float"),
    (dict(backend="cuda"), dict(), "backend='cuda' is not one of"),
])
@pytest.mark.no_typecheck
def test_bad_input_raises(kwargs, shapes, match):
    q, k, v = _qkv(**shapes)
    kwargs = dict(interpret=True, backend="gpu") | kwargs
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v, **kwargs)


@pytest.mark.no_typecheck  # the annotations say `float`; NumPy's float32 is taken as scale always was
def test_a_numpy_float_softcap_is_a_float():
    """``softcap=np.float32(5)`` (as ``scale`` already was) is taken as 5.0, not refused as 'not a positive float'."""
    from pallas_kernels.flash_attention.checks import check_logits
    from pallas_kernels.flash_attention.tiles import Logits

    got = check_logits(Logits(scale=np.float32(0.5), softcap=np.float32(5.0)), 1, 2, 16)
    assert (got.scale, got.softcap) == (0.5, 5.0) and type(got.softcap) is float


def test_auto_backend_on_cpu_needs_interpret():
    assert jax.default_backend() == "cpu"
    with pytest.raises(ValueError, match="pass interpret=True"):
        flash_attention(*_qkv())


def test_block_sizes_defaults_and_clipping():
    for backend in ("gpu", "tpu"):
        bs = BlockSizes.default(backend).resolved()
        assert all(_is_pow2(x) for x in bs.as_dict().values())
    with pytest.raises(ValueError, match="backend='npu'"):
        BlockSizes.default("npu")
    bs = BlockSizes(64, 128, block_q_dkv=32).clipped(T=20, S=5, minimum=16)
    assert (bs.block_q, bs.block_k, bs.block_q_dkv, bs.block_k_dkv, bs.block_q_dq) == (32, 16, 32, 16, 32)


def test_auto_interpret_dispatches_to_gpu_kernel():
    """backend="auto" + interpret on CPU runs the GPU kernel: it matches the reference (fp32 tolerance)."""
    B, T, S, N, K, H = 1, 20, 20, 2, 1, 16
    rng = np.random.default_rng(7)
    q = rng.standard_normal((B, T, N, H), np.float32)
    k, v = rng.standard_normal((2, B, S, K, H), np.float32)
    fn = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=True, block_sizes=BlockSizes(16, 16)))
    got = fn(q, k, v)
    np.testing.assert_allclose(got, reference(q, k, v, causal=True), **FWD_TOL)


def test_default_gpu_blocks_fit_every_head_dim():
    from pallas_kernels.flash_attention.gpu import MAX_TILE_BYTES, MIN_BLOCK

    for H in (16, 64, 128, 256):
        for itemsize in (2, 4):
            bs = BlockSizes.default("gpu").fit(H, itemsize, MAX_TILE_BYTES, MIN_BLOCK)
            check_block_sizes(bs, minimum=MIN_BLOCK, H=H, itemsize=itemsize, max_tile_bytes=MAX_TILE_BYTES)


def test_kernel_mask_is_a_pytree_of_its_operands():
    """The operands are the leaves (jit traces them), the static fields ride along, static() is hashable."""
    seg = np.array([[0, 0, 1]], np.int32)
    m = KernelMask(3, 3, causal=True, window=(1, 0), q_offset=0, q_segment_ids=seg, kv_segment_ids=seg,
                   kv_lengths=np.array([2], np.int32))
    leaves, tree = jax.tree_util.tree_flatten(m)
    assert len(leaves) == 3
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert (back.causal, back.window, back.q_len) == (True, (1, 0), 3)
    st_ = m.static()
    assert st_.q_segment_ids == (1, 3) and st_.q_global is None and hash(st_) == hash(m.static())
    got = jax.jit(lambda mm: mm.allowed(jnp.arange(3)[:, None], jnp.arange(3)[None, :],
                                        q_segment=mm.q_segment_ids[0][:, None],
                                        kv_segment=mm.kv_segment_ids[0][None, :], kv_length=mm.kv_lengths[0]))(m)
    want = dense_np(3, 3, True, (1, 0), 0, seg, seg, np.array([2]))[0]
    np.testing.assert_array_equal(got, want)


def test_block_lists_repeat_the_last_tile():
    """Padding a row's list repeats its last tile (0 for an empty row), so a prefetching walk fetches nothing new."""
    from pallas_kernels.schedule import block_lists

    live = np.array([[[True, False, True, False], [False, False, False, False], [False, True, False, False]]])
    idx, count = block_lists(live)
    np.testing.assert_array_equal(idx, [[[0, 2], [0, 0], [1, 1]]])
    np.testing.assert_array_equal(count, [[2, 0, 1]])
