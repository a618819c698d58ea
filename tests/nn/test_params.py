"""jaxformer.nn.params.project (every projection of the model) against a float64 numpy einsum, forward and
gradients, and the form of its weight gradient (what makes it fast on XLA's CPU backend)."""

import math
import re
import string

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from jaxformer.nn import params as PP
from jaxformer.nn.params import project
from tests.draws import few_draws

# fp32 products of O(1) values over <= 27 terms (x w: <= 16; the weight gradient sums over <= 27 rows) against
# float64: a few ulps of accumulated rounding on the CPU.
RTOL, ATOL = 1e-5, 1e-5
# Each draw compiles new shapes; the pinned examples are the model's projection shapes.
DRAWS = few_draws()


def _spec(x_ndim, w_ndim, n_in):
    """The einsum subscripts of ``x [*B, *I] w [*I, *O] -> [*B, *O]``: (x's, w's, the result's)."""
    a = string.ascii_lowercase
    xs, ws = a[:x_ndim], a[x_ndim - n_in:x_ndim] + a[x_ndim:x_ndim + w_ndim - n_in]
    return xs, ws, xs[:x_ndim - n_in] + ws[n_in:]


def ref_project(x, w, n_in):
    """The einsum ``x [*B, *I] w [*I, *O] -> [*B, *O]`` in float64 numpy."""
    xs, ws, ys = _spec(x.ndim, w.ndim, n_in)
    return np.einsum(f"{xs},{ws}->{ys}", np.asarray(x, np.float64), np.asarray(w, np.float64))


def ref_grads(x, w, g, n_in):
    """d/dx and d/dw of ``sum(g * (x w))`` in float64, each an einsum of the other operand with ``g``: ``dx = g w``
    over the output axes, ``dw = x g`` over the leading axes (no flattening: independent of ``project``'s)."""
    xs, ws, ys = _spec(x.ndim, w.ndim, n_in)
    x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
    return np.einsum(f"{ys},{ws}->{xs}", g64, w64), np.einsum(f"{xs},{ys}->{ws}", x64, g64)


def assert_rank2_dots(jaxpr):
    """Every ``dot_general`` of ``jaxpr`` (top level) is a rank-2 product contracting one axis per operand."""
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots, jaxpr
    for e in dots:
        (lc, rc), _ = e.params["dimension_numbers"]
        assert [v.aval.ndim for v in e.invars] == [2, 2] and len(lc) == len(rc) == 1, e
    return dots


@DRAWS  # 12 -> 1 draw: 4 s
@given(lead=st.lists(st.integers(0, 3), max_size=3), inner=st.lists(st.integers(1, 4), min_size=1, max_size=2),
       outer=st.lists(st.integers(1, 4), min_size=1, max_size=2), seed=st.integers(0, 2**16))
@example(lead=[2, 3], inner=[2, 3], outer=[4], seed=0)  # attention's output projection: [B, T, N, H] x [N, H, D]
@example(lead=[2, 3], inner=[4], outer=[2, 3], seed=1)  # its input projections: [B, T, D] x [D, N, H]
@example(lead=[], inner=[3], outer=[5], seed=2)  # a single vector
@example(lead=[2, 0], inner=[3], outer=[5], seed=3)  # no rows
@example(lead=[3, 2], inner=[4, 4], outer=[3], seed=4)  # a tall weight (I >= 2 O): the wide weight gradient
def test_project_matches_einsum_forward_and_grads(lead, inner, outer, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*lead, *inner)).astype(np.float32)
    w = rng.standard_normal((*inner, *outer)).astype(np.float32)
    g = rng.standard_normal((*lead, *outer)).astype(np.float32)
    n_in = len(inner)
    y = project(jnp.asarray(x), jnp.asarray(w), jnp.float32, n_in=n_in)
    assert y.shape == (*lead, *outer) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), ref_project(x, w, n_in), rtol=RTOL, atol=ATOL)
    dx, dw = jax.grad(lambda a, b: jnp.sum(g * project(a, b, jnp.float32, n_in=n_in)), (0, 1))(x, w)
    rx, rw = ref_grads(x, w, g, n_in)
    np.testing.assert_allclose(np.asarray(dx), rx, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(dw), rw, rtol=RTOL, atol=ATOL)


