"""jaxformer.nn.params.project (every projection of the model) against a float64 numpy einsum, forward and
gradients, and the form of its weight gradient (what makes it fast on XLA's CPU backend)."""

import string

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from jaxformer.nn.params import project

# fp32 products of O(1) values over <= 27 terms (x w: <= 16; the weight gradient sums over <= 27 rows) against
# float64: a few ulps of accumulated rounding on the CPU.
RTOL, ATOL = 1e-5, 1e-5


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


@given(lead=st.lists(st.integers(0, 3), max_size=3), inner=st.lists(st.integers(1, 4), min_size=1, max_size=2),
       outer=st.lists(st.integers(1, 4), min_size=1, max_size=2), seed=st.integers(0, 2**16))
@example(lead=[2, 3], inner=[2, 3], outer=[4], seed=0)  # attention's output projection: [B, T, N, H] x [N, H, D]
@example(lead=[2, 3], inner=[4], outer=[2, 3], seed=1)  # its input projections: [B, T, D] x [D, N, H]
@example(lead=[], inner=[3], outer=[5], seed=2)  # a single vector
@example(lead=[2, 0], inner=[3], outer=[5], seed=3)  # no rows
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


def test_project_names_the_shapes_it_refuses():
    with pytest.raises(ValueError, match=r"x.shape=\(2, 3, 5\) does not end in w.shape\[:1\]=\(4,\)"):
        project(jnp.zeros((2, 3, 5)), jnp.zeros((4, 6)), jnp.float32)
    with pytest.raises(ValueError, match=r"w.shape\[:2\]=\(4, 2\)"):
        project(jnp.zeros((2, 3, 2, 4)), jnp.zeros((4, 2, 6)), jnp.float32, n_in=2)
