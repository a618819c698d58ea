"""``experiments/bench/decode.py``'s step-profile machinery has a pulse on a tiny model (no torch needed): the
length-scaling rows record the table width each step read, the step recorder times every model call, the
id tokenizer round-trips, and the vs-transformers rounds count no contender's first call after another's."""

from __future__ import annotations

import numpy as np
import pytest

from tests.bench_scripts import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("decode")


def test_length_scaling_rows_record_the_width_each_step_read(bench, llama, monkeypatch):
    cfg, graphdef, state = llama  # a 40-token context: 3 pages of 16 per slot
    from jaxformer.decode import engine as eng

    monkeypatch.setattr(eng, "MIN_TABLE_TOKENS", 16)  # one page: below the capacity, so the width shows
    rows = bench.bench_length_scaling(graphdef, state, cfg, lengths=(4, 33), batches=(1, 2), steps=2)
    assert [(r["n"], r["B"]) for r in rows] == [(4, 1), (4, 2), (33, 1), (33, 2)]
    assert [r["M"] for r in rows] == [1, 1, 3, 3] and all(r["capacity"] == 3 for r in rows)
    assert [r["Bs"] for r in rows] == [1, 2, 1, 2]
    assert all(r["ms"] >= r["jit"] > 0 for r in rows)


def test_timed_calls_run_each_contenders_first_call_again_before_counting(bench):
    """Fakes whose first call after another contender's costs 200 ms (the cost the uncounted call keeps out of
    the counted times) and every other call 1 ms a token: each round calls every contender's first ``n`` once more
    before its counted calls, in order; the counted times are the 1 ms-a-token ones (a first call counted would
    read >= 200 ms; the bound, 100 ms, leaves ~95 ms for a busy machine's late wake-ups or a garbage collection)
    and the uncounted ones what the first call cost."""
    import time

    order, last = [], [None]

    def contender(name):
        def run(n):
            order.append((name, n))
            time.sleep(0.2 if last[0] != name else 0.001 * n)
            last[0] = name
        return run

    calls = [("a", 2), ("a", 5), ("b", 2), ("b", 5), ("p", 1)]
    times, first = bench.timed_calls({k: contender(k) for k in "abp"}, calls, 2)
    assert order == [("a", 2), ("a", 2), ("a", 5), ("b", 2), ("b", 2), ("b", 5), ("p", 1), ("p", 1)] * 2
    assert set(times) == set(calls) and set(first) == {("a", 2), ("b", 2), ("p", 1)}
    assert all(len(v) == 2 for v in (*times.values(), *first.values()))
    assert all(0.001 * n <= t < 0.1 for (_, n), ts in times.items() for t in ts), times
    assert all(t >= 0.2 for ts in first.values() for t in ts), first


def test_id_tokenizer_and_cpu_line(bench):
    tok = bench.IdTokenizer()
    assert tok.encode_prompt("5 17 302") == [5, 17, 302] and tok.decode([5, 17]) == "5 17"
    line = bench.cpu_line()
    assert line.startswith("CPU: ") and "load average" in line
    assert line.endswith(("malloc huge pages", "malloc defaults"))  # a step's time depends on it (host_memory.py)


def test_cpu_identity_names_the_family_and_model_of_the_first_processor():
    """Every AMD guest here calls itself "AMD EPYC": the family and model numbers are what tell a table's CPU apart;
    a CPU without them (aarch64) keeps its name alone; only the first processor's block is read."""
    identity = load_bench("timing").cpu_identity
    zen4 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
            "model name\t: AMD EPYC\nflags\t\t: fpu avx2 fma avx512f\n\n"
            "processor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: other\nflags\t\t: sse2\n")
    assert identity(zen4) == ("AMD EPYC (family 25, model 17)", {"fpu", "avx2", "fma", "avx512f"})
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\n"
    assert identity(arm) == ("unknown CPU", set())
    assert identity("model name\t: Intel(R) Xeon(R)\nflags\t: amx_tile\n") == ("Intel(R) Xeon(R)", {"amx_tile"})


def test_serve_bench_profile_counts_every_step_by_kind(llama):
    """The serving bench's step profile: every step of a run is counted once, prefill steps apart from decode
    steps, and the decode steps by their batch rows (two prompts of 20 tokens in chunks of 8 then 3 tokens)."""
    import collections

    from jaxformer.decode import engine as eng
    from jaxformer.decode.sampling import SamplingParams

    serve = load_bench("serve")
    cfg, graphdef, state = llama
    e = eng.Engine(graphdef, state, cfg, num_pages=16, page_size=8, max_batch=4, max_context=40, chunk_size=8)
    profile = collections.Counter()
    for i in range(2):
        e.submit(list(range(1, 21)), SamplingParams(max_new_tokens=3), request_id=i)
    results = serve.run_profiled(e, profile)
    assert [len(results[i].tokens) for i in range(2)] == [3, 3]
    # 20 tokens in chunks of 8: 3 prefill steps (the last samples token 1), then tokens 2 and 3 at B=2
    assert profile["with prefill", "steps"] == 3 and profile["decode B=2", "steps"] == 2
    assert sum(v for (k, what), v in profile.items() if what == "steps") == e.stats["steps"] == 5
    lines = serve.profile_lines({"both": profile})
    assert lines[0].index("decode B=2") < lines[0].index("with prefill") and lines[2].startswith("| both | 2, ")


def test_paired_steps_time_the_decode_steps_of_both_engines(bench, llama):
    """The paired 16-vs-1 measurement times ``new`` steps of each engine, each a decode step (one token per
    sequence, every sequence's row computed: the recorder's batch rows), and its engines generate what
    ``run_prompts`` generates for the same prompts."""
    cfg, graphdef, state = llama
    from jaxformer.decode.prompts import GenerateOptions, run_prompts

    rng = np.random.default_rng(0)
    one = [list(map(int, rng.integers(3, cfg.vocab_size, 5)))]
    many = [list(map(int, rng.integers(3, cfg.vocab_size, 5))) for _ in range(4)]
    with bench.StepRecorder() as rec:
        r = bench.paired_steps(graphdef, state, cfg, one, many, short=2, new=20, passes=1)
    assert len(r["one"]) == len(r["many"]) == 20 and all(t > 0 for t in r["one"] + r["many"])
    # after the 2 untimed steps of each engine, 20 pairs, the order swapped every step (the 4-sequence engine first
    # at even steps): every timed step one token per sequence, every sequence's row computed (27 tokens: 2 pages
    # a sequence, so the pool admits all 4 at once; with 1 page each it would keep a page of growth per sequence)
    order = [((4, 1), (1, 1)) if i % 2 == 0 else ((1, 1), (4, 1)) for i in range(2, 22)]
    assert [(s["B"], s["T"]) for s in rec.steps[4:]] == [p for pair in order for p in pair]
    tok = bench.IdTokenizer()
    # each run_prompts engine as large as the paired engine of its prompts (max_batch 8 and 4): the same pools, so
    # the same compiled steps
    for prompts, got, rows in ((one, r["tokens"][0], 8), (many, r["tokens"][1], len(many))):
        recs = run_prompts(graphdef, state, cfg, tok, [" ".join(map(str, p)) for p in prompts],
                           GenerateOptions(max_new_tokens=22, temperature=0.0, page_size=16, max_batch=rows))
        assert [x["tokens"] for x in recs] == got and all(len(t) == 22 for t in got)
