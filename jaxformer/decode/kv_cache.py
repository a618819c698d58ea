"""Contiguous KV cache: per layer ``k, v [B, S, K, H]`` plus ``lengths [B]``, a pytree.

Implements the model's cache hook (:class:`jaxformer.nn.attention.KVCacheLayer`):
``attend(q [B,T,N,H], k, v [B,T,K,H])`` writes the ``T`` new keys/values of
sequence ``b`` at rows ``lengths[b] .. lengths[b]+T-1`` (``dynamic_update_slice``)
and attends with ``MaskSpec(causal=True, q_offset=lengths, kv_lengths=lengths+T)``.
Rows past a sequence's length may hold stale values; the mask hides them, and a
right-padded chunk is handled by resetting ``lengths`` afterwards
(:func:`set_lengths`). The caller keeps ``lengths + T <= S``.

``window`` W (static; a sliding-window model, ``ModelConfig.sparsity.causal_window``): each query
also sees only itself and the W - 1 keys before it, ``MaskSpec(window=(W - 1, 0))``. The
storage stays ``S`` rows (no ring buffer): the window changes the mask, not the memory.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxformer.ops.attention import dot_product_attention
from jaxformer.ops.masks import MaskSpec


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """One layer's cache: ``k, v [B, S, K, H]``, ``lengths int32 [B]`` (tokens already cached),
    ``window`` (static int or None: the sliding window, see the module docstring)."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    window: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self):
        w = self.window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"KVCache.window={w!r} must be an int >= 1 or None")

    @classmethod
    def zeros(cls, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype=jnp.float32, *,
              window: int | None = None) -> KVCache:
        shape = (batch, max_len, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32), window)

    @property
    def max_len(self) -> int:
        return self.k.shape[1]

    def attend(self, q, k, v, *, scale, alibi_slopes=None, softcap=None, impl="auto"):
        """Write ``k, v [B, T, K, H]`` after each sequence's cached tokens, attend ``q [B, T, N, H]``."""
        B, T = q.shape[:2]
        if k.shape[0] != B or k.shape[1] != T or k.shape[2:] != self.k.shape[2:] or v.shape != k.shape:
            raise ValueError(f"new {k.shape=} {v.shape=} do not fit {q.shape=} and cache {self.k.shape=}")
        if T > self.max_len:
            raise ValueError(f"{T} new tokens do not fit a cache of max_len={self.max_len}")
        write = jax.vmap(lambda c, x, i: jax.lax.dynamic_update_slice_in_dim(c, x, i, axis=0))
        ck = write(self.k, k.astype(self.k.dtype), self.lengths)
        cv = write(self.v, v.astype(self.v.dtype), self.lengths)
        band = None if self.window is None else (self.window - 1, 0)
        mask = MaskSpec(causal=True, window=band, q_offset=self.lengths, kv_lengths=self.lengths + T)
        out = dot_product_attention(q, ck, cv, mask=mask, scale=scale, alibi_slopes=alibi_slopes,
                                    softcap=softcap, impl=impl)
        return out, KVCache(ck, cv, self.lengths + T, self.window)


def init_caches(config, batch: int, max_len: int, dtype=None) -> list[KVCache]:
    """One empty :class:`KVCache` per decoder layer of a ``ModelConfig`` (``window``: its
    ``sparsity.causal_window``)."""
    if config.kind != "decoder":
        raise ValueError(f"KV-cached decoding needs a decoder-only model; got config.kind={config.kind!r}")
    dtype = jnp.dtype(config.compute_dtype if dtype is None else dtype)
    return [KVCache.zeros(batch, max_len, config.resolved_kv_heads, config.resolved_head_dim, dtype,
                          window=config.sparsity.causal_window)
            for _ in range(config.n_decoder_layers)]


def set_lengths(caches, lengths):
    """The same caches with ``lengths [B]`` replaced (e.g. the true prompt lengths after a padded prefill)."""
    lengths = jnp.asarray(lengths, jnp.int32)
    return [dataclasses.replace(c, lengths=lengths) for c in caches]
