"""Token sampling with per-request parameters: temperature, top-k, top-p (nucleus), seeds.

Every parameter is an array ``[B]``, so requests in one batch sample
differently under one compiled function. Temperature 0 is greedy (argmax).
The key of a request's ``i``-th generated token is
``fold_in(key(seed), i)``: a request samples the same tokens whatever batch it
shares and however often it is preempted and recomputed.

Filtering order: logits / temperature -> keep the ``top_k`` largest (0: all)
-> keep the smallest set of those whose probability (renormalised over the
top-k) reaches ``top_p`` (the most likely token is always kept). Ties at a
threshold are all kept.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampling: ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 disable
    their filters (``top_p`` 0 keeps the most likely token alone, as in transformers and OpenAI's API);
    generation stops after ``max_new_tokens`` or on any of ``stop_tokens``
    (the stop token is kept in the output)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 32
    stop_tokens: tuple[int, ...] = ()

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise ValueError naming the bad field; return self."""
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature={t!r} must be a finite number >= 0")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 0 (0 disables it)")
        p = self.top_p
        if not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"top_p={p!r} must be in [0, 1] (0 keeps the most likely token alone)")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed={self.seed!r} must be an int in [0, 2**32)")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an int >= 1")
        for s in self.stop_tokens:
            if not isinstance(s, int) or s < 0 or (vocab_size is not None and s >= vocab_size):
                raise ValueError(f"stop_tokens={self.stop_tokens!r}: {s!r} is not a token id in [0, {vocab_size})")
        return self


class RowSampling(NamedTuple):
    """The sampling of a batch's rows as arrays ``[B]`` (a pytree, traced by the jitted steps): ``seeds``
    uint32, ``temperature`` float32, ``top_k`` int32, ``top_p`` float32."""

    seeds: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> RowSampling:
        """The rows of ``params``, one request each."""
        return cls(seeds=jnp.asarray([p.seed for p in params], jnp.uint32),
                   temperature=jnp.asarray([p.temperature for p in params], jnp.float32),
                   top_k=jnp.asarray([p.top_k for p in params], jnp.int32),
                   top_p=jnp.asarray([p.top_p for p in params], jnp.float32))

    def sample(self, logits, steps):
        """Token number ``steps [B]`` of each row from ``logits [B, V]`` (:func:`sample` with the rows' keys)."""
        return sample(logits, request_keys(self.seeds, steps), self.temperature, self.top_k, self.top_p)


def request_keys(seeds, steps):
    """Keys ``[B]`` for token number ``steps[b]`` of the request seeded ``seeds[b]``."""
    seeds = jnp.asarray(seeds, jnp.uint32)
    steps = jnp.asarray(steps, jnp.int32)
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, steps)


def filter_logits(logits, temperature, top_k, top_p):
    """``logits [B, V]`` -> fp32 logits scaled by temperature with filtered tokens at ``-inf``."""
    B, V = logits.shape
    t = jnp.asarray(temperature, jnp.float32)
    x = logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)[:, None]
    desc = -jnp.sort(-x, axis=-1)  # [B, V]
    top_k = jnp.asarray(top_k, jnp.int32)
    k = jnp.where((top_k <= 0) | (top_k > V), V, top_k)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
    rank = jnp.arange(V, dtype=jnp.int32)[None, :]
    desc = jnp.where(rank < k[:, None], desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    top_p = jnp.asarray(top_p, jnp.float32)[:, None]
    n_keep = jnp.sum((before < top_p) | (top_p >= 1.0), axis=-1)
    n_keep = jnp.clip(jnp.minimum(n_keep, k), 1, V)
    pth = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
    return jnp.where((x >= kth) & (x >= pth), x, -jnp.inf)


def sample(logits, keys, temperature, top_k, top_p):
    """Next tokens ``int32 [B]`` from ``logits [B, V]`` with per-row keys and parameters."""
    if logits.ndim != 2:
        raise ValueError(f"sample expects logits [B, V]; got {logits.shape=}")
    B = logits.shape[0]
    for name, a in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if jnp.shape(a) != (B,):
            raise ValueError(f"{name}.shape={jnp.shape(a)} must be [B]=({B},)")
    if keys.shape != (B,):
        raise ValueError(f"keys.shape={keys.shape} must be [B]=({B},) typed keys")
    temperature = jnp.asarray(temperature, jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        x = filter_logits(logits, temperature, top_k, top_p)
        drawn = jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    # an all-greedy batch skips the sort and the random draws
    return jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy, None)
