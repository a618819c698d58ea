"""``flash_attention``: one differentiable entry point for the GPU and TPU kernels."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jaxtyping import Bool, Integer

from pallas_kernels.flash_attention.blocks import BlockSizes
from pallas_kernels.flash_attention.checks import check_logits, check_mask, check_operands
from pallas_kernels.flash_attention.tiles import Logits
from pallas_kernels.kernel_mask import KernelMask
from pallas_kernels.shapes import check_qkv
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
    B, T, S, N, K, H = check_qkv(q, k, v)
    mask = KernelMask(q_len=T, kv_len=S, causal=causal, window=window, q_offset=q_offset, block_map=block_map,
                      random_block_size=random_block_size, q_segment_ids=q_segment_ids,
                      kv_segment_ids=kv_segment_ids, kv_lengths=kv_lengths, q_global=q_global, kv_global=kv_global,
                      random_kv_starts=random_kv_starts)
    return attend(q, k, v, mask, Logits(scale=scale, softcap=softcap, alibi_slopes=alibi_slopes),
                  block_sizes=block_sizes, backend=backend, interpret=interpret)


def attend(q: Query, k: KeyValue, v: KeyValue, mask: KernelMask, logits: Logits | None = None,
           block_sizes: BlockSizes | None = None, backend: str = "auto", interpret: bool = False) -> AttnOut:
    """:func:`flash_attention` with its mask and logits as objects (what ``jaxformer.ops`` calls).

    Checks every argument once (``checks``), then runs the chosen backend's kernels.
    """
    B, T, S, N, K, H = check_operands(q, k, v)
    if (mask.q_len, mask.kv_len) != (T, S):
        raise ValueError(f"KernelMask(q_len={mask.q_len}, kv_len={mask.kv_len}) does not fit {q.shape=} {k.shape=}")
    mask = check_mask(mask, B, N)
    logits = check_logits(Logits() if logits is None else logits, B, N, H)
    chosen = _pick_backend(backend, interpret)
    if chosen == "gpu":
        from pallas_kernels.flash_attention import gpu
        return gpu.attend(q, k, v, mask, logits, block_sizes, interpret)
    from pallas_kernels.flash_attention import tpu
    return tpu.attend(q, k, v, mask, logits, block_sizes, interpret)


def flash_attention_gpu(q: Query, k: KeyValue, v: KeyValue, **kwargs) -> AttnOut:
    """:func:`flash_attention` on the Pallas Triton kernels (``backend="gpu"``)."""
    return flash_attention(q, k, v, backend="gpu", **kwargs)


def flash_attention_tpu(q: Query, k: KeyValue, v: KeyValue, **kwargs) -> AttnOut:
    """:func:`flash_attention` on the Pallas Mosaic kernels (``backend="tpu"``; on CPU inside
    ``pltpu.force_tpu_interpret_mode()`` or with ``interpret=True``)."""
    return flash_attention(q, k, v, backend="tpu", **kwargs)
