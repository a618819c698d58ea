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

import functools
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
    adapters go through here (the engine's transposed copies, inference only, through :func:`project_t`); a train step
    is 1.1-1.5x faster for it (experiments/results/train_throughput.md, "Intel"). The reshapes go one group
    of axes at a time, which explicit-sharding meshes accept (a batch axis sharded over ``data``). On the CPU a tall
    weight (``prod I >= TALL_RATIO * prod O``) times two rows or more goes through :func:`tall_product`, whose weight
    gradient is the wide ``(dy^T x)^T`` (never one row: see below).

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
    elif _wide_weight_gradient(*x2.shape, w2.shape[1]):
        y = tall_product(x2, w2, preferred_element_type)
    else:
        y = jnp.matmul(x2, w2, preferred_element_type=preferred_element_type)
    return y.reshape(*lead, math.prod(outer)).reshape(lead + outer)


TALL_RATIO = 2
"""A weight ``[I, O]`` with ``I >= TALL_RATIO * O`` (the FFN's down projection, LoRA's ``A``, a GQA model's K / V) is
tall: on the CPU its weight gradient takes the wide form (:func:`tall_product`)."""


def _wide_weight_gradient(rows: int, inner: int, outer: int) -> bool:
    """Whether a product of ``rows`` rows by a weight ``[inner, outer]`` goes through :func:`tall_product`."""
    return rows >= 2 and inner >= TALL_RATIO * outer and jax.default_backend() == "cpu"


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def tall_product(x, w, preferred_element_type=None):
    """``x [N, I] @ w [I, O]``, whose weight gradient reverse mode computes in the wide form: ``(dy^T x)^T``, the
    ``[O, I]`` product behind an optimisation barrier, then transposed, instead of the tall ``x^T dy``.

    XLA's CPU backend runs both as an Eigen dot contracting the rows of both operands, the tall one often slower:
    nanoGPT's FFN down-projection gradient ``[1024, 1024]^T x [1024, 256]`` alone took 8.0 ms on one Zen 4 core
    against 5.6 for the wide form (5.0 against 3.8 ms on two threads; on Zen 3 the wide form was the slower on one
    core). A GPT-2 of the main job's width (d 128) trains 1.05x as fast for it on 2 Zen 4 cores, nanoGPT's shape
    0.96-1.05x, both level on Zen 3 (``experiments/results/train_throughput.md``, seventeenth and fourteenth stops).
    The barrier keeps XLA from folding the transpose back into the product. Forward and input gradient as
    ``jnp.matmul``; a tangent of ``w`` that is a symbolic zero (a frozen weight) costs no product."""
    return jnp.matmul(x, w, preferred_element_type=preferred_element_type)


@functools.partial(tall_product.defjvp, symbolic_zeros=True)
def _tall_product_jvp(preferred_element_type, primals, tangents):
    x, w = primals
    dx, dw = tangents
    y = tall_product(x, w, preferred_element_type)
    terms = []
    if not isinstance(dx, jax.custom_derivatives.SymbolicZero):
        terms.append(jnp.matmul(dx, w, preferred_element_type=preferred_element_type))
    if not isinstance(dw, jax.custom_derivatives.SymbolicZero):  # x dw = (dw^T x^T)^T; transposed: (dy^T x)^T
        wide = jnp.matmul(jax.lax.optimization_barrier(dw.T), x.T, preferred_element_type=preferred_element_type)
        terms.append(wide.T)
    return y, functools.reduce(jnp.add, terms) if terms else jnp.zeros_like(y)


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


FEATURE_MAJOR_ROWS = range(2, 33)
"""Rows (tokens in a call) a module holding :class:`TransposedCopy` weights computes feature-major."""


class TransposedCopy(nnx.Variable):
    """A weight ``[*S, *I, *O]`` (``S``: stacked layers) laid out ``[*S, *O, *I]``: a copy for feature-major calls,
    added by :func:`add_transposed_copies`; not a parameter (never trained or saved)."""


def project_t(x, wt, dtype, *, n_in: int = 1, preferred_element_type=None):
    """``x [*B, *I]`` times the weight ``W [*I, *O]`` given as ``wt [*O, *I]`` (its :class:`TransposedCopy`, or a
    tied head's table): ``[*B, *O]``, :func:`project`'s value, computed feature-major as ``wt @ x^T``.

    XLA's CPU backend tiles a product's result by its rows: with a few tokens as the rows (``x @ W``) the tiles
    are mostly empty and every weight is packed for them; with the output features as the rows they are full, and
    2-32 rows run 1.3-2.8x as fast (``experiments/results/decode_matmul_cpu.md``: 2.1x at 4 rows, 2.8x at 16,
    SmolLM2-135M's matrices and head on 2 Zen 2 cores). The ``[O, rows]`` result goes back
    to rows behind an optimisation barrier: without it XLA folds the transpose into the product, back at
    ``x @ W^T``. For inference (the decode engine's step model): gradients flow, to the copy.
    """
    lead, inner = x.shape[:x.ndim - n_in], x.shape[x.ndim - n_in:]
    outer = wt.shape[:wt.ndim - n_in]
    if wt.shape[wt.ndim - n_in:] != inner:
        raise ValueError(f"project_t: x.shape={x.shape} does not end in wt.shape[-{n_in}:] "
                         f"({wt.shape=}: the weight's output axes first)")
    x2 = x.astype(dtype).reshape(*lead, math.prod(inner)).reshape(math.prod(lead), math.prod(inner))  # as project
    w2 = wt.astype(dtype).reshape(math.prod(outer), math.prod(inner))
    y = jax.lax.dot_general(w2, x2, (((1,), (1,)), ((), ())), preferred_element_type=preferred_element_type)
    return jax.lax.optimization_barrier(y).T.reshape(lead + outer)


def rows(x, n_in: int = 1) -> int:
    """The rows of a call on ``x [*B, *I]`` (``n_in`` input axes): ``prod(B)``, what :func:`runs_feature_major`
    decides by."""
    return math.prod(x.shape[:x.ndim - n_in])


def adapted(module) -> bool:
    """Whether ``module`` holds a LoRA adapter (an attribute ``*_lora`` that is not None)."""
    return any(k.endswith("_lora") and v is not None for k, v in vars(module).items())


def runs_feature_major(module, rows: int) -> bool:
    """Whether a call of ``module`` on ``rows`` rows reads its :class:`TransposedCopy` weights: ``rows`` in
    :data:`FEATURE_MAJOR_ROWS`, a copy of each weight its class's ``TRANSPOSED`` names (those it has), no
    adapter (the feature-major path would bypass it), no statistics recorded."""
    spec = getattr(type(module), "TRANSPOSED", None)
    spec = spec if isinstance(spec, dict) else {}  # a tied head's name of its own table: Embed.attend decides
    return (rows in FEATURE_MAJOR_ROWS and bool(spec) and not getattr(module, "record_stats", False)
            and all(isinstance(getattr(module, f"{k}_t", None), TransposedCopy)
                    for k in spec if getattr(module, k, None) is not None)
            and not adapted(module))


def add_transposed_copies(model: nnx.Module, min_weights: int = 0) -> int:
    """Give every module of ``model`` whose class names weights in ``TRANSPOSED`` (``{name: (input axes, output
    axes)}``: the attention's and the FFNs' projections, an untied head) and that holds no
    adapter, where its first such weight has at least ``min_weights`` entries per layer, a
    :class:`TransposedCopy` ``{name}_t`` of each, in place; a module whose ``TRANSPOSED`` names one weight
    laid out feature-major already (a tied head, ``Embed``: its table ``[V, D]``) is marked to run so
    (``feature_major = True``), from the same size on (an untied model's input ``Embed`` too: harmless, its
    ``attend`` is never called). Stacked (scanned) layers get stacked copies. Returns how many modules got copies
    or a mark. The copies hold the same numbers: a new model state."""
    todo, marked = [], 0
    for _, m in nnx.iter_modules(model):
        spec = getattr(type(m), "TRANSPOSED", None)
        if spec is None or adapted(m):
            continue
        if isinstance(spec, str):  # the weight named is laid out feature-major already (a tied head's table)
            if math.prod(getattr(m, spec).shape[-2:]) >= min_weights:
                m.feature_major = True
                marked += 1
            continue
        names = [k for k in spec if getattr(m, k, None) is not None]
        if not names:
            continue
        first = getattr(m, names[0])
        n_in, n_out = spec[names[0]]
        if math.prod(first.shape[first.ndim - n_in - n_out:]) >= min_weights:
            todo += [(m, k, spec[k]) for k in names]
    copies = _transposed([getattr(m, k)[...] for m, k, _ in todo], tuple(axes for _, _, axes in todo))
    for (m, k, _), w in zip(todo, copies):
        setattr(m, f"{k}_t", TransposedCopy(w))
    return len({id(m) for m, _, _ in todo}) + marked


@functools.partial(jax.jit, static_argnums=1)
def _transposed(ws, axes):  # one call: 60 eager transposes cost 3x the copy
    out = []
    for w, (n_in, n_out) in zip(ws, axes):
        s = w.ndim - n_in - n_out
        out.append(jnp.transpose(w, (*range(s), *range(s + n_in, w.ndim), *range(s, s + n_in))))
    return out


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
