"""What both flash-attention kernels (GPU and TPU) mean by a mask, a block and a bad input.

Positions: keys sit at ``0 .. S-1``; query ``i`` at ``q_offset + i`` with
``q_offset=None`` meaning ``S - T`` (bottom-right aligned). Logit order, per
tile: ``s = scale * q·k`` (fp32) -> ``softcap * tanh(s / softcap)`` ->
``- slope * |q_pos - k_pos|`` (ALiBi) -> mask -> softmax.

The mask of a tile is :func:`pallas_kernels.mask.mask_rule` (the rule every
attention path evaluates) applied by :func:`tile_allowed` with the kernel's
static :class:`MaskParams`, plus the true key length ``S``: padding added by the
wrappers is never attended.

A row with no allowed key has output 0 and stores ``lse = EMPTY_ROW_LSE``
(``+inf``), so ``exp(s - lse) == 0`` in the backward pass and its gradients are 0.

Block liveness (:func:`kv_block_range`, :func:`q_block_range`) is computed
from the static fields only, with the same meaning as
``jaxformer.ops.masks.MaskSpec.block_map`` (this package may not import
jaxformer; the tests compare the two).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.mask import mask_rule

EMPTY_ROW_LSE = float("inf")
MAX_HEAD_DIM = 256
BACKENDS = ("gpu", "tpu")


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pad_axis(x, axis: int, size: int):
    """Zero-pad ``x`` along ``axis`` up to ``size`` (None passes through)."""
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


# --------------------------------------------------------------------------- block sizes


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes. ``*_dkv`` / ``*_dq`` are the backward kernels' tiles; None means the forward ones."""

    block_q: int
    block_k: int
    block_q_dkv: int | None = None
    block_k_dkv: int | None = None
    block_q_dq: int | None = None
    block_k_dq: int | None = None

    @classmethod
    def default(cls, backend: str) -> "BlockSizes":
        """Generic tiles per backend. The GPU dispatcher does not use these: it takes its tiles (and warps,
        stages) from :mod:`pallas_kernels.block_table`, per architecture, head dim and dtype."""
        if backend == "gpu":
            return cls(block_q=128, block_k=64, block_q_dkv=64, block_k_dkv=128, block_q_dq=128, block_k_dq=64)
        if backend == "tpu":
            return cls(block_q=512, block_k=512, block_q_dkv=512, block_k_dkv=512, block_q_dq=512, block_k_dq=512)
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")

    def resolved(self) -> "BlockSizes":
        """Fill the None backward sizes from the forward ones."""
        return BlockSizes(
            block_q=self.block_q,
            block_k=self.block_k,
            block_q_dkv=self.block_q if self.block_q_dkv is None else self.block_q_dkv,
            block_k_dkv=self.block_k if self.block_k_dkv is None else self.block_k_dkv,
            block_q_dq=self.block_q if self.block_q_dq is None else self.block_q_dq,
            block_k_dq=self.block_k if self.block_k_dq is None else self.block_k_dq,
        )

    def clipped(self, T: int, S: int, minimum: int = 1) -> "BlockSizes":
        """Shrink each q (k) tile to at most ``next_pow2(T)`` (``S``), never below ``minimum``."""
        r = self.resolved()
        cq = max(minimum, next_pow2(T))
        ck = max(minimum, next_pow2(S))
        return BlockSizes(
            block_q=min(r.block_q, cq),
            block_k=min(r.block_k, ck),
            block_q_dkv=min(r.block_q_dkv, cq),
            block_k_dkv=min(r.block_k_dkv, ck),
            block_q_dq=min(r.block_q_dq, cq),
            block_k_dq=min(r.block_k_dq, ck),
        )

    def as_dict(self) -> dict[str, int | None]:
        return dataclasses.asdict(self)

    def fit(self, H: int, itemsize: int, max_tile_bytes: int, minimum: int = 1) -> "BlockSizes":
        """Halve the larger tile of each (q, k) pair until :func:`tile_bytes` fits ``max_tile_bytes``."""
        r = self.resolved().as_dict()
        for q_name, k_name in (("block_q", "block_k"), ("block_q_dkv", "block_k_dkv"), ("block_q_dq", "block_k_dq")):
            while tile_bytes(r[q_name], r[k_name], H, itemsize) > max_tile_bytes:
                name = q_name if r[q_name] >= r[k_name] else k_name
                if r[name] // 2 < minimum:
                    break
                r[name] //= 2
        return BlockSizes(**r)


