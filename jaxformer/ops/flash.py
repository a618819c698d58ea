"""``pallas_attention``: ``dot_product_attention(impl="pallas")`` on the Pallas FlashAttention kernels.

Adapts a :class:`MaskSpec` to the kernels' mask object
(:class:`~pallas_kernels.kernel_mask.KernelMask`, by ``MaskSpec.kernel_mask``). On CPU the GPU
kernel runs in Pallas interpret mode (correct but slow; for tests). A traced ``q_offset`` (decode, chunked prefill with per-sequence
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
from pallas_kernels.shapes import check_qkv

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
    from pallas_kernels.flash_attention.api import attend
    from pallas_kernels.flash_attention.tiles import Logits

    return attend(q, k, v, mask.kernel_mask(T, S), Logits(scale=scale, softcap=softcap, alibi_slopes=alibi_slopes),
                  block_sizes=block_sizes, interpret=jax.default_backend() not in ("gpu", "tpu"))


def pattern_operands(mask: MaskSpec, T: int, S: int) -> dict:
    """``flash_attention``'s block-sparse keywords for ``mask`` (from :meth:`MaskSpec.kernel_mask`); empty
    without active patterns. For calls through the keyword API (tests, benchmarks)."""
    km = mask.kernel_mask(T, S)
    names = ("block_map", "q_global", "kv_global", "random_kv_starts", "random_block_size")
    return {name: getattr(km, name) for name in names if getattr(km, name) is not None}
