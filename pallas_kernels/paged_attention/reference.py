"""Paged-attention decode, plain JAX: gather the pages through the block table, then einsum.

The meaning every kernel in this package must match. One query token per
sequence, sitting at position ``lengths[b] - 1``; keys at positions
``0 .. lengths[b] - 1`` live in page ``block_tables[b, pos // L]`` at row
``pos % L``. Logit order: ``scale * q·k`` (fp32) -> ``softcap * tanh(s / softcap)``
-> ``- slope * (lengths[b] - 1 - pos)`` (ALiBi) -> mask ``pos < lengths[b]`` (and,
with a sliding ``window``, ``pos >= lengths[b] - window``: the query sees its last
``window`` keys) -> softmax. A sequence of length 0 gives a zero output.

Only distances enter the logits, so a table whose leading pages were dropped (the
sliding window's freed pages) is read as if its first page sat at position 0.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from pallas_kernels.typing import ArrayLike, BlockTables, DecodeOut, DecodeQuery, Lengths, Pages, Slopes


def gather_pages(pages: Shaped[ArrayLike, "K P L H"], block_tables: BlockTables) -> Shaped[Array, "B M*L K H"]:
    """``[K, P, L, H]`` pages and ``[B, M]`` tables -> contiguous ``[B, M*L, K, H]``."""
    K, _, L, H = pages.shape
    B, M = block_tables.shape
    g = pages[:, block_tables]  # [K, B, M, L, H]
    return jnp.transpose(g, (1, 2, 3, 0, 4)).reshape(B, M * L, K, H)


def decode_weights(s: Float[Array, "B K G S"], lengths: Lengths, *, alibi_slopes: Slopes | None = None,
                   softcap: float | None = None, window: int | None = None) -> Float[Array, "B K G S"]:
    """Scaled fp32 logits ``s [B, K, G, S]`` of each sequence's query (at position ``lengths[b] - 1``) against
    its positions ``0 .. S-1`` -> attention weights: softcap, ALiBi, the length (and window) mask, softmax, in
    the order of the module docstring. Rows with no visible key give zeros; gradients stay finite."""
    B, K, G, S = s.shape
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    pos = jnp.arange(S, dtype=jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    if alibi_slopes is not None:
        slopes = jnp.broadcast_to(jnp.asarray(alibi_slopes, jnp.float32), (B, K * G)).reshape(B, K, G, 1)
        dist = (lengths[:, None] - 1 - pos[None, :]).astype(jnp.float32)  # [B, S]
        s = s - slopes * dist[:, None, None, :]
    valid = pos[None, :] < lengths[:, None]  # [B, S]
    if window is not None:
        valid &= pos[None, :] >= lengths[:, None] - window
    # Row max as a constant, masked logits replaced before exp and zeroed after: finite gradients.
    ok = jnp.broadcast_to(valid[:, None, None, :], s.shape)
    m = jax.lax.stop_gradient(jnp.max(jnp.where(ok, s, -jnp.inf), axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(ok, jnp.exp(jnp.where(ok, s - m, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(denom == 0.0, 1.0, denom)


def check_decode_inputs(q, k_pages, v_pages, block_tables, lengths, alibi_slopes=None, window=None, softcap=None):
    """ValueError naming the shapes for inputs no paged-decode path accepts (every public entry point calls
    this at trace time: :func:`paged_attention`, the reference, the xla form)."""
    if q.ndim != 3 or k_pages.ndim != 4:
        raise ValueError(f"paged_attention expects q [B,N,H] and pages [K,P,L,H]; got {q.shape=} {k_pages.shape=}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages differ: {k_pages.shape=} {v_pages.shape=}")
    B, N, H = q.shape
    K, P, L, Hk = k_pages.shape
    if B == 0 or H == 0:
        raise ValueError(f"empty decode operands: {q.shape=} (a batch of at least one query of head dim >= 1)")
    if Hk != H:
        raise ValueError(f"head dim mismatch: {q.shape=} {k_pages.shape=}")
    if K == 0 or N % K:
        raise ValueError(f"{q.shape=} {k_pages.shape=}: heads {N} not divisible by kv heads {K}")
    if P == 0 or L == 0:
        raise ValueError(f"{k_pages.shape=}: the pool needs at least one page of at least one slot")
    if block_tables.ndim != 2 or block_tables.shape[0] != B or block_tables.shape[1] == 0:
        raise ValueError(f"block_tables must be [B, M] with B={B} and M >= 1; got {block_tables.shape=}")
    if jnp.shape(lengths) != (B,):
        raise ValueError(f"lengths must be [B]=({B},); got {jnp.shape(lengths)=}")
    lengths_dtype = jnp.asarray(lengths).dtype
    if not jnp.issubdtype(block_tables.dtype, jnp.integer) or not jnp.issubdtype(lengths_dtype, jnp.integer):
        raise ValueError(f"block_tables and lengths must be integer; got {block_tables.dtype=} {lengths_dtype=}")
    if alibi_slopes is not None and jnp.shape(alibi_slopes) not in ((N,), (B, N)):
        raise ValueError(f"alibi_slopes.shape={jnp.shape(alibi_slopes)} must be [N]=({N},) or [B, N]=({B}, {N})")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"window={window!r} must be None or a Python int >= 1 (keys each query sees)")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap} must be > 0")


def paged_attention_reference(q: DecodeQuery, k_pages: Pages, v_pages: Pages, block_tables: BlockTables,
                              lengths: Lengths, *, scale: float | None = None, alibi_slopes: Slopes | None = None,
                              softcap: float | None = None, window: int | None = None) -> DecodeOut:
    """``q [B, N, H]`` against paged ``k_pages, v_pages [K, P, L, H]`` -> ``[B, N, H]``.

    ``alibi_slopes``: ``[N]`` or ``[B, N]``; ``window``: None or an int >= 1 (keys seen).
    """
    check_decode_inputs(q, k_pages, v_pages, block_tables, lengths, alibi_slopes, window, softcap)
    B, N, H = q.shape
    K, _, L, _ = k_pages.shape
    M = block_tables.shape[1]
    G = N // K
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    k = k_pages[:, block_tables]  # [K, B, M, L, H]: the pages of each sequence, in table order
    v = v_pages[:, block_tables]
    S = M * L
    s = jnp.einsum("BKGH,KBMLH->BKGML", q.reshape(B, K, G, H), k,
                   preferred_element_type=jnp.float32).reshape(B, K, G, S) * jnp.float32(scale)
    w = decode_weights(s, lengths, alibi_slopes=alibi_slopes, softcap=softcap, window=window)
    out = jnp.einsum("BKGML,KBMLH->BKGH", w.reshape(B, K, G, M, L).astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(B, N, H).astype(q.dtype)