def tile_bytes(bq: int, bk: int, H: int, itemsize: int) -> int:
    """Bytes of one q tile, k and v tiles and the fp32 ``[bq, bk]`` logits."""
    return (bq + 2 * bk) * H * itemsize + bq * bk * 4


def check_block_sizes(block_sizes: BlockSizes, *, pow2: bool = True, minimum: int = 1,
                      multiple_of: int = 1, H: int | None = None, itemsize: int | None = None,
                      max_tile_bytes: int | None = None) -> BlockSizes:
    """Validate (and resolve) block sizes; raise ValueError naming the bad field.

    ``max_tile_bytes``: with ``H`` and ``itemsize``, reject tiles whose q, k, v
    blocks plus the fp32 ``[block_q, block_k]`` logits do not fit this budget.
    """
    if not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a BlockSizes, got {type(block_sizes).__name__}")
    bs = block_sizes.resolved()
    for name, value in bs.as_dict().items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"BlockSizes.{name}={value!r} must be a positive int")
        if pow2 and not _is_pow2(int(value)):
            raise ValueError(f"BlockSizes.{name}={value} must be a power of two")
        if value < minimum:
            raise ValueError(f"BlockSizes.{name}={value} is below the minimum {minimum} for this backend")
        if value % multiple_of:
            raise ValueError(f"BlockSizes.{name}={value} must be a multiple of {multiple_of} on this backend")
    if max_tile_bytes is not None and H is not None and itemsize is not None:
        for bq, bk, which in ((bs.block_q, bs.block_k, "forward"),
                              (bs.block_q_dkv, bs.block_k_dkv, "dkv"),
                              (bs.block_q_dq, bs.block_k_dq, "dq")):
            need = tile_bytes(bq, bk, H, itemsize)
            if need > max_tile_bytes:
                raise ValueError(
                    f"{which} tiles block_q={bq}, block_k={bk} with head dim H={H} need {need} bytes, "
                    f"more than the {max_tile_bytes} bytes this backend allows; use smaller blocks"
                )
    return bs


# --------------------------------------------------------------------------- static mask params


@dataclasses.dataclass(frozen=True)
class MaskParams:
    """Static (hashable) mask and logit description with every default resolved.

    ``q_len``/``kv_len`` are the true lengths T and S before any padding.
    ``window`` is None or ``(left, right)`` with None sides unbounded; ``(None, None)`` becomes None.
    """

    q_len: int
    kv_len: int
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    q_offset: int = 0
    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def make(cls, T: int, S: int, H: int, *, causal: bool = False, window=None,
             q_offset: int | None = None, scale: float | None = None,
             softcap: float | None = None) -> "MaskParams":
        window = check_window(window)
        return cls(
            q_len=int(T),
            kv_len=int(S),
            causal=bool(causal),
            window=window,
            q_offset=int(S - T) if q_offset is None else int(q_offset),
            scale=float(1.0 / math.sqrt(H) if scale is None else scale),
            softcap=None if softcap is None else float(softcap),
        )


def check_window(window) -> tuple[int | None, int | None] | None:
    if window is None:
        return None
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be (left, right), got {window!r}") from None
    for side in (left, right):
        if side is not None and (isinstance(side, bool) or not isinstance(side, (int, np.integer)) or side < 0):
            raise ValueError(f"window sides must be non-negative ints or None, got {window!r}")
    if left is None and right is None:
        return None
    return (None if left is None else int(left), None if right is None else int(right))


# --------------------------------------------------------------------------- tiles (pure jnp)