def test_project_bf16_with_fp32_result():
    """The output head's use: bf16 operands, ``preferred_element_type=float32`` (logits in fp32). The
    reference is the float64 product of the bf16-rounded operands; one bf16 product is exact in fp32."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 5, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, 11)), jnp.float32)
    y = project(x, w, jnp.bfloat16, preferred_element_type=jnp.float32)
    assert y.dtype == jnp.float32 and y.shape == (2, 5, 11)
    ref = ref_project(np.asarray(x.astype(jnp.bfloat16), np.float32), np.asarray(w.astype(jnp.bfloat16), np.float32), 1)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)


def test_project_weight_gradient_is_one_plain_product():
    """The reason ``project`` exists: the weight gradient of a projection of ``[B, T, D]`` activations must be a
    single rank-2 ``x^T dy`` (contracting one axis per operand). An einsum over ``[B, T, D]`` gives a dot
    contracting two axes of each operand, which XLA's CPU backend runs through a transposed copy and an Eigen
    dot at a third of the speed (experiments/results/train_throughput.md)."""
    x = jnp.zeros((2, 8, 16))
    for w, n_in, xx in ((jnp.zeros((16, 4, 8)), 1, x), (jnp.zeros((4, 4, 16)), 2, x.reshape(2, 8, 4, 4))):
        assert_rank2_dots(jax.make_jaxpr(jax.grad(lambda b, a=xx, n=n_in: jnp.sum(project(a, b, jnp.float32,
                                                                                           n_in=n))))(w))


def _dots_and_barriers(jaxpr):
    eqns = [e for e in jaxpr.eqns if e.primitive.name in ("dot_general", "optimization_barrier")]
    return [(e.primitive.name, tuple(e.outvars[0].aval.shape)) for e in eqns]


def test_tall_weights_take_the_wide_weight_gradient():
    """A tall weight ``[I, O]`` (``I >= TALL_RATIO * O``) on the CPU: its weight gradient is the ``[O, I]`` product
    behind an optimisation barrier (then transposed), not the ``[I, O]`` one, in the program and in what XLA
    compiles (without the barrier XLA folds the transpose back into an ``[I, O]`` product); a frozen weight
    (gradient with respect to ``x`` only) computes neither; a weight below the ratio keeps the plain form."""
    x, g = jnp.ones((3, 5, 16)), jnp.ones((3, 5, 16))

    def grad_jaxpr(w, argnums):
        return jax.make_jaxpr(jax.grad(lambda a, b: jnp.sum(g[..., :b.shape[1]] * project(a, b, jnp.float32)),
                                       argnums))(x, w)

    assert _dots_and_barriers(grad_jaxpr(jnp.ones((16, 4)), 1)) == [("dot_general", (4, 16)),
                                                                   ("optimization_barrier", (4, 16))]
    frozen = _dots_and_barriers(grad_jaxpr(jnp.ones((16, 4)), 0))
    assert ("dot_general", (15, 16)) in frozen and not {("dot_general", (4, 16)), ("optimization_barrier", (4, 16)),
                                                        ("dot_general", (16, 4))} & set(frozen), frozen
    assert sorted(_dots_and_barriers(grad_jaxpr(jnp.ones((16, 4)), (0, 1)))) == [
        ("dot_general", (4, 16)), ("dot_general", (15, 16)), ("optimization_barrier", (4, 16))]
    short = _dots_and_barriers(grad_jaxpr(jnp.ones((16, 9)), 1))  # 16 < 2 * 9: not tall
    assert short and all(name == "dot_general" for name, _ in short), short
    xs, gs = jnp.ones((3, 5, 64)), jnp.ones((3, 5, 16))
    hlo = jax.jit(jax.grad(lambda b: jnp.sum(gs * project(xs, b, jnp.float32)))).lower(jnp.ones((64, 16))).compile()
    dots = set(re.findall(r"f32\[(\d+),(\d+)\]\{[^}]*\} dot\(", hlo.as_text()))
    assert ("16", "64") in dots and ("64", "16") not in dots, dots


def test_tall_product_derivatives_match_plain_autodiff(monkeypatch):
    """Forward mode, second order and ``vmap`` through the wide weight gradient's custom JVP: the same numbers as
    JAX's own derivatives of the plain product (``TALL_RATIO`` raised so nothing is tall), and first order as the
    float64 einsum (second order only against JAX's own rules). fp32 products of <= 20 terms: a few ulps (``RTOL``,
    ``ATOL``)."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((4, 5, 12)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((12, 3)), jnp.float32)
    g = rng.standard_normal((4, 5, 3)).astype(np.float32)

    def f(a, b):
        return jnp.sum(jnp.tanh(project(a, b, jnp.float32)))

    def derivatives():
        return (jax.jacfwd(lambda b: project(x, b, jnp.float32))(w),
                jax.hessian(f, 1)(x, w),
                jax.jacrev(jax.grad(f, 0), 1)(x, w),
                jax.vmap(jax.grad(f, 1), (0, None))(x, w),
                jax.grad(lambda a, b: jnp.sum(g * project(a, b, jnp.float32)), (0, 1))(x, w))

    assert PP._wide_weight_gradient(20, 12, 3)
    tall = derivatives()
    monkeypatch.setattr(PP, "TALL_RATIO", 10**9)
    assert not PP._wide_weight_gradient(20, 12, 3)
    plain = derivatives()
    for t, p in zip(jax.tree.leaves(tall), jax.tree.leaves(plain)):
        np.testing.assert_allclose(np.asarray(t), np.asarray(p), rtol=RTOL, atol=ATOL)
    rx, rw = ref_grads(np.asarray(x), np.asarray(w), g, 1)
    np.testing.assert_allclose(np.asarray(tall[-1][0]), rx, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(tall[-1][1]), rw, rtol=RTOL, atol=ATOL)


