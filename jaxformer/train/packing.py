"""Packed rows to model batches: rows ``[B, T+1]`` with segment ids -> a :class:`Batch`.

A row gives ``tokens = row[:-1]``, ``targets = row[1:]``; segment 0 is padding; a
target counts only inside its input's segment, so nothing is learned across a
piece or document boundary. Used by the training stream and the validation windows.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np


class Batch(NamedTuple):
    """One model batch, every field ``[B, T]`` (numpy on the host, jax arrays on the mesh; a pytree).

    ``loss_mask`` is True where a target is scored: inside its input's segment and not padding.
    """

    tokens: Any  # int32: the model's input ids
    targets: Any  # int32: the next ids
    loss_mask: Any  # bool
    segment_ids: Any  # int32: 1, 2, ... per packed document, 0 padding
    positions: Any  # int32: the position within the document


def split_segments(segment_ids: np.ndarray, tokens: np.ndarray, eos_id: int | None) -> np.ndarray:
    """Relabel ``[..., L]`` segment ids 1, 2, ... so a new segment also starts after each EOS.

    Segment 0 (padding) stays 0.
    """
    seg = np.asarray(segment_ids)
    starts = np.zeros(seg.shape, bool)
    starts[..., 0] = True
    starts[..., 1:] = seg[..., 1:] != seg[..., :-1]
    if eos_id is not None:
        starts[..., 1:] |= np.asarray(tokens)[..., :-1] == eos_id
    out = np.cumsum(starts, axis=-1).astype(np.int32)
    return np.where(seg == 0, 0, out).astype(np.int32)


def positions_from_segments(segment_ids: np.ndarray) -> np.ndarray:
    """Position of each token within its segment: ``[..., L]`` int32."""
    seg = np.asarray(segment_ids)
    L = seg.shape[-1]
    idx = np.broadcast_to(np.arange(L, dtype=np.int32), seg.shape)
    starts = np.ones(seg.shape, bool)
    starts[..., 1:] = seg[..., 1:] != seg[..., :-1]
    start_idx = np.maximum.accumulate(np.where(starts, idx, 0), axis=-1)
    return (idx - start_idx).astype(np.int32)


def model_batch(rows: np.ndarray, segment_ids: np.ndarray, pad_id: int) -> Batch:
    """Rows ``[B, T+1]`` with their segment ids -> the :class:`Batch` of inputs and targets ``[B, T]``."""
    rows = np.asarray(rows, np.int32)
    seg = np.asarray(segment_ids, np.int32)
    inputs, targets = rows[:, :-1], rows[:, 1:]
    seg_in, seg_out = seg[:, :-1], seg[:, 1:]
    return Batch(tokens=np.where(seg_in == 0, pad_id, inputs).astype(np.int32),
                 targets=np.where(seg_out == 0, pad_id, targets).astype(np.int32),
                 loss_mask=(seg_in == seg_out) & (seg_in > 0),
                 segment_ids=seg_in,
                 positions=positions_from_segments(seg_in))
