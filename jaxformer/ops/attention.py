"""Scaled dot-product attention, pure, with backend dispatch.

``dot_product_attention(q [B,T,N,H], k [B,S,K,H], v [B,S,K,H]) -> [B,T,N,H]``.

Order of operations on the logits (every backend follows it):

1. ``s = scale * q·k`` with ``scale = 1/sqrt(H)`` by default, accumulated in fp32;
2. ``s = softcap * tanh(s / softcap)`` when ``softcap`` is given (Gemma-2 style);
3. ``s += bias`` and ``s -= slope_n * |q_pos - k_pos|`` for ALiBi slopes;
4. masked entries (``MaskSpec.dense_heads``) are dropped; a row with no allowed
   key gives a zero output and zero gradients, never NaN.

GQA/MQA: query heads are grouped ``N = K * G`` and contracted against their kv
head directly (``BTKGH,BSKH->BKGTS``); K/V are never repeated in memory.

``impl="xla"`` runs :func:`dense_attention` when there is no bias, ALiBi or soft cap and ``K = N``
(the training path of the GPT-2 and LLaMA-style presets): the same dense math with a hand-written
derivative and causal query chunks that skip keys wholly in their future. :func:`xla_attention`
(plain autodiff) stays the reference every path is tested against.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from jaxformer.ops import blockwise, flash, sparse
from jaxformer.ops.masks import MaskSpec, masked_softmax
from jaxformer.typing import ArrayLike, AttnOut, KeyValue, Query, Slopes
from pallas_kernels.shapes import check_qkv, check_slopes

Impl = Literal["auto", "xla", "blockwise", "pallas", "sparse"]
IMPLS = ("auto", "xla", "blockwise", "pallas", "sparse")


def attention_logits_bias(mask: MaskSpec, slopes, T: int, S: int):
    """ALiBi bias ``-slope * |q_pos - k_pos|`` as fp32 ``[B|1, N, T, S]`` (positions from the mask)."""
    qp = mask.q_positions(T, S)  # [B|1, T]
    dist = jnp.abs(qp[:, None, :, None] - jnp.arange(S, dtype=jnp.int32)[None, None, None, :])
    return -slopes[:, :, None, None] * dist.astype(jnp.float32)


def attention_scores(q: Query, k: KeyValue, *, mask: MaskSpec | None = None,
                     bias: Float[ArrayLike, "..."] | None = None, scale: float | None = None,
                     alibi_slopes: Slopes | None = None, softcap: float | None = None,
                     ) -> tuple[Float[Array, "B N T S"], Bool[Array, "#B #N T S"]]:
    """Steps 1-3 of the module docstring: fp32 logits ``s [B, N, T, S]`` and where they are ``allowed``."""
    B, T, S, N, K, H = check_qkv(q, k, k)
    G = N // K
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    mask = MaskSpec() if mask is None else mask
    slopes = check_slopes(alibi_slopes, B, N)
    mask.validate(B, T, S, N)

    qg = q.reshape(B, T, K, G, H)
    s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32)
    s = s.reshape(B, N, T, S) * jnp.float32(scale)
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if bias is not None:
        bias = jnp.asarray(bias, jnp.float32)
        if bias.ndim > 4 or any(b not in (1, n) for b, n in zip(bias.shape[::-1], (S, T, N, B))):
            raise ValueError(f"bias.shape={bias.shape} does not broadcast to [B,N,T,S]=({B}, {N}, {T}, {S})")
        s = s + bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    if slopes is not None:
        s = s + attention_logits_bias(mask, slopes, T, S)
    return s, mask.dense_heads(T, S)  # allowed: [B|1, N|1, T, S]


def xla_attention(q: Query, k: KeyValue, v: KeyValue, *, mask: MaskSpec | None = None,
                  bias: Float[ArrayLike, "..."] | None = None, scale: float | None = None,
                  alibi_slopes: Slopes | None = None, softcap: float | None = None,
                  return_weights: bool = False) -> AttnOut | tuple[AttnOut, Float[Array, "B N T S"]]:
    """Dense attention in plain jnp: the reference every fast path is compared with."""
    B, T, S, N, K, H = check_qkv(q, k, v)
    G = N // K
    s, allowed = attention_scores(q, k, mask=mask, bias=bias, scale=scale, alibi_slopes=alibi_slopes,
                                  softcap=softcap)
    w = masked_softmax(s, allowed)  # fully masked rows: all zeros

    out = jnp.einsum("BKGTS,BSKH->BTKGH", w.reshape(B, K, G, T, S).astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    out = out.reshape(B, T, N, H).astype(q.dtype)
    return (out, w) if return_weights else out


# -- the dense training path: xla_attention's meaning, a hand-written backward and causal chunks ---------------

_CHUNK = 64  # query rows per causal chunk (at most 4 chunks; measured best at T=128/256 on CPU)


def causal_chunks(T: int, S: int, mask: MaskSpec) -> tuple[tuple[int, int, int], ...]:
    """``((q_start, q_end, n_keys), ...)``: query chunks and how many leading keys each can see.

    Under a causal mask with a static, non-negative query offset ``o``, query ``i`` sees no key past
    ``o + i``, so the chunk ``[a, b)`` needs only the first ``min(S, o + b)`` keys: the rest of its
    logits are masked whatever the other constraints say (they are combined with AND). Any other mask:
    one chunk over every key.
    """
    off = mask.static_offset(T, S) if mask.causal else None
    n = max(1, min(4, T // _CHUNK))
    if off is None or off < 0 or n == 1:
        return ((0, T, S),)
    edges = [round(i * T / n) for i in range(n + 1)]
    return tuple((a, b, min(S, off + b)) for a, b in itertools.pairwise(edges))


def _dense_weights(q, k, allowed, scale: float):
    """One query chunk's unnormalised weights ``e [B, N, T, S]`` (0 where masked; the row max, a constant,
    subtracted first) and ``inv [B, N, T]`` = 1 / their row sums (1 for a row with nothing allowed)."""
    s = jnp.einsum("BTNH,BSNH->BNTS", q, k, preferred_element_type=jnp.float32) * jnp.float32(scale)
    allowed = jnp.broadcast_to(allowed, s.shape)
    m = jax.lax.stop_gradient(jnp.max(jnp.where(allowed, s, -jnp.inf), axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(allowed, jnp.exp(jnp.where(allowed, s - m, 0.0)), 0.0)
    denom = jnp.sum(e, axis=-1)
    return e, 1.0 / jnp.where(denom == 0.0, 1.0, denom)


def _rows(inv):
    """``[B, N, T] -> [B, T, N, 1]``: a per-row factor laid out like the output."""
    return jnp.swapaxes(inv, 1, 2)[..., None]


def _concat(parts):
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _dense_attention(q, k, v, allowed, scale, chunks):
    out = []
    for a, b, n in chunks:
        e, inv = _dense_weights(q[:, a:b], k[:, :n], allowed[..., a:b, :n], scale)
        ev = jnp.einsum("BNTS,BSNH->BTNH", e.astype(v.dtype), v[:, :n], preferred_element_type=jnp.float32)
        out.append(ev * _rows(inv))
    return _concat(out).astype(q.dtype)


@_dense_attention.defjvp
def _dense_attention_jvp(scale, chunks, primals, tangents):
    """``out = (e v) inv`` differentiated by hand: ``de = e * ds`` (zero wherever ``e`` is, so neither the mask
    nor a select reaches the tangent, nor the backward pass JAX transposes from it) and
    ``d inv = -inv^2 rowsum(de)``; the backward's row sums then come from ``[B, T, N, H]`` arrays."""
    q, k, v, allowed = primals
    tq, tk, tv, _ = tangents
    f32 = jnp.float32
    out, t_out = [], []
    for a, b, n in chunks:
        qc, kc, vc = q[:, a:b], k[:, :n], v[:, :n]
        e, inv = _dense_weights(qc, kc, allowed[..., a:b, :n], scale)
        ev = jnp.einsum("BNTS,BSNH->BTNH", e.astype(v.dtype), vc, preferred_element_type=f32)
        ts = (jnp.einsum("BTNH,BSNH->BNTS", tq[:, a:b], kc, preferred_element_type=f32)
              + jnp.einsum("BTNH,BSNH->BNTS", qc, tk[:, :n], preferred_element_type=f32)) * f32(scale)
        te = e * ts
        t_inv = -inv * inv * jnp.sum(te, axis=-1)
        t_ev = (jnp.einsum("BNTS,BSNH->BTNH", te.astype(v.dtype), vc, preferred_element_type=f32)
                + jnp.einsum("BNTS,BSNH->BTNH", e.astype(v.dtype), tv[:, :n], preferred_element_type=f32))
        out.append(ev * _rows(inv))
        t_out.append(t_ev * _rows(inv) + ev * _rows(t_inv))
    return _concat(out).astype(q.dtype), _concat(t_out).astype(q.dtype)


