"""blockwise_attention (plain-JAX, O(T) memory) against dense xla_attention under MaskSpec.dense.

Forward and dq, dk, dv on random inputs for every mask feature and combinations,
traced q offsets, dead-block skipping and the no-[T, S]-matrix property.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from jaxformer.ops import MaskSpec, xla_attention
from jaxformer.ops.blockwise import blockwise_attention
from tests.attention_helpers import assert_close as _close
from tests.attention_helpers import attention_inputs as _inputs
from tests.draws import few_draws

# Tolerances relative to max(1, max|want|). fp32: same math as the dense path, different summation
# order -> 1e-5 forward, 1e-4 gradients. bf16: p is rounded to bf16 before p @ v and the output is
# bf16 (8-bit mantissa) -> 2e-2 forward, 4e-2 gradients.
TOL = {jnp.float32: (1e-5, 1e-4), jnp.bfloat16: (2e-2, 4e-2)}


def check(shape, mask, *, dtype=jnp.float32, block_k=16, block_q=8, seed=0, **kw):
    """blockwise vs dense, forward and (dq, dk, dv); mask array leaves are traced arguments."""
    q, k, v, do = _inputs(*shape, dtype=dtype, seed=seed)

    def go(q, k, v, do, mask):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        o, vjp = jax.vjp(lambda q, k, v: blockwise_attention(q, k, v, mask=mask, block_k=block_k,
                                                             block_q=block_q, **kw), q, k, v)
        o_d, vjp_d = jax.vjp(lambda q, k, v: xla_attention(q, k, v, mask=mask, **kw), *f32)
        return o, vjp(do), o_d, vjp_d(do.astype(jnp.float32))

    o, g, o_d, g_d = jax.jit(go)(q, k, v, do, mask)
    assert o.dtype == dtype and all(x.dtype == dtype for x in g)
    ftol, gtol = TOL[dtype]
    _close(o, o_d, ftol, "out")
    for n, a, b in zip(("dq", "dk", "dv"), g, g_d):
        _close(a, b, gtol, n)
    return o, g


def test_plain_gqa_unaligned():
    check((2, 37, 45, 4, 2, 24), MaskSpec())


def test_causal_mqa_window_alibi_softcap():
    check((1, 33, 33, 3, 1, 16), MaskSpec(causal=True, window=(7, None)),
          alibi_slopes=jnp.array([0.5, 0.25, 0.125]), softcap=2.0)


def test_two_sided_window_cross_lengths_offset():
    check((2, 19, 41, 2, 1, 16), MaskSpec(window=(5, 3), q_offset=7), block_k=8, block_q=None)


def test_segments_lengths_and_empty_rows():
    q_seg = jnp.array([[0] * 10 + [1] * 10 + [7] * 4, [0] * 24])  # segment 7 has no keys
    kv_seg = jnp.array([[0] * 12 + [1] * 12, [0] * 24])
    mask = MaskSpec(causal=True, q_segment_ids=q_seg, kv_segment_ids=kv_seg, kv_lengths=jnp.array([20, 0]))
    o, (dq, dk, dv) = check((2, 24, 24, 2, 2, 8), mask)
    assert (o[0, 20:] == 0).all() and (o[1] == 0).all()
    assert (dq[0, 20:] == 0).all() and (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()


@pytest.mark.parametrize("T, S, offset", [
    # slow, 1.5 s: per-sequence traced offsets under the same mask are the next case's (T = 5), and with lengths
    # test_traced_offset_skips_blocks_no_row_reaches's (default-run); on the CPU "auto" runs one-row steps with xla
    pytest.param(1, 29, jnp.array([28, 3]), marks=pytest.mark.slow),  # decode: one query per sequence at its position
    (5, 29, jnp.array([24, -2])),    # chunked prefill with per-sequence offsets (some rows empty)
    (6, 17, jnp.int32(4)),           # a traced scalar offset
])
def test_traced_q_offset(T, S, offset):
    check((2, T, S, 2, 1, 8), MaskSpec(causal=True, window=(6, None), q_offset=offset),
          alibi_slopes=jnp.array([0.2, 0.4]))


def test_bf16():
    check((1, 48, 48, 4, 2, 32), MaskSpec(causal=True), dtype=jnp.bfloat16, alibi_slopes=jnp.array([.1, .2, .3, .4]))


def test_dead_blocks_are_skipped_not_masked():
    """NaN in kv blocks the causal/window mask never reaches must not leak into other rows."""
    q, k, v, _ = _inputs(1, 64, 64, 2, 1, 8)
    v_bad = np.array(v)
    v_bad[:, 48:] = v_bad[:, :8] = np.nan  # q block 2 (rows 32..47) sees kv blocks 1, 2 only
    mask = MaskSpec(causal=True, window=(8, 0))
    f = lambda q, k, v: blockwise_attention(q, k, v, mask=mask, block_k=16, block_q=16)  # noqa: E731
    o = jax.jit(f)(q, k, v_bad)
    want = jax.jit(lambda q, k, v: xla_attention(q, k, v, mask=mask))(q, k, v)
    _close(o[:, 32:48], want[:, 32:48], 1e-5, "rows whose live blocks are clean")
    # backward: with causal, kv blocks 1..3 never meet q block 0
    q_bad = np.array(q)
    q_bad[:, :16] = np.nan
    do = jnp.ones(q.shape).at[:, :16].set(0.0)
    cmask = MaskSpec(causal=True)

    def grads(fn, q, k, v):
        return jax.vjp(fn, q, k, v)[1](do)

    _, dk, dv = jax.jit(lambda *a: grads(lambda q, k, v: blockwise_attention(
        q, k, v, mask=cmask, block_k=16, block_q=16), *a))(q_bad, k, v)
    _, dk_d, dv_d = jax.jit(lambda *a: grads(lambda q, k, v: xla_attention(q, k, v, mask=cmask), *a))(q, k, v)
    _close(dk[:, 16:], dk_d[:, 16:], 1e-4, "dk")
    _close(dv[:, 16:], dv_d[:, 16:], 1e-4, "dv")


@pytest.mark.parametrize("S, offsets, window, nan_keys", [
    (64, [20, 8], None, [slice(48, 64)]),                   # past every row's causal band and length
    (80, [40, 36], (8, 0), [slice(0, 16), slice(64, 80)]),  # also before every row's window
    (80, [40, 0], (8, 0), [slice(0, 16), slice(64, 80)]),   # an idle row (length 0) holds no block
])
def test_traced_offset_skips_blocks_no_row_reaches(S, offsets, window, nan_keys):
    """A prefill chunk over a cache (a traced offset per sequence, kv_lengths = offset + T): the kv blocks
    that no row's band or length reaches are never read, forward or backward (NaN there would leak through
    ``0 * NaN``), and the rest matches the dense reference on clean data (fp32, the check's tolerances)."""
    T, bk = 16, 16
    q, k, v, do = _inputs(2, T, S, 4, 2, 8, seed=3)
    off = jnp.asarray(offsets, jnp.int32)
    lengths = jnp.where(off > 0, off + T, 0)  # offset 0 here: an idle row, as the engine pads a step's batch
    mask = MaskSpec(causal=True, window=window, q_offset=off, kv_lengths=lengths)
    k_bad, v_bad = np.array(k), np.array(v)
    for sl in nan_keys:
        k_bad[:, sl] = v_bad[:, sl] = np.nan

    def run(fn, k, v):
        o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, mask), q, k, v)
        return o, vjp(do)

    got = jax.jit(lambda k, v: run(lambda q, k, v, m: blockwise_attention(q, k, v, mask=m, block_k=bk,
                                                                          block_q=8), k, v))(k_bad, v_bad)
    want = jax.jit(lambda k, v: run(lambda q, k, v, m: xla_attention(q, k, v, mask=m), k, v))(k, v)
    ftol, gtol = TOL[jnp.float32]
    _close(got[0], want[0], ftol, "out")
    for n, a, b in zip(("dq", "dk", "dv"), got[1], want[1]):
        _close(a, b, gtol, n)


