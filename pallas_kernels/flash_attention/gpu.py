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

Tiles, warps and pipeline stages: :mod:`pallas_kernels.block_table`, per GPU
architecture (read at call time), padded head dim, dtype and kernel; entries
compile for sm_90a / sm_80 / sm_86 without register spills (``experiments/bench/gpu_compile.py``).
A caller's ``block_sizes`` replaces the table: its tiles, launched with 4 warps up to head dim 64 else 8
and 2 stages.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import block_table
from pallas_kernels.flash_attention import common
from pallas_kernels.flash_attention.common import BlockSizes, MaskParams

MIN_BLOCK = 16  # Triton's dot needs M, N, K >= 16
MAX_TILE_BYTES = 160 * 1024  # q, k, v tiles + fp32 logits must fit in shared memory / registers
_F32 = jnp.float32


class Aux(NamedTuple):
    """Mask operands after padding: ``q_seg [B,Tp]``, ``kv_seg [B,Sp]`` int32, ``lengths [B,1]`` int32,
    ``slopes [B,N]`` fp32; each may be None.

    Block-sparse operands (all int32, None without a ``block_map``): tile lists ``fwd_list [N, Tp/bq, W]``,
    ``dq_list`` (dq tiling) and ``dkv_list [N, Sp/bk, W]`` (q blocks per kv block), column 0 the count,
    then the listed blocks; ``q_glob [B, Tp]``, ``kv_glob [B, Sp]``, ``rand [N, r', Tp]`` (-1 = none).
    """

    q_seg: Any = None
    kv_seg: Any = None
    lengths: Any = None
    slopes: Any = None
    fwd_list: Any = None
    dq_list: Any = None
    dkv_list: Any = None
    q_glob: Any = None
    kv_glob: Any = None
    rand: Any = None


@dataclasses.dataclass(frozen=True)
class _Static:
    params: MaskParams
    blocks: BlockSizes
    interpret: bool
    H: int  # true head dim
    n_rand: int = 0  # random blocks per query row (rows of Aux.rand actually used)
    rand_size: int = 1
    # (num_warps, num_stages) of the forward, dq and dk/dv kernels (block_table.py)
    launch: tuple[tuple[int, int], tuple[int, int], tuple[int, int]] = ((4, 2), (4, 2), (4, 2))


def _iota(n: int):
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _dot(a, b, contract: tuple[int, int]):
    """fp32-accumulated 2-D dot; exact (IEEE) for fp32 inputs rather than TF32."""
    prec = jax.lax.Precision.HIGHEST if a.dtype == _F32 else None
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                               precision=prec, preferred_element_type=_F32)


class _Pat(NamedTuple):
    """Block-sparse refs of one kernel (None when absent)."""

    lst: Any = None
    qg: Any = None
    kg: Any = None
    rnd: Any = None


def _split_refs(refs, aux_flags):
    """-> (main refs, q_seg_ref, kv_seg_ref, len_ref, slope_ref, _Pat, out refs)."""
    has_seg, has_len, has_slope, n_main, pat_flags = aux_flags
    refs = list(refs)
    main, refs = refs[:n_main], refs[n_main:]
    qseg = kseg = ln = sl = None
    if has_seg:
        qseg, kseg, *refs = refs
    if has_len:
        ln, *refs = refs
    if has_slope:
        sl, *refs = refs
    pat = []
    for present in pat_flags:
        if present:
            ref, *refs = refs
            pat.append(ref)
        else:
            pat.append(None)
    return main, qseg, kseg, ln, sl, _Pat(*pat), refs


def _row_terms(st: "_Static", pat: _Pat, load_qg, load_rand, transposed: bool = False):
    """Per-row pattern terms of a q tile: (q_glob ``[bq, 1]`` or None, random starts: list of ``[bq, 1]``);
    ``[1, bq]`` each when ``transposed`` (the dk/dv kernel's ``[bk, bq]`` tiles)."""
    col = (lambda x: x[None, :]) if transposed else (lambda x: x[:, None])
    q_glob = None if pat.qg is None else col(load_qg())
    rand = [] if pat.rnd is None else [col(load_rand(t)) for t in range(st.n_rand)]
    return q_glob, rand


