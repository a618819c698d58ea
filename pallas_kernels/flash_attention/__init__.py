"""Blockwise FlashAttention (forward + backward) in Pallas for GPU (Triton) and TPU (Mosaic).

``flash_attention`` is the differentiable entry point; ``reference`` is the
plain-einsum oracle with the same arguments; ``BlockSizes`` sets the tiles;
``flash_attention_gpu`` / ``flash_attention_tpu`` are ``flash_attention`` with the backend chosen.
"""

from pallas_kernels.flash_attention.api import flash_attention, flash_attention_gpu, flash_attention_tpu
from pallas_kernels.flash_attention.blocks import BlockSizes
from pallas_kernels.flash_attention.reference import reference

__all__ = ["flash_attention", "flash_attention_gpu", "flash_attention_tpu", "reference", "BlockSizes"]
