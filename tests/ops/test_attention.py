"""dot_product_attention (xla path) against a float64 reference and the Transformer's known properties."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from jaxformer.ops import MaskSpec, dot_product_attention
from tests.draws import few_draws


def numpy_attention(q, k, v, allowed, *, scale=None, slopes=None, softcap=None, q_pos=None):
    """Float64 numpy reference: K/V repeated to N heads, explicit softmax, masked rows -> 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    k = np.repeat(k, N // K, axis=2)
    v = np.repeat(v, N // K, axis=2)
    scale = 1 / math.sqrt(H) if scale is None else scale
    s = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if slopes is not None:
        qp = np.arange(T) + (S - T) if q_pos is None else q_pos
        s = s - np.asarray(slopes, np.float64)[None, :, None, None] * np.abs(qp[:, None] - np.arange(S)[None, :])
    allowed = np.broadcast_to(np.asarray(allowed)[:, None], s.shape)
    s = np.where(allowed, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    d = p.sum(-1, keepdims=True)
    w = p / np.where(d == 0, 1, d)
    return np.einsum("bnts,bsnh->btnh", w, v)


def rand(shape, seed):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# fp32 attention vs float64 numpy: errors are O(1e-6); 2e-5 leaves room for accumulation order.
TOL = dict(rtol=2e-5, atol=2e-5)
# Each draw compiles new shapes (~0.6 s); the pinned examples turn every feature on.
DRAWS = few_draws()


@DRAWS  # 12 -> 1 draw: 6 s
@example(B=2, T=7, S=9, K=2, G=3, H=8, causal=True, window=(3, 0), use_seg=True, use_len=True, use_alibi=True,
         softcap=5.0, seed=1)  # every feature at once
@example(B=1, T=9, S=5, K=1, G=3, H=4, causal=False, window=(None, 1), use_seg=False, use_len=True, use_alibi=True,
         softcap=None, seed=2)  # one-sided window, T > S (queries aligned to the end of the keys)
@given(B=st.integers(1, 2), T=st.integers(1, 9), S=st.integers(1, 9), K=st.sampled_from([1, 2]),
       G=st.sampled_from([1, 3]), H=st.sampled_from([4, 8]), causal=st.booleans(),
       window=st.sampled_from([None, (2, 1), (0, 0), (3, None), (None, 1), (1, 4)]), use_seg=st.booleans(),
       use_len=st.booleans(), use_alibi=st.booleans(), softcap=st.sampled_from([None, 5.0]),
       seed=st.integers(0, 1000))
def test_forward_matches_float64(B, T, S, K, G, H, causal, window, use_seg, use_len, use_alibi, softcap, seed):
    N = K * G
    rng = np.random.default_rng(seed)
    q, k, v = rand((B, T, N, H), seed), rand((B, S, K, H), seed + 1), rand((B, S, K, H), seed + 2)
    mask = MaskSpec(
        causal=causal, window=window,
        q_segment_ids=rng.integers(0, 2, (B, T)) if use_seg else None,
        kv_segment_ids=rng.integers(0, 2, (B, S)) if use_seg else None,
        kv_lengths=rng.integers(0, S + 1, (B,)) if use_len else None,
    )
    slopes = rng.uniform(0.05, 1.0, (N,)).astype(np.float32) if use_alibi else None
    attend = jax.jit(lambda q, k, v, mask, slopes: dot_product_attention(
        q, k, v, mask=mask, alibi_slopes=slopes, softcap=softcap, impl="xla"))
    out = attend(q, k, v, mask, slopes)
    want = numpy_attention(q, k, v, mask.dense(T, S), slopes=slopes, softcap=softcap)
    np.testing.assert_allclose(out, want, **TOL)
    assert np.isfinite(np.asarray(out)).all()


def test_gradients_match_float64_reference():
    """Gradients of the fp32 path vs jax.grad of a float64 naive formulation (repeat K/V, jax.nn.softmax)."""
    B, T, S, N, K, H = 2, 6, 8, 4, 2, 8
    q, k, v = rand((B, T, N, H), 0), rand((B, S, K, H), 1), rand((B, S, K, H), 2)
    mask = MaskSpec(causal=True, kv_lengths=np.array([8, 5]))
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    allowed = np.asarray(mask.dense(T, S))
    ct = rand((B, T, N, H), 3)

    def ours(q, k, v):
        return jnp.sum(dot_product_attention(q, k, v, mask=mask, alibi_slopes=slopes, impl="xla") * ct)

    with jax.enable_x64(True):
        def naive(q, k, v):
            kr, vr = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
            s = jnp.einsum("btnh,bsnh->bnts", q, kr) / math.sqrt(H)
            dist = jnp.abs((jnp.arange(T) + S - T)[:, None] - jnp.arange(S)[None, :])
            s = s - jnp.asarray(slopes, jnp.float64)[None, :, None, None] * dist[None, None]
            w = jax.nn.softmax(jnp.where(allowed[:, None], s, -1e30), axis=-1)
            return jnp.sum(jnp.einsum("bnts,bsnh->btnh", w, vr) * jnp.asarray(ct, jnp.float64))

        want = jax.jit(jax.grad(naive, argnums=(0, 1, 2)))(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, np.asarray(w), rtol=1e-4, atol=1e-5)  # fp32 backward vs fp64


def test_fully_masked_rows_are_zero_with_zero_gradients():
    B, T, S, N, H = 1, 4, 4, 2, 4
    q, k, v = rand((B, T, N, H), 0), rand((B, S, N, H), 1), rand((B, S, N, H), 2)
    # query 0 has segment 7, which no key has: its row is fully masked.
    mask = MaskSpec(q_segment_ids=np.array([[7, 1, 1, 1]]), kv_segment_ids=np.array([[1, 1, 1, 1]]))
    out = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, mask=mask, impl="xla"))(q, k, v)
    assert np.all(np.asarray(out[:, 0]) == 0)
    dq, dk, dv = jax.jit(jax.grad(lambda q, k, v: jnp.sum(dot_product_attention(q, k, v, mask=mask, impl="xla")),
                                  argnums=(0, 1, 2)))(q, k, v)
    for g in (dq, dk, dv):
        assert np.isfinite(np.asarray(g)).all()
    assert np.all(np.asarray(dq[:, 0]) == 0)


def test_softmax_rows_sum_to_one():
    q, k, v = rand((2, 5, 4, 8), 0), rand((2, 7, 4, 8), 1), rand((2, 7, 4, 8), 2)
    _, w = dot_product_attention(q, k, v, mask=MaskSpec(causal=True), return_weights=True)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, atol=1e-6)


