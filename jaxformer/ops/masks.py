"""MaskSpec: one description of which keys each query may see.

Every attention path (dense XLA, blockwise, Pallas flash, sparse, paged decode)
takes its meaning from a :class:`MaskSpec`. :meth:`MaskSpec.dense` is the
reference: a boolean ``[B or 1, T, S]`` matrix, ``True`` where query ``i`` may
attend to key ``j`` (:meth:`MaskSpec.dense_heads` adds a heads axis, needed only
for per-head random blocks). Each element of it is
:func:`pallas_kernels.mask.mask_rule`, the one rule that the blockwise, sparse and
kernel tile paths evaluate too (``ops`` may import ``pallas_kernels``, never the
reverse). Fast paths derive their block-level skipping from
:meth:`MaskSpec.block_map`, which is computed from the same fields, so skipping
work never changes meaning. :func:`masked_softmax` is the softmax the dense and
sparse paths apply to an allowed matrix; it stays here, not beside the rule,
because no kernel uses it (the kernels run an online softmax).

Positions. Keys sit at positions ``0 .. S-1``. Query ``i`` sits at
``q_offset + i``. ``q_offset=None`` means ``S - T``: queries are aligned to the
*end* of the keys (bottom-right), so the last query sees every key under a
causal mask. That is what chunked prefill and decode need; for ``T == S`` it is
the usual lower-triangular mask. ``q_offset`` may be a Python int (static; block
skipping can use it) or an int array ``[B]`` (per-sequence, traced).

Hard constraints, combined with AND:

* ``causal``: key position <= query position.
* ``q_segment_ids [B, T]`` / ``kv_segment_ids [B, S]``: attend only within the
  same segment (packed documents). If only ``q_segment_ids`` is given and
  ``T == S`` the same ids are used for keys.
* ``kv_lengths [B]``: keys at positions ``>= kv_lengths[b]`` are padding.

The local band and the sparse patterns that widen it (Longformer, BigBird)::

    allowed = causal AND segments AND lengths AND (band OR global_q OR global_k OR random)

* ``window=(left, right)``, the band: ``q_pos - left <= k_pos <= q_pos + right``;
  either side may be ``None`` (unbounded). Without a window the band is
  everything, so the patterns below only matter together with a window. With
  ``causal`` only ``left`` matters.
* ``global_tokens``: static absolute positions, ``[g]`` (every sequence) or
  ``[B, g]`` (per sequence; ``-1`` pads rows of unequal length). Key ``p`` is
  global when ``p`` is listed (and ``p < S``): every query may see it. The query
  at position ``q_offset + i == p`` is global: it may see every key. Positions
  are absolute, as everywhere here: with ``T != S`` or an offset, a chunk holds
  a global query only if its position range covers ``p``, and a global key is
  seen by every query once ``p < S``. ``causal`` still applies: a global query
  of a causal mask sees every *earlier* key.
* ``random_blocks=RandomBlocks(num_blocks, block_size, seed, num_heads)``
  (BigBird): query block ``q_pos // block_size`` also sees ``num_blocks``
  distinct key blocks ``k_pos // block_size`` out of ``ceil(S / block_size)``,
  chosen by a hash of (seed, head, query block, key block): the draw does not
  depend on ``T`` or ``q_offset``, only on ``S``. One pattern shared by all heads
  (``num_heads=None``) or one per query head (``num_heads=N``). Needs a static
  ``q_offset``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Integer

from jaxformer.typing import DenseMask
from pallas_kernels.kernel_mask import KernelMask
from pallas_kernels.mask import mask_rule
from pallas_kernels.schedule import band_first, band_last


def _shape(x: Any) -> tuple[int, ...] | None:
    return None if x is None else tuple(np.shape(x))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


# --------------------------------------------------------------------------- BigBird random blocks


@dataclasses.dataclass(frozen=True)
class RandomBlocks:
    """BigBird random attention: each query block also sees ``num_blocks`` random key blocks.

    ``block_size`` cuts absolute positions into blocks; ``seed`` fixes the draw;
    ``num_heads=None`` shares one pattern across heads, ``num_heads=N`` draws one
    per query head (then it must equal the query's ``N``).
    """

    num_blocks: int
    block_size: int
    seed: int = 0
    num_heads: int | None = None

    def __post_init__(self):
        for name, low in (("num_blocks", 0), ("block_size", 1), ("seed", 0), ("num_heads", 1)):
            value = getattr(self, name)
            if name == "num_heads" and value is None:
                continue
            if not _is_int(value) or value < low:
                raise ValueError(f"RandomBlocks.{name}={value!r} must be an int >= {low}")
            object.__setattr__(self, name, int(value))

    @property
    def heads(self) -> int:
        """Number of distinct patterns: 1 when shared, else ``num_heads``."""
        return 1 if self.num_heads is None else self.num_heads

    def table(self, rb_lo: int | np.integer, rb_hi: int | np.integer, nkb: int | np.integer) -> np.ndarray:
        """Random key blocks of query blocks ``rb_lo .. rb_hi-1``: int ``[heads, rb_hi-rb_lo, min(num_blocks, nkb)]``."""
        return _random_table(self, int(rb_lo), int(rb_hi), int(nkb))

    def membership(self, rb_lo: int | np.integer, rb_hi: int | np.integer, nkb: int | np.integer) -> np.ndarray:
        """Bool ``[heads, rb_hi-rb_lo, nkb]``: True where the query block sees the key block."""
        tbl = self.table(rb_lo, rb_hi, nkb)
        member = np.zeros(tbl.shape[:2] + (nkb,), bool)
        np.put_along_axis(member, tbl, True, axis=-1)
        return member


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _u64(values) -> np.ndarray:
    return np.atleast_1d(np.asarray(values, np.int64)).astype(np.uint64)


@functools.lru_cache(maxsize=64)
def _random_table(rb: RandomBlocks, rb_lo: int, rb_hi: int, nkb: int) -> np.ndarray:
    heads = _u64(np.arange(rb.heads))[:, None, None]
    qblocks = _u64(np.arange(rb_lo, rb_hi))[None, :, None]
    kblocks = _u64(np.arange(nkb))[None, None, :]
    score = _mix64(_mix64(_mix64(_mix64(_u64(rb.seed)) ^ heads) ^ qblocks) ^ kblocks)
    r = min(rb.num_blocks, nkb)
    tbl = np.sort(np.argsort(score, axis=-1, kind="stable")[..., :r], axis=-1).astype(np.int32)
    tbl.setflags(write=False)
    return tbl


def _normalize_globals(value) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    if isinstance(value, jax.core.Tracer):
        raise ValueError("MaskSpec.global_tokens must be static positions (a list, tuple or numpy array), "
                         "not a traced array")
    arr = np.asarray(value)
    if arr.ndim not in (1, 2) or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"MaskSpec.global_tokens must be int positions [g] or [B, g]; got shape {arr.shape} "
                         f"dtype {arr.dtype}")
    if arr.size == 0:
        return None
    arr = arr.reshape(-1, arr.shape[-1]) if arr.ndim == 2 else arr[None, :]
    rows = [np.unique(row[row >= 0]) for row in arr]
    width = max(len(row) for row in rows)
    if width == 0:
        return None
    return tuple(tuple(int(p) for p in row) + (-1,) * (width - len(row)) for row in rows)


# --------------------------------------------------------------------------- MaskSpec


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class MaskSpec:
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    q_segment_ids: Any = None
    kv_segment_ids: Any = None
    kv_lengths: Any = None
    global_tokens: Any = None
    random_blocks: RandomBlocks | None = None
    q_offset: Any = None

    def __post_init__(self):
        if self.window is not None:
            if len(self.window) != 2:
                raise ValueError(f"MaskSpec.window must be (left, right), got {self.window!r}")
            for side in self.window:
                if side is not None and (not isinstance(side, (int, np.integer)) or side < 0):
                    raise ValueError(
                        f"MaskSpec.window sides must be non-negative ints or None, got {self.window!r}"
                    )
            object.__setattr__(self, "window", tuple(None if s is None else int(s) for s in self.window))
        object.__setattr__(self, "global_tokens", _normalize_globals(self.global_tokens))
        if self.random_blocks is not None and not isinstance(self.random_blocks, RandomBlocks):
            raise ValueError(f"MaskSpec.random_blocks must be a RandomBlocks, got {type(self.random_blocks).__name__}")

    # -- pytree: arrays are children; bools, windows, patterns and int offsets are static.
    def tree_flatten(self):
        static_offset = self.q_offset is None or isinstance(self.q_offset, (int, np.integer))
        children = (
            self.q_segment_ids,
            self.kv_segment_ids,
            self.kv_lengths,
            None if static_offset else self.q_offset,
        )
        aux = (self.causal, self.window, self.q_offset if static_offset else None, static_offset,
               self.global_tokens, self.random_blocks)
        return children, aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        causal, window, offset, static_offset, global_tokens, random_blocks = aux
        qs, ks, lens, dyn_offset = children
        spec = object.__new__(cls)
        for name, value in (
            ("causal", causal),
            ("window", window),
            ("q_segment_ids", qs),
            ("kv_segment_ids", ks),
            ("kv_lengths", lens),
            ("global_tokens", global_tokens),
            ("random_blocks", random_blocks),
            ("q_offset", offset if static_offset else dyn_offset),
        ):
            object.__setattr__(spec, name, value)
        return spec

    # -- properties
    @property
    def has_static_offset(self) -> bool:
        return self.q_offset is None or isinstance(self.q_offset, (int, np.integer))

    def static_offset(self, T: int, S: int) -> int | None:
        """The query offset as a Python int, or None when it is a traced/per-batch array."""
        if self.q_offset is None:
            return S - T
        if isinstance(self.q_offset, (int, np.integer)):
            return int(self.q_offset)
        return None

    @property
    def has_pattern(self) -> bool:
        """True when global tokens or random blocks are set (paths that ignore them must refuse the spec)."""
        return self.global_tokens is not None or self.random_blocks is not None

    @property
    def num_heads(self) -> int:
        """Heads axis of :meth:`dense_heads`: ``RandomBlocks.num_heads`` for per-head patterns, else 1."""
        return 1 if self.random_blocks is None else self.random_blocks.heads

    @property
    def global_array(self) -> np.ndarray | None:
        """Global positions as int32 ``[1 or B, g]`` (``-1`` pads), or None."""
        return None if self.global_tokens is None else np.asarray(self.global_tokens, np.int32)

    @property
    def patterns_active(self) -> bool:
        """True when global tokens or random blocks change the meaning (they need a bounded window)."""
        return self.has_pattern and self.window is not None and self.window != (None, None)

    def resolved_kv_segment_ids(self, T: int, S: int):
        """Key segment ids ``[B, S]`` (the query ids when only those are given and T == S), or None."""
        if self.kv_segment_ids is not None:
            if self.q_segment_ids is None:
                raise ValueError(
                    f"MaskSpec: kv_segment_ids {_shape(self.kv_segment_ids)} given without q_segment_ids"
                )
            return self.kv_segment_ids
        if self.q_segment_ids is not None:
            if T != S:
                raise ValueError(
                    f"MaskSpec: q_segment_ids {_shape(self.q_segment_ids)} given without kv_segment_ids, "
                    f"but T={T} != S={S}; pass kv_segment_ids [B, S]"
                )
            return self.q_segment_ids
        return None

    # -- validation
    def validate(self, B: int, T: int, S: int, N: int | None = None) -> None:
        """Raise ValueError naming the shapes when the spec does not fit q [B,T,N,..], k [B,S,..]."""
        if self.q_segment_ids is not None and _shape(self.q_segment_ids) != (B, T):
            raise ValueError(
                f"MaskSpec.q_segment_ids.shape={_shape(self.q_segment_ids)} does not match "
                f"q's (B, T)=({B}, {T})"
            )
        if self.kv_segment_ids is not None and _shape(self.kv_segment_ids) != (B, S):
            raise ValueError(
                f"MaskSpec.kv_segment_ids.shape={_shape(self.kv_segment_ids)} does not match "
                f"k's (B, S)=({B}, {S})"
            )
        self.resolved_kv_segment_ids(T, S)  # raises on ids given for one side only
        if self.kv_lengths is not None and _shape(self.kv_lengths) != (B,):
            raise ValueError(
                f"MaskSpec.kv_lengths.shape={_shape(self.kv_lengths)} does not match batch B={B}"
            )
        if not self.has_static_offset and _shape(self.q_offset) not in ((B,), ()):
            raise ValueError(
                f"MaskSpec.q_offset.shape={_shape(self.q_offset)} must be () or (B,)=({B},)"
            )
        if self.global_tokens is not None and len(self.global_tokens) not in (1, B):
            raise ValueError(
                f"MaskSpec.global_tokens.shape={self.global_array.shape} must be [g] or [B, g] with B={B}"
            )
        if self.random_blocks is not None:
            if not self.has_static_offset:
                raise ValueError("MaskSpec.random_blocks needs a static q_offset (a Python int or None), "
                                 f"got an array of shape {_shape(self.q_offset)}")
            heads = self.random_blocks.num_heads
            if heads is not None and N is not None and heads != N:
                raise ValueError(f"MaskSpec.random_blocks.num_heads={heads} does not match the query heads N={N}")

    # -- meaning
    def q_positions(self, T: int, S: int) -> Integer[Array, "#B T"]:
        """Absolute query positions, int32 ``[B or 1, T]``."""
        offset = self.static_offset(T, S)
        if offset is None:
            off = jnp.asarray(self.q_offset, jnp.int32).reshape(-1, 1)
        else:
            off = jnp.full((1, 1), offset, jnp.int32)
        return off + jnp.arange(T, dtype=jnp.int32)[None, :]

    def dense(self, T: int, S: int) -> DenseMask:
        """The reference meaning: bool ``[B or 1, T, S]``, True where attention is allowed.

        Per-head random blocks have no single matrix: use :meth:`dense_heads`.
        """
        if self.num_heads != 1:
            raise ValueError(f"MaskSpec with per-head random blocks (num_heads={self.num_heads}) has no "
                             "head-shared dense mask; use dense_heads(T, S) -> [B|1, N, T, S]")
        return self.dense_heads(T, S)[:, 0]

    def dense_heads(self, T: int, S: int) -> Bool[Array, "#B #N T S"]:
        """The reference meaning with a heads axis: bool ``[B or 1, num_heads, T, S]`` (num_heads 1 or N)."""
        qp = self.q_positions(T, S)[:, None, :, None]  # [B|1, 1, T, 1]
        kp = jnp.arange(S, dtype=jnp.int32)[None, None, None, :]  # [1, 1, 1, S]
        kv_seg = self.resolved_kv_segment_ids(T, S)
        lengths = None if self.kv_lengths is None else jnp.asarray(self.kv_lengths, jnp.int32)
        allowed = mask_rule(
            qp, kp, causal=self.causal, window=self.window,
            q_segment=None if kv_seg is None else jnp.asarray(self.q_segment_ids)[:, None, :, None],
            kv_segment=None if kv_seg is None else jnp.asarray(kv_seg)[:, None, None, :],
            kv_length=None if lengths is None else lengths[:, None, None, None],
            q_global=self.is_global(qp), kv_global=self.is_global(kp),
            random=self._random_dense(T, S)[None] if self.random_blocks is not None and self.patterns_active else None,
        )
        allowed = jnp.ones((1, 1, T, S), bool) if allowed is None else allowed
        return jnp.broadcast_to(allowed, (allowed.shape[0], self.num_heads, T, S))

    def is_global(self, pos) -> jax.Array | None:
        """Bool of ``pos``'s shape (leading axis 1 or B): True at this spec's global positions.

        ``pos`` int ``[1|B, ...]``; None when no global tokens are active.
        """
        if self.global_tokens is None or not self.patterns_active:
            return None
        g = self.global_array  # [1|B, g]; -1 pads
        g = jnp.asarray(g).reshape((g.shape[0],) + (1,) * (jnp.ndim(pos) - 1) + (g.shape[1],))
        return jnp.any((pos[..., None] == g) & (g >= 0), axis=-1)

    def _random_dense(self, T: int, S: int) -> jax.Array:
        """Bool ``[heads, T, S]`` of the random-block pattern alone (static offset only)."""
        offset = self.static_offset(T, S)
        if offset is None:
            raise ValueError("MaskSpec.random_blocks needs a static q_offset (a Python int or None)")
        R = self.random_blocks.block_size
        rq = (offset + np.arange(T)) // R
        member = jnp.asarray(self.random_blocks.membership(rq.min(), rq.max() + 1, _cdiv(S, R)))
        rq = jnp.asarray(rq - rq.min(), jnp.int32)
        rk = jnp.arange(S, dtype=jnp.int32) // R
        return member[:, rq[:, None], rk[None, :]]

    def block_map(self, T: int, S: int, block_q: int, block_k: int, *, per_head: bool = False,
                  global_rows: bool = True) -> np.ndarray | None:
        """Static bool ``[ceil(T/bq), ceil(S/bk)]``: True exactly where some element of the block may be allowed.

        Derived from the static fields (``causal``, ``window``, ``global_tokens``,
        ``random_blocks``, an int ``q_offset``); data-dependent fields (segments,
        lengths) never make a block skippable here. Per-sequence global tokens
        count when global in any sequence. Returns None when the offset is
        traced (no static skipping possible).

        ``per_head=True`` returns ``[num_heads, nq, nk]`` (heads differ only
        through per-head random blocks). ``global_rows=False`` leaves out the
        rows of queries that are global in every sequence, for paths that
        compute those rows densely on their own.
        """
        offset = self.static_offset(T, S)
        if offset is None:
            return None
        nq, nk = _cdiv(T, block_q), _cdiv(S, block_k)
        qp = offset + np.arange(T, dtype=np.int64)
        # each row's band [lo, hi], from the interval functions the kernels' schedule uses
        causal_last = band_last(qp, self.causal, None)
        top = np.full(T, S - 1, np.int64) if causal_last is None else np.minimum(S - 1, causal_last)
        first, last = band_first(qp, self.window), band_last(qp, self.causal, self.window)
        lo = np.zeros(T, np.int64) if first is None else first
        hi = top.copy() if last is None else np.minimum(S - 1, last)
        keep = np.ones(T, bool)
        rows, los, his = [np.arange(T)], [lo], [hi]
        if self.global_tokens is not None and self.patterns_active:
            g = self.global_array
            in_any = np.isin(qp, g[g >= 0])
            in_all = np.all([np.isin(qp, row[row >= 0]) for row in g], axis=0)
            rows.append(np.flatnonzero(in_any))
            los.append(np.zeros(len(rows[-1]), np.int64))
            his.append(top[rows[-1]])
            cols = np.unique(g[(g >= 0) & (g < S)])
            rows.append(np.repeat(np.arange(T), len(cols)))
            los.append(np.tile(cols, T))
            his.append(np.minimum(np.tile(cols, T), top[rows[-1]]))
            if not global_rows:
                keep = ~in_all
        shared = _mark(np.concatenate(rows), np.concatenate(los), np.concatenate(his), keep,
                       _BlockGrid(1, nq, nk, block_q, block_k))
        live = shared
        if self.random_blocks is not None and self.patterns_active:
            R = self.random_blocks.block_size
            rq = qp // R
            tbl = self.random_blocks.table(rq.min(), rq.max() + 1, _cdiv(S, R))  # [h, nrb, r]
            kb = tbl[:, rq - rq.min()].astype(np.int64)  # [h, T, r]
            r = kb.shape[-1]
            heads = tbl.shape[0]
            rlo, rhi = kb * R, np.minimum(kb * R + R - 1, top[None, :, None])
            trow = np.broadcast_to(np.arange(T)[None, :, None], kb.shape)
            hid = np.broadcast_to(np.arange(heads)[:, None, None], kb.shape)
            rand = _mark(trow.ravel(), rlo.ravel(), rhi.ravel(), keep, _BlockGrid(heads, nq, nk, block_q, block_k),
                         head=hid.ravel()) if r else np.zeros((heads, nq, nk), bool)
            live = shared | rand
        if not per_head:
            return live.any(axis=0)
        return np.broadcast_to(live, (self.num_heads, nq, nk)).copy()

    def kernel_mask(self, T: int, S: int) -> KernelMask:
        """This spec as the flash kernels take it (static ``q_offset`` only): the same fields, the
        resolved key segment ids, and for active Longformer / BigBird patterns the kernels'
        block-sparse operands (``block_map`` per head with global rows, global flags, random-block starts)."""
        offset = self.static_offset(T, S)
        if offset is None:
            raise ValueError(f"MaskSpec.kernel_mask needs a static q_offset; got an array of shape "
                             f"{_shape(self.q_offset)}")
        mask = KernelMask(q_len=T, kv_len=S, causal=self.causal, window=self.window, q_offset=offset,
                          q_segment_ids=self.q_segment_ids, kv_segment_ids=self.resolved_kv_segment_ids(T, S),
                          kv_lengths=self.kv_lengths)
        if not self.patterns_active:
            return mask
        qp = offset + np.arange(T)

        def block_map(block_q: int, block_k: int) -> np.ndarray:
            return self.block_map(T, S, block_q, block_k, per_head=True)

        ops = dict(block_map=block_map)
        if self.global_tokens is not None:
            g = self.global_array  # [Bg, g], -1 pads
            ops["q_global"] = np.stack([np.isin(qp, row[row >= 0]) for row in g])
            ops["kv_global"] = np.stack([np.isin(np.arange(S), row[row >= 0]) for row in g])
        rb = self.random_blocks
        if rb is not None:
            R = rb.block_size
            rq = qp // R
            tbl = rb.table(rq.min(), rq.max() + 1, -(-S // R))  # [heads, nrb, r]
            if tbl.shape[-1]:
                starts = tbl[:, rq - rq.min()] * R  # [heads, T, r]
                ops.update(random_kv_starts=np.ascontiguousarray(starts.transpose(0, 2, 1)).astype(np.int32),
                           random_block_size=R)
        return dataclasses.replace(mask, **ops)


class _BlockGrid(NamedTuple):
    """A block map's shape: ``nheads`` heads of ``nq`` q blocks of ``bq`` rows by ``nk`` kv blocks of ``bk``."""

    nheads: int
    nq: int
    nk: int
    bq: int
    bk: int


def _mark(rows, lo, hi, keep, grid: _BlockGrid, head=None):
    """OR of key intervals ``[lo, hi]`` of query ``rows`` (of head ``head``) into a bool ``[nheads, nq, nk]``."""
    nheads, nq, nk, bq, bk = grid
    hid = np.zeros_like(rows) if head is None else head
    lo = np.maximum(lo, 0)
    ok = (lo <= hi) & keep[rows]
    rows, lo, hi, hid = rows[ok], lo[ok], hi[ok], hid[ok]
    base = (hid * nq + rows // bq) * (nk + 1)
    size = nheads * nq * (nk + 1)
    diff = np.bincount(base + lo // bk, minlength=size) - np.bincount(base + hi // bk + 1, minlength=size)
    return (np.cumsum(diff.reshape(nheads, nq, nk + 1), axis=-1) > 0)[..., :nk]


def masked_softmax(s, allowed):
    """Softmax of fp32 logits ``s`` over the last axis, restricted to ``allowed`` (broadcastable bool).

    Rows with nothing allowed give zeros. Finite by construction, gradients included: ``exp`` only
    ever sees finite arguments (masked logits are replaced *before* it and zeroed *after* it), and the
    row max is a constant (``stop_gradient``; softmax does not depend on the shift), so no ``-inf``
    and no max-location gradient reaches the backward pass on any CPU or compiler setting.
    """
    allowed = jnp.broadcast_to(allowed, s.shape)
    m = jax.lax.stop_gradient(jnp.max(jnp.where(allowed, s, -jnp.inf), axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(allowed, jnp.exp(jnp.where(allowed, s - m, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(denom == 0.0, 1.0, denom)
