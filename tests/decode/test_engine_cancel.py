"""Engine.cancel and Engine.in_progress (what the HTTP server uses to stream and to drop requests):
a cancelled request frees its pages before the next step and changes nothing for the others."""

import numpy as np

from jaxformer.decode import engine as eng
from jaxformer.decode.sampling import SamplingParams

GEOMETRY = dict(num_pages=10, page_size=4, max_batch=4, chunk_size=8)  # as test_engine.py: the same programs
RNG = np.random.default_rng(1)
PROMPTS = [list(map(int, RNG.integers(0, 256, size=n))) for n in (5, 9, 3, 7, 6)]


def test_cancel_frees_pages_and_leaves_the_others_as_they_were(llama):
    cfg, graphdef, state = llama
    params = SamplingParams(max_new_tokens=8)
    alone = eng.serve(graphdef, state, cfg, [(p, params) for p in PROMPTS], **GEOMETRY)
    e = eng.Engine(graphdef, state, cfg, **GEOMETRY)
    ids = [e.submit(p, params, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
    for _ in range(3):
        e.step()
    progress = e.in_progress()
    assert set(progress) == set(ids) and progress["r0"] == alone[0].tokens[:len(progress["r0"])]
    running, waiting = e.running[0].rid, e.waiting[-1].rid  # one holding pages, one not yet admitted
    held = len(e.manager.block_table(running))
    free = e.manager.num_free
    assert e.cancel(running) and e.cancel(waiting)
    assert e.manager.num_free == free + held and running not in e.manager
    for rid in (running, waiting):
        r = e.results[rid]
        assert (r.finish_reason, r.stopped_by) == ("cancelled", "cancelled") and rid not in e.in_progress()
    assert e.results[running].tokens == progress[running] and e.results[waiting].tokens == progress[waiting]
    assert not e.cancel(running) and not e.cancel("unknown")  # finished or never seen: nothing to do
    results = e.run()
    for i, rid in enumerate(ids):
        if rid not in (running, waiting):
            assert results[rid].tokens == alone[i].tokens, rid
    assert e.manager.num_free == GEOMETRY["num_pages"] and e.stats["cancelled"] == 2


def test_in_progress_lists_only_grow_through_preemption(llama):
    cfg, graphdef, state = llama
    e = eng.Engine(graphdef, state, cfg, **GEOMETRY)
    for p in PROMPTS * 2:  # too many for 10 pages: some are preempted and recomputed
        e.submit(p, SamplingParams(max_new_tokens=8))
    seen: dict = {}
    while not e.done:
        e.step()
        for rid, tokens in e.in_progress().items():
            assert tokens[:len(seen.get(rid, []))] == seen.get(rid, []), rid
            seen[rid] = tokens
    assert e.stats["preemptions"] > 0


def test_compile_all_covers_every_step_a_workload_runs(llama):
    """compile_all traces each shape of step_shapes once; after it a varied workload (prefill chunks of every
    size, batches growing and shrinking, preemption) traces nothing new; the pools are unchanged by it. A
    geometry of its own (3 rows, 11 pages, chunks of 16), so no other test compiled these shapes first."""
    cfg, graphdef, state = llama
    e = eng.Engine(graphdef, state, cfg, num_pages=11, page_size=4, max_batch=3, chunk_size=16)
    pools = [np.asarray(k) for k, _ in e.pools]
    before = dict(eng.TRACE_COUNTS)
    n = e.compile_all()
    assert e.step_shapes() == [(B, T, 10) for B in (1, 2, 3) for T in (1, 8, 16)] and n == 9
    traced = {k: v - before.get(k, 0) for k, v in eng.TRACE_COUNTS.items() if v != before.get(k, 0)}
    assert sorted(traced) == sorted(f"step_B{B}_T{T}_M{M}" for B, T, M in e.step_shapes())
    assert all(np.array_equal(a, np.asarray(k)) for a, (k, _) in zip(pools, e.pools))
    before = dict(eng.TRACE_COUNTS)
    for i, p in enumerate(PROMPTS):
        e.submit(p + p, SamplingParams(max_new_tokens=8))  # 6..18-token prompts: chunks of 8 and 16
        e.step()
    e.run()
    assert e.stats["preemptions"] > 0
    assert {k: v for k, v in eng.TRACE_COUNTS.items() if v != before.get(k, 0)} == {}
