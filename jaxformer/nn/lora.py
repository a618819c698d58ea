"""Low-rank adapters (LoRA, Hu et al. 2021) written into the einsum projections, as ``peft`` computes them.

A projection ``y = x W`` whose kernel is ``W [*I, *O]`` (W_q ``[D, N, H]``: I = (D,), O = (N, H);
W_o ``[N, H, D]``: I = (N, H), O = (D,); the MLP's ``[D, F]`` / ``[F, D]``) gains::

    y = x W + s (drop(x) A) B        A [*I, R]   B [R, *O]   s = alpha / R   (rslora: alpha / sqrt(R))

``drop`` is inverted dropout of rate ``dropout`` on the adapter's input only (peft's ``lora_dropout``).
A is drawn as peft draws ``lora_A.weight`` (torch's ``kaiming_uniform_(a=sqrt(5))`` on ``[R, prod(I)]``:
``U(-1/sqrt(prod(I)), 1/sqrt(prod(I)))``) and B is zero, so a new adapter leaves the model exactly as it
was. A and B are ``nnx.LoRAParam`` (a subclass of ``nnx.Param``) in float32 whatever the base's dtype:
``nnx.state(model, nnx.LoRAParam)`` is the adapter, ``nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))`` the
base. peft stores ``lora_A.weight [R, prod(I)]`` and ``lora_B.weight [prod(O), R]``, i.e.
``A.reshape(-1, R).T`` and ``B.reshape(R, -1).T`` (:mod:`jaxformer.interop.peft`).

Dropout needs a fresh key per call. With ``dropout > 0`` each adapter holds one in a
:class:`DropoutKey` variable (not a ``Param``: never trained, never saved) that the trainer overwrites
every step; it is used only when ``deterministic`` is False, an attribute (part of the graphdef), True
unless the trainer sets it (``model.set_attributes(deterministic=False)``), so evaluation and decoding
never drop.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer.nn.params import as_dtype, eager_sharding, project
from jaxformer.typing import ArrayLike

LORA_SUFFIX = "_lora"
"""A projection ``w_q``'s adapter is the module attribute ``w_q_lora`` (state path ``.../w_q_lora/{a,b}``)."""


def is_dropout_key(path) -> bool:
    """Whether a pure-dict path (``.../w_q_lora/key``) names an adapter's dropout key (a :class:`DropoutKey`)."""
    return path[-1] == "key" and str(path[-2]).endswith(LORA_SUFFIX)


class DropoutKey(nnx.Variable):
    """One adapter's dropout key as raw key data (``jax.random.key_data``, uint32 ``[2]``)."""


def lora_scale(alpha: float, rank: int, rslora: bool = False) -> float:
    """peft's scale of the low-rank update: ``alpha / R``, or ``alpha / sqrt(R)`` with rsLoRA (Kalajdzievski
    2023). The one place it is computed (the modules, merging and the peft files all use it)."""
    return alpha / (math.sqrt(rank) if rslora else rank)


class Dims(NamedTuple):
    """A projection's input (or output) dims: their sizes and logical axis names (None: unsharded)."""

    shape: Sequence[int]
    axes: Sequence[str | None]


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    """What a layer needs to build its adapters: the projections to adapt (their kernels' names,
    e.g. ``"w_q"``), the rank R, ``alpha``, the dropout rate and whether the scale is rsLoRA's."""

    targets: frozenset[str]
    rank: int
    alpha: float
    dropout: float = 0.0
    rslora: bool = False

    @property
    def scale(self) -> float:
        return lora_scale(self.alpha, self.rank, self.rslora)

    def make(self, name: str, inputs: Dims, outputs: Dims, *, dtype, rngs: nnx.Rngs) -> LoRA | None:
        """The adapter of the projection ``name`` (None unless it is a target)."""
        if name not in self.targets:
            return None
        return LoRA(inputs, outputs, rank=self.rank, scale=self.scale, dropout=self.dropout, dtype=dtype, rngs=rngs)


