"""``flash_attention``: one differentiable entry point for the GPU and TPU kernels."""

from __future__ import annotations

import jax

from pallas_kernels.flash_attention import common
from pallas_kernels.flash_attention.common import BlockSizes

BACKEND_CHOICES = ("auto", "gpu", "tpu")


def _pick_backend(backend: str, interpret: bool) -> str:
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend={backend!r} is not one of {BACKEND_CHOICES}")
    if backend != "auto":
        return backend
    platform = jax.default_backend()
    if platform in ("gpu", "tpu"):
        return platform
    if interpret:
        return "gpu"
    raise ValueError(
        f"flash_attention has no compiled kernel for jax.default_backend()={platform!r}; pass interpret=True "
        "to run the GPU kernel in interpret mode (slow; for tests), or use jaxformer.ops.blockwise"
    )


def flash_attention(q, k, v, *, causal: bool = False, window=None, q_segment_ids=None,
                    kv_segment_ids=None, kv_lengths=None, q_offset: int | None = None,
                    alibi_slopes=None, softcap: float | None = None, scale: float | None = None,
                    block_sizes: BlockSizes | None = None, backend: str = "auto", interpret: bool = False):
    """Blockwise attention ``q [B,T,N,H], k, v [B,S,K,H] -> [B,T,N,H]``, differentiable in q, k, v.

    Args:
      causal: key position <= query position.
      window: ``(left, right)``; query at p sees keys ``p-left .. p+right``; a None side is unbounded.
      q_segment_ids, kv_segment_ids: int ``[B, T]`` and ``[B, S]``; attend within equal ids (both or neither).
      kv_lengths: int ``[B]``; keys at positions ``>= kv_lengths[b]`` are padding.
      q_offset: static int position of query 0; None means ``S - T`` (bottom-right aligned).
      alibi_slopes: ``[N]`` or ``[B, N]``; adds ``-slope * |q_pos - k_pos|`` after the softcap.
      softcap: logits become ``softcap * tanh(s / softcap)``.
      scale: default ``1/sqrt(H)``.
      block_sizes: :class:`BlockSizes`; default per backend.
      backend: "gpu" (Pallas Triton), "tpu" (Pallas Mosaic) or "auto" (``jax.default_backend()``;
        on CPU the GPU kernel in interpret mode when ``interpret=True``).
      interpret: run the kernel in Pallas interpret mode.

    Rows with no allowed key give 0 and zero gradients. Ids and slopes get zero cotangents.
    """
    common.check_inputs(q, k, v, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                        kv_lengths=kv_lengths, q_offset=q_offset, alibi_slopes=alibi_slopes,
                        softcap=softcap, scale=scale)
    common.check_window(window)
    kwargs = dict(causal=causal, window=window, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                  kv_lengths=kv_lengths, q_offset=q_offset, alibi_slopes=alibi_slopes, softcap=softcap,
                  scale=scale, block_sizes=block_sizes, interpret=interpret)
    chosen = _pick_backend(backend, interpret)
    if chosen == "gpu":
        from pallas_kernels.flash_attention.gpu import flash_attention_gpu
        return flash_attention_gpu(q, k, v, **kwargs)
    from pallas_kernels.flash_attention.tpu import flash_attention_tpu
    return flash_attention_tpu(q, k, v, **kwargs)