def test_tall_product_bf16_with_fp32_result():
    """The output head's use on a tall weight: bf16 operands, fp32 result; the weight gradient (wide form) equals
    the float64 product of the bf16-rounded operands, rounded to bf16 (``w``'s dtype): ``rtol`` bf16's half ulp,
    ``atol`` 1e-2 for the entries near zero."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 5, 8)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((8, 3)), jnp.bfloat16)
    g = rng.standard_normal((2, 5, 3)).astype(np.float32)
    y, dw = jax.value_and_grad(lambda b: jnp.sum(g * project(x, b, jnp.bfloat16,
                                                               preferred_element_type=jnp.float32)))(w)
    assert dw.dtype == jnp.bfloat16 and dw.shape == (8, 3)
    ref = ref_grads(np.asarray(x, np.float32), np.asarray(w, np.float32), g, 1)[1]
    np.testing.assert_allclose(np.asarray(dw, np.float32), ref, rtol=2**-8, atol=1e-2)


def test_project_under_an_explicit_sharding_mesh():
    """A batch sharded over ``data`` and heads over ``tensor`` (explicit axes: reshapes must say how they shard,
    so ``project`` splits one group of axes at a time): the unsharded numbers, forward and weight gradient."""
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                         devices=jax.devices()[:4])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 8)).astype(np.float32)
    w = rng.standard_normal((8, 2, 5)).astype(np.float32)
    g = rng.standard_normal((4, 3, 2, 5)).astype(np.float32)

    def loss(w, x):
        return jnp.sum(g * project(x, w, jnp.float32))

    with jax.set_mesh(mesh):
        P, sharded = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
        xs = jax.device_put(x, sharded(mesh, P("data")))
        ws = jax.device_put(w, sharded(mesh, P(None, "tensor")))
        y = jax.jit(lambda x, w: project(x, w, jnp.float32))(xs, ws)
        dw = jax.jit(jax.grad(loss))(ws, xs)
    assert y.sharding.spec == P("data", None, "tensor", None)
    np.testing.assert_allclose(np.asarray(y), ref_project(x, w, 1), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(dw), ref_grads(x, w, g, 1)[1], rtol=RTOL, atol=ATOL)
    # a tall weight (the wide weight gradient, tall_product) under the same mesh, its output axis over "tensor"
    wt = rng.standard_normal((8, 4)).astype(np.float32)
    gt = rng.standard_normal((4, 3, 4)).astype(np.float32)
    with jax.set_mesh(mesh):
        wts = jax.device_put(wt, sharded(mesh, P(None, "tensor")))
        yt = jax.jit(lambda x, w: project(x, w, jnp.float32))(xs, wts)
        dwt = jax.jit(jax.grad(lambda w, x: jnp.sum(gt * project(x, w, jnp.float32))))(wts, xs)
    assert dwt.sharding.spec == P(None, "tensor")
    np.testing.assert_allclose(np.asarray(yt), ref_project(x, wt, 1), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(dwt), ref_grads(x, wt, gt, 1)[1], rtol=RTOL, atol=ATOL)


def test_project_names_the_shapes_it_refuses():
    with pytest.raises(ValueError, match=r"x.shape=\(2, 3, 5\) does not end in w.shape\[:1\]=\(4,\)"):
        project(jnp.zeros((2, 3, 5)), jnp.zeros((4, 6)), jnp.float32)
    with pytest.raises(ValueError, match=r"w.shape\[:2\]=\(4, 2\)"):
        project(jnp.zeros((2, 3, 2, 4)), jnp.zeros((4, 2, 6)), jnp.float32, n_in=2)


# --- one-row products (a batch-1 decode step) on the CPU: split_matvec / project_rows ---------------------------


def _assert_within_dot_bound(y, ref, x64, w64):
    """``|y - ref| <= 1e-5 * (|x| |w|) + 1e-6`` elementwise: fp32 rounding of a length-K dot, whose error is
    bounded by K * 2^-24 * sum|x_i w_i| (9e-5 of it at K 1,536) and is ~sqrt(K) * 2^-24 of it for random
    signs (2.3e-6); 1e-5 leaves headroom for either kernel's summation order and catches a lost term."""
    bound = 1e-5 * (np.abs(x64) @ np.abs(w64)) + 1e-6
    assert np.all(np.abs(np.asarray(y, np.float64) - ref) <= bound), np.max(np.abs(np.asarray(y) - ref) / bound)


