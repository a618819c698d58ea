"""jaxformer.nn modules against independent references (numpy float64 forward, jnp float32 gradients)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.nn.builders import attention, mlp
from jaxformer.nn.params import FEATURE_MAJOR_ROWS, TransposedCopy, add_transposed_copies
from jaxformer.nn import (
    LOGICAL_AXES, Block, Embed, GatedMLP, HeadTransform, LayerNorm, LearnedPositions, LMHead, MLP,
    NormConfig, Residual, RMSNorm, param,
)
from jaxformer.ops.masks import MaskSpec

# fp32 module vs float64 reference on O(1) values: a few ulps of accumulated rounding.
RTOL, ATOL = 1e-4, 2e-5


def build(factory, seed, std=0.3):
    """``factory()``'s structure with every Param drawn from N(0, std^2) by numpy: nothing is
    trivially zero or uniform, and no XLA compilation is spent on initialisation."""
    graphdef, state = nnx.split(nnx.eval_shape(factory))
    rng = np.random.default_rng(seed)
    leaves, tree = jax.tree.flatten(state)
    return nnx.merge(graphdef, jax.tree.unflatten(
        tree, [jnp.asarray(std * rng.standard_normal(l.shape), l.dtype) for l in leaves]))


def run(module, *args, **kwargs):
    """``module(*args, **kwargs)`` under one jax.jit (eager dispatch compiles every op separately)."""
    graphdef, state = nnx.split(module)
    return jax.jit(lambda st, a, kw: nnx.merge(graphdef, st)(*a, **kw))(state, args, kwargs)


def params_np(module):
    return {".".join(map(str, p)): np.asarray(v[...], np.float64)
            for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


# ---------------------------------------------------------------- references (xp = np or jnp)
def ref_rope(xp, x, pos, base=10000.0):
    """Rotate pairs (x_i, x_{i+H/2}) by angle pos * base^(-2i/H) (RoFormer, half-split pairing)."""
    H = x.shape[-1]
    theta = base ** (-np.arange(0, H, 2) / H)
    ang = pos[:, None] * theta[None, :]  # [T, H/2]
    cos, sin = xp.cos(ang)[None, :, None, :], xp.sin(ang)[None, :, None, :]
    a, b = x[..., : H // 2], x[..., H // 2:]
    return xp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def ref_attention(xp, p, x, ctx=None, *, position="none", causal=False, softcap=None):
    """Plain multi-head attention with K/V heads repeated G times (fine for a reference)."""
    ctx = x if ctx is None else ctx
    q = xp.einsum("btd,dnh->btnh", x, p["w_q"])
    k = xp.einsum("bsd,dkh->bskh", ctx, p["w_k"])
    v = xp.einsum("bsd,dkh->bskh", ctx, p["w_v"])
    if "b_q" in p:  # q/k/v biases come together; b_o (below) on its own
        q, k, v = q + p["b_q"][None, None], k + p["b_k"][None, None], v + p["b_v"][None, None]
    N, H, K = q.shape[2], q.shape[3], k.shape[2]
    T, S = x.shape[1], ctx.shape[1]
    if position == "rope":
        q, k = ref_rope(xp, q, np.arange(T, dtype=np.float64)), ref_rope(xp, k, np.arange(S, dtype=np.float64))
    k, v = xp.repeat(k, N // K, axis=2), xp.repeat(v, N // K, axis=2)
    s = xp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(H)
    if softcap is not None:
        s = softcap * xp.tanh(s / softcap)
    if position == "alibi":  # slopes 2^(-8i/N), i = 1..N (N a power of two)
        slopes = 2.0 ** (-8.0 * np.arange(1, N + 1) / N)
        s = s - slopes[None, :, None, None] * np.abs(np.arange(T)[:, None] - np.arange(S)[None, :])
    # Softmax with the row max as a constant (softmax ignores the shift; a max differentiated
    # through its argmax is 0/0 when a compile recomputes s with other rounding) and the mask
    # applied after exp, so exp never sees -inf: forward and gradients finite by construction.
    allowed = np.broadcast_to(np.tril(np.ones((T, S), bool), S - T) if causal else True, s.shape)
    stop = jax.lax.stop_gradient if xp is jnp else (lambda a: a)
    m = stop(xp.where(allowed, s, -np.inf).max(-1, keepdims=True))
    w = xp.where(allowed, xp.exp(xp.where(allowed, s - m, 0.0)), 0.0)
    w = w / w.sum(-1, keepdims=True)
    y = xp.einsum("btnh,nhd->btd", xp.einsum("bnts,bsnh->btnh", w, v), p["w_o"])
    return y + p["b_o"][None, None] if "b_o" in p else y


@pytest.mark.parametrize("position,N,K,causal,bias,softcap,qkv_bias", [
    ("none", 4, 4, False, True, None, None),
    ("rope", 8, 2, True, True, None, None),
    ("alibi", 4, 1, True, False, 1.5, None),
    ("rope", 8, 2, True, False, None, True),   # Qwen2: q/k/v biases only
    ("none", 4, 2, True, True, None, False),   # output bias only
])
def test_attention_matches_reference_forward_and_grad(position, N, K, causal, bias, softcap, qkv_bias):
    D, H, B, T = 16, 4, 2, 5
    m = build(lambda: attention(D, N, K, H, position=position, use_bias=bias, qkv_bias=qkv_bias, softcap=softcap,
                                impl="xla", rngs=nnx.Rngs(0)), 1)
    has_qkv = bias if qkv_bias is None else qkv_bias
    assert {n for n in ("b_q", "b_k", "b_v", "b_o") if getattr(m, n) is not None} == (
        ({"b_q", "b_k", "b_v"} if has_qkv else set()) | ({"b_o"} if bias else set()))
    x = jax.random.normal(jax.random.key(2), (B, T, D))
    ct = jax.random.normal(jax.random.key(3), (B, T, D))
    mask = MaskSpec(causal=causal)
    p = params_np(m)
    graphdef, state = nnx.split(m)

    @jax.jit
    def module_vjp(st, xx):
        y, pullback = jax.vjp(lambda s_, x_: nnx.merge(graphdef, s_)(x_, mask=mask), st, xx)
        return y, pullback(ct)

    @jax.jit
    def reference_vjp(pp, xx):
        y, pullback = jax.vjp(
            lambda p_, x_: ref_attention(jnp, p_, x_, position=position, causal=causal, softcap=softcap), pp, xx)
        return y, pullback(ct)

    got, (g_state, g_x) = module_vjp(state, x)
    want = ref_attention(np, p, np.asarray(x, np.float64), position=position, causal=causal, softcap=softcap)
    np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=ATOL)
    _, (g_p_ref, g_x_ref) = reference_vjp({k: jnp.asarray(v, jnp.float32) for k, v in p.items()}, x)
    # fp32 both sides, different summation orders: relative 1e-4 of O(1) gradients.
    np.testing.assert_allclose(g_x, g_x_ref, rtol=1e-4, atol=1e-4)
    for path, v in nnx.to_flat_state(g_state):
        np.testing.assert_allclose(v[...], g_p_ref[".".join(map(str, path))], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qkv_bias", [None, True])
def test_cross_attention_matches_reference(qkv_bias):
    D, N, K, H, B, T, S = 16, 4, 2, 4, 2, 3, 7
    m = build(lambda: attention(D, N, K, H, impl="xla", qkv_bias=qkv_bias, rngs=nnx.Rngs(0)), 4)
    assert (m.b_k is not None) == bool(qkv_bias) and m.b_o is None
    x = jax.random.normal(jax.random.key(5), (B, T, D))
    ctx = jax.random.normal(jax.random.key(6), (B, S, D))
    want = ref_attention(np, params_np(m), np.asarray(x, np.float64), np.asarray(ctx, np.float64))
    np.testing.assert_allclose(np.asarray(run(m, x, ctx)), want, rtol=RTOL, atol=ATOL)


@pytest.mark.no_typecheck
def test_cross_attention_refuses_a_context_of_another_width():
    m = attention(16, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"context.shape=\(2, 7, 12\) must be \[B, S, D\] with D=16"):
        m(jnp.zeros((2, 3, 16)), jnp.zeros((2, 7, 12)))


def test_gqa_with_k_equal_n_is_mha_and_gqa_equals_mha_with_repeated_kv_weights():
    """A GQA layer equals an MHA layer whose W_k, W_v repeat each kv head for its G query heads."""
    D, N, K, H = 16, 4, 2, 4
    x = jax.random.normal(jax.random.key(7), (2, 6, D))
    gqa = build(lambda: attention(D, N, K, H, position="rope", impl="xla", rngs=nnx.Rngs(0)), 8)
    mha = build(lambda: attention(D, N, N, H, position="rope", impl="xla", rngs=nnx.Rngs(1)), 0)
    mha.w_q[...] = gqa.w_q[...]
    mha.w_o[...] = gqa.w_o[...]
    mha.w_k[...] = jnp.repeat(gqa.w_k[...], N // K, axis=1)
    mha.w_v[...] = jnp.repeat(gqa.w_v[...], N // K, axis=1)
    mask = MaskSpec(causal=True)
    y_mha = run(mha, x, mask=mask)
    np.testing.assert_allclose(run(gqa, x, mask=mask), y_mha, rtol=1e-5, atol=1e-6)
    # K == N is plain MHA: it matches the float64 reference (which has no grouping at all).
    want = ref_attention(np, params_np(mha), np.asarray(x, np.float64), position="rope", causal=True)
    np.testing.assert_allclose(y_mha, want, rtol=RTOL, atol=ATOL)


@pytest.mark.no_typecheck
def test_attention_bad_input():
    with pytest.raises(ValueError, match="n_heads=6 not divisible by n_kv_heads=4"):
        attention(24, 6, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="d_model 10 not divisible by heads 4"):
        attention(10, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="even head dim.*head_dim=3"):
        attention(12, 4, position="rope", rngs=nnx.Rngs(0))
    m = nnx.eval_shape(lambda: attention(8, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"x \[B, T, D\].*\(3, 8\)"):
        m(jnp.ones((3, 8)))


# ---------------------------------------------------------------- MLP, norms, embeddings
def _np_act(name, x):
    erf = np.vectorize(math.erf)
    return {
        "relu": lambda: np.maximum(x, 0.0),
        "gelu": lambda: 0.5 * x * (1.0 + erf(x / math.sqrt(2.0))),
        "gelu_tanh": lambda: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3))),
        "silu": lambda: x / (1.0 + np.exp(-x)),
    }[name]()


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu"])
def test_mlp_matches_reference(activation):
    D, F = 8, 12
    m = build(lambda: mlp(D, F, activation, use_bias=True, rngs=nnx.Rngs(0)), 9, std=0.5)
    x = jax.random.normal(jax.random.key(10), (2, 3, D))
    p, xn = params_np(m), np.asarray(x, np.float64)
    if activation in ("swiglu", "geglu"):
        assert isinstance(m, GatedMLP)
        gate, up = xn @ p["w_gate"] + p["b_gate"], xn @ p["w_up"] + p["b_up"]
        h = _np_act("silu" if activation == "swiglu" else "gelu", gate) * up
        want = h @ p["w_down"] + p["b_down"]
    else:
        assert isinstance(m, MLP)
        want = _np_act(activation, xn @ p["w_in"] + p["b_in"]) @ p["w_out"] + p["b_out"]
    np.testing.assert_allclose(np.asarray(run(m, x)), want, rtol=RTOL, atol=ATOL)


FM_SHAPES = [(2, 3), (1, 2), (4, 8), (1, 1), (5, 8)]  # 6, 2, 32 rows; 1, 40: usual path


def fm_cases(combos, default):
    """``(shape, *combo)`` for every shape and combination, ids ``shape<i>-<combo>``; the cases for which
    ``default(shape index, combo)`` is false are slow. Which rows run feature-major is one rule for every module
    (``runs_feature_major``), so one combination takes the range's edges in the default run."""
    return [pytest.param(shape, *c, id="-".join([f"shape{i}", *map(str, c)]),
                         marks=() if default(i, c) else pytest.mark.slow)
            for i, shape in enumerate(FM_SHAPES) for c in combos]


