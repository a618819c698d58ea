"""Paged-attention decode in Pallas for TPU (Mosaic), block tables scalar-prefetched.

Grid ``(B, K, Z, pages_per_split)``, ``Z`` splits of a sequence's pages. The
lengths and the flattened block tables are prefetched into SMEM, and the k/v
``BlockSpec`` index maps read the page id of grid step ``(b, h, z, p)`` from
them, so the pipeline DMAs exactly one ``[L, H]`` page per step from the pool
into VMEM, no contiguous copy of the cache. Steps past a sequence's last page repeat the index of its last page (no
new DMA) and skip the compute; with a sliding ``window``, steps before the first
page holding a visible key repeat that page's index and skip too. The ``G``
query heads of a kv head form one ``[G, H]`` tile; an online softmax lives in
VMEM scratch and each split writes its unnormalised accumulator, running max and
sum for a log-sum-exp merge.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float

from pallas_kernels.typing import BlockTables, Lengths, Pages

NEG_INF = float("-inf")


def _kernel(lengths_ref, tables_ref, q_ref, slopes_ref, k_ref, v_ref, acc_ref, m_ref, l_ref,
            m_sc, l_sc, acc_sc, *, scale: float, softcap: float | None, use_alibi: bool,
            window: int | None, page_size: int, pages_per_split: int):
    b = pl.program_id(0)
    split = pl.program_id(2)
    step = pl.program_id(3)
    length = lengths_ref[b]
    j = split * pages_per_split + step

    @pl.when(step == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    live = j * page_size < length
    if window is not None:
        live &= (j + 1) * page_size > length - window

    @pl.when(live)
    def _compute():
        q = q_ref[...]  # [G, H]
        k = k_ref[...]  # [L, H]
        v = v_ref[...]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale  # [G, L]
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        pos = j * page_size + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        if use_alibi:
            s = s - slopes_ref[...] * (length - 1 - pos).astype(jnp.float32)
        visible = pos < length
        if window is not None:
            visible &= pos >= length - window
        s = jnp.where(visible, s, NEG_INF)
        m_prev = m_sc[...]  # [G, 1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        acc_sc[...] = alpha * acc_sc[...] + jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        m_sc[...] = m_new

    @pl.when(step == pages_per_split - 1)
    def _finish():
        acc_ref[...] = acc_sc[...]
        m_ref[...] = m_sc[...]
        l_ref[...] = l_sc[...]


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "window", "pages_per_split", "interpret"))
def paged_attention_partials_tpu(q: Float[Array, "B K G H"], k_pages: Pages, v_pages: Pages, block_tables: BlockTables,
                                 lengths: Lengths, slopes: Float[Array, "B K G"] | None, *, scale: float,
                                 softcap: float | None, pages_per_split: int, window: int | None = None,
                                 interpret: bool = False,
                                 ) -> tuple[Float[Array, "B K Z G H"], Float[Array, "B K Z G"], Float[Array, "B K Z G"]]:
    """Per-split partials for ``q [B, K, G, H]``; same contract as the GPU kernel's.

    ``interpret=True`` runs the TPU interpreter on CPU (as does calling under
    ``pltpu.force_tpu_interpret_mode()``).
    """
    B, K, G, H = q.shape
    L = k_pages.shape[2]
    M = block_tables.shape[1]
    Z = -(-M // pages_per_split)
    use_alibi = slopes is not None
    slopes = jnp.zeros((B, K, G, 1), jnp.float32) if slopes is None else slopes.astype(jnp.float32)[..., None]

    def page_map(b, h, z, p, lengths_ref, tables_ref):
        # lax.div, not //: operands are >= 0, and jnp.floor_divide's sign fix-up lowers through a
        # Mosaic rule that asks the default device for its TPU generation (fails compiling ahead of time).
        length = jnp.maximum(lengths_ref[b], 0)
        last = jnp.maximum(jax.lax.div(length + (L - 1), L) - 1, 0)
        j = jnp.minimum(z * pages_per_split + p, last)
        if window is not None:  # pages behind the window: repeat the first visible one
            j = jnp.maximum(j, jnp.minimum(jax.lax.div(jnp.maximum(length - window, 0), L), last))
        j = jnp.minimum(j, M - 1)
        return h, tables_ref[b * M + j], 0, 0

    def head_map(b, h, z, p, lengths_ref, tables_ref):
        return b, h, 0, 0

    def out_map(b, h, z, p, lengths_ref, tables_ref):
        return b, h, z, 0, 0

    kernel = functools.partial(_kernel, scale=scale, softcap=softcap, use_alibi=use_alibi, window=window,
                               page_size=L, pages_per_split=pages_per_split)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(B, K, Z, pages_per_split),
        in_specs=[
            pl.BlockSpec((None, None, G, H), head_map),
            pl.BlockSpec((None, None, G, 1), head_map),
            pl.BlockSpec((None, None, L, H), page_map),
            pl.BlockSpec((None, None, L, H), page_map),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, G, H), out_map),
            pl.BlockSpec((None, None, None, G, 1), out_map),
            pl.BlockSpec((None, None, None, G, 1), out_map),
        ],
        scratch_shapes=[pltpu.VMEM((G, 1), jnp.float32), pltpu.VMEM((G, 1), jnp.float32),
                        pltpu.VMEM((G, H), jnp.float32)],
    )
    acc, m, l = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((B, K, Z, G, H), jnp.float32),
            jax.ShapeDtypeStruct((B, K, Z, G, 1), jnp.float32),
            jax.ShapeDtypeStruct((B, K, Z, G, 1), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret is True else interpret,
        name="paged_attention_tpu",
    )(lengths.astype(jnp.int32), block_tables.astype(jnp.int32).reshape(-1), q, slopes, k_pages, v_pages)
    return acc, m[..., 0], l[..., 0]
