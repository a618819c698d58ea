"""``experiments/bench/train_profile.py``: its op classifier reads the FLOPs of a compiled program's dots right
(against 2 M K N), and the script runs end to end at a toy size (slow: a subprocess, since XLA's profile flag
must be set before JAX starts)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import numpy as np
import jax.numpy as jnp
import pytest

from tests.bench_scripts import BENCH, load_bench


def test_classify_xla_counts_dot_flops_and_sorts_ops():
    bench = load_bench("train_profile")
    M, K, N = 64, 32, 48
    f = jax.jit(lambda x, w: jnp.exp(x @ w).T.copy())
    hlo = f.lower(jnp.ones((M, K)), jnp.ones((K, N))).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]  # the ops the profiler reports: the entry computation's, not fused ones
    names = re.findall(r"^\s*(?:ROOT )?%([\w.\-]+) = \S+ (?:fusion|dot|custom-call)\(", entry, re.M)
    index = bench.HloIndex(hlo)
    out = bench.classify_xla({n: 1_000_000 for n in names}, index)
    matmul = {k: v for k, v in out.items() if k.startswith("matmul")}
    assert sum(fl for _, fl in matmul.values()) == 2 * M * K * N, (out, hlo)
    assert sum(ns for ns, _ in out.values()) == 1_000_000 * len(names)
    assert f"f32[{N},{M}]" in {index.output(n) for n in names}  # the transposed copy's output


def test_bound_costs_the_products_at_the_peak():
    """78 GFLOP of products at a 78 GFLOP/s peak take 1,000 ms; with 400 ms of other ops against torch's 1,500 ms the
    library could reach at most 1.5x (products alone) and 1,500 / 1,400 with the rest; 1.3x leaves the other ops
    1,500 / 1.3 - 1,000 = 153.8 ms, and 1.6x is out of reach even with no other op (937.5 - 1,000 ms)."""
    bench = load_bench("train_profile")
    lib = {"matmul, YNNPACK fusions": (600e6, 46.8e9), "matmul, Eigen dots": (500e6, 31.2e9),
           "transposes and copies": (250e6, 0), "other elementwise and reductions": (150e6, 0)}
    b = bench.bound(lib, 1500e6, 78e9, 1.3)
    assert b == pytest.approx({"products_at_peak_ms": 1000.0, "other_ms": 400.0, "best": 1.5,
                               "best_with_other": 1500 / 1400, "other_budget_ms": 1500 / 1.3 - 1000})
    assert bench.bound(lib, 1500e6, 78e9, 1.6)["other_budget_ms"] == pytest.approx(-62.5)


def test_best_rate_is_the_fastest_product():
    bench = load_bench("train_profile")
    assert bench.best_rate({"xla a": 3e9, "torch a": 5e9, "xla b": 4e9}) == ("torch a", 5e9)


def test_product_forms_compute_what_they_name():
    """Each form's XLA function, on operands of the shapes :func:`product_rates` makes (``[m, k]`` and the form's
    second shape), against numpy's float64 product (rtol 1e-5, fp32 sums of 4 terms); ``product_rates`` times every
    form at distinct ``m, k, n`` and names each by its shape; the model's products name each projection's three
    forms with the widths of a GPT-2 block."""
    bench = load_bench("train_profile")
    for form, a, b, want in _form_cases(bench):
        got = np.asarray(bench.FORMS[form][2](jnp, jnp.asarray(a), jnp.asarray(b)))
        assert got.shape == want.shape, form
        np.testing.assert_allclose(got, want, rtol=1e-5)
    m, k, n = 6, 4, 5
    rates = bench.product_rates([(form, m, k, n) for form in bench.FORMS], calls=1, with_torch=False)
    assert set(rates) == {"xla [6,4] x [4,5]", "xla [6,4] x [5,4]^T", "xla [6,4]^T x [6,5]"}
    assert all(r > 0 for r in rates.values())
    products = dict(bench.model_products(8, 4))
    assert products["mlp down weight gradient"] == ("x^T @ dy", 4, 32, 8)
    assert products["qkv input gradient"] == ("dy @ w^T", 4, 24, 8)
    assert products["attention out forward"] == ("x @ w", 4, 8, 8) and len(products) == 12


def test_product_forms_torch_side():
    """Where torch is importable (a bench venv; never a dependency): its form of each product against numpy's."""
    torch = pytest.importorskip("torch")
    bench = load_bench("train_profile")
    for form, a, b, want in _form_cases(bench):
        got = bench.FORMS[form][3](torch.from_numpy(a), torch.from_numpy(b)).numpy()
        assert got.shape == want.shape, form
        np.testing.assert_allclose(got, want, rtol=1e-5)


def _form_cases(bench, m: int = 6, k: int = 4, n: int = 5):
    """``(form, a [m, k], b (the form's second shape, from FORMS), numpy's float64 product)`` for each form."""
    rng = np.random.default_rng(0)
    refs = {"x @ w": lambda a, b: a @ b, "dy @ w^T": lambda a, b: a @ b.T, "x^T @ dy": lambda a, b: a.T @ b}
    a = rng.random((m, k), np.float32)
    for form, ref in refs.items():
        b = rng.random(bench.FORMS[form][1](m, k, n), np.float32)
        yield form, a, b, ref(a.astype(np.float64), b.astype(np.float64))


