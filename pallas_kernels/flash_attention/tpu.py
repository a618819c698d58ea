"""FlashAttention for TPU: Pallas kernels lowered by Mosaic, forward and backward.

Kernel layout is ``[B, N, T, H]`` / ``[B, K, S, H]`` (the wrapper transposes and
zero-pads T and S up to whole blocks). Three kernels, each over a grid whose
last axes walk the *live* blocks only:

* forward, grid ``(B, N, q blocks, kv steps)``: online softmax with ``m, l, acc``
  in fp32 VMEM scratch over the "arbitrary" kv axis; writes ``o`` and the row
  log-sum-exp;
* dq, grid ``(B, N, q blocks, kv steps)``: recomputes ``p = exp(s - lse)``;
* dk/dv, grid ``(B, K, kv blocks, G, q steps)``: sums over the ``G`` query heads
  of a kv head and the live q blocks, so K/V and dK/dV are never repeated.

Block skipping: for q block ``i`` the live kv blocks are ``[lo, hi)`` from
:meth:`BlockSchedule.kv_range` (causal, window, static offset), cut further at
``ceil(kv_length[b] / block_k)``. The kv grid axis has ``max(hi - lo)`` steps;
step ``j`` maps to block ``min(lo + j, hi - 1)`` in the index map, so steps past
the last live block re-name the block already in VMEM (no DMA) and the body
is guarded by ``pl.when(lo + j < hi)`` (no compute). The dk/dv kernel does the
same over q blocks with :meth:`BlockSchedule.q_range`.

Block-sparse patterns (Longformer / BigBird): with a ``block_map`` the walked
axes follow per-row block lists instead (:func:`pallas_kernels.schedule.block_lists` of the map,
its transpose for dk/dv), scalar-prefetched into SMEM with per-batch counts cut
at the kv length: step ``j`` of row ``i`` maps to ``idx[h, i, min(j, count-1)]``
in the index map and computes only while ``j < count``, so unlisted tiles are
neither fetched nor computed. ``q_global``, ``kv_global`` and the random-block
starts ride along as VMEM blocks and widen the window's band inside each tile.

Scalar prefetch (SMEM, one :class:`Prefetch`): ``kv_len [B]`` int32, ALiBi ``slopes [B, N]`` fp32
and, with a block map, the flattened lists ``idx`` and ``count``. Each kernel takes that
``Prefetch`` of refs, its tensor refs, its side inputs as one :class:`Side` (a ref or None per
field), its outputs and scratch, each by name.
fp16 inputs run in fp32 (Mosaic has no fp16 matmul on most TPUs); bf16 and
fp32 run natively with fp32 accumulation. ALiBi slopes get no gradient.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.flash_attention.blocks import BlockSizes, check_block_sizes
from pallas_kernels.flash_attention.tiles import EMPTY_ROW_LSE, Logits, finalize_lse, mask_logits, pattern_terms, safe_max
from pallas_kernels.kernel_mask import KernelMask
from pallas_kernels.schedule import BlockSchedule, block_lists
from pallas_kernels.shapes import pad_axis, round_up

MIN_BLOCK = 8  # sublane tile: every q/kv block is a multiple of it
MAX_TILE_BYTES = 8 * 2**20  # q, k, v tiles + fp32 logits of one grid step in VMEM
# Scoped VMEM a kernel may use: the compiler's default limit on v4, v5e and v5p (v6e: 32 MiB), and the
# limit asked for when a kernel's estimated need exceeds it (tiles above the defaults): v5p has 64 MiB of
# VMEM, v5e and v6e 128 MiB. v4 has 16 MiB, so there such tiles fail to compile ("Ran out of memory in
# memory space vmem"; experiments/results/tpu_compile.md).
VMEM_DEFAULT_LIMIT = 16 * 2**20
VMEM_RAISED_LIMIT = 64 * 2**20


class Prefetch(NamedTuple):
    """The scalar-prefetched (SMEM) operands, one pytree (arrays outside the kernel, refs inside):
    ``lens [B]`` int32, ``slopes [B, N]`` fp32 and, with a block map, the flattened block lists
    ``idx [Nh*rows*w]`` and per-batch ``count [B*Nh*rows]`` (None without one)."""

    lens: Any
    slopes: Any
    idx: Any = None
    count: Any = None


class Side(NamedTuple):
    """Per-position operands riding along as VMEM blocks (None where absent): ``qseg [B, Tp, 1]``,
    ``kvseg [B, Sp]`` (blocked ``[B, Sp/bk, 1, bk]``), ``qglob [B, Tp, 1]``, ``kvglob [B, Sp]``,
    ``rand [Nr, Tp, r]`` (-1 = no block)."""

    qseg: Any = None
    kvseg: Any = None
    qglob: Any = None
    kvglob: Any = None
    rand: Any = None


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernels specialise on (hashable)."""

    mask: KernelMask  # KernelMask.static(): fields and operand shapes
    logits: Logits  # Logits.static()
    blocks: BlockSizes
    G: int
    t_pad: int
    s_pad: int
    interpret: bool = False
    num_heads: int = 1
    map_heads: int = 1

    @property
    def sparse(self) -> bool:
        return self.mask.block_map is not None

    @property
    def has_alibi(self) -> bool:
        return self.logits.alibi_slopes is not None

    @property
    def rand_heads(self) -> int:
        """0 without random blocks, else 1 or N."""
        return 0 if self.mask.random_kv_starts is None else self.mask.random_kv_starts[0]

    def call(self, kernel, **kwargs):
        """``pl.pallas_call`` in TPU interpret mode when asked (a surrounding
        ``pltpu.force_tpu_interpret_mode()`` takes precedence either way)."""
        return pl.pallas_call(kernel, interpret=pltpu.InterpretParams() if self.interpret else False, **kwargs)


