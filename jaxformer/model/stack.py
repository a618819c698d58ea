"""A stack of Transformer blocks built from a ModelConfig: a Python list or one scanned, stacked block.

With ``scan_layers`` every parameter gets a leading ``"layers"`` axis ``[L, ...]``
and the forward pass is one ``jax.lax.scan``; with ``remat`` each block's
activations are recomputed in the backward pass (``nnx.remat`` / ``jax.checkpoint``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx
from jaxtyping import Array, Float

from jaxformer.model.config import ModelConfig
from jaxformer.nn.attention import Attention, AttentionInit
from jaxformer.nn.block import Block, Residual
from jaxformer.nn.lora import LoRASpec
from jaxformer.nn.mlp import make_mlp
from jaxformer.nn.norms import make_norm
from jaxformer.nn.params import xavier_std
from jaxformer.ops.masks import MaskSpec
from jaxformer.typing import Activations, Memory, Positions


def make_norm_for(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """A norm of ``cfg.norm.kind`` over ``d_model`` (a LayerNorm's bias iff ``use_bias``)."""
    return make_norm(cfg.norm.kind, cfg.d_model, eps=cfg.norm.eps, use_bias=cfg.use_bias,
                     param_dtype=cfg.param_dtype, rngs=rngs)


def lora_spec(cfg: ModelConfig) -> LoRASpec | None:
    """What a block's self-attention and MLP need of ``cfg.lora`` (None without adapters)."""
    if cfg.lora is None:
        return None
    c = cfg.lora
    return LoRASpec(frozenset(cfg.lora_targets), c.rank, c.alpha, c.dropout, c.rslora)


def make_block(cfg: ModelConfig, *, cross: bool, alpha: float | None, beta: float | None,
               rngs: nnx.Rngs) -> Block:
    """One block: self-attention (+ cross-attention) + MLP, with DeepNorm's alpha / beta-init if given;
    adapters (``cfg.lora``) on the self-attention and MLP projections."""
    D, N, K, H, F = (cfg.d_model, cfg.attention.n_heads, cfg.resolved_kv_heads, cfg.resolved_head_dim,
                     cfg.resolved_d_ff)
    deepnorm = cfg.norm.placement == "deepnorm"
    if deepnorm or cfg.init_scheme == "xavier":
        g = beta if deepnorm else 1.0  # DeepNorm's beta on W_v, W_o and the MLP; plain Glorot otherwise
        init = AttentionInit(xavier_std(D, N * H), xavier_std(D, K * H, g), xavier_std(N * H, D, g),
                             bias=cfg.use_bias, q_scale=cfg.attention.q_init_scale)
        mlp_stds = (xavier_std(D, F, g), xavier_std(F, D, g))
    else:
        s = cfg.init_std
        init = AttentionInit(s, s, s, bias=cfg.use_bias, q_scale=cfg.attention.q_init_scale)
        mlp_stds = (s, s)
    common = dict(param_dtype=cfg.param_dtype, dtype=cfg.compute_dtype, rngs=rngs)

    def residual():
        return Residual(
            make_norm_for(cfg, rngs), norm_position=cfg.norm.placement,
            branch_norm=make_norm_for(cfg, rngs) if cfg.norm.sandwich else None,
            alpha=alpha if deepnorm else 1.0, skip=cfg.residual,
        )

    self_attn = Attention(D, cfg.attention, positions=cfg.positions, init=init, lora=lora_spec(cfg), **common)
    attn_res = residual()
    cross_attn = (Attention(D, cfg.attention.model_copy(update=dict(qkv_sharing="none")), init=init, **common)
                  if cross else None)
    cross_res = residual() if cross else None
    mlp = make_mlp(D, cfg.ffn, stds=mlp_stds, lora=lora_spec(cfg), use_bias=cfg.use_bias, **common)
    return Block(self_attn, attn_res, mlp, residual(), cross_attn=cross_attn, cross_residual=cross_res)


class Stack(nnx.Module):
    """``n`` blocks plus the optional final norm."""

    def __init__(self, cfg: ModelConfig, n: int, *, cross: bool, alpha: float | None = None,
                 beta: float | None = None, rngs: nnx.Rngs):
        self.n = n
        self.scan_layers = cfg.scan_layers
        self.use_remat = cfg.remat
        if cfg.scan_layers:
            @nnx.split_rngs(splits=n)
            @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=n,
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
            def create(r: nnx.Rngs) -> Block:
                return make_block(cfg, cross=cross, alpha=alpha, beta=beta, rngs=r)

            self.blocks = create(rngs)
        else:
            self.blocks = nnx.List([make_block(cfg, cross=cross, alpha=alpha, beta=beta, rngs=rngs)
                                    for _ in range(n)])
        self.final_norm = make_norm_for(cfg, rngs) if cfg.norm.resolved_final else None

    def __call__(self, x: Activations, *, positions: Positions | None = None, mask: MaskSpec | None = None,
                 context: Memory | None = None, context_mask: MaskSpec | None = None,
                 caches: Sequence | None = None) -> tuple[Float[Array, "B T D"], list | None]:
        """``x [B, T, D] -> (y [B, T, D], new_caches or None)``; ``caches`` one per block."""
        kw = dict(positions=positions, mask=mask, context=context, context_mask=context_mask)
        new_caches = None
        if caches is not None:
            if len(caches) != self.n:
                raise ValueError(f"got {len(caches)} caches for {self.n} layers")
            new_caches = []
            for i, block in enumerate(self._unstacked()):
                x, c = block(x, cache=caches[i], **kw)
                new_caches.append(c)
        elif self.scan_layers:
            graphdef, params = nnx.split(self.blocks)

            def body(h, p):
                return nnx.merge(graphdef, p)(h, **kw)[0], None

            x, _ = jax.lax.scan(jax.checkpoint(body) if self.use_remat else body, x, params)
        else:
            def run(block, h):
                return block(h, **kw)[0]

            if self.use_remat:
                run = nnx.remat(run)
            for block in self.blocks:
                x = run(block, x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, new_caches

    def _unstacked(self):
        if not self.scan_layers:
            yield from self.blocks
            return
        graphdef, params = nnx.split(self.blocks)
        for i in range(self.n):
            yield nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], params))
