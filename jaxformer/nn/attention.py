"""Multi-head attention (self and cross, MHA / GQA / MQA) and the KV-cache hook.

Projections (no K/V repetition anywhere: grouped heads are handled by
:func:`jaxformer.ops.attention.dot_product_attention`)::

    q = x W_q    W_q [D, N, H]  ("embed", "heads", "head_dim")
    k = c W_k    W_k [D, K, H]  ("embed", "kv_heads", "head_dim")
    v = c W_v    W_v [D, K, H]  ("embed", "kv_heads", "head_dim")
    y = o W_o    W_o [N, H, D]  ("heads", "head_dim", "embed")

with ``c = x`` (self-attention) or the encoder output (cross-attention).
``share="qk"`` drops W_k and uses W_q for the keys (shared-QK attention, as in
Reformer); ``share="qkv"`` drops W_v too (K = V = Q before positions). Both
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
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from jaxformer.nn.lora import LoRASpec
from jaxformer.nn.params import add_bias, as_dtype, normal, param, zeros
from jaxformer.ops.attention import attention_logit_stats, dot_product_attention
from jaxformer.ops.masks import MaskSpec
from jaxformer.ops.positional import RopeScaling, alibi_slopes, apply_rope
from jaxformer.typing import Activations, ArrayLike, KvPositions, Positions

ATTENTION_POSITIONS = ("rope", "alibi", "none")
SHARING = ("none", "qk", "qkv")


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
    ``impl`` the model's ``attention_impl`` string. The cache is treated as a
    value: the updated one is returned, never mutated in place (a pytree is
    the natural choice so it can cross ``jax.jit``).
    """

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
               alibi_slopes: jax.Array | None, softcap: float | None,
               impl: str) -> tuple[jax.Array, KVCacheLayer]:
        ...


