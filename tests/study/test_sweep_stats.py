"""Paired differences with t intervals (jaxformer.study.stats) against textbook values, scipy's
paired t-test and a coverage simulation in numpy."""

import math
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxformer.study.stats import paired_difference, t_quantile


@pytest.mark.parametrize("df, value", [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (29, 2.045)])
def test_t_quantile_matches_the_printed_table(df, value):
    # two-sided 95% critical values of Student's t, as printed in every statistics textbook (3 decimals)
    assert t_quantile(0.975, df) == pytest.approx(value, abs=5e-4)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-5, 5), st.floats(-5, 5)), min_size=2, max_size=8),
       st.sampled_from([0.8, 0.9, 0.95, 0.99]))
def test_interval_equals_scipy_paired_ttest(pairs, confidence):
    from scipy.stats import ttest_rel

    a = {s: x for s, (x, _) in enumerate(pairs)}
    b = {s: y for s, (_, y) in enumerate(pairs)}
    d = np.array([x - y for x, y in pairs], np.float64)
    got = paired_difference(a, b, confidence=confidence)
    assert got.n == len(pairs) and got.mean == pytest.approx(d.mean(), abs=1e-12)
    if d.std() < 1e-9:  # scipy's interval is undefined for identical differences; ours has zero width
        assert got.hi - got.lo == pytest.approx(0.0, abs=1e-6)
        return
    ci = ttest_rel(list(a.values()), list(b.values())).confidence_interval(confidence)
    assert (got.lo, got.hi) == (pytest.approx(ci.low, rel=1e-9, abs=1e-12), pytest.approx(ci.high, rel=1e-9,
                                                                                            abs=1e-12))
    # the interval holds 0 exactly when the two-sided test does not reject at 1 - confidence
    p = ttest_rel(list(a.values()), list(b.values())).pvalue
    if abs(p - (1 - confidence)) > 1e-6:
        assert got.within_noise == (p > 1 - confidence)


def test_coverage_of_the_95_percent_interval_by_simulation():
    # 3 seeds per arm, a shared per-seed effect (what pairing removes) and a true difference of 0.05:
    # the interval must hold the true difference ~95% of the time (4,000 trials: sd of the rate 0.34%)
    rng = np.random.default_rng(0)
    hits = 0
    trials = 4000
    for _ in range(trials):
        shared = rng.normal(0.0, 1.0, 3)
        base = shared + rng.normal(0.0, 0.1, 3)
        arm = shared + 0.05 + rng.normal(0.0, 0.1, 3)
        r = paired_difference(dict(enumerate(arm)), dict(enumerate(base)))
        hits += r.lo <= 0.05 <= r.hi
    assert abs(hits / trials - 0.95) < 0.015


def test_pairs_only_common_finite_seeds():
    arm = {0: 1.0, 1: 2.0, 2: float("nan"), 3: 4.0}
    base = {0: 0.5, 1: 1.0, 2: 1.0, 5: 0.0}
    r = paired_difference(arm, base)
    assert r.seeds == (0, 1) and r.n == 2 and r.mean == pytest.approx(0.75)
    assert r.sd == pytest.approx(math.sqrt(0.125))
    one = paired_difference({0: 1.0}, {0: 0.25})
    assert one.n == 1 and one.lo is None and one.within_noise is None and "no interval" in one.format()
    assert paired_difference({0: 1.0}, {1: 1.0}) is None


def test_within_noise_and_format():
    noisy = paired_difference({0: 1.0, 1: 0.0, 2: 0.5}, {0: 0.5, 1: 0.5, 2: 0.5})
    assert noisy.within_noise and noisy.format().endswith("within noise")
    clear = paired_difference({0: 1.1, 1: 1.2, 2: 1.15}, {0: 1.0, 1: 1.1, 2: 1.04})
    assert clear.within_noise is False and "within noise" not in clear.format()
    assert clear.lo > 0
    with pytest.raises(ValueError, match="confidence"):
        paired_difference({0: 1.0}, {0: 1.0}, confidence=1.0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n", [3, 4, 6])
def test_long_context_slope_interval_equals_scipy_linregress(seed, n):
    """Study 9's exponent intervals: slope ± t(n - 2) x the slope's standard error, as scipy computes them."""
    import importlib.util
    from pathlib import Path

    from scipy import stats

    path = Path(__file__).resolve().parents[2] / "experiments" / "studies" / "long_context.py"
    spec = importlib.util.spec_from_file_location("long_context_study", path)
    study = importlib.util.module_from_spec(spec)
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    try:
        spec.loader.exec_module(study)  # puts experiments/bench on sys.path and imports its `sparse`
    finally:  # neither leaks into other tests
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            del sys.modules[name]
    rng = np.random.default_rng(seed)
    T = 2048 * 2 ** np.arange(n)
    y = 1e-9 * T ** rng.uniform(1, 2.2) * np.exp(rng.normal(0, 0.2, n))
    lo, hi = study.slope_interval(list(zip(T.tolist(), y.tolist())))
    ref = stats.linregress(np.log(T), np.log(y))
    half = stats.t.ppf(0.975, n - 2) * ref.stderr
    assert (lo, hi) == pytest.approx((ref.slope - half, ref.slope + half), rel=1e-9, abs=1e-12)
    assert study.slope_interval(list(zip(T.tolist(), y.tolist()))[:2]) is None
