"""``generate``: batched autoregressive decoding with the contiguous KV cache.

One jitted prefill of the right-padded prompts, then one jitted decode step per
token; shapes stay fixed, so decoding never retraces (``TRACE_COUNTS`` counts
traces, for tests). Sampling follows :mod:`jaxformer.decode.sampling`, so a
request's tokens depend only on its own prompt and parameters.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer.decode.kv_cache import init_caches, set_lengths
from jaxformer.decode.sampling import RowSampling, SamplingParams

TRACE_COUNTS: collections.Counter = collections.Counter()


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def prefill_step(graphdef, state, caches, tokens, prompt_lengths, sampling: RowSampling):
    """Run right-padded prompts ``tokens [B, T]`` through the model; sample each first token."""
    TRACE_COUNTS["prefill"] += 1
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))
    logits, caches = nnx.merge(graphdef, state)(tokens, positions=positions, cache=caches,
                                                logits_at=prompt_lengths - 1)  # the head at the last token only
    nxt = sampling.sample(logits[:, 0], jnp.zeros_like(prompt_lengths))
    return nxt, set_lengths(caches, prompt_lengths)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def decode_step(graphdef, state, caches, tokens, steps, sampling: RowSampling):
    """Feed ``tokens [B]`` at each sequence's cached length; sample token number ``steps [B]``."""
    TRACE_COUNTS["decode"] += 1
    positions = caches[0].lengths[:, None]
    logits, caches = nnx.merge(graphdef, state)(tokens[:, None], positions=positions, cache=caches)
    return sampling.sample(logits[:, 0], steps), caches


def _per_request(value, B: int, name: str) -> list:
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) != B:
            raise ValueError(f"{name} has {len(value)} values for {B} prompts")
        return value.tolist() if isinstance(value, np.ndarray) else list(value)  # numpy's scalars as Python's
    return [value] * B


def check_prompt(tokens, config) -> list[int]:
    """A prompt as a list of ints; ValueError if empty, out of vocabulary or over the context."""
    tokens = [int(t) for t in np.asarray(tokens).reshape(-1)] if not isinstance(tokens, list) else tokens
    if len(tokens) == 0:
        raise ValueError("empty prompt: give at least one token")
    if len(tokens) > config.max_seq_len:
        raise ValueError(f"prompt of {len(tokens)} tokens is longer than the model's context "
                         f"max_seq_len={config.max_seq_len}")
    bad = [t for t in tokens if not isinstance(t, (int, np.integer)) or not 0 <= t < config.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {config.vocab_size})")
    return [int(t) for t in tokens]


def generate(graphdef, state, config, prompt_tokens: Sequence[Sequence[int]], *, max_new_tokens: int = 32,
             temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_tokens: Sequence[int] = ()) -> list[list[int]]:
    """Generate continuations of a batch of prompts with the contiguous KV cache.

    Args:
      graphdef, state: ``jaxformer.model.init(config, key)`` (or a restored checkpoint).
      config: the decoder-only ``ModelConfig``.
      prompt_tokens: B prompts of token ids (ragged lists, or an int array ``[B, T]``).
      max_new_tokens: tokens to generate per prompt (fewer if the context fills up).
      temperature, top_k, top_p, seed: one value for all, or one per prompt (0 temperature: greedy).
      stop_tokens: ids that end a sequence (kept in its output).
    Returns:
      B lists of generated token ids (prompt excluded).
    """
    prompts = [check_prompt(p, config) for p in prompt_tokens]
    B = len(prompts)
    if B == 0:
        raise ValueError("no prompts given")
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, max_new_tokens=max_new_tokens,
                             stop_tokens=tuple(int(x) for x in stop_tokens)).validate(config.vocab_size)
              for t, k, p, s in zip(_per_request(temperature, B, "temperature"), _per_request(top_k, B, "top_k"),
                                    _per_request(top_p, B, "top_p"), _per_request(seed, B, "seed"))]
    lens = np.array([len(p) for p in prompts], np.int32)
    T = int(min(-(-lens.max() // 16) * 16, config.max_seq_len))
    S = int(min(T + max_new_tokens, config.max_seq_len))
    tokens = np.zeros((B, T), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    sampling = RowSampling.of(params)
    budget = np.minimum(max_new_tokens, config.max_seq_len - lens + 1)  # the last token is never fed back
    caches = init_caches(config, B, S)
    nxt, caches = prefill_step(graphdef, state, caches, jnp.asarray(tokens), jnp.asarray(lens), sampling)
    stop = set(params[0].stop_tokens)
    out: list[list[int]] = [[] for _ in range(B)]
    done = budget <= 0
    for i in range(int(budget.max())):
        host = np.asarray(nxt)
        for b in np.flatnonzero(~done):
            out[b].append(int(host[b]))
            done[b] = host[b] in stop or len(out[b]) >= budget[b]
        if done.all():
            break
        steps = jnp.full((B,), i + 1, jnp.int32)
        nxt, caches = decode_step(graphdef, state, caches, nxt, steps, sampling)
    return out
