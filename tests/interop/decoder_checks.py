"""Checks shared by the decoder-only family tests: a loaded fixture decoded through the contiguous
KV cache, the paged cache and the engine must reproduce transformers' recorded logits and tokens.

Every function takes ``(config, graphdef, state)`` from ``load_pretrained`` and the fixture's
``expected`` arrays. Decoding is teacher-forced over one batch holding the fixture's rows (its
``input_ids``, right-padded to the length of ``generated_ids``) plus ``generated_ids`` itself, so one
pass checks both ``logits`` (every position where ``attention_mask`` is 1) and ``generated_logits``
(the next-token logits transformers saw at each greedy step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer.decode import engine as eng
from jaxformer.decode.kv_cache import init_caches
from jaxformer.decode.paged_cache import PagedKVCache, init_page_pools
from jaxformer.decode.sampling import SamplingParams
from jaxformer.model.functional import abstract_init, apply
from tests.interop.common import max_diff

PREFILL = 4       # teacher-forced decoding: one chunk of this many tokens, then one token per step
PAGE_SIZE = 4
MARGIN = 1e-3     # a greedy step whose top-2 logit margin is below this may flip between implementations


def batch(expected: dict) -> tuple[np.ndarray, np.ndarray, int]:
    """``(tokens [B+1, T'], mask [B+1, T'], gen_prompt)``: the fixture's rows right-padded with their last
    token to ``generated_ids``' length, then ``generated_ids``; mask marks the fixture's valid positions
    (the generated row's are compared against ``generated_logits`` instead)."""
    ids, mask, gen = expected["input_ids"], expected["attention_mask"], expected["generated_ids"]
    T = max(ids.shape[1], gen.shape[1])
    pad = lambda a: np.pad(a, ((0, 0), (0, T - a.shape[1])), mode="edge")  # noqa: E731
    tokens = np.concatenate([pad(ids), pad(gen)]).astype(np.int32)
    full_mask = np.concatenate([np.pad(mask, ((0, 0), (0, T - mask.shape[1]))), np.zeros((len(gen), T), mask.dtype)])
    gen_prompt = gen.shape[1] - expected["generated_logits"].shape[1]
    return tokens, full_mask, gen_prompt


def compare(logits, expected: dict, mask: np.ndarray, gen_prompt: int) -> tuple[float, float]:
    """``(max diff vs logits at valid positions, max diff vs generated_logits)`` of batch-shaped logits."""
    B, T = expected["input_ids"].shape
    steps = expected["generated_logits"].shape[1]
    fixture = max_diff(np.asarray(logits)[:B, :T], expected["logits"], mask[:B, :T])
    gen = np.asarray(logits)[B:, gen_prompt - 1: gen_prompt - 1 + steps]
    return fixture, max_diff(gen, expected["generated_logits"])


def contiguous_teacher_forced(config, graphdef, state, tokens: np.ndarray) -> np.ndarray:
    """Logits ``[B, T, V]``: a ``PREFILL``-token chunk, then one token per call, through ``init_caches``."""
    B, T = tokens.shape
    step = jax.jit(lambda s, c, t, p: apply(graphdef, s, t, positions=p, cache=c))
    caches = init_caches(config, B, T)
    tok = jnp.asarray(tokens)
    logits, caches = step(state, caches, tok[:, :PREFILL], jnp.broadcast_to(jnp.arange(PREFILL), (B, PREFILL)))
    out = [logits]
    for i in range(PREFILL, T):
        logits, caches = step(state, caches, tok[:, i:i + 1], jnp.full((B, 1), i, jnp.int32))
        out.append(logits)
    return np.asarray(jnp.concatenate(out, axis=1))


def paged_teacher_forced(config, graphdef, state, tokens: np.ndarray) -> np.ndarray:
    """Logits ``[B, T, V]`` through :class:`PagedKVCache` as the engine's step builds it: a
    ``PREFILL``-token chunk (gathered pages), then single tokens (the paged-attention kernel; its
    reference backend on CPU). Block tables hand out pages in a scrambled order, so a wrong table
    lookup would show."""
    B, T = tokens.shape
    M = -(-T // PAGE_SIZE)
    pages = np.random.default_rng(0).permutation(B * M).astype(np.int32)
    tables = jnp.asarray(pages.reshape(B, M))
    pools = init_page_pools(config, B * M, PAGE_SIZE)

    @jax.jit
    def step(state, pools, t, p, lengths):
        num_new = jnp.full((B,), t.shape[1], jnp.int32)
        caches = [PagedKVCache(k, v, tables, lengths, num_new, window=config.sparsity.causal_window) for k, v in pools]
        logits, caches = apply(graphdef, state, t, positions=p, cache=caches)
        return logits, [(c.k_pages, c.v_pages) for c in caches]

    tok = jnp.asarray(tokens)
    logits, pools = step(state, pools, tok[:, :PREFILL], jnp.broadcast_to(jnp.arange(PREFILL), (B, PREFILL)),
                         jnp.zeros((B,), jnp.int32))
    out = [logits]
    for i in range(PREFILL, T):
        logits, pools = step(state, pools, tok[:, i:i + 1], jnp.full((B, 1), i, jnp.int32),
                             jnp.full((B,), i, jnp.int32))
        out.append(logits)
    return np.asarray(jnp.concatenate(out, axis=1))


def trusted_steps(expected: dict) -> int:
    """Greedy steps whose tokens must match: those before the first near-tie (margin < MARGIN)."""
    low = np.flatnonzero(expected["generated_top2_margin"][0] < MARGIN)
    return int(low[0]) if low.size else expected["generated_top2_margin"].shape[1]


def greedy(config, graphdef, state, expected: dict) -> tuple[list[int], list[int]]:
    """``(want, ours)``: the first :func:`trusted_steps` new tokens of the fixture's greedy continuation,
    and the paged engine's (greedy; no stop tokens: HF stops only at eos, and ``generated_ids`` would
    be shorter if it had). The contiguous cache's ``generate`` computes the same logits as
    :func:`contiguous_teacher_forced` (checked against ``generated_logits``), so it is not rerun here."""
    gen = expected["generated_ids"][0]
    steps = expected["generated_logits"].shape[1]
    prompt = [int(t) for t in gen[: len(gen) - steps]]
    n = trusted_steps(expected)
    [result] = eng.serve(graphdef, state, config, [(prompt, SamplingParams(max_new_tokens=steps))],
                         num_pages=8, page_size=PAGE_SIZE, max_batch=2, chunk_size=8)
    assert result.finish_reason == "length", result
    return [int(t) for t in gen[len(prompt):][:n]], result.tokens[:n]


def random_state(config, seed: int = 0, std: float = 0.5):
    """``(graphdef, state)`` of ``config`` filled with numpy normals (no compiled init: fast)."""
    graphdef, abstract = abstract_init(config)
    rng = np.random.default_rng(seed)
    leaves = [(p, v.replace(jnp.asarray(rng.normal(0.0, std, v.shape), v.dtype)))
              for p, v in nnx.to_flat_state(abstract)]
    return graphdef, nnx.from_flat_state(leaves)


def flat(state) -> dict:
    """``path -> numpy array`` of a state."""
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(state)}