def _mask_and_logits(p, qk, q_pos, k_pos, *, slope, q_seg, kv_seg, kv_length, static_mask: bool,
                     check_kv_len: bool, pattern=None):
    s, dscale = common.tile_logits(p, qk, q_pos, k_pos, slope)
    if static_mask:
        allowed = common.tile_allowed(p, q_pos, k_pos, q_seg=q_seg, kv_seg=kv_seg, kv_length=kv_length,
                                      check_kv_len=check_kv_len, pattern=pattern)
    else:
        allowed = common.tile_allowed(MaskParams(p.q_len, p.kv_len), q_pos, k_pos, q_seg=q_seg,
                                      kv_seg=kv_seg, kv_length=kv_length, check_kv_len=False)
    return common.mask_logits(s, allowed), dscale


def _kv_loop(p, qi, bq, bk, body, lst_ref=None):
    """Run ``body(j, carry, static_mask)`` over the live kv blocks of q block ``qi``.

    With a tile list (``lst_ref [W]``: count, then blocks) exactly the listed blocks, masked.
    Else three runs: masked edge, the blocks causal/window leave whole (``static_mask=False``), masked edge.
    """
    if lst_ref is not None:
        def listed(carry):
            return jax.lax.fori_loop(0, lst_ref[0], lambda t, c: body(lst_ref[1 + t], c, static_mask=True), carry)

        return listed
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
    (q_ref, k_ref, v_ref), qseg_ref, kseg_ref, len_ref, slope_ref, pat, (o_ref, lse_ref) = \
        _split_refs(refs, flags)
    p = st.params
    qi = pl.program_id(2)
    q = q_ref[...]
    q_pos = (qi * bq + p.q_offset + _iota(bq))[:, None]
    q_seg = None if qseg_ref is None else qseg_ref[...][:, None]
    kv_length = None if len_ref is None else len_ref[0]
    slope = None if slope_ref is None else slope_ref[0]
    q_glob, rand = _row_terms(st, pat, lambda: pat.qg[...], lambda t: pat.rnd[t, :])

    def body(j, carry, static_mask):
        acc, m, l = carry
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        k_pos = (start + _iota(bk))[None, :]
        kv_seg = None if kseg_ref is None else kseg_ref[pl.ds(start, bk)][None, :]
        kv_glob = None if pat.kg is None else pat.kg[pl.ds(start, bk)][None, :]
        pattern = common.pattern_terms(k_pos, q_glob=q_glob, kv_glob=kv_glob, rand_starts=rand,
                                       rand_size=st.rand_size)
        s, _ = _mask_and_logits(p, _dot(q, k, (1, 1)), q_pos, k_pos, slope=slope, q_seg=q_seg,
                                kv_seg=kv_seg, kv_length=kv_length, static_mask=static_mask,
                                check_kv_len=check_kv_len, pattern=pattern)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = common.safe_max(m_new)
        alpha = jnp.exp(m - m_safe)
        pr = jnp.exp(s - m_safe[:, None])
        l = alpha * l + jnp.sum(pr, axis=1)
        acc = acc * alpha[:, None] + _dot(pr.astype(v.dtype), v, (1, 0))
        return acc, m_new, l

    init = (jnp.zeros((bq, q.shape[1]), _F32), jnp.full((bq,), -jnp.inf, _F32), jnp.zeros((bq,), _F32))
    acc, m, l = _kv_loop(p, qi, bq, bk, body, pat.lst)(init)
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = common.finalize_lse(m, l)


def _aux_specs(aux: Aux, q_block, kv_block, len_map, slope_block, slope_map, pat_specs=None):
    """BlockSpecs and operands of the mask operands; ``pat_specs`` lists (array, spec) of the pattern ones."""
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
    for arr, spec in pat_specs or ():
        if arr is not None:
            specs.append(spec)
            args.append(arr)
    return specs, args


def _flags(aux: Aux, n_main: int, lst=None):
    pat = (lst is not None, aux.q_glob is not None, aux.kv_glob is not None, aux.rand is not None)
    return (aux.q_seg is not None, aux.lengths is not None, aux.slopes is not None, n_main, pat)


def _row_pat_specs(aux: Aux, lst, bq: int, Sp: int):
    """Pattern specs of the grid ``(B, N, Tp/bq)`` kernels (forward, dq)."""
    return [
        (lst, None if lst is None else pl.BlockSpec((None, None, lst.shape[2]), lambda b, n, i: (n, i, 0))),
        (aux.q_glob, pl.BlockSpec((None, bq), lambda b, n, i: (b, i))),
        (aux.kv_glob, pl.BlockSpec((None, Sp), lambda b, n, i: (b, 0))),
        (aux.rand, None if aux.rand is None else
         pl.BlockSpec((None, aux.rand.shape[1], bq), lambda b, n, i: (n, 0, i))),
    ]