# 0.8 s; the same property of the same (dense) path through a model is test_transformer's
# test_encoder_permutation_equivariance_only_without_positions[none] (default-run)
@pytest.mark.slow
def test_permutation_equivariance_without_positions():
    """Swapping two tokens (queries and keys together) swaps the outputs: attention has no notion of order."""
    x = rand((1, 6, 2, 8), 0)
    perm = np.array([0, 4, 2, 3, 1, 5])
    out = dot_product_attention(x, x, x, impl="xla")
    out_p = dot_product_attention(x[:, perm], x[:, perm], x[:, perm], impl="xla")
    np.testing.assert_allclose(out_p, out[:, perm], atol=1e-6)


# 1 s; the same claim read off the library's logits (test_unit_variance_...) and the 1/sqrt(H) of the float64
# references (test_forward_matches_float64) are default-run tests
@pytest.mark.slow
def test_scaling_keeps_score_variance_near_one():
    """q, k ~ N(0, 1): q.k has variance H; the default 1/sqrt(H) scaling brings it to ~1."""
    H = 64
    q, k = rand((1, 256, 1, H), 0), rand((1, 512, 1, H), 1)
    raw = jnp.einsum("BTNH,BSNH->BNTS", q, k)
    _, w = dot_product_attention(q, k, jnp.zeros_like(k), return_weights=True)
    # the weights the library computes are the softmax of raw/sqrt(H): recover its logits up to a row constant
    logits = jnp.log(w)
    logits = logits - logits.mean(-1, keepdims=True)
    np.testing.assert_allclose(logits, (raw - raw.mean(-1, keepdims=True)) / math.sqrt(H), atol=1e-3)
    # the claim, read off the library's own weights: its scores have variance ~1, where q.k has ~H
    ours = float(jnp.var(logits))
    assert 0.85 < ours < 1.15
    assert float(jnp.var(raw - raw.mean(-1, keepdims=True))) / ours == pytest.approx(H, rel=1e-3)


