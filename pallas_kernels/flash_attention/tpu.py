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
:func:`common.kv_block_range` (causal, window, static offset), cut further at
``ceil(kv_length[b] / block_k)``. The kv grid axis has ``max(hi - lo)`` steps;
step ``j`` maps to block ``min(lo + j, hi - 1)`` in the index map, so steps past
the last live block re-name the block already in VMEM (no DMA) and the body
is guarded by ``pl.when(lo + j < hi)`` (no compute). The dk/dv kernel does the
same over q blocks with :func:`common.q_block_range`.

Block-sparse patterns (Longformer / BigBird): with a ``block_map`` the walked
axes follow per-row block lists instead (:func:`common.block_lists` of the map,
its transpose for dk/dv), scalar-prefetched into SMEM with per-batch counts cut
at the kv length: step ``j`` of row ``i`` maps to ``idx[h, i, min(j, count-1)]``
in the index map and computes only while ``j < count``, so unlisted tiles are
neither fetched nor computed. ``q_global``, ``kv_global`` and the random-block
starts ride along as VMEM blocks and widen the window's band inside each tile.

Scalar prefetch (SMEM): ``kv_len [B]`` int32, ALiBi ``slopes [B, N]`` fp32 and,
with a block map, the flattened lists ``idx`` and ``count``.
fp16 inputs run in fp32 (Mosaic has no fp16 matmul on most TPUs); bf16 and
fp32 run natively with fp32 accumulation. ALiBi slopes get no gradient.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.flash_attention import common
from pallas_kernels.flash_attention.common import BlockSizes, MaskParams

