"""Feed-forward activations, plain and gated (GLU variants, Shazeer 2020), and FFN width.

A gated FFN computes ``act(x W_gate) * (x W_up)``; :func:`activation_fn` returns
``act`` for both plain and gated names, :func:`is_gated` tells them apart.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxformer.typing import ArrayLike

ACTIVATIONS = ("identity", "relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu")
_GATED = ("swiglu", "geglu")


def identity(x: Float[ArrayLike, "*shape"]) -> Float[Array, "*shape"]:
    """No non-linearity: the FFN becomes one linear map ``x W_in W_out`` (for the activations study)."""
    return jnp.asarray(x)


def relu(x: Float[ArrayLike, "*shape"]) -> Float[Array, "*shape"]:
    """``max(x, 0)``."""
    return jax.nn.relu(x)


def gelu(x: Float[ArrayLike, "*shape"], approximate: bool = False) -> Float[Array, "*shape"]:
    """``x * Phi(x)`` exactly (erf), or with the tanh approximation of Hendrycks & Gimpel.

    Written as ``0.5 x erfc(-x / sqrt 2)`` and ``x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))``
    (= ``0.5 x (1 + tanh(...))``): same functions, no cancellation in ``1 + erf`` /
    ``1 + tanh`` for negative ``x``, so the tail keeps full relative precision.
    """
    x = jnp.asarray(x)
    if approximate:
        u = math.sqrt(2.0 / math.pi) * (x + 0.044715 * (x * x * x))
        return x * jax.nn.sigmoid(2.0 * u)
    return 0.5 * x * jax.lax.erfc(-x * (1.0 / math.sqrt(2.0)))


def silu(x: Float[ArrayLike, "*shape"]) -> Float[Array, "*shape"]:
    """``x * sigmoid(x)`` (a.k.a. swish with beta = 1)."""
    return jax.nn.silu(x)


swish = silu


def _check_gate(name: str, gate, up):
    if jnp.shape(gate) != jnp.shape(up):
        raise ValueError(f"{name}: gate and up must have the same shape; got {jnp.shape(gate)=} {jnp.shape(up)=}")


def swiglu(gate: Float[ArrayLike, "*B F"], up: Float[ArrayLike, "*B F"]) -> Float[Array, "*B F"]:
    """``silu(gate) * up``."""
    _check_gate("swiglu", gate, up)
    return silu(gate) * up


def geglu(gate: Float[ArrayLike, "*B F"], up: Float[ArrayLike, "*B F"]) -> Float[Array, "*B F"]:
    """``gelu(gate) * up`` (exact gelu)."""
    _check_gate("geglu", gate, up)
    return gelu(gate) * up


def _check_name(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; choose one of {ACTIVATIONS}")


def is_gated(name: str) -> bool:
    """Whether ``name`` is a gated (GLU) activation needing two input projections."""
    _check_name(name)
    return name in _GATED


def activation_fn(name: str) -> Callable:
    """The elementwise function for ``name``; for gated names, the gate's activation."""
    _check_name(name)
    return {
        "identity": identity,
        "relu": relu,
        "gelu": gelu,
        "gelu_tanh": functools.partial(gelu, approximate=True),
        "silu": silu,
        "swiglu": silu,
        "geglu": gelu,
    }[name]


def ffn_hidden_size(d_model: int, activation: str, multiple_of: int = 1) -> int:
    """FFN width F: ``4 D`` for plain activations, ``int(8 D / 3)`` for gated ones (same
    parameter count with three matrices), then rounded up to a multiple of ``multiple_of``.

    LLaMA-7B: ``ffn_hidden_size(4096, "swiglu", 256) == 11008``.
    """
    _check_name(activation)
    if not isinstance(d_model, int) or d_model <= 0:
        raise ValueError(f"ffn_hidden_size: d_model={d_model!r} must be a positive int")
    if not isinstance(multiple_of, int) or multiple_of <= 0:
        raise ValueError(f"ffn_hidden_size: multiple_of={multiple_of!r} must be a positive int")
    hidden = 8 * d_model // 3 if is_gated(activation) else 4 * d_model
    return -(-hidden // multiple_of) * multiple_of
