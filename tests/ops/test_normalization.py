"""LayerNorm / RMSNorm vs float64 references (forward and gradients); DeepNet constants."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxformer.ops import DeepNormConstants, deepnorm_constants, layer_norm, rms_norm


def ln_ref(x, scale, bias, eps):
    """float64; variance as E[x^2] - E[x]^2 (a different formula from the one under test)."""
    x = np.asarray(x, np.float64)
    mean = x.mean(-1, keepdims=True)
    var = (x * x).mean(-1, keepdims=True) - mean * mean
    y = (x - mean) / np.sqrt(var + eps) * np.asarray(scale, np.float64)
    return y if bias is None else y + np.asarray(bias, np.float64)


def rms_ref(x, scale, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(scale, np.float64)


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    D = 16
    x = (rng.standard_normal((2, 5, D)) * 3 + 1).astype(np.float32)
    scale = (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    bias = (0.5 * rng.standard_normal(D)).astype(np.float32)
    return x, scale, bias


def test_layer_norm_matches_float64(data):
    x, scale, bias = data
    for b in (bias, None):
        out = layer_norm(jnp.asarray(x), jnp.asarray(scale), None if b is None else jnp.asarray(b), eps=1e-5)
        assert out.dtype == jnp.float32 and out.shape == x.shape
        np.testing.assert_allclose(np.asarray(out), ln_ref(x, scale, b, 1e-5), atol=1e-5, rtol=1e-5)  # fp32


def test_rms_norm_matches_float64(data):
    x, scale, _ = data
    out = rms_norm(jnp.asarray(x), jnp.asarray(scale), eps=1e-6)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), rms_ref(x, scale, 1e-6), atol=1e-5, rtol=1e-5)  # fp32


def test_rms_norm_equals_layer_norm_on_zero_mean(data):
    x, scale, _ = data
    x0 = x - x.mean(-1, keepdims=True)
    a = rms_norm(jnp.asarray(x0), jnp.asarray(scale), eps=1e-5)
    b = layer_norm(jnp.asarray(x0), jnp.asarray(scale), eps=1e-5)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)  # fp32, mean ~1e-7
    assert not np.allclose(np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(scale))),
                           np.asarray(layer_norm(jnp.asarray(x), jnp.asarray(scale))), atol=1e-2)


@pytest.mark.parametrize("magnitude", [1e-4, 1e-3, 3e-3])
def test_eps_inside_the_root_on_tiny_inputs(magnitude):
    """Activations near eps: mean(x^2) ~ eps, so where eps sits decides the output.

    ``1/(sqrt(ms) + eps)`` or no eps at all differ from ``rsqrt(ms + eps)`` by up to ~0.85 here;
    fp32 vs float64 is ~1e-6 relative.
    """
    rng = np.random.default_rng(4)
    D = 32
    x = (magnitude * rng.standard_normal((3, D))).astype(np.float32)
    scale = (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(D)).astype(np.float32)
    for eps in (1e-6, 1e-5):
        np.testing.assert_allclose(np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(scale), eps=eps)),
                                   rms_ref(x, scale, eps), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(layer_norm(jnp.asarray(x), jnp.asarray(scale), jnp.asarray(bias),
                                                         eps=eps)), ln_ref(x, scale, bias, eps), rtol=1e-5, atol=1e-5)


def test_default_eps_and_zero_input():
    """The defaults are the papers' (LayerNorm 1e-5, RMSNorm 1e-6), and an all-zero row gives 0 (+ bias)."""
    rng = np.random.default_rng(5)
    x = (1e-3 * rng.standard_normal((2, 16))).astype(np.float32)
    s = np.ones(16, np.float32)
    np.testing.assert_allclose(np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(s))), rms_ref(x, s, 1e-6),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(layer_norm(jnp.asarray(x), jnp.asarray(s))), ln_ref(x, s, None, 1e-5),
                               rtol=1e-5, atol=1e-5)
    z = jnp.zeros((1, 16))
    assert np.all(np.asarray(rms_norm(z, jnp.asarray(s))) == 0)
    np.testing.assert_array_equal(np.asarray(layer_norm(z, jnp.asarray(s), jnp.full((16,), 0.5))), 0.5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.fp16)])
def test_low_precision_inputs_use_fp32_statistics(dtype):
    rng = np.random.default_rng(1)
    D = 64
    # Offset activations: a low-precision mean of ~300 loses the signal; in fp16, x^2 ~ 9e4 overflows.
    x = jnp.asarray(300 + rng.standard_normal((3, D)), dtype)
    scale = jnp.asarray(1 + 0.1 * rng.standard_normal(D), dtype)
    bias = jnp.asarray(0.1 * rng.standard_normal(D), dtype)
    xs, ss, bs = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, scale, bias))
    ln = layer_norm(x, scale, bias)
    rn = rms_norm(x, scale)
    assert ln.dtype == dtype and rn.dtype == dtype
    # One rounding to the output dtype: relative 2^-8 (bf16) / 2^-11 (fp16), plus slack for fp32 stats.
    tol = 2.0 ** -7 if dtype == jnp.bfloat16 else 2.0 ** -9
    np.testing.assert_allclose(np.asarray(ln.astype(jnp.float32)), ln_ref(xs, ss, bs, 1e-5), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(rn.astype(jnp.float32)), rms_ref(xs, ss, 1e-6), rtol=tol, atol=tol)


