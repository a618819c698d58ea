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

Scalar prefetch (SMEM): ``kv_len [B]`` int32 and ALiBi ``slopes [B, N]`` fp32.
fp16 inputs run in fp32 (Mosaic has no fp16 matmul on most TPUs); bf16 and
fp32 run natively with fp32 accumulation. ALiBi slopes get no gradient.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.flash_attention import common
from pallas_kernels.flash_attention.common import BlockSizes, MaskParams

MIN_BLOCK = 8  # sublane tile: every q/kv block is a multiple of it
MAX_TILE_BYTES = 8 * 2**20  # q, k, v tiles + fp32 logits of one grid step in VMEM


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

    def call(self, kernel, **kwargs):
        """``pl.pallas_call`` in TPU interpret mode when asked (a surrounding
        ``pltpu.force_tpu_interpret_mode()`` takes precedence either way)."""
        return pl.pallas_call(kernel, interpret=pltpu.InterpretParams() if self.interpret else False, **kwargs)


# --------------------------------------------------------------------------- live ranges


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


def _num_steps(st: _Static, bq: int, bk: int, *, over_kv: bool) -> int:
    """Grid extent of the walked axis: the longest static live run (at least 1)."""
    nq, nk = -(-st.params.q_len // bq), -(-st.params.kv_len // bk)
    if over_kv:
        runs = [common.kv_block_range(st.params, i, bq, bk) for i in range(nq)]
    else:
        runs = [common.q_block_range(st.params, j, bq, bk) for j in range(nk)]
    return max(1, max(hi - lo for lo, hi in runs))


# --------------------------------------------------------------------------- tile math


def _tile_logits(st: _Static, q, k, qi, kj, bq: int, bk: int, kv_len, slope, qseg_ref, kvseg_ref):
    """Masked fp32 logits ``[bq, bk]`` of one tile and d logits / d (q·k)."""
    qk = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    q_pos = st.params.q_offset + qi * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    k_pos = kj * bk + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    s, dscale = common.tile_logits(st.params, qk, q_pos, k_pos, slope)
    allowed = common.tile_allowed(
        st.params, q_pos, k_pos,
        q_seg=qseg_ref[...] if st.has_seg else None,
        kv_seg=kvseg_ref[...] if st.has_seg else None,
        kv_length=kv_len,
        check_kv_len=st.s_pad != st.params.kv_len,
    )
    return common.mask_logits(s, allowed), dscale


def _split(refs, st: _Static, n_tensors: int):
    """Kernel refs after the prefetch refs -> (tensors, qseg, kvseg, outputs and scratch)."""
    tensors, refs = refs[:n_tensors], refs[n_tensors:]
    if st.has_seg:
        (qseg, kvseg), refs = refs[:2], refs[2:]
    else:
        qseg = kvseg = None
    return tensors, qseg, kvseg, refs


def _seg_inputs(st: _Static, qseg, kvseg, bq: int, bk: int, q_map, kv_map):
    """Segment-id operands and specs: q ``[B, Tp, 1]``; kv ``[B, Sp/bk, 1, bk]`` (legal for any bk).

    Their blocks follow ``q_map`` / ``kv_map`` (``(b, head, block, 0)``), minus the head.
    """
    if not st.has_seg:
        return [], []

    def qseg_map(*idx):
        b, _, i, _ = q_map(*idx)
        return b, i, 0

    def kvseg_map(*idx):
        b, _, j, _ = kv_map(*idx)
        return b, j, 0, 0

    kv4 = kvseg.reshape(kvseg.shape[0], st.s_pad // bk, 1, bk)
    specs = [pl.BlockSpec((None, bq, 1), qseg_map), pl.BlockSpec((None, None, 1, bk), kvseg_map)]
    return [qseg, kv4], specs


def _row_walk(st: _Static, bq: int, bk: int, H: int):
    """Specs of the kernels gridded ``(b, n, q block, kv step)``: q-side blocks fixed, kv-side walked."""
    nk = st.s_pad // bk

    def q_map(b, n, i, j, lens_ref, slopes_ref):
        return b, n, i, 0

    def kv_map(b, n, i, j, lens_ref, slopes_ref):
        lo, hi = _kv_range(st, bq, bk, i, _kv_len(st, lens_ref, b))
        return b, jax.lax.div(n, st.G), _clamp(lo, j, hi, nk), 0

    return (pl.BlockSpec((None, None, bq, H), q_map), pl.BlockSpec((None, None, bk, H), kv_map),
            pl.BlockSpec((None, None, bq, 1), q_map), q_map, kv_map)


_ROW_SEMANTICS = ("parallel", "parallel", "parallel", "arbitrary")


# --------------------------------------------------------------------------- forward


def _fwd_kernel(st: _Static, bq: int, bk: int, steps: int, lens_ref, slopes_ref, *refs):
    (q_ref, k_ref, v_ref), qseg_ref, kvseg_ref, (o_ref, lse_ref, m_sc, l_sc, acc_sc) = _split(refs, st, 3)
    b, n, qi, j = (pl.program_id(a) for a in range(4))
    kv_len = _kv_len(st, lens_ref, b)
    lo, hi = _kv_range(st, bq, bk, qi, kv_len)
    kj = lo + j

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(kj < hi)
    def _step():
        v = v_ref[...]
        slope = slopes_ref[b, n] if st.has_alibi else None
        s, _ = _tile_logits(st, q_ref[...], k_ref[...], qi, kj, bq, bk, kv_len, slope, qseg_ref, kvseg_ref)
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


def _forward(st: _Static, q, k, v, qseg, kvseg, lens, slopes):
    """q ``[B,N,Tp,H]``, k, v ``[B,K,Sp,H]`` -> (o ``[B,N,Tp,H]``, lse ``[B,N,Tp,1]`` fp32)."""
    B, N, Tp, H = q.shape
    bq, bk = st.blocks.block_q, st.blocks.block_k
    steps = _num_steps(st, bq, bk, over_kv=True)
    q_spec, kv_spec, row_spec, q_map, kv_map = _row_walk(st, bq, bk, H)
    seg_args, seg_specs = _seg_inputs(st, qseg, kvseg, bq, bk, q_map, kv_map)
    return st.call(
        functools.partial(_fwd_kernel, st, bq, bk, steps),
        out_shape=[jax.ShapeDtypeStruct((B, N, Tp, H), q.dtype),
                   jax.ShapeDtypeStruct((B, N, Tp, 1), jnp.float32)],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, N, Tp // bq, steps),
            in_specs=[q_spec, kv_spec, kv_spec, *seg_specs],
            out_specs=[q_spec, row_spec],
            scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                            pltpu.VMEM((bq, H), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=_ROW_SEMANTICS),
        name="flash_fwd_tpu",
    )(lens, slopes, q, k, v, *seg_args)


# --------------------------------------------------------------------------- backward: dq


def _dq_kernel(st: _Static, bq: int, bk: int, steps: int, lens_ref, slopes_ref, *refs):
    tensors, qseg_ref, kvseg_ref, (dq_ref, dq_sc) = _split(refs, st, 6)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = tensors
    b, n, qi, j = (pl.program_id(a) for a in range(4))
    kv_len = _kv_len(st, lens_ref, b)
    lo, hi = _kv_range(st, bq, bk, qi, kv_len)
    kj = lo + j

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(kj < hi)
    def _step():
        k, v, do = k_ref[...], v_ref[...], do_ref[...]
        slope = slopes_ref[b, n] if st.has_alibi else None
        s, dscale = _tile_logits(st, q_ref[...], k, qi, kj, bq, bk, kv_len, slope, qseg_ref, kvseg_ref)
        p = jnp.exp(s - lse_ref[...])
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - delta_ref[...]) * dscale
        dq_sc[...] += jax.lax.dot_general(ds.astype(k.dtype), k, (((1,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)

    @pl.when(j == steps - 1)
    def _finish():
        dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


def _backward_dq(st: _Static, q, k, v, do, lse, delta, qseg, kvseg, lens, slopes):
    B, N, Tp, H = q.shape
    bq, bk = st.blocks.block_q_dq, st.blocks.block_k_dq
    steps = _num_steps(st, bq, bk, over_kv=True)
    q_spec, kv_spec, row_spec, q_map, kv_map = _row_walk(st, bq, bk, H)
    seg_args, seg_specs = _seg_inputs(st, qseg, kvseg, bq, bk, q_map, kv_map)
    return st.call(
        functools.partial(_dq_kernel, st, bq, bk, steps),
        out_shape=jax.ShapeDtypeStruct((B, N, Tp, H), q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, N, Tp // bq, steps),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *seg_specs],
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((bq, H), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=_ROW_SEMANTICS),
        name="flash_dq_tpu",
    )(lens, slopes, q, k, v, do, lse, delta, *seg_args)


# --------------------------------------------------------------------------- backward: dk, dv


def _dkv_kernel(st: _Static, bq: int, bk: int, steps: int, lens_ref, slopes_ref, *refs):
    tensors, qseg_ref, kvseg_ref, (dk_ref, dv_ref, dk_sc, dv_sc) = _split(refs, st, 6)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = tensors
    b, h, kj, g, i = (pl.program_id(a) for a in range(5))
    kv_len = _kv_len(st, lens_ref, b)
    lo, hi = _q_range(st, bq, bk, kj, kv_len)
    qi = lo + i

    @pl.when((g == 0) & (i == 0))
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(qi < hi)
    def _step():
        q, v, do = q_ref[...], v_ref[...], do_ref[...]
        slope = slopes_ref[b, h * st.G + g] if st.has_alibi else None
        s, dscale = _tile_logits(st, q, k_ref[...], qi, kj, bq, bk, kv_len, slope, qseg_ref, kvseg_ref)
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


def _backward_dkv(st: _Static, q, k, v, do, lse, delta, qseg, kvseg, lens, slopes):
    B, N, Tp, H = q.shape
    K, Sp = k.shape[1], k.shape[2]
    bq, bk = st.blocks.block_q_dkv, st.blocks.block_k_dkv
    steps = _num_steps(st, bq, bk, over_kv=False)
    nq, G = Tp // bq, st.G

    def q_map(b, h, j, g, i, lens_ref, slopes_ref):
        lo, hi = _q_range(st, bq, bk, j, _kv_len(st, lens_ref, b))
        return b, h * G + g, _clamp(lo, i, hi, nq), 0

    def kv_map(b, h, j, g, i, lens_ref, slopes_ref):
        return b, h, j, 0

    seg_args, seg_specs = _seg_inputs(st, qseg, kvseg, bq, bk, q_map, kv_map)
    q_spec = pl.BlockSpec((None, None, bq, H), q_map)
    kv_spec = pl.BlockSpec((None, None, bk, H), kv_map)
    row_spec = pl.BlockSpec((None, None, bq, 1), q_map)
    return st.call(
        functools.partial(_dkv_kernel, st, bq, bk, steps),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, K, Sp // bk, G, steps),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *seg_specs],
            out_specs=[kv_spec, kv_spec],
            scratch_shapes=[pltpu.VMEM((bk, H), jnp.float32), pltpu.VMEM((bk, H), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary")),
        name="flash_dkv_tpu",
    )(lens, slopes, q, k, v, do, lse, delta, *seg_args)


# --------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q, k, v, qseg, kvseg, lens, slopes):
    return _forward(st, q, k, v, qseg, kvseg, lens, slopes)[0]


def _flash_fwd(st, q, k, v, qseg, kvseg, lens, slopes):
    o, lse = _forward(st, q, k, v, qseg, kvseg, lens, slopes)
    return o, (q, k, v, qseg, kvseg, lens, slopes, o, lse)


def _flash_bwd(st, res, do):
    q, k, v, qseg, kvseg, lens, slopes, o, lse = res
    # Padding rows see keys the forward pass never visited; an infinite lse makes their p exactly 0
    # (a finite one can overflow exp(s - lse) to inf, and inf * 0 = NaN in dk, dv).
    padding = jax.lax.broadcasted_iota(jnp.int32, lse.shape, 2) >= st.params.q_len
    lse = jnp.where(padding, common.EMPTY_ROW_LSE, lse)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
    args = (q, k, v, do, lse, delta, qseg, kvseg, lens, slopes)
    dq = _backward_dq(st, *args)
    dk, dv = _backward_dkv(st, *args)
    return dq, dk, dv, None, None, None, None


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
                        block_sizes: BlockSizes | None = None, interpret: bool = False):
    """FlashAttention ``q [B,T,N,H], k, v [B,S,K,H] -> [B,T,N,H]`` with Mosaic TPU kernels.

    Differentiable in q, k, v. Mask and logit semantics are those of
    :mod:`pallas_kernels.flash_attention.common`. Run on CPU under
    ``pltpu.force_tpu_interpret_mode()`` or with ``interpret=True``.
    """
    B, T, S, N, K, H = common.check_inputs(
        q, k, v, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, kv_lengths=kv_lengths,
        q_offset=q_offset, alibi_slopes=alibi_slopes, softcap=softcap, scale=scale)
    in_dtype = q.dtype
    dtype = jnp.float32 if in_dtype == jnp.float16 else in_dtype
    blocks = resolve_block_sizes(block_sizes, T, S, H, jnp.dtype(dtype).itemsize)
    params = MaskParams.make(T, S, H, causal=causal, window=window, q_offset=q_offset,
                             scale=scale, softcap=softcap)
    bq_max = max(blocks.block_q, blocks.block_q_dq, blocks.block_q_dkv)
    bk_max = max(blocks.block_k, blocks.block_k_dq, blocks.block_k_dkv)
    t_pad, s_pad = common.round_up(T, bq_max), common.round_up(S, bk_max)
    st = _Static(params=params, blocks=blocks, G=N // K, has_seg=q_segment_ids is not None,
                 has_lens=kv_lengths is not None, has_alibi=alibi_slopes is not None,
                 t_pad=t_pad, s_pad=s_pad, interpret=bool(interpret))

    def to_kernel(x, padded):
        return common.pad_axis(jnp.swapaxes(x.astype(dtype), 1, 2), 2, padded)

    qt, kt, vt = to_kernel(q, t_pad), to_kernel(k, s_pad), to_kernel(v, s_pad)
    qseg = kvseg = None
    if st.has_seg:
        qseg = common.pad_axis(jnp.asarray(q_segment_ids, jnp.int32), 1, t_pad)[:, :, None]
        kvseg = common.pad_axis(jnp.asarray(kv_segment_ids, jnp.int32), 1, s_pad)
    lens = (jnp.full((B,), S, jnp.int32) if kv_lengths is None
            else jnp.clip(jnp.asarray(kv_lengths, jnp.int32), 0, S))
    slopes = (jnp.zeros((B, N), jnp.float32) if alibi_slopes is None
              else common.slopes_bn(alibi_slopes, B, N))
    o = _flash(st, qt, kt, vt, qseg, kvseg, lens, slopes)
    return jnp.swapaxes(o[:, :, :T], 1, 2).astype(in_dtype)
