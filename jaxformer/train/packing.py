"""Packed rows to model batches: rows ``[B, T+1]`` with segment ids -> inputs, targets, positions, mask.

A row gives ``inputs = row[:-1]``, ``targets = row[1:]``; segment 0 is padding; a
target counts only inside its input's segment, so nothing is learned across a
piece or document boundary. Used by the training stream and the validation windows.
"""

from __future__ import annotations

import numpy as np


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


def model_batch(rows: np.ndarray, segment_ids: np.ndarray, pad_id: int) -> dict[str, np.ndarray]:
    """Rows ``[B, T+1]`` with their segment ids -> model inputs/targets ``[B, T]``.

    ``mask`` is True where the target lies in its input's segment (and is not padding).
    """
    rows = np.asarray(rows, np.int32)
    seg = np.asarray(segment_ids, np.int32)
    inputs, targets = rows[:, :-1], rows[:, 1:]
    seg_in, seg_out = seg[:, :-1], seg[:, 1:]
    return {
        "inputs": np.where(seg_in == 0, pad_id, inputs).astype(np.int32),
        "targets": np.where(seg_out == 0, pad_id, targets).astype(np.int32),
        "segment_ids": seg_in,
        "positions": positions_from_segments(seg_in),
        "mask": (seg_in == seg_out) & (seg_in > 0),
    }
