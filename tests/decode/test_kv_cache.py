"""Contiguous KV cache and ``generate``: cached logits equal a full causal forward, greedy
generation equals recomputing the whole sequence each token, and decoding never retraces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.decode.generate import TRACE_COUNTS, generate
from jaxformer.decode.kv_cache import KVCache, init_caches, set_lengths
from jaxformer.model import apply, init, presets
from jaxformer.ops.attention import xla_attention
from jaxformer.ops.masks import MaskSpec


def test_attend_writes_at_each_length_and_matches_dense_attention():
    rng = np.random.default_rng(0)
    B, S, K, G, H, T = 2, 12, 2, 2, 8, 3
    cache = KVCache.zeros(B, S, K, H)
    k_hist = jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.float32)
    v_hist = jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.float32)
    lengths = jnp.asarray([2, 7])
    cache = KVCache(k_hist, v_hist, lengths)
    q = jnp.asarray(rng.normal(size=(B, T, K * G, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32)
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625])
    attend = jax.jit(lambda c, q, k, v: c.attend(q, k, v, scale=0.4, alibi_slopes=slopes, softcap=4.0))
    out, new = attend(cache, q, k, v)
    dense = jax.jit(lambda q, k, v: xla_attention(q, k, v, scale=0.4, alibi_slopes=slopes, softcap=4.0,
                                                  mask=MaskSpec(causal=True)))
    np.testing.assert_array_equal(new.lengths, lengths + T)
    for b, n in enumerate([2, 7]):
        kk = np.concatenate([np.asarray(k_hist[b, :n]), np.asarray(k[b])])
        vv = np.concatenate([np.asarray(v_hist[b, :n]), np.asarray(v[b])])
        np.testing.assert_array_equal(new.k[b, : n + T], kk)
        # independent: dense attention of the T queries over exactly the n+T keys, bottom-right causal
        want = dense(q[b:b + 1], jnp.asarray(kk)[None], jnp.asarray(vv)[None])
        np.testing.assert_allclose(out[b], want[0], atol=1e-5, rtol=1e-5)


# llama_tiny default (RoPE without a band: the cached logits of the commonest model; 2.5 s, the `llama` fixture's).
# bloom_tiny slow (4 s): a BLOOM model through init_caches, a prefill then one token a call, is default-run against
# transformers' logits at every position in tests/interop/test_bloom.py::test_kv_cache_decoding_matches_transformers
# [bloom], and ALiBi slopes in KVCache.attend against dense attention in test_attend_writes_at_each_length_...
@pytest.mark.parametrize("preset", ["llama_tiny", pytest.param("bloom_tiny", marks=pytest.mark.slow)])
def test_teacher_forced_cached_logits_equal_full_forward(preset, llama):
    """Prefill 5 tokens then feed 4 one at a time: logits at every position equal apply() on all 9."""
    if preset == "llama_tiny":
        cfg, graphdef, state = llama
    else:  # ALiBi
        cfg = presets.get(preset, init_std=0.3, max_seq_len=16)
        graphdef, state = init(cfg, jax.random.key(1))
    toks = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 9)), jnp.int32)
    full = jax.jit(apply, static_argnums=0)(graphdef, state, toks)
    step = jax.jit(lambda s, c, t, p: apply(graphdef, s, t, positions=p, cache=c))
    caches = init_caches(cfg, 2, 16)
    logits, caches = step(state, caches, toks[:, :5], jnp.broadcast_to(jnp.arange(5), (2, 5)))
    got = [logits]
    for i in range(5, 9):
        logits, caches = step(state, caches, toks[:, i:i + 1], jnp.full((2, 1), i))
        got.append(logits)
    # fp32, same math in another order (cached keys, bottom-right mask): 1e-4 on logits of O(10)
    np.testing.assert_allclose(jnp.concatenate(got, axis=1), full, atol=1e-4, rtol=1e-4)


def test_generate_greedy_equals_full_recompute_and_never_retraces(llama):
    cfg, graphdef, state = llama
    prompts = [[5, 6, 7], [9] * 11, [1, 2, 3, 4, 5, 6, 7, 8]]
    before = dict(TRACE_COUNTS)
    out = generate(graphdef, state, cfg, prompts, max_new_tokens=6)
    traced = {k: v - before.get(k, 0) for k, v in TRACE_COUNTS.items()}
    assert traced == {"prefill": 1, "decode": 1}, traced  # 5 decode steps, one trace
    # new prompts of the same padded shape: no new trace at all
    generate(graphdef, state, cfg, [[1], [2] * 9, [3] * 12], max_new_tokens=6)
    assert TRACE_COUNTS["decode"] == before.get("decode", 0) + 1
    # causal model: right padding to a fixed width leaves the logits at len(seq)-1 unchanged
    full = jax.jit(lambda t: apply(graphdef, state, t))
    for p, o in zip(prompts, out):
        seq = list(p)
        for _ in range(6):
            padded = jnp.asarray([seq + [0] * (24 - len(seq))])
            seq.append(int(jnp.argmax(full(padded)[0, len(seq) - 1])))
        assert o == seq[len(p):]


def test_generate_stop_tokens_context_limit_and_per_request_sampling(llama):
    cfg, graphdef, state = llama
    greedy = generate(graphdef, state, cfg, [[3, 4, 5]], max_new_tokens=8)[0]
    stop = greedy[3]
    out = generate(graphdef, state, cfg, [[3, 4, 5]], max_new_tokens=8, stop_tokens=[stop])[0]
    assert out == greedy[: greedy.index(stop) + 1]
    # 38 prompt tokens in a 40-token context: 3 new tokens at most (the last is never fed back)
    assert len(generate(graphdef, state, cfg, [[1] * 38], max_new_tokens=8)[0]) == 3
    # same seed: same sample alone or in a batch beside a greedy request
    alone = generate(graphdef, state, cfg, [[7, 8]], max_new_tokens=8, temperature=1.5, seed=3)[0]
    both = generate(graphdef, state, cfg, [[3, 4, 5], [7, 8]], max_new_tokens=8, temperature=[0.0, 1.5],
                        seed=[0, 3])
    assert both == [greedy, alone]
    # per-request values as numpy arrays (numpy's scalars taken as Python's)
    assert generate(graphdef, state, cfg, [[3, 4, 5], [7, 8]], max_new_tokens=8,
                    temperature=np.array([0.0, 1.5], np.float32), seed=np.array([0, 3]),
                    top_k=np.zeros(2, np.int64)) == both


def test_generate_bad_inputs(llama):
    cfg, graphdef, state = llama
    with pytest.raises(ValueError, match="empty prompt"):
        generate(graphdef, state, cfg, [[1], []])
    with pytest.raises(ValueError, match="longer than the model's context"):
        generate(graphdef, state, cfg, [[1] * 41])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(graphdef, state, cfg, [[1, 256]])
    with pytest.raises(ValueError, match="top_p"):
        generate(graphdef, state, cfg, [[1]], top_p=-0.5)
    with pytest.raises(ValueError, match="temperature has 1 values for 2 prompts"):
        generate(graphdef, state, cfg, [[1], [2]], temperature=[1.0])
    with pytest.raises(ValueError, match="decoder-only"):
        init_caches(presets.get("vaswani_tiny"), 1, 8)


def test_set_lengths_replaces_every_layer():
    caches = set_lengths(init_caches(presets.get("llama_tiny"), 2, 8), [3, 4])
    assert len(caches) == 2 and all(list(c.lengths) == [3, 4] for c in caches)


# ---------------------------------------------------------------- sliding-window models (Mistral, Qwen2)
W = 4  # the model's window: band (W-1, 0), i.e. query i sees keys i-3 .. i


@pytest.fixture(scope="module")
def windowed(llama):
    """The llama fixture's weights under a config with the causal band (W-1, 0)."""
    cfg, _, state = llama
    cfg_w = presets.get("llama_tiny", init_std=0.3, max_seq_len=40, attention_window=(W - 1, 0))
    return cfg_w, init(cfg_w, jax.random.key(0))[0], state


