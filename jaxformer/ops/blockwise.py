"""Memory-efficient attention in plain JAX: O(T) memory forward and backward.

``blockwise_attention(q [B,T,N,H], k [B,S,K,H], v) -> [B,T,N,H]``, same meaning
and logit order as :func:`jaxformer.ops.attention.xla_attention`.

Queries are cut into blocks of ``block_q``; each q block runs an online softmax
(fp32) over kv blocks of ``block_k`` and keeps only its output and row
log-sum-exp. The ``custom_vjp`` backward recomputes every logits tile from
``q``, ``k`` and the log-sum-exp, so no ``[T, S]`` matrix exists in either pass;
peak extra memory is one ``[B, N, block_q, block_k]`` tile plus O(T + S) rows.

Skipping: with a static ``q_offset`` the kv loop of q block ``i`` runs only over
the live blocks of ``MaskSpec.block_map`` (first to last live one), so blocks
above the causal diagonal or outside the window are never computed. With a
traced ``q_offset`` (a prefill chunk over a KV cache) the range is computed in
the graph from the block's first and last query positions and ``kv_lengths``.
Each tile evaluates the mask rule (``pallas_kernels.mask``) that
:meth:`MaskSpec.dense` evaluates on the whole matrix.

GQA/MQA contract ``BTKGH,BSKH`` directly; K/V are never repeated. ALiBi slopes,
segment ids, lengths and offsets get zero cotangents.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.ops.masks import MaskSpec
from jaxformer.typing import AttnOut, KeyValue, Query, Slopes
from pallas_kernels.shapes import check_qkv, check_slopes, pad_axis
from pallas_kernels.mask import mask_rule
from pallas_kernels.schedule import band_first, band_last

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Cfg:
    T: int
    S: int
    bq: int
    bk: int
    scale: float
    softcap: float | None
    kv_lo: tuple[int, ...] | None  # per q block, static; None: computed in the graph (_kv_range)
    kv_hi: tuple[int, ...] | None

    @property
    def nq(self) -> int:
        return -(-self.T // self.bq)

    @property
    def nk(self) -> int:
        return -(-self.S // self.bk)


class _MaskOperands(NamedTuple):
    """Padded per-position mask operands: q positions ``[B|1, Tp]``, q and kv segment ids, kv lengths."""

    q_pos: jax.Array
    q_seg: jax.Array | None
    kv_seg: jax.Array | None
    lengths: jax.Array | None


class _QBlock(NamedTuple):
    """One q block: its queries ``[B, bq, K, G, H]``, positions ``[B|1, bq]`` and segment ids (or None)."""

    q: jax.Array
    pos: jax.Array
    seg: jax.Array | None


def _mask_operands(mask: MaskSpec, cfg: _Cfg) -> _MaskOperands:
    """Padded per-position operands: q positions ``[B|1, Tp]``, segment ids, lengths."""
    Tp = cfg.nq * cfg.bq
    qpos = mask.q_positions(cfg.T, cfg.S)[:, :1] + jnp.arange(Tp, dtype=jnp.int32)[None, :]
    kv_seg = mask.resolved_kv_segment_ids(cfg.T, cfg.S)
    q_seg = None if mask.q_segment_ids is None else pad_axis(jnp.asarray(mask.q_segment_ids), 1, Tp)
    kv_seg = None if kv_seg is None else pad_axis(jnp.asarray(kv_seg), 1, cfg.nk * cfg.bk)
    lengths = None if mask.kv_lengths is None else jnp.asarray(mask.kv_lengths, jnp.int32)
    return _MaskOperands(qpos, q_seg, kv_seg, lengths)


def _tile_allowed(mask: MaskSpec, cfg: _Cfg, qp, kp, qs, ks, lengths):
    """Bool ``[B|1, bq, bk]`` for q positions ``qp [B|1, bq]`` and key positions ``kp [bk]``.

    The mask rule of :meth:`MaskSpec.dense`, plus ``kp < S`` for the padding of the last kv block.
    """
    return mask_rule(qp[:, :, None], kp[None, None, :], causal=mask.causal, window=mask.window,
                     q_segment=None if qs is None else qs[:, :, None],
                     kv_segment=None if ks is None else ks[:, None, :],
                     kv_length=None if lengths is None else lengths[:, None, None], num_keys=cfg.S)


def _block(mask, cfg, slopes, qblock: _QBlock, kp_all, vp_all, ops: _MaskOperands, j):
    """Logits tile of q block ``qblock.q [B,bq,K,G,H]`` against kv block ``j`` of the padded ``kp_all``,
    ``vp_all``.

    Returns (masked fp32 logits ``[B,K,bq,G,bk]``, d logits / d qk, k block, v block). The tile keeps the
    queries' own ``(bq, G)`` order, so the logits product needs no transpose of its result: as
    ``[B,K,G,bq,bk]`` XLA's CPU backend transposed every tile in each pass over it (2.4x slower).
    """
    qb, qp, qs = qblock
    ks_all, lengths = ops.kv_seg, ops.lengths
    start = j * cfg.bk
    kb = jax.lax.dynamic_slice_in_dim(kp_all, start, cfg.bk, axis=1)
    vb = jax.lax.dynamic_slice_in_dim(vp_all, start, cfg.bk, axis=1)
    kpos = start + jnp.arange(cfg.bk, dtype=jnp.int32)
    s = jnp.einsum("BTKGH,BSKH->BKTGS", qb, kb, preferred_element_type=_F32) * cfg.scale
    dscale = cfg.scale
    if cfg.softcap is not None:
        t = jnp.tanh(s / cfg.softcap)
        s = cfg.softcap * t
        dscale = cfg.scale * (1.0 - t * t)
    if slopes is not None:
        dist = jnp.abs(qp[:, :, None] - kpos[None, None, :]).astype(_F32)  # [B|1, bq, bk]
        s = s - slopes[:, :, None, :, None] * dist[:, None, :, None, :]
    ks = None if ks_all is None else jax.lax.dynamic_slice_in_dim(ks_all, start, cfg.bk, axis=1)
    allowed = _tile_allowed(mask, cfg, qp, kpos, qs, ks, lengths)
    s = jnp.where(allowed[:, None, :, None, :], s, -jnp.inf)
    return s, dscale, kb, vb


def _kv_range(mask: MaskSpec, cfg: _Cfg, ops: _MaskOperands, i):
    """The kv blocks ``[lo, hi)`` q block ``i`` visits: from :meth:`MaskSpec.block_map` when the offset is
    static; with a traced offset, from the band of the block's first and last real query over every
    sequence, and the longest ``kv_lengths`` (a prefill chunk over a cache reads no block past its
    positions). Blocks left out hold no allowed key of the q block, so the result is the same."""
    if cfg.kv_lo is not None:
        return jnp.asarray(cfg.kv_lo, jnp.int32)[i], jnp.asarray(cfg.kv_hi, jnp.int32)[i]
    if cfg.nk == 1:  # nothing to skip; a static trip count lets XLA drop the loop (512 x 512 prefill: 1.3x)
        return 0, 1
    first_row = i * cfg.bq
    last_row = jnp.minimum(first_row + cfg.bq, cfg.T) - 1
    last = band_last(ops.q_pos[:, last_row], mask.causal, mask.window)  # [B|1] or None
    if ops.lengths is not None:
        last = ops.lengths - 1 if last is None else jnp.minimum(last, ops.lengths - 1)
    first = band_first(ops.q_pos[:, first_row], mask.window)
    if first is not None and last is not None:  # a sequence that sees nothing here (an idle row) holds no block
        first = jnp.where(jnp.maximum(first, 0) <= last, first, cfg.nk * cfg.bk)
    lo = 0 if first is None else jnp.clip(jnp.min(first) // cfg.bk, 0, cfg.nk)
    hi = cfg.nk if last is None else jnp.clip(jnp.max(last) // cfg.bk + 1, 0, cfg.nk)
    return lo, hi


def _q_slices(cfg, i, qg, qpos, q_seg) -> _QBlock:
    start = i * cfg.bq
    qb = jax.lax.dynamic_slice_in_dim(qg, start, cfg.bq, axis=1)
    qp = jax.lax.dynamic_slice_in_dim(qpos, start, cfg.bq, axis=1)
    qs = None if q_seg is None else jax.lax.dynamic_slice_in_dim(q_seg, start, cfg.bq, axis=1)
    return _QBlock(qb, qp, qs)


def _grouped(q, k, v, cfg: _Cfg):
    B, T, N, H = q.shape
    K = k.shape[2]
    qg = pad_axis(q, 1, cfg.nq * cfg.bq).reshape(B, cfg.nq * cfg.bq, K, N // K, H)
    return qg, pad_axis(k, 1, cfg.nk * cfg.bk), pad_axis(v, 1, cfg.nk * cfg.bk)


def _forward(q, k, v, mask, slopes, cfg: _Cfg):
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    qg, kp, vp = _grouped(q, k, v, cfg)
    ops = _mask_operands(mask, cfg)

    def q_block(i):
        qblock = _q_slices(cfg, i, qg, ops.q_pos, ops.q_seg)

        def body(j, carry):
            acc, m, l = carry
            s, _, _, vb = _block(mask, cfg, slopes, qblock, kp, vp, ops, j)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(s - m_safe[..., None])
            l = alpha * l + jnp.sum(p, axis=-1)
            pv = jnp.einsum("BKTGS,BSKH->BKTGH", p.astype(vb.dtype), vb, preferred_element_type=_F32)
            return acc * alpha[..., None] + pv, m_new, l

        init = (jnp.zeros((B, K, cfg.bq, G, H), _F32), jnp.full((B, K, cfg.bq, G), -jnp.inf, _F32),
                jnp.zeros((B, K, cfg.bq, G), _F32))
        lo, hi = _kv_range(mask, cfg, ops, i)
        acc, m, l = jax.lax.fori_loop(lo, hi, body, init)
        empty = l == 0.0
        o = acc / jnp.where(empty, 1.0, l)[..., None]
        m_safe = jnp.where(m == -jnp.inf, 0.0, m)
        lse = jnp.where(empty, jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, l)))
        return o.astype(q.dtype), lse

    o, lse = jax.lax.map(q_block, jnp.arange(cfg.nq))  # [nq, B, K, bq, G, H], [nq, B, K, bq, G]
    o = jnp.transpose(o, (1, 0, 3, 2, 4, 5)).reshape(B, cfg.nq * cfg.bq, N, H)[:, :T]
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _blockwise(q, k, v, mask_leaves, slopes, cfg, mask_def):
    mask = jax.tree_util.tree_unflatten(mask_def, mask_leaves)
    return _forward(q, k, v, mask, slopes, cfg)[0]


def _blockwise_fwd(q, k, v, mask_leaves, slopes, cfg, mask_def):
    mask = jax.tree_util.tree_unflatten(mask_def, mask_leaves)
    o, lse = _forward(q, k, v, mask, slopes, cfg)
    return o, (q, k, v, mask_leaves, slopes, o, lse)


def _blockwise_bwd(cfg, mask_def, res, do):
    q, k, v, mask_leaves, slopes, o, lse = res
    mask = jax.tree_util.tree_unflatten(mask_def, mask_leaves)
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    Tp = cfg.nq * cfg.bq
    qg, kp, vp = _grouped(q, k, v, cfg)
    ops = _mask_operands(mask, cfg)
    dog = pad_axis(do.astype(q.dtype), 1, Tp).reshape(B, Tp, K, G, H)
    delta = jnp.einsum("BTNH,BTNH->BTN", do.astype(_F32), o.astype(_F32))
    delta = jnp.transpose(pad_axis(delta, 1, Tp).reshape(B, cfg.nq, cfg.bq, K, G), (1, 0, 3, 2, 4))

    def q_block(i, carry):
        dq, dk, dv = carry
        qblock = _q_slices(cfg, i, qg, ops.q_pos, ops.q_seg)
        qb = qblock.q
        dob = jax.lax.dynamic_slice_in_dim(dog, i * cfg.bq, cfg.bq, axis=1)
        lse_i = lse[i][..., None]
        delta_i = delta[i][..., None]

        def body(j, c):
            dq_i, dk, dv = c
            s, dscale, kb, vb = _block(mask, cfg, slopes, qblock, kp, vp, ops, j)
            p = jnp.exp(s - lse_i)
            dv_j = jnp.einsum("BKTGS,BTKGH->BSKH", p.astype(dob.dtype), dob, preferred_element_type=_F32)
            dp = jnp.einsum("BTKGH,BSKH->BKTGS", dob, vb, preferred_element_type=_F32)
            ds = p * (dp - delta_i) * dscale
            dq_i = dq_i + jnp.einsum("BKTGS,BSKH->BTKGH", ds, kb.astype(_F32))
            dk_j = jnp.einsum("BKTGS,BTKGH->BSKH", ds, qb.astype(_F32))
            start = j * cfg.bk
            dk = jax.lax.dynamic_update_slice_in_dim(
                dk, jax.lax.dynamic_slice_in_dim(dk, start, cfg.bk, axis=1) + dk_j, start, axis=1)
            dv = jax.lax.dynamic_update_slice_in_dim(
                dv, jax.lax.dynamic_slice_in_dim(dv, start, cfg.bk, axis=1) + dv_j, start, axis=1)
            return dq_i, dk, dv

        lo, hi = _kv_range(mask, cfg, ops, i)
        dq_i, dk, dv = jax.lax.fori_loop(lo, hi, body, (jnp.zeros(qb.shape, _F32), dk, dv))
        dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_i.astype(q.dtype), i * cfg.bq, axis=1)
        return dq, dk, dv

    init = (jnp.zeros(qg.shape, q.dtype), jnp.zeros(kp.shape, _F32), jnp.zeros(vp.shape, _F32))
    dq, dk, dv = jax.lax.fori_loop(0, cfg.nq, q_block, init)
    return (dq.reshape(B, Tp, N, H)[:, :T], dk[:, :cfg.S].astype(k.dtype), dv[:, :cfg.S].astype(v.dtype),
            tuple(None for _ in mask_leaves), None if slopes is None else jnp.zeros_like(slopes))


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_attention(q: Query, k: KeyValue, v: KeyValue, *, mask: MaskSpec | None = None,
                        scale: float | None = None, alibi_slopes: Slopes | None = None,
                        softcap: float | None = None, block_k: int = 512, block_q: int | None = None) -> AttnOut:
    """Attention ``q [B,T,N,H], k, v [B,S,K,H] -> [B,T,N,H]`` with O(T) memory (see the module docstring).

    Args:
      mask: a :class:`MaskSpec`; ``q_offset`` may be an int or a traced int array ``[B]`` / ``()``.
      scale: default ``1/sqrt(H)``. alibi_slopes: ``[N]`` or ``[B, N]``. softcap: logit soft-capping.
      block_k: kv tile; block_q: q tile (None: ``min(block_k, 256)``). Both are clipped to S and T.
    """
    B, T, S, N, K, H = check_qkv(q, k, v)
    mask = MaskSpec() if mask is None else mask
    if not isinstance(mask, MaskSpec):
        raise ValueError(f"mask must be a MaskSpec, got {type(mask).__name__}")
    mask.validate(B, T, S, N)
    if mask.has_pattern:
        raise ValueError("blockwise_attention does not handle MaskSpec.global_tokens / random_blocks; "
                         "use jaxformer.ops.sparse.sparse_attention or xla_attention")
    for name, b in (("block_k", block_k), ("block_q", block_q)):
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b <= 0):
            raise ValueError(f"{name}={b!r} must be a positive int")
    bk = min(int(block_k), S)
    bq = min(int(min(block_k, 256) if block_q is None else block_q), T)
    live = mask.block_map(T, S, bq, bk)
    kv_lo = kv_hi = None
    if live is not None:
        any_live = live.any(axis=1)
        kv_lo = tuple(int(x) for x in np.where(any_live, live.argmax(axis=1), 0))
        kv_hi = tuple(int(x) for x in np.where(any_live, live.shape[1] - live[:, ::-1].argmax(axis=1), 0))
    cfg = _Cfg(T=T, S=S, bq=bq, bk=bk, scale=float(1.0 / math.sqrt(H) if scale is None else scale),
               softcap=None if softcap is None else float(softcap), kv_lo=kv_lo, kv_hi=kv_hi)
    slopes = check_slopes(alibi_slopes, B, N)
    if slopes is not None:
        slopes = slopes.reshape(slopes.shape[0], K, N // K)
    mask_leaves, mask_def = jax.tree_util.tree_flatten(mask)
    return _blockwise(q, k, v, tuple(mask_leaves), slopes, cfg, mask_def)
