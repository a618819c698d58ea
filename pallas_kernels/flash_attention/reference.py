"""Plain-einsum attention with ``flash_attention``'s arguments: the oracle the kernels are tested against.

Written from the definitions alone: it shares no tile or mask helper with the
kernels, not even the mask rule every attention path evaluates
(``pallas_kernels.mask.mask_rule``), since an oracle that called the code under
test would agree with any bug in it. It builds the whole ``[B, N, T, S]`` logits matrix, so it is for
tests and small shapes only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.typing import AttnOut, KeyValue, KvSegmentIds, Lengths, Query, RowLse, SegmentIds, Slopes


def reference(q: Query, k: KeyValue, v: KeyValue, *, causal: bool = False,
              window: tuple[int | None, int | None] | None = None, q_segment_ids: SegmentIds | None = None,
              kv_segment_ids: KvSegmentIds | None = None, kv_lengths: Lengths | None = None,
              q_offset: int | None = None, alibi_slopes: Slopes | None = None, softcap: float | None = None,
              scale: float | None = None, block_sizes=None, backend=None, interpret=None,
              return_lse: bool = False) -> AttnOut | tuple[AttnOut, RowLse]:
    """Dense attention ``q [B,T,N,H], k, v [B,S,K,H] -> [B,T,N,H]`` (fp32 math, output in q.dtype).

    ``block_sizes``, ``backend`` and ``interpret`` are accepted and ignored so the
    call matches ``flash_attention``. With ``return_lse`` also returns the row
    log-sum-exp ``[B, N, T]`` (``+inf`` for rows with no allowed key).
    """
    del block_sizes, backend, interpret
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    offset = S - T if q_offset is None else q_offset

    qf = q.astype(jnp.float32).reshape(B, T, K, G, H)
    s = jnp.einsum("BTKGH,BSKH->BKGTS", qf, k.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST).reshape(B, N, T, S) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)

    qpos = (jnp.arange(T) + offset)[:, None]
    kpos = jnp.arange(S)[None, :]
    if alibi_slopes is not None:
        slopes = jnp.asarray(alibi_slopes, jnp.float32).reshape(-1, N)  # [1|B, N]
        s = s - slopes[:, :, None, None] * jnp.abs(qpos - kpos).astype(jnp.float32)[None, None]

    ok = jnp.ones((1, 1, T, S), bool)
    if causal:
        ok = ok & (kpos <= qpos)[None, None]
    if window is not None:
        left, right = window
        if left is not None:
            ok = ok & (kpos >= qpos - left)[None, None]
        if right is not None:
            ok = ok & (kpos <= qpos + right)[None, None]
    if q_segment_ids is not None:
        ok = ok & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    if kv_lengths is not None:
        ok = ok & (kpos[None, None] < jnp.asarray(kv_lengths)[:, None, None, None])

    # The row max is a constant (softmax ignores the shift) and masked logits are replaced before
    # exp and zeroed after it: exp never sees -inf, so gradients are finite by construction.
    ok = jnp.broadcast_to(ok, s.shape)
    row_max = jnp.max(jnp.where(ok, s, -jnp.inf), axis=-1, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isinf(row_max), 0.0, row_max))
    e = jnp.where(ok, jnp.exp(jnp.where(ok, s - row_max, 0.0)), 0.0)
    z = jnp.sum(e, axis=-1, keepdims=True)
    w = e / jnp.where(z > 0, z, 1.0)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", w.reshape(B, K, G, T, S), v.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST).reshape(B, T, N, H).astype(q.dtype)
    if not return_lse:
        return out
    lse = jnp.where(z[..., 0] > 0, row_max[..., 0] + jnp.log(jnp.where(z[..., 0] > 0, z[..., 0], 1.0)), jnp.inf)
    return out, lse
