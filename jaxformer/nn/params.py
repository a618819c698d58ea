"""Parameter creation with logical axis names, and dtype helpers.

Every parameter is an ``nnx.Param`` whose ``out_sharding`` metadata holds one
logical axis name per dimension, drawn from :data:`LOGICAL_AXES` (or ``None``:
replicated). The training code maps them to mesh axes with one rules table,
e.g. ``nnx.get_partition_spec(state)`` under ``flax.core.spmd.logical_axis_rules``.

Parameters are sharded eagerly at creation only when flax's eager sharding is
on *and* a mesh and logical-axis rules are both active; otherwise they are
created unsharded (so models build on a laptop with no mesh).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import meta
from flax.core import spmd as core_spmd

LOGICAL_AXES: tuple[str, ...] = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers")
"""The logical axis names parameters carry (``None`` in a slot means replicated).

vocab: V · embed: D · heads: N · kv_heads: K · head_dim: H · mlp: F ·
layers: the stacked-layer axis of scanned blocks.
"""

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def as_dtype(name_or_dtype) -> jnp.dtype:
    """'float32' | 'bfloat16' | 'float16' or a dtype -> a jnp dtype."""
    if isinstance(name_or_dtype, str):
        if name_or_dtype not in DTYPES:
            raise ValueError(f"dtype {name_or_dtype!r} is not one of {tuple(DTYPES)}")
        return jnp.dtype(DTYPES[name_or_dtype])
    return jnp.dtype(name_or_dtype)


zeros: Initializer = jax.nn.initializers.zeros
ones: Initializer = jax.nn.initializers.ones


def normal(std: float) -> Initializer:
    """``jax.nn.initializers.normal(std)``, drawn in fp32 and cast to the parameter dtype.

    Drawing in fp32 gives bf16/fp16 parameters the same values as fp32 ones, rounded (a draw
    in bf16 itself would round the uniform samples before the inverse-CDF transform).
    """
    draw = jax.nn.initializers.normal(std, jnp.float32)

    def init(key, shape, dtype):
        return draw(key, shape, jnp.float32).astype(dtype)

    return init


def xavier_std(fan_in: int, fan_out: int, gain: float = 1.0) -> float:
    """Glorot/Xavier normal standard deviation ``gain * sqrt(2 / (fan_in + fan_out))``.

    ``normal(xavier_std(fan_in, fan_out, gain))`` draws what
    ``jax.nn.initializers.variance_scaling(gain**2, "fan_avg", "normal")`` draws for a
    ``[fan_in, fan_out]`` matrix; the modules take a standard deviation, so the number is what
    they are given.
    """
    return gain * math.sqrt(2.0 / (fan_in + fan_out))


def add_bias(y, b, dtype):
    """``y [..., *b.shape] + b`` (explicit broadcasting), or ``y`` when ``b`` is None."""
    if b is None:
        return y
    b = b[...].astype(dtype)
    return y + b.reshape((1,) * (y.ndim - b.ndim) + b.shape)


def project(x, w, dtype, *, n_in: int = 1, preferred_element_type=None, split: bool = True):
    """``x [*B, *I]`` times ``w [*I, *O]`` (the last ``n_in`` axes of ``x`` against the first ``n_in`` of ``w``)
    in ``dtype``: ``[*B, *O]``, computed as one 2-D product ``[prod B, prod I] @ [prod I, prod O]``.

    The einsum's meaning, in the form XLA's CPU backend differentiates fastest: the weight gradient of an
    einsum over ``x [B, T, D]`` contracts two axes of each operand, which XLA lowers to a transposed copy of
    the output gradient and an Eigen dot with both operands transposed (47 GFLOP/s on one Intel Xeon core);
    the 2-D product's is one ``x^T dy``, an Eigen dot on ``x`` as it is (73-134 GFLOP/s, where YNNPACK runs
    the forward products at ~145). The projections of the attention, the FFNs, the output heads and LoRA's
    adapters go through here (the engine's feature-major FFN copies, inference only, do not); a train step
    is 1.1-1.5x faster for it (experiments/results/train_throughput.md, "Intel"). The reshapes go one group
    of axes at a time, which explicit-sharding meshes accept (a batch axis sharded over ``data``).

    One row (a batch-1 decode step) on the CPU, with at least ``MATVEC_SPLIT_MIN_WEIGHTS`` weights and no mesh
    active (``split`` not False), goes as :func:`split_matvec`'s ``MATVEC_SPLIT`` parts of the contraction (the
    same sum, rounded in another order). The check sees shapes only: under ``vmap`` or a legacy ``with mesh:``
    a one-row example is split too (the same numbers; only the speed may differ).
    """
    lead, inner, outer = x.shape[:x.ndim - n_in], w.shape[:n_in], w.shape[n_in:]
    if x.shape[x.ndim - n_in:] != inner:
        raise ValueError(f"project: x.shape={x.shape} does not end in w.shape[:{n_in}]={inner} ({w.shape=})")
    x2 = x.astype(dtype).reshape(*lead, math.prod(inner)).reshape(math.prod(lead), math.prod(inner))
    w2 = w.astype(dtype).reshape(math.prod(inner), math.prod(outer))
    if split and _split_matvec(x2.shape[0], w2.shape[0], w2.size):
        y = split_matvec(x2, w2, preferred_element_type=preferred_element_type)
    else:
        y = jnp.matmul(x2, w2, preferred_element_type=preferred_element_type)
    return y.reshape(*lead, math.prod(outer)).reshape(lead + outer)


MATVEC_SPLIT = 2
"""How many parts :func:`split_matvec` cuts a one-row product's contraction into (the 2 cores measured)."""
MATVEC_SPLIT_MIN_WEIGHTS = 1 << 17
"""The smallest weight (entries) a one-row product is split for: below it (a 128 x 512 matrix) the two forms ran
alike, and tiny models keep the plain product's rounding."""