def tile_allowed(params: MaskParams, q_pos, k_pos, *, q_seg=None, kv_seg=None, kv_length=None,
                 check_kv_len: bool = True, pattern=None):
    """Boolean allowed tile from absolute positions: :func:`pallas_kernels.mask.mask_rule` with ``params``.

    ``q_pos`` int32 ``[bq, 1]`` (or ``[bq, bk]``), ``k_pos`` int32 ``[1, bk]`` (or ``[bq, bk]``);
    ``q_seg``/``kv_seg`` broadcastable the same way; ``kv_length`` a scalar. ``check_kv_len``
    masks ``k_pos >= S`` (wrapper padding); pass False when the kv axis is not padded.
    ``pattern``: the rule's pattern terms (from :func:`pattern_terms`), or None.
    Returns a bool array of the broadcast shape, or None when nothing can be masked.
    """
    return mask_rule(q_pos, k_pos, causal=params.causal, window=params.window, q_segment=q_seg,
                     kv_segment=kv_seg, kv_length=kv_length, num_keys=params.kv_len if check_kv_len else None,
                     **(pattern or {}))


def alibi_tile(slope, q_pos, k_pos):
    """ALiBi bias tile ``-slope * |q_pos - k_pos|`` in fp32 (slope a scalar)."""
    return -jnp.asarray(slope, jnp.float32) * jnp.abs(q_pos - k_pos).astype(jnp.float32)


def tile_logits(params: MaskParams, qk, q_pos=None, k_pos=None, slope=None):
    """``qk`` fp32 raw ``q·k`` tile -> (logits before masking, d logits / d qk).

    The derivative is ``scale`` (a Python float) without softcap, else the tile
    ``scale * (1 - tanh(s/softcap)^2)``. ALiBi needs ``q_pos``, ``k_pos`` and ``slope``.
    """
    s = qk * params.scale
    dscale: Any = params.scale
    if params.softcap is not None:
        t = jnp.tanh(s / params.softcap)
        s = params.softcap * t
        dscale = params.scale * (1.0 - t * t)
    if slope is not None:
        s = s + alibi_tile(slope, q_pos, k_pos)
    return s, dscale


def mask_logits(s, allowed):
    return s if allowed is None else jnp.where(allowed, s, -jnp.inf)


def safe_max(m):
    """A running max with -inf (empty so far) replaced by 0, so ``exp(s - m)`` never sees inf - inf."""
    return jnp.where(m == -jnp.inf, 0.0, m)


def finalize_lse(m, l):
    """Row log-sum-exp from running max ``m`` and sum ``l``; empty rows get ``EMPTY_ROW_LSE``."""
    return jnp.where(l == 0.0, EMPTY_ROW_LSE, safe_max(m) + jnp.log(jnp.where(l == 0.0, 1.0, l)))


# --------------------------------------------------------------------------- block liveness


def _div(a, b: int):
    """Floor division of a non-negative int (Python or traced int32) by a positive Python int."""
    if isinstance(a, (int, np.integer)):
        return int(a) // b
    return jax.lax.div(a, jnp.asarray(b, a.dtype))


def _max(a, b):
    if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
        return max(int(a), int(b))
    return jnp.maximum(a, b)


def _min(a, b):
    if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
        return min(int(a), int(b))
    return jnp.minimum(a, b)


def _where(c, a, b):
    if isinstance(c, (bool, np.bool_)):
        return a if c else b
    return jnp.where(c, a, b)