def _all_shapes(jaxpr):
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield eqn.primitive.name, getattr(var.aval, "shape", ())
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _all_shapes(sub)


def test_no_t_by_s_matrix_forward_or_backward():
    """Traced fwd+bwd program holds nothing of T*S elements; the dense path does (so the check can fail)."""
    B, T, S, N, H = 1, 512, 512, 1, 16
    q, k, v = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((B, T, N, H), (B, S, N, H), (B, S, N, H)))
    mask = MaskSpec(causal=True)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) ** 2)

    blockwise = jax.make_jaxpr(jax.grad(loss(lambda q, k, v: blockwise_attention(
        q, k, v, mask=mask, block_k=64, block_q=64)), argnums=(0, 1, 2)))(q, k, v)
    dense = jax.make_jaxpr(jax.grad(loss(lambda q, k, v: xla_attention(q, k, v, mask=mask)),
                                    argnums=(0, 1, 2)))(q, k, v)
    biggest = max(int(np.prod(s)) for _, s in _all_shapes(blockwise.jaxpr))
    assert biggest < T * S // 16, f"largest intermediate has {biggest} elements"
    assert max(int(np.prod(s)) for _, s in _all_shapes(dense.jaxpr)) >= T * S


# Each drawn example compiles a custom-VJP program (~1 s); the pinned examples reach every feature at once (causal + window + offset + segments
# + lengths + ALiBi + softcap + GQA 3:1), the two-sided window with cross lengths and a traced per-sequence offset,
# so coverage does not hang on the draw.
@few_draws()
@example(B=2, T=29, S=23, K=2, G=3, causal=True, window=(6, 2), offset=-3, use_seg=True, use_len=True,
         use_alibi=True, softcap=4.0, block_k=7, block_q=3, traced=False, seed=5)