# slow, 8 s: the other combinations at 2, 32, 1 and 40 rows, and the GELU one with biases at 32, 1 and 40 (6 rows of
# each combination and 2 rows of that one are default-run; the rows rule's other edges, 32, 1 and 40, are
# test_feature_major_heads_match_reference's, 1 row the attention's below)
@pytest.mark.parametrize("shape, use_bias, activation", fm_cases(
    [(True, "gelu"), (True, "swiglu"), (False, "gelu"), (False, "swiglu")],
    lambda i, c: i == 0 or (i == 1 and c == (True, "gelu"))))
def test_feature_major_mlp_matches_reference_forward_and_grad(activation, use_bias, shape):
    """An MLP given transposed copies of its projections (the decode engine's feature-major calls, 2-32
    rows) against the float64 reference forward, and its gradient in ``x`` against the usual path's; the
    copies are what a call in that range reads (changing them changes the result), outside it they are
    unused."""
    D, F = 8, 12
    m = build(lambda: mlp(D, F, activation, use_bias=use_bias, rngs=nnx.Rngs(0)), 9, std=0.5)
    x = jax.random.normal(jax.random.key(10), (*shape, D))
    p, xn = params_np(m), np.asarray(x, np.float64)
    if activation == "swiglu":
        gate, up = xn @ p["w_gate"] + p.get("b_gate", 0), xn @ p["w_up"] + p.get("b_up", 0)
        want = _np_act("silu", gate) * up @ p["w_down"] + p.get("b_down", 0)
    else:
        want = _np_act("gelu", xn @ p["w_in"] + p.get("b_in", 0)) @ p["w_out"] + p.get("b_out", 0)
    fm = nnx.merge(*nnx.split(m))
    assert add_transposed_copies(fm) == 1
    np.testing.assert_allclose(np.asarray(run(fm, x)), want, rtol=RTOL, atol=ATOL)
    r = jax.random.normal(jax.random.key(11), want.shape)
    grads = [jax.grad(lambda x, g=g, st=st: jnp.sum(nnx.merge(g, st)(x) * r))(x)
             for g, st in (nnx.split(m), nnx.split(fm))]
    # fp32 both sides, different summation orders: relative 1e-4 of O(1) gradients.
    np.testing.assert_allclose(np.asarray(grads[1]), np.asarray(grads[0]), rtol=1e-4, atol=1e-5)
    names = ("w_gate", "w_up", "w_down") if activation == "swiglu" else ("w_in", "w_out")
    for k in names:  # each copy, alone, is read (or not) by the call
        t = getattr(fm, f"{k}_t")
        t.set_value(t[...] * 2.0)
        changed = not np.allclose(np.asarray(run(fm, x)), want, rtol=RTOL, atol=ATOL)
        t.set_value(t[...] / 2.0)
        assert changed == (math.prod(shape) in FEATURE_MAJOR_ROWS), k


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_feature_major_mlp_in_bfloat16_matches_the_usual_path(activation):
    """bf16 parameters and compute: the feature-major call (6 rows) against the usual path and the float64 product
    of the same bf16 parameters. Tolerance: bf16 keeps 8 bits, and each path rounds its products and hidden
    activations once each to bf16 (relative ~2^-8 per rounding, sums of 8-12 O(1) terms): 5e-2 relative, 5e-2
    absolute."""
    D, F = 8, 12
    m = build(lambda: mlp(D, F, activation, use_bias=True, param_dtype="bfloat16", dtype="bfloat16",
                          rngs=nnx.Rngs(0)), 9, std=0.5)
    x = jax.random.normal(jax.random.key(10), (2, 3, D)).astype(jnp.bfloat16)
    fm = nnx.merge(*nnx.split(m))
    assert add_transposed_copies(fm) == 1
    assert run(fm, x).dtype == jnp.bfloat16
    usual, fast = np.asarray(run(m, x), np.float32), np.asarray(run(fm, x), np.float32)
    t = getattr(fm, "w_down_t" if activation == "swiglu" else "w_out_t")  # the call reads the output copy
    t.set_value(t[...] * 2.0)
    assert not np.allclose(np.asarray(run(fm, x), np.float32), fast, rtol=5e-2, atol=5e-2)
    t.set_value(t[...] / 2.0)
    p, xn = params_np(m), np.asarray(x.astype(jnp.float32), np.float64)
    if activation == "swiglu":
        h = _np_act("silu", xn @ p["w_gate"] + p["b_gate"]) * (xn @ p["w_up"] + p["b_up"])
        want = h @ p["w_down"] + p["b_down"]
    else:
        want = _np_act("gelu", xn @ p["w_in"] + p["b_in"]) @ p["w_out"] + p["b_out"]
    np.testing.assert_allclose(fast, usual, rtol=5e-2, atol=5e-2)
    np.testing.assert_allclose(fast, want, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("activation, target", [("swiglu", "w_up"), ("swiglu", "w_down"), ("gelu", "w_out")])
def test_feature_major_copies_skip_adapted_mlps(activation, target):
    """A module with a LoRA adapter on any of its projections keeps the usual path (the feature-major one
    would bypass the adapter)."""
    from jaxformer.nn.lora import LoRASpec

    spec = LoRASpec(rank=2, alpha=4.0, targets=frozenset({target}))
    m = nnx.eval_shape(lambda: mlp(8, 12, activation, use_bias=False, lora=spec, rngs=nnx.Rngs(0)))
    assert add_transposed_copies(m) == 0
    assert not any(hasattr(m, f"{k}_t") for k in ("w_in", "w_out", "w_gate", "w_up", "w_down"))
    # copies given by hand are not used either: the call keeps the adapter (B non-zero, so it counts)
    m = build(lambda: mlp(8, 12, activation, use_bias=False, lora=spec, rngs=nnx.Rngs(0)), 9, std=0.5)
    x = jax.random.normal(jax.random.key(10), (2, 3, 8))
    want = np.asarray(run(m, x))
    for k in ("w_gate", "w_up", "w_down") if activation == "swiglu" else ("w_in", "w_out"):
        setattr(m, f"{k}_t", TransposedCopy(jnp.swapaxes(getattr(m, k)[...], -1, -2)))
    np.testing.assert_array_equal(np.asarray(run(m, x)), want)


# slow, 18 s: all but 6 rows of every combination but q/k/v biases alone (biases on all four projections and on
# none are the other two's), and 1 row of GQA with biases; the rows rule's edges are the MLP test's above and the
# heads' below (default-run)
@pytest.mark.parametrize("shape, share, bias, qkv_bias", fm_cases(
    [("none", True, None), ("none", False, True), ("qk", False, None)],
    lambda i, c: (i == 0 and c != ("none", False, True)) or (i == 3 and c == ("none", True, None))))
def test_feature_major_attention_matches_reference_forward_and_grad(share, bias, qkv_bias, shape):
    """Attention given transposed copies of its projections (the decode engine's feature-major calls, 2-32 rows:
    ``[N, H, D]`` / ``[K, H, D]`` / ``[D, N, H]``) against the float64 reference forward (GQA, RoPE, causal,
    biases; with W_k shared with W_q: against the usual path), its input gradient against the usual path's; the
    copies are what a call in that range reads (changing each one changes the result), outside it unused."""
    D, N, H = 16, 4, 4
    K = 2 if share == "none" else N
    m = build(lambda: attention(D, N, K, H, position="rope", share=share, use_bias=bias, qkv_bias=qkv_bias,
                                impl="xla", rngs=nnx.Rngs(0)), 21)
    x = jax.random.normal(jax.random.key(22), (*shape, D))
    mask = MaskSpec(causal=True)
    p = params_np(m)
    fm = nnx.merge(*nnx.split(m))
    assert add_transposed_copies(fm) == 1
    names = [k for k in ("w_q", "w_k", "w_v", "w_o") if getattr(fm, k) is not None]
    assert [k for k in ("w_q", "w_k", "w_v", "w_o") if hasattr(fm, f"{k}_t")] == names
    if share == "none":
        want = ref_attention(np, p, np.asarray(x, np.float64), position="rope", causal=True)
        np.testing.assert_allclose(np.asarray(run(fm, x, mask=mask)), want, rtol=RTOL, atol=ATOL)
    want = np.asarray(run(m, x, mask=mask))  # the usual path (against the reference in the test above)
    np.testing.assert_allclose(np.asarray(run(fm, x, mask=mask)), want, rtol=RTOL, atol=ATOL)
    r = jax.random.normal(jax.random.key(23), want.shape)
    grads = [jax.jit(jax.grad(lambda x, g=g, st=st: jnp.sum(nnx.merge(g, st)(x, mask=mask) * r)))(x)
             for g, st in (nnx.split(m), nnx.split(fm))]
    np.testing.assert_allclose(np.asarray(grads[1]), np.asarray(grads[0]), rtol=1e-4, atol=1e-5)
    for k in names:  # each copy is read (feature-major rows) or unused (other rows)
        t = getattr(fm, f"{k}_t")
        t.set_value(t[...] * 2.0)
        changed = not np.allclose(np.asarray(run(fm, x, mask=mask)), want, rtol=RTOL, atol=ATOL)
        t.set_value(t[...] / 2.0)
        assert changed == (math.prod(shape) in FEATURE_MAJOR_ROWS), k


@pytest.mark.parametrize("shape", [(2, 3), (4, 8), (1, 1), (5, 8)])
def test_feature_major_heads_match_reference(shape):
    """The tied head marked feature-major (its table ``[V, D]`` read as it lies) and the untied head given a
    ``[V, D]`` copy, against the float64 products, in fp32 logits; a marked tied head reads its table, an untied
    one its copy, at 2-32 rows only."""
    V, D = 11, 6
    emb = build(lambda: Embed(V, D, rngs=nnx.Rngs(0)), 24)
    head = build(lambda: LMHead(D, V, rngs=nnx.Rngs(0)), 25)
    x = jax.random.normal(jax.random.key(26), (*shape, D))
    xn = np.asarray(x, np.float64)
    want_tied = xn @ np.asarray(emb.embedding[...], np.float64).T
    want_untied = xn @ params_np(head)["kernel"]
    for module, want in ((emb, want_tied), (head, want_untied)):
        assert add_transposed_copies(module) == 1
        if module is head:
            got = run(module, x)
        else:
            got = jax.jit(lambda st, x: nnx.merge(nnx.graphdef(emb), st).attend(x))(nnx.state(emb), x)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=ATOL)
    assert emb.feature_major and isinstance(head.kernel_t, TransposedCopy)
    head.kernel_t.set_value(head.kernel_t[...] * 2.0)
    changed = not np.allclose(np.asarray(run(head, x)), want_untied, rtol=RTOL, atol=ATOL)
    assert changed == (math.prod(shape) in FEATURE_MAJOR_ROWS)
    with jax.disable_jit():  # the marked tied head's product is the feature-major one: E x^T, then a barrier
        jaxpr = jax.make_jaxpr(lambda x: emb.attend(x))(x)
    assert ("optimization_barrier" in str(jaxpr)) == (math.prod(shape) in FEATURE_MAJOR_ROWS)