def test_hlo_index_names_an_ops_output_and_a_tuples_first():
    bench = load_bench("train_profile")
    hlo = ("HloModule m\n\nENTRY %main (p: f32[4,8]) -> (f32[4,8], f32[8]) {\n"
           "  %p = f32[4,8]{1,0} parameter(0)\n  %neg.1 = f32[4,8]{1,0} negate(%p)\n"
           "  ROOT %fusion.2 = (f32[4,8]{1,0}, f32[8]{0}) fusion(%neg.1), kind=kLoop, calls=%f\n}\n")
    index = bench.HloIndex(hlo)
    assert (index.output("neg.1"), index.output("fusion.2"), index.output("missing")) == (
        "f32[4,8]", "(f32[4,8], ...)", "?")


def test_the_command_line_builds_the_throughput_benchs_experiment():
    """The profile's arguments carry every field ``train_throughput.experiment`` reads (a field added there and not
    here broke the script for a stop, unseen: its end-to-end test is slow-marked)."""
    bench = load_bench("train_profile")
    cfg = bench.tt.experiment(bench.parse_args(["--d-model", "64", "--layers", "1", "--parts", "2"]))
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.optimizer.parallel_parts) == (64, 1, 2)
    assert bench.tt.experiment(bench.parse_args([])).optimizer.parallel_parts == "auto"


def test_ops_running_shares_of_the_span():
    """Ops a (0-10 ns), b (5-15), c (20-30): of the 30 ns span, 5 with none running, 20 with one, 5 with two."""
    timing = load_bench("timing")
    shares = timing.ops_running([(20, 30, "c"), (0, 10, "a"), (5, 15, "b")])
    assert shares == pytest.approx({0: 5 / 30, 1: 20 / 30, 2: 5 / 30})
    three = timing.ops_running([(0, 4, "a"), (1, 3, "b"), (2, 3, "c")])  # three at once counts as two or more
    assert three == pytest.approx({0: 0.0, 1: 2 / 4, 2: 2 / 4})
    assert timing.ops_running([]) == {}


def test_ops_alone_takes_the_one_op_share_apart():
    """a (0-10), b (5-15), c (20-30), a again (32-34): a alone 0-5 and 32-34, b 10-15, c 20-30; overlaps count for none."""
    timing = load_bench("timing")
    events = [(20, 30, "c"), (0, 10, "a"), (5, 15, "b"), (32, 34, "a")]
    assert timing.ops_alone(events) == {"a": 7, "b": 5, "c": 10}
    assert sum(timing.ops_alone(events).values()) == pytest.approx(timing.ops_running(events)[1] * 34)
    assert timing.ops_alone([(0, 4, "a"), (1, 3, "b"), (2, 3, "c")]) == {"a": 2}
    # an op that takes no time, or ends as the next starts, changes nothing
    assert timing.ops_alone([(0, 0, "z"), (5, 10, "a"), (10, 12, "b")]) == {"a": 5, "b": 2}
    assert timing.ops_running([(0, 0, "z"), (5, 10, "a"), (10, 12, "b")]) == pytest.approx({0: 5 / 12, 1: 7 / 12,
                                                                                          2: 0.0})


def test_op_ns_per_step_sums_each_name_over_threads_and_steps():
    timing = load_bench("timing")
    ns = timing.op_ns_per_step([(0, 10, "dot"), (5, 9, "add"), (20, 40, "dot"), (12, 13, "add")], steps=2)
    assert ns == {"dot": 15.0, "add": 2.5}


@pytest.mark.slow  # ~20 s: the script end to end in a subprocess at a toy size
def test_train_profile_runs_end_to_end():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(BENCH / "train_profile.py"), "--d-model", "64", "--layers", "1",
                          "--heads", "2", "--seq-len", "64", "--batch", "2", "--steps", "1", "--no-torch", "--parts", "1"],
                         capture_output=True, text=True, env=env, timeout=300, check=True).stdout
    assert "matmul, YNNPACK fusions" in out or "matmul, Eigen dots" in out, out
    total = float(re.search(r"^total\s+([\d.]+)", out, re.M)[1])
    assert total > 0, out
    shares = re.search(r"^library: 1 part\(s\) a micro-batch; traced span [\d.]+ ms a step, with XLA ops running at "
                       r"once: none ([\d.]+)%, one ([\d.]+)%, two or more ([\d.]+)%", out, re.M)
    assert shares and abs(sum(float(x) for x in shares.groups()) - 100) < 0.2, out
    alone = re.findall(r"^  +([\d.]+)  \S+ +\(?\w+\[[\d,]*\](?:, \.\.\.\))? +(matmul|transposes|elementwise|other)",
                       out, re.M)
    assert alone and float(alone[0][0]) > 0, out  # the ops run alone are named, with their class
    # the time with one op running, by class, adds up to the "one" share of the span (print rounding: 0.05 ms a class)
    span = float(re.search(r"traced span ([\d.]+) ms a step", out)[1])
    by_class = re.search(r"^time with one XLA op running, by the op's class, ms a step: (.*)$", out, re.M)[1]
    total = sum(float(x) for x in re.findall(r" ([\d.]+)(?:,|$)", by_class))
    assert total == pytest.approx(float(shares[2]) / 100 * span, abs=0.05 * 5 + 0.001 * span), out
