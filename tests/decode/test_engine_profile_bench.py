"""experiments/bench/engine_profile.py on a tiny model: each scenario runs the steps it names, and its op table
names the ops by the output shapes of the compiled step (the lookup the issue notes' figures rely on)."""

import jax
import pytest

from jaxformer.model import init, presets
from tests.bench_scripts import load_bench


@pytest.fixture(scope="module")
def tiny():
    cfg = presets.get("llama_tiny", max_seq_len=520)
    return (cfg, *init(cfg, jax.random.key(0)))


# prefill and decode-1 slow (6 s): one sequence's prefill and decode steps, profiled by the same code as the
# default-run batched-prefill's and decode's
@pytest.mark.parametrize("scenario, shapes, steps", [
    # 512 tokens in two chunks of 256: the table 256, then 512 wide
    pytest.param("prefill", {(1, 256, 16), (1, 256, 32)}, 2, marks=pytest.mark.slow),
    ("batched-prefill", {(16, 16, 16)}, 4),         # 16 rows x 16 tokens, a table of 256 positions
    ("decode", {(16, 1, 4)}, 8),                    # 16 rows of ~20 tokens: the batched decode floor, 64 positions
    pytest.param("decode-1", {(1, 1, 16)}, 8, marks=pytest.mark.slow),  # one sequence: the batch-1 figure
])
def test_scenarios_profile_their_steps(tiny, scenario, shapes, steps):
    bench = load_bench("engine_profile")
    walls, groups, calls = bench.profile(scenario, *tiny, chunk=256)
    assert set(calls) == shapes and len(walls) == steps
    total = sum(groups.values())
    named = sum(ns for k, ns in groups.items() if not k.endswith("?"))
    assert total > 0 and named > 0.9 * total, groups.most_common(5)
