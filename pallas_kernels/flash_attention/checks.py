"""Input checks of the flash kernels: every argument of ``flash_attention`` but the block sizes.

Each check raises ``ValueError`` naming the shapes or the keyword, at trace time, and returns
the value normalised as the kernels take it (defaults resolved, ids int32).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from pallas_kernels.flash_attention.tiles import Logits
from pallas_kernels.kernel_mask import KernelMask
from pallas_kernels.shapes import check_qkv, check_slopes, check_window

MAX_HEAD_DIM = 256


def check_operands(q, k, v, max_head_dim: int = MAX_HEAD_DIM) -> tuple[int, int, int, int, int, int]:
    """Shapes by :func:`~pallas_kernels.shapes.check_qkv`, then what the kernels need on top: non-empty
    operands, ``H <= max_head_dim``, equal float dtypes. Returns (B, T, S, N, K, H)."""
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
    return B, T, S, N, K, H


def _check_ids(mask: KernelMask, B: int) -> None:
    T, S = mask.q_len, mask.kv_len
    q_seg, kv_seg = mask.q_segment_ids, mask.kv_segment_ids
    if (q_seg is None) != (kv_seg is None):
        raise ValueError("pass both q_segment_ids [B, T] and kv_segment_ids [B, S], or neither")
    if q_seg is not None:
        if tuple(jnp.shape(q_seg)) != (B, T):
            raise ValueError(f"q_segment_ids.shape={tuple(jnp.shape(q_seg))} must be (B, T)=({B}, {T})")
        if tuple(jnp.shape(kv_seg)) != (B, S):
            raise ValueError(f"kv_segment_ids.shape={tuple(jnp.shape(kv_seg))} must be (B, S)=({B}, {S})")
        for name, x in (("q_segment_ids", q_seg), ("kv_segment_ids", kv_seg)):
            if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
                raise ValueError(f"{name}.dtype={jnp.result_type(x)} must be an integer type")
    lengths = mask.kv_lengths
    if lengths is not None:
        if tuple(jnp.shape(lengths)) != (B,):
            raise ValueError(f"kv_lengths.shape={tuple(jnp.shape(lengths))} must be (B,)=({B},)")
        if not jnp.issubdtype(jnp.result_type(lengths), jnp.integer):
            raise ValueError(f"kv_lengths.dtype={jnp.result_type(lengths)} must be an integer type")
    offset = mask.q_offset
    if offset is not None and (isinstance(offset, bool) or not isinstance(offset, (int, np.integer))):
        raise ValueError(
            f"q_offset must be a static Python int or None (bottom-right, S - T), got {type(offset).__name__}; "
            "for traced offsets use jaxformer.ops.blockwise"
        )


def _check_pattern(mask: KernelMask, B: int, N: int) -> None:
    """The block-sparse operands (see ``flash_attention``'s docstring)."""
    T, S = mask.q_len, mask.kv_len
    if mask.block_map is not None and not callable(mask.block_map):
        raise ValueError(f"block_map must be a callable (block_q, block_k) -> bool [Nh, nq, nk], "
                         f"got {type(mask.block_map).__name__}")
    if mask.has_pattern and mask.block_map is None:
        raise ValueError("q_global / kv_global / random_kv_starts need a block_map listing the tiles they open")
    for name, x, n in (("q_global", mask.q_global, T), ("kv_global", mask.kv_global, S)):
        if x is not None and (np.ndim(x) != 2 or np.shape(x)[0] not in (1, B) or np.shape(x)[1] != n):
            raise ValueError(f"{name}.shape={tuple(np.shape(x))} must be (1 or B, {n}) with B={B}")
    if mask.random_kv_starts is not None:
        shape = tuple(np.shape(mask.random_kv_starts))
        size = mask.random_block_size
        if len(shape) != 3 or shape[0] not in (1, N) or shape[2] != T:
            raise ValueError(f"random_kv_starts.shape={shape} must be (1 or N, r, T) with N={N}, T={T}")
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size <= 0:
            raise ValueError(f"random_block_size={size!r} must be a positive int with random_kv_starts")


def check_mask(mask: KernelMask, B: int, N: int) -> KernelMask:
    """Validate ``mask`` against ``B`` sequences and ``N`` query heads; return it normalised: a bool
    ``causal``, a checked ``window``, an int ``q_offset`` (None: ``S - T``), int32 operands, and
    ``random_block_size`` 1 without random blocks."""
    _check_ids(mask, B)
    window = check_window(mask.window)
    _check_pattern(mask, B, N)

    def as_int32(x, cast: bool = False):
        if x is None:
            return None
        return jnp.asarray(x).astype(jnp.int32) if cast else jnp.asarray(x, jnp.int32)

    offset = mask.q_offset
    return dataclasses.replace(
        mask, causal=bool(mask.causal), window=window,
        q_offset=int(mask.kv_len - mask.q_len) if offset is None else int(offset),
        random_block_size=1 if mask.random_kv_starts is None else int(mask.random_block_size),
        q_segment_ids=as_int32(mask.q_segment_ids), kv_segment_ids=as_int32(mask.kv_segment_ids),
        kv_lengths=as_int32(mask.kv_lengths), q_global=as_int32(mask.q_global, cast=True),
        kv_global=as_int32(mask.kv_global, cast=True), random_kv_starts=as_int32(mask.random_kv_starts))


def check_logits(logits: Logits, B: int, N: int, H: int) -> Logits:
    """Validate ``scale``, ``softcap`` and the ALiBi slopes; return them with ``scale`` resolved
    (``1/sqrt(H)``) and the slopes fp32 ``[1|B, N]``."""
    slopes = check_slopes(logits.alibi_slopes, B, N)
    softcap, scale = logits.softcap, logits.scale
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating))
                                or not softcap > 0):  # as scale: NumPy's floats too; True is no soft cap
        raise ValueError(f"softcap={softcap!r} must be a positive float or None")
    if scale is not None and not isinstance(scale, (int, float, np.floating)):
        raise ValueError(f"scale={scale!r} must be a Python float or None")
    return Logits(scale=float(1.0 / math.sqrt(H) if scale is None else scale),
                  softcap=None if softcap is None else float(softcap), alibi_slopes=slopes)