def _split_matvec(rows: int, split_len: int, weights: int) -> bool:
    """Whether a product of ``rows`` rows by ``weights`` weights, cut along an axis of ``split_len``, goes split."""
    return (rows == 1 and split_len % MATVEC_SPLIT == 0 and weights >= MATVEC_SPLIT_MIN_WEIGHTS
            and jax.default_backend() == "cpu" and jax.sharding.get_abstract_mesh().empty)


def split_matvec(x, w, *, preferred_element_type=None):
    """``x [1, K] @ w [K, N]`` as ``MATVEC_SPLIT`` products over consecutive slices of ``K`` (one batched dot
    on free reshapes of both operands), summed: ``[1, N]``.

    XLA's CPU backend runs a one-row product ``[1, K] @ [K, N]`` at 13-18 GB/s of weights read on 2 Intel
    Xeon cores (a batch-1 decode step is ~200 of them: the whole model's weights per token), and the batched
    form at 24; a SmolLM2-135M-shaped batch-1 decode is 1.24x as fast for it
    (``experiments/results/decode_cpu.md``, "split one-row products"). From 2 rows on the batched form is
    slower (0.7-0.8x), so only one row takes it.
    """
    (m, k), n, s = x.shape, w.shape[1], MATVEC_SPLIT
    if m != 1 or k % s or w.shape[0] != k:
        raise ValueError(f"split_matvec: needs x [1, K] and w [K, N] with K divisible by {s}, "
                         f"got {x.shape=} {w.shape=}")
    out = jnp.result_type(x, w) if preferred_element_type is None else jnp.dtype(preferred_element_type)
    acc = jnp.promote_types(out, jnp.float32)  # the parts kept in fp32 (bf16 parts would round twice)
    parts = jax.lax.dot_general(x.reshape(s, 1, k // s), w.reshape(s, k // s, n), (((2,), (1,)), ((0,), (0,))),
                                preferred_element_type=acc)
    return parts.sum(0).astype(out)


def project_rows(x, table, dtype, *, preferred_element_type=None):
    """``x [*B, I]`` times the transpose of ``table [O, I]`` (a tied output head: the embedding table): ``[*B, O]``.

    ``project(x, table.T, ...)``; one row on the CPU (the conditions of :func:`project`) goes as
    ``MATVEC_SPLIT`` products over consecutive slices of ``table``'s rows instead (a free reshape of it; a
    split of the contraction would copy the table): each logit the same dot product (XLA's kernels may round
    it differently), 1.6-1.9x as fast for SmolLM2-135M's ``[49152, 576]`` table on 2 Intel Xeon cores.
    """
    rows, s = math.prod(x.shape[:-1]), MATVEC_SPLIT
    if table.ndim != 2 or x.shape[-1:] != table.shape[1:]:
        raise ValueError(f"project_rows: needs a table [O, I] and x [..., I]; got {x.shape=} {table.shape=}")
    if not _split_matvec(rows, table.shape[0], table.size):  # never a split of the transposed table's contraction
        return project(x, table.T, dtype, preferred_element_type=preferred_element_type, split=False)
    o, i = table.shape
    x3 = jnp.broadcast_to(x.astype(dtype).reshape(1, 1, i), (s, 1, i))
    parts = jax.lax.dot_general(x3, table.astype(dtype).reshape(s, o // s, i), (((2,), (2,)), ((0,), (0,))),
                                preferred_element_type=preferred_element_type)  # [s, 1, O/s]
    return parts.reshape(x.shape[:-1] + (o,))


def eager_sharding() -> bool:
    """Whether new parameters are sharded at creation (flax's eager sharding on, a mesh and rules active)."""
    return bool(
        nnx.using_eager_sharding() and meta.global_mesh_defined() and core_spmd.get_logical_axis_rules()
    )


def param(rngs: nnx.Rngs, init: Initializer, shape: Sequence[int], axes: Sequence[str | None],
          dtype) -> nnx.Param:
    """Create ``nnx.Param(init(key, shape, dtype))`` tagged with logical ``axes``."""
    shape, axes = tuple(int(s) for s in shape), tuple(axes)
    if len(axes) != len(shape):
        raise ValueError(f"axes {axes} do not match shape {shape}")
    bad = [a for a in axes if a is not None and a not in LOGICAL_AXES]
    if bad:
        raise ValueError(f"unknown logical axes {bad}; use {LOGICAL_AXES} or None")
    value = init(rngs.params(), shape, as_dtype(dtype))
    return nnx.Param(value, out_sharding=axes, eager_sharding=eager_sharding())
