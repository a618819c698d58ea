"""Sliding-window generation past the context (RoPE / ALiBi models).

The engine's greedy tokens equal two independent references, both plain full forwards
without any cache: (1) the whole sequence under a band mask ``attention_window=(W-1, 0)``
(what "every token attends to its last W positions" means at every layer), and (2) for a
1-layer model, the model run on just the last W tokens at their absolute positions (equal
to (1) only with one layer: deeper, the cached keys of a windowed model carry context from
before the window). Each reference also reports its smallest top-1/top-2 logit gap, so a
tie decided by rounding would show. Pages behind the window go back to the block manager;
absolute-position models are refused. A model whose config has the band itself (Mistral's
``sliding_window``) brings the window to the engine, and its paged cache gives the banded full
forward's logits.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.decode import engine as eng
from jaxformer.decode.block_manager import BlockManager
from jaxformer.decode.paged_cache import PagedKVCache, init_page_pools
from jaxformer.decode.sampling import SamplingParams
from jaxformer.model import apply, init, presets

L, W, NEW = 4, 22, 60  # page size, window (not page-aligned), new tokens: 30 + 60 tokens, > 2 contexts of 40
RNG = np.random.default_rng(1)
PROMPTS = [list(map(int, RNG.integers(1, 256, size=n))) for n in (5, 30, 13)]
# The engine's float32 logits (paged kernel, chunked prefill) differ from the banded full forward by
# at most 2.5e-5 over 80 tokens past the context (measured, llama and bloom); a greedy token is only a
# fair comparison where the reference's top-2 gap is well above that.
MIN_GAP = 1e-4

_forward = jax.jit(apply, static_argnums=0)


def greedy_reference(graphdef, state, prompts, n_new, width, last_w=None):
    """Greedy continuations by full forwards of fixed ``width`` (right padding: causal, so the
    logits at the last real token do not see it). ``last_w``: feed only the last ``last_w``
    tokens at their absolute positions; None: the whole sequence from position 0.
    Returns the new tokens per prompt and the smallest top-1/top-2 logit gap seen."""
    seqs = [list(p) for p in prompts]
    gap = math.inf
    for _ in range(n_new):
        tokens = np.zeros((len(seqs), width), np.int32)
        positions = np.zeros((len(seqs), width), np.int32)
        last = []
        for b, s in enumerate(seqs):
            start = 0 if last_w is None else max(0, len(s) - last_w)
            tokens[b, : len(s) - start] = s[start:]
            positions[b] = start + np.arange(width)
            last.append(len(s) - start - 1)
        logits = np.asarray(_forward(graphdef, state, jnp.asarray(tokens), positions=jnp.asarray(positions)))
        rows = logits[np.arange(len(seqs)), last]
        top2 = np.sort(rows, axis=-1)[:, -2:]
        gap = min(gap, float(np.min(top2[:, 1] - top2[:, 0])))
        for s, t in zip(seqs, rows.argmax(-1)):
            s.append(int(t))
    return [s[len(p):] for s, p in zip(seqs, prompts)], gap


def banded(cfg, graphdef_state):
    """The same weights under a config whose self-attention has the band (W-1, 0)."""
    _, state = graphdef_state
    cfg_w = cfg.replace(attention_window=(W - 1, 0))
    return init(cfg_w, jax.random.key(0))[0], state


def engine_run(cfg, graphdef, state, prompts, n_new, **kw):
    e = eng.Engine(graphdef, state, cfg, page_size=L, chunk_size=8, **kw)
    ids = [e.submit(p, SamplingParams(max_new_tokens=n_new)) for p in prompts]
    res = e.run()
    return e, [res[i] for i in ids]


@pytest.fixture(scope="module")
def bloom():
    cfg = presets.get("bloom_tiny", init_std=0.3, max_seq_len=40)
    return (cfg, *init(cfg, jax.random.key(2)))


@pytest.fixture(scope="module")
def llama_banded_reference(llama):
    cfg, graphdef, state = llama
    return greedy_reference(*banded(cfg, (graphdef, state)), PROMPTS, NEW, width=96)


# llama (6 s): test_model_band_is_the_engine_window runs the same weights, prompts and window W through the engine
# (the window from the config, not the argument; the same steps after check_window) against the same reference.
# bloom (10 s): the windowed engine against the banded full forward is default-run on llama (above, and the window
# argument in test_window_under_preemption_recomputes_past_the_context); ALiBi over a table whose pages behind the
# window were dropped is the Pallas GPU kernel's (interpreted) in tests/pallas_kernels/test_paged_attention.py::
# test_kernel_sliding_window_with_dropped_leading_pages[gpu], an ALiBi model through the Engine (no window) against
# transformers' tokens tests/interop/test_bloom.py::test_greedy_generation_matches_transformers (both default-run).
# Not default-run any more: ALiBi through the Engine's windowed steps (the CPU's reference decode, a blockwise
# re-prefill)
@pytest.mark.parametrize("model", [pytest.param("llama", marks=pytest.mark.slow),
                                   pytest.param("bloom", marks=pytest.mark.slow)])
def test_window_equals_full_forward_with_band_mask(model, request, llama_banded_reference):
    """RoPE (GQA) and ALiBi, 2 layers, context 40: 90-token sequences through the engine with a
    22-token window equal full forwards under the band mask."""
    cfg, graphdef, state = request.getfixturevalue(model)
    if model == "llama":
        want, gap = llama_banded_reference
    else:
        want, gap = greedy_reference(*banded(cfg, (graphdef, state)), PROMPTS, NEW, width=96)
    assert gap > MIN_GAP
    e, results = engine_run(cfg, graphdef, state, PROMPTS, NEW, num_pages=30, window=W)
    assert [r.tokens for r in results] == want
    assert all(r.stopped_by == "max_new_tokens" and r.finish_reason == "length" for r in results)
    assert e.stats["preemptions"] == 0 and e.stats["pages_dropped"] > 0
    assert e.manager.num_free == 30


def test_window_under_preemption_recomputes_past_the_context(llama, llama_banded_reference):
    """12 pages for two sequences that settle at 6-7 each: the newer one, already past the 40-token
    context, is preempted and later recomputed by windowed prefill (dropping pages as it goes),
    and still gives the reference's tokens."""
    cfg, graphdef, state = llama
    want, _ = llama_banded_reference
    e = eng.Engine(graphdef, state, cfg, num_pages=12, page_size=L, chunk_size=8, window=W)
    a = e.submit(PROMPTS[0], SamplingParams(max_new_tokens=40))
    b = e.submit(PROMPTS[1], SamplingParams(max_new_tokens=NEW))
    readmitted = []  # token counts of preempted sequences when they come back
    while not e.done:
        waiting = {r.rid: len(r.tokens) for r in e.waiting if r.preemptions}
        e.step()
        readmitted += [waiting[r.rid] for r in e.running if r.rid in waiting]
    assert e.stats["preemptions"] > 0 and max(readmitted) > cfg.max_seq_len
    assert e.results[a].tokens == want[0][:40] and e.results[b].tokens == want[1]
    assert e.manager.num_free == 12


