"""An engine step's work follows the tokens in its cache, not the engine's capacity (counted, not timed):
the block-table width it sends (what the paged attention and the prefill's page gather read) and the batch
rows it runs; outputs stay those of each request generated alone; the head at one position per row equals
that position of the full head."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxformer.decode import engine as eng
from jaxformer.decode.generate import generate
from jaxformer.decode.sampling import SamplingParams
from jaxformer.model import apply, init, presets

L = 4  # tokens per page


@pytest.fixture(scope="module")
def long_llama():
    """llama_tiny with a 2,048-token context: a 512-page table per slot at L=4."""
    cfg = presets.get("llama_tiny", init_std=0.3, max_seq_len=2048)
    return (cfg, *init(cfg, jax.random.key(1)))


def width_rows_need(inputs):
    """``(table width, batch rows, pages the longest row reads)`` of a call: the last from its own
    ``lengths + num_new`` (the keys its attention sees), so ``width >= need`` is what correctness needs and
    ``width < 2 * need`` is no wasted bucket."""
    need = -(-int(np.max(np.asarray(inputs.lengths) + np.asarray(inputs.num_new))) // L)
    return inputs.tables.shape[1], inputs.tokens.shape[0], need


def run_steps(e, record=width_rows_need):
    """Step ``e`` to the end; ``record(inputs)`` of every model call (default :func:`width_rows_need`)."""
    out, step = [], eng.engine_step

    def spy(graphdef, state, pools, inputs, options):
        out.append(record(inputs))
        return step(graphdef, state, pools, inputs, options)

    eng.engine_step = spy
    try:
        e.run()
    finally:
        eng.engine_step = step
    return out


def test_table_width_follows_the_longest_sequence_not_the_capacity(long_llama):
    cfg, graphdef, state = long_llama
    rng = np.random.default_rng(0)
    short, long = [list(map(int, rng.integers(0, 256, n))) for n in (10, 700)]
    e = eng.Engine(graphdef, state, cfg, num_pages=400, page_size=L, max_batch=4, chunk_size=64)
    capacity = e.max_pages_per_seq
    assert capacity == 512
    floor = eng.MIN_TABLE_TOKENS // L  # 64 pages: the narrowest table a step sends
    a = e.submit(short, SamplingParams(max_new_tokens=4))
    steps_short = run_steps(e)
    b = e.submit(long, SamplingParams(max_new_tokens=4))
    steps_long = run_steps(e)
    # the short sequence (<= 14 tokens, 4 pages) never reads more than the floor: 1/8 of the capacity
    assert {w for w, _, _ in steps_short} == {floor} and {r for _, r, _ in steps_short} == {1}
    # the long one's table grows with its chunks (16 pages more per 64-token chunk) in powers of two,
    # and its decode steps (176 pages) read 256 of the 512
    for width, rows, need in steps_long:
        assert need <= width < max(2 * need, floor + 1) and rows == 1, (width, need)
    assert [w for w, _, _ in steps_long] == [64] * 4 + [128] * 4 + [256] * 6
    assert e.stats["max_table_width"] == 256 < capacity
    res = e.results
    # greedy: the first 4 of 100 tokens (the shape test_a_batched_decode_call_sends_a_narrower_table generates)
    assert res[a].tokens == generate(graphdef, state, cfg, [short], max_new_tokens=100)[0][:4]
    assert res[b].tokens == generate(graphdef, state, cfg, [long], max_new_tokens=4)[0]


def test_batch_rows_follow_the_running_sequences(llama):
    cfg, graphdef, state = llama
    e = eng.Engine(graphdef, state, cfg, num_pages=40, page_size=L, max_batch=8, chunk_size=8)
    for n, new in ((3, 2), (5, 4), (7, 6)):
        e.submit(list(range(1, n + 1)), SamplingParams(max_new_tokens=new))
    rows = [r for _, r, _ in run_steps(e)]
    assert rows == [4, 4, 2, 2, 1, 1]  # 3 sequences run in 4 rows of 8, then 2, then 1


def test_a_joining_prefill_does_not_widen_the_decoding_rows(llama):
    """A request that joins while others decode: its chunk runs in a call of its own, the decoding rows at
    width 1 (one [B, T] call would compute every decoding row at the chunk's width); outputs as alone."""
    cfg, graphdef, state = llama
    # the pool of the test above (40 pages, more than these requests ever hold): its steps' programs serve here too
    e = eng.Engine(graphdef, state, cfg, num_pages=40, page_size=L, max_batch=4, chunk_size=16)
    rng = np.random.default_rng(3)
    prompts = [list(map(int, rng.integers(0, 256, n))) for n in (4, 6, 5, 40)]
    ids = [e.submit(p, SamplingParams(max_new_tokens=6)) for p in prompts[:3]]
    e.step()  # the three prompts' prefill
    calls, step = [], eng.engine_step

    def spy(graphdef, state, pools, inputs, options):
        n = np.asarray(inputs.num_new)
        calls.append((inputs.tokens.shape[1], sorted(n[n > 0].tolist())))
        return step(graphdef, state, pools, inputs, options)

    ids.append(e.submit(prompts[3], SamplingParams(max_new_tokens=6)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eng, "engine_step", spy)
        e.step()  # three decoding, one joining with the first 16 of its 40 tokens
        e.run()
    assert calls[:2] == [(1, [1, 1, 1]), (16, [16])], calls[:2]
    for width, rows in calls:
        assert all(n == 1 for n in rows) if width == 1 else all(n > 1 for n in rows), (width, rows)
    # greedy: the first 6 of 8 tokens (8 new tokens, as the bucketed test's references)
    for rid, p in zip(ids, prompts):
        assert e.results[rid].tokens == generate(graphdef, state, cfg, [p], max_new_tokens=8)[0][:6], p


def test_a_batched_decode_call_sends_a_narrower_table(long_llama):
    """A decode call of ``BATCHED_DECODE_ROWS`` rows or more sends tables down to ``MIN_BATCHED_TABLE_TOKENS``
    (its attention reads every row's table); prefill calls and smaller decode calls keep ``MIN_TABLE_TOKENS``.
    Every shape sent is one of ``step_shapes`` (what ``compile_all`` compiles); outputs equal each request
    generated alone."""
    cfg, graphdef, state = long_llama
    rng = np.random.default_rng(2)
    prompts = [list(map(int, rng.integers(0, 256, n))) for n in (10, 7, 12, 9, 11, 8, 10, 6, 5, 9)]
    e = eng.Engine(graphdef, state, cfg, num_pages=300, page_size=L, max_batch=16, chunk_size=16)
    ids = [e.submit(p, SamplingParams(max_new_tokens=k)) for p, k in zip(prompts, (100, 3) + (60,) * 8)]
    calls = run_steps(e, lambda inputs: inputs.tokens.shape + inputs.tables.shape[1:])  # (B, T, M)
    narrow, wide = eng.MIN_BATCHED_TABLE_TOKENS // L, eng.MIN_TABLE_TOKENS // L  # 16 and 64 pages
    batched = {M for B, T, M in calls if T == 1 and B >= eng.BATCHED_DECODE_ROWS}
    assert batched == {narrow, 2 * narrow}  # 9-10 rows (16 batch rows) of up to 72 tokens: 16 pages, then 32
    assert {M for B, T, M in calls if T > 1 or B < eng.BATCHED_DECODE_ROWS} == {wide}
    assert any(T == 1 and B < eng.BATCHED_DECODE_ROWS for B, T, M in calls)  # the longest, alone at the end
    assert set(calls) <= set(e.step_shapes())
    # greedy: a request's first k tokens do not depend on how many follow, so one generate shape (100 new tokens)
    # serves k = 3, 60 and 100 (about 2 s less than compiling a prefill and a decode step for each k)
    for rid, p in zip(ids, prompts):
        k = len(e.results[rid].tokens)
        assert e.results[rid].tokens == generate(graphdef, state, cfg, [p], max_new_tokens=100)[0][:k], p


# 2 draws: hypothesis's simplest (one 1-token request: width 1), then 4 requests of 1-27 tokens in 2 rows (widths 2,
# 4 and 8, a decoding row beside a prefill chunk, a longest row ending mid-page); each draw compiles new step shapes.
# The slow test below draws the profile's number (12; nightly 200), the 10-page capacity and a 24-page pool among
# them (every step of tests/decode/test_engine.py runs at the capacity: its floor is above it)
@settings(deadline=None, max_examples=2)
@given(data=st.data())
def test_bucketed_steps_equal_each_request_alone(llama, data):
    """Random requests through an engine whose narrowest table is one page, so steps switch table widths
    (1, 2, 4, 8; the 10-page capacity in the slow test's draws) and batch rows (1, 2) as sequences grow, wait and
    finish: every output equals the request generated alone with the contiguous cache. (Counted: none of the drawn
    workloads preempts; preempted requests' outputs are checked in tests/decode/test_engine.py.)"""
    _check_bucketed_steps(llama, data)


@pytest.mark.slow  # 19 s: 12 draws; the test above draws 2 (4 drew 6 s more: a 24-page pool, a 2-row workload)
@settings(deadline=None)
@given(data=st.data())
def test_bucketed_steps_equal_each_request_alone_many(llama, data):
    _check_bucketed_steps(llama, data)


def _check_bucketed_steps(llama, data):
    cfg, graphdef, state = llama
    n = data.draw(st.integers(1, 4), label="requests")
    lens = data.draw(st.lists(st.integers(1, 30), min_size=n, max_size=n), label="prompt lengths")
    new = data.draw(st.lists(st.integers(1, 8), min_size=n, max_size=n), label="new tokens")
    num_pages = data.draw(st.sampled_from([10, 24]), label="pages")
    rng = np.random.default_rng(sum(lens))
    prompts = [list(map(int, rng.integers(0, 256, k))) for k in lens]
    e = eng.Engine(graphdef, state, cfg, num_pages=num_pages, page_size=L, max_batch=2, chunk_size=8)
    ids = [e.submit(p, SamplingParams(max_new_tokens=k)) for p, k in zip(prompts, new)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eng, "MIN_TABLE_TOKENS", L)
        steps = run_steps(e)
    for width, _, need in steps:
        assert need <= width <= max(1, 2 * need - 1) or width == e.max_pages_per_seq, (width, need)
    res = e.results
    for rid, p, k in zip(ids, prompts, new):
        assert res[rid].tokens == generate(graphdef, state, cfg, [p], max_new_tokens=8)[0][:k], (p, k)


# One pinned batch by default: 3 rows of 12 tokens whose heads run at the first, the last and a middle position
# (each batch shape is a new compile; the slow test below draws 4 per model: 1-3 rows of 1, 5 or 12 tokens).
# gpt2_tiny and vaswani_tiny (6 s): their heads at one position are the shared _Decodes._decode that llama_tiny's runs
@pytest.mark.parametrize("name", ["llama_tiny", pytest.param("gpt2_tiny", marks=pytest.mark.slow),
                                  pytest.param("vaswani_tiny", marks=pytest.mark.slow)])
def test_head_at_one_position_equals_that_position_of_the_full_head(name):
    """``logits_at [B]``: logits ``[B, 1, V]`` equal to the full logits at those positions (decoders and the
    encoder-decoder's target; a soft cap and a head bias included)."""
    _check_head_at(name, 3, 12, [0, 11, 6])


@pytest.mark.slow  # 6-10 s a model: 4 draws; the test above runs one pinned batch
@settings(deadline=None, max_examples=4)  # each draw a new shape (a compile)
@given(data=st.data())
@pytest.mark.parametrize("name", ["llama_tiny", "gpt2_tiny", "vaswani_tiny"])
def test_head_at_one_position_equals_that_position_of_the_full_head_drawn(name, data):
    B = data.draw(st.integers(1, 3), label="B")
    T = data.draw(st.sampled_from([1, 5, 12]), label="T")
    _check_head_at(name, B, T, data.draw(st.lists(st.integers(0, T - 1), min_size=B, max_size=B), label="at"))


def _check_head_at(name, B, T, at):
    cfg = presets.get(name, logits_softcap=30.0, head_bias=True)
    graphdef, state = init(cfg, jax.random.key(0))
    at = jnp.asarray(at, jnp.int32)
    tokens = jnp.asarray(np.random.default_rng(T).integers(0, 256, (B, T)), jnp.int32)
    if cfg.kind == "encoder_decoder":   # the target's head, as a translation step runs it
        model = nnx.merge(graphdef, state)
        memory = model.encode(tokens)
        full, one = model.decode(tokens, memory), model.decode(tokens, memory, logits_at=at)
    else:
        full, one = apply(graphdef, state, tokens), apply(graphdef, state, tokens, logits_at=at)
    assert one.shape == (B, 1, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(one[:, 0]), np.asarray(full)[np.arange(B), np.asarray(at)],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.no_typecheck
def test_logits_at_must_be_one_index_per_row(llama):
    cfg, graphdef, state = llama
    with pytest.raises(ValueError, match=r"logits_at.shape=\(3,\) must be \[B\]=\(2,\)"):
        apply(graphdef, state, jnp.zeros((2, 4), jnp.int32), logits_at=jnp.zeros(3, jnp.int32))


def test_table_width_buckets():
    assert [eng.table_width(p, 512, 16) for p in (1, 16, 17, 33, 200, 257, 512)] == [16, 16, 32, 64, 256, 512, 512]
    assert [eng.table_width(p, 10, 4) for p in (1, 9, 10)] == [10, 10, 10]  # the floor above the capacity
    assert [eng.table_width(p, 512, 16, 64) for p in (1, 4, 5, 9)] == [4, 4, 8, 16]
    calls = ((1, 1), (8, 1), (15, 1), (16, 1), (32, 1), (16, 16))  # (rows, width): decode calls of 16+ rows go narrow
    assert [eng.min_table_tokens(B, T) for B, T in calls] == [256, 256, 256, 64, 64, 256]
    assert [eng.bucket(n, 1, 6) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]


def test_engines_over_one_model_share_compiled_steps(llama, monkeypatch):
    """A second engine over the same model traces no step anew and holds the same ``StaticModel`` object (one
    per distinct model, hashed once: that the step then hashes nothing per call is a speed claim, measured by
    the decode bench's per-step profile, not asserted here)."""
    cfg, graphdef, state = llama
    prompt = list(range(1, 6))
    eng.serve(graphdef, state, cfg, [(prompt, SamplingParams(max_new_tokens=3))], num_pages=10, page_size=L,
              max_batch=4, chunk_size=8)
    before = dict(eng.TRACE_COUNTS)
    e = eng.Engine(graphdef, state, cfg, num_pages=10, page_size=L, max_batch=4, chunk_size=8)
    e.submit(prompt, SamplingParams(max_new_tokens=3))
    e.run()
    assert dict(eng.TRACE_COUNTS) == before
    geometry = dict(num_pages=10, page_size=L, max_batch=4, chunk_size=8)
    off = eng.Engine(graphdef, state, cfg, **geometry, feature_major=False)
    own = eng.StaticModel.of(graphdef, jax.tree.structure(state))
    # the tiny model's modules (FFNs, attention, head) are below the CPU default's size: no copies, no mark, the
    # step model is the model's own
    assert all(x._step_model(rows)[0] is own for x in (e, off) for rows in (1, 4, 64))
    if jax.default_backend() != "cpu":  # the copies are a CPU default
        return
    monkeypatch.setattr(eng, "FEATURE_MAJOR_MIN_WEIGHTS", 0)  # as for a model of SmolLM2's size
    on = eng.Engine(graphdef, state, cfg, **geometry)
    assert on._feature_major is None  # the copies wait for the first call of 2-32 rows
    assert on._step_model(1)[0] is on._step_model(64)[0] is own and on._feature_major is None
    fm = on._step_model(4)[0]
    assert fm is eng.Engine(graphdef, state, cfg, **geometry, feature_major=True)._step_model(32)[0]
    assert fm is not own and on._step_model(2)[0] is fm and on._step_model(33)[0] is own
