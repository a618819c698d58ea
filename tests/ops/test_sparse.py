"""sparse_attention (Longformer / BigBird block-sparse path) against dense attention under the same MaskSpec:
xla_attention, and float64 numpy with textbook gradients, forward and backward."""

import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from jaxformer.ops import MaskSpec, dot_product_attention, xla_attention
from jaxformer.ops.masks import RandomBlocks
from jaxformer.ops.sparse import global_query_rows, sparse_attention
from tests.draws import few_draws

# fp32 on both sides, only the summation order differs: errors ~1e-6.
TOL = dict(rtol=1e-5, atol=1e-5)
# fp32 against float64: errors ~1e-6, a few times more through the backward pass.
TOL64 = dict(rtol=2e-5, atol=2e-5)
# Each draw compiles a forward + backward program (~0.9 s); the pinned examples turn every feature on.
DRAWS = few_draws()


def rand(shape, seed):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def out_and_grads(fn, q, k, v, ct, **kw):
    """The output and d<out, ct>/d(q, k, v)."""
    out, pull = jax.vjp(lambda q, k, v: fn(q, k, v, **kw), q, k, v)
    return out, pull(ct)


def sparse_and_dense(q, k, v, masks, block_size=None, **kw):
    """Outputs and gradients of both paths for each mask, in one jitted program (one compile)."""
    ct = rand(q.shape, 99)

    @jax.jit
    def run(q, k, v, ct):
        return [(out_and_grads(sparse_attention, q, k, v, ct, mask=m, block_size=block_size, **kw),
                 out_and_grads(xla_attention, q, k, v, ct, mask=m, **kw)) for m in masks]

    return run(q, k, v, ct)