@dataclasses.dataclass(frozen=True)
class _WalkSpec:
    """The walked grid axis of one kernel (hashable): its block sizes and direction.

    ``over_kv``: grid rows are q blocks walking their live kv blocks (forward, dq); else kv
    blocks walking their live q blocks (dk/dv).
    """

    st: _Static
    bq: int
    bk: int
    over_kv: bool

    @property
    def schedule(self) -> BlockSchedule:
        return BlockSchedule(self.st.mask, self.bq, self.bk)

    @property
    def n_rows(self) -> int:
        """Grid rows: q blocks, or kv blocks."""
        return self.st.t_pad // self.bq if self.over_kv else self.st.s_pad // self.bk

    @property
    def n_blocks(self) -> int:
        """Blocks along the walked axis: kv blocks, or q blocks."""
        return self.st.s_pad // self.bk if self.over_kv else self.st.t_pad // self.bq


# --------------------------------------------------------------------------- live ranges and lists


def _kv_len(st: _Static, pref: Prefetch, b):
    """``kv_lengths[b]`` read from SMEM, or None when there are no kv lengths."""
    return pref.lens[b] if st.mask.kv_lengths is not None else None


def _kv_range(walk: _WalkSpec, qi, kv_len):
    """Live kv blocks ``[lo, hi)`` of q block ``qi`` (traced ints), cut at the kv length."""
    lo, hi = walk.schedule.kv_range(qi)
    if kv_len is not None:
        hi = jnp.minimum(hi, jax.lax.div(kv_len + (walk.bk - 1), walk.bk))
    return lo, hi


def _q_range(walk: _WalkSpec, kj, kv_len):
    """Live q blocks ``[lo, hi)`` of kv block ``kj``; none past the kv length."""
    lo, hi = walk.schedule.q_range(kj)
    if kv_len is not None:
        hi = jnp.where(kj * walk.bk < kv_len, hi, 0)
    return lo, hi


def _clamp(lo, step, hi, n_blocks: int):
    """Block fetched at grid step ``step``: the live block, or the last live one after the run ends."""
    idx = jnp.minimum(lo + step, hi - 1)
    return jnp.minimum(jnp.maximum(idx, 0), n_blocks - 1)


def _num_steps(walk: _WalkSpec) -> int:
    """Grid extent of the walked axis: the longest static live run (at least 1)."""
    if walk.st.sparse:
        return _lists(walk)[0].shape[-1]
    return walk.schedule.longest_run(walk.over_kv)