def kv_block_range(params: MaskParams, qi, bq: int, bk: int):
    """Live kv blocks of q block ``qi`` as ``[lo, hi)`` (``lo >= hi``: none). ``qi`` int or traced int32.

    Equal to the True run of row ``qi`` of ``MaskSpec.block_map`` (live blocks form one run).
    """
    T, S, off = params.q_len, params.kv_len, params.q_offset
    nk = -(-S // bk)
    lo, hi = 0, nk
    q_lo = qi * bq + off
    q_hi = _min(qi * bq + bq, T) - 1 + off
    last = None
    if params.causal:
        last = q_hi
    if params.window is not None:
        left, right = params.window
        if right is not None:
            last = q_hi + right if last is None else _min(last, q_hi + right)
        if left is not None:
            first = q_lo - left
            lo = _where(first > S - 1, nk, _div(_max(first, 0), bk))
    if last is not None:
        hi = _min(hi, _div(_max(last, -1) + bk, bk))
    return lo, hi


def kv_unmasked_range(params: MaskParams, qi, bq: int, bk: int):
    """Kv blocks ``[lo, hi)`` that causal, window and the key length ``S`` leave wholly allowed for q block ``qi``.

    Inside it a kernel may skip the static mask (segments and kv lengths still apply).
    May be empty or stick out of :func:`kv_block_range`; clamp to it.
    """
    T, S, off = params.q_len, params.kv_len, params.q_offset
    lo, hi = 0, S // bk
    q_lo = qi * bq + off
    q_hi = _min(qi * bq + bq, T) - 1 + off
    last = None  # every q row sees keys <= last
    if params.causal:
        last = q_lo
    if params.window is not None:
        left, right = params.window
        if right is not None:
            last = q_lo + right if last is None else _min(last, q_lo + right)
        if left is not None:
            lo = _div(_max(q_hi - left, 0) + bk - 1, bk)
    if last is not None:
        hi = _min(hi, _div(_max(last + 1, 0), bk))
    return lo, hi


def q_block_range(params: MaskParams, kj, bq: int, bk: int):
    """Live q blocks of kv block ``kj`` as ``[lo, hi)``; the column counterpart of :func:`kv_block_range`."""
    T, S, off = params.q_len, params.kv_len, params.q_offset
    nq = -(-T // bq)
    lo, hi = 0, nq
    k_lo = kj * bk
    k_hi = _min(kj * bk + bk, S) - 1
    first = None  # smallest q position that may see this block
    if params.causal:
        first = k_lo
    if params.window is not None:
        left, right = params.window
        if right is not None:
            first = k_lo - right if first is None else _max(first, k_lo - right)
        if left is not None:
            last = k_hi + left - off
            hi = _min(hi, _div(_max(last, -1) + bq, bq))
    if first is not None:
        rel = first - off
        # block qi is live iff q_hi(qi) >= first, q_hi(qi) = min(qi*bq + bq, T) - 1 + off
        lo = _where(rel > T - 1, nq, _div(_max(rel, 0), bq))
    return lo, hi


# --------------------------------------------------------------------------- input validation


def check_qkv(q, k, v) -> tuple[int, int, int, int, int, int]:
    """Validate attention operand shapes ``q [B,T,N,H]``, ``k, v [B,S,K,H]``; return (B, T, S, N, K, H).

    The shape check of every attention path: the kernels' :func:`check_inputs` and ``jaxformer.ops``.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"attention expects q [B,T,N,H] and k, v [B,S,K,H]; got {q.shape=} {k.shape=} {v.shape=}"
        )
    B, T, N, H = q.shape
    Bk, S, K, Hk = k.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [B,S,K,H]; got {k.shape=} {v.shape=}")
    if Bk != B:
        raise ValueError(f"batch mismatch: {q.shape=} {k.shape=}")
    if Hk != H:
        raise ValueError(f"head dim mismatch: {q.shape=} {k.shape=}")
    if K == 0 or N % K != 0:
        raise ValueError(f"{q.shape=} {k.shape=}: heads {N} not divisible by kv heads {K}")
    return B, T, S, N, K, H


def check_slopes(alibi_slopes, B: int, N: int):
    """ALiBi slopes as fp32 ``[1 or B, N]`` (from ``[N]`` or ``[B, N]``), or None; ValueError naming the shape."""
    if alibi_slopes is None:
        return None
    slopes = jnp.asarray(alibi_slopes, jnp.float32)
    if slopes.shape == (N,):
        slopes = slopes[None, :]
    if slopes.shape != (1, N) and slopes.shape != (B, N):
        raise ValueError(f"alibi_slopes.shape={jnp.shape(alibi_slopes)} must be [N]=({N},) or [B, N]=({B}, {N})")
    return slopes


def check_inputs(q, k, v, *, window=None, q_segment_ids=None, kv_segment_ids=None, kv_lengths=None,
                 q_offset=None, alibi_slopes=None, softcap=None, scale=None, block_map=None, q_global=None,
                 kv_global=None, random_kv_starts=None, random_block_size=None,
                 max_head_dim: int = MAX_HEAD_DIM) -> tuple[int, int, int, int, int, int]:
    """Validate every ``flash_attention`` argument but the block sizes; return (B, T, S, N, K, H).

    Shapes by :func:`check_qkv`, then what the kernels need on top: non-empty operands, ``H <= max_head_dim``,
    float dtypes, integer ids and lengths, a static ``q_offset``, the window and the block-sparse keywords.
    """
    B, T, S, N, K, H = check_qkv(q, k, v)
    if T == 0 or S == 0 or B == 0:
        raise ValueError(f"empty attention operands: {q.shape=} {k.shape=}")
    if not 1 <= H <= max_head_dim:
        raise ValueError(f"head dim H={H} is unsupported (must be 1..{max_head_dim}); {q.shape=}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
            raise ValueError(f"{name}.dtype={x.dtype} is unsupported; use float32, bfloat16 or float16")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype=} {k.dtype=} {v.dtype=}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("pass both q_segment_ids [B, T] and kv_segment_ids [B, S], or neither")
    if q_segment_ids is not None:
        if tuple(jnp.shape(q_segment_ids)) != (B, T):
            raise ValueError(f"q_segment_ids.shape={tuple(jnp.shape(q_segment_ids))} must be (B, T)=({B}, {T})")
        if tuple(jnp.shape(kv_segment_ids)) != (B, S):
            raise ValueError(f"kv_segment_ids.shape={tuple(jnp.shape(kv_segment_ids))} must be (B, S)=({B}, {S})")
        for name, x in (("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)):
            if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
                raise ValueError(f"{name}.dtype={jnp.result_type(x)} must be an integer type")
    if kv_lengths is not None:
        if tuple(jnp.shape(kv_lengths)) != (B,):
            raise ValueError(f"kv_lengths.shape={tuple(jnp.shape(kv_lengths))} must be (B,)=({B},)")
        if not jnp.issubdtype(jnp.result_type(kv_lengths), jnp.integer):
            raise ValueError(f"kv_lengths.dtype={jnp.result_type(kv_lengths)} must be an integer type")
    if q_offset is not None and (isinstance(q_offset, bool) or not isinstance(q_offset, (int, np.integer))):
        raise ValueError(
            f"q_offset must be a static Python int or None (bottom-right, S - T), got {type(q_offset).__name__}; "
            "for traced offsets use jaxformer.ops.blockwise"
        )
    check_slopes(alibi_slopes, B, N)
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"softcap={softcap!r} must be a positive float or None")
    if scale is not None and not isinstance(scale, (int, float, np.floating)):
        raise ValueError(f"scale={scale!r} must be a Python float or None")
    check_window(window)
    check_pattern(B, T, S, N, block_map=block_map, q_global=q_global, kv_global=kv_global,
                  random_kv_starts=random_kv_starts, random_block_size=random_block_size)
    return B, T, S, N, K, H


def slopes_bn(alibi_slopes, B: int, N: int):
    """ALiBi slopes as fp32 ``[B, N]`` (from ``[N]`` or ``[B, N]``), or None."""
    slopes = check_slopes(alibi_slopes, B, N)
    return None if slopes is None else jnp.broadcast_to(slopes, (B, N))


# --------------------------------------------------------------------------- block-sparse patterns
#
# Longformer / BigBird masks widen the window's band. Every kernel takes the same keywords
# (see ``api.flash_attention``); ``Nh`` is 1 (one pattern for all heads) or N (one per query head),
# ``Bg`` is 1 or B:
#
#   block_map(block_q, block_k) -> bool [Nh, ceil(T/block_q), ceil(S/block_k)]   (static numpy)
#       True where a tile may hold an allowed element. Kernels visit exactly these tiles (forward,
#       dq and dk/dv), whatever causal/window say; a tile absent from the map is never read.
#   q_global  [Bg, T] bool/int: query row sees every key (under the hard constraints).
#   kv_global [Bg, S] bool/int: key column is seen by every query.
#   random_kv_starts int32 [Nh, r, T], random_block_size R: query row q of head h also sees keys
#       random_kv_starts[h, i, q] <= k_pos < random_kv_starts[h, i, q] + R (i < r; -1 = no block).
#
# Element meaning, per tile: pallas_kernels.mask.mask_rule with q_global[q], kv_global[k] and
# random[h, q, k] as its pattern terms (they widen the window's band; without a window they change
# nothing), from pattern_terms.


def pattern_given(q_global=None, kv_global=None, random_kv_starts=None) -> bool:
    return q_global is not None or kv_global is not None or random_kv_starts is not None


def check_pattern(B: int, T: int, S: int, N: int, *, block_map=None, q_global=None, kv_global=None,
                  random_kv_starts=None, random_block_size=None) -> None:
    """Validate the block-sparse keywords (see the section comment); raise ValueError naming the shapes."""
    if block_map is not None and not callable(block_map):
        raise ValueError(f"block_map must be a callable (block_q, block_k) -> bool [Nh, nq, nk], "
                         f"got {type(block_map).__name__}")
    if pattern_given(q_global, kv_global, random_kv_starts) and block_map is None:
        raise ValueError("q_global / kv_global / random_kv_starts need a block_map listing the tiles they open")
    for name, x, n in (("q_global", q_global, T), ("kv_global", kv_global, S)):
        if x is not None and (np.ndim(x) != 2 or np.shape(x)[0] not in (1, B) or np.shape(x)[1] != n):
            raise ValueError(f"{name}.shape={tuple(np.shape(x))} must be (1 or B, {n}) with B={B}")
    if random_kv_starts is not None:
        shape = tuple(np.shape(random_kv_starts))
        if len(shape) != 3 or shape[0] not in (1, N) or shape[2] != T:
            raise ValueError(f"random_kv_starts.shape={shape} must be (1 or N, r, T) with N={N}, T={T}")
        if isinstance(random_block_size, bool) or not isinstance(random_block_size, (int, np.integer)) \
                or random_block_size <= 0:
            raise ValueError(f"random_block_size={random_block_size!r} must be a positive int with random_kv_starts")


def live_blocks(block_map, T: int, S: int, N: int, bq: int, bk: int) -> np.ndarray:
    """``block_map(bq, bk)`` checked: bool ``[Nh, ceil(T/bq), ceil(S/bk)]`` with Nh 1 or N."""
    live = np.asarray(block_map(bq, bk))
    nq, nk = -(-T // bq), -(-S // bk)
    if live.ndim == 2:
        live = live[None]
    if live.ndim != 3 or live.shape[0] not in (1, N) or live.shape[1:] != (nq, nk):
        raise ValueError(f"block_map({bq}, {bk}).shape={live.shape} must be (1 or N, {nq}, {nk}) for "
                         f"T={T}, S={S}, N={N}")
    return live.astype(bool)


def block_lists(live: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row lists of a bool ``[Nh, nr, nc]`` map: ``(idx int32 [Nh, nr, w], count int32 [Nh, nr])``.

    ``idx[h, i, :count[h, i]]`` are the True columns of row ``i``, ascending; the rest repeats the
    last listed column (0 for an empty row) so a prefetching kernel never fetches a new tile there.
    ``w = max(1, max count)``. For the dk/dv kernels pass ``live.transpose(0, 2, 1)``.
    """
    live = np.asarray(live, bool)
    count = live.sum(axis=-1)
    width = max(1, int(count.max()) if count.size else 1)
    order = np.argsort(~live, axis=-1, kind="stable")[..., :width]
    last = np.take_along_axis(order, np.maximum(count - 1, 0)[..., None], axis=-1)
    last = np.where(count[..., None] > 0, last, 0)
    idx = np.where(np.arange(width) < count[..., None], order, last)
    return idx.astype(np.int32), count.astype(np.int32)


def pattern_terms(k_pos, *, q_glob=None, kv_glob=None, rand_starts=(), rand_size: int = 1) -> dict:
    """The mask rule's pattern keywords of a tile from the kernel operands: ``q_glob`` ``[bq, 1]``,
    ``kv_glob`` ``[1, bk]`` (nonzero = global), ``rand_starts`` a sequence of ``[bq, 1]`` int32 block
    starts (-1 none). Absent terms are None."""
    random = None
    for st in rand_starts:
        hit = (st >= 0) & (k_pos >= st) & (k_pos < st + rand_size)
        random = hit if random is None else random | hit
    return {"q_global": None if q_glob is None else q_glob != 0,
            "kv_global": None if kv_glob is None else kv_glob != 0, "random": random}
