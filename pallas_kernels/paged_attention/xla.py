"""Paged-attention decode in plain JAX, in the form XLA's CPU backend runs fastest at long contexts.

The same meaning as :func:`pallas_kernels.paged_attention.reference.paged_attention_reference` (see its module),
computed differently: the pages are gathered as whole ``[L*H]`` rows with in-bounds indices (the table clamped
into the pool first), into ``[B, K, S, H]``, and the logits are computed ``[B, K, S, G]`` with the keys as the
product's rows, then swapped to ``[B, K, G, S]`` behind an optimisation barrier; from the logits on (softcap,
ALiBi, mask, softmax) it is the reference's :func:`decode_weights`. The reference's gather of
``pages[:, tables]`` is fused by XLA into a bounds-checked loop that also transposes the keys for the logits'
product, at 2-3 GB/s. On 2 Intel Xeon cores (SmolLM2-135M's shape, ``experiments/results/decode_cpu.md``) a
batch-1 decode step at 4,096 cached tokens takes 72-86 ms this way against 114-133 ms; at 64 cached tokens
it is ~4% slower, and at 16 sequences of 80 3-7% slower: so ``paged_attention(backend="auto")`` takes it on
the CPU from ``XLA_MIN_POSITIONS`` table positions on, and the reference below that.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Shaped

from pallas_kernels.paged_attention.reference import check_decode_inputs, decode_weights
from pallas_kernels.typing import ArrayLike, BlockTables, DecodeOut, DecodeQuery, Lengths, Pages, Slopes

XLA_MIN_POSITIONS = 1024
"""Table positions (``M * L``) from which ``backend="auto"`` on the CPU takes :func:`paged_attention_xla`."""


def gather_rows(pages: Shaped[ArrayLike, "K P L H"], block_tables: BlockTables) -> Shaped[Array, "B K M*L H"]:
    """``[K, P, L, H]`` pages and ``[B, M]`` tables -> ``[B, K, M*L, H]``, as one gather of whole ``[L*H]`` rows.

    The table's entries are clamped into ``[0, P)`` and the gather then promises in-bounds indices (entries past
    a sequence's pages may hold anything; those inside its length must be page ids in ``[0, P)``, as for every
    backend): XLA's CPU backend copies rows for it at ~4x the speed of the bounds-checked gather
    ``pages[:, block_tables]`` fused into its consumer (``experiments/results/decode_cpu.md``).
    """
    K, P, L, H = pages.shape
    B, M = block_tables.shape
    rows = (jnp.arange(K, dtype=jnp.int32)[None, :, None] * P
            + jnp.clip(jnp.asarray(block_tables, jnp.int32), 0, P - 1)[:, None, :])  # [B, K, M]
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
    g = jax.lax.gather(jnp.asarray(pages).reshape(K * P, L * H), rows.reshape(B * K * M, 1), dims, (1, L * H),
                       mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    return g.reshape(B, K, M * L, H)


def paged_attention_xla(q: DecodeQuery, k_pages: Pages, v_pages: Pages, block_tables: BlockTables, lengths: Lengths,
                        *, scale: float | None = None, alibi_slopes: Slopes | None = None,
                        softcap: float | None = None, window: int | None = None) -> DecodeOut:
    """``q [B, N, H]`` against paged ``k_pages, v_pages [K, P, L, H]`` -> ``[B, N, H]``: the reference's result
    (arguments as there), for the CPU at long contexts."""
    check_decode_inputs(q, k_pages, v_pages, block_tables, lengths, alibi_slopes, window, softcap)
    B, N, H = q.shape
    K = k_pages.shape[0]
    G = N // K
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    k = gather_rows(k_pages, block_tables)  # [B, K, S, H]: the pages of each sequence, in table order
    v = gather_rows(v_pages, block_tables)
    # logits computed [B, K, S, G], the gathered keys as the product's rows as they lie (computed [B, K, G, S],
    # XLA's CPU backend transposes the keys, a copy dearer than the attention), then laid out [B, K, G, S]
    s = jnp.einsum("BKSH,BKGH->BKSG", k, q.reshape(B, K, G, H), preferred_element_type=jnp.float32)
    s = jnp.swapaxes(jax.lax.optimization_barrier(s), 2, 3) * jnp.float32(scale)  # the barrier: XLA would fold
    # the swap into the product, back to the transposed keys
    w = decode_weights(s, lengths, alibi_slopes=alibi_slopes, softcap=softcap, window=window)
    out = jnp.einsum("BKGS,BKSH->BKGH", w.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, N, H).astype(q.dtype)
