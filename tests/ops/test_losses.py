"""Cross entropy vs numpy float64 log-softmax: masks, z-loss, gradients, bad shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.ops import cross_entropy

B, T, V = 2, 5, 11


def log_softmax64(logits):
    x = np.asarray(logits, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def ce_ref(logits, targets, mask, z_loss):
    """float64: mean over unmasked tokens of -log p[target], and z_loss * mean(logZ^2)."""
    x = np.asarray(logits, np.float64)
    lp = log_softmax64(x)
    m = x.max(-1)
    log_z = m + np.log(np.exp(x - m[..., None]).sum(-1))
    nll = -np.take_along_axis(lp, np.asarray(targets)[..., None], -1)[..., 0]
    mask = np.ones(nll.shape, bool) if mask is None else np.asarray(mask)
    n = mask.sum()
    ce = (nll * mask).sum() / max(n, 1)
    z = z_loss * (log_z ** 2 * mask).sum() / max(n, 1)
    return ce + z, ce, z, n


@pytest.fixture
def batch():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((B, T, V)) * 4 + 10).astype(np.float32)  # offset: logZ far from 0
    targets = rng.integers(0, V, (B, T))
    mask = rng.random((B, T)) < 0.7
    mask[0, 0] = True
    return logits, targets, mask


@pytest.mark.parametrize("use_mask", [False, True])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_cross_entropy_matches_float64(batch, use_mask, z_loss):
    logits, targets, mask = batch
    mask = mask if use_mask else None
    loss, metrics = cross_entropy(jnp.asarray(logits), jnp.asarray(targets),
                                  mask=None if mask is None else jnp.asarray(mask), z_loss=z_loss)
    want_loss, want_ce, want_z, want_n = ce_ref(logits, targets, mask, z_loss)
    assert loss.dtype == jnp.float32 and loss.shape == ()
    # fp32 logsumexp over 11 logits of size ~20: relative ~1e-6.
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    assert float(metrics["ce"]) == pytest.approx(want_ce, rel=1e-5)
    assert float(metrics["z_loss"]) == pytest.approx(want_z, rel=1e-5, abs=1e-12)
    assert int(metrics["n_tokens"]) == want_n


def test_masked_positions_are_ignored_even_with_invalid_targets(batch):
    logits, targets, mask = batch
    base, _ = cross_entropy(jnp.asarray(logits), jnp.asarray(targets), mask=jnp.asarray(mask))
    junk = np.where(mask, targets, -100)  # ignore-index style padding
    noisy = np.where(mask[..., None], logits, 1e4).astype(np.float32)
    loss, _ = cross_entropy(jnp.asarray(noisy), jnp.asarray(junk), mask=jnp.asarray(mask))
    assert float(loss) == pytest.approx(float(base), rel=1e-6)
    grad = jax.grad(lambda x: cross_entropy(x, jnp.asarray(junk), mask=jnp.asarray(mask))[0])(jnp.asarray(noisy))
    assert np.all(np.isfinite(np.asarray(grad)))
    np.testing.assert_array_equal(np.asarray(grad)[~mask], 0.0)


def test_negative_targets_never_count_without_a_mask(batch):
    """Labels ported from Hugging Face / PyTorch mark ignored positions -100 and pass no mask: those positions are
    left out (the float64 reference with them masked), never read as index V - 100 and counted."""
    logits, targets, mask = batch
    labels = np.where(mask, targets, -100)
    loss, metrics = cross_entropy(jnp.asarray(logits), jnp.asarray(labels), z_loss=1e-2)
    want_loss, _, _, want_n = ce_ref(logits, targets, mask, 1e-2)
    assert float(loss) == pytest.approx(want_loss, rel=1e-5) and int(metrics["n_tokens"]) == want_n < B * T
    grad = jax.grad(lambda x: cross_entropy(x, jnp.asarray(labels))[0])(jnp.asarray(logits))
    np.testing.assert_array_equal(np.asarray(grad)[~mask], 0.0)


def test_gradient_matches_softmax_minus_onehot(batch):
    logits, targets, mask = batch
    z = 1e-2
    grad = jax.jit(jax.grad(lambda x: cross_entropy(x, jnp.asarray(targets), mask=jnp.asarray(mask), z_loss=z)[0]))(
        jnp.asarray(logits))
    p = np.exp(log_softmax64(logits))
    log_z = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
    onehot = np.eye(V)[targets]
    # d/dx [CE + z logZ^2] = softmax - onehot + 2 z logZ softmax, averaged over unmasked tokens.
    want = (p - onehot + 2 * z * log_z[..., None] * p) * mask[..., None] / mask.sum()
    np.testing.assert_allclose(np.asarray(grad), want, atol=1e-6, rtol=1e-4)  # fp32


def test_all_masked_gives_zero_not_nan(batch):
    logits, targets, _ = batch
    mask = jnp.zeros((B, T), bool)

    def f(x):
        return cross_entropy(x, jnp.asarray(targets), mask=mask, z_loss=1e-4)

    loss, metrics = f(jnp.asarray(logits))
    assert float(loss) == 0.0 and float(metrics["ce"]) == 0.0 and float(metrics["z_loss"]) == 0.0
    assert int(metrics["n_tokens"]) == 0
    grad = jax.grad(lambda x: f(x)[0])(jnp.asarray(logits))
    np.testing.assert_array_equal(np.asarray(grad), 0.0)


def test_bf16_logits_are_upcast(batch):
    logits, targets, _ = batch
    lb = jnp.asarray(logits, jnp.bfloat16)
    loss, _ = cross_entropy(lb, jnp.asarray(targets))
    assert loss.dtype == jnp.float32
    want, *_ = ce_ref(np.asarray(lb.astype(jnp.float32)), targets, None, 0.0)
    # Same bf16 values, fp32 arithmetic: fp32-level agreement (a bf16 logsumexp would be ~1e-2 off).
    assert float(loss) == pytest.approx(want, rel=1e-5)


@pytest.mark.no_typecheck
def test_bad_shapes_raise():
    logits = jnp.zeros((B, T, V))
    with pytest.raises(ValueError, match=r"logits.shape=\(2, 5, 11\).*targets.shape=\(2, 4\)"):
        cross_entropy(logits, jnp.zeros((B, T - 1), jnp.int32))
    with pytest.raises(ValueError, match=r"logits.shape=\(2, 5, 11\).*mask.shape=\(5,\)"):
        cross_entropy(logits, jnp.zeros((B, T), jnp.int32), mask=jnp.ones(T, bool))
    with pytest.raises(ValueError, match="targets.dtype"):
        cross_entropy(logits, jnp.zeros((B, T), jnp.float32))
    with pytest.raises(ValueError, match=r"mask must be bool \(or 0/1 integers\), not per-token weights"):
        cross_entropy(logits, jnp.zeros((B, T), jnp.int32), mask=jnp.full((B, T), 0.5))
    ones = jnp.ones((B, T), jnp.int32)  # 0/1 integers are a mask
    assert int(cross_entropy(logits, jnp.zeros((B, T), jnp.int32), mask=ones)[1]["n_tokens"]) == B * T
