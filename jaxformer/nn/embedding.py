"""Token embedding (with the tied output head), untied output head, learned absolute positions, and
BERT's head transform (the MLM head's dense + activation + norm before the output projection)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Integer

from jaxformer.nn.config import NormConfig
from jaxformer.nn.norms import make_norm
from jaxformer.nn.params import (FEATURE_MAJOR_ROWS, add_bias, as_dtype, normal, param, project, project_rows,
                                 project_t, rows, runs_feature_major, zeros)
from jaxformer.ops.activations import activation_fn, is_gated
from jaxformer.typing import Activations, ArrayLike, Logits


class Embed(nnx.Module):
    """Token table ``E [V, D]``: ``tokens [B, T] -> E[tokens] [B, T, D]``; ``attend`` is the tied head.

    ``feature_major`` (set by :func:`jaxformer.nn.params.add_transposed_copies`, the decode engine's step model on
    the CPU): the head's calls of ``FEATURE_MAJOR_ROWS`` rows compute ``E x^T`` (the table is laid out as that
    product wants it already: no copy)."""

    TRANSPOSED = "embedding"  # laid out [V, D]: the feature-major head's operand as it lies
    feature_major = False

    def __init__(self, vocab_size: int, d_model: int, *, std: float = 0.02, param_dtype="float32",
                 dtype="float32", rngs: nnx.Rngs):
        self.vocab_size = vocab_size
        self.dtype = as_dtype(dtype)
        self.embedding = param(rngs, normal(std), (vocab_size, d_model), ("vocab", "embed"), param_dtype)

    def __call__(self, tokens: Integer[ArrayLike, "*B"]) -> Float[Array, "*B D"]:
        return jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)

    def attend(self, x: Activations) -> Logits:
        """Tied output head: ``x [B, T, D] @ E^T -> logits float32 [B, T, V]``."""
        if self.feature_major and rows(x) in FEATURE_MAJOR_ROWS:
            return project_t(x, self.embedding[...], self.dtype, preferred_element_type=jnp.float32)
        return project_rows(x, self.embedding[...], self.dtype, preferred_element_type=jnp.float32)


class LMHead(nnx.Module):
    """Untied output head ``W [D, V]``: ``x [B, T, D] -> logits float32 [B, T, V]`` (feature-major from a
    ``[V, D]`` copy where one is given: :func:`jaxformer.nn.params.add_transposed_copies`)."""

    TRANSPOSED = {"kernel": (1, 1)}

    def __init__(self, d_model: int, vocab_size: int, *, std: float = 0.02, param_dtype="float32",
                 dtype="float32", rngs: nnx.Rngs):
        self.dtype = as_dtype(dtype)
        self.kernel = param(rngs, normal(std), (d_model, vocab_size), ("embed", "vocab"), param_dtype)

    def __call__(self, x: Activations) -> Logits:
        if runs_feature_major(self, rows(x)):
            return project_t(x, self.kernel_t[...], self.dtype, preferred_element_type=jnp.float32)
        return project(x, self.kernel[...], self.dtype, preferred_element_type=jnp.float32)


class LearnedPositions(nnx.Module):
    """Learned absolute position table ``P [max_len, D]`` (GPT-2's ``wpe``)."""

    def __init__(self, max_len: int, d_model: int, *, std: float = 0.01, param_dtype="float32",
                 dtype="float32", rngs: nnx.Rngs):
        self.max_len = max_len
        self.dtype = as_dtype(dtype)
        self.embedding = param(rngs, normal(std), (max_len, d_model), (None, "embed"), param_dtype)

    def __call__(self, positions: Integer[ArrayLike, "*B"]) -> Float[Array, "*B D"]:
        """``positions`` int ``[T]`` or ``[B, T]`` -> ``[..., T, D]`` (out-of-range positions clip)."""
        return jnp.take(self.embedding[...], positions, axis=0, mode="clip").astype(self.dtype)


class HeadTransform(nnx.Module):
    """BERT's MLM head transform: ``x [..., D] -> norm(act(x W + b)) [..., D]``.

    Parameters: ``w [D, D]`` ("embed", None), ``b [D]`` (iff ``use_bias``), and ``norm``
    (``scale [D]``, plus ``bias [D]`` for a LayerNorm with ``use_bias``). HF BERT's
    ``cls.predictions.transform.{dense.weight (transposed), dense.bias, LayerNorm.weight, LayerNorm.bias}``.
    ``activation`` is a non-gated name from :data:`jaxformer.ops.activations.ACTIVATIONS`; ``norm``: the
    model's norm section (its ``kind`` and ``eps``; the placement fields do not apply here).
    """

    def __init__(self, d_model: int, activation: str, *, norm: NormConfig = NormConfig(), use_bias: bool = True,
                 std: float = 0.02, param_dtype="float32", dtype="float32", rngs: nnx.Rngs):
        if is_gated(activation):
            raise ValueError(f"HeadTransform needs a non-gated activation, got {activation!r}")
        self.activation = activation
        self.dtype = as_dtype(dtype)
        self.w = param(rngs, normal(std), (d_model, d_model), ("embed", None), param_dtype)
        self.b = param(rngs, zeros, (d_model,), ("embed",), param_dtype) if use_bias else None
        self.norm = make_norm(norm.kind, d_model, eps=norm.eps, use_bias=use_bias, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: Float[ArrayLike, "*B D"]) -> Float[Array, "*B D"]:
        h = project(x, self.w[...], self.dtype)  # [..., D] @ [D, D]
        return self.norm(activation_fn(self.activation)(add_bias(h, self.b, self.dtype)))