# 0.8 s; the same property through the models' attention is test_transformer's
# test_causal_output_at_t_ignores_later_tokens, and causal masks against float64 are this file's (default-run)
@pytest.mark.slow
def test_causal_output_ignores_future_tokens():
    q, k, v = rand((1, 8, 2, 4), 0), rand((1, 8, 2, 4), 1), rand((1, 8, 2, 4), 2)
    t = 4
    k2 = k.at[:, t + 1:].set(rand((1, 3, 2, 4), 9))
    v2 = v.at[:, t + 1:].set(rand((1, 3, 2, 4), 8))
    mask = MaskSpec(causal=True)
    a = dot_product_attention(q, k, v, mask=mask)
    b = dot_product_attention(q, k2, v2, mask=mask)
    np.testing.assert_array_equal(a[:, :t + 1], b[:, :t + 1])
    assert not np.allclose(a[:, t + 1:], b[:, t + 1:])


# 1 s; the same comparison through the attention module is tests/nn/test_modules.py's
# test_gqa_with_k_equal_n_is_mha_and_gqa_equals_mha_with_repeated_kv_weights, and GQA against float64 with K/V
# repeated is test_forward_matches_float64's and test_gradients_match_float64_reference's (default-run)
@pytest.mark.slow
def test_gqa_equals_mha_with_repeated_kv():
    q, k, v = rand((2, 5, 6, 8), 0), rand((2, 5, 2, 8), 1), rand((2, 5, 2, 8), 2)
    gqa = dot_product_attention(q, k, v, mask=MaskSpec(causal=True))
    mha = dot_product_attention(q, jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2), mask=MaskSpec(causal=True))
    np.testing.assert_allclose(gqa, mha, atol=1e-6)


@pytest.mark.slow  # 2 s; the same path (GQA, causal) against float64 numpy is test_forward_matches_float64
def test_matches_jax_nn_dot_product_attention():
    """A second, external oracle: JAX's own reference implementation."""
    q, k, v = rand((2, 7, 4, 16), 0), rand((2, 7, 2, 16), 1), rand((2, 7, 2, 16), 2)
    ours = dot_product_attention(q, k, v, mask=MaskSpec(causal=True))
    theirs = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


# 0.7 s; the bias path equals the float64-checked ALiBi path in tests/ops/test_positional.py's
# test_alibi_bias_agrees_with_attention_alibi (default-run)
@pytest.mark.slow
def test_bias_is_added_to_logits():
    q, k, v = rand((1, 3, 2, 4), 0), rand((1, 5, 2, 4), 1), rand((1, 5, 2, 4), 2)
    bias = np.asarray(rand((1, 2, 3, 5), 3))
    out = dot_product_attention(q, k, v, bias=bias)
    s = np.einsum("btnh,bsnh->bnts", np.asarray(q, np.float64), np.asarray(k, np.float64)) / 2 + bias
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    np.testing.assert_allclose(out, np.einsum("bnts,bsnh->btnh", w, np.asarray(v, np.float64)), atol=1e-5)


def test_jit_and_bf16():
    q, k, v = (rand(s, i).astype(jnp.bfloat16) for i, s in enumerate([(1, 16, 4, 8), (1, 16, 2, 8), (1, 16, 2, 8)]))
    out = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, mask=MaskSpec(causal=True)))(q, k, v)
    assert out.dtype == jnp.bfloat16
    want = numpy_attention(q, k, v, MaskSpec(causal=True).dense(16, 16))
    # The reference sees the same bf16-rounded inputs; the error is p and the output rounded to bf16
    # (2^-9 relative): measured 6.1e-3, bound 1.2e-2.
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=1.2e-2)


