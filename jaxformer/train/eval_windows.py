"""Validation windows: the validation stream cut into rows that score each token exactly once."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from jaxformer.train.packing import Batch, model_batch, split_segments


@dataclass
class EvalSet:
    """Windows ``[W, T+1]`` of the validation stream; each token is a target in exactly one window.

    ``score_from[w]``: window ``w`` scores only its targets at positions ``>= score_from[w]``
    (the earlier ones are context, scored by the window before).
    """

    rows: np.ndarray
    segment_ids: np.ndarray
    pad_id: int
    score_from: np.ndarray | None = None

    def _batch(self, rows, seg, score_from) -> Batch:
        b = model_batch(rows, seg, self.pad_id)
        if score_from is not None:
            b = b._replace(loss_mask=b.loss_mask & (np.arange(rows.shape[1] - 1)[None, :] >= score_from[:, None]))
        return b

    def batches(self, batch_size: int):
        for i in range(0, len(self.rows), batch_size):
            rows, seg = self.rows[i:i + batch_size], self.segment_ids[i:i + batch_size]
            frm = None if self.score_from is None else self.score_from[i:i + batch_size]
            n = len(rows)
            if n < batch_size:
                rows = np.concatenate([rows, np.full((batch_size - n, rows.shape[1]), self.pad_id, np.int32)])
                seg = np.concatenate([seg, np.zeros((batch_size - n, seg.shape[1]), np.int32)])
                if frm is not None:
                    frm = np.concatenate([frm, np.zeros((batch_size - n,), frm.dtype)])
            yield self._batch(rows, seg, frm)

    def target_ids(self) -> np.ndarray:
        """The ids that are scored, in order (for byte counts and compressor baselines)."""
        b = self._batch(self.rows, self.segment_ids, self.score_from)
        return b.targets[b.loss_mask]


def eval_windows(stream: np.ndarray, *, seq_len: int, tokenizer, max_tokens: int | None = None,
                 stride: int | None = None) -> EvalSet:
    """Cut the validation stream into windows of ``seq_len`` targets, ``stride`` apart (default: ``seq_len``).

    With ``stride < seq_len`` (sliding-window evaluation) every window after the first scores only
    its last ``stride`` targets, so each scored token sees at least ``seq_len - stride`` tokens of
    its document before it (as far as the document goes back); the cost is ``seq_len / stride``
    forward passes per token. ``max_tokens``: evenly spaced windows scoring about that many tokens.
    """
    stream = np.asarray(stream, np.int32)
    if len(stream) < 2:
        raise ValueError(f"the validation split has {len(stream)} tokens; raise data.val_fraction")
    T = seq_len
    stride = T if stride is None else stride
    if not 1 <= stride <= T:
        raise ValueError(f"eval.stride={stride} must be in [1, seq_len={T}]")
    starts = _starts(len(stream), T, stride, max_tokens)
    rows, seg = _pack([stream[s:s + T + 1] for s in starts], T, tokenizer.pad_id)
    score_from = None if stride == T else np.where(starts == 0, 0, T - stride).astype(np.int32)
    return EvalSet(rows, split_segments(seg, rows, tokenizer.eos_id), tokenizer.pad_id, score_from)


def _starts(n_stream: int, T: int, stride: int, max_tokens: int | None) -> np.ndarray:
    """Start offsets of windows of ``T`` targets ``stride`` apart over a stream of ``n_stream`` tokens: all of
    them, or (``max_tokens``) evenly spaced ones scoring about that many."""
    n_total = 1 + math.ceil(max(n_stream - 1 - T, 0) / stride)
    n = n_total if max_tokens is None else max(1, min(n_total, max_tokens // stride))
    return (np.arange(n, dtype=np.int64) * n_total // n) * stride


def _pack(pieces, T: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[W, T+1]`` (padded with ``pad_id``) and their segment ids (1 on the tokens, 0 on padding)."""
    rows = np.full((len(pieces), T + 1), pad_id, np.int32)
    seg = np.zeros((len(pieces), T + 1), np.int32)
    for r, piece in enumerate(pieces):
        rows[r, :len(piece)] = piece
        seg[r, :len(piece)] = 1
    return rows, seg


def nested_windows(stream: np.ndarray, *, seq_len: int, span: int, tokenizer,
                   max_tokens: int | None = None) -> EvalSet:
    """The same scored tokens at every ``seq_len <= span``: windows of ``seq_len`` tiling spans of ``span``.

    The spans are :func:`eval_windows`' windows at length ``span`` (evenly spaced, scoring about
    ``max_tokens`` targets; None: the whole split); each is cut into consecutive windows of
    ``seq_len`` targets (the last one shorter when ``seq_len`` does not divide ``span``). The
    targets scored are those of the spans whatever ``seq_len`` is, so evaluations at several
    lengths that share ``span`` and ``max_tokens`` score exactly the same tokens; a shorter
    window only sees less of what came before (its first target sees one token of context).
    """
    stream = np.asarray(stream, np.int32)
    if len(stream) < 2:
        raise ValueError(f"the validation split has {len(stream)} tokens; raise data.val_fraction")
    if not 1 <= seq_len <= span:
        raise ValueError(f"seq_len={seq_len} must be in [1, span={span}]")
    pieces = []
    for s in _starts(len(stream), span, span, max_tokens):
        end = min(s + span + 1, len(stream))  # the span's last target + 1
        for j in range(s, end - 1, seq_len):
            pieces.append(stream[j:min(j + seq_len + 1, end)])
    rows, seg = _pack(pieces, seq_len, tokenizer.pad_id)
    return EvalSet(rows, split_segments(seg, rows, tokenizer.eos_id), tokenizer.pad_id)