MIN_BLOCK = 8  # sublane tile: every q/kv block is a multiple of it
MAX_TILE_BYTES = 8 * 2**20  # q, k, v tiles + fp32 logits of one grid step in VMEM
# Scoped VMEM a kernel may use: the compiler's default limit on v4, v5e and v5p (v6e: 32 MiB), and the
# limit asked for when a kernel's estimated need exceeds it (tiles above the defaults): v5p has 64 MiB of
# VMEM, v5e and v6e 128 MiB. v4 has 16 MiB, so there such tiles fail to compile ("Ran out of memory in
# memory space vmem"; experiments/results/tpu_compile.md).
VMEM_DEFAULT_LIMIT = 16 * 2**20
VMEM_RAISED_LIMIT = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernels specialise on (hashable)."""

    params: MaskParams
    blocks: BlockSizes
    G: int
    has_seg: bool
    has_lens: bool
    has_alibi: bool
    t_pad: int
    s_pad: int
    interpret: bool = False
    num_heads: int = 1
    block_map: Any = None  # static callable (block_q, block_k) -> bool [Nh, nq, nk]; None: range walk
    map_heads: int = 1
    has_qglob: bool = False
    has_kvglob: bool = False
    rand_heads: int = 0  # 0: no random blocks, else 1 or N
    n_rand: int = 0
    rand_size: int = 1

    @property
    def sparse(self) -> bool:
        return self.block_map is not None

    @property
    def n_prefetch(self) -> int:
        return 4 if self.sparse else 2

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
    def n_rows(self) -> int:
        """Grid rows: q blocks, or kv blocks."""
        return self.st.t_pad // self.bq if self.over_kv else self.st.s_pad // self.bk

    @property
    def n_blocks(self) -> int:
        """Blocks along the walked axis: kv blocks, or q blocks."""
        return self.st.s_pad // self.bk if self.over_kv else self.st.t_pad // self.bq


# --------------------------------------------------------------------------- live ranges and lists


def _kv_len(st: _Static, lens_ref, b):
    """``kv_lengths[b]`` read from SMEM, or None when there are no kv lengths."""
    return lens_ref[b] if st.has_lens else None


def _kv_range(st: _Static, bq: int, bk: int, qi, kv_len):
    """Live kv blocks ``[lo, hi)`` of q block ``qi`` (traced ints)."""
    lo, hi = common.kv_block_range(st.params, qi, bq, bk)
    if kv_len is not None:
        hi = jnp.minimum(hi, jax.lax.div(kv_len + (bk - 1), bk))
    return lo, hi


def _q_range(st: _Static, bq: int, bk: int, kj, kv_len):
    """Live q blocks ``[lo, hi)`` of kv block ``kj``."""
    lo, hi = common.q_block_range(st.params, kj, bq, bk)
    if kv_len is not None:
        hi = jnp.where(kj * bk < kv_len, hi, 0)
    return lo, hi


def _clamp(lo, step, hi, n_blocks: int):
    """Block fetched at grid step ``step``: the live block, or the last live one after the run ends."""
    idx = jnp.minimum(lo + step, hi - 1)
    return jnp.minimum(jnp.maximum(idx, 0), n_blocks - 1)


def _num_steps(walk: _WalkSpec) -> int:
    """Grid extent of the walked axis: the longest static live run (at least 1)."""
    st, bq, bk = walk.st, walk.bq, walk.bk
    if st.sparse:
        return _lists(walk)[0].shape[-1]
    nq, nk = -(-st.params.q_len // bq), -(-st.params.kv_len // bk)
    if walk.over_kv:
        runs = [common.kv_block_range(st.params, i, bq, bk) for i in range(nq)]
    else:
        runs = [common.q_block_range(st.params, j, bq, bk) for j in range(nk)]
    return max(1, max(hi - lo for lo, hi in runs))


@functools.lru_cache(maxsize=32)
def _lists(walk: _WalkSpec) -> tuple[np.ndarray, np.ndarray]:
    """Static block lists of the padded grid: ``(idx [Nh, rows, w], count [Nh, rows])``.

    Rows are q blocks listing kv blocks (``over_kv``), else kv blocks listing q blocks. Rows with
    nothing listed repeat the previous row's last block, so walking them fetches no new tile.
    """
    st, bq, bk = walk.st, walk.bq, walk.bk
    p = st.params
    live = common.live_blocks(st.block_map, p.q_len, p.kv_len, st.num_heads, bq, bk)
    nq, nk = st.t_pad // bq, st.s_pad // bk
    live = np.pad(live, ((0, 0), (0, nq - live.shape[1]), (0, nk - live.shape[2])))
    idx, count = common.block_lists(live if walk.over_kv else live.transpose(0, 2, 1))
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


def _walk(walk: _WalkSpec, pref, b, head, row, step):
    """(block visited at ``step`` of grid row ``row``, whether the step computes), both traced."""
    st, bq, bk = walk.st, walk.bq, walk.bk
    lens_ref = pref[0]
    if st.sparse:
        idx_ref, count_ref = pref[2], pref[3]
        n_rows, w = walk.n_rows, _num_steps(walk)
        h = head if st.map_heads > 1 else 0
        count = count_ref[(b * st.map_heads + h) * n_rows + row]
        slot = jnp.maximum(jnp.minimum(step, count - 1), 0)
        return idx_ref[(h * n_rows + row) * w + slot], step < count
    kv_len = _kv_len(st, lens_ref, b)
    range_of = _kv_range if walk.over_kv else _q_range
    lo, hi = range_of(st, bq, bk, row, kv_len)
    return _clamp(lo, step, hi, walk.n_blocks), lo + step < hi


# --------------------------------------------------------------------------- tile math


def _tile_logits(st: _Static, q, k, qi, kj, bq: int, bk: int, kv_len, slope, side):
    """Masked fp32 logits ``[bq, bk]`` of one tile and d logits / d (q·k)."""
    qk = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    q_pos = st.params.q_offset + qi * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    k_pos = kj * bk + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    s, dscale = common.tile_logits(st.params, qk, q_pos, k_pos, slope)
    rand = side.get("rand")
    pattern = common.pattern_terms(
        k_pos,
        q_glob=side["qglob"][...] if st.has_qglob else None,
        kv_glob=side["kvglob"][...] if st.has_kvglob else None,
        rand_starts=[rand[:, r:r + 1] for r in range(st.n_rand)],
        rand_size=st.rand_size,
    )
    allowed = common.tile_allowed(
        st.params, q_pos, k_pos,
        q_seg=side["qseg"][...] if st.has_seg else None,
        kv_seg=side["kvseg"][...] if st.has_seg else None,
        kv_length=kv_len,
        check_kv_len=st.s_pad != st.params.kv_len,
        pattern=pattern,
    )
    return common.mask_logits(s, allowed), dscale


_SIDE_NAMES = ("qseg", "kvseg", "qglob", "kvglob", "rand")


def _side_present(st: _Static) -> tuple[str, ...]:
    flags = (st.has_seg, st.has_seg, st.has_qglob, st.has_kvglob, st.n_rand > 0)
    return tuple(n for n, f in zip(_SIDE_NAMES, flags) if f)


def _split(refs, st: _Static, n_tensors: int):
    """Kernel refs -> (prefetch refs, tensors, side-input refs by name, outputs and scratch)."""
    pref, refs = refs[:st.n_prefetch], refs[st.n_prefetch:]
    tensors, refs = refs[:n_tensors], refs[n_tensors:]
    names = _side_present(st)
    side, refs = dict(zip(names, refs[:len(names)])), refs[len(names):]
    return pref, tensors, side, refs


def _side_inputs(st: _Static, side: dict, bq: int, bk: int, q_map, kv_map):
    """Per-position operands and specs, blocks following ``q_map`` / ``kv_map`` (``(b, head, block, 0)``).

    q side ``[B, Tp, 1]`` (segments, global queries), random starts ``[Nr, Tp, r]``; kv side
    ``[B, Sp/bk, 1, bk]`` (legal for any bk).
    """
    def q_rows(*idx):
        b, _, i, _ = q_map(*idx)
        return b, i, 0

    def q_rows_of_head(*idx):
        _, n, i, _ = q_map(*idx)
        return (n if st.rand_heads > 1 else 0), i, 0

    def kv_cols(*idx):
        b, _, j, _ = kv_map(*idx)
        return b, j, 0, 0

    args, specs = [], []
    for name in _side_present(st):
        x = side[name]
        if name in ("qseg", "qglob"):
            args.append(x)
            specs.append(pl.BlockSpec((None, bq, 1), q_rows))
        elif name == "rand":
            args.append(x)
            specs.append(pl.BlockSpec((None, bq, st.n_rand), q_rows_of_head))
        else:
            args.append(x.reshape(x.shape[0], st.s_pad // bk, 1, bk))
            specs.append(pl.BlockSpec((None, None, 1, bk), kv_cols))
    return args, specs


def _row_walk(walk: _WalkSpec, H: int):
    """Specs of the kernels gridded ``(b, n, q block, kv step)``: q-side blocks fixed, kv-side walked."""
    bq, bk = walk.bq, walk.bk

    def q_map(b, n, i, j, *pref):
        return b, n, i, 0

    def kv_map(b, n, i, j, *pref):
        kj, _ = _walk(walk, pref, b, n, i, j)
        return b, jax.lax.div(n, walk.st.G), kj, 0

    return (pl.BlockSpec((None, None, bq, H), q_map), pl.BlockSpec((None, None, bk, H), kv_map),
            pl.BlockSpec((None, None, bq, 1), q_map), q_map, kv_map)


def _prefetch(walk: _WalkSpec, lens, slopes):
    if not walk.st.sparse:
        return [lens, slopes]
    return [lens, slopes, *_prefetch_lists(walk, lens)]


def _kernel(st: _Static, body):
    """``body(*refs)`` with the prefetch refs named apart, so tensor refs are ``refs[0..]`` in both modes."""
    if st.sparse:
        def kernel(lens_ref, slopes_ref, idx_ref, count_ref, *refs):
            return body(lens_ref, slopes_ref, idx_ref, count_ref, *refs)
    else:
        def kernel(lens_ref, slopes_ref, *refs):
            return body(lens_ref, slopes_ref, *refs)
    return kernel


_ROW_SEMANTICS = ("parallel", "parallel", "parallel", "arbitrary")


def _vmem_tile(rows: int, cols: int, itemsize: int) -> int:
    """Bytes of a ``[rows, cols]`` VMEM block in (8, 128) tiles."""
    return common.round_up(rows, 8) * common.round_up(cols, 128) * itemsize


def _side_vmem(st: _Static, bq: int, bk: int) -> int:
    """Bytes of one grid step's side-input blocks (segments, global flags, random starts)."""
    sizes = {"qseg": _vmem_tile(bq, 1, 4), "qglob": _vmem_tile(bq, 1, 4), "rand": _vmem_tile(bq, st.n_rand, 4),
             "kvseg": _vmem_tile(1, bk, 4), "kvglob": _vmem_tile(1, bk, 4)}
    return sum(sizes[n] for n in _side_present(st))


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


