"""LayerNorm and RMSNorm modules: own the scale (and bias), call :mod:`jaxformer.ops.normalization`."""

from __future__ import annotations

from flax import nnx
from jaxtyping import Array, Float

from jaxformer.nn.params import ones, param, zeros
from jaxformer.ops.normalization import layer_norm, rms_norm
from jaxformer.typing import ArrayLike

NORMS = ("layernorm", "rmsnorm")


class LayerNorm(nnx.Module):
    """``(x - mean) / sqrt(var + eps) * scale + bias`` over the last dim D; stats in fp32."""

    def __init__(self, dim: int, *, eps: float = 1e-5, use_bias: bool = True,
                 param_dtype="float32", rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(rngs, ones, (dim,), ("embed",), param_dtype)
        self.bias = param(rngs, zeros, (dim,), ("embed",), param_dtype) if use_bias else None

    def __call__(self, x: Float[ArrayLike, "*B D"]) -> Float[Array, "*B D"]:
        bias = None if self.bias is None else self.bias[...]
        return layer_norm(x, self.scale[...], bias, eps=self.eps)


class RMSNorm(nnx.Module):
    """``x / sqrt(mean(x^2) + eps) * scale`` over the last dim D; stats in fp32."""

    def __init__(self, dim: int, *, eps: float = 1e-6, param_dtype="float32", rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(rngs, ones, (dim,), ("embed",), param_dtype)

    def __call__(self, x: Float[ArrayLike, "*B D"]) -> Float[Array, "*B D"]:
        return rms_norm(x, self.scale[...], eps=self.eps)


def make_norm(kind: str, dim: int, *, eps: float, use_bias: bool, param_dtype, rngs: nnx.Rngs):
    """``"layernorm"`` (bias iff ``use_bias``) or ``"rmsnorm"`` (never a bias)."""
    if kind == "layernorm":
        return LayerNorm(dim, eps=eps, use_bias=use_bias, param_dtype=param_dtype, rngs=rngs)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps, param_dtype=param_dtype, rngs=rngs)
    raise ValueError(f"norm {kind!r} is not one of {NORMS}")

