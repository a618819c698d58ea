"""Per-token log-probabilities of a whole sequence: one causal forward pass, log-softmax at every position.

What OpenAI's ``logprobs`` (with ``echo``, the prompt's too) report, and what evaluation harnesses score
choices with: entry ``i`` is ``log p(tokens[i + 1] | tokens[:i + 1])`` under the model's own logits (no
temperature, no top-k / top-p filter). The sequence is right-padded to a power of two (at least 16, at most
the context) so a few compiled programs serve every length; causal attention keeps the padding from
touching the real positions.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer.decode.engine import bucket

MIN_LENGTH = 16


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """``logprobs [T - 1]``: each next token's log-probability; ``top_ids``, ``top_logprobs [T - 1, k]``:
    the ``k`` most likely tokens there, most likely first (``k`` = the ``top`` asked for)."""

    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@functools.partial(jax.jit, static_argnums=(0, 3))
def _score(graphdef, state, tokens, top: int):
    logits = nnx.merge(graphdef, state)(tokens)  # [1, T, V]
    logp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)  # [T - 1, V]
    chosen = jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0]
    top_vals, top_ids = jax.lax.top_k(logp, max(top, 1))
    return chosen, top_ids, top_vals


def token_logprobs(graphdef, state, tokens: Sequence[int], *, top: int = 0, max_len: int | None = None
                   ) -> TokenLogprobs:
    """Log-probabilities of ``tokens[1:]`` given what precedes each (see the module docstring).

    ``top``: also the ``top`` most likely tokens per position (0: none, arrays of width 0). ``max_len``:
    the model's context (padding stops there; ``len(tokens)`` may not exceed it)."""
    n = len(tokens)
    if n < 2:
        empty = np.zeros((0, top), np.float32)
        return TokenLogprobs(np.zeros(0, np.float32), empty.astype(np.int32), empty)
    if max_len is not None and n > max_len:
        raise ValueError(f"{n} tokens are longer than the context max_len={max_len}")
    T = bucket(n, MIN_LENGTH, n << 1 if max_len is None else max_len)  # a power of two, at most the context
    padded = np.zeros((1, T), np.int32)
    padded[0, :n] = tokens
    chosen, ids, vals = jax.device_get(_score(graphdef, state, jnp.asarray(padded), top))
    return TokenLogprobs(np.asarray(chosen[: n - 1]), np.asarray(ids[: n - 1, :top]), np.asarray(vals[: n - 1, :top]))