def float64_attention_and_grads(q, k, v, ct, allowed, q_pos, *, slopes=None, softcap=None):
    """Dense attention and its gradients by the textbook formulas in float64 numpy (independent of JAX).

    ``allowed`` bool ``[B|1, N|1, T, S]`` (``MaskSpec.dense_heads``), ``q_pos [T]`` absolute query positions.
    """
    q, k, v, ct = (np.asarray(x, np.float64) for x in (q, k, v, ct))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    kr, vr = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    scale = 1 / math.sqrt(H)
    s = np.einsum("btnh,bsnh->bnts", q, kr) * scale
    if softcap is not None:
        tanh = np.tanh(s / softcap)
        s = softcap * tanh
    if slopes is not None:
        s = s - np.asarray(slopes, np.float64)[None, :, None, None] * np.abs(q_pos[:, None] - np.arange(S)[None, :])
    s = np.where(np.broadcast_to(allowed, s.shape), s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    denom = p.sum(-1, keepdims=True)
    w = p / np.where(denom == 0, 1, denom)
    out = np.einsum("bnts,bsnh->btnh", w, vr)
    dw = np.einsum("btnh,bsnh->bnts", ct, vr)
    ds = w * (dw - (dw * w).sum(-1, keepdims=True))
    if softcap is not None:
        ds = ds * (1 - tanh ** 2)
    ds = ds * scale
    dq = np.einsum("bnts,bsnh->btnh", ds, kr)
    dk = np.einsum("bnts,btnh->bsnh", ds, q).reshape(B, S, K, G, H).sum(3)
    dv = np.einsum("bnts,btnh->bsnh", w, ct).reshape(B, S, K, G, H).sum(3)
    return out, (dq, dk, dv)


@DRAWS  # 12 -> 1 draw: 10 s
@example(B=2, T=33, S=37, K=2, G=2, block=8, causal=True, left=5, right=None, globals_kind="per_batch",
         random_kind="per_head", random_block=5, num_random=2, use_len=True, use_seg=True, offset=4,
         use_alibi=True, softcap=4.0, seed=11)  # every feature at once
@example(B=1, T=20, S=29, K=1, G=2, block=4, causal=False, left=3, right=2, globals_kind="shared",
         random_kind="shared", random_block=8, num_random=3, use_len=False, use_seg=False, offset=None,
         use_alibi=False, softcap=None, seed=12)  # two-sided window, shared patterns
@given(
    B=st.integers(1, 2), T=st.integers(1, 37), S=st.integers(1, 37), K=st.sampled_from([1, 2]),
    G=st.sampled_from([1, 2]), block=st.sampled_from([4, 8]), causal=st.booleans(),
    left=st.integers(0, 9), right=st.one_of(st.none(), st.integers(0, 9)),
    globals_kind=st.sampled_from(["none", "shared", "per_batch"]),
    random_kind=st.sampled_from(["none", "shared", "per_head"]), random_block=st.sampled_from([4, 8, 5]),
    num_random=st.integers(0, 3), use_len=st.booleans(), use_seg=st.booleans(),
    offset=st.one_of(st.none(), st.integers(0, 6)), use_alibi=st.booleans(),
    softcap=st.sampled_from([None, 4.0]), seed=st.integers(0, 2**16),
)
def test_matches_dense_forward_and_gradients(B, T, S, K, G, block, causal, left, right, globals_kind,
                                             random_kind, random_block, num_random, use_len, use_seg,
                                             offset, use_alibi, softcap, seed):
    """Window sizes, global positions, random seeds, ragged lengths, T != S, GQA: dense float64 attention and
    its textbook gradients under the same mask (``dense_heads``) are the reference."""
    rng = np.random.default_rng(seed)
    N = K * G
    glob = {"none": None,
            "shared": rng.integers(0, max(S, T) + 3, (int(rng.integers(1, 4)),)),
            "per_batch": rng.integers(-1, max(S, T) + 3, (B, int(rng.integers(1, 4))))}[globals_kind]
    rblocks = None if random_kind == "none" else RandomBlocks(
        num_random, random_block, seed=int(rng.integers(0, 1000)), num_heads=N if random_kind == "per_head" else None)
    mask = MaskSpec(
        causal=causal, window=(left, right), global_tokens=glob, random_blocks=rblocks, q_offset=offset,
        kv_lengths=rng.integers(0, S + 1, (B,)) if use_len else None,
        q_segment_ids=rng.integers(0, 2, (B, T)) if use_seg else None,
        kv_segment_ids=rng.integers(0, 2, (B, S)) if use_seg else None,
    )
    q, k, v = rand((B, T, N, 8), seed), rand((B, S, K, 8), seed + 1), rand((B, S, K, 8), seed + 2)
    ct = rand((B, T, N, 8), seed + 3)
    slopes = rng.uniform(0.05, 1.0, (N,)).astype(np.float32) if use_alibi else None
    run = jax.jit(lambda q, k, v, ct: (out_and_grads(sparse_attention, q, k, v, ct, mask=mask, block_size=block,
                                                     alibi_slopes=slopes, softcap=softcap), mask.dense_heads(T, S)))
    (got, got_g), allowed = run(q, k, v, ct)
    q_pos = mask.static_offset(T, S) + np.arange(T)
    want, want_g = float64_attention_and_grads(q, k, v, ct, np.asarray(allowed), q_pos,
                                               slopes=slopes, softcap=softcap)
    np.testing.assert_allclose(got, want, **TOL64)
    for name, g, w in zip("qkv", got_g, want_g):
        np.testing.assert_allclose(g, w, **TOL64, err_msg=f"d{name}")


def test_bigbird_ragged_batch_with_an_empty_sequence():
    """BigBird (window, global, per-head random blocks), GQA, T % block != 0, lengths 45, 30 and 0 (no keys)."""
    B, T, N, K, H = 3, 45, 4, 2, 8
    q, k, v = rand((B, T, N, H), 0), rand((B, T, K, H), 1), rand((B, T, K, H), 2)
    bigbird = MaskSpec(window=(8, 8), global_tokens=[0, 20], kv_lengths=np.array([45, 30, 0]),
                       random_blocks=RandomBlocks(num_blocks=2, block_size=8, seed=3, num_heads=N))
    [((got, got_g), (want, want_g))] = sparse_and_dense(q, k, v, [bigbird])  # block size from random_blocks
    np.testing.assert_allclose(got, want, **TOL)
    for name, g, w in zip("qkv", got_g, want_g):
        np.testing.assert_allclose(g, w, **TOL, err_msg=f"d{name}")
        assert np.isfinite(np.asarray(g)).all()
    assert np.all(np.asarray(got[2]) == 0) and np.all(np.asarray(got_g[0][2]) == 0)  # fully masked rows


def test_dispatch_and_bf16():
    q, k, v = (rand(s, i) for i, s in enumerate([(2, 40, 4, 16), (2, 40, 2, 16), (2, 40, 2, 16)]))
    mask = MaskSpec(window=(5, 3), global_tokens=[[1, 33], [7, -1]],
                    random_blocks=RandomBlocks(num_blocks=1, block_size=8, seed=1))

    @jax.jit
    def run(q, k, v):
        low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
        return (xla_attention(q, k, v, mask=mask), dot_product_attention(q, k, v, mask=mask, impl="sparse"),
                sparse_attention(*low, mask=mask), xla_attention(*(x.astype(jnp.float32) for x in low), mask=mask))

    want, got, low, want_low = run(q, k, v)
    np.testing.assert_allclose(got, want, **TOL)
    assert low.dtype == jnp.bfloat16
    # Against dense fp32 attention on the same bf16-rounded inputs: the error is p and the output
    # rounded to bf16 (2^-9 relative): measured 5.6e-3, bound 1.2e-2.
    np.testing.assert_allclose(np.asarray(low, np.float32), want_low, atol=1.2e-2)


def test_global_query_rows_alone():
    """Only the rows of global queries (here at positions 9 and 4 for queries at offset 3) are written."""
    q, k, v = rand((2, 8, 2, 8), 0), rand((2, 12, 1, 8), 1), rand((2, 12, 1, 8), 2)
    mask = MaskSpec(causal=True, window=(1, 1), global_tokens=[[9, 40], [4, -1]], q_offset=3,
                    kv_lengths=np.array([10, 12]))
    run = jax.jit(lambda q, k, v: (global_query_rows(jnp.zeros_like(q), q, k, v, mask=mask, softcap=3.0),
                                   xla_attention(q, k, v, mask=mask, softcap=3.0)))
    got, want = run(q, k, v)
    rows = np.zeros((2, 8), bool)
    rows[0, 6] = rows[1, 1] = True
    np.testing.assert_allclose(np.asarray(got)[rows], np.asarray(want)[rows], **TOL)
    assert np.all(np.asarray(got)[~rows] == 0)


def _largest_intermediate(fn, *args) -> int:
    jaxpr = jax.make_jaxpr(fn)(*args)
    sizes = []

    def walk(jx):
        for eqn in jx.eqns:
            sizes.extend(math.prod(getattr(o.aval, "shape", ())) for o in eqn.outvars)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    return max(sizes)


def test_no_t_by_s_intermediate_forward_or_backward():
    """Every array in the forward+backward program is O(T*w), far below T*S."""
    T = S = 1024
    q, k, v = rand((1, T, 1, 8), 0), rand((1, S, 1, 8), 1), rand((1, S, 1, 8), 2)
    mask = MaskSpec(window=(16, 16), global_tokens=[0, 500], random_blocks=RandomBlocks(2, 16, seed=0))
    loss = lambda q, k, v: jnp.sum(sparse_attention(q, k, v, mask=mask, block_size=16) ** 2)
    biggest = _largest_intermediate(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
    # per q block: 3 band + 2 global-column + 2 random blocks of 16 -> w*b <= 7*16 keys per query
    assert biggest <= T * 7 * 16, biggest
    assert biggest * 8 < T * S


def test_block_lists_are_narrow():
    from pallas_kernels.schedule import block_lists
    mask = MaskSpec(window=(64, 64), global_tokens=[0, 1])
    live = mask.block_map(4096, 4096, 64, 64, per_head=True, global_rows=False)
    idx, count = block_lists(live, pad=64)
    assert idx.shape == (1, 64, 4)  # 3 band blocks + the globals' block 0
    assert count.min() >= 2 and (idx[0, 10] == [0, 9, 10, 11]).all()


@pytest.mark.parametrize("kwargs, match", [
    (dict(mask=MaskSpec(causal=True, q_offset=np.array([0, 1]))), r"static q_offset"),
    (dict(mask=MaskSpec(window=(2, 2)), block_size=0), r"block_size=0"),
    (dict(mask=MaskSpec(window=(2, 2)), block_size=2.5), r"block_size=2.5"),
    (dict(mask=MaskSpec(window=(2, 2), random_blocks=RandomBlocks(1, 4, num_heads=3))), r"num_heads=3.*N=4"),
    (dict(mask=MaskSpec(window=(2, 2), global_tokens=[[0], [1], [2]])), r"global_tokens.shape=\(3, 1\).*B=2"),
    (dict(mask=np.ones((8, 8), bool)), r"mask must be a MaskSpec"),
    (dict(mask=MaskSpec(), softcap=-1.0), r"softcap=-1.0"),
])
@pytest.mark.no_typecheck
def test_bad_input(kwargs, match):
    q, k, v = jnp.zeros((2, 8, 4, 8)), jnp.zeros((2, 8, 2, 8)), jnp.zeros((2, 8, 2, 8))
    with pytest.raises(ValueError, match=match):
        sparse_attention(q, k, v, **kwargs)


def test_bad_shapes():
    with pytest.raises(ValueError, match="heads 3 not divisible by kv heads 2"):
        sparse_attention(jnp.zeros((1, 4, 3, 8)), jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 2, 8)))