def dense_attention(q: Query, k: KeyValue, v: KeyValue, *, mask: MaskSpec | None = None,
                    scale: float | None = None) -> AttnOut:
    """:func:`xla_attention`'s meaning (no bias, ALiBi or soft cap; ``K = N``) with a hand-written derivative
    and causal chunking (:func:`causal_chunks`): what ``impl="xla"`` runs when it can.

    Same values up to float rounding: the softmax is normalised after ``p v`` (``(e v) / sum e``), the
    derivative (a ``custom_jvp``: forward, reverse and higher-order modes all work) never goes through the
    mask, and causal query chunks skip the key blocks wholly in their future. On CPU the train step of a
    4-layer d_model-256 GPT at T=256 runs 1.14-1.24x faster than with plain autodiff of xla_attention
    (experiments/results/train_throughput.md).
    """
    B, T, S, N, K, H = check_qkv(q, k, v)
    if K != N:
        raise ValueError(f"dense_attention needs as many kv heads as query heads, got N={N}, K={K}")
    mask = MaskSpec() if mask is None else mask
    mask.validate(B, T, S, N)
    if T * S == 0:  # no keys: every row sees nothing, and such rows are zero
        return jnp.zeros(q.shape, q.dtype)
    if not _static_scale(scale):  # a traced scale: the reference, whose autodiff differentiates it too
        return xla_attention(q, k, v, mask=mask, scale=scale)
    scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
    return _dense_attention(q, k, v, mask.dense_heads(T, S), scale, causal_chunks(T, S, mask))


