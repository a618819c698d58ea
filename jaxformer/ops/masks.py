"""MaskSpec: one description of which keys each query may see.

Every attention path (dense XLA, blockwise, Pallas flash, sparse, paged decode)
takes its meaning from a :class:`MaskSpec`. :meth:`MaskSpec.dense` is the
reference: a boolean ``[B or 1, T, S]`` matrix, ``True`` where query ``i`` may
attend to key ``j``. Fast paths derive their block-level skipping from
:meth:`MaskSpec.block_map`, which is computed from the same fields, so skipping
work never changes meaning.

Positions. Keys sit at positions ``0 .. S-1``. Query ``i`` sits at
``q_offset + i``. ``q_offset=None`` means ``S - T``: queries are aligned to the
*end* of the keys (bottom-right), so the last query sees every key under a
causal mask. That is what chunked prefill and decode need; for ``T == S`` it is
the usual lower-triangular mask. ``q_offset`` may be a Python int (static; block
skipping can use it) or an int array ``[B]`` (per-sequence, traced).

Fields, all combined with AND:

* ``causal``: key position <= query position.
* ``window=(left, right)``: ``q_pos - left <= k_pos <= q_pos + right``; either
  side may be ``None`` (unbounded). With ``causal`` only ``left`` matters.
* ``q_segment_ids [B, T]`` / ``kv_segment_ids [B, S]``: attend only within the
  same segment (packed documents). If only ``q_segment_ids`` is given and
  ``T == S`` the same ids are used for keys.
* ``kv_lengths [B]``: keys at positions ``>= kv_lengths[b]`` are padding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _shape(x: Any) -> tuple[int, ...] | None:
    return None if x is None else tuple(np.shape(x))


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class MaskSpec:
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    q_segment_ids: Any = None
    kv_segment_ids: Any = None
    kv_lengths: Any = None
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

    # -- pytree: arrays are children; bools, windows and int offsets are static.
    def tree_flatten(self):
        static_offset = self.q_offset is None or isinstance(self.q_offset, (int, np.integer))
        children = (
            self.q_segment_ids,
            self.kv_segment_ids,
            self.kv_lengths,
            None if static_offset else self.q_offset,
        )
        aux = (self.causal, self.window, self.q_offset if static_offset else None, static_offset)
        return children, aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        causal, window, offset, static_offset = aux
        qs, ks, lens, dyn_offset = children
        spec = object.__new__(cls)
        for name, value in (
            ("causal", causal),
            ("window", window),
            ("q_segment_ids", qs),
            ("kv_segment_ids", ks),
            ("kv_lengths", lens),
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
    def is_empty(self) -> bool:
        """True when the spec masks nothing (every query sees every key)."""
        return (
            not self.causal
            and (self.window is None or self.window == (None, None))
            and self.q_segment_ids is None
            and self.kv_segment_ids is None
            and self.kv_lengths is None
        )

    def resolved_kv_segment_ids(self, T: int, S: int):
        if self.kv_segment_ids is not None:
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
    def validate(self, B: int, T: int, S: int) -> None:
        """Raise ValueError naming the shapes when the spec does not fit q [B,T,..], k [B,S,..]."""
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
        if self.kv_segment_ids is None and self.q_segment_ids is not None and T != S:
            self.resolved_kv_segment_ids(T, S)
        if self.kv_lengths is not None and _shape(self.kv_lengths) != (B,):
            raise ValueError(
                f"MaskSpec.kv_lengths.shape={_shape(self.kv_lengths)} does not match batch B={B}"
            )
        if not self.has_static_offset and _shape(self.q_offset) not in ((B,), ()):
            raise ValueError(
                f"MaskSpec.q_offset.shape={_shape(self.q_offset)} must be () or (B,)=({B},)"
            )

    # -- meaning
    def q_positions(self, T: int, S: int) -> jax.Array:
        """Absolute query positions, int32 ``[B or 1, T]``."""
        offset = self.static_offset(T, S)
        if offset is None:
            off = jnp.asarray(self.q_offset, jnp.int32).reshape(-1, 1)
        else:
            off = jnp.full((1, 1), offset, jnp.int32)
        return off + jnp.arange(T, dtype=jnp.int32)[None, :]

    def dense(self, T: int, S: int) -> jax.Array:
        """The reference meaning: bool ``[B or 1, T, S]``, True where attention is allowed."""
        qp = self.q_positions(T, S)[:, :, None]  # [B|1, T, 1]
        kp = jnp.arange(S, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
        allowed = jnp.ones((1, T, S), bool)
        if self.causal:
            allowed = allowed & (kp <= qp)
        if self.window is not None:
            left, right = self.window
            if left is not None:
                allowed = allowed & (kp >= qp - left)
            if right is not None:
                allowed = allowed & (kp <= qp + right)
        kv_seg = self.resolved_kv_segment_ids(T, S)
        if self.q_segment_ids is not None or kv_seg is not None:
            if self.q_segment_ids is None:
                raise ValueError("MaskSpec: kv_segment_ids given without q_segment_ids")
            allowed = allowed & (
                jnp.asarray(self.q_segment_ids)[:, :, None] == jnp.asarray(kv_seg)[:, None, :]
            )
        if self.kv_lengths is not None:
            allowed = allowed & (kp < jnp.asarray(self.kv_lengths, jnp.int32)[:, None, None])
        return allowed

    def block_map(self, T: int, S: int, block_q: int, block_k: int) -> np.ndarray | None:
        """Static bool ``[ceil(T/bq), ceil(S/bk)]``: False where a block is certainly fully masked.

        Derived only from the static fields (``causal``, ``window``, an int
        ``q_offset``); data-dependent fields (segments, lengths) never make a
        block skippable here. Returns None when the offset is traced (no static
        skipping possible).
        """
        offset = self.static_offset(T, S)
        nq, nk = -(-T // block_q), -(-S // block_k)
        if offset is None:
            return None
        q_lo = np.arange(nq)[:, None] * block_q + offset  # first query position in block
        q_hi = np.minimum(np.arange(nq)[:, None] * block_q + block_q, T) - 1 + offset
        k_lo = np.arange(nk)[None, :] * block_k
        k_hi = np.minimum(np.arange(nk)[None, :] * block_k + block_k, S) - 1
        live = np.ones((nq, nk), bool)
        if self.causal:
            live &= k_lo <= q_hi
        if self.window is not None:
            left, right = self.window
            if left is not None:
                live &= k_hi >= q_lo - left
            if right is not None:
                live &= k_lo <= q_hi + right
        return live
