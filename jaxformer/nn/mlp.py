"""Position-wise feed-forward networks: plain ``act(x W_in) W_out`` and gated ``glu(x W_g, x W_u) W_d``.

With ``record_stats = True`` (an attribute, off by default) a call also sows, as ``nnx.Intermediate``
``"fired"``, where the activation's input (the gate's, for GLUs) is positive, bool ``[..., F]``: a
ReLU unit that is never positive on the data never fires (is dead). Read with ``nnx.capture``.

``lora`` (a :class:`jaxformer.nn.lora.LoRASpec`) adds low-rank adapters (``w_gate_lora``, ...) to the
projections it targets: ``w_in``, ``w_out`` (plain) or ``w_gate``, ``w_up``, ``w_down`` (gated).

Feature-major decode (:func:`jaxformer.nn.params.add_transposed_copies`): a module given transposed copies of
its projections (``[F, D]`` ``w_in_t``, ``[D, F]`` ``w_out_t``; ``w_gate_t``, ``w_up_t``, ``w_down_t``), as the
decode engine gives them on CPU, computes a call of ``FEATURE_MAJOR_ROWS`` rows as ``W^T x^T``: the FFN's hidden
activations ``[F, *B]``, then the output ``[D, *B]`` the same way, back to rows. The same product; on XLA's CPU
backend 2-32 rows run 1.3-2.8x as fast that way (the kernels tile the result's rows: the features fill them, a
few tokens do not; ``experiments/results/decode_matmul_cpu.md``; with the down projection's copy a 16-row decode
step of SmolLM2-135M takes 0.82-0.85x the time, paired in one process: ``decode_cpu.md``, Zen 2 fourth stop).
Other row counts, and calls of a module with adapters or ``record_stats``, take the usual path. For inference
only: a gradient of such a call reaches the copies, not the parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from jaxformer.nn.lora import Dims, LoRASpec
from jaxformer.nn.params import add_bias, as_dtype, normal, param, project, rows, runs_feature_major, zeros
from jaxformer.nn.config import FFNConfig
from jaxformer.ops.activations import activation_fn, geglu, swiglu
from jaxformer.typing import ArrayLike

_GLU = {"swiglu": swiglu, "geglu": geglu}
_STDS = (0.02, 0.02)  # init standard deviations of the projections into the FFN width and back


def dense(x, w, b, dtype, lora=None):
    """``x W (+ lora(x)) (+ b)`` in ``dtype``: ``x [..., D]``, ``W [D, F]`` -> ``[..., F]`` (or back, ``[F, D]``)."""
    y = project(x, w[...], dtype)
    if lora is not None:
        y = y + lora(x)
    return add_bias(y, b, dtype)


def dense_t(x, wt, b, dtype):
    """``(x W + b)`` feature-major, computed as ``W^T x^T``: ``x [*B, D]``, ``wt = W^T [F, D]`` -> ``[F, *B]``."""
    y = jnp.einsum("FD,...D->F...", wt[...].astype(dtype), x.astype(dtype))
    return y if b is None else y + b[...].astype(dtype).reshape((-1,) + (1,) * (x.ndim - 1))


def dense_from_t(h, wt, b, dtype):
    """Feature-major ``h [F, *B]`` times ``W [F, D]``, given as ``wt = W^T [D, F]`` (+ b): ``[*B, D]``, computed
    ``W^T h`` (``[D, *B]``, the output features as the product's rows) and back to rows behind an optimisation
    barrier (without it XLA folds the transpose into the product, back at the rows' form)."""
    y = jnp.einsum("DF,F...->D...", wt[...].astype(dtype), h.astype(dtype))
    return add_bias(jnp.moveaxis(jax.lax.optimization_barrier(y), 0, -1), b, dtype)


def _adapters(module, lora: LoRASpec | None, d_model: int, d_ff: int, names_in, names_out, dtype, rngs):
    """The adapters of the projections ``names_in`` (``[D, F]``) then ``names_out`` (``[F, D]``), each None
    unless ``lora`` targets it."""
    if lora is None:
        return (None,) * (len(names_in) + len(names_out))
    wrong = lora.targets & {"w_in", "w_out", "w_gate", "w_up", "w_down"} - set(names_in) - set(names_out)
    if wrong:
        raise ValueError(f"LoRA targets {sorted(wrong)}: a {type(module).__name__} has only "
                         f"{[*names_in, *names_out]}")
    embed, hidden = Dims((d_model,), ("embed",)), Dims((d_ff,), ("mlp",))
    into = [lora.make(n, embed, hidden, dtype=dtype, rngs=rngs) for n in names_in]
    back = [lora.make(n, hidden, embed, dtype=dtype, rngs=rngs) for n in names_out]
    return (*into, *back)


class MLP(nnx.Module):
    """``act(x W_in + b_in) W_out + b_out``; ``W_in [D, F]``, ``W_out [F, D]`` with act = ``cfg.activation``
    and F = ``cfg.width(D)``; ``stds``: the init standard deviations of W_in and W_out."""

    TRANSPOSED = {"w_in": (1, 1), "w_out": (1, 1)}  # copied [F, D] and [D, F] for feature-major calls

    def __init__(self, d_model: int, cfg: FFNConfig, *, use_bias: bool = True, stds: tuple[float, float] = _STDS,
                 lora: LoRASpec | None = None, param_dtype="float32", dtype="float32", rngs: nnx.Rngs):
        activation, d_ff, (in_std, out_std) = cfg.activation, cfg.width(d_model), stds
        if cfg.gated:
            raise ValueError(f"MLP got gated activation {activation!r}; use GatedMLP")
        self.activation = activation
        self.dtype = as_dtype(dtype)
        self.w_in = param(rngs, normal(in_std), (d_model, d_ff), ("embed", "mlp"), param_dtype)
        self.w_out = param(rngs, normal(out_std), (d_ff, d_model), ("mlp", "embed"), param_dtype)
        self.b_in = param(rngs, zeros, (d_ff,), ("mlp",), param_dtype) if use_bias else None
        self.b_out = param(rngs, zeros, (d_model,), ("embed",), param_dtype) if use_bias else None
        self.record_stats = False
        self.w_in_lora, self.w_out_lora = _adapters(self, lora, d_model, d_ff, ("w_in",), ("w_out",), dtype, rngs)

    def __call__(self, x: Float[ArrayLike, "*B D"]) -> Float[Array, "*B D"]:
        if runs_feature_major(self, rows(x)):
            h = activation_fn(self.activation)(dense_t(x, self.w_in_t, self.b_in, self.dtype))
            return dense_from_t(h, self.w_out_t, self.b_out, self.dtype)
        pre = dense(x, self.w_in, self.b_in, self.dtype, self.w_in_lora)
        if self.record_stats:
            self.sow(nnx.Intermediate, "fired", pre > 0)
        h = activation_fn(self.activation)(pre)
        return dense(h, self.w_out, self.b_out, self.dtype, self.w_out_lora)


class GatedMLP(nnx.Module):
    """``glu(x W_gate + b_g, x W_up + b_u) W_down + b_d`` with glu = ``cfg.activation``, swiglu | geglu
    (Shazeer 2020); ``stds``: the init standard deviations of W_gate and W_up, and of W_down."""

    TRANSPOSED = {"w_gate": (1, 1), "w_up": (1, 1), "w_down": (1, 1)}

    def __init__(self, d_model: int, cfg: FFNConfig, *, use_bias: bool = False, stds: tuple[float, float] = _STDS,
                 lora: LoRASpec | None = None, param_dtype="float32", dtype="float32", rngs: nnx.Rngs):
        activation, d_ff, (in_std, out_std) = cfg.activation, cfg.width(d_model), stds
        if activation not in _GLU:
            raise ValueError(f"GatedMLP activation {activation!r} is not one of {tuple(_GLU)}")
        self.activation = activation
        self.dtype = as_dtype(dtype)
        self.w_gate = param(rngs, normal(in_std), (d_model, d_ff), ("embed", "mlp"), param_dtype)
        self.w_up = param(rngs, normal(in_std), (d_model, d_ff), ("embed", "mlp"), param_dtype)
        self.w_down = param(rngs, normal(out_std), (d_ff, d_model), ("mlp", "embed"), param_dtype)
        self.b_gate = param(rngs, zeros, (d_ff,), ("mlp",), param_dtype) if use_bias else None
        self.b_up = param(rngs, zeros, (d_ff,), ("mlp",), param_dtype) if use_bias else None
        self.b_down = param(rngs, zeros, (d_model,), ("embed",), param_dtype) if use_bias else None
        self.record_stats = False
        self.w_gate_lora, self.w_up_lora, self.w_down_lora = _adapters(
            self, lora, d_model, d_ff, ("w_gate", "w_up"), ("w_down",), dtype, rngs)

    def __call__(self, x: Float[ArrayLike, "*B D"]) -> Float[Array, "*B D"]:
        if runs_feature_major(self, rows(x)):
            gate, up = (dense_t(x, w, b, self.dtype) for w, b in ((self.w_gate_t, self.b_gate),
                                                                  (self.w_up_t, self.b_up)))
            return dense_from_t(_GLU[self.activation](gate, up), self.w_down_t, self.b_down, self.dtype)
        gate = dense(x, self.w_gate, self.b_gate, self.dtype, self.w_gate_lora)
        if self.record_stats:
            self.sow(nnx.Intermediate, "fired", gate > 0)
        up = dense(x, self.w_up, self.b_up, self.dtype, self.w_up_lora)
        return dense(_GLU[self.activation](gate, up), self.w_down, self.b_down, self.dtype, self.w_down_lora)


def make_mlp(d_model: int, cfg: FFNConfig, **kwargs):
    """A :class:`GatedMLP` for swiglu / geglu, an :class:`MLP` otherwise (``kwargs``: theirs)."""
    return (GatedMLP if cfg.gated else MLP)(d_model, cfg, **kwargs)