@functools.lru_cache(maxsize=32)
def _lists(walk: _WalkSpec) -> tuple[np.ndarray, np.ndarray]:
    """Static block lists of the padded grid: ``(idx [Nh, rows, w], count [Nh, rows])``.

    Rows are q blocks listing kv blocks (``over_kv``), else kv blocks listing q blocks. Rows with
    nothing listed repeat the previous row's last block, so walking them fetches no new tile.
    """
    st, bq, bk = walk.st, walk.bq, walk.bk
    live = walk.schedule.live(st.num_heads)
    nq, nk = st.t_pad // bq, st.s_pad // bk
    live = np.pad(live, ((0, 0), (0, nq - live.shape[1]), (0, nk - live.shape[2])))
    idx, count = block_lists(live if walk.over_kv else live.transpose(0, 2, 1))
    rows = idx.reshape(-1, idx.shape[-1])
    flat_count = count.reshape(-1)
    nonempty = np.flatnonzero(flat_count)
    prev = rows[nonempty[0], 0] if nonempty.size else 0
    for r in range(rows.shape[0]):
        if flat_count[r]:
            prev = rows[r, flat_count[r] - 1]
        else:
            rows[r] = prev
    return rows.reshape(idx.shape), count


def _prefetch_lists(walk: _WalkSpec, lens):
    """SMEM operands ``(idx [Nh*rows*w], count [B*Nh*rows])``: counts cut at each sequence's kv length."""
    bk = walk.bk
    idx, count = _lists(walk)
    idx_j, count_j = jnp.asarray(idx), jnp.asarray(count)[None]
    if walk.over_kv:  # lists are ascending: those below the cut are a prefix
        cut = jax.lax.div(lens + (bk - 1), bk)[:, None, None, None]
        w = idx.shape[-1]
        valid = (jnp.arange(w).reshape(1, 1, 1, w) < count_j[..., None]) & (idx_j[None] < cut)
        count_b = jnp.sum(valid, axis=-1, dtype=jnp.int32)
    else:
        kv_live = (jnp.arange(idx.shape[1]) * bk)[None, None, :] < lens[:, None, None]
        count_b = jnp.where(kv_live, count_j, 0)
    return idx_j.reshape(-1), count_b.reshape(-1).astype(jnp.int32)


def _walk(walk: _WalkSpec, pref: Prefetch, b, head, row, step):
    """(block visited at ``step`` of grid row ``row``, whether the step computes), both traced."""
    st = walk.st
    if st.sparse:
        n_rows, w = walk.n_rows, _num_steps(walk)
        h = head if st.map_heads > 1 else 0
        count = pref.count[(b * st.map_heads + h) * n_rows + row]
        slot = jnp.maximum(jnp.minimum(step, count - 1), 0)
        return pref.idx[(h * n_rows + row) * w + slot], step < count
    kv_len = _kv_len(st, pref, b)
    range_of = _kv_range if walk.over_kv else _q_range
    lo, hi = range_of(walk, row, kv_len)
    return _clamp(lo, step, hi, walk.n_blocks), lo + step < hi


# --------------------------------------------------------------------------- tile math


def _tile_logits(walk: _WalkSpec, q, k, qi, kj, kv_len, slope, side: Side):
    """Masked fp32 logits ``[bq, bk]`` of one tile and d logits / d (q·k)."""
    st, bq, bk = walk.st, walk.bq, walk.bk
    m = st.mask
    qk = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    q_pos = m.q_offset + qi * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    k_pos = kj * bk + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    s, dscale = st.logits.tile(qk, q_pos, k_pos, slope)
    pattern = pattern_terms(
        k_pos,
        q_glob=None if side.qglob is None else side.qglob[...],
        kv_glob=None if side.kvglob is None else side.kvglob[...],
        rand_starts=[side.rand[:, r:r + 1] for r in range(m.num_random)],
        rand_size=m.random_block_size,
    )
    allowed = m.allowed(
        q_pos, k_pos,
        q_segment=None if side.qseg is None else side.qseg[...],
        kv_segment=None if side.kvseg is None else side.kvseg[...],
        kv_length=kv_len,
        check_kv_len=st.s_pad != m.kv_len,
        pattern=pattern,
    )
    return mask_logits(s, allowed), dscale


