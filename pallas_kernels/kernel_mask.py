"""``KernelMask``: the mask of one kernel call as the kernels receive it, one pytree.

Its static fields say what :func:`pallas_kernels.mask.mask_rule` needs (lengths, causal, window,
offset) and which blocks to visit (``block_map``); its optional operands (segment ids, kv lengths,
global flags, random-block starts) are the pytree's leaves, so they travel through ``jit`` and
``custom_vjp`` as one argument, and reach the kernel bodies as named refs (GPU ``Refs``, TPU
``Prefetch`` / ``Side``, laid out from it). From it
:mod:`pallas_kernels.schedule` derives the blocks every kernel visits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from pallas_kernels.mask import mask_rule


OPERANDS = ("q_segment_ids", "kv_segment_ids", "kv_lengths", "q_global", "kv_global", "random_kv_starts")


@dataclasses.dataclass(frozen=True)
class KernelMask:
    """Which keys each query may see in one kernel call: static fields plus optional operands.

    Static: the true lengths ``q_len`` (T) and ``kv_len`` (S) before any padding, ``causal``,
    ``window`` (``(left, right)`` or None), the static ``q_offset`` (position of query 0),
    ``block_map`` (None, or the static callable ``(block_q, block_k) -> bool [Nh, nq, nk]`` of tiles
    that may hold an allowed element) and ``random_block_size``. Operands (each None or an array,
    the pytree's leaves): ``q_segment_ids [B, T]``, ``kv_segment_ids [B, S]``, ``kv_lengths [B]``,
    ``q_global [1|B, T]``, ``kv_global [1|B, S]`` (nonzero = global) and ``random_kv_starts
    [1|N, r, T]`` (-1 = no block), all int32 once checked.

    :meth:`static` replaces each operand by its shape: a hashable view a kernel specialises on.
    ``flash_attention`` builds one from its keywords; ``jaxformer.ops.masks.MaskSpec.kernel_mask``
    converts a MaskSpec to one.
    """

    q_len: int
    kv_len: int
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    q_offset: int | None = None
    block_map: Callable | None = None
    random_block_size: int | None = None
    q_segment_ids: Any = None
    kv_segment_ids: Any = None
    kv_lengths: Any = None
    q_global: Any = None
    kv_global: Any = None
    random_kv_starts: Any = None

    def static(self) -> "KernelMask":
        """This mask with every operand replaced by its shape (None stays None): hashable."""
        return dataclasses.replace(self, **{name: _shape_of(getattr(self, name)) for name in OPERANDS})

    @property
    def has_pattern(self) -> bool:
        """True when a Longformer / BigBird operand is present (``q_global``, ``kv_global``, random blocks)."""
        return any(getattr(self, name) is not None for name in ("q_global", "kv_global", "random_kv_starts"))

    @property
    def num_random(self) -> int:
        """Random blocks per query row (``r`` of ``random_kv_starts [1|N, r, T]``), 0 without them."""
        return 0 if self.random_kv_starts is None else int(_shape_of(self.random_kv_starts)[1])

    def allowed(self, q_pos, k_pos, *, q_segment=None, kv_segment=None, kv_length=None,
                check_kv_len: bool = True, pattern: dict | None = None):
        """:func:`mask_rule` of one tile with this mask's static fields.

        ``check_kv_len`` also masks ``k_pos >= kv_len`` (keys a wrapper padded); pass False when the
        kv axis is not padded. ``pattern``: the rule's pattern terms of the tile, or None.
        """
        return mask_rule(q_pos, k_pos, causal=self.causal, window=self.window, q_segment=q_segment,
                         kv_segment=kv_segment, kv_length=kv_length,
                         num_keys=self.kv_len if check_kv_len else None, **(pattern or {}))


def _shape_of(x) -> tuple[int, ...] | None:
    """An operand's shape (a static view already holds it), or None."""
    if x is None or isinstance(x, tuple):
        return x
    return tuple(jax.numpy.shape(x))


jax.tree_util.register_dataclass(
    KernelMask, data_fields=list(OPERANDS),
    meta_fields=["q_len", "kv_len", "causal", "window", "q_offset", "block_map", "random_block_size"])
