"""``pallas_attention``: ``dot_product_attention(impl="pallas")`` on the Pallas FlashAttention kernels.

Adapts a :class:`MaskSpec` to ``pallas_kernels.flash_attention.flash_attention``
keywords. On CPU the GPU kernel runs in Pallas interpret mode (correct but slow;
for tests). A traced ``q_offset`` (decode, chunked prefill with per-sequence
offsets) cannot drive the kernels' static block skipping: ``dot_product_attention``
sends those calls to :func:`jaxformer.ops.blockwise.blockwise_attention`, which
has the same meaning, and ``pallas_attention`` refuses them.

Longformer / BigBird masks (``global_tokens``, ``random_blocks``) go to the
kernels' block-sparse path: ``MaskSpec.block_map`` (per head, global rows
included) becomes the kernels' tile lists, so forward, dq and dk/dv visit only
the listed tiles; global queries/keys and each row's random key blocks are
passed as flags and block starts, and the tiles apply the exact mask of
:meth:`MaskSpec.dense_heads`.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxformer.ops.masks import MaskSpec
from pallas_kernels.flash_attention.common import check_qkv

SUPPORTS_MASK_PATTERNS = True


def pallas_attention(q, k, v, *, mask: MaskSpec | None = None, scale: float | None = None,
                     alibi_slopes=None, softcap: float | None = None, block_sizes=None):
    """Attention ``q [B,T,N,H], k, v [B,S,K,H] -> [B,T,N,H]`` through the flash kernels (see module docstring)."""
    B, T, S, N, K, H = check_qkv(q, k, v)
    mask = MaskSpec() if mask is None else mask
    mask.validate(B, T, S, N)
    if not mask.has_static_offset:
        use = "impl='xla'" if mask.has_pattern else "impl='blockwise'"
        raise ValueError(f"pallas_attention needs a static q_offset; got an array of shape "
                         f"{np.shape(mask.q_offset)}: use {use}")
    from pallas_kernels.flash_attention import flash_attention

    kv_seg = mask.resolved_kv_segment_ids(T, S)
    return flash_attention(
        q, k, v,
        causal=mask.causal,
        window=mask.window,
        q_segment_ids=mask.q_segment_ids,
        kv_segment_ids=kv_seg,
        kv_lengths=mask.kv_lengths,
        q_offset=mask.static_offset(T, S),
        alibi_slopes=alibi_slopes,
        softcap=softcap,
        scale=scale,
        block_sizes=block_sizes,
        interpret=jax.default_backend() not in ("gpu", "tpu"),
        **pattern_operands(mask, T, S),
    )


def pattern_operands(mask: MaskSpec, T: int, S: int) -> dict:
    """``flash_attention``'s block-sparse keywords for ``mask`` (static numpy); empty without active patterns."""
    if not mask.patterns_active:
        return {}
    offset = mask.static_offset(T, S)
    qp = offset + np.arange(T)

    def block_map(block_q: int, block_k: int) -> np.ndarray:
        return mask.block_map(T, S, block_q, block_k, per_head=True)

    ops = dict(block_map=block_map)
    if mask.global_tokens is not None:
        g = mask.global_array  # [Bg, g], -1 pads
        ops["q_global"] = np.stack([np.isin(qp, row[row >= 0]) for row in g])
        ops["kv_global"] = np.stack([np.isin(np.arange(S), row[row >= 0]) for row in g])
    rb = mask.random_blocks
    if rb is not None:
        R = rb.block_size
        rq = qp // R
        tbl = rb.table(rq.min(), rq.max() + 1, -(-S // R))  # [heads, nrb, r]
        if tbl.shape[-1]:
            starts = tbl[:, rq - rq.min()] * R  # [heads, T, r]
            ops.update(random_kv_starts=np.ascontiguousarray(starts.transpose(0, 2, 1)).astype(np.int32),
                       random_block_size=R)
    return ops