def _side_inputs(walk: _WalkSpec, side: Side, q_map, kv_map) -> tuple[Side, Side]:
    """(operands, specs) of the side inputs, blocks following ``q_map`` / ``kv_map`` (``(b, head, block, 0)``).

    q side ``[B, Tp, 1]`` (segments, global queries), random starts ``[Nr, Tp, r]``; kv side
    ``[B, Sp/bk, 1, bk]`` (legal for any bk).
    """
    st, bq, bk = walk.st, walk.bq, walk.bk

    def q_rows(*idx):
        b, _, i, _ = q_map(*idx)
        return b, i, 0

    def q_rows_of_head(*idx):
        _, n, i, _ = q_map(*idx)
        return (n if st.rand_heads > 1 else 0), i, 0

    def kv_cols(*idx):
        b, _, j, _ = kv_map(*idx)
        return b, j, 0, 0

    def kv_blocked(x):
        return None if x is None else x.reshape(x.shape[0], st.s_pad // bk, 1, bk)

    def spec(x, block_shape, index_map):
        return None if x is None else pl.BlockSpec(block_shape, index_map)

    args = side._replace(kvseg=kv_blocked(side.kvseg), kvglob=kv_blocked(side.kvglob))
    specs = Side(qseg=spec(side.qseg, (None, bq, 1), q_rows), kvseg=spec(side.kvseg, (None, None, 1, bk), kv_cols),
                 qglob=spec(side.qglob, (None, bq, 1), q_rows), kvglob=spec(side.kvglob, (None, None, 1, bk), kv_cols),
                 rand=spec(side.rand, (None, bq, st.mask.num_random), q_rows_of_head))
    return args, specs


def _row_walk(walk: _WalkSpec, H: int):
    """Specs of the kernels gridded ``(b, n, q block, kv step)``: q-side blocks fixed, kv-side walked."""
    bq, bk = walk.bq, walk.bk

    def q_map(b, n, i, j, pref):
        return b, n, i, 0

    def kv_map(b, n, i, j, pref):
        kj, _ = _walk(walk, pref, b, n, i, j)
        return b, jax.lax.div(n, walk.st.G), kj, 0

    return (pl.BlockSpec((None, None, bq, H), q_map), pl.BlockSpec((None, None, bk, H), kv_map),
            pl.BlockSpec((None, None, bq, 1), q_map), q_map, kv_map)


def _prefetch(walk: _WalkSpec, lens, slopes) -> Prefetch:
    if not walk.st.sparse:
        return Prefetch(lens, slopes)
    return Prefetch(lens, slopes, *_prefetch_lists(walk, lens))


_ROW_SEMANTICS = ("parallel", "parallel", "parallel", "arbitrary")


def _vmem_tile(rows: int, cols: int, itemsize: int) -> int:
    """Bytes of a ``[rows, cols]`` VMEM block in (8, 128) tiles."""
    return round_up(rows, 8) * round_up(cols, 128) * itemsize


def _side_vmem(st: _Static, side: Side, bq: int, bk: int) -> int:
    """Bytes of one grid step's side-input blocks (segments, global flags, random starts)."""
    sizes = Side(qseg=_vmem_tile(bq, 1, 4), kvseg=_vmem_tile(1, bk, 4), qglob=_vmem_tile(bq, 1, 4),
                 kvglob=_vmem_tile(1, bk, 4), rand=_vmem_tile(bq, st.mask.num_random, 4))
    return sum(size for size, x in zip(sizes, side) if x is not None)


def _compiler_params(semantics, *, pipelined: int, scratch: int, bq: int, bk: int) -> pltpu.CompilerParams:
    """Mosaic params; the scoped-VMEM limit is raised only when an upper estimate of the kernel's need
    (double-buffered ``pipelined`` blocks, ``scratch``, four fp32 ``[bq, bk]`` temporaries) exceeds the
    compiler's default, so the default tiles compile exactly as they would without it."""
    need = 2 * pipelined + scratch + 4 * bq * bk * 4
    limit = None
    if need > VMEM_DEFAULT_LIMIT:
        limit = min(max(need * 5 // 4, 2 * VMEM_DEFAULT_LIMIT), VMEM_RAISED_LIMIT)
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=limit)


# --------------------------------------------------------------------------- forward


def _fwd_kernel(walk: _WalkSpec, steps: int, pref: Prefetch, q_ref, k_ref, v_ref, side: Side, o_ref, lse_ref,
                m_sc, l_sc, acc_sc):
    b, n, qi, j = (pl.program_id(a) for a in range(4))
    kv_len = _kv_len(walk.st, pref, b)
    kj, live = _walk(walk, pref, b, n, qi, j)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(live)
    def _step():
        v = v_ref[...]
        slope = pref.slopes[b, n] if walk.st.has_alibi else None
        s, _ = _tile_logits(walk, q_ref[...], k_ref[...], qi, kj, kv_len, slope, side)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = safe_max(m_new)
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_prev - m_safe)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        acc_sc[...] = alpha * acc_sc[...] + pv
        m_sc[...] = m_new

    @pl.when(j == steps - 1)
    def _finish():
        l = l_sc[...]
        o_ref[...] = (acc_sc[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)
        lse_ref[...] = finalize_lse(m_sc[...], l)


def _forward(st: _Static, q, k, v, side: Side, lens, slopes):
    """q ``[B,N,Tp,H]``, k, v ``[B,K,Sp,H]`` -> (o ``[B,N,Tp,H]``, lse ``[B,N,Tp,1]`` fp32)."""
    B, N, Tp, H = q.shape
    it = q.dtype.itemsize
    bq, bk = st.blocks.block_q, st.blocks.block_k
    walk = _WalkSpec(st, bq, bk, over_kv=True)
    steps = _num_steps(walk)
    q_spec, kv_spec, row_spec, q_map, kv_map = _row_walk(walk, H)
    side_args, side_specs = _side_inputs(walk, side, q_map, kv_map)
    return st.call(
        functools.partial(_fwd_kernel, walk, steps),
        out_shape=[jax.ShapeDtypeStruct((B, N, Tp, H), q.dtype),
                   jax.ShapeDtypeStruct((B, N, Tp, 1), jnp.float32)],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, N, Tp // bq, steps),
            in_specs=[q_spec, kv_spec, kv_spec, side_specs],
            out_specs=[q_spec, row_spec],
            scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                            pltpu.VMEM((bq, H), jnp.float32)],
        ),
        compiler_params=_compiler_params(
            _ROW_SEMANTICS, bq=bq, bk=bk,
            pipelined=2 * _vmem_tile(bq, H, it) + 2 * _vmem_tile(bk, H, it) + _vmem_tile(bq, 1, 4)
            + _side_vmem(st, side, bq, bk),
            scratch=2 * _vmem_tile(bq, 1, 4) + _vmem_tile(bq, H, 4)),
        name="flash_fwd_tpu",
    )(_prefetch(walk, lens, slopes), q, k, v, side_args)