class Attention(nnx.Module):
    """Multi-head attention with ``n_kv_heads`` K dividing ``n_heads`` N (GQA; K=1 is MQA).

    Args:
      d_model: D, the width of ``x`` (and of the output).
      n_heads, n_kv_heads, head_dim: N, K (default N), H (default D // N).
      kv_dim: width of the cross-attention context (default D).
      position: "rope" | "alibi" | "none" (what attention itself does with positions).
      rope_base, rope_scaling, rope_interleaved: passed to ``apply_rope``.
      softcap: attention-logit soft cap; impl: ``dot_product_attention``'s backend.
      scale: logits scale (default ``1/sqrt(H)``); share: "none" | "qk" | "qkv" (see the module doc).
      use_bias: biases ``b_o [D]`` on the output projection and, unless ``qkv_bias`` says otherwise,
        ``b_q [N, H]``, ``b_k, b_v [K, H]`` on the input projections.
      qkv_bias: biases on q/k/v (None: ``use_bias``); ``qkv_bias=True, use_bias=False`` is Qwen2's layout.
      qk_std, v_std, o_std: init standard deviations of W_q and W_k, W_v, W_o.
      lora: adapters on the targeted projections (see the module doc); None: none.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None,
                 head_dim: int | None = None, *, kv_dim: int | None = None, position: str = "none",
                 rope_base: float = 10000.0, rope_scaling: RopeScaling | None = None,
                 rope_interleaved: bool = False, softcap: float | None = None, impl: str = "auto",
                 scale: float | None = None, share: str = "none",
                 use_bias: bool = False, qkv_bias: bool | None = None, qk_std: float = 0.02, v_std: float = 0.02,
                 o_std: float = 0.02, param_dtype="float32", dtype="float32", lora: LoRASpec | None = None,
                 rngs: nnx.Rngs):
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if n_kv_heads <= 0 or n_heads % n_kv_heads:
            raise ValueError(f"heads {n_heads} not divisible by kv heads {n_kv_heads}")
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"d_model {d_model} not divisible by heads {n_heads}; give head_dim")
            head_dim = d_model // n_heads
        if position not in ATTENTION_POSITIONS:
            raise ValueError(f"attention position {position!r} is not one of {ATTENTION_POSITIONS}")
        if position == "rope" and head_dim % 2:
            raise ValueError(f"RoPE needs an even head dim, got head_dim={head_dim}")
        if share not in SHARING:
            raise ValueError(f"share={share!r} is not one of {SHARING}")
        if share != "none" and (n_kv_heads != n_heads or (kv_dim is not None and kv_dim != d_model)):
            raise ValueError(f"share={share!r} uses W_q for the keys: it needs n_kv_heads = n_heads and "
                             f"kv_dim = d_model, got n_heads={n_heads}, n_kv_heads={n_kv_heads}, kv_dim={kv_dim}")
        if scale is not None and not scale > 0:
            raise ValueError(f"scale={scale} must be > 0")
        kv_dim = d_model if kv_dim is None else kv_dim
        N, K, H = n_heads, n_kv_heads, head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = N, K, H
        self.position, self.rope_base, self.rope_interleaved = position, rope_base, rope_interleaved
        self.rope_scaling = rope_scaling
        self.softcap, self.impl = softcap, impl
        self.scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
        self.share = share
        self.record_stats = False
        self.dtype = as_dtype(dtype)
        self.w_q = param(rngs, normal(qk_std), (d_model, N, H), ("embed", "heads", "head_dim"), param_dtype)
        self.w_k = (param(rngs, normal(qk_std), (kv_dim, K, H), ("embed", "kv_heads", "head_dim"), param_dtype)
                    if share == "none" else None)
        self.w_v = (param(rngs, normal(v_std), (kv_dim, K, H), ("embed", "kv_heads", "head_dim"), param_dtype)
                    if share != "qkv" else None)
        self.w_o = param(rngs, normal(o_std), (N, H, d_model), ("heads", "head_dim", "embed"), param_dtype)
        qkv_bias = use_bias if qkv_bias is None else qkv_bias

        def bias(shape, axes, present):
            return param(rngs, zeros, shape, axes, param_dtype) if present else None

        self.b_q = bias((N, H), ("heads", "head_dim"), qkv_bias)
        self.b_k = bias((K, H), ("kv_heads", "head_dim"), qkv_bias and self.w_k is not None)
        self.b_v = bias((K, H), ("kv_heads", "head_dim"), qkv_bias and self.w_v is not None)
        self.b_o = bias((d_model,), ("embed",), use_bias)
        missing = lora.targets & {n for n in ("w_k", "w_v") if getattr(self, n) is None} if lora else ()
        if missing:
            raise ValueError(f"LoRA targets {sorted(missing)}: share={share!r} has no such projection")
        kv = ((kv_dim,), (K, H), ("embed",), ("kv_heads", "head_dim"))
        shapes = {"w_q": ((d_model,), (N, H), ("embed",), ("heads", "head_dim")), "w_k": kv, "w_v": kv,
                  "w_o": ((N, H), (d_model,), ("heads", "head_dim"), ("embed",))}

        def adapter(name):
            return None if lora is None else lora.make(name, *shapes[name], dtype=dtype, rngs=rngs)

        self.w_q_lora, self.w_k_lora, self.w_v_lora, self.w_o_lora = (adapter(n) for n in shapes)

    def _project(self, x, w, b, spec, lora=None):
        y = jnp.einsum(spec, x.astype(self.dtype), w[...].astype(self.dtype))
        if lora is not None:
            y = y + lora(x)
        return add_bias(y, b, self.dtype)

    def __call__(self, x: Activations, context: Float[ArrayLike, "B S _"] | None = None, *,
                 positions: Positions | None = None, kv_positions: KvPositions | None = None,
                 mask: MaskSpec | None = None, cache: KVCacheLayer | None = None,
                 ) -> Float[Array, "B T D"] | tuple[Float[Array, "B T D"], KVCacheLayer]:
        """Attend ``x [B, T, D]`` to itself (``context=None``) or to ``context [B, S, D_kv]``.

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
        ctx = x if context is None else context
        q = self._project(x, self.w_q, self.b_q, "BTD,DNH->BTNH", self.w_q_lora)
        shared = None
        if self.share != "none":  # keys (and values) from W_q
            shared = q if context is None else self._project(ctx, self.w_q, self.b_q, "BSD,DNH->BSNH",
                                                             self.w_q_lora)
        k = shared if self.w_k is None else self._project(ctx, self.w_k, self.b_k, "BSD,DKH->BSKH", self.w_k_lora)
        v = shared if self.w_v is None else self._project(ctx, self.w_v, self.b_v, "BSD,DKH->BSKH", self.w_v_lora)
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
        B_, T_, N_, H_ = o.shape
        y = o.astype(self.dtype).reshape(B_, T_, N_ * H_) @ self.w_o[...].astype(self.dtype).reshape(N_ * H_, -1)
        if self.w_o_lora is not None:
            y = y + self.w_o_lora(o)
        y = add_bias(y, self.b_o, self.dtype)
        return y if cache is None else (y, new_cache)
