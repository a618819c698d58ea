"""Paged-attention decode in Pallas for GPU (Triton lowering).

Grid ``(B, K, Z)``: one program per sequence, kv head and split of pages. A
program holds the ``G`` query heads of its kv head as one ``[G, H]`` tile
(padded to a power of two >= 16 rows for ``tl.dot``), walks its pages in order,
loading each ``[L, H]`` page of k and v straight from the pool at the row the
block table names (no contiguous copy of the cache is ever made), and keeps an
online softmax. It writes its unnormalised accumulator with the running max and
sum, which the caller merges across splits by log-sum-exp (flash-decoding). With
a sliding ``window`` the walk starts at the first page holding a visible key.
Warps and pipeline stages come from :mod:`pallas_kernels.block_table` (the ``"paged"`` entry of
the device's architecture, head dim and dtype) unless the caller passes them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float

from pallas_kernels import block_table
from pallas_kernels.typing import BlockTables, Lengths, Pages

NEG_INF = float("-inf")


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _kernel(lengths_ref, tables_ref, q_ref, slopes_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *,
            scale: float, softcap: float | None, use_alibi: bool, window: int | None, page_size: int,
            pages_per_split: int):
    b = pl.program_id(0)
    split = pl.program_id(2)
    length = lengths_ref[b]
    num_pages = (length + page_size - 1) // page_size
    first = split * pages_per_split
    last = jnp.minimum(first + pages_per_split, num_pages)
    if window is not None:  # skip pages wholly behind the window
        first = jnp.maximum(first, jnp.maximum(length - window, 0) // page_size)
    q = q_ref[...]  # [Gp, H]
    slopes = slopes_ref[...] if use_alibi else None  # [Gp]
    offsets = jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)

    def body(i, carry):
        m, l, acc = carry
        page = tables_ref[i]
        k = k_ref[page]  # [L, H]
        v = v_ref[page]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale  # [Gp, L]
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        pos = i * page_size + offsets  # [1, L]
        if use_alibi:
            s = s - slopes[:, None] * (length - 1 - pos).astype(jnp.float32)
        visible = pos < length
        if window is not None:
            visible &= pos >= length - window
        s = jnp.where(visible, s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l_new = alpha * l + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        return m_new, l_new, acc * alpha[:, None] + pv

    Gp, H = q.shape
    init = (jnp.full((Gp,), NEG_INF, jnp.float32), jnp.zeros((Gp,), jnp.float32),
            jnp.zeros((Gp, H), jnp.float32))
    m, l, acc = jax.lax.fori_loop(first, last, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "window", "pages_per_split", "interpret",
                                             "num_warps", "num_stages"))
def paged_attention_partials_gpu(q: Float[Array, "B K G H"], k_pages: Pages, v_pages: Pages, block_tables: BlockTables,
                                 lengths: Lengths, slopes: Float[Array, "B K G"] | None, *, scale: float,
                                 softcap: float | None, pages_per_split: int, window: int | None = None,
                                 interpret: bool = False, num_warps: int | None = None, num_stages: int | None = None,
                                 ) -> tuple[Float[Array, "B K Z G H"], Float[Array, "B K Z G"], Float[Array, "B K Z G"]]:
    """Per-split partial results for ``q [B, K, G, H]`` (already grouped by kv head).

    ``slopes``: ``[B, K, G]`` fp32 or None; ``window``: None or the keys each query sees.
    ``num_warps`` / ``num_stages``: None takes the block table's ``"paged"`` entry for this GPU, read
    when the call is traced. Returns ``acc [B, K, Z, G, H]`` (unnormalised, fp32), ``m, l [B, K, Z, G]``
    (running max and sum of ``exp(s - m)``) for the ``Z = ceil(M / pages_per_split)`` splits.
    """
    if num_warps is None or num_stages is None:
        cfg = block_table.lookup("paged", max(16, _next_pow2(q.shape[-1])), q.dtype)
        num_warps = cfg.num_warps if num_warps is None else num_warps
        num_stages = cfg.num_stages if num_stages is None else num_stages
    B, K, G, H = q.shape
    _, P, L, _ = k_pages.shape
    M = block_tables.shape[1]
    Z = -(-M // pages_per_split)
    Gp = max(16, _next_pow2(G))
    use_alibi = slopes is not None
    q = jnp.pad(q, ((0, 0), (0, 0), (0, Gp - G), (0, 0)))
    slopes = (jnp.zeros((B, K, Gp), jnp.float32) if slopes is None
              else jnp.pad(slopes.astype(jnp.float32), ((0, 0), (0, 0), (0, Gp - G))))
    kernel = functools.partial(_kernel, scale=scale, softcap=softcap, use_alibi=use_alibi, window=window,
                               page_size=L, pages_per_split=pages_per_split)
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(B, K, Z),
        in_specs=[
            pl.BlockSpec((B,), lambda b, h, z: (0,)),
            pl.BlockSpec((None, M), lambda b, h, z: (b, 0)),
            pl.BlockSpec((None, None, Gp, H), lambda b, h, z: (b, h, 0, 0)),
            pl.BlockSpec((None, None, Gp), lambda b, h, z: (b, h, 0)),
            pl.BlockSpec((None, P, L, H), lambda b, h, z: (h, 0, 0, 0)),
            pl.BlockSpec((None, P, L, H), lambda b, h, z: (h, 0, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, Gp, H), lambda b, h, z: (b, h, z, 0, 0)),
            pl.BlockSpec((None, None, None, Gp), lambda b, h, z: (b, h, z, 0)),
            pl.BlockSpec((None, None, None, Gp), lambda b, h, z: (b, h, z, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, K, Z, Gp, H), jnp.float32),
            jax.ShapeDtypeStruct((B, K, Z, Gp), jnp.float32),
            jax.ShapeDtypeStruct((B, K, Z, Gp), jnp.float32),
        ],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_attention_gpu",
    )(lengths.astype(jnp.int32), block_tables.astype(jnp.int32), q, slopes, k_pages, v_pages)
    return acc[:, :, :, :G], m[:, :, :, :G], l[:, :, :, :G]