def _batched_dots(jaxpr):
    return [e for e in jaxpr.eqns if e.primitive.name == "dot_general" and e.params["dimension_numbers"][1][0]]


ON_CPU = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the split is the CPU's form of one-row products")


@ON_CPU
@DRAWS  # 12 -> 1 draw: 2 s
@given(k=st.sampled_from([256, 512, 576, 1536]), n=st.integers(256, 1100), lead=st.sampled_from([(), (1,), (1, 1)]),
       seed=st.integers(0, 2**16))
@example(k=576, n=1536, lead=(1, 1), seed=0)  # SmolLM2-135M's FFN gate at a batch-1 decode step: x [1, 1, D]
@example(k=1536, n=576, lead=(1,), seed=1)  # its down projection
def test_project_one_row_split_matches_float64(k, n, lead, seed):
    """One row of ``x`` by a weight of >= MATVEC_SPLIT_MIN_WEIGHTS entries takes the split product (the jaxpr
    holds the batched dot); its value and both gradients stay within the fp32 dot bound of a float64 product."""
    import jaxformer.nn.params as P
    if k * n < P.MATVEC_SPLIT_MIN_WEIGHTS:
        n = -(-P.MATVEC_SPLIT_MIN_WEIGHTS // k)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*lead, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    g = rng.standard_normal((*lead, n)).astype(np.float32)
    f = jax.jit(lambda a, b: project(a, b, jnp.float32))
    assert _batched_dots(jax.make_jaxpr(lambda a, b: project(a, b, jnp.float32))(x, w).jaxpr)
    x64, w64, g64 = (np.asarray(a, np.float64).reshape(-1, a.shape[-1]) for a in (x, w, g))
    _assert_within_dot_bound(f(x, w).reshape(1, n), x64 @ w64, x64, w64)
    dx, dw = jax.jit(jax.grad(lambda a, b: jnp.sum(g * project(a, b, jnp.float32)), (0, 1)))(x, w)
    _assert_within_dot_bound(dx.reshape(1, k), g64 @ w64.T, g64, w64.T)  # dx = g w^T
    np.testing.assert_allclose(np.asarray(dw), x64.T @ g64, rtol=1e-6, atol=1e-6)  # dw = x^T g: one term each


@ON_CPU
def test_project_splits_only_one_large_row_without_a_mesh():
    """The split is for one row only (from 2 rows on the batched form is slower), for weights of at least
    MATVEC_SPLIT_MIN_WEIGHTS (tiny models keep the plain product), for an even contraction, and never under a
    mesh (the reshape of a sharded contraction would reshard the weight)."""
    import jaxformer.nn.params as P
    big = P.MATVEC_SPLIT_MIN_WEIGHTS // 512

    def split(x_shape, w_shape):
        return bool(_batched_dots(jax.make_jaxpr(lambda a, b: project(a, b, jnp.float32))(
            jnp.zeros(x_shape), jnp.zeros(w_shape)).jaxpr))

    assert split((1, 512), (512, big))
    assert not split((2, 512), (512, big))  # two rows
    assert not split((1, 1, 512), (512, big - 1))  # below the threshold
    assert not split((1, 513), (513, big))  # an odd contraction
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        assert not split((1, 512), (512, big))


@ON_CPU
@pytest.mark.parametrize("lead", [(1, 1), (3,), (2, 2)])
def test_project_rows_matches_float64(lead):
    """The tied head's ``x @ table^T``: one row (split over the table's rows) and several (the plain product),
    value and both gradients against float64, and the split taken exactly for the one row."""
    from jaxformer.nn.params import project_rows
    import jaxformer.nn.params as P
    o, i = 2 * (P.MATVEC_SPLIT_MIN_WEIGHTS // 256) + 6, 128  # rows even, weights above the threshold
    rng = np.random.default_rng(len(lead))
    x = rng.standard_normal((*lead, i)).astype(np.float32)
    t = rng.standard_normal((o, i)).astype(np.float32)
    g = rng.standard_normal((*lead, o)).astype(np.float32)
    fn = lambda a, b: project_rows(a, b, jnp.float32, preferred_element_type=jnp.float32)  # noqa: E731
    assert bool(_batched_dots(jax.make_jaxpr(fn)(x, t).jaxpr)) == (math.prod(lead) == 1)
    x64, t64, g64 = (np.asarray(a, np.float64).reshape(-1, a.shape[-1]) for a in (x, t, g))
    y = jax.jit(fn)(x, t)
    assert y.shape == (*lead, o) and y.dtype == jnp.float32
    _assert_within_dot_bound(y.reshape(-1, o), x64 @ t64.T, x64, t64.T)
    dx, dt = jax.jit(jax.grad(lambda a, b: jnp.sum(g * fn(a, b)), (0, 1)))(x, t)
    _assert_within_dot_bound(dx.reshape(-1, i), g64 @ t64, g64, t64)
    _assert_within_dot_bound(dt, g64.T @ x64, g64.T, x64)
    with pytest.raises(ValueError, match=r"needs a table \[O, I\] and x \[..., I\]; got x.shape=\(1, 5\)"):
        project_rows(jnp.zeros((1, 5)), jnp.zeros((8, 4)), jnp.float32)
    with pytest.raises(ValueError, match=r"table.shape=\(8, 4, 1\)"):
        project_rows(jnp.zeros((1, 4)), jnp.zeros((8, 4, 1)), jnp.float32)


def test_split_matvec_names_the_shapes_it_refuses():
    from jaxformer.nn.params import split_matvec
    with pytest.raises(ValueError, match=r"x.shape=\(2, 4\) w.shape=\(4, 3\)"):
        split_matvec(jnp.zeros((2, 4)), jnp.zeros((4, 3)))
    with pytest.raises(ValueError, match=r"K divisible by 2, got x.shape=\(1, 5\)"):
        split_matvec(jnp.zeros((1, 5)), jnp.zeros((5, 3)))


@ON_CPU
def test_project_rows_odd_table_takes_the_plain_product():
    """A table with an odd number of rows (GPT-2's 50,257) cannot be split over its rows; one row then takes the
    plain product, never a split of the transposed table's contraction (which copies the whole table)."""
    from jaxformer.nn.params import project_rows
    import jaxformer.nn.params as P
    o, i = 2 * (P.MATVEC_SPLIT_MIN_WEIGHTS // 128) + 1, 128
    jaxpr = jax.make_jaxpr(lambda a, b: project_rows(a, b, jnp.float32))(jnp.zeros((1, 1, i)), jnp.zeros((o, i)))
    assert not _batched_dots(jaxpr.jaxpr)


@ON_CPU
def test_split_matvec_bf16_keeps_the_parts_in_fp32():
    """bf16 operands: the parts are summed in fp32 and rounded once, so the split product is the plain product
    (fp32 accumulation, one rounding to bf16) up to one bf16 ulp; rounding each part to bf16 first is up to ~2."""
    from jaxformer.nn.params import split_matvec
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 1024)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((1024, 512)), jnp.bfloat16)
    y = split_matvec(x, w)
    assert y.dtype == jnp.bfloat16
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    ulp = np.abs(np.asarray(jnp.asarray(ref, jnp.bfloat16), np.float64)) * 2.0 ** -7  # bf16: 8 significant bits
    assert np.all(np.abs(np.asarray(y, np.float64) - ref) <= ulp + 1e-3), np.max(np.abs(np.asarray(y, np.float64) - ref) / (ulp + 1e-3))
    assert split_matvec(x, w, preferred_element_type=jnp.float32).dtype == jnp.float32