def test_windowed_model_teacher_forced_cached_logits_equal_full_forward(windowed, llama):
    """Prefill 5, a chunk of 3, then 6 single tokens (14 > W): cached logits at every position equal
    the windowed model's full forward (no cache: the band from ModelConfig.self_attention_mask)."""
    cfg, graphdef, state = windowed
    toks = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, size=(2, 14)), jnp.int32)
    full = jax.jit(apply, static_argnums=0)(graphdef, state, toks)
    dense = jax.jit(apply, static_argnums=0)(llama[1], state, toks)
    # the band matters: the first W positions see the same keys, later ones fewer
    np.testing.assert_allclose(full[:, :W], dense[:, :W], atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(full[:, W:] - dense[:, W:]).max()) > 1e-2
    caches = init_caches(cfg, 2, 16)
    assert all(c.window == W for c in caches)
    step = jax.jit(lambda s, c, t, p: apply(graphdef, s, t, positions=p, cache=c))
    got = []
    for a, b in [(0, 5), (5, 8)] + [(i, i + 1) for i in range(8, 14)]:
        logits, caches = step(state, caches, toks[:, a:b], jnp.broadcast_to(jnp.arange(a, b), (2, b - a)))
        got.append(logits)
    # fp32, same math in another order (cached keys, offset band mask): 1e-4 on logits of O(10)
    np.testing.assert_allclose(jnp.concatenate(got, axis=1), full, atol=1e-4, rtol=1e-4)


# slow (3 s): generate's caches are init_caches(cfg), the windowed caches whose logits at every position the test
# above checks against the full forward; generate's own loop: test_generate_greedy_equals_full_recompute_...
@pytest.mark.slow
def test_generate_with_a_windowed_model_equals_full_recompute(windowed):
    cfg, graphdef, state = windowed
    prompts = [[5, 6, 7], [9, 3] * 5]
    out = generate(graphdef, state, cfg, prompts, max_new_tokens=6)
    full = jax.jit(lambda t: apply(graphdef, state, t))
    for p, o in zip(prompts, out):
        seq = list(p)
        for _ in range(6):
            seq.append(int(jnp.argmax(full(jnp.asarray([seq + [0] * (24 - len(seq))]))[0, len(seq) - 1])))
        assert o == seq[len(p):]


def test_cache_window_must_match_the_model(windowed, llama):
    cfg, graphdef, state = windowed
    toks, pos = jnp.zeros((1, 2), jnp.int32), jnp.arange(2)[None]
    dense_caches = init_caches(llama[0], 1, 8)
    assert all(c.window is None for c in dense_caches)
    with pytest.raises(ValueError, match=r"cache\[0\].window=None but config.sparsity.window=\(3, 0\) .*"
                                         r"causal_window=4"):
        apply(graphdef, state, toks, positions=pos, cache=dense_caches)
    with pytest.raises(ValueError, match=r"cache\[0\].window=5 .*causal_window=4"):
        apply(graphdef, state, toks, positions=pos, cache=[KVCache.zeros(1, 8, 2, 16, window=5)] * cfg.n_layers)
    with pytest.raises(ValueError, match=r"KVCache.window=0 must be an int >= 1"):
        KVCache.zeros(1, 8, 2, 16, window=0)