# --------------------------------------------------------------------------- backward: dq


def _dq_kernel(walk: _WalkSpec, steps: int, pref: Prefetch, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               side: Side, dq_ref, dq_sc):
    b, n, qi, j = (pl.program_id(a) for a in range(4))
    kv_len = _kv_len(walk.st, pref, b)
    kj, live = _walk(walk, pref, b, n, qi, j)

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(live)
    def _step():
        k, v, do = k_ref[...], v_ref[...], do_ref[...]
        slope = pref.slopes[b, n] if walk.st.has_alibi else None
        s, dscale = _tile_logits(walk, q_ref[...], k, qi, kj, kv_len, slope, side)
        p = jnp.exp(s - lse_ref[...])
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - delta_ref[...]) * dscale
        dq_sc[...] += jax.lax.dot_general(ds.astype(k.dtype), k, (((1,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)

    @pl.when(j == steps - 1)
    def _finish():
        dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


def _backward_dq(st: _Static, tensors, side: Side, lens, slopes):
    """``tensors``: ``(q, k, v, do, lse, delta)`` in the kernel layout."""
    q = tensors[0]
    B, N, Tp, H = q.shape
    it = q.dtype.itemsize
    bq, bk = st.blocks.block_q_dq, st.blocks.block_k_dq
    walk = _WalkSpec(st, bq, bk, over_kv=True)
    steps = _num_steps(walk)
    q_spec, kv_spec, row_spec, q_map, kv_map = _row_walk(walk, H)
    side_args, side_specs = _side_inputs(walk, side, q_map, kv_map)
    return st.call(
        functools.partial(_dq_kernel, walk, steps),
        out_shape=jax.ShapeDtypeStruct((B, N, Tp, H), q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, N, Tp // bq, steps),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, side_specs],
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((bq, H), jnp.float32)],
        ),
        compiler_params=_compiler_params(
            _ROW_SEMANTICS, bq=bq, bk=bk,
            pipelined=3 * _vmem_tile(bq, H, it) + 2 * _vmem_tile(bk, H, it) + 2 * _vmem_tile(bq, 1, 4)
            + _side_vmem(st, side, bq, bk),
            scratch=_vmem_tile(bq, H, 4)),
        name="flash_dq_tpu",
    )(_prefetch(walk, lens, slopes), *tensors, side_args)


# --------------------------------------------------------------------------- backward: dk, dv


def _dkv_kernel(walk: _WalkSpec, steps: int, pref: Prefetch, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                side: Side, dk_ref, dv_ref, dk_sc, dv_sc):
    st = walk.st
    b, h, kj, g, i = (pl.program_id(a) for a in range(5))
    kv_len = _kv_len(st, pref, b)
    qi, live = _walk(walk, pref, b, h * st.G + g, kj, i)

    @pl.when((g == 0) & (i == 0))
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(live)
    def _step():
        q, v, do = q_ref[...], v_ref[...], do_ref[...]
        slope = pref.slopes[b, h * st.G + g] if st.has_alibi else None
        s, dscale = _tile_logits(walk, q, k_ref[...], qi, kj, kv_len, slope, side)
        p = jnp.exp(s - lse_ref[...])
        dv_sc[...] += jax.lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - delta_ref[...]) * dscale
        dk_sc[...] += jax.lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)

    @pl.when((g == st.G - 1) & (i == steps - 1))
    def _finish():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _backward_dkv(st: _Static, tensors, side: Side, lens, slopes):
    """``tensors``: ``(q, k, v, do, lse, delta)`` in the kernel layout."""
    q, k, v = tensors[:3]
    B, _, _, H = q.shape
    K, Sp = k.shape[1], k.shape[2]
    it = q.dtype.itemsize
    bq, bk = st.blocks.block_q_dkv, st.blocks.block_k_dkv
    walk = _WalkSpec(st, bq, bk, over_kv=False)
    steps = _num_steps(walk)
    G = st.G

    def q_map(b, h, j, g, i, pref):
        qi, _ = _walk(walk, pref, b, h * G + g, j, i)
        return b, h * G + g, qi, 0

    def kv_map(b, h, j, g, i, pref):
        return b, h, j, 0

    side_args, side_specs = _side_inputs(walk, side, q_map, kv_map)
    q_spec = pl.BlockSpec((None, None, bq, H), q_map)
    kv_spec = pl.BlockSpec((None, None, bk, H), kv_map)
    row_spec = pl.BlockSpec((None, None, bq, 1), q_map)
    return st.call(
        functools.partial(_dkv_kernel, walk, steps),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, K, Sp // bk, G, steps),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, side_specs],
            out_specs=[kv_spec, kv_spec],
            scratch_shapes=[pltpu.VMEM((bk, H), jnp.float32), pltpu.VMEM((bk, H), jnp.float32)],
        ),
        compiler_params=_compiler_params(
            ("parallel", "parallel", "parallel", "arbitrary", "arbitrary"), bq=bq, bk=bk,
            pipelined=2 * _vmem_tile(bq, H, it) + 4 * _vmem_tile(bk, H, it) + 2 * _vmem_tile(bq, 1, 4)
            + _side_vmem(st, side, bq, bk),
            scratch=2 * _vmem_tile(bk, H, 4)),
        name="flash_dkv_tpu",
    )(_prefetch(walk, lens, slopes), *tensors, side_args)


