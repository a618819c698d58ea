"""``flash_attention``: one differentiable entry point for the GPU and TPU kernels."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jaxtyping import Bool, Integer

from pallas_kernels.flash_attention.common import BlockSizes
from pallas_kernels.typing import ArrayLike, AttnOut, KeyValue, KvSegmentIds, Lengths, Query, SegmentIds, Slopes

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


def flash_attention(q: Query, k: KeyValue, v: KeyValue, *, causal: bool = False,
                    window: tuple[int | None, int | None] | None = None, q_segment_ids: SegmentIds | None = None,
                    kv_segment_ids: KvSegmentIds | None = None, kv_lengths: Lengths | None = None,
                    q_offset: int | None = None, alibi_slopes: Slopes | None = None, softcap: float | None = None,
                    scale: float | None = None, block_sizes: BlockSizes | None = None, backend: str = "auto",
                    interpret: bool = False, block_map: Callable | None = None,
                    q_global: Bool[ArrayLike, "#B T"] | Integer[ArrayLike, "#B T"] | None = None,
                    kv_global: Bool[ArrayLike, "#B S"] | Integer[ArrayLike, "#B S"] | None = None,
                    random_kv_starts: Integer[ArrayLike, "#N _ T"] | None = None,
                    random_block_size: int | None = None) -> AttnOut:
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
      block_map: static callable ``(block_q, block_k) -> bool [Nh, ceil(T/block_q), ceil(S/block_k)]``
        (Nh 1 or N): the tiles that may hold an allowed element. When given, the forward, dq and dk/dv
        kernels visit exactly these tiles (causal/window skipping is then the caller's map); tiles absent
        from it are never read. Needed with any of the three pattern operands below.
      q_global: ``[1|B, T]`` bool/int; nonzero rows see every key (Longformer global queries).
      kv_global: ``[1|B, S]`` bool/int; nonzero keys are seen by every query (Longformer global keys).
      random_kv_starts: int32 ``[1|N, r, T]`` with ``random_block_size`` R: query row q (of head h) also
        sees keys ``[start, start + R)`` for each ``start = random_kv_starts[h, i, q] >= 0`` (BigBird).
        Per tile: ``allowed = hard & (band | q_global | kv_global | random)``; the pattern operands widen
        the window's band and change nothing without a window (``MaskSpec.dense_heads``'s meaning).

    Rows with no allowed key give 0 and zero gradients. Ids and slopes get zero cotangents.
    """
    # The backend's entry point validates every argument, once (common.check_inputs).
    kwargs = dict(causal=causal, window=window, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                  kv_lengths=kv_lengths, q_offset=q_offset, alibi_slopes=alibi_slopes, softcap=softcap,
                  scale=scale, block_sizes=block_sizes, interpret=interpret, block_map=block_map,
                  q_global=q_global, kv_global=kv_global, random_kv_starts=random_kv_starts,
                  random_block_size=random_block_size)
    chosen = _pick_backend(backend, interpret)
    if chosen == "gpu":
        from pallas_kernels.flash_attention.gpu import flash_attention_gpu
        return flash_attention_gpu(q, k, v, **kwargs)
    from pallas_kernels.flash_attention.tpu import flash_attention_tpu
    return flash_attention_tpu(q, k, v, **kwargs)