@pytest.mark.parametrize("shapes, match", [
    (((1, 4, 6, 8), (1, 4, 4, 8), (1, 4, 4, 8)), r"heads 6 not divisible by kv heads 4"),
    (((1, 4, 4, 8), (1, 4, 2, 16), (1, 4, 2, 16)), r"head dim mismatch"),
    (((1, 4, 4, 8), (2, 4, 2, 8), (2, 4, 2, 8)), r"batch mismatch"),
    (((1, 4, 4, 8), (1, 4, 2, 8), (1, 5, 2, 8)), r"k and v must have the same shape"),
    (((4, 4, 8), (1, 4, 2, 8), (1, 4, 2, 8)), r"q \[B,T,N,H\]"),
])
@pytest.mark.no_typecheck
def test_bad_shapes(shapes, match):
    q, k, v = (jnp.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        dot_product_attention(q, k, v)


@pytest.mark.no_typecheck
def test_bad_mask_and_impl():
    q = k = v = jnp.zeros((2, 4, 2, 8))
    with pytest.raises(ValueError, match=r"q_segment_ids.shape=\(2, 3\)"):
        dot_product_attention(q, k, v, mask=MaskSpec(q_segment_ids=np.zeros((2, 3))))
    with pytest.raises(ValueError, match="impl='cuda'"):
        dot_product_attention(q, k, v, impl="cuda")
    with pytest.raises(ValueError, match=r"alibi_slopes.shape=\(3,\)"):
        dot_product_attention(q, k, v, alibi_slopes=np.ones(3))
    with pytest.raises(ValueError, match=r"bias.shape=\(3, 3\)"):
        dot_product_attention(q, k, v, bias=np.ones((3, 3)))


# 1 s; xla_attention under per-head random blocks against the float64-checked sparse path (forward and gradients)
# is tests/ops/test_sparse.py's test_bigbird_ragged_batch_with_an_empty_sequence, the dense path's is
# test_dense_training_path_every_mask_feature (default-run)
@pytest.mark.slow
def test_per_head_random_blocks_mask_each_head():
    """xla_attention reads MaskSpec.dense_heads: with per-head random blocks each head has its own mask."""
    from jaxformer.ops.masks import RandomBlocks
    B, T, N, K, H = 1, 12, 4, 2, 8
    q, k, v = rand((B, T, N, H), 0), rand((B, T, K, H), 1), rand((B, T, K, H), 2)
    mask = MaskSpec(window=(1, 1), global_tokens=[5], random_blocks=RandomBlocks(1, 3, seed=2, num_heads=N))
    allowed = np.asarray(mask.dense_heads(T, T))  # [1, N, T, S]
    assert not (allowed[:, :1] == allowed).all(), "heads differ"
    want = np.concatenate([numpy_attention(q[:, :, n:n + 1], k[:, :, n // 2:n // 2 + 1], v[:, :, n // 2:n // 2 + 1],
                                           allowed[:, n]) for n in range(N)], axis=2)
    got = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, mask=mask, impl="xla"))(q, k, v)
    np.testing.assert_allclose(got, want, **TOL)


def test_blockwise_refuses_mask_patterns():
    q = k = v = jnp.zeros((1, 8, 2, 8))
    with pytest.raises(ValueError, match="impl='blockwise' does not handle MaskSpec.global_tokens"):
        dot_product_attention(q, k, v, mask=MaskSpec(window=(2, 2), global_tokens=[0]), impl="blockwise")


def test_auto_picks_sparse_for_long_patterned_masks():
    from jaxformer.ops.attention import default_impl
    from jaxformer.ops.masks import RandomBlocks
    assert default_impl(4096, 4096, MaskSpec(window=(2, 2), global_tokens=[0])) == "sparse"
    if jax.default_backend() == "cpu":
        assert default_impl(256, 511) == "xla" and default_impl(512, 512) == "blockwise"
        assert default_impl(1, 4096) == "xla"  # one decode step: no blocks to skip
    assert default_impl(64, 64, MaskSpec(window=(1, 1), random_blocks=RandomBlocks(1, 4))) == "xla"
    q = k = v = jnp.zeros((1, 8, 2, 8))
    with pytest.raises(ValueError, match=r"num_heads=3 does not match the query heads N=2"):
        dot_product_attention(q, k, v, mask=MaskSpec(random_blocks=RandomBlocks(1, 4, num_heads=3)))