def _static_scale(scale) -> bool:
    """None or a Python / NumPy number: a constant the hand-written derivative may close over."""
    return scale is None or isinstance(scale, (int, float, np.number))


def _concrete(x) -> bool:
    """None or a value known while tracing (a Python, NumPy or JAX constant: ``float()`` takes it), not a tracer."""
    return x is None or not isinstance(x, jax.core.Tracer)


def _kernel_takes(q, k, v, scale, softcap) -> bool:
    """Whether the Pallas kernels take these operands: their own operand check passes (one float dtype,
    ``H <= MAX_HEAD_DIM``: ``pallas_kernels.flash_attention.checks.check_operands``) and the scale and soft cap
    are static numbers."""
    from pallas_kernels.flash_attention.checks import check_operands  # the kernels' package: only on GPU / TPU

    try:
        check_operands(q, k, v)
    except ValueError:
        return False
    return _static_scale(scale) and _static_scale(softcap)


def attention_logit_stats(q: Query, k: KeyValue, *, mask: MaskSpec | None = None, scale: float | None = None,
                          alibi_slopes: Slopes | None = None, softcap: float | None = None,
                          ) -> dict[str, Float[Array, ""]]:
    """What softmax sees, averaged over the query rows that have at least two allowed keys (and, when
    the mask has ``q_segment_ids``, are not padding: segment 0):

    * ``logit_var``: the variance of a row's logits over its allowed keys (softmax ignores a row's
      shift, so the spread within a row is what can saturate it);
    * ``entropy``: the row's attention entropy in nats, and ``entropy_ratio`` that entropy over
      ``log(#allowed keys)`` (1 = uniform, 0 = one-hot: saturated);
    * ``max_weight``: the row's largest attention weight.
    """
    s, allowed = attention_scores(q, k, mask=mask, scale=scale, alibi_slopes=alibi_slopes, softcap=softcap)
    allowed = jnp.broadcast_to(allowed, s.shape)
    n = allowed.sum(-1).astype(jnp.float32)  # [B, N, T]
    rows = n >= 2
    if mask is not None and mask.q_segment_ids is not None:  # padding rows may see each other: not data
        rows = rows & (jnp.asarray(mask.q_segment_ids) > 0)[:, None, :]
    n_safe = jnp.maximum(n, 1.0)
    mean = jnp.where(allowed, s, 0.0).sum(-1) / n_safe
    var = jnp.where(allowed, (s - mean[..., None]) ** 2, 0.0).sum(-1) / n_safe
    w = masked_softmax(s, allowed)
    ent = -jnp.where(w > 0, w * jnp.log(jnp.where(w > 0, w, 1.0)), 0.0).sum(-1)
    ratio = ent / jnp.log(jnp.maximum(n, 2.0))
    n_rows = jnp.maximum(rows.sum(), 1).astype(jnp.float32)

    def avg(x):
        return jnp.where(rows, x, 0.0).sum() / n_rows

    return {"logit_var": avg(var), "entropy": avg(ent), "entropy_ratio": avg(ratio),
            "max_weight": avg(w.max(-1))}