# slow (5.4 s): this oracle checks what the band (W-1, 0) means, and MaskSpec's band is checked against its loop
# definition in tests/ops/test_masks.py::test_dense_matches_definition; the engine against the banded full forward
# (RoPE angles past the context included) is default-run: test_model_band_is_the_engine_window,
# test_window_under_preemption_recomputes_past_the_context
@pytest.mark.slow
def test_one_layer_window_equals_recompute_on_the_last_w_tokens():
    """One layer: the keys in the window depend only on their own tokens, so the windowed engine
    equals running the model on just the last W tokens at their absolute positions (RoPE angles
    past the context included)."""
    cfg = presets.get("llama_tiny", n_layers=1, init_std=0.3, max_seq_len=40)
    graphdef, state = init(cfg, jax.random.key(3))
    want, gap = greedy_reference(graphdef, state, PROMPTS, NEW, width=W, last_w=W)
    assert gap > MIN_GAP
    _, results = engine_run(cfg, graphdef, state, PROMPTS, NEW, num_pages=30, window=W)
    assert [r.tokens for r in results] == want


# slow (7 s): the same checks through `jaxformer generate` (run_prompts' engine: cut at the context with stopped_by
# "context" and context - prompt + 1 tokens, then --window of the whole context: those tokens first, then on to
# max_new_tokens) are tests/test_cli.py::test_generate_says_when_the_context_cut_a_completion_and_separates_completions
@pytest.mark.slow
def test_window_of_the_context_continues_where_plain_generation_stops(llama):
    """Without a window the engine stops at the 40-token context (stopped_by "context"); with
    window=40 the same tokens come first (inside the context nothing is cut), then it goes on."""
    cfg, graphdef, state = llama
    prompt = PROMPTS[1]
    _, (cut,) = engine_run(cfg, graphdef, state, [prompt], NEW, num_pages=30, max_batch=4)
    assert cut.stopped_by == "context" and len(cut.tokens) == cfg.max_seq_len - len(prompt) + 1
    _, (full,) = engine_run(cfg, graphdef, state, [prompt], NEW, num_pages=30, max_batch=4,
                            window=cfg.max_seq_len)
    assert full.stopped_by == "max_new_tokens" and len(full.tokens) == NEW
    assert full.tokens[: len(cut.tokens)] == cut.tokens