def test_feature_major_copies_skip_adapted_attention():
    """An attention with a LoRA adapter on any projection gets no copies (the feature-major path would bypass
    the adapter)."""
    from jaxformer.nn.lora import LoRASpec

    spec = LoRASpec(rank=2, alpha=4.0, targets=frozenset({"w_v"}))
    m = nnx.eval_shape(lambda: attention(16, 4, 2, 4, lora=spec, rngs=nnx.Rngs(0)))
    assert add_transposed_copies(m) == 0
    assert not any(hasattr(m, f"{k}_t") for k in ("w_q", "w_k", "w_v", "w_o"))


def test_norms_match_reference():
    D = 16
    x = 3.0 + 2.0 * jax.random.normal(jax.random.key(11), (2, 5, D))
    xn = np.asarray(x, np.float64)
    for use_bias in (True, False):
        ln = build(lambda: LayerNorm(D, eps=1e-5, use_bias=use_bias, rngs=nnx.Rngs(0)), 12)
        p = params_np(ln)
        want = (xn - xn.mean(-1, keepdims=True)) / np.sqrt(xn.var(-1, keepdims=True) + 1e-5) * p["scale"]
        want = want + p["bias"] if use_bias else want
        np.testing.assert_allclose(np.asarray(run(ln, x)), want, rtol=RTOL, atol=ATOL)
    rms = build(lambda: RMSNorm(D, eps=1e-6, rngs=nnx.Rngs(0)), 13)
    want = xn / np.sqrt((xn ** 2).mean(-1, keepdims=True) + 1e-6) * params_np(rms)["scale"]
    np.testing.assert_allclose(np.asarray(run(rms, x)), want, rtol=RTOL, atol=ATOL)
    # bf16 input: statistics in fp32, output dtype preserved.
    assert rms(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16


def test_embeddings():
    V, D, P = 11, 6, 9
    emb = build(lambda: Embed(V, D, rngs=nnx.Rngs(0)), 14)
    tokens = jnp.array([[0, 3, 10], [5, 5, 1]])
    table = np.asarray(emb.embedding[...])
    np.testing.assert_array_equal(emb(tokens), table[np.asarray(tokens)])
    x = jax.random.normal(jax.random.key(15), (2, 3, D))
    np.testing.assert_allclose(emb.attend(x), np.asarray(x, np.float64) @ table.T.astype(np.float64),
                               rtol=RTOL, atol=ATOL)
    head = build(lambda: LMHead(D, V, rngs=nnx.Rngs(0)), 16)
    np.testing.assert_allclose(head(x), np.asarray(x, np.float64) @ params_np(head)["kernel"],
                               rtol=RTOL, atol=ATOL)
    pos = build(lambda: LearnedPositions(P, D, rngs=nnx.Rngs(0)), 17)
    np.testing.assert_array_equal(pos(jnp.array([[2, 0, 8]])), np.asarray(pos.embedding[...])[[[2, 0, 8]]])


@pytest.mark.parametrize("norm,use_bias,activation", [("layernorm", True, "gelu"), ("rmsnorm", False, "relu"),
                                                      ("layernorm", False, "gelu_tanh")])
def test_head_transform_matches_reference_forward_and_grad(norm, use_bias, activation):
    """BERT's ``norm(act(x W + b))``: numpy float64 forward, and gradients (x and every parameter)
    against the same formula in plain jnp."""
    D, eps = 8, 1e-3   # not the default 1e-5: the section's eps must reach the norm
    m = build(lambda: HeadTransform(D, activation, norm=NormConfig(kind=norm, eps=eps), use_bias=use_bias,
                                    rngs=nnx.Rngs(0)), 21)
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(m, nnx.Param))}
    assert names == ({"w", "b", "norm.scale", "norm.bias"} if use_bias else {"w", "norm.scale"})
    x = 2.0 * jax.random.normal(jax.random.key(22), (2, 3, D))
    ct = jax.random.normal(jax.random.key(23), (2, 3, D))

    def reference(xp, p, x, act):
        vec = {k: v[None, None] for k, v in p.items() if v.ndim == 1}  # [D] -> [1, 1, D]
        h = x @ p["w"]
        h = act(h + vec["b"] if "b" in p else h)
        if norm == "rmsnorm":
            return h / xp.sqrt((h * h).mean(-1, keepdims=True) + eps) * vec["norm.scale"]
        mu = h.mean(-1, keepdims=True)
        y = (h - mu) / xp.sqrt(((h - mu) ** 2).mean(-1, keepdims=True) + eps) * vec["norm.scale"]
        return y + vec["norm.bias"] if "norm.bias" in p else y

    p = params_np(m)
    want = reference(np, p, np.asarray(x, np.float64), lambda h: _np_act(activation, h))
    np.testing.assert_allclose(np.asarray(run(m, x)), want, rtol=RTOL, atol=ATOL)

    jnp_act = {"gelu": lambda h: 0.5 * h * (1.0 + jax.scipy.special.erf(h / math.sqrt(2.0))),
               "gelu_tanh": lambda h: 0.5 * h * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h ** 3))),
               "relu": lambda h: jnp.maximum(h, 0.0)}[activation]
    graphdef, state = nnx.split(m)
    _, pull = jax.vjp(lambda st, xx: nnx.merge(graphdef, st)(xx), state, x)
    g_state, g_x = jax.jit(pull)(ct)
    pj = {k: jnp.asarray(v, jnp.float32) for k, v in p.items()}
    _, pull_ref = jax.vjp(lambda pp, xx: reference(jnp, pp, xx, jnp_act), pj, x)
    g_ref, g_x_ref = jax.jit(pull_ref)(ct)
    # fp32 both sides, different op order: relative 1e-4 of O(1) gradients.
    np.testing.assert_allclose(g_x, g_x_ref, rtol=1e-4, atol=1e-4)
    for path, v in nnx.to_flat_state(g_state):
        np.testing.assert_allclose(v[...], g_ref[".".join(map(str, path))], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="non-gated activation, got 'swiglu'"):
        HeadTransform(D, "swiglu", rngs=nnx.Rngs(0))