@example(B=1, T=17, S=30, K=1, G=1, causal=False, window=(4, None), offset=5, use_seg=False, use_len=True,
         use_alibi=True, softcap=None, block_k=16, block_q=None, traced=False, seed=6)
@example(B=2, T=13, S=29, K=2, G=3, causal=True, window=(6, None), offset=5, use_seg=False, use_len=True,
         use_alibi=True, softcap=None, block_k=7, block_q=3, traced=True, seed=7)
@given(B=st.integers(1, 2), T=st.integers(1, 30), S=st.integers(1, 30), K=st.sampled_from([1, 2]),
       G=st.sampled_from([1, 3]), causal=st.booleans(), window=st.sampled_from([None, (4, None), (6, 2), (None, 0)]),
       offset=st.sampled_from([None, 0, -3, 5]), use_seg=st.booleans(), use_len=st.booleans(),
       use_alibi=st.booleans(), softcap=st.sampled_from([None, 4.0]), block_k=st.sampled_from([1, 7, 16]),
       block_q=st.sampled_from([None, 3, 32]), traced=st.booleans(), seed=st.integers(0, 99))
def test_drawn(B, T, S, K, G, causal, window, offset, use_seg, use_len, use_alibi, softcap, block_k, block_q,
               seed, traced):
    rng = np.random.default_rng(seed)
    N = K * G
    if traced and offset is not None:  # per-sequence offsets as an array: the kv range is computed in the graph
        offset = jnp.asarray(offset + rng.integers(0, 4, (B,)), jnp.int32)
    mask = MaskSpec(
        causal=causal, window=window, q_offset=offset,
        q_segment_ids=jnp.asarray(rng.integers(0, 2, (B, T))) if use_seg else None,
        kv_segment_ids=jnp.asarray(rng.integers(0, 2, (B, S))) if use_seg else None,
        kv_lengths=jnp.asarray(rng.integers(0, S + 1, (B,))) if use_len else None,
    )
    slopes = jnp.asarray(rng.uniform(0.05, 1.0, (N,)), jnp.float32) if use_alibi else None
    check((B, T, S, N, K, 8), mask, block_k=block_k, block_q=block_q, seed=seed, alibi_slopes=slopes,
          softcap=softcap)


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_k=0), "block_k=0 must be a positive int"),
    (dict(block_q=2.5), "block_q=2.5 must be a positive int"),
    (dict(mask="causal"), "mask must be a MaskSpec"),
    (dict(mask=MaskSpec(kv_lengths=jnp.zeros((3,), jnp.int32))), r"kv_lengths.shape=\(3,\)"),
    (dict(alibi_slopes=jnp.zeros((5,))), r"alibi_slopes.shape=\(5,\)"),
    (dict(mask=MaskSpec(window=(1, 1), global_tokens=[0])), "does not handle MaskSpec.global_tokens"),
])
@pytest.mark.no_typecheck
def test_bad_input_raises(kwargs, match):
    q, k, v, _ = _inputs(1, 4, 4, 2, 1, 8)
    with pytest.raises(ValueError, match=match):
        blockwise_attention(q, k, v, **kwargs)


def test_bad_shapes_raise():
    q, k, v, _ = _inputs(1, 4, 4, 3, 2, 8)
    with pytest.raises(ValueError, match="heads 3 not divisible by kv heads 2"):
        blockwise_attention(q, k, v)