def test_pages_behind_the_window_return_to_the_block_manager(llama):
    """Window 10, pages of 4: a decoding sequence holds at most ceil(10/4)+1 = 4 pages, so a pool
    of exactly 4 carries one request 100 tokens past its prompt without preemption."""
    cfg, graphdef, state = llama
    window, bound = 10, math.ceil(10 / L) + 1
    e = eng.Engine(graphdef, state, cfg, num_pages=bound, page_size=L, max_batch=1, chunk_size=8, window=window)
    rid = e.submit(PROMPTS[0], SamplingParams(max_new_tokens=100))
    held = []
    while not e.done:
        start = e.manager.num_computed(rid) if rid in e.manager else 0
        e.step()
        if rid in e.manager:
            held.append(len(e.manager.block_table(rid)))
            assert e.manager.num_free == bound - held[-1]
            # the step's table began with the page holding the oldest position its first token sees
            first = e.manager.num_dropped(rid) * L
            assert first <= max(0, start - window + 1) < first + L
    assert max(held) == bound and e.stats["preemptions"] == 0
    assert e.stats["pages_dropped"] >= (len(PROMPTS[0]) + 100) // L - bound
    assert len(e.results[rid].tokens) == 100 and e.manager.num_free == bound


def test_block_manager_drop_before():
    m = BlockManager(8, 4)
    m.add("a", list(range(10)))  # 3 pages
    m.prepare_write("a", 10)
    m.commit("a", 10)
    table = m.block_table("a")
    assert m.drop_before("a", 3) == 0  # page 0 still holds position 3
    assert m.drop_before("a", 8) == 2 and m.num_dropped("a") == 2
    assert m.block_table("a") == table[2:] and m.num_free == 8 - 1
    assert m.drop_before("a", 8) == 0
    m.append("a", [10, 11, 12])
    assert m.prepare_write("a", 3) == [] and len(m.block_table("a")) == 2  # position 12 opens page 3
    m.commit("a", 3)
    m.fork("a", "b")
    assert m.num_dropped("b") == 2 and m.block_table("b") == m.block_table("a")
    with pytest.raises(ValueError, match="computed"):
        m.drop_before("a", 14)
    m.finish("a")
    m.finish("b")
    assert m.num_free == 8


