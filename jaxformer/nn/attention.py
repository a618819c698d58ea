"""Multi-head attention (self and cross, MHA / GQA / MQA) and the KV-cache hook.

Projections (no K/V repetition anywhere: grouped heads are handled by
:func:`jaxformer.ops.attention.dot_product_attention`)::

    q = x W_q    W_q [D, N, H]  ("embed", "heads", "head_dim")
    k = c W_k    W_k [D, K, H]  ("embed", "kv_heads", "head_dim")
    v = c W_v    W_v [D, K, H]  ("embed", "kv_heads", "head_dim")
    y = o W_o    W_o [N, H, D]  ("heads", "head_dim", "embed")

with ``c = x`` (self-attention) or the encoder output (cross-attention).
``qkv_sharing="qk"`` drops W_k and uses W_q for the keys (shared-QK attention, as in
Reformer); ``qkv_sharing="qkv"`` drops W_v too (K = V = Q before positions). Both
need K = N.

With ``record_stats = True`` (an attribute, off by default) a call without a
cache also sows :func:`jaxformer.ops.attention.attention_logit_stats` of its
logits as ``nnx.Intermediate`` ``"attention_stats"`` (read them with
``nnx.pop(model, nnx.Intermediate)``): what the softmax sees, for studies.
``lora`` (a :class:`jaxformer.nn.lora.LoRASpec`) adds low-rank adapters ``w_q_lora`` ... ``w_o_lora`` to
the projections it targets (``"w_q"``, ``"w_k"``, ``"w_v"``, ``"w_o"``): ``x W + s (x A) B``.
Position handling inside attention: ``"rope"`` rotates q and k, ``"alibi"``
passes the paper's slopes to the attention op, anything else does nothing here
(sinusoidal and learned positions are added to the embeddings by the model).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from jaxformer.nn.config import AttentionConfig, PositionConfig
from jaxformer.nn.lora import Dims, LoRASpec
from jaxformer.nn.params import (add_bias, as_dtype, normal, param, project, project_t, rows, runs_feature_major,
                                 zeros)
from jaxformer.ops.attention import attention_logit_stats, dot_product_attention
from jaxformer.ops.masks import MaskSpec
from jaxformer.ops.positional import alibi_slopes, apply_rope
from jaxformer.typing import Activations, ArrayLike, KvPositions, Positions



@runtime_checkable
class KVCacheLayer(Protocol):
    """One self-attention layer's key/value cache, as :class:`Attention` uses it.

    When ``Attention.__call__`` gets ``cache=c``, it projects the new tokens to
    ``q [B, T, N, H]`` and ``k, v [B, T, K, H]`` (RoPE already applied at the
    caller's absolute ``positions``), then returns, instead of attending itself::

        out, new_cache = c.attend(q, k, v, scale=scale, alibi_slopes=slopes,
                                  softcap=softcap, impl=impl)

    ``attend`` must append (or write) ``k, v`` into its storage and attend ``q``
    to every cached key including the new ones. The cache owns the mask: its
    own lengths, causality within the new chunk and ``q_offset`` (the new
    tokens' position in the cache); the model passes no ``MaskSpec``. ``out``
    is ``[B, T, N, H]`` in ``q.dtype``. ``alibi_slopes`` is ``[N]`` float32 or
    None; ``scale`` is a float (``1/sqrt(H)``); ``softcap`` a float or None;
    ``impl`` the model's ``attention.impl`` string. The cache is treated as a
    value: the updated one is returned, never mutated in place (a pytree is
    the natural choice so it can cross ``jax.jit``).
    """

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
               alibi_slopes: jax.Array | None, softcap: float | None,
               impl: str) -> tuple[jax.Array, KVCacheLayer]:
        ...


class AttentionInit(NamedTuple):
    """How the projections start: init standard deviations of W_q and W_k (``qk``; W_q's times
    ``q_scale``), W_v (``v``) and W_o (``o``), and whether they have biases (zeros): ``bias`` (the model's
    ``use_bias``) puts ``b_o [D]`` on the output projection and, unless ``AttentionConfig.qkv_bias`` says
    otherwise, ``b_q [N, H]``, ``b_k, b_v [K, H]`` on the input projections (``qkv_bias=True, bias=False``
    is Qwen2's layout)."""

    qk: float = 0.02
    v: float = 0.02
    o: float = 0.02
    bias: bool = False
    q_scale: float = 1.0


class Attention(nnx.Module):
    """Multi-head attention with ``n_kv_heads`` K dividing ``n_heads`` N (GQA; K=1 is MQA).

    Args:
      d_model: D, the width of ``x``, of the output and of a cross-attention ``context``.
      cfg: heads N, K (default N) and width H (default D // N), logit scale (default ``1/sqrt(H)``) and
        soft cap, ``qkv_sharing`` ("none" | "qk" | "qkv", see the module doc), ``qkv_bias``, the
        ``dot_product_attention`` backend ``impl``.
      positions: what this attention does with positions (``positions.in_attention``: RoPE rotates q and
        k with ``rope_base``, ``rope_scaling``, ``rope_interleaved``; ALiBi adds the paper's slopes);
        None: nothing (cross-attention).
      init: the projections' init standard deviations and biases (:class:`AttentionInit`).
      lora: adapters on the targeted projections (see the module doc); None: none.
    """

    def __init__(self, d_model: int, cfg: AttentionConfig = AttentionConfig(), *,
                 positions: PositionConfig | None = None,
                 init: AttentionInit = AttentionInit(), lora: LoRASpec | None = None, param_dtype="float32",
                 dtype="float32", rngs: nnx.Rngs):
        N, K = cfg.n_heads, cfg.resolved_kv_heads
        if cfg.head_dim is None and d_model % N:
            raise ValueError(f"d_model {d_model} not divisible by heads {N}; give head_dim")
        H = cfg.resolved_head_dim(d_model)
        position = "none" if positions is None else positions.in_attention
        if position == "rope" and H % 2:
            raise ValueError(f"RoPE needs an even head dim, got head_dim={H}")
        share = cfg.qkv_sharing
        self.n_heads, self.n_kv_heads, self.head_dim = N, K, H
        self.position = position
        self.rope_base = 10000.0 if positions is None else positions.rope_base
        self.rope_interleaved = False if positions is None else positions.rope_interleaved
        self.rope_scaling = None if positions is None else positions.rope
        self.softcap, self.impl = cfg.softcap, cfg.impl
        self.scale = 1.0 / math.sqrt(H) if cfg.scale is None else float(cfg.scale)
        self.share = share
        self.record_stats = False
        self.dtype = as_dtype(dtype)
        qk_std, v_std, o_std, use_bias, q_scale = init
        qkv_bias = use_bias if cfg.qkv_bias is None else cfg.qkv_bias
        self.w_q = param(rngs, normal(qk_std * q_scale), (d_model, N, H), ("embed", "heads", "head_dim"),
                         param_dtype)
        self.w_k = (param(rngs, normal(qk_std), (d_model, K, H), ("embed", "kv_heads", "head_dim"), param_dtype)
                    if share == "none" else None)
        self.w_v = (param(rngs, normal(v_std), (d_model, K, H), ("embed", "kv_heads", "head_dim"), param_dtype)
                    if share != "qkv" else None)
        self.w_o = param(rngs, normal(o_std), (N, H, d_model), ("heads", "head_dim", "embed"), param_dtype)

        def bias(shape, axes, present):
            return param(rngs, zeros, shape, axes, param_dtype) if present else None

        self.b_q = bias((N, H), ("heads", "head_dim"), qkv_bias)
        self.b_k = bias((K, H), ("kv_heads", "head_dim"), qkv_bias and self.w_k is not None)
        self.b_v = bias((K, H), ("kv_heads", "head_dim"), qkv_bias and self.w_v is not None)
        self.b_o = bias((d_model,), ("embed",), use_bias)
        missing = lora.targets & {n for n in ("w_k", "w_v") if getattr(self, n) is None} if lora else ()
        if missing:
            raise ValueError(f"LoRA targets {sorted(missing)}: qkv_sharing={share!r} has no such projection")
        embed, heads = Dims((d_model,), ("embed",)), Dims((N, H), ("heads", "head_dim"))
        kv = (embed, Dims((K, H), ("kv_heads", "head_dim")))
        shapes = {"w_q": (embed, heads), "w_k": kv, "w_v": kv, "w_o": (heads, embed)}

        def adapter(name):
            return None if lora is None else lora.make(name, *shapes[name], dtype=dtype, rngs=rngs)

        self.w_q_lora, self.w_k_lora, self.w_v_lora, self.w_o_lora = (adapter(n) for n in shapes)

    TRANSPOSED = {"w_q": (1, 2), "w_k": (1, 2), "w_v": (1, 2), "w_o": (2, 1)}  # copied for feature-major calls

    def _project(self, x, name, b, lora=None, n_in=1):
        """``x`` through projection ``name`` (+ its adapter, + ``b``); feature-major from its copy where the
        call's rows allow (:func:`jaxformer.nn.params.runs_feature_major`)."""
        if runs_feature_major(self, rows(x, n_in)):
            y = project_t(x, getattr(self, f"{name}_t")[...], self.dtype, n_in=n_in)
        else:
            y = project(x, getattr(self, name)[...], self.dtype, n_in=n_in)
        if lora is not None:
            y = y + lora(x)
        return add_bias(y, b, self.dtype)

    def __call__(self, x: Activations, context: Float[ArrayLike, "B S D"] | None = None, *,
                 positions: Positions | None = None, kv_positions: KvPositions | None = None,
                 mask: MaskSpec | None = None, cache: KVCacheLayer | None = None,
                 ) -> Float[Array, "B T D"] | tuple[Float[Array, "B T D"], KVCacheLayer]:
        """Attend ``x [B, T, D]`` to itself (``context=None``) or to ``context [B, S, D]``.

        Args:
          positions: int ``[T]`` or ``[B, T]`` absolute positions of ``x``'s tokens
            (RoPE); default ``arange(T)``; required with ``cache``.
          kv_positions: positions of the context tokens for RoPE in cross-attention
            (default ``arange(S)``).
          mask: a ``MaskSpec`` (ignored when ``cache`` is given: the cache owns it).
          cache: a :class:`KVCacheLayer` (self-attention only).

        Returns:
          ``y [B, T, D]``, or ``(y, new_cache)`` when ``cache`` is given.
        """
        if x.ndim != 3:
            raise ValueError(f"attention expects x [B, T, D]; got {x.shape=}")
        if context is not None and cache is not None:
            raise ValueError("a KV cache is only supported for self-attention (context must be None)")
        T = x.shape[1]
        if context is not None and (jnp.ndim(context) != 3 or jnp.shape(context)[-1] != self.w_q.shape[0]):
            raise ValueError(f"context.shape={jnp.shape(context)} must be [B, S, D] with D={self.w_q.shape[0]} "
                             "(cross-attention's context has the model's width)")
        ctx = x if context is None else context
        q = self._project(x, "w_q", self.b_q, self.w_q_lora)
        shared = None
        if self.share != "none":  # keys (and values) from W_q
            shared = q if context is None else self._project(ctx, "w_q", self.b_q, self.w_q_lora)
        k = shared if self.w_k is None else self._project(ctx, "w_k", self.b_k, self.w_k_lora)
        v = shared if self.w_v is None else self._project(ctx, "w_v", self.b_v, self.w_v_lora)
        if self.position == "rope":
            if positions is None:
                if cache is not None:
                    raise ValueError("positions [B, T] are required with a KV cache (RoPE)")
                positions = jnp.arange(T, dtype=jnp.int32)
            if kv_positions is None:
                kv_positions = positions if context is None else jnp.arange(ctx.shape[1], dtype=jnp.int32)
            rope = dict(base=self.rope_base, scaling=self.rope_scaling, interleaved=self.rope_interleaved)
            q = apply_rope(q, positions, **rope)
            k = apply_rope(k, kv_positions, **rope)
        slopes = alibi_slopes(self.n_heads) if self.position == "alibi" else None
        scale = self.scale
        if self.record_stats and cache is None:
            self.sow(nnx.Intermediate, "attention_stats",
                     attention_logit_stats(q, k, mask=mask, scale=scale, alibi_slopes=slopes, softcap=self.softcap))
        new_cache = None
        if cache is not None:
            o, new_cache = cache.attend(q, k, v, scale=scale, alibi_slopes=slopes,
                                        softcap=self.softcap, impl=self.impl)
        else:
            o = dot_product_attention(q, k, v, mask=mask, scale=scale, alibi_slopes=slopes,
                                      softcap=self.softcap, impl=self.impl)
        # one (N*H)-wide contraction: as a two-axis einsum, XLA CPU may lay the attention output out H-major
        # and then transpose all of w_o to match, every call (a weight-sized copy per layer per decode step)
        y = self._project(o, "w_o", self.b_o, self.w_o_lora, n_in=2)
        return y if cache is None else (y, new_cache)
