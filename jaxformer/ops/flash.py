"""``pallas_attention``: ``dot_product_attention(impl="pallas")`` on the Pallas FlashAttention kernels.

Adapts a :class:`MaskSpec` to ``pallas_kernels.flash_attention.flash_attention``
keywords. On CPU the GPU kernel runs in Pallas interpret mode (correct but slow;
for tests). A traced ``q_offset`` (decode, chunked prefill with per-sequence
offsets) cannot drive the kernels' static block skipping, so those calls fall
back to :func:`jaxformer.ops.blockwise.blockwise_attention`, which has the same
meaning.
"""

from __future__ import annotations

import jax

from jaxformer.ops.attention import check_qkv
from jaxformer.ops.masks import MaskSpec


def pallas_attention(q, k, v, *, mask: MaskSpec | None = None, scale: float | None = None,
                     alibi_slopes=None, softcap: float | None = None, block_sizes=None):
    """Attention ``q [B,T,N,H], k, v [B,S,K,H] -> [B,T,N,H]`` through the flash kernels (see module docstring)."""
    B, T, S, N, K, H = check_qkv(q, k, v)
    mask = MaskSpec() if mask is None else mask
    mask.validate(B, T, S, N)
    if mask.has_pattern:
        raise ValueError("pallas_attention does not handle MaskSpec.global_tokens / random_blocks; "
                         "use jaxformer.ops.sparse.sparse_attention or xla_attention")
    if not mask.has_static_offset:
        from jaxformer.ops.blockwise import blockwise_attention
        return blockwise_attention(q, k, v, mask=mask, scale=scale, alibi_slopes=alibi_slopes, softcap=softcap)
    from pallas_kernels.flash_attention import flash_attention

    kv_seg = mask.resolved_kv_segment_ids(T, S)
    if kv_seg is not None and mask.q_segment_ids is None:
        raise ValueError("MaskSpec: kv_segment_ids given without q_segment_ids")
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
    )