# ---------------------------------------------------------------- residual block
def _branch(D, seed):
    w = 0.5 * jax.random.normal(jax.random.key(seed), (D, D))
    return lambda h: jnp.tanh(h @ w), np.asarray(w, np.float64)


def _np_ln(x, eps=1e-5):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)


@pytest.mark.parametrize("position,sandwich,alpha", [("pre", False, 1.0), ("pre", True, 1.0),
                                                     ("post", False, 1.0), ("deepnorm", False, 2.2)])
def test_residual_formulas(position, sandwich, alpha):
    D = 8
    f, w = _branch(D, 18)
    res = Residual(LayerNorm(D, rngs=nnx.Rngs(0)), norm_position=position, alpha=alpha,
                   branch_norm=LayerNorm(D, rngs=nnx.Rngs(1)) if sandwich else None)
    x = jax.random.normal(jax.random.key(19), (2, 3, D))
    xn = np.asarray(x, np.float64)
    if position == "pre":
        h = np.tanh(_np_ln(xn) @ w)
        want = xn + (_np_ln(h) if sandwich else h)
    else:  # post: LN(x + f(x)); deepnorm: LN(alpha x + f(x))
        want = _np_ln(alpha * xn + np.tanh(xn @ w))
    np.testing.assert_allclose(np.asarray(res(x, f)), want, rtol=RTOL, atol=ATOL)