def peft_uniform(key, shape: Sequence[int], n_in: int) -> jax.Array:
    """peft's ``lora_A`` init for ``A [*I, R]`` with ``prod(I) = n_in``: ``U(-1/sqrt(n_in), 1/sqrt(n_in))``
    (torch's ``kaiming_uniform_`` with ``a = sqrt(5)``: gain ``sqrt(2 / (1 + a^2))``, bound
    ``gain * sqrt(3 / fan_in)``)."""
    bound = 1.0 / math.sqrt(n_in)
    return jax.random.uniform(key, tuple(shape), jnp.float32, -bound, bound)


class LoRA(nnx.Module):
    """``x [..., *I] -> s (drop(x) A) B [..., *O]`` with ``A [*I, R]``, ``B [R, *O]`` (see the module doc)."""

    def __init__(self, inputs: Dims, outputs: Dims, *, rank: int, scale: float, dropout: float = 0.0,
                 dtype="float32", rngs: nnx.Rngs):
        (in_shape, in_axes), (out_shape, out_axes) = inputs, outputs
        in_shape, out_shape = tuple(int(s) for s in in_shape), tuple(int(s) for s in out_shape)
        if rank <= 0:
            raise ValueError(f"LoRA rank={rank} must be > 0")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout={dropout} must be in [0, 1)")
        if len(in_axes) != len(in_shape) or len(out_axes) != len(out_shape):
            raise ValueError(f"axes {tuple(in_axes)} / {tuple(out_axes)} do not match shapes {in_shape} / {out_shape}")
        self.rank, self.scale, self.dropout = int(rank), float(scale), float(dropout)
        self.dtype = as_dtype(dtype)
        self.deterministic = True
        eager = eager_sharding()
        self.a = nnx.LoRAParam(peft_uniform(rngs.params(), (*in_shape, rank), math.prod(in_shape)),
                               out_sharding=(*in_axes, None), eager_sharding=eager)
        self.b = nnx.LoRAParam(jnp.zeros((rank, *out_shape), jnp.float32), out_sharding=(None, *out_axes),
                               eager_sharding=eager)
        self.key = (DropoutKey(jnp.zeros((2,), jnp.uint32), out_sharding=(None,), eager_sharding=eager)
                    if dropout > 0 else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        a, b = self.a[...].astype(self.dtype), self.b[...].astype(self.dtype)
        n_in = a.ndim - 1
        if x.shape[x.ndim - n_in:] != a.shape[:-1]:
            raise ValueError(f"LoRA input {x.shape=} does not end in A's input dims {a.shape[:-1]} ({a.shape=})")
        x = x.astype(self.dtype)
        if self.dropout > 0 and not self.deterministic:
            key = jax.random.wrap_key_data(self.key[...])
            keep = jax.random.bernoulli(key, 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / jnp.asarray(1.0 - self.dropout, x.dtype), jnp.zeros((), x.dtype))
        h = project(x, a, self.dtype, n_in=n_in)  # [..., R], as 2-D products (see project: the gradients' form)
        return project(h, b, self.dtype) * jnp.asarray(self.scale, self.dtype)


def lora_delta(a: ArrayLike, b: ArrayLike, scale: float, kernel_shape: Sequence[int]) -> jax.Array:
    """``s A B`` in the kernel's layout, float32: ``A [*L, *I, R]``, ``B [*L, R, *O]`` -> ``[*L, *I, *O]``
    (``L``: a scanned stack's leading layer axis, or none), what merging adds to the kernel."""
    kernel_shape = tuple(kernel_shape)
    lead = a.ndim + b.ndim - 2 - len(kernel_shape)
    if lead < 0 or a.shape[:lead] != b.shape[:lead] or a.shape[-1] != b.shape[lead]:
        raise ValueError(f"LoRA A {a.shape} and B {b.shape} do not compose into a kernel of shape {kernel_shape}")
    L, R = a.shape[:lead], a.shape[-1]
    a2 = jnp.reshape(a.astype(jnp.float32), (*L, -1, R))
    b2 = jnp.reshape(b.astype(jnp.float32), (*L, R, -1))
    return (jnp.matmul(a2, b2) * scale).reshape(kernel_shape)  # [*L, in, R] @ [*L, R, out]
