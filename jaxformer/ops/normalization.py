"""LayerNorm, RMSNorm and the DeepNet (DeepNorm) residual constants.

Both norms normalise over the last axis with statistics in at least fp32 (bf16 /
fp16 inputs are upcast, so large or offset activations neither overflow nor lose
their mean) and return ``x.dtype``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxformer.typing import ArrayLike


def _compute_dtype(x):
    return jnp.promote_types(x.dtype, jnp.float32)


def _check_param(name: str, x, p):
    if p is not None and tuple(p.shape) != tuple(x.shape[-1:]):
        raise ValueError(f"{name}.shape={tuple(p.shape)} must equal x.shape[-1:]; got {x.shape=}")


def _along_last(p, x, dt):
    """``p [D]`` reshaped to x's rank (rank promotion is disabled under test)."""
    return p.astype(dt).reshape((1,) * (x.ndim - 1) + p.shape)


def layer_norm(x: Float[ArrayLike, "*B D"], scale: Float[ArrayLike, "D"], bias: Float[ArrayLike, "D"] | None = None,
               *, eps: float = 1e-5) -> Float[Array, "*B D"]:
    """``(x - mean) / sqrt(var + eps) * scale + bias`` over the last axis (Ba et al. 2016).

    Args:
      x: ``[..., D]``; scale, bias: ``[D]`` (bias optional).
    """
    x, scale = jnp.asarray(x), jnp.asarray(scale)
    bias = None if bias is None else jnp.asarray(bias)
    _check_param("scale", x, scale)
    _check_param("bias", x, bias)
    dt = _compute_dtype(x)
    xf = x.astype(dt)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    centred = xf - mean
    var = jnp.mean(jnp.square(centred), axis=-1, keepdims=True)
    y = centred * jax.lax.rsqrt(var + eps) * _along_last(scale, x, dt)
    if bias is not None:
        y = y + _along_last(bias, x, dt)
    return y.astype(x.dtype)


def rms_norm(x: Float[ArrayLike, "*B D"], scale: Float[ArrayLike, "D"], *, eps: float = 1e-6) -> Float[Array, "*B D"]:
    """``x / sqrt(mean(x^2) + eps) * scale`` over the last axis (Zhang & Sennrich 2019).

    Args:
      x: ``[..., D]``; scale: ``[D]``.
    """
    x, scale = jnp.asarray(x), jnp.asarray(scale)
    _check_param("scale", x, scale)
    dt = _compute_dtype(x)
    xf = x.astype(dt)
    ms = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
    return (xf * jax.lax.rsqrt(ms + eps) * _along_last(scale, x, dt)).astype(x.dtype)


class DeepNormConstants(NamedTuple):
    """DeepNorm ``x_{l+1} = LN(alpha * x_l + G(x_l))``; ``beta`` scales the init of the
    FFN, value and output projections. ``None`` for a stack that is absent."""

    encoder_alpha: float | None
    encoder_beta: float | None
    decoder_alpha: float | None
    decoder_beta: float | None


def deepnorm_constants(n_encoder_layers: int, n_decoder_layers: int) -> DeepNormConstants:
    """alpha and beta from the DeepNet paper (Wang et al. 2022, Table / Figure 2).

    N encoder layers, M decoder layers:

    * encoder-only (M = 0): alpha = (2N)^(1/4), beta = (8N)^(-1/4);
    * decoder-only (N = 0): alpha = (2M)^(1/4), beta = (8M)^(-1/4);
    * encoder-decoder: encoder alpha = 0.81 (N^4 M)^(1/16), beta = 0.87 (N^4 M)^(-1/16);
      decoder alpha = (3M)^(1/4), beta = (12M)^(-1/4).
    """
    N, M = n_encoder_layers, n_decoder_layers
    for name, v in (("n_encoder_layers", N), ("n_decoder_layers", M)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"deepnorm_constants: {name}={v!r} must be a non-negative int")
    if N == 0 and M == 0:
        raise ValueError(f"deepnorm_constants needs at least one layer; got {N=} {M=}")
    if M == 0:
        return DeepNormConstants((2 * N) ** 0.25, (8 * N) ** -0.25, None, None)
    if N == 0:
        return DeepNormConstants(None, None, (2 * M) ** 0.25, (8 * M) ** -0.25)
    nm = float(N) ** 4 * M
    return DeepNormConstants(0.81 * nm ** (1 / 16), 0.87 * nm ** (-1 / 16),
                             (3 * M) ** 0.25, (12 * M) ** -0.25)