def test_residual_rejects_alpha_without_deepnorm():
    with pytest.raises(ValueError, match="alpha=2.0.*'pre'"):
        Residual(RMSNorm(4, rngs=nnx.Rngs(0)), norm_position="pre", alpha=2.0)


def _tiny_block(D=8, cross=False, seed=0):
    r = nnx.Rngs(seed)
    kw = dict(impl="xla", use_bias=True, rngs=r)
    return Block(
        attention(D, 2, 1, position="rope", **kw), Residual(RMSNorm(D, rngs=r)),
        mlp(D, 16, "swiglu", rngs=r), Residual(RMSNorm(D, rngs=r)),
        cross_attn=attention(D, 2, **kw) if cross else None,
        cross_residual=Residual(RMSNorm(D, rngs=r)) if cross else None,
    )


# 1 s; the block it composes, x + f(x) then + g(.), is test_residual_formulas's (each residual against float64) and
# test_oracle's (whole pre-norm blocks against float64; without the identity path too) (default-run)
@pytest.mark.slow
def test_pre_norm_block_jacobian_contains_identity():
    """Pre-norm: block(x) = h + g(h), h = x + f(x), so J = (I + J_g(h)) (I + J_f(x)), built here from
    the sublayers alone; with both output projections zeroed the branches vanish and J = I exactly."""
    D, T = 8, 3
    blk = build(lambda: _tiny_block(D), 20)
    x = jax.random.normal(jax.random.key(21), (1, T, D))
    mask = MaskSpec(causal=True)

    def flat(fn):
        return lambda v: fn(v.reshape(1, T, D)).reshape(-1)

    graphdef, state = nnx.split(blk)

    @jax.jit
    def jacobians(st, v):
        b = nnx.merge(graphdef, st)
        f = flat(lambda u: b.self_attn(b.attn_residual.norm(u), mask=mask))
        g = flat(lambda u: b.mlp(b.mlp_residual.norm(u)))
        h = v + f(v)
        return jax.jacfwd(flat(lambda u: b(u, mask=mask)[0]))(v), jax.jacfwd(f)(v), jax.jacfwd(g)(h)

    J, J_f, J_g = jacobians(state, x.reshape(-1))
    eye = np.eye(T * D)
    # fp32 Jacobians of O(1) entries composed by one 24x24 product.
    np.testing.assert_allclose(J, (eye + J_g) @ (eye + J_f), rtol=1e-5, atol=1e-5)
    assert np.abs(J_f).max() > 1e-2 and np.abs(J_g).max() > 1e-2  # the branches are not trivially zero

    blk.self_attn.w_o[...] = jnp.zeros_like(blk.self_attn.w_o[...])
    blk.self_attn.b_o[...] = jnp.zeros_like(blk.self_attn.b_o[...])
    blk.mlp.w_down[...] = jnp.zeros_like(blk.mlp.w_down[...])
    J0, _, _ = jacobians(nnx.state(blk), x.reshape(-1))
    np.testing.assert_array_equal(J0, eye)