# -- attention_logit_stats: what softmax sees (the sqrt(d_k) study reads these) ---------------------
def numpy_logit_stats(q, k, allowed, *, scale):
    """Float64, row by row: variance and entropy over each row's allowed keys, rows with >= 2 keys."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, T, N, H = q.shape
    k = np.repeat(k, N // k.shape[2], axis=2)
    s = np.einsum("btnh,bsnh->bnts", q, k) * scale
    var, ent, ratio, wmax = [], [], [], []
    for b in range(B):
        for n in range(N):
            for t in range(T):
                row = s[b, n, t][np.asarray(allowed)[b, t]]
                if len(row) < 2:
                    continue
                p = np.exp(row - row.max())
                p /= p.sum()
                var.append(row.var())
                ent.append(-(p * np.log(p)).sum())
                ratio.append(ent[-1] / np.log(len(row)))
                wmax.append(p.max())
    return {"logit_var": np.mean(var), "entropy": np.mean(ent), "entropy_ratio": np.mean(ratio),
            "max_weight": np.mean(wmax)}


# [None] slow, 1 s: the default scale's statistics are test_unit_variance_...'s (default-run)
@pytest.mark.parametrize("scale", [pytest.param(None, marks=pytest.mark.slow), 1.0])
def test_logit_stats_match_a_float64_row_by_row_reference(scale):
    from jaxformer.ops.attention import attention_logit_stats

    B, T, N, K, H = 2, 9, 4, 2, 16
    q, k = rand((B, T, N, H), 1), rand((B, T, K, H), 2)
    lengths = jnp.array([9, 5])
    mask = MaskSpec(causal=True, kv_lengths=lengths)
    got = jax.jit(lambda q, k: attention_logit_stats(q, k, mask=mask, scale=scale))(q, k)
    allowed = np.asarray(mask.dense(T, T))
    allowed = np.broadcast_to(allowed, (B, T, T))
    want = numpy_logit_stats(q, k, allowed, scale=1 / math.sqrt(H) if scale is None else scale)
    for key, w in want.items():
        np.testing.assert_allclose(float(got[key]), w, rtol=2e-5, err_msg=key)  # fp32 vs fp64


@pytest.mark.parametrize("H", [16, 256])
def test_unit_variance_dot_products_have_variance_d_k_and_scaling_restores_one(H):
    """The textbook claim (Vaswani et al. 2017, footnote 4) as a statistical check: q, k with
    independent N(0, 1) entries give var(q.k) = d_k; times 1/sqrt(d_k) it is 1. 4 x 256 x 256 rows;
    the tolerance (8%) is > 5 standard errors of the mean of the row variances."""
    from jaxformer.ops.attention import attention_logit_stats

    q, k = rand((4, 256, 1, H), 3), rand((4, 256, 1, H), 4)
    raw = attention_logit_stats(q, k, scale=1.0)
    scaled = attention_logit_stats(q, k)
    np.testing.assert_allclose(float(raw["logit_var"]), H, rtol=0.08)
    np.testing.assert_allclose(float(scaled["logit_var"]), 1.0, rtol=0.08)
    assert float(scaled["entropy_ratio"]) > float(raw["entropy_ratio"])


def test_logit_stats_leave_padding_rows_out():
    """Rows of segment 0 (padding) may attend to each other; they are not data and must not count."""
    from jaxformer.ops.attention import attention_logit_stats

    T, H = 8, 16
    q, k = rand((2, T, 2, H), 5), rand((2, T, 2, H), 6)
    seg = jnp.array([[1] * T, [1] * 5 + [0] * 3])
    # one jitted program (eager dispatch compiles every op)
    got = jax.jit(lambda q, k: attention_logit_stats(q, k, mask=MaskSpec(causal=True, q_segment_ids=seg), scale=1.0))(
        q, k)
    allowed = np.asarray(MaskSpec(causal=True, q_segment_ids=seg).dense(T, T))
    allowed = allowed & (np.asarray(seg) > 0)[:, :, None]  # the reference drops padding rows outright
    want = numpy_logit_stats(q, k, allowed, scale=1.0)
    for key, w in want.items():
        np.testing.assert_allclose(float(got[key]), w, rtol=2e-5, err_msg=key)


@pytest.mark.parametrize("T,S,causal,window,seg,q_offset", [
    (256, 256, True, None, True, None),     # the training shape: 4 causal chunks of 64 rows
    (200, 256, True, (50, 0), False, None),  # uneven chunks, queries at the end of the keys, a window
    # slow, 5 s: chunk bounds past an offset are the case above's, and one chunk over every key is the traced
    # offset of test_dense_training_path_every_mask_feature (both default-run)
    pytest.param(128, 160, True, None, True, 0,  # offset 0 with extra keys: chunks still skip the future
                 marks=pytest.mark.slow),
    pytest.param(130, 130, False, None, True, None, marks=pytest.mark.slow),  # no causality: one chunk over every key
])
def test_dense_training_path_matches_reference_values_and_gradients(T, S, causal, window, seg, q_offset):
    """impl="xla" runs dense_attention (hand-written backward, causal chunks): xla_attention's values and
    gradients, with rows that see nothing (segment 9 in no key) zero in both."""
    from jaxformer.ops.attention import causal_chunks, dense_attention, xla_attention

    B, N, H = 2, 2, 16
    rng = np.random.default_rng(T + S)
    q, k, v, ct = rand((B, T, N, H), 0), rand((B, S, N, H), 1), rand((B, S, N, H), 2), rand((B, T, N, H), 3)
    qs = np.sort(rng.integers(0, 3, (B, T)), axis=1)
    qs[0, 5] = 9
    mask = MaskSpec(causal=causal, window=window, q_offset=q_offset,
                    q_segment_ids=qs if seg else None,
                    kv_segment_ids=np.sort(rng.integers(0, 3, (B, S)), axis=1) if seg else None)
    chunks = causal_chunks(T, S, mask)
    assert len(chunks) == (1 if not causal else min(4, T // 64)) and chunks[-1][1] == T

    def grads(fn):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v, mask=mask) * ct), argnums=(0, 1, 2)))

    (got_l, got), (want_l, want) = grads(dense_attention)(q, k, v), grads(xla_attention)(q, k, v)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-6)
    out = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, mask=mask, impl="xla"))(q, k, v)
    np.testing.assert_allclose(out, xla_attention(q, k, v, mask=mask), rtol=1e-5, atol=1e-6)
    # forward mode too (a custom_jvp): the same directional derivative as the reference's
    tangents = (rand(q.shape, 4), rand(k.shape, 5), rand(v.shape, 6))
    _, t_got = jax.jit(lambda *a: jax.jvp(lambda q, k, v: dense_attention(q, k, v, mask=mask), a[:3], a[3:]))(
        q, k, v, *tangents)
    _, t_want = jax.jvp(lambda q, k, v: xla_attention(q, k, v, mask=mask), (q, k, v), tangents)
    np.testing.assert_allclose(t_got, t_want, rtol=1e-4, atol=2e-5)
    if seg:
        assert np.all(np.asarray(out[0, 5]) == 0) and np.all(np.asarray(got[0][0, 5]) == 0)


def test_dense_training_path_bf16_and_refusals():
    from jaxformer.ops.attention import dense_attention, xla_attention

    q, k, v = (rand((2, 128, 2, 16), i).astype(jnp.bfloat16) for i in range(3))
    mask = MaskSpec(causal=True)

    def forward(fn):  # jitted, as the train step runs it (eager dispatch would compile every op on its own)
        return jax.jit(lambda q, k, v: fn(q, k, v, mask=mask))(q, k, v)

    out = forward(dense_attention)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(forward(xla_attention), np.float32), atol=2e-2)
    ct = rand((2, 128, 2, 16), 7)

    def grads(fn):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, mask=mask).astype(jnp.float32) * ct),
                                argnums=(0, 1, 2)))(q, k, v)

    got, want = grads(dense_attention), grads(xla_attention)
    # both round the same float32 math to bf16 at their outputs; |g| ~ 1, so 3e-2 is a few bf16 ulps (2^-7 each)
    for g, w in zip(got, want):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=3e-2, rtol=3e-2)
    with pytest.raises(ValueError, match="kv heads"):
        dense_attention(q, k[:, :, :1], v[:, :, :1], mask=mask)


def test_dense_training_path_every_mask_feature():
    """K = N takes the dense path whatever the mask: global tokens, per-head random blocks, kv lengths and a
    traced offset (one chunk: nothing static to skip) give the reference's values and gradients; an empty key
    set falls back to the reference itself."""
    from jaxformer.ops.attention import dense_attention, xla_attention
    from jaxformer.ops.masks import RandomBlocks

    B, T, N, H = 2, 128, 3, 8
    q, k, v, ct = rand((B, T, N, H), 10), rand((B, T, N, H), 11), rand((B, T, N, H), 12), rand((B, T, N, H), 13)
    masks = [
        MaskSpec(causal=True, global_tokens=[0, 70], random_blocks=RandomBlocks(2, 16, seed=3, num_heads=N),
                 window=(20, 0)),
        MaskSpec(causal=True, kv_lengths=jnp.array([128, 77])),
    ]
    for mask in masks:
        def loss(fn, q, k, v, off=None):
            m = mask if off is None else MaskSpec(causal=True, q_offset=off, kv_lengths=mask.kv_lengths,
                                                  global_tokens=mask.global_tokens)
            return jnp.sum(fn(q, k, v, mask=m) * ct)

        for off in (None, jnp.int32(0)):  # a traced offset: passed as a jit argument below
            got = jax.jit(jax.grad(lambda q, k, v, o: loss(dense_attention, q, k, v, o), argnums=(0, 1, 2)))(
                q, k, v, off)
            want = jax.grad(lambda q, k, v: loss(xla_attention, q, k, v, off), argnums=(0, 1, 2))(q, k, v)
            for g, w in zip(got, want):
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-6)
    assert dense_attention(q, k[:, :0], v[:, :0]).shape == q.shape  # no keys: zeros, not a reduction error


@pytest.mark.no_typecheck  # the annotations say `scale: float`; a traced one worked before the dense path
def test_dense_training_path_traced_scale_falls_back():
    """A traced scale (a learned temperature, say) cannot be closed over by the hand-written derivative:
    impl="xla" then runs the reference, whose autodiff differentiates the scale too."""
    from jaxformer.ops.attention import xla_attention

    q, k, v, ct = (rand((1, 64, 2, 8), i) for i in range(4))
    mask = MaskSpec(causal=True)
    # jitted (eager dispatch compiles every op); the scale is traced either way: it is what jax.grad differentiates
    ds = jax.jit(jax.grad(lambda s: jnp.sum(dot_product_attention(q, k, v, mask=mask, scale=s, impl="xla") * ct)))(0.3)
    ds_ref = jax.jit(jax.grad(lambda s: jnp.sum(xla_attention(q, k, v, mask=mask, scale=s) * ct)))(0.3)
    np.testing.assert_allclose(ds, ds_ref, rtol=1e-5)


@pytest.mark.no_typecheck  # a traced scale, as above
def test_auto_falls_back_where_the_path_it_would_pick_refuses(monkeypatch):
    """``impl="auto"`` never picks a path that refuses the call: a traced scale at 512 x 512 (where the CPU picks
    blockwise, which needs a static one) runs the reference, its gradient the reference's; on a GPU (the platform
    simulated: the kernels must not be called) mixed dtypes and ``H > 256`` run blockwise, a traced scale xla, each
    equal to the reference. Asked for by name, blockwise refuses a traced scale with a ValueError naming it."""
    from jaxformer.ops import flash
    from jaxformer.ops.attention import xla_attention

    mask = MaskSpec(causal=True)
    q, k, v, ct = (rand((1, 512, 1, 8), i) for i in range(4))
    got = jax.jit(jax.grad(lambda s: jnp.sum(dot_product_attention(q, k, v, mask=mask, scale=s) * ct)))(0.3)
    want = jax.jit(jax.grad(lambda s: jnp.sum(xla_attention(q, k, v, mask=mask, scale=s) * ct)))(0.3)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    with pytest.raises(ValueError, match=r"impl='blockwise' needs scale and softcap known when traced"):
        jax.jit(lambda s: dot_product_attention(q, k, v, mask=mask, scale=s, impl="blockwise"))(0.3)
    # a constant array is no tracer: blockwise as before, by name and by auto, the same numbers as a float's
    by_float = dot_product_attention(q, k, v, mask=mask, scale=0.3, impl="blockwise")
    for impl in ("blockwise", "auto"):
        np.testing.assert_array_equal(dot_product_attention(q, k, v, mask=mask, scale=jnp.float32(0.3), impl=impl),
                                      by_float)

    def no_kernel(*a, **kw):
        raise AssertionError("auto picked the Pallas kernels for operands they refuse")

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(flash, "pallas_attention", no_kernel)
    q, k, v = (rand((1, 32, 2, 8), i) for i in range(3))
    cases = [((q.astype(jnp.bfloat16), k, v), {}, 2e-2), ((q, k, v), {"scale": jnp.float32(0.3)}, 1e-5)]
    wide = tuple(rand((1, 16, 1, 320), i) for i in range(3))
    cases.append((wide, {}, 1e-5))
    for (a, b, c), kw, tol in cases:
        out = jax.jit(lambda a, b, c, kw=kw: dot_product_attention(a, b, c, mask=mask, **kw))(a, b, c)
        ref = xla_attention(a.astype(jnp.float32), b, c, mask=mask, **kw)
        np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("impl", ["auto", "xla", "blockwise", "sparse"])
def test_no_keys_give_zeros_and_a_nonpositive_softcap_is_refused(impl):
    """``S == 0`` (an empty context): every row sees nothing, so zeros, and zero gradients, on every path (the
    reduction over no keys raised); ``softcap`` 0 or negative is refused (0 made every logit 0: uniform weights,
    and NaN where a logit was 0), as the kernels and the sparse path refuse it."""
    q = rand((2, 5, 2, 8), 0)
    k = v = jnp.zeros((2, 0, 2, 8))
    out = dot_product_attention(q, k, v, mask=MaskSpec(causal=True), impl=impl)
    assert out.shape == q.shape and not np.asarray(out).any()
    half = dot_product_attention(q.astype(jnp.bfloat16), k, v, impl=impl)  # q's dtype, as every path returns
    assert half.dtype == jnp.bfloat16 and half.shape == q.shape
    if impl == "blockwise":  # what the path refuses it still refuses with no keys
        with pytest.raises(ValueError, match="does not handle MaskSpec.global_tokens"):
            dot_product_attention(q, k, v, mask=MaskSpec(global_tokens=[0]), impl=impl)
    g = jax.grad(lambda q: jnp.sum(dot_product_attention(q, k, v, impl=impl) ** 2))(q)
    assert not np.asarray(g).any()
    if impl in ("auto", "xla"):
        o, w = dot_product_attention(q, k, v, impl=impl, return_weights=True)
        assert o.shape == q.shape and w.shape == (2, 2, 5, 0)
    kv = rand((2, 6, 2, 8), 1)
    for cap in (0.0, -30.0):
        with pytest.raises(ValueError, match=f"softcap={cap} must be positive or None"):
            dot_product_attention(q, kv, kv, softcap=cap, impl=impl)


def test_dense_training_path_second_order():
    """Hessian-vector products (forward over reverse) through the hand-written derivative match the reference's."""
    from jaxformer.ops.attention import dense_attention, xla_attention

    q, k, v, ct, dq = (rand((1, 128, 2, 8), i) for i in range(5))
    mask = MaskSpec(causal=True)

    def hvp(fn):
        grad = jax.grad(lambda q: jnp.sum(fn(q, k, v, mask=mask) * ct))
        return jax.jit(lambda q, t: jax.jvp(grad, (q,), (t,))[1])(q, dq)

    np.testing.assert_allclose(hvp(dense_attention), hvp(xla_attention), rtol=1e-3, atol=1e-5)