def default_impl(T: int, S: int, mask: MaskSpec | None = None) -> str:
    """What ``impl="auto"`` picks: Pallas on GPU/TPU; on CPU xla below 512 x 512, blockwise from there.

    The CPU crossover is measured on a whole llama-style train step (d 128, 4 layers, 3 K tokens
    per step, 2 cores; ``experiments/bench/attention_step.py``): blockwise / xla step time
    0.96 at T=256, 0.86 at 512, 0.45 at 1024 on an AMD EPYC (Zen 5). On an Intel Xeon (Sapphire
    Rapids) xla stays ahead to 1024 (1.06 at 128, 1.20 at 256, 1.15 at 512, 1.13 at 1024, 2026-12-04):
    the crossover is the CPU's, and this one is Zen 5's.
    Masks with global tokens or random blocks: xla for short, sparse for long, on every platform.
    """
    if mask is not None and mask.has_pattern:
        return "xla" if T * S <= 2048 * 2048 else "sparse"
    platform = jax.default_backend()
    if platform in ("gpu", "tpu"):
        return "pallas"
    return "xla" if T * S < 512 * 512 else "blockwise"


def _refuse_patterns(module, impl: str, mask: MaskSpec) -> None:
    """ValueError for a mask with global tokens / random blocks unless the path's module handles them
    (declares ``SUPPORTS_MASK_PATTERNS = True``)."""
    if mask.has_pattern and not getattr(module, "SUPPORTS_MASK_PATTERNS", False):
        raise ValueError(f"impl={impl!r} does not handle MaskSpec.global_tokens / random_blocks; "
                         "use impl='sparse' or impl='xla'")