@pytest.mark.parametrize("position", ["learned", "sinusoidal", "none"])
def test_window_refused_for_absolute_or_no_positions(position):
    cfg = presets.get("llama_tiny", position=position, max_seq_len=40)
    with pytest.raises(ValueError, match=f"relative positions.*positions.kind='{position}'"):
        eng.Engine(None, None, cfg, num_pages=4, window=40)
    rope = presets.get("llama_tiny", max_seq_len=40)
    for bad in (0, 41, 2.5):
        with pytest.raises(ValueError, match="max_seq_len=40"):
            eng.Engine(None, None, rope, num_pages=4, window=bad)


# ---------------------------------------------------------------- models trained with a sliding window
def banded_config(cfg):
    return cfg.replace(attention_window=(W - 1, 0))


def test_model_band_is_the_engine_window(llama, llama_banded_reference):
    """A config with attention_window=(W-1, 0) (Mistral's sliding_window=W) brings its own window: the
    engine, given none, runs with W and reproduces the banded full forward past the context."""
    cfg, graphdef, state = llama
    cfg_w = banded_config(cfg)
    graphdef_w, _ = banded(cfg, (graphdef, state))
    want, gap = llama_banded_reference
    assert gap > MIN_GAP
    e, results = engine_run(cfg_w, graphdef_w, state, PROMPTS, NEW, num_pages=30)
    assert e.window == W and e.options.window == W
    assert [r.tokens for r in results] == want
    assert e.stats["pages_dropped"] > 0
    assert eng.check_window(W, cfg_w) == W and eng.check_window(None, cfg_w) == W
    with pytest.raises(ValueError, match=rf"window={W + 1} differs from the model's own sliding window "
                                         rf"sparsity.causal_window={W} \(sparsity.window=\({W - 1}, 0\)\)"):
        eng.Engine(graphdef_w, state, cfg_w, num_pages=4, window=W + 1)
    with pytest.raises(ValueError, match=r"sliding window \(its own, sparsity.window=.*positions.kind='learned'"):
        eng.Engine(None, None, cfg_w.replace(position="learned"), num_pages=4)


# slow (3 s): a windowed model's paged cache teacher-forced (a chunk through gathered pages, then the kernel one token
# at a time past the window) against transformers' logits is tests/interop/test_llama.py::
# test_kv_cache_decoding_matches_transformers[mistral] (decoder_checks.paged_teacher_forced, window 4); the engine's
# paged cache under this banded model against the banded full forward is test_model_band_is_the_engine_window
@pytest.mark.slow
def test_paged_cache_teacher_forced_logits_of_a_windowed_model(llama):
    """The paged cache under a windowed model (W = 22 < 34 tokens, pages of 4): a prefill chunk through
    gathered pages, then one token at a time through the paged-attention kernel, gives the banded
    full forward's logits at every position."""
    cfg, graphdef, state = llama
    cfg_w = banded_config(cfg)
    graphdef_w, _ = banded(cfg, (graphdef, state))
    n, first = 34, 10
    toks = jnp.asarray(np.random.default_rng(3).integers(0, 256, size=(2, n)), jnp.int32)
    full = np.asarray(_forward(graphdef_w, state, toks))
    pools = init_page_pools(cfg_w, num_pages=2 * 9, page_size=L)
    tables = jnp.asarray(np.arange(18).reshape(2, 9), jnp.int32)  # 9 pages of 4 per sequence

    @jax.jit
    def step(pools, t, start):
        B, T = t.shape
        caches = [PagedKVCache(k, v, tables, jnp.full(B, start, jnp.int32), jnp.full(B, T, jnp.int32),
                               window=cfg_w.sparsity.causal_window) for k, v in pools]
        pos = start + jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        logits, caches = apply(graphdef_w, state, t, positions=pos, cache=caches)
        return logits, [(c.k_pages, c.v_pages) for c in caches]

    got = []
    for a, b in [(0, first)] + [(i, i + 1) for i in range(first, n)]:
        logits, pools = step(pools, toks[:, a:b], a)
        got.append(np.asarray(logits))
    # fp32; gathered pages and the kernel's online softmax sum in another order: 1e-4 on logits of O(10)
    np.testing.assert_allclose(np.concatenate(got, axis=1), full, atol=1e-4, rtol=1e-4)
