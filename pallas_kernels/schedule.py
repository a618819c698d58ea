"""Which blocks an attention kernel visits: one schedule for every kernel and for ``MaskSpec.block_map``.

The band of a mask (causal and window) in interval form is written once, here:
:func:`band_first` / :func:`band_last` give the first and last key a query may see,
:func:`band_queries_first` / :func:`band_queries_last` the first and last query that may
see a key (the same inequalities ``k_pos <= q_pos`` and ``q_pos - left <= k_pos <= q_pos +
right`` solved for the other side). Each takes Python ints, numpy arrays or traced int32
(inside a kernel body or index map) and builds exactly the operations it needs.

:class:`BlockSchedule` turns the band into blocks of a ``block_q x block_k`` tiling: the
live kv blocks of a q block (:meth:`~BlockSchedule.kv_range`), those it covers wholly
(:meth:`~BlockSchedule.kv_full_range`, where a kernel may skip the static mask), the live q
blocks of a kv block (:meth:`~BlockSchedule.q_range`), and, for block-sparse masks, the
checked ``block_map`` and its per-row tile lists (:meth:`~BlockSchedule.live`,
:func:`block_lists`). ``jaxformer.ops.masks.MaskSpec.block_map`` marks its band rows with the
same interval functions, so the kernels' skipping and the reference block map cannot drift
apart (``tests/pallas_kernels/test_flash_api.py`` checks them against each other).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kernel_mask import KernelMask

_STATIC = (int, np.integer, np.ndarray)


def _div(a, b: int):
    """Floor division of non-negative ints (Python, numpy or traced int32) by a positive Python int."""
    if isinstance(a, (int, np.integer)):
        return int(a) // b
    if isinstance(a, np.ndarray):
        return a // b
    return jax.lax.div(a, jnp.asarray(b, a.dtype))


def _max(a, b):
    if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
        return max(int(a), int(b))
    if isinstance(a, _STATIC) and isinstance(b, _STATIC):
        return np.maximum(a, b)
    return jnp.maximum(a, b)


def _min(a, b):
    if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
        return min(int(a), int(b))
    if isinstance(a, _STATIC) and isinstance(b, _STATIC):
        return np.minimum(a, b)
    return jnp.minimum(a, b)


def _where(c, a, b):
    if isinstance(c, (bool, np.bool_)):
        return a if c else b
    if isinstance(c, np.ndarray):
        return np.where(c, a, b)
    return jnp.where(c, a, b)


# --------------------------------------------------------------------------- the band as intervals


def band_last(q_pos, causal: bool, window):
    """Last key position the query at ``q_pos`` may see (``k_pos <= q_pos`` and ``k_pos <= q_pos + right``),
    before clipping to the keys; None when unbounded."""
    last = q_pos if causal else None
    right = None if window is None else window[1]
    if right is not None:
        last = q_pos + right if last is None else _min(last, q_pos + right)
    return last


def band_first(q_pos, window):
    """First key position the query at ``q_pos`` may see (``q_pos - left``); None when unbounded."""
    left = None if window is None else window[0]
    return None if left is None else q_pos - left


def band_queries_first(k_pos, causal: bool, window):
    """First query position that may see the key at ``k_pos`` (the transpose of :func:`band_last`)."""
    first = k_pos if causal else None
    right = None if window is None else window[1]
    if right is not None:
        first = k_pos - right if first is None else _max(first, k_pos - right)
    return first


def band_queries_last(k_pos, window):
    """Last query position that may see the key at ``k_pos`` (the transpose of :func:`band_first`)."""
    left = None if window is None else window[0]
    return None if left is None else k_pos + left


# --------------------------------------------------------------------------- blocks


@dataclasses.dataclass(frozen=True)
class BlockSchedule:
    """The blocks a ``block_q x block_k`` tiling of ``mask`` visits (``mask``: a :meth:`KernelMask.static` view).

    Block indices ``qi`` / ``kj`` may be Python ints or traced int32; ranges are ``[lo, hi)``
    (``lo >= hi``: none). Live blocks of one row form one run, so a range says it all for the band;
    a ``block_map`` (block-sparse masks) replaces the ranges by its lists.
    """

    mask: KernelMask
    block_q: int
    block_k: int

    @property
    def num_q_blocks(self) -> int:
        return -(-self.mask.q_len // self.block_q)

    @property
    def num_kv_blocks(self) -> int:
        return -(-self.mask.kv_len // self.block_k)

    def _q_rows(self, qi):
        """Positions of the first and last (true, unpadded) query of q block ``qi``."""
        bq, m = self.block_q, self.mask
        return qi * bq + m.q_offset, _min(qi * bq + bq, m.q_len) - 1 + m.q_offset

    def kv_range(self, qi):
        """Live kv blocks of q block ``qi``: every key some query of the block may see."""
        m, bk = self.mask, self.block_k
        S, nk = m.kv_len, self.num_kv_blocks
        lo, hi = 0, nk
        q_lo, q_hi = self._q_rows(qi)
        last = band_last(q_hi, m.causal, m.window)
        first = band_first(q_lo, m.window)
        if first is not None:
            lo = _where(first > S - 1, nk, _div(_max(first, 0), bk))
        if last is not None:
            hi = _min(hi, _div(_max(last, -1) + bk, bk))
        return lo, hi

    def kv_full_range(self, qi):
        """Kv blocks that the band and the key length leave wholly allowed for every query of q block ``qi``.

        Inside it a kernel may skip the static mask (segments and kv lengths still apply). May be
        empty or stick out of :meth:`kv_range`; clamp to it.
        """
        m, bk = self.mask, self.block_k
        lo, hi = 0, m.kv_len // bk
        q_lo, q_hi = self._q_rows(qi)
        last = band_last(q_lo, m.causal, m.window)  # every query of the block sees keys <= last
        first = band_first(q_hi, m.window)  # ... and keys >= first
        if first is not None:
            lo = _div(_max(first, 0) + bk - 1, bk)
        if last is not None:
            hi = _min(hi, _div(_max(last + 1, 0), bk))
        return lo, hi

    def q_range(self, kj):
        """Live q blocks of kv block ``kj``: the column counterpart of :meth:`kv_range`."""
        m, bq, bk = self.mask, self.block_q, self.block_k
        T, off, nq = m.q_len, m.q_offset, self.num_q_blocks
        lo, hi = 0, nq
        k_lo = kj * bk
        k_hi = _min(kj * bk + bk, m.kv_len) - 1
        first = band_queries_first(k_lo, m.causal, m.window)
        last = band_queries_last(k_hi, m.window)
        if last is not None:
            last = last - off
            hi = _min(hi, _div(_max(last, -1) + bq, bq))
        if first is not None:
            rel = first - off
            # block qi is live iff its last query reaches first: min(qi*bq + bq, T) - 1 + off >= first
            lo = _where(rel > T - 1, nq, _div(_max(rel, 0), bq))
        return lo, hi

    def longest_run(self, over_kv: bool) -> int:
        """The most blocks one row visits (at least 1): kv blocks of a q block, or q blocks of a kv block."""
        rows = range(self.num_q_blocks) if over_kv else range(self.num_kv_blocks)
        walk = self.kv_range if over_kv else self.q_range
        return max(1, max(hi - lo for lo, hi in map(walk, rows)))

    def range_map(self) -> np.ndarray:
        """Bool ``[nq, nk]``: True on the live blocks of :meth:`kv_range`."""
        cols = np.arange(self.num_kv_blocks)
        rows = [self.kv_range(qi) for qi in range(self.num_q_blocks)]
        return np.stack([(cols >= lo) & (cols < hi) for lo, hi in rows]) if rows else np.zeros((0, cols.size), bool)

    def live(self, num_heads: int) -> np.ndarray:
        """Bool ``[Nh, nq, nk]`` of the tiles to visit: the checked ``block_map`` (Nh 1 or ``num_heads``),
        else :meth:`range_map` (Nh 1)."""
        if self.mask.block_map is None:
            return self.range_map()[None]
        return live_blocks(self.mask.block_map, self.mask.q_len, self.mask.kv_len, num_heads,
                           self.block_q, self.block_k)


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


def block_lists(live: np.ndarray, pad: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Row lists of a bool ``[..., nr, nc]`` map: ``(idx int32 [..., nr, w], count int32 [..., nr])``.

    ``idx[..., i, :count[..., i]]`` are the True columns of row ``i``, ascending; ``w = max(1, max count)``.
    The rest is ``pad``, or with ``pad=None`` repeats the last listed column (0 for an empty row), so a
    prefetching kernel never fetches a new tile there. For column lists pass the transposed map.
    """
    live = np.asarray(live, bool)
    count = live.sum(axis=-1)
    width = max(1, int(count.max()) if count.size else 1)
    order = np.argsort(~live, axis=-1, kind="stable")[..., :width]
    if pad is None:
        last = np.take_along_axis(order, np.maximum(count - 1, 0)[..., None], axis=-1)
        pad = np.where(count[..., None] > 0, last, 0)
    idx = np.where(np.arange(width) < count[..., None], order, pad)
    return idx.astype(np.int32), count.astype(np.int32)