def dot_product_attention(q: Query, k: KeyValue, v: KeyValue, *, mask: MaskSpec | None = None,
                          bias: Float[ArrayLike, "..."] | None = None, scale: float | None = None,
                          alibi_slopes: Slopes | None = None, softcap: float | None = None,
                          impl: Impl = "auto", return_weights: bool = False,
                          ) -> AttnOut | tuple[AttnOut, Float[Array, "B N T S"]]:
    """Multi-head / grouped-query attention. See the module docstring for the exact semantics.

    Args:
      q: ``[B, T, N, H]``; k, v: ``[B, S, K, H]`` with ``N % K == 0``.
      mask: a :class:`MaskSpec` (None: no mask).
      bias: additive logits bias broadcastable to ``[B, N, T, S]`` (xla only).
      scale: logits scale, default ``1/sqrt(H)``.
      alibi_slopes: ``[N]`` or ``[B, N]``; adds ``-slope * |q_pos - k_pos|``.
      softcap: logit soft-capping value, positive (None: none).
      impl: "xla" | "blockwise" | "pallas" | "sparse" | "auto". ``"xla"`` runs :func:`dense_attention` (the
        dense math with a hand-written derivative and causal query chunks) when there is no bias, ALiBi,
        soft cap or returned weights, ``K == N`` and a static scale; else :func:`xla_attention` (plain
        autodiff, the reference). ``"auto"``: :func:`default_impl`, then blockwise where the Pallas kernels
        refuse the operands (mixed dtypes, ``H > 256``) and xla for a traced scale or soft cap, which
        "blockwise" and "pallas" refuse. No keys (``S == 0``): zeros, on every path.
      return_weights: also return the attention weights ``[B, N, T, S]`` (xla only).
    """
    B, T, S, N, K, H = check_qkv(q, k, v)
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    mask = MaskSpec() if mask is None else mask
    if not isinstance(mask, MaskSpec):
        raise ValueError(f"mask must be a MaskSpec, got {type(mask).__name__}")
    mask.validate(B, T, S, N)
    if softcap is not None and _concrete(softcap) and not bool(softcap > 0):  # 0 is not "off": logits all 0
        raise ValueError(f"softcap={softcap!r} must be positive or None (None: no soft cap)")
    if return_weights or bias is not None:
        if impl not in ("auto", "xla"):
            raise ValueError(f"impl={impl!r} supports neither bias nor return_weights; use impl='xla'")
        impl = "xla"
    if impl == "auto":
        impl = default_impl(T, S, mask)
        if impl == "pallas" and not _kernel_takes(q, k, v, scale, softcap):
            impl = "blockwise"  # what the kernels refuse (a traced scale, mixed dtypes, H > 256): the same math
        if impl == "blockwise" and not (_concrete(scale) and _concrete(softcap)):
            impl = "xla"  # a traced scale or soft cap: the reference, which differentiates it too
    elif impl in ("blockwise", "pallas") and not (_concrete(scale) and _concrete(softcap)):
        raise ValueError(f"impl={impl!r} needs scale and softcap known when traced (got scale={scale!r}, "
                         f"softcap={softcap!r}); a traced one runs with impl='xla' or 'auto'")
    if B * T * S == 0:  # no keys (or no queries, no rows): every row sees nothing, and such rows are zero
        if impl in ("blockwise", "pallas"):
            _refuse_patterns(blockwise if impl == "blockwise" else flash, impl, mask)
        out = jnp.zeros(q.shape, q.dtype)
        return (out, jnp.zeros((B, N, T, S), jnp.float32)) if return_weights else out
    kwargs = dict(mask=mask, scale=scale, alibi_slopes=alibi_slopes, softcap=softcap)
    if impl == "xla":
        if (bias is None and not return_weights and alibi_slopes is None and softcap is None and K == N
                and T * S > 0 and _static_scale(scale)):
            return dense_attention(q, k, v, mask=mask, scale=scale)
        return xla_attention(q, k, v, bias=bias, return_weights=return_weights, **kwargs)
    if impl == "pallas" and not mask.has_static_offset and not mask.has_pattern:
        impl = "blockwise"  # a traced q_offset cannot drive the kernels' static block skipping; same meaning
    if impl == "blockwise":
        _refuse_patterns(blockwise, impl, mask)
        return blockwise.blockwise_attention(q, k, v, **kwargs)
    if impl == "pallas":
        _refuse_patterns(flash, impl, mask)
        return flash.pallas_attention(q, k, v, **kwargs)
    return sparse.sparse_attention(q, k, v, **kwargs)