def rms_norm_3(x, s, b):
    return rms_norm(x, s)


def test_gradients_match_float64_reference(data):
    x, scale, bias = data
    w = np.random.default_rng(2).standard_normal(x.shape)

    def loss_ln(fn, x, s, b):
        return jnp.sum(fn(x, s, b) * w.astype(x.dtype))

    def ln64(x, s, b):  # jnp float64 twin of ln_ref, differentiated by jax
        mean = x.mean(-1, keepdims=True)
        var = (x * x).mean(-1, keepdims=True) - mean * mean
        return (x - mean) / jnp.sqrt(var + 1e-5) * s[None, None] + b[None, None]

    def rms64(x, s, b):
        return x / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * s[None, None]

    got_ln = jax.jit(jax.grad(loss_ln, argnums=(1, 2, 3)), static_argnums=0)(layer_norm, *map(jnp.asarray, data))
    got_rms = jax.jit(jax.grad(loss_ln, argnums=(1, 2)), static_argnums=0)(rms_norm_3, *map(jnp.asarray, data))
    with jax.enable_x64(True):
        args64 = [jnp.asarray(a, jnp.float64) for a in data]
        want_ln = jax.jit(jax.grad(loss_ln, argnums=(1, 2, 3)), static_argnums=0)(ln64, *args64)
        want_rms = jax.jit(jax.grad(loss_ln, argnums=(1, 2)), static_argnums=0)(rms64, *args64)
        want_ln = [np.asarray(g) for g in want_ln]
        want_rms = [np.asarray(g) for g in want_rms]
    for g, r in zip(got_ln + got_rms, want_ln + want_rms):
        # fp32 backward through a mean/var of 16 values: ~1e-6 relative to the gradient's scale.
        np.testing.assert_allclose(np.asarray(g), r, atol=1e-4 * np.abs(r).max(), rtol=1e-4)


# 1 s; the same gradients (x, scale, bias of both norms) against a float64 formula of their own are
# test_gradients_match_float64_reference's (default-run)
@pytest.mark.slow
def test_gradients_finite_differences_float64():
    rng = np.random.default_rng(3)
    with jax.enable_x64(True):
        x = jnp.asarray(rng.standard_normal((3, 8)))
        s = jnp.asarray(1 + 0.2 * rng.standard_normal(8))
        b = jnp.asarray(rng.standard_normal(8))
        assert layer_norm(x, s, b).dtype == jnp.float64
        # central differences in float64: check_grads' default tolerances (~1e-5 relative).
        check_grads(jax.jit(layer_norm), (x, s, b), order=1, modes=["rev"])
        check_grads(jax.jit(rms_norm), (x, s), order=1, modes=["rev"])


@pytest.mark.no_typecheck
def test_bad_param_shapes_raise():
    x = jnp.zeros((2, 3, 8))
    with pytest.raises(ValueError, match=r"scale.shape=\(4,\).*x.shape=\(2, 3, 8\)"):
        layer_norm(x, jnp.ones(4))
    with pytest.raises(ValueError, match=r"bias.shape=\(1, 8\).*x.shape=\(2, 3, 8\)"):
        layer_norm(x, jnp.ones(8), jnp.zeros((1, 8)))
    with pytest.raises(ValueError, match=r"scale.shape=\(3,\).*x.shape=\(2, 3, 8\)"):
        rms_norm(x, jnp.ones(3))


# DeepNet (Wang et al. 2022) table, evaluated by hand: (N enc, M dec) -> (enc a, enc b, dec a, dec b).
# e.g. encoder-only N=6: (2*6)^(1/4) = 1.86121, (8*6)^(-1/4) = 0.37992;
# encoder-decoder N=M=6: 0.81 * 6^(5/16) = 1.41794, 0.87 * 6^(-5/16) = 0.49699, 18^(1/4), 72^(-1/4).
DEEPNET_TABLE = [
    ((6, 0), (1.8612097182041991, 0.37991784282579627, None, None)),
    ((100, 0), (3.7606030930863934, 0.1880301546543197, None, None)),
    ((128, 0), (4.0, 2.0 ** -2.5, None, None)),
    ((0, 2), (None, None, 2.0 ** 0.5, 0.5)),
    ((0, 12), (None, None, 2.2133638394006434, 0.31947155212313627)),
    ((6, 6), (1.4179381406855227, 0.49698924077132356, 2.0597671439071177, 0.34329452398451965)),
    ((12, 12), (1.7608775570472672, 0.4001981836725083, 2.449489742783178, 0.28867513459481287)),
    ((100, 100), (3.4157416777715164, 0.206309512392564, 4.161791450287817, 0.16990442448471224)),
    ((12, 6), (1.686222125536953, 0.41791647098427115, 2.0597671439071177, 0.34329452398451965)),
]


@pytest.mark.parametrize("layers, want", DEEPNET_TABLE)
def test_deepnorm_constants_table(layers, want):
    got = deepnorm_constants(*layers)
    assert isinstance(got, DeepNormConstants)
    for g, w in zip(got, want):
        assert (g is None) if w is None else g == pytest.approx(w, rel=1e-12)


@pytest.mark.parametrize("layers", [(0, 0), (-1, 6), (6.0, 6)])
@pytest.mark.no_typecheck
def test_deepnorm_bad_layers_raise(layers):
    with pytest.raises(ValueError, match="deepnorm_constants"):
        deepnorm_constants(*layers)