def test_block_cross_attention_arguments():
    blk = nnx.eval_shape(lambda: _tiny_block(8, cross=True))
    x = jax.ShapeDtypeStruct((1, 3, 8), jnp.float32)
    ctx = jax.ShapeDtypeStruct((1, 5, 8), jnp.float32)
    with pytest.raises(ValueError, match="cross-attention: pass context"):
        nnx.eval_shape(lambda b, x: b(x), blk, x)
    y, cache = nnx.eval_shape(lambda b, x, c: b(x, context=c), blk, x, ctx)
    assert y.shape == (1, 3, 8) and cache is None
    with pytest.raises(ValueError, match="without cross-attention"):
        nnx.eval_shape(lambda b, x, c: b(x, context=c), nnx.eval_shape(lambda: _tiny_block(8)), x, ctx)


# ---------------------------------------------------------------- logical axes
def test_logical_axes_on_every_param():
    assert LOGICAL_AXES == ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers")
    def make():
        r = nnx.Rngs(0)
        return [_tiny_block(8, cross=True), Embed(5, 8, rngs=r), LMHead(8, 5, rngs=r),
                LearnedPositions(4, 8, rngs=r), LayerNorm(8, rngs=r), mlp(8, 16, "gelu", rngs=r),
                HeadTransform(8, "gelu", rngs=r)]

    mods = nnx.eval_shape(make)
    seen = {}
    for mod in mods:
        for path, v in nnx.to_flat_state(nnx.state(mod, nnx.Param)):
            axes = v.get_metadata()["out_sharding"]
            assert len(axes) == len(v.shape), (path, axes)
            assert all(a is None or a in LOGICAL_AXES for a in axes), (path, axes)
            seen[path[-1]] = tuple(axes)
    assert seen["w_q"] == ("embed", "heads", "head_dim")
    assert seen["w_k"] == seen["w_v"] == ("embed", "kv_heads", "head_dim")
    assert seen["w_o"] == ("heads", "head_dim", "embed")
    assert seen["w_gate"] == seen["w_up"] == seen["w_in"] == ("embed", "mlp")
    assert seen["w_down"] == seen["w_out"] == ("mlp", "embed")
    assert seen["kernel"] == ("embed", "vocab")
    assert seen["w"] == ("embed", None) and seen["b"] == ("embed",)
    assert seen["scale"] == ("embed",)


