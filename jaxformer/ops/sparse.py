"""Block-sparse attention in plain JAX for Longformer / BigBird masks: O(T·w) time and memory.

``sparse_attention(q [B,T,N,H], k [B,S,K,H], v [B,S,K,H]) -> [B,T,N,H]`` has the
meaning and logit order of :func:`jaxformer.ops.attention.xla_attention` under
the same :class:`MaskSpec`; only the work differs.

1. Plan (static numpy): ``MaskSpec.block_map(T, S, b, b, per_head=True,
   global_rows=False)`` gives, per q block of ``b`` queries, the kv blocks the
   band, the global key columns and the random blocks need; each q block's list
   is padded to the common width ``w`` with a sentinel block lying past ``S``.
2. Blocked part: gather those kv blocks (``k, v -> [B, K, Q, W, H]``, or one
   list per query head for per-head random blocks; ``Q`` q blocks of ``C = b``
   queries, ``W = w·C`` keys gathered per q block), form the logits
   ``[B, K, G, Q, C, W]`` and evaluate the mask rule (``pallas_kernels.mask``) of
   :meth:`MaskSpec.dense_heads` on the gathered positions.
3. Global query rows (a query that sees every key) would make their block dense,
   so queries global in every sequence are left out of the plan; every global
   query row (``E`` of them) is computed over all ``S`` keys (``O(E·S)``) and
   written over the blocked result (:func:`global_query_rows`, reusable by other
   block-sparse paths).

No ``[T, S]`` matrix exists; peak memory is ``O(B·N·T·W + B·N·E·S)``.
Gradients come from autodiff: the gathers transpose to scatter-adds the size
of ``k`` and ``v``. Fully masked rows give zeros and zero gradients.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Float

from jaxformer.ops.masks import MaskSpec, masked_softmax
from jaxformer.typing import ArrayLike, AttnOut, KeyValue, Query, Slopes
from pallas_kernels.shapes import check_qkv, check_slopes
from pallas_kernels.mask import mask_rule
from pallas_kernels.schedule import block_lists

DEFAULT_BLOCK_SIZE = 64


def sparse_attention(q: Query, k: KeyValue, v: KeyValue, *, mask: MaskSpec | None = None,
                     scale: float | None = None, alibi_slopes: Slopes | None = None,
                     softcap: float | None = None, block_size: int | None = None) -> AttnOut:
    """Attention visiting only the kv blocks the mask needs (see the module docstring).

    Args:
      q: ``[B, T, N, H]``; k, v: ``[B, S, K, H]`` with ``N % K == 0``.
      mask: a :class:`MaskSpec` with a static ``q_offset`` (int or None).
      scale: logits scale, default ``1/sqrt(H)``. alibi_slopes: ``[N]`` or ``[B, N]``. softcap: logit cap.
      block_size: q and kv block size; default ``random_blocks.block_size`` if set, else 64.
    """
    B, T, S, N, K, H = check_qkv(q, k, v)
    mask = MaskSpec() if mask is None else mask
    if not isinstance(mask, MaskSpec):
        raise ValueError(f"mask must be a MaskSpec, got {type(mask).__name__}")
    mask.validate(B, T, S, N)
    offset = mask.static_offset(T, S)
    if offset is None:
        raise ValueError(f"sparse_attention needs a static q_offset (a Python int or None); got an array of "
                         f"shape {np.shape(mask.q_offset)}: use impl='blockwise' or 'xla'")
    if block_size is None:
        block_size = DEFAULT_BLOCK_SIZE if mask.random_blocks is None else mask.random_blocks.block_size
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size <= 0:
        raise ValueError(f"block_size={block_size!r} must be a positive int")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap!r} must be positive or None")
    bs = int(block_size)
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    slopes = check_slopes(alibi_slopes, B, N)

    live = mask.block_map(T, S, bs, bs, per_head=True, global_rows=False)
    idx, _ = block_lists(live, pad=live.shape[-1])
    out = _blocked(q, k, v, mask, slopes, BlockedPlan(idx, bs, offset, scale, softcap))
    if mask.global_tokens is not None and mask.patterns_active:
        out = _global_rows(out, (q, k, v), mask, slopes, offset, (scale, softcap))
    return out


def _logits(s, scale, softcap):
    s = s * jnp.asarray(scale, jnp.float32)
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    return s


def _pad_axis1(x, n: int, value=0):
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, n - x.shape[1])
    return jnp.pad(x, pad, constant_values=value)


@dataclasses.dataclass(frozen=True)
class BlockedPlan:
    """The static part of :func:`_blocked`: which kv blocks each q block visits, and the logit transform.

    idx: ``[Nh, nq, w]`` kv block ids per head (``Nh`` = 1 or N) and q block, padded with the
    sentinel block ``ceil(S / block_size)``. block_size: the q and kv block size. offset: the
    absolute position of query 0. scale, softcap: as in :func:`_logits`.
    """

    idx: np.ndarray
    block_size: int
    offset: int
    scale: float
    softcap: float | None


def _blocked(q, k, v, mask: MaskSpec, slopes, plan: BlockedPlan):
    idx, bs = plan.idx, plan.block_size
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    Nh, nq, w = idx.shape
    nk = -(-S // bs)
    W = w * bs
    Kh, Gh = (1, 1) if Nh == 1 else (K, G)

    qb = _pad_axis1(q, nq * bs).reshape(B, nq, bs, K, G, H)
    kb = _pad_axis1(k, (nk + 1) * bs).reshape(B, nk + 1, bs, K, H).transpose(0, 3, 1, 2, 4)
    vb = _pad_axis1(v, (nk + 1) * bs).reshape(B, nk + 1, bs, K, H).transpose(0, 3, 1, 2, 4)
    if Nh == 1:
        kg = kb[:, :, idx[0]].reshape(B, K, nq, W, H)
        vg = vb[:, :, idx[0]].reshape(B, K, nq, W, H)
        s = jnp.einsum("BQCKGH,BKQWH->BKGQCW", qb, kg, preferred_element_type=jnp.float32)
    else:
        kh = np.arange(K)[:, None, None, None]
        idx_kg = idx.reshape(K, G, nq, w)
        kg = kb[:, kh, idx_kg].reshape(B, K, G, nq, W, H)
        vg = vb[:, kh, idx_kg].reshape(B, K, G, nq, W, H)
        s = jnp.einsum("BQCKGH,BKGQWH->BKGQCW", qb, kg, preferred_element_type=jnp.float32)
    s = _logits(s, plan.scale, plan.softcap)

    kpos_np = (idx[..., None] * bs + np.arange(bs)).reshape(1, Kh, Gh, nq, 1, W)
    qpos_np = (plan.offset + np.arange(nq * bs)).reshape(1, 1, 1, nq, bs, 1)
    kpos, qpos = jnp.asarray(kpos_np, jnp.int32), jnp.asarray(qpos_np, jnp.int32)
    if slopes is not None:
        dist = jnp.abs(qpos - kpos).astype(jnp.float32)
        s = s - slopes.reshape(-1, K, G, 1, 1, 1) * dist
    allowed = _blocked_allowed(mask, qpos_np, kpos_np, plan, T, S)
    wts = masked_softmax(s, allowed).astype(v.dtype)
    if Nh == 1:
        out = jnp.einsum("BKGQCW,BKQWH->BQCKGH", wts, vg, preferred_element_type=jnp.float32)
    else:
        out = jnp.einsum("BKGQCW,BKGQWH->BQCKGH", wts, vg, preferred_element_type=jnp.float32)
    return out.reshape(B, nq * bs, N, H)[:, :T].astype(q.dtype)


def _blocked_allowed(mask: MaskSpec, qpos_np, kpos_np, plan: BlockedPlan, T: int, S: int):
    """Bool ``[B|1, Kh, Gh, nq, bs, W]``: the mask rule of :meth:`MaskSpec.dense_heads` on the gathered keys
    (at the query and key positions ``qpos_np``, ``kpos_np`` of :func:`_blocked`).

    The rule's ``q_global`` term is left out: :func:`_global_rows` writes over every global query row.
    """
    idx, bs = plan.idx, plan.block_size
    kpos, qpos = jnp.asarray(kpos_np, jnp.int32), jnp.asarray(qpos_np, jnp.int32)
    qseg = kseg = None
    if mask.q_segment_ids is not None:
        B = np.shape(mask.q_segment_ids)[0]
        nq = qpos_np.shape[3]
        qseg = _pad_axis1(jnp.asarray(mask.q_segment_ids), nq * bs).reshape(B, 1, 1, nq, bs, 1)
        kseg = _pad_axis1(jnp.asarray(mask.resolved_kv_segment_ids(T, S)), (S // bs + 2) * bs)
        kseg = jnp.take(kseg, kpos.reshape(-1), axis=1).reshape((B,) + kpos.shape[1:])
    random = None
    if mask.patterns_active and mask.random_blocks is not None:
        random = _random_allowed(mask, qpos_np, kpos_np, idx, bs, S)
    return mask_rule(qpos, kpos, causal=mask.causal, window=mask.window, q_segment=qseg, kv_segment=kseg,
                     kv_length=None if mask.kv_lengths is None else
                     jnp.asarray(mask.kv_lengths, jnp.int32).reshape(-1, 1, 1, 1, 1, 1),
                     num_keys=S, kv_global=mask.is_global(kpos), random=random)


def _random_allowed(mask: MaskSpec, qpos_np, kpos_np, idx, bs: int, S: int):
    """Random-block part of the band on the gathered keys: bool ``[1, Kh, Gh, nq, bs|1, W]``."""
    R = mask.random_blocks.block_size
    rq = qpos_np // R
    lo, hi = int(rq.min()), int(rq.max()) + 1
    nkr = -(-S // R)
    member = mask.random_blocks.membership(lo, hi, nkr)  # [Nh, nrb, nkr]
    Kh, Gh = kpos_np.shape[1:3]
    rq = rq - lo
    rk = np.minimum(kpos_np // R, nkr - 1)
    heads = np.arange(member.shape[0]).reshape(1, Kh, Gh, 1, 1, 1)
    nq, w = idx.shape[1:]
    q_uniform = (rq == rq[..., :1, :]).all()
    rk_slots = rk.reshape(1, Kh, Gh, nq, 1, w, bs)
    if q_uniform and (rk_slots == rk_slots[..., :1]).all():
        small = member[heads[..., None], rq[..., :1, :, None], rk_slots[..., :1]]  # [1, Kh, Gh, nq, 1, w, 1]
        return jnp.asarray(np.repeat(small, bs, axis=-1).reshape(1, Kh, Gh, nq, 1, w * bs))
    table = jnp.asarray(member)
    return table[jnp.asarray(heads), jnp.asarray(rq, jnp.int32), jnp.asarray(rk, jnp.int32)]


def global_query_rows(out: Float[ArrayLike, "B T N H"], q: Query, k: KeyValue, v: KeyValue, *, mask: MaskSpec,
                      scale: float | None = None, alibi_slopes: Slopes | None = None,
                      softcap: float | None = None) -> AttnOut:
    """Write over ``out [B,T,N,H]`` the rows of ``mask``'s global queries, each attending to all keys (O(E·S)).

    For block-sparse paths that leave global query rows out of their block lists
    (``block_map(..., global_rows=False)``). Needs a static ``q_offset``.
    """
    B, T, S, N, K, H = check_qkv(q, k, v)
    offset = mask.static_offset(T, S)
    if offset is None:
        raise ValueError("global_query_rows needs a static q_offset (a Python int or None)")
    if out.shape != q.shape:
        raise ValueError(f"out.shape={out.shape} must equal q.shape={q.shape}")
    if mask.global_tokens is None or not mask.patterns_active:
        return out
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    return _global_rows(out, (q, k, v), mask, check_slopes(alibi_slopes, B, N), offset, (scale, softcap))


def _global_rows(out, qkv, mask: MaskSpec, slopes, offset: int, logit: tuple[float, float | None]):
    """:func:`global_query_rows` of checked inputs: ``qkv`` the ``(q, k, v)`` triple, ``logit`` the
    ``(scale, softcap)`` of :func:`_logits`."""
    q, k, v = qkv
    scale, softcap = logit
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    g = mask.global_array  # [Bg, g]
    rows = g - offset
    valid = (g >= 0) & (rows >= 0) & (rows < T)
    keep = valid.any(axis=0)
    if not keep.any():
        return out
    rows, valid = rows[:, keep], valid[:, keep]
    ng = rows.shape[1]
    rows_in = np.broadcast_to(np.where(valid, rows, 0), (B, ng))
    bidx = np.arange(B)[:, None]
    qg = q[bidx, rows_in].reshape(B, ng, K, G, H)
    s = jnp.einsum("BEKGH,BSKH->BKGES", qg, k, preferred_element_type=jnp.float32)
    s = _logits(s, scale, softcap)
    qpos = jnp.asarray(offset + rows_in, jnp.int32).reshape(B, 1, 1, ng, 1)
    kpos = jnp.arange(S, dtype=jnp.int32).reshape(1, 1, 1, 1, S)
    if slopes is not None:
        s = s - slopes.reshape(-1, K, G, 1, 1) * jnp.abs(qpos - kpos).astype(jnp.float32)
    kv_seg = mask.resolved_kv_segment_ids(T, S)
    allowed = mask_rule(  # every row here is a global query: q_global=True opens its whole band
        qpos, kpos, causal=mask.causal, window=mask.window, q_global=True,
        q_segment=None if kv_seg is None else jnp.asarray(mask.q_segment_ids)[bidx, rows_in].reshape(B, 1, 1, ng, 1),
        kv_segment=None if kv_seg is None else jnp.asarray(kv_seg).reshape(B, 1, 1, 1, S),
        kv_length=None if mask.kv_lengths is None else
        jnp.asarray(mask.kv_lengths, jnp.int32).reshape(-1, 1, 1, 1, 1))
    wts = masked_softmax(s, allowed).astype(v.dtype)
    out_g = jnp.einsum("BKGES,BSKH->BEKGH", wts, v, preferred_element_type=jnp.float32)
    target = np.broadcast_to(np.where(valid, rows, T), (B, ng))
    return out.at[bidx, target].set(out_g.reshape(B, ng, N, H).astype(out.dtype), mode="drop")