# --------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q, k, v, side: Side, lens, slopes):
    return _forward(st, q, k, v, side, lens, slopes)[0]


def _flash_fwd(st, q, k, v, side, lens, slopes):
    o, lse = _forward(st, q, k, v, side, lens, slopes)
    return o, (q, k, v, side, lens, slopes, o, lse)


def _flash_bwd(st, res, do):
    q, k, v, side, lens, slopes, o, lse = res
    # Padding rows see keys the forward pass never visited; an infinite lse makes their p exactly 0
    # (a finite one can overflow exp(s - lse) to inf, and inf * 0 = NaN in dk, dv).
    padding = jax.lax.broadcasted_iota(jnp.int32, lse.shape, 2) >= st.mask.q_len
    lse = jnp.where(padding, EMPTY_ROW_LSE, lse)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
    tensors = (q, k, v, do, lse, delta)
    dq = _backward_dq(st, tensors, side, lens, slopes)
    dk, dv = _backward_dkv(st, tensors, side, lens, slopes)
    return dq, dk, dv, Side(), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# --------------------------------------------------------------------------- entry point


def resolve_block_sizes(block_sizes: BlockSizes | None, T: int, S: int, H: int, itemsize: int) -> BlockSizes:
    """Validate user block sizes (powers of two, multiples of 8, fit VMEM) and clip them to the lengths."""
    bs = BlockSizes.default("tpu") if block_sizes is None else block_sizes
    check_block_sizes(bs, pow2=True, minimum=MIN_BLOCK, multiple_of=MIN_BLOCK, H=H,
                      itemsize=itemsize, max_tile_bytes=MAX_TILE_BYTES)
    return bs.clipped(T, S, minimum=MIN_BLOCK)


