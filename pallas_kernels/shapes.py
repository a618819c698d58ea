"""Shape checks and padding shared by every attention path: the kernels here and ``jaxformer.ops``.

``jaxformer.ops`` imports this module (never the kernels' internals); the kernels never import
``jaxformer``. Each check raises ``ValueError`` naming the shapes it was given.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


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


def check_qkv(q, k, v) -> tuple[int, int, int, int, int, int]:
    """Validate attention operand shapes ``q [B,T,N,H]``, ``k, v [B,S,K,H]``; return (B, T, S, N, K, H)."""
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


def check_window(window) -> tuple[int | None, int | None] | None:
    """``(left, right)`` with non-negative int or None sides; ``(None, None)`` and None give None."""
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
