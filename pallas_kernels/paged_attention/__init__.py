"""Paged-attention decode kernels (GPU Triton, TPU Mosaic) and their plain-JAX reference."""

from pallas_kernels.paged_attention.api import merge_splits, paged_attention
from pallas_kernels.paged_attention.reference import gather_pages, paged_attention_reference

__all__ = ["paged_attention", "paged_attention_reference", "gather_pages", "merge_splits"]
