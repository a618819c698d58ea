"""The attention mask rule: which key a query may see, one element at a time.

Every attention path evaluates this one function: ``jaxformer.ops.masks.MaskSpec.dense``
(the reference meaning) on the whole ``[T, S]`` grid, the blockwise and block-sparse
paths of ``jaxformer.ops`` on their tiles, and the flash-attention kernels inside their
bodies (``KernelMask.allowed``). Only the kernels' test oracle,
``flash_attention/reference.py``, writes the definition out again on purpose: a test
that compares a function with itself proves nothing.

Positions are absolute: keys sit at ``0 .. S-1``, query ``i`` at ``q_offset + i``::

    allowed = causal AND (band OR q_global OR kv_global OR random)
              AND segments AND kv_length AND num_keys

* ``causal``: ``k_pos <= q_pos``.
* ``window=(left, right)``, the band: ``q_pos - left <= k_pos <= q_pos + right``; a None
  side is unbounded. Without a window (or with ``(None, None)``) there is no band and
  the pattern terms change nothing: they only widen a band.
* ``q_segment == kv_segment``: packed documents attend within their own segment.
* ``k_pos < kv_length``: keys past a sequence's length are padding.
* ``k_pos < num_keys``: keys a caller added to fill a whole block (the true ``S``).
* ``q_global`` / ``kv_global`` / ``random``: bool terms of the Longformer / BigBird
  patterns (a global query sees every key, a global key is seen by every query, a
  random block is seen by its query block), each already evaluated at these positions.

Every operand broadcasts against the others (``q_pos [.., bq, 1]``, ``k_pos [.., 1, bk]``
and so on) and may be a numpy array, a jax array or a value loaded inside a Pallas
kernel body: only comparisons, ``+``, ``-``, ``&`` and ``|`` are used, which Triton and
Mosaic both lower.

:class:`pallas_kernels.kernel_mask.KernelMask` is the same description as the kernels receive it
(this module stays a leaf that imports nothing, so the rule runs on plain numpy too).
"""

from __future__ import annotations

from typing import Any


def mask_rule(q_pos, k_pos, *, causal: bool = False, window: tuple[int | None, int | None] | None = None,
              q_segment=None, kv_segment=None, kv_length=None, num_keys: int | None = None,
              q_global=None, kv_global=None, random=None) -> Any:
    """Bool ``allowed`` of the broadcast shape of the operands; None when no term applies (all allowed).

    See the module docstring for each term. ``q_segment`` and ``kv_segment`` come together.
    """
    hard = []
    if causal:
        hard.append(k_pos <= q_pos)
    left, right = (None, None) if window is None else window
    band = None
    if left is not None:
        band = k_pos >= q_pos - left
    if right is not None:
        upper = k_pos <= q_pos + right
        band = upper if band is None else band & upper
    if band is not None:
        for term in (q_global, kv_global, random):
            if term is not None:
                band = band | term
        hard.append(band)
    if q_segment is not None:
        hard.append(q_segment == kv_segment)
    if kv_length is not None:
        hard.append(k_pos < kv_length)
    if num_keys is not None:
        hard.append(k_pos < num_keys)
    if not hard:
        return None
    allowed = hard[0]
    for term in hard[1:]:
        allowed = allowed & term
    return allowed
