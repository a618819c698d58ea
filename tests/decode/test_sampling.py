"""Sampling: greedy, seeding, and the empirical distribution vs the filtered one in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.decode.sampling import SamplingParams, filter_logits, request_keys, sample

V = 6
jsample = jax.jit(sample)
LOGITS = np.log(np.array([0.35, 0.25, 0.2, 0.1, 0.07, 0.03]))[[3, 0, 5, 1, 4, 2]]  # shuffled order


def expected_probs(logits, temperature, top_k, top_p):
    """The filtered distribution in float64 numpy, written from the definition."""
    x = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-x)
    keep = np.zeros(len(x), bool)
    k = len(x) if top_k == 0 else top_k
    top = order[:k]
    p = np.exp(x[top] - x[top].max())
    p /= p.sum()
    mass = 0.0
    for idx, pi in zip(top, p):
        keep[idx] = True
        mass += pi
        if mass >= top_p:
            break
    q = np.where(keep, np.exp(x - x.max()), 0.0)
    return q / q.sum()


def draw(n, temperature, top_k, top_p, seed=0):
    logits = jnp.broadcast_to(jnp.asarray(LOGITS, jnp.float32), (n, V))
    keys = request_keys(jnp.full((n,), seed), jnp.arange(n))
    full = lambda v, dt: jnp.full((n,), v, dt)  # noqa: E731
    return np.asarray(jsample(logits, keys, full(temperature, jnp.float32), full(top_k, jnp.int32),
                                      full(top_p, jnp.float32)))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.6), (1.0, 4, 0.8)])
def test_empirical_distribution_matches_filtered_probabilities(temperature, top_k, top_p):
    n = 20000
    got = np.bincount(draw(n, temperature, top_k, top_p), minlength=V) / n
    want = expected_probs(LOGITS, temperature, top_k, top_p)
    # binomial std <= sqrt(.25/20000) = 0.0035; 0.015 is > 4 sigma, and filtered-out tokens must be 0
    np.testing.assert_allclose(got, want, atol=0.015)
    assert np.all(got[want == 0] == 0)


def test_filter_logits_keeps_exactly_the_nucleus():
    x = jax.jit(filter_logits)(jnp.asarray(LOGITS, jnp.float32)[None], jnp.ones(1), jnp.zeros(1, jnp.int32),
                      jnp.full((1,), 0.6))
    # probabilities .35 + .25 reach .6: the two most likely tokens, nothing else
    assert set(np.flatnonzero(np.isfinite(np.asarray(x[0])))) == {1, 3}


def test_greedy_seeded_and_per_row_parameters_in_one_batch():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 50)) * 3, jnp.float32)
    temps = jnp.asarray([0.0, 1.0, 1.0, 1.0])
    top_k = jnp.asarray([0, 1, 0, 5], jnp.int32)
    top_p = jnp.asarray([1.0, 1.0, 0.0, 1.0])
    keys = request_keys(jnp.arange(4), jnp.zeros(4, jnp.int32))
    out = np.asarray(jsample(logits, keys, temps, top_k, top_p))
    argmax = np.asarray(jnp.argmax(logits, -1))
    # greedy, top_k=1 and top_p=0 all reduce to argmax; row 3 stays within its top 5
    assert list(out[:3]) == list(argmax[:3])
    assert out[3] in np.argsort(-np.asarray(logits[3]))[:5]
    # same seeds and steps: same tokens; another step: a different draw for a flat distribution
    flat = jnp.zeros((64, 1000))
    ones = jnp.ones(64)
    a = jsample(flat, request_keys(jnp.full(64, 7), jnp.zeros(64, jnp.int32)), ones, jnp.zeros(64, jnp.int32), ones)
    b = jsample(flat, request_keys(jnp.full(64, 7), jnp.zeros(64, jnp.int32)), ones, jnp.zeros(64, jnp.int32), ones)
    c = jsample(flat, request_keys(jnp.full(64, 7), jnp.ones(64, jnp.int32)), ones, jnp.zeros(64, jnp.int32), ones)
    np.testing.assert_array_equal(a, b)
    assert np.mean(np.asarray(a) == np.asarray(c)) < 0.1


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-2), "top_k"), (dict(top_p=-0.1), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(seed=-1), "seed"), (dict(max_new_tokens=0), "max_new_tokens"), (dict(stop_tokens=(300,)), "stop_tokens"),
])
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs).validate(vocab_size=256)


def test_sample_shape_errors():
    with pytest.raises(ValueError, match=r"temperature.shape"):
        sample(jnp.zeros((2, 5)), request_keys(jnp.arange(2), jnp.arange(2)), jnp.zeros(3), jnp.zeros(2), jnp.ones(2))


def test_filter_logits_keeps_exactly_the_defined_set_for_every_top_k_top_p():
    """Top-k first, then top-p on the renormalised top-k distribution (the smallest prefix whose mass
    reaches p): the kept set equals the float64 definition for a grid of k, p and temperatures."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(16, 12)) * 1.5
    f = jax.jit(filter_logits)
    for temperature in (0.5, 1.0):
        for top_k in (0, 1, 2, 3, 5):
            for top_p in (0.0, 0.3, 0.5, 0.7, 0.9, 1.0):  # 0: the most likely token alone
                n = logits.shape[0]
                x = f(jnp.asarray(logits, jnp.float32), jnp.full((n,), temperature), jnp.full((n,), top_k, jnp.int32),
                      jnp.full((n,), top_p))
                for row in range(n):
                    want = expected_probs(logits[row], temperature, top_k, top_p) > 0
                    got = np.isfinite(np.asarray(x[row]))
                    np.testing.assert_array_equal(got, want, err_msg=f"T={temperature} k={top_k} p={top_p} row {row}")