def _compiler_params(launch: tuple[int, int]):
    return plgpu.CompilerParams(num_warps=launch[0], num_stages=launch[1])


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
        _row_pat_specs(aux, aux.fwd_list, bq, Sp),
    )
    kernel = functools.partial(_fwd_kernel, st=st, bq=bq, bk=bk, flags=_flags(aux, 3, aux.fwd_list),
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
        compiler_params=_compiler_params(st.launch[0]),
        interpret=st.interpret,
        name="flash_attention_fwd",
    )(q, k, v, *aux_args)


# --------------------------------------------------------------------------- backward: dq


def _dq_kernel(*refs, st: _Static, bq: int, bk: int, flags, check_kv_len: bool):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qseg_ref, kseg_ref, len_ref, slope_ref, pat, (dq_ref,) = \
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
    q_glob, rand = _row_terms(st, pat, lambda: pat.qg[...], lambda t: pat.rnd[t, :])

    def body(j, dq, static_mask):
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        k_pos = (start + _iota(bk))[None, :]
        kv_seg = None if kseg_ref is None else kseg_ref[pl.ds(start, bk)][None, :]
        kv_glob = None if pat.kg is None else pat.kg[pl.ds(start, bk)][None, :]
        pattern = common.pattern_terms(k_pos, q_glob=q_glob, kv_glob=kv_glob, rand_starts=rand,
                                       rand_size=st.rand_size)
        s, dscale = _mask_and_logits(p, _dot(q, k, (1, 1)), q_pos, k_pos, slope=slope, q_seg=q_seg,
                                     kv_seg=kv_seg, kv_length=kv_length, static_mask=static_mask,
                                     check_kv_len=check_kv_len, pattern=pattern)
        pr = jnp.exp(s - lse)
        ds = pr * (_dot(do, v, (1, 1)) - delta) * dscale
        return dq + _dot(ds.astype(k.dtype), k, (1, 0))

    dq = _kv_loop(p, qi, bq, bk, body, pat.lst)(jnp.zeros(q.shape, _F32))
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
        _row_pat_specs(aux, aux.dq_list, bq, Sp),
    )
    q_spec = pl.BlockSpec((None, bq, None, Hp), lambda b, n, i: (b, i, n, 0))
    kv_spec = pl.BlockSpec((None, Sp, None, Hp), lambda b, n, i: (b, 0, n // G, 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i))
    kernel = functools.partial(_dq_kernel, st=st, bq=bq, bk=bk, flags=_flags(aux, 6, aux.dq_list),
                               check_kv_len=Sp != st.params.kv_len)
    return pl.pallas_call(
        kernel,
        grid=(B, N, Tp // bq),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *aux_specs],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(st.launch[1]),
        interpret=st.interpret,
        name="flash_attention_dq",
    )(q, k, v, do, lse, delta, *aux_args)


# --------------------------------------------------------------------------- backward: dk, dv


def _dkv_kernel(*refs, st: _Static, bq: int, bk: int, G: int, flags, check_kv_len: bool):
    """dk, dv of one kv block, its tiles transposed (``[bk, bq]``: keys down, queries across).

    ``sT = k qT``, ``dv += pT do``, ``dpT = v doT``, ``dk += dsT q``: every dot takes its register
    operand as it was computed, so no ``[bq, bk]`` tile is transposed in registers (that costs a trip
    through shared memory and, on sm_80/sm_90, the registers that made this kernel spill).
    """
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qseg_ref, kseg_ref, len_ref, slope_ref, pat, \
        (dk_ref, dv_ref) = _split_refs(refs, flags)
    p = st.params
    kj = pl.program_id(2)
    k = k_ref[...]
    v = v_ref[...]
    k_pos = (kj * bk + _iota(bk))[:, None]
    kv_seg = None if kseg_ref is None else kseg_ref[...][:, None]
    kv_length = None if len_ref is None else len_ref[0]
    kv_glob = None if pat.kg is None else pat.kg[...][:, None]
    if pat.lst is None:
        lo, hi = common.q_block_range(p, kj, bq, bk)

    def head(g, carry):
        slope = None if slope_ref is None else slope_ref[g]

        def body(i, carry):
            dk, dv = carry
            start = pl.multiple_of(i * bq, bq)
            q = q_ref[pl.ds(start, bq), g, :]
            do = do_ref[pl.ds(start, bq), g, :]
            lse = lse_ref[g, pl.ds(start, bq)][None, :]
            delta = delta_ref[g, pl.ds(start, bq)][None, :]
            q_pos = (start + p.q_offset + _iota(bq))[None, :]
            q_seg = None if qseg_ref is None else qseg_ref[pl.ds(start, bq)][None, :]
            q_glob, rand = _row_terms(st, pat, lambda: pat.qg[pl.ds(start, bq)],
                                      lambda t: pat.rnd[g, t, pl.ds(start, bq)], transposed=True)
            pattern = common.pattern_terms(k_pos, q_glob=q_glob, kv_glob=kv_glob, rand_starts=rand,
                                           rand_size=st.rand_size)
            s, dscale = _mask_and_logits(p, _dot(k, q, (1, 1)), q_pos, k_pos, slope=slope, q_seg=q_seg,
                                         kv_seg=kv_seg, kv_length=kv_length, static_mask=True,
                                         check_kv_len=check_kv_len, pattern=pattern)
            pr = jnp.exp(s - lse)
            dv = dv + _dot(pr.astype(do.dtype), do, (1, 0))
            ds = pr * (_dot(v, do, (1, 1)) - delta) * dscale
            dk = dk + _dot(ds.astype(q.dtype), q, (1, 0))
            return dk, dv

        if pat.lst is not None:
            return jax.lax.fori_loop(0, pat.lst[g, 0], lambda t, c: body(pat.lst[g, 1 + t], c), carry)
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
        [
            (aux.dkv_list, None if aux.dkv_list is None else
             pl.BlockSpec((G, None, aux.dkv_list.shape[2]), lambda b, h, j: (h, j, 0))),
            (aux.q_glob, pl.BlockSpec((None, Tp), lambda b, h, j: (b, 0))),
            (aux.kv_glob, pl.BlockSpec((None, bk), lambda b, h, j: (b, j))),
            (aux.rand, None if aux.rand is None else
             pl.BlockSpec((G, aux.rand.shape[1], Tp), lambda b, h, j: (h, 0, 0))),
        ],
    )
    q_spec = pl.BlockSpec((None, Tp, G, Hp), lambda b, h, j: (b, 0, h, 0))
    kv_spec = pl.BlockSpec((None, bk, None, Hp), lambda b, h, j: (b, j, h, 0))
    row_spec = pl.BlockSpec((None, G, Tp), lambda b, h, j: (b, h, 0))
    kernel = functools.partial(_dkv_kernel, st=st, bq=bq, bk=bk, G=G, flags=_flags(aux, 6, aux.dkv_list),
                               check_kv_len=Sp != st.params.kv_len)
    return pl.pallas_call(
        kernel,
        grid=(B, K, Sp // bk),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *aux_specs],
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_compiler_params(st.launch[2]),
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
                        block_sizes: BlockSizes | None = None, interpret: bool = False, block_map=None,
                        q_global=None, kv_global=None, random_kv_starts=None, random_block_size: int | None = None):
    """Differentiable FlashAttention on the Pallas Triton backend (``interpret=True`` runs it on CPU).

    Arguments as in ``pallas_kernels.flash_attention.flash_attention``; slopes and ids get zero cotangents.
    """
    B, T, S, N, K, H = common.check_inputs(
        q, k, v, window=window, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, kv_lengths=kv_lengths,
        q_offset=q_offset, alibi_slopes=alibi_slopes, softcap=softcap, scale=scale, block_map=block_map,
        q_global=q_global, kv_global=kv_global, random_kv_starts=random_kv_starts,
        random_block_size=random_block_size)
    params = MaskParams.make(T, S, H, causal=causal, window=window, q_offset=q_offset, scale=scale,
                             softcap=softcap)
    Hp = max(MIN_BLOCK, common.next_pow2(H))
    itemsize = jnp.dtype(q.dtype).itemsize
    if block_sizes is None:  # the table's tiles with its warps and stages, for the device read at trace time
        arch = block_table.gpu_arch()
        block_sizes = table_block_sizes(Hp, q.dtype, arch)
        launch = tuple((c.num_warps, c.num_stages) for c in
                       (block_table.lookup(kernel, Hp, q.dtype, arch) for kernel in ("fwd", "dq", "dkv")))
    else:  # a caller's tiles: the generic launch (the table's stages were sized for the table's tiles)
        launch = ((4 if Hp <= 64 else 8, 2),) * 3
    blocks = common.check_block_sizes(block_sizes, pow2=True, minimum=MIN_BLOCK, H=Hp, itemsize=itemsize,
                                      max_tile_bytes=MAX_TILE_BYTES).clipped(T, S, MIN_BLOCK)
    n_rand = 0 if random_kv_starts is None else int(jnp.shape(random_kv_starts)[1])
    st = _Static(params=params, blocks=blocks, interpret=bool(interpret), H=H, n_rand=n_rand,
                 rand_size=1 if random_block_size is None else int(random_block_size),
                 launch=launch)
    aux = Aux(
        q_seg=None if q_segment_ids is None else jnp.asarray(q_segment_ids, jnp.int32),
        kv_seg=None if kv_segment_ids is None else jnp.asarray(kv_segment_ids, jnp.int32),
        lengths=None if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32).reshape(B, 1),
        slopes=common.slopes_bn(alibi_slopes, B, N),
    )
    if block_map is not None:
        aux = aux._replace(**_pattern_operands(st, B, N, block_map, q_global, kv_global, random_kv_starts))
    return _flash(q, k, v, aux, st)


def table_block_sizes(head_dim: int, dtype, arch: str | None = None) -> BlockSizes:
    """The forward, dq and dk/dv tiles of :mod:`pallas_kernels.block_table` for a padded ``head_dim``,
    ``dtype`` and ``arch`` (default: this machine's GPU, sm90 without one)."""
    fwd, dq, dkv = (block_table.lookup(kernel, head_dim, dtype, arch) for kernel in ("fwd", "dq", "dkv"))
    return BlockSizes(block_q=fwd.block_q, block_k=fwd.block_k, block_q_dkv=dkv.block_q, block_k_dkv=dkv.block_k,
                      block_q_dq=dq.block_q, block_k_dq=dq.block_k)


def _tile_lists(block_map, st: _Static, N: int, bq: int, bk: int, rows: int, transpose: bool):
    """Int32 ``[N, rows, W]``: per row of tiles its count, then its listed blocks (W a power of two)."""
    T, S = st.params.q_len, st.params.kv_len
    live = common.live_blocks(block_map, T, S, N, bq, bk)
    if transpose:
        live = live.transpose(0, 2, 1)
    idx, cnt = common.block_lists(live)
    nh, nr, w = idx.shape
    out = np.zeros((nh, rows, common.next_pow2(1 + w)), np.int32)
    out[:, :nr, 0] = cnt
    out[:, :nr, 1:] = idx[..., -1:]
    out[:, :nr, 1:1 + w] = idx
    return jnp.asarray(np.broadcast_to(out, (N,) + out.shape[1:]))


def _pattern_operands(st: _Static, B: int, N: int, block_map, q_global, kv_global, random_kv_starts):
    """Padded int32 operands of the block-sparse path (see :class:`Aux`)."""
    Tp, Sp, _ = _padded_sizes(st)
    b = st.blocks
    ops = dict(
        fwd_list=_tile_lists(block_map, st, N, b.block_q, b.block_k, Tp // b.block_q, False),
        dq_list=_tile_lists(block_map, st, N, b.block_q_dq, b.block_k_dq, Tp // b.block_q_dq, False),
        dkv_list=_tile_lists(block_map, st, N, b.block_q_dkv, b.block_k_dkv, Sp // b.block_k_dkv, True),
    )
    for name, x, n in (("q_glob", q_global, Tp), ("kv_glob", kv_global, Sp)):
        if x is not None:
            x = jnp.broadcast_to(jnp.asarray(x).astype(jnp.int32), (B, jnp.shape(x)[1]))
            ops[name] = common.pad_axis(x, 1, n)
    if random_kv_starts is not None:
        r = jnp.asarray(random_kv_starts, jnp.int32)
        r = jnp.broadcast_to(r, (N,) + r.shape[1:])
        rp = common.next_pow2(r.shape[1])
        ops["rand"] = jnp.pad(r, ((0, 0), (0, rp - r.shape[1]), (0, Tp - r.shape[2])), constant_values=-1)
    return ops
