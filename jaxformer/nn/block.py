"""Residual sublayers and the Transformer block built from them.

``norm_position`` (Ln = the sublayer's norm, f = its branch, Lb = the optional
sandwich norm on the branch output, alpha = 1 except for DeepNorm):

* ``"pre"``      ``x + Lb(f(Ln(x)))``                      (GPT-2, LLaMA)
* ``"post"``     ``Ln(x + Lb(f(x)))``                       (Vaswani et al.)
* ``"deepnorm"`` ``Ln(alpha * x + Lb(f(x)))``               (DeepNet, Wang et al. 2022)

``skip=False`` drops the identity path (``x +`` / ``alpha * x +``), for the residuals study:
``Lb(f(Ln(x)))`` (pre) or ``Ln(Lb(f(x)))`` (post, deepnorm).

DeepNorm's other half, the beta-scaled initialisation of W_v, W_o and the FFN
weights, is applied by whoever builds the sublayers (see ``jaxformer.model``).
"""

from __future__ import annotations

from collections.abc import Callable

from flax import nnx
from jaxtyping import Array, Float

from jaxformer.nn.attention import Attention, KVCacheLayer
from jaxformer.ops.masks import MaskSpec
from jaxformer.typing import Activations, ArrayLike, Memory, Positions

NORM_POSITIONS = ("post", "pre", "deepnorm")


class Residual(nnx.Module):
    """A residual connection around a branch, with its norm(s) placed by ``norm_position``."""

    def __init__(self, norm: nnx.Module, *, norm_position: str = "pre",
                 branch_norm: nnx.Module | None = None, alpha: float = 1.0, skip: bool = True):
        if norm_position not in NORM_POSITIONS:
            raise ValueError(f"norm_position {norm_position!r} is not one of {NORM_POSITIONS}")
        if alpha != 1.0 and norm_position != "deepnorm":
            raise ValueError(f"alpha={alpha} only applies to norm_position='deepnorm', got {norm_position!r}")
        self.norm = norm
        self.branch_norm = branch_norm
        self.norm_position = norm_position
        self.alpha = float(alpha)
        self.skip = bool(skip)

    def __call__(self, x: Float[ArrayLike, "*B D"], branch: Callable) -> Float[Array, "*B D"]:
        if self.norm_position == "pre":
            h = branch(self.norm(x))
            h = h if self.branch_norm is None else self.branch_norm(h)
            return x + h if self.skip else h
        h = branch(x)
        if self.branch_norm is not None:
            h = self.branch_norm(h)
        if not self.skip:
            return self.norm(h)
        if self.alpha != 1.0:
            x = (x * self.alpha).astype(x.dtype)
        return self.norm(x + h)


class Block(nnx.Module):
    """Self-attention, optional cross-attention, then the MLP, each in a :class:`Residual`."""

    def __init__(self, self_attn: Attention, attn_residual: Residual, mlp: nnx.Module,
                 mlp_residual: Residual, cross_attn: Attention | None = None,
                 cross_residual: Residual | None = None):
        if (cross_attn is None) != (cross_residual is None):
            raise ValueError("cross_attn and cross_residual must be given together")
        self.self_attn, self.attn_residual = self_attn, attn_residual
        self.cross_attn, self.cross_residual = cross_attn, cross_residual
        self.mlp, self.mlp_residual = mlp, mlp_residual

    def __call__(self, x: Activations, *, positions: Positions | None = None, mask: MaskSpec | None = None,
                 context: Memory | None = None, context_mask: MaskSpec | None = None,
                 cache: KVCacheLayer | None = None) -> tuple[Float[Array, "B T D"], KVCacheLayer | None]:
        """``x [B, T, D] -> (y [B, T, D], new_cache or None)``.

        ``context [B, S, D]`` (the encoder output) is required iff the block has
        cross-attention; ``context_mask`` masks it (e.g. source padding).
        """
        new_cache = None

        def attend(h):
            nonlocal new_cache
            if cache is None:
                return self.self_attn(h, positions=positions, mask=mask)
            h, new_cache = self.self_attn(h, positions=positions, cache=cache)
            return h

        x = self.attn_residual(x, attend)
        if self.cross_attn is not None:
            if context is None:
                raise ValueError("this block has cross-attention: pass context [B, S, D]")
            x = self.cross_residual(x, lambda h: self.cross_attn(h, context, mask=context_mask))
        elif context is not None:
            raise ValueError("context given to a block without cross-attention")
        x = self.mlp_residual(x, self.mlp)
        return x, new_cache