def _fwd_kernel(walk: _WalkSpec, steps: int, *refs):
    st, bq, bk = walk.st, walk.bq, walk.bk
    pref, (q_ref, k_ref, v_ref), side, (o_ref, lse_ref, m_sc, l_sc, acc_sc) = _split(refs, st, 3)
    b, n, qi, j = (pl.program_id(a) for a in range(4))
    kv_len = _kv_len(st, pref[0], b)
    kj, live = _walk(walk, pref, b, n, qi, j)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(live)
    def _step():
        v = v_ref[...]
        slope = pref[1][b, n] if st.has_alibi else None
        s, _ = _tile_logits(st, q_ref[...], k_ref[...], qi, kj, bq, bk, kv_len, slope, side)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = common.safe_max(m_new)
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
        lse_ref[...] = common.finalize_lse(m_sc[...], l)


def _forward(st: _Static, q, k, v, side, lens, slopes):
    """q ``[B,N,Tp,H]``, k, v ``[B,K,Sp,H]`` -> (o ``[B,N,Tp,H]``, lse ``[B,N,Tp,1]`` fp32)."""
    B, N, Tp, H = q.shape
    it = q.dtype.itemsize
    bq, bk = st.blocks.block_q, st.blocks.block_k
    walk = _WalkSpec(st, bq, bk, over_kv=True)
    steps = _num_steps(walk)
    q_spec, kv_spec, row_spec, q_map, kv_map = _row_walk(walk, H)
    side_args, side_specs = _side_inputs(st, side, bq, bk, q_map, kv_map)
    pref = _prefetch(walk, lens, slopes)
    return st.call(
        _kernel(st, functools.partial(_fwd_kernel, walk, steps)),
        out_shape=[jax.ShapeDtypeStruct((B, N, Tp, H), q.dtype),
                   jax.ShapeDtypeStruct((B, N, Tp, 1), jnp.float32)],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(pref),
            grid=(B, N, Tp // bq, steps),
            in_specs=[q_spec, kv_spec, kv_spec, *side_specs],
            out_specs=[q_spec, row_spec],
            scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                            pltpu.VMEM((bq, H), jnp.float32)],
        ),
        compiler_params=_compiler_params(
            _ROW_SEMANTICS, bq=bq, bk=bk,
            pipelined=2 * _vmem_tile(bq, H, it) + 2 * _vmem_tile(bk, H, it) + _vmem_tile(bq, 1, 4)
            + _side_vmem(st, bq, bk),
            scratch=2 * _vmem_tile(bq, 1, 4) + _vmem_tile(bq, H, 4)),
        name="flash_fwd_tpu",
    )(*pref, q, k, v, *side_args)