def test_param_rejects_unknown_axis_and_rank_mismatch():
    init = lambda k, s, d: jnp.zeros(s, d)  # noqa: E731
    with pytest.raises(ValueError, match="unknown logical axes.*'model'"):
        param(nnx.Rngs(0), init, (2, 3), ("embed", "model"), "float32")
    with pytest.raises(ValueError, match=r"axes \('embed',\) do not match shape \(2, 3\)"):
        param(nnx.Rngs(0), init, (2, 3), ("embed",), "float32")


def test_params_shard_eagerly_only_under_a_mesh_with_rules():
    rules = (("vocab", "tensor"), ("embed", "fsdp"))
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 3)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        emb = Embed(8, 4, rngs=nnx.Rngs(0))
        specs = nnx.get_partition_spec(nnx.state(emb))
    assert emb.embedding[...].sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    assert specs["embedding"].get_value() == jax.sharding.PartitionSpec("tensor", "fsdp")
    plain = Embed(8, 4, rngs=nnx.Rngs(0))  # no mesh: created unsharded, same values
    assert len(plain.embedding[...].sharding.device_set) == 1
    np.testing.assert_array_equal(plain.embedding[...], emb.embedding[...])


def test_initialisers_are_jax_nn_initializers():
    """``normal`` draws jax.nn.initializers.normal in fp32 (bf16 parameters: the same draw, rounded);
    ``normal(xavier_std(...))`` draws what Glorot normal (variance_scaling, fan_avg) draws."""
    from jaxformer.nn.params import normal, ones, xavier_std, zeros

    key, shape = jax.random.key(3), (48, 80)
    want = jax.nn.initializers.normal(0.02)(key, shape, jnp.float32)
    np.testing.assert_array_equal(normal(0.02)(key, shape, jnp.float32), want)
    np.testing.assert_array_equal(normal(0.02)(key, shape, jnp.bfloat16), want.astype(jnp.bfloat16))
    glorot = jax.nn.initializers.variance_scaling(0.7 ** 2, "fan_avg", "normal")(key, shape, jnp.float32)
    # the same standard normal draw times a std computed two ways (a float32 ulp apart at most)
    np.testing.assert_allclose(normal(xavier_std(*shape, gain=0.7))(key, shape, jnp.float32), glorot, rtol=1e-6)
    assert (zeros(key, (2,), jnp.bfloat16) == 0).all() and zeros(key, (2,), jnp.bfloat16).dtype == jnp.bfloat16
    assert (ones(key, (2,), jnp.float32) == 1).all()
