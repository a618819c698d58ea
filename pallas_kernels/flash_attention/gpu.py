"""FlashAttention for GPU in Pallas (Triton lowering): forward, dq and dk/dv kernels.

Layout ``q [B,T,N,H]``, ``k, v [B,S,K,H]`` (no transposes). The wrapper pads T
and S to whole blocks and H to a power of two >= 16 with zeros; padded keys are
masked, padded query rows are dropped.

* forward, grid ``(B, N, T/bq)``: online softmax over the live kv blocks of the
  q block only (``common.kv_block_range``: blocks outside causal/window are
  never visited; blocks wholly inside skip the mask), fp32 accumulators;
  writes ``o`` and the row log-sum-exp ``[B, N, T]``.
* dq, grid ``(B, N, T/bq)``: recomputes ``p = exp(s - lse)`` per kv block.
* dk/dv, grid ``(B, K, S/bk)``: loops over the G query heads of the kv head and
  their live q blocks (``common.q_block_range``), so GQA sums happen in-kernel.

The kv head of query head ``n`` is ``n // G``, chosen in the BlockSpec index
map; K/V are never repeated.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.flash_attention import common
from pallas_kernels.flash_attention.common import BlockSizes, MaskParams

MIN_BLOCK = 16  # Triton's dot needs M, N, K >= 16
MAX_TILE_BYTES = 160 * 1024  # q, k, v tiles + fp32 logits must fit in shared memory / registers
_F32 = jnp.float32


class Aux(NamedTuple):
    """Mask operands after padding: ``q_seg [B,Tp]``, ``kv_seg [B,Sp]`` int32, ``lengths [B,1]`` int32,
    ``slopes [B,N]`` fp32; each may be None."""

    q_seg: Any = None
    kv_seg: Any = None
    lengths: Any = None
    slopes: Any = None


@dataclasses.dataclass(frozen=True)
class _Static:
    params: MaskParams
    blocks: BlockSizes
    interpret: bool
    H: int  # true head dim


def _iota(n: int):
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _dot(a, b, contract: tuple[int, int]):
    """fp32-accumulated 2-D dot; exact (IEEE) for fp32 inputs rather than TF32."""
    prec = jax.lax.Precision.HIGHEST if a.dtype == _F32 else None
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                               precision=prec, preferred_element_type=_F32)


def _split_refs(refs, aux_flags):
    """-> (main refs, q_seg_ref, kv_seg_ref, len_ref, slope_ref, out refs)."""
    has_seg, has_len, has_slope, n_main = aux_flags
    refs = list(refs)
    main, refs = refs[:n_main], refs[n_main:]
    qseg = kseg = ln = sl = None
    if has_seg:
        qseg, kseg, *refs = refs
    if has_len:
        ln, *refs = refs
    if has_slope:
        sl, *refs = refs
    return main, qseg, kseg, ln, sl, refs


def _mask_and_logits(p, qk, q_pos, k_pos, *, slope, q_seg, kv_seg, kv_length, static_mask: bool,
                     check_kv_len: bool):
    s, dscale = common.tile_logits(p, qk, q_pos, k_pos, slope)
    if static_mask:
        allowed = common.tile_allowed(p, q_pos, k_pos, q_seg=q_seg, kv_seg=kv_seg, kv_length=kv_length,
                                      check_kv_len=check_kv_len)
    else:
        allowed = common.tile_allowed(MaskParams(p.q_len, p.kv_len), q_pos, k_pos, q_seg=q_seg,
                                      kv_seg=kv_seg, kv_length=kv_length, check_kv_len=False)
    return common.mask_logits(s, allowed), dscale


def _kv_loop(p, qi, bq, bk, body):
    """Run ``body(j, carry, static_mask)`` over the live kv blocks of q block ``qi``.

    Three runs: masked edge, the blocks causal/window leave whole (``static_mask=False``), masked edge.
    """
    lo, hi = common.kv_block_range(p, qi, bq, bk)

    def run(a, b, static_mask, carry):
        return jax.lax.fori_loop(a, b, functools.partial(body, static_mask=static_mask), carry)

    def loops(carry):
        ulo, uhi = common.kv_unmasked_range(p, qi, bq, bk)
        a = jnp.clip(ulo, lo, hi)
        b = jnp.clip(uhi, a, hi)
        carry = run(lo, a, True, carry)
        carry = run(a, b, False, carry)
        return run(b, hi, True, carry)

    return loops


# --------------------------------------------------------------------------- forward


def _fwd_kernel(*refs, st: _Static, bq: int, bk: int, flags, check_kv_len: bool):
    (q_ref, k_ref, v_ref), qseg_ref, kseg_ref, len_ref, slope_ref, (o_ref, lse_ref) = _split_refs(refs, flags)
    p = st.params
    qi = pl.program_id(2)
    q = q_ref[...]
    q_pos = (qi * bq + p.q_offset + _iota(bq))[:, None]
    q_seg = None if qseg_ref is None else qseg_ref[...][:, None]
    kv_length = None if len_ref is None else len_ref[0]
    slope = None if slope_ref is None else slope_ref[0]

    def body(j, carry, static_mask):
        acc, m, l = carry
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        k_pos = (start + _iota(bk))[None, :]
        kv_seg = None if kseg_ref is None else kseg_ref[pl.ds(start, bk)][None, :]
        s, _ = _mask_and_logits(p, _dot(q, k, (1, 1)), q_pos, k_pos, slope=slope, q_seg=q_seg,
                                kv_seg=kv_seg, kv_length=kv_length, static_mask=static_mask,
                                check_kv_len=check_kv_len)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = common.safe_max(m_new)
        alpha = jnp.exp(m - m_safe)
        pr = jnp.exp(s - m_safe[:, None])
        l = alpha * l + jnp.sum(pr, axis=1)
        acc = acc * alpha[:, None] + _dot(pr.astype(v.dtype), v, (1, 0))
        return acc, m_new, l

    init = (jnp.zeros((bq, q.shape[1]), _F32), jnp.full((bq,), -jnp.inf, _F32), jnp.zeros((bq,), _F32))
    acc, m, l = _kv_loop(p, qi, bq, bk, body)(init)
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = common.finalize_lse(m, l)


def _aux_specs(aux: Aux, q_block, kv_block, len_map, slope_block, slope_map):
    specs, args = [], []
    if aux.q_seg is not None:
        specs += [q_block, kv_block]
        args += [aux.q_seg, aux.kv_seg]
    if aux.lengths is not None:
        specs.append(pl.BlockSpec((None, 1), len_map))
        args.append(aux.lengths)
    if aux.slopes is not None:
        specs.append(pl.BlockSpec((None, slope_block), slope_map))
        args.append(aux.slopes)
    return specs, args


def _flags(aux: Aux, n_main: int):
    return (aux.q_seg is not None, aux.lengths is not None, aux.slopes is not None, n_main)


def _warps(H: int) -> int:
    return 4 if H <= 64 else 8


def _fwd_call(q, k, v, aux: Aux, st: _Static):
    B, Tp, N, Hp = q.shape
    Sp, K = k.shape[1], k.shape[2]
    G = N // K
    bq, bk = st.blocks.block_q, st.blocks.block_k
    grid = (B, N, Tp // bq)
    aux_specs, aux_args = _aux_specs(
        aux,
        pl.BlockSpec((None, bq), lambda b, n, i: (b, i)),
        pl.BlockSpec((None, Sp), lambda b, n, i: (b, 0)),
        lambda b, n, i: (b, 0),
        1,
        lambda b, n, i: (b, n),
    )
    kernel = functools.partial(_fwd_kernel, st=st, bq=bq, bk=bk, flags=_flags(aux, 3),
                               check_kv_len=Sp != st.params.kv_len)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, bq, None, Hp), lambda b, n, i: (b, i, n, 0)),
            pl.BlockSpec((None, Sp, None, Hp), lambda b, n, i: (b, 0, n // G, 0)),
            pl.BlockSpec((None, Sp, None, Hp), lambda b, n, i: (b, 0, n // G, 0)),
            *aux_specs,
        ],
        out_specs=[
            pl.BlockSpec((None, bq, None, Hp), lambda b, n, i: (b, i, n, 0)),
            pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, N, Tp), _F32)],
        compiler_params=plgpu.CompilerParams(num_warps=_warps(Hp), num_stages=2),
        interpret=st.interpret,
        name="flash_attention_fwd",
    )(q, k, v, *aux_args)


# --------------------------------------------------------------------------- backward: dq


def _dq_kernel(*refs, st: _Static, bq: int, bk: int, flags, check_kv_len: bool):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qseg_ref, kseg_ref, len_ref, slope_ref, (dq_ref,) = \
        _split_refs(refs, flags)
    p = st.params
    qi = pl.program_id(2)
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...][:, None]
    delta = delta_ref[...][:, None]
    q_pos = (qi * bq + p.q_offset + _iota(bq))[:, None]
    q_seg = None if qseg_ref is None else qseg_ref[...][:, None]
    kv_length = None if len_ref is None else len_ref[0]
    slope = None if slope_ref is None else slope_ref[0]

    def body(j, dq, static_mask):
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        k_pos = (start + _iota(bk))[None, :]
        kv_seg = None if kseg_ref is None else kseg_ref[pl.ds(start, bk)][None, :]
        s, dscale = _mask_and_logits(p, _dot(q, k, (1, 1)), q_pos, k_pos, slope=slope, q_seg=q_seg,
                                     kv_seg=kv_seg, kv_length=kv_length, static_mask=static_mask,
                                     check_kv_len=check_kv_len)
        pr = jnp.exp(s - lse)
        ds = pr * (_dot(do, v, (1, 1)) - delta) * dscale
        return dq + _dot(ds.astype(k.dtype), k, (1, 0))

    dq = _kv_loop(p, qi, bq, bk, body)(jnp.zeros(q.shape, _F32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dq_call(q, k, v, do, lse, delta, aux: Aux, st: _Static):
    B, Tp, N, Hp = q.shape
    Sp, K = k.shape[1], k.shape[2]
    G = N // K
    bq, bk = st.blocks.block_q_dq, st.blocks.block_k_dq
    aux_specs, aux_args = _aux_specs(
        aux,
        pl.BlockSpec((None, bq), lambda b, n, i: (b, i)),
        pl.BlockSpec((None, Sp), lambda b, n, i: (b, 0)),
        lambda b, n, i: (b, 0),
        1,
        lambda b, n, i: (b, n),
    )
    q_spec = pl.BlockSpec((None, bq, None, Hp), lambda b, n, i: (b, i, n, 0))
    kv_spec = pl.BlockSpec((None, Sp, None, Hp), lambda b, n, i: (b, 0, n // G, 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i))
    kernel = functools.partial(_dq_kernel, st=st, bq=bq, bk=bk, flags=_flags(aux, 6),
                               check_kv_len=Sp != st.params.kv_len)
    return pl.pallas_call(
        kernel,
        grid=(B, N, Tp // bq),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *aux_specs],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=_warps(Hp), num_stages=2),
        interpret=st.interpret,
        name="flash_attention_dq",
    )(q, k, v, do, lse, delta, *aux_args)


# --------------------------------------------------------------------------- backward: dk, dv


def _dkv_kernel(*refs, st: _Static, bq: int, bk: int, G: int, flags, check_kv_len: bool):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qseg_ref, kseg_ref, len_ref, slope_ref, (dk_ref, dv_ref) = \
        _split_refs(refs, flags)
    p = st.params
    kj = pl.program_id(2)
    k = k_ref[...]
    v = v_ref[...]
    k_pos = (kj * bk + _iota(bk))[None, :]
    kv_seg = None if kseg_ref is None else kseg_ref[...][None, :]
    kv_length = None if len_ref is None else len_ref[0]
    lo, hi = common.q_block_range(p, kj, bq, bk)

    def head(g, carry):
        slope = None if slope_ref is None else slope_ref[g]

        def body(i, carry):
            dk, dv = carry
            start = pl.multiple_of(i * bq, bq)
            q = q_ref[pl.ds(start, bq), g, :]
            do = do_ref[pl.ds(start, bq), g, :]
            lse = lse_ref[g, pl.ds(start, bq)][:, None]
            delta = delta_ref[g, pl.ds(start, bq)][:, None]
            q_pos = (start + p.q_offset + _iota(bq))[:, None]
            q_seg = None if qseg_ref is None else qseg_ref[pl.ds(start, bq)][:, None]
            s, dscale = _mask_and_logits(p, _dot(q, k, (1, 1)), q_pos, k_pos, slope=slope, q_seg=q_seg,
                                         kv_seg=kv_seg, kv_length=kv_length, static_mask=True,
                                         check_kv_len=check_kv_len)
            pr = jnp.exp(s - lse)
            dv = dv + _dot(pr.astype(do.dtype), do, (0, 0))
            ds = pr * (_dot(do, v, (1, 1)) - delta) * dscale
            dk = dk + _dot(ds.astype(q.dtype), q, (0, 0))
            return dk, dv

        return jax.lax.fori_loop(lo, hi, body, carry)

    zeros = jnp.zeros(k.shape, _F32)
    dk, dv = jax.lax.fori_loop(0, G, head, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dkv_call(q, k, v, do, lse, delta, aux: Aux, st: _Static):
    B, Tp, N, Hp = q.shape
    Sp, K = k.shape[1], k.shape[2]
    G = N // K
    bq, bk = st.blocks.block_q_dkv, st.blocks.block_k_dkv
    aux_specs, aux_args = _aux_specs(
        aux,
        pl.BlockSpec((None, Tp), lambda b, h, j: (b, 0)),
        pl.BlockSpec((None, bk), lambda b, h, j: (b, j)),
        lambda b, h, j: (b, 0),
        G,
        lambda b, h, j: (b, h),
    )
    q_spec = pl.BlockSpec((None, Tp, G, Hp), lambda b, h, j: (b, 0, h, 0))
    kv_spec = pl.BlockSpec((None, bk, None, Hp), lambda b, h, j: (b, j, h, 0))
    row_spec = pl.BlockSpec((None, G, Tp), lambda b, h, j: (b, h, 0))
    kernel = functools.partial(_dkv_kernel, st=st, bq=bq, bk=bk, G=G, flags=_flags(aux, 6),
                               check_kv_len=Sp != st.params.kv_len)
    return pl.pallas_call(
        kernel,
        grid=(B, K, Sp // bk),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *aux_specs],
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=plgpu.CompilerParams(num_warps=_warps(Hp), num_stages=2),
        interpret=st.interpret,
        name="flash_attention_dkv",
    )(q, k, v, do, lse, delta, *aux_args)


# --------------------------------------------------------------------------- wrapper + custom_vjp


def _padded_sizes(st: _Static) -> tuple[int, int, int]:
    b = st.blocks
    Tp = common.round_up(st.params.q_len, max(b.block_q, b.block_q_dq, b.block_q_dkv))
    Sp = common.round_up(st.params.kv_len, max(b.block_k, b.block_k_dq, b.block_k_dkv))
    Hp = max(MIN_BLOCK, common.next_pow2(st.H))
    return Tp, Sp, Hp


def _pad_all(q, k, v, aux: Aux, st: _Static):
    Tp, Sp, Hp = _padded_sizes(st)
    q = common.pad_axis(common.pad_axis(q, 1, Tp), 3, Hp)
    k = common.pad_axis(common.pad_axis(k, 1, Sp), 3, Hp)
    v = common.pad_axis(common.pad_axis(v, 1, Sp), 3, Hp)
    aux = aux._replace(q_seg=common.pad_axis(aux.q_seg, 1, Tp), kv_seg=common.pad_axis(aux.kv_seg, 1, Sp))
    return q, k, v, aux


def _forward(q, k, v, aux: Aux, st: _Static):
    T, H = q.shape[1], q.shape[3]
    o, lse = _fwd_call(*_pad_all(q, k, v, aux, st), st)
    return o[:, :T, :, :H], lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, aux: Aux, st: _Static):
    return _forward(q, k, v, aux, st)[0]


def _flash_fwd(q, k, v, aux, st):
    o, lse = _forward(q, k, v, aux, st)
    return o, (q, k, v, aux, o, lse)


def _flash_bwd(st, res, do):
    q, k, v, aux, o, lse = res
    T, S, H = q.shape[1], k.shape[1], q.shape[3]
    Tp, _, Hp = _padded_sizes(st)
    # Padding rows see keys the forward pass never visited; an infinite lse makes their p exactly 0
    # (a finite one can overflow exp(s - lse) to inf, and inf * 0 = NaN in dk, dv).
    lse = jnp.where(jax.lax.broadcasted_iota(jnp.int32, lse.shape, 2) < T, lse, common.EMPTY_ROW_LSE)
    delta = jnp.einsum("BTNH,BTNH->BNT", do.astype(_F32), o.astype(_F32))
    delta = common.pad_axis(delta, 2, Tp)
    do = common.pad_axis(common.pad_axis(do.astype(q.dtype), 1, Tp), 3, Hp)
    qp, kp, vp, auxp = _pad_all(q, k, v, aux, st)
    dq = _dq_call(qp, kp, vp, do, lse, delta, auxp, st)
    dk, dv = _dkv_call(qp, kp, vp, do, lse, delta, auxp, st)
    no_grad = Aux(*(None for _ in aux))
    return dq[:, :T, :, :H], dk[:, :S, :, :H], dv[:, :S, :, :H], no_grad


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention_gpu(q, k, v, *, causal: bool = False, window=None, q_segment_ids=None,
                        kv_segment_ids=None, kv_lengths=None, q_offset: int | None = None,
                        alibi_slopes=None, softcap: float | None = None, scale: float | None = None,
                        block_sizes: BlockSizes | None = None, interpret: bool = False):
    """Differentiable FlashAttention on the Pallas Triton backend (``interpret=True`` runs it on CPU).

    Arguments as in ``pallas_kernels.flash_attention.flash_attention``; slopes and ids get zero cotangents.
    """
    B, T, S, N, K, H = common.check_inputs(
        q, k, v, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, kv_lengths=kv_lengths,
        q_offset=q_offset, alibi_slopes=alibi_slopes, softcap=softcap, scale=scale)
    params = MaskParams.make(T, S, H, causal=causal, window=window, q_offset=q_offset, scale=scale,
                             softcap=softcap)
    Hp = max(MIN_BLOCK, common.next_pow2(H))
    itemsize = jnp.dtype(q.dtype).itemsize
    if block_sizes is None:
        block_sizes = BlockSizes.default("gpu").fit(Hp, itemsize, MAX_TILE_BYTES, MIN_BLOCK)
    blocks = common.check_block_sizes(block_sizes, pow2=True, minimum=MIN_BLOCK, H=Hp, itemsize=itemsize,
                                      max_tile_bytes=MAX_TILE_BYTES).clipped(T, S, MIN_BLOCK)
    st = _Static(params=params, blocks=blocks, interpret=bool(interpret), H=H)
    aux = Aux(
        q_seg=None if q_segment_ids is None else jnp.asarray(q_segment_ids, jnp.int32),
        kv_seg=None if kv_segment_ids is None else jnp.asarray(kv_segment_ids, jnp.int32),
        lengths=None if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32).reshape(B, 1),
        slopes=common.slopes_bn(alibi_slopes, B, N),
    )
    return _flash(q, k, v, aux, st)
