"""``paged_attention``: validation, split sizing, backend dispatch and the split-K merge.

Split-K (flash-decoding): a sequence's ``M`` pages are cut into ``Z`` splits of ``pages_per_split``
pages, each reduced by its own program; :func:`merge_splits` combines the ``Z`` partials.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from pallas_kernels.paged_attention.reference import check_decode_inputs, paged_attention_reference
from pallas_kernels.paged_attention.xla import XLA_MIN_POSITIONS, paged_attention_xla
from pallas_kernels.typing import BlockTables, DecodeOut, DecodeQuery, Lengths, Pages, Slopes

BACKENDS = ("auto", "gpu", "tpu", "reference", "xla")


def merge_splits(acc: Float[Array, "B K Z G H"], m: Float[Array, "B K Z G"],
                 l: Float[Array, "B K Z G"]) -> Float[Array, "B K G H"]:
    """Log-sum-exp merge of per-split partials ``acc [B,K,Z,G,H]``, ``m, l [B,K,Z,G]`` -> ``[B,K,G,H]``.

    Splits that saw no key have ``m = -inf, l = 0`` and drop out; a sequence with
    no key at all gets zeros.
    """
    m_max = jnp.max(m, axis=2, keepdims=True)
    m_max = jnp.where(jnp.isfinite(m_max), m_max, 0.0)
    w = jnp.exp(m - m_max)  # [B, K, Z, G]
    denom = jnp.sum(w * l, axis=2)  # [B, K, G]
    num = jnp.sum(w[..., None] * acc, axis=2)  # [B, K, G, H]
    return num / jnp.where(denom == 0.0, 1.0, denom)[..., None]


def default_pages_per_split(M: int, B: int, K: int, num_splits: int | None, pages_per_split: int | None) -> int:
    """Pages per split: from ``num_splits`` or ``pages_per_split``, else enough splits to give
    the device ~128 parallel programs (flash-decoding), at least 8 pages each."""
    if num_splits is not None and pages_per_split is not None:
        raise ValueError(f"give num_splits={num_splits} or pages_per_split={pages_per_split}, not both")
    if pages_per_split is not None:
        if pages_per_split < 1:
            raise ValueError(f"pages_per_split={pages_per_split} must be >= 1")
        return min(pages_per_split, M)
    if num_splits is None:
        num_splits = max(1, min(-(-128 // (B * K)), M // 8))
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    return -(-M // min(num_splits, M))


def paged_attention(q: DecodeQuery, k_pages: Pages, v_pages: Pages, block_tables: BlockTables, lengths: Lengths,
                    *, scale: float | None = None, alibi_slopes: Slopes | None = None,
                    softcap: float | None = None, window: int | None = None, num_splits: int | None = None,
                    pages_per_split: int | None = None, backend: str = "auto",
                    interpret: bool = False) -> DecodeOut:
    """Decode attention of one query token per sequence against a paged KV cache.

    Args:
      q: ``[B, N, H]``, the token at position ``lengths[b] - 1``.
      k_pages, v_pages: ``[K, P, L, H]`` page pools (``N % K == 0``).
      block_tables: ``[B, M]`` int, page ids of each sequence's logical pages.
      lengths: ``[B]`` int, tokens in each sequence (``<= M * L``; 0 gives zeros).
      scale: logits scale, default ``1/sqrt(H)``; a traced one only with the "reference" and "xla" forms
        (the kernels need a number: ValueError).
      alibi_slopes: ``[N]`` or ``[B, N]``; adds ``-slope * (lengths[b] - 1 - pos)``.
      softcap: logit soft-capping, applied before ALiBi.
      window: sliding window (static int): only keys at ``pos >= lengths[b] - window`` are seen,
        the query's last ``window``. Positions are relative, so tables may start past dropped pages.
      num_splits / pages_per_split: split-K over pages, ``Z`` splits of ``pages_per_split`` pages
        (at most one of the two).
      backend: "gpu" (Triton), "tpu" (Mosaic), "reference", "xla" (plain JAX in the form XLA's CPU backend
        runs fastest at long contexts: :mod:`pallas_kernels.paged_attention.xla`), or "auto" (the kernel of
        the default device; on the CPU, unless ``interpret``, "xla" from ``XLA_MIN_POSITIONS`` table
        positions ``M * L`` on with no mesh active (its gather merges the kv-head axis into the pages'), and
        the reference otherwise).
      interpret: run the kernel in Pallas interpret mode (CPU testing).
    Returns:
      ``[B, N, H]`` in ``q.dtype``.
    """
    check_decode_inputs(q, k_pages, v_pages, block_tables, lengths, alibi_slopes, window, softcap)
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    B, N, H = q.shape
    K = k_pages.shape[0]
    G = N // K
    M = block_tables.shape[1]
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    if backend == "auto":
        platform = jax.default_backend()
        if platform in ("gpu", "tpu"):
            backend = platform
        elif interpret:
            backend = "gpu"
        else:
            long = M * k_pages.shape[2] >= XLA_MIN_POSITIONS
            backend = "xla" if long and jax.sharding.get_abstract_mesh().empty else "reference"
    if backend in ("reference", "xla"):
        plain = paged_attention_reference if backend == "reference" else paged_attention_xla
        return plain(q, k_pages, v_pages, block_tables, lengths, scale=scale, alibi_slopes=alibi_slopes,
                     softcap=softcap, window=window)
    try:  # the kernels close over the scale; the plain forms above also take a traced one
        scale = float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise ValueError(f"paged_attention(backend={backend!r}) needs a static scale (a Python or NumPy number), "
                         f"got {scale!r}; backend='reference' or 'xla' takes a traced one") from None
    pps = default_pages_per_split(M, B, K, num_splits, pages_per_split)
    slopes = None
    if alibi_slopes is not None:
        slopes = jnp.broadcast_to(jnp.asarray(alibi_slopes, jnp.float32), (B, N)).reshape(B, K, G)
    if backend == "gpu":
        from pallas_kernels.paged_attention.gpu import paged_attention_partials_gpu as partials
    else:
        from pallas_kernels.paged_attention.tpu import paged_attention_partials_tpu as partials
    acc, m, l = partials(q.reshape(B, K, G, H), k_pages, v_pages, block_tables, jnp.asarray(lengths),
                         slopes, scale=scale, softcap=None if softcap is None else float(softcap),
                         window=window, pages_per_split=pps, interpret=interpret)
    return merge_splits(acc, m, l).reshape(B, N, H).astype(q.dtype)
