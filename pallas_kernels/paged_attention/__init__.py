"""Paged-attention decode kernels (GPU Triton, TPU Mosaic), their plain-JAX reference, and a plain-JAX form
for the CPU at long contexts."""

from pallas_kernels.paged_attention.api import merge_splits, paged_attention
from pallas_kernels.paged_attention.reference import gather_pages, paged_attention_reference
from pallas_kernels.paged_attention.xla import paged_attention_xla

__all__ = ["paged_attention", "paged_attention_reference", "paged_attention_xla", "gather_pages", "merge_splits"]