def attend(q, k, v, mask: KernelMask, logits: Logits, block_sizes: BlockSizes | None = None,
           interpret: bool = False):
    """FlashAttention ``q [B,T,N,H], k, v [B,S,K,H] -> [B,T,N,H]`` with Mosaic TPU kernels.

    Differentiable in q, k, v. ``mask`` and ``logits`` as ``flash_attention`` checked them
    (``checks.check_mask`` / ``check_logits``). Run on CPU under ``pltpu.force_tpu_interpret_mode()``
    or with ``interpret=True``.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    in_dtype = q.dtype
    dtype = jnp.float32 if in_dtype == jnp.float16 else in_dtype
    blocks = resolve_block_sizes(block_sizes, T, S, H, jnp.dtype(dtype).itemsize)
    bq_max = max(blocks.block_q, blocks.block_q_dq, blocks.block_q_dkv)
    bk_max = max(blocks.block_k, blocks.block_k_dq, blocks.block_k_dkv)
    t_pad, s_pad = round_up(T, bq_max), round_up(S, bk_max)
    static = mask.static()
    map_heads = 1
    if mask.block_map is not None:
        map_heads = BlockSchedule(static, blocks.block_q, blocks.block_k).live(N).shape[0]
    st = _Static(mask=static, logits=logits.static(), blocks=blocks, G=N // K, t_pad=t_pad, s_pad=s_pad,
                 interpret=bool(interpret), num_heads=N, map_heads=map_heads)

    def to_kernel(x, padded):
        return pad_axis(jnp.swapaxes(x.astype(dtype), 1, 2), 2, padded)

    qt, kt, vt = to_kernel(q, t_pad), to_kernel(k, s_pad), to_kernel(v, s_pad)
    side = Side()
    if mask.q_segment_ids is not None:
        side = side._replace(qseg=pad_axis(mask.q_segment_ids, 1, t_pad)[:, :, None],
                             kvseg=pad_axis(mask.kv_segment_ids, 1, s_pad))
    if mask.q_global is not None:
        side = side._replace(qglob=pad_axis(jnp.broadcast_to(mask.q_global, (B, T)), 1, t_pad)[:, :, None])
    if mask.kv_global is not None:
        side = side._replace(kvglob=pad_axis(jnp.broadcast_to(mask.kv_global, (B, S)), 1, s_pad))
    if mask.num_random:
        rand = jnp.swapaxes(mask.random_kv_starts, 1, 2)  # [Nr, T, r]
        side = side._replace(rand=jnp.pad(rand, ((0, 0), (0, t_pad - T), (0, 0)), constant_values=-1))
    lens = (jnp.full((B,), S, jnp.int32) if mask.kv_lengths is None
            else jnp.clip(mask.kv_lengths, 0, S))
    slopes = (jnp.zeros((B, N), jnp.float32) if logits.alibi_slopes is None
              else jnp.broadcast_to(logits.alibi_slopes, (B, N)))
    o = _flash(st, qt, kt, vt, side, lens, slopes)
    return jnp.swapaxes(o[:, :, :T], 1, 2).astype(in_dtype)
