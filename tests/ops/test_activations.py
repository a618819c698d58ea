"""Activations vs float64 formulas (math.erf / math.tanh); FFN widths."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.ops import (
    ACTIVATIONS,
    activation_fn,
    ffn_hidden_size,
    geglu,
    gelu,
    is_gated,
    relu,
    silu,
    swiglu,
    swish,
)

X = np.concatenate([np.linspace(-12, 12, 97), np.random.default_rng(0).standard_normal(31) * 3])


def gelu_exact64(v):
    return 0.5 * v * (1 + math.erf(v / math.sqrt(2)))


def gelu_tanh64(v):
    return 0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))


def silu64(v):
    return v / (1 + math.exp(-v))


def ref(fn, xs):
    return np.array([fn(float(v)) for v in xs])


def check(out, want):
    # fp32 elementwise functions: a few ulps relative, tiny absolute near 0.
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2e-6, atol=1e-7)


def test_plain_activations_vs_float64():
    x = jnp.asarray(X, jnp.float32)
    xs = np.asarray(x, np.float64)
    check(relu(x), np.maximum(xs, 0))
    check(gelu(x), ref(gelu_exact64, xs))
    check(gelu(x, approximate=True), ref(gelu_tanh64, xs))
    check(silu(x), ref(silu64, xs))
    assert swish is silu
    for fn in (relu, gelu, silu, activation_fn("gelu_tanh")):
        assert fn(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    # exact and tanh gelu really differ (max gap ~5e-4 near |x| ~ 2).
    assert np.abs(np.asarray(gelu(x)) - np.asarray(gelu(x, approximate=True))).max() > 1e-4


def test_gelu_gradient_vs_formula():
    x = jnp.asarray(X, jnp.float32)
    g = jax.vmap(jax.grad(gelu))(x)
    want = ref(lambda v: 0.5 * (1 + math.erf(v / math.sqrt(2))) + v * math.exp(-v * v / 2) / math.sqrt(2 * math.pi),
               np.asarray(x, np.float64))
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-6)  # fp32


@pytest.mark.no_typecheck
def test_gated_activations_vs_float64():
    rng = np.random.default_rng(1)
    gate = jnp.asarray(rng.standard_normal((3, 5)) * 3, jnp.float32)
    up = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
    g, u = np.asarray(gate, np.float64).ravel(), np.asarray(up, np.float64).ravel()
    check(swiglu(gate, up).ravel(), ref(silu64, g) * u)
    check(geglu(gate, up).ravel(), ref(gelu_exact64, g) * u)
    with pytest.raises(ValueError, match=r"\(3, 5\).*\(3, 4\)"):
        swiglu(gate, up[:, :4])
    with pytest.raises(ValueError, match=r"\(3, 5\).*\(5,\)"):
        geglu(gate, up[0])


def test_activation_registry():
    x = jnp.asarray(X, jnp.float32)
    xs = np.asarray(x, np.float64)
    want = {
        "identity": xs,
        "relu": np.maximum(xs, 0),
        "gelu": ref(gelu_exact64, xs),
        "gelu_tanh": ref(gelu_tanh64, xs),
        "silu": ref(silu64, xs),
        "swiglu": ref(silu64, xs),  # the gate's activation
        "geglu": ref(gelu_exact64, xs),
    }
    assert set(want) == set(ACTIVATIONS)
    for name in ACTIVATIONS:
        check(activation_fn(name)(x), want[name])
        assert is_gated(name) == (name in ("swiglu", "geglu"))
    for bad in (activation_fn, is_gated):
        with pytest.raises(ValueError, match=r"'tanh'.*relu.*geglu"):
            bad("tanh")


def test_ffn_hidden_size():
    assert ffn_hidden_size(4096, "swiglu", 256) == 11008  # LLaMA-7B
    assert ffn_hidden_size(4096, "swiglu") == 10922  # int(8 * 4096 / 3)
    assert ffn_hidden_size(512, "geglu", 64) == 1408  # 1365 -> next multiple of 64
    assert ffn_hidden_size(512, "relu") == 2048  # Vaswani base
    assert ffn_hidden_size(768, "gelu") == 3072  # GPT-2 small
    assert ffn_hidden_size(768, "gelu_tanh", 256) == 3072  # already a multiple
    assert ffn_hidden_size(100, "silu", 256) == 512  # 400 rounded up
    with pytest.raises(ValueError, match="'mish'"):
        ffn_hidden_size(64, "mish")
    with pytest.raises(ValueError, match="multiple_of=0"):
        ffn_hidden_size(64, "relu", 0)
    with pytest.raises(ValueError, match="d_model=-4"):
        ffn_hidden_size(-4, "relu")