# --------------------------------------------------------------------------- backward: dq


def _dq_kernel(walk: _WalkSpec, steps: int, *refs):
    st, bq, bk = walk.st, walk.bq, walk.bk
    pref, tensors, side, (dq_ref, dq_sc) = _split(refs, st, 6)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = tensors
    b, n, qi, j = (pl.program_id(a) for a in range(4))
    kv_len = _kv_len(st, pref[0], b)
    kj, live = _walk(walk, pref, b, n, qi, j)

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(live)
    def _step():
        k, v, do = k_ref[...], v_ref[...], do_ref[...]
        slope = pref[1][b, n] if st.has_alibi else None
        s, dscale = _tile_logits(st, q_ref[...], k, qi, kj, bq, bk, kv_len, slope, side)
        p = jnp.exp(s - lse_ref[...])
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - delta_ref[...]) * dscale
        dq_sc[...] += jax.lax.dot_general(ds.astype(k.dtype), k, (((1,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)

    @pl.when(j == steps - 1)
    def _finish():
        dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


def _backward_dq(st: _Static, q, k, v, do, lse, delta, side, lens, slopes):
    B, N, Tp, H = q.shape
    it = q.dtype.itemsize
    bq, bk = st.blocks.block_q_dq, st.blocks.block_k_dq
    walk = _WalkSpec(st, bq, bk, over_kv=True)
    steps = _num_steps(walk)
    q_spec, kv_spec, row_spec, q_map, kv_map = _row_walk(walk, H)
    side_args, side_specs = _side_inputs(st, side, bq, bk, q_map, kv_map)
    pref = _prefetch(walk, lens, slopes)
    return st.call(
        _kernel(st, functools.partial(_dq_kernel, walk, steps)),
        out_shape=jax.ShapeDtypeStruct((B, N, Tp, H), q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(pref),
            grid=(B, N, Tp // bq, steps),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *side_specs],
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((bq, H), jnp.float32)],
        ),
        compiler_params=_compiler_params(
            _ROW_SEMANTICS, bq=bq, bk=bk,
            pipelined=3 * _vmem_tile(bq, H, it) + 2 * _vmem_tile(bk, H, it) + 2 * _vmem_tile(bq, 1, 4)
            + _side_vmem(st, bq, bk),
            scratch=_vmem_tile(bq, H, 4)),
        name="flash_dq_tpu",
    )(*pref, q, k, v, do, lse, delta, *side_args)


# --------------------------------------------------------------------------- backward: dk, dv


def _dkv_kernel(walk: _WalkSpec, steps: int, *refs):
    st, bq, bk = walk.st, walk.bq, walk.bk
    pref, tensors, side, (dk_ref, dv_ref, dk_sc, dv_sc) = _split(refs, st, 6)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = tensors
    b, h, kj, g, i = (pl.program_id(a) for a in range(5))
    kv_len = _kv_len(st, pref[0], b)
    qi, live = _walk(walk, pref, b, h * st.G + g, kj, i)

    @pl.when((g == 0) & (i == 0))
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(live)
    def _step():
        q, v, do = q_ref[...], v_ref[...], do_ref[...]
        slope = pref[1][b, h * st.G + g] if st.has_alibi else None
        s, dscale = _tile_logits(st, q, k_ref[...], qi, kj, bq, bk, kv_len, slope, side)
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


def _backward_dkv(st: _Static, q, k, v, do, lse, delta, side, lens, slopes):
    B, _, _, H = q.shape
    K, Sp = k.shape[1], k.shape[2]
    it = q.dtype.itemsize
    bq, bk = st.blocks.block_q_dkv, st.blocks.block_k_dkv
    walk = _WalkSpec(st, bq, bk, over_kv=False)
    steps = _num_steps(walk)
    G = st.G

    def q_map(b, h, j, g, i, *pref):
        qi, _ = _walk(walk, pref, b, h * G + g, j, i)
        return b, h * G + g, qi, 0

    def kv_map(b, h, j, g, i, *pref):
        return b, h, j, 0

    side_args, side_specs = _side_inputs(st, side, bq, bk, q_map, kv_map)
    pref = _prefetch(walk, lens, slopes)
    q_spec = pl.BlockSpec((None, None, bq, H), q_map)
    kv_spec = pl.BlockSpec((None, None, bk, H), kv_map)
    row_spec = pl.BlockSpec((None, None, bq, 1), q_map)
    return st.call(
        _kernel(st, functools.partial(_dkv_kernel, walk, steps)),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(pref),
            grid=(B, K, Sp // bk, G, steps),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *side_specs],
            out_specs=[kv_spec, kv_spec],
            scratch_shapes=[pltpu.VMEM((bk, H), jnp.float32), pltpu.VMEM((bk, H), jnp.float32)],
        ),
        compiler_params=_compiler_params(
            ("parallel", "parallel", "parallel", "arbitrary", "arbitrary"), bq=bq, bk=bk,
            pipelined=2 * _vmem_tile(bq, H, it) + 4 * _vmem_tile(bk, H, it) + 2 * _vmem_tile(bq, 1, 4)
            + _side_vmem(st, bq, bk),
            scratch=2 * _vmem_tile(bk, H, 4)),
        name="flash_dkv_tpu",
    )(*pref, q, k, v, do, lse, delta, *side_args)


# --------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q, k, v, side, lens, slopes):
    return _forward(st, q, k, v, side, lens, slopes)[0]


def _flash_fwd(st, q, k, v, side, lens, slopes):
    o, lse = _forward(st, q, k, v, side, lens, slopes)
    return o, (q, k, v, side, lens, slopes, o, lse)


def _flash_bwd(st, res, do):
    q, k, v, side, lens, slopes, o, lse = res
    # Padding rows see keys the forward pass never visited; an infinite lse makes their p exactly 0
    # (a finite one can overflow exp(s - lse) to inf, and inf * 0 = NaN in dk, dv).
    padding = jax.lax.broadcasted_iota(jnp.int32, lse.shape, 2) >= st.params.q_len
    lse = jnp.where(padding, common.EMPTY_ROW_LSE, lse)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
    args = (q, k, v, do, lse, delta, side, lens, slopes)
    dq = _backward_dq(st, *args)
    dk, dv = _backward_dkv(st, *args)
    return dq, dk, dv, jax.tree.map(lambda _: None, side), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# --------------------------------------------------------------------------- public


def resolve_block_sizes(block_sizes: BlockSizes | None, T: int, S: int, H: int, itemsize: int) -> BlockSizes:
    """Validate user block sizes (powers of two, multiples of 8, fit VMEM) and clip them to the lengths."""
    bs = BlockSizes.default("tpu") if block_sizes is None else block_sizes
    common.check_block_sizes(bs, pow2=True, minimum=MIN_BLOCK, multiple_of=MIN_BLOCK, H=H,
                             itemsize=itemsize, max_tile_bytes=MAX_TILE_BYTES)
    return bs.clipped(T, S, minimum=MIN_BLOCK)


def flash_attention_tpu(q, k, v, *, causal: bool = False, window=None, q_segment_ids=None,
                        kv_segment_ids=None, kv_lengths=None, q_offset: int | None = None,
                        alibi_slopes=None, softcap: float | None = None, scale: float | None = None,
                        block_sizes: BlockSizes | None = None, interpret: bool = False, block_map=None,
                        q_global=None, kv_global=None, random_kv_starts=None,
                        random_block_size: int | None = None):
    """FlashAttention ``q [B,T,N,H], k, v [B,S,K,H] -> [B,T,N,H]`` with Mosaic TPU kernels.

    Differentiable in q, k, v. Mask and logit semantics are those of
    :mod:`pallas_kernels.flash_attention.common`, including the block-sparse keywords
    (``block_map``, ``q_global``, ``kv_global``, ``random_kv_starts``) documented in
    :func:`pallas_kernels.flash_attention.flash_attention`. Run on CPU under
    ``pltpu.force_tpu_interpret_mode()`` or with ``interpret=True``.
    """
    B, T, S, N, K, H = common.check_inputs(
        q, k, v, window=window, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, kv_lengths=kv_lengths,
        q_offset=q_offset, alibi_slopes=alibi_slopes, softcap=softcap, scale=scale, block_map=block_map,
        q_global=q_global, kv_global=kv_global, random_kv_starts=random_kv_starts,
        random_block_size=random_block_size)
    in_dtype = q.dtype
    dtype = jnp.float32 if in_dtype == jnp.float16 else in_dtype
    blocks = resolve_block_sizes(block_sizes, T, S, H, jnp.dtype(dtype).itemsize)
    params = MaskParams.make(T, S, H, causal=causal, window=window, q_offset=q_offset,
                             scale=scale, softcap=softcap)
    bq_max = max(blocks.block_q, blocks.block_q_dq, blocks.block_q_dkv)
    bk_max = max(blocks.block_k, blocks.block_k_dq, blocks.block_k_dkv)
    t_pad, s_pad = common.round_up(T, bq_max), common.round_up(S, bk_max)
    map_heads = 1
    if block_map is not None:
        map_heads = common.live_blocks(block_map, T, S, N, blocks.block_q, blocks.block_k).shape[0]
    st = _Static(params=params, blocks=blocks, G=N // K, has_seg=q_segment_ids is not None,
                 has_lens=kv_lengths is not None, has_alibi=alibi_slopes is not None,
                 t_pad=t_pad, s_pad=s_pad, interpret=bool(interpret), num_heads=N, block_map=block_map,
                 map_heads=map_heads, has_qglob=q_global is not None, has_kvglob=kv_global is not None,
                 rand_heads=0 if random_kv_starts is None else int(jnp.shape(random_kv_starts)[0]),
                 n_rand=0 if random_kv_starts is None else int(jnp.shape(random_kv_starts)[1]),
                 rand_size=1 if random_kv_starts is None else int(random_block_size))

    def to_kernel(x, padded):
        return common.pad_axis(jnp.swapaxes(x.astype(dtype), 1, 2), 2, padded)

    qt, kt, vt = to_kernel(q, t_pad), to_kernel(k, s_pad), to_kernel(v, s_pad)
    side = {}
    if st.has_seg:
        side["qseg"] = common.pad_axis(jnp.asarray(q_segment_ids, jnp.int32), 1, t_pad)[:, :, None]
        side["kvseg"] = common.pad_axis(jnp.asarray(kv_segment_ids, jnp.int32), 1, s_pad)
    if st.has_qglob:
        qg = jnp.broadcast_to(jnp.asarray(q_global).astype(jnp.int32), (B, T))
        side["qglob"] = common.pad_axis(qg, 1, t_pad)[:, :, None]
    if st.has_kvglob:
        side["kvglob"] = common.pad_axis(jnp.broadcast_to(jnp.asarray(kv_global).astype(jnp.int32), (B, S)),
                                         1, s_pad)
    if st.n_rand:
        rand = jnp.swapaxes(jnp.asarray(random_kv_starts, jnp.int32), 1, 2)  # [Nr, T, r]
        side["rand"] = jnp.pad(rand, ((0, 0), (0, t_pad - T), (0, 0)), constant_values=-1)
    lens = (jnp.full((B,), S, jnp.int32) if kv_lengths is None
            else jnp.clip(jnp.asarray(kv_lengths, jnp.int32), 0, S))
    slopes = (jnp.zeros((B, N), jnp.float32) if alibi_slopes is None
              else common.slopes_bn(alibi_slopes, B, N))
    o = _flash(st, qt, kt, vt, side, lens, slopes)
    return jnp.swapaxes(o[:, :, :T], 1, 2).astype(in_dtype)
