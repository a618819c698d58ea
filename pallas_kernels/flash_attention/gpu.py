"""FlashAttention for GPU in Pallas (Triton lowering): forward, dq and dk/dv kernels.

Layout ``q [B,T,N,H]``, ``k, v [B,S,K,H]`` (no transposes). The wrapper pads T
and S to whole blocks and H to a power of two >= 16 with zeros; padded keys are
masked, padded query rows are dropped.

* forward, grid ``(B, N, T/bq)``: online softmax over the live kv blocks of the
  q block only (``BlockSchedule.kv_range``: blocks outside causal/window are
  never visited; blocks wholly inside skip the mask), fp32 accumulators;
  writes ``o`` and the row log-sum-exp ``[B, N, T]``.
* dq, grid ``(B, N, T/bq)``: recomputes ``p = exp(s - lse)`` per kv block.
* dk/dv, grid ``(B, K, S/bk)``: loops over the G query heads of the kv head and
  their live q blocks (``BlockSchedule.q_range``), so GQA sums happen in-kernel.

Each kernel takes ``q_ref, k_ref, v_ref`` (and the backward's ``do, lse, delta`` refs), then its
optional operands as one :class:`Refs` (a ref or None per field), then its outputs.

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
from pallas_kernels.flash_attention import tiles
from pallas_kernels.flash_attention.blocks import BlockSizes, check_block_sizes
from pallas_kernels.flash_attention.tiles import Logits
from pallas_kernels.kernel_mask import KernelMask
from pallas_kernels.schedule import BlockSchedule, block_lists
from pallas_kernels.shapes import next_pow2, pad_axis, round_up

MIN_BLOCK = 16  # Triton's dot needs M, N, K >= 16
MAX_TILE_BYTES = 160 * 1024  # q, k, v tiles + fp32 logits must fit in shared memory / registers
_F32 = jnp.float32


class Operands(NamedTuple):
    """The padded GPU layout of a call's :class:`KernelMask` and ALiBi slopes; each field None or int32
    (slopes fp32): ``q_seg [B,Tp]``, ``kv_seg [B,Sp]``, ``lengths [B,1]``, ``slopes [B,N]``.

    Block-sparse operands (None without a ``block_map``): tile lists ``fwd_list [N, Tp/bq, W]``,
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

    def refs(self, tile_list) -> "Refs":
        """What one kernel receives: these operands with that kernel's tile list."""
        return Refs(self.q_seg, self.kv_seg, self.lengths, self.slopes, tile_list, self.q_glob, self.kv_glob,
                    self.rand)


class Refs(NamedTuple):
    """One kernel's optional operands, in its signature after the tensors: arrays outside, refs inside
    (None where absent, so an absent operand is neither passed nor read). ``tiles``: its tile list."""

    q_seg: Any = None
    kv_seg: Any = None
    lengths: Any = None
    slopes: Any = None
    tiles: Any = None
    q_glob: Any = None
    kv_glob: Any = None
    rand: Any = None


@dataclasses.dataclass(frozen=True)
class _Static:
    mask: KernelMask  # KernelMask.static(): fields, operand shapes
    logits: Logits  # Logits.static()
    blocks: BlockSizes
    interpret: bool
    H: int  # true head dim
    # (num_warps, num_stages) of the forward, dq and dk/dv kernels (block_table.py)
    launch: tuple[tuple[int, int], tuple[int, int], tuple[int, int]] = ((4, 2), (4, 2), (4, 2))

    def schedule(self, bq: int, bk: int) -> BlockSchedule:
        return BlockSchedule(self.mask, bq, bk)


def _iota(n: int):
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _dot(a, b, contract: tuple[int, int]):
    """fp32-accumulated 2-D dot; exact (IEEE) for fp32 inputs rather than TF32."""
    prec = jax.lax.Precision.HIGHEST if a.dtype == _F32 else None
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                               precision=prec, preferred_element_type=_F32)


def _row_terms(st: "_Static", refs: Refs, load_qg, load_rand, transposed: bool = False):
    """Per-row pattern terms of a q tile: (q_glob ``[bq, 1]`` or None, random starts: list of ``[bq, 1]``);
    ``[1, bq]`` each when ``transposed`` (the dk/dv kernel's ``[bk, bq]`` tiles)."""
    col = (lambda x: x[None, :]) if transposed else (lambda x: x[:, None])
    q_glob = None if refs.q_glob is None else col(load_qg())
    rand = [] if refs.rand is None else [col(load_rand(t)) for t in range(st.mask.num_random)]
    return q_glob, rand


def _mask_and_logits(st: "_Static", qk, q_pos, k_pos, *, loaded, static_mask: bool, check_kv_len: bool,
                     pattern=None):
    """Masked logits of a tile and d logits / d qk. ``loaded``: (ALiBi slope, q segment, kv segment, kv
    length) as loaded, or None each; ``static_mask=False`` (a tile the band covers wholly) applies only the
    segments and the length."""
    slope, q_seg, kv_seg, kv_length = loaded
    s, dscale = st.logits.tile(qk, q_pos, k_pos, slope)
    if static_mask:
        allowed = st.mask.allowed(q_pos, k_pos, q_segment=q_seg, kv_segment=kv_seg, kv_length=kv_length,
                                  check_kv_len=check_kv_len, pattern=pattern)
    else:
        allowed = KernelMask(st.mask.q_len, st.mask.kv_len).allowed(
            q_pos, k_pos, q_segment=q_seg, kv_segment=kv_seg, kv_length=kv_length, check_kv_len=False)
    return tiles.mask_logits(s, allowed), dscale


def _kv_loop(sched: BlockSchedule, qi, body, lst_ref=None):
    """Run ``body(j, carry, static_mask)`` over the live kv blocks of q block ``qi``.

    With a tile list (``lst_ref [W]``: count, then blocks) exactly the listed blocks, masked.
    Else three runs: masked edge, the blocks causal/window leave whole (``static_mask=False``), masked edge.
    """
    if lst_ref is not None:
        def listed(carry):
            return jax.lax.fori_loop(0, lst_ref[0], lambda t, c: body(lst_ref[1 + t], c, static_mask=True), carry)

        return listed
    lo, hi = sched.kv_range(qi)

    def run(a, b, static_mask, carry):
        return jax.lax.fori_loop(a, b, functools.partial(body, static_mask=static_mask), carry)

    def loops(carry):
        ulo, uhi = sched.kv_full_range(qi)
        a = jnp.clip(ulo, lo, hi)
        b = jnp.clip(uhi, a, hi)
        carry = run(lo, a, True, carry)
        carry = run(a, b, False, carry)
        return run(b, hi, True, carry)

    return loops


# --------------------------------------------------------------------------- forward


def _fwd_kernel(q_ref, k_ref, v_ref, refs: Refs, o_ref, lse_ref, *, st: _Static, bq: int, bk: int,
                check_kv_len: bool):
    m = st.mask
    qi = pl.program_id(2)
    q = q_ref[...]
    q_pos = (qi * bq + m.q_offset + _iota(bq))[:, None]
    q_seg = None if refs.q_seg is None else refs.q_seg[...][:, None]
    kv_length = None if refs.lengths is None else refs.lengths[0]
    slope = None if refs.slopes is None else refs.slopes[0]
    q_glob, rand = _row_terms(st, refs, lambda: refs.q_glob[...], lambda t: refs.rand[t, :])

    def body(j, carry, static_mask):
        acc, m_run, l = carry
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        k_pos = (start + _iota(bk))[None, :]
        kv_seg = None if refs.kv_seg is None else refs.kv_seg[pl.ds(start, bk)][None, :]
        kv_glob = None if refs.kv_glob is None else refs.kv_glob[pl.ds(start, bk)][None, :]
        pattern = tiles.pattern_terms(k_pos, q_glob=q_glob, kv_glob=kv_glob, rand_starts=rand,
                                      rand_size=m.random_block_size)
        s, _ = _mask_and_logits(st, _dot(q, k, (1, 1)), q_pos, k_pos, loaded=(slope, q_seg, kv_seg, kv_length),
                                static_mask=static_mask, check_kv_len=check_kv_len, pattern=pattern)
        m_new = jnp.maximum(m_run, jnp.max(s, axis=1))
        m_safe = tiles.safe_max(m_new)
        alpha = jnp.exp(m_run - m_safe)
        pr = jnp.exp(s - m_safe[:, None])
        l = alpha * l + jnp.sum(pr, axis=1)
        acc = acc * alpha[:, None] + _dot(pr.astype(v.dtype), v, (1, 0))
        return acc, m_new, l

    init = (jnp.zeros((bq, q.shape[1]), _F32), jnp.full((bq,), -jnp.inf, _F32), jnp.zeros((bq,), _F32))
    acc, m_run, l = _kv_loop(st.schedule(bq, bk), qi, body, refs.tiles)(init)
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = tiles.finalize_lse(m_run, l)


def _row_specs(ops: Operands, tile_list, bq: int, Sp: int, slope_block: int = 1) -> Refs:
    """BlockSpecs of the optional operands of the grid ``(B, N, Tp/bq)`` kernels (forward, dq)."""
    spec = _spec_if
    return Refs(
        q_seg=spec(ops.q_seg, (None, bq), lambda b, n, i: (b, i)),
        kv_seg=spec(ops.kv_seg, (None, Sp), lambda b, n, i: (b, 0)),
        lengths=spec(ops.lengths, (None, 1), lambda b, n, i: (b, 0)),
        slopes=spec(ops.slopes, (None, slope_block), lambda b, n, i: (b, n)),
        tiles=None if tile_list is None else pl.BlockSpec((None, None, tile_list.shape[2]), lambda b, n, i: (n, i, 0)),
        q_glob=spec(ops.q_glob, (None, bq), lambda b, n, i: (b, i)),
        kv_glob=spec(ops.kv_glob, (None, Sp), lambda b, n, i: (b, 0)),
        rand=None if ops.rand is None else pl.BlockSpec((None, ops.rand.shape[1], bq), lambda b, n, i: (n, 0, i)),
    )


def _spec_if(x, block_shape, index_map):
    """A BlockSpec when the operand is there, else None (no operand, no spec)."""
    return None if x is None else pl.BlockSpec(block_shape, index_map)


def _compiler_params(launch: tuple[int, int]):
    return plgpu.CompilerParams(num_warps=launch[0], num_stages=launch[1])


def _fwd_call(q, k, v, ops: Operands, st: _Static):
    B, Tp, N, Hp = q.shape
    Sp, K = k.shape[1], k.shape[2]
    G = N // K
    bq, bk = st.blocks.block_q, st.blocks.block_k
    kernel = functools.partial(_fwd_kernel, st=st, bq=bq, bk=bk, check_kv_len=Sp != st.mask.kv_len)
    return pl.pallas_call(
        kernel,
        grid=(B, N, Tp // bq),
        in_specs=[
            pl.BlockSpec((None, bq, None, Hp), lambda b, n, i: (b, i, n, 0)),
            pl.BlockSpec((None, Sp, None, Hp), lambda b, n, i: (b, 0, n // G, 0)),
            pl.BlockSpec((None, Sp, None, Hp), lambda b, n, i: (b, 0, n // G, 0)),
            _row_specs(ops, ops.fwd_list, bq, Sp),
        ],
        out_specs=[
            pl.BlockSpec((None, bq, None, Hp), lambda b, n, i: (b, i, n, 0)),
            pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, N, Tp), _F32)],
        compiler_params=_compiler_params(st.launch[0]),
        interpret=st.interpret,
        name="flash_attention_fwd",
    )(q, k, v, ops.refs(ops.fwd_list))


# --------------------------------------------------------------------------- backward: dq


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, refs: Refs, dq_ref, *, st: _Static, bq: int,
               bk: int, check_kv_len: bool):
    m = st.mask
    qi = pl.program_id(2)
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...][:, None]
    delta = delta_ref[...][:, None]
    q_pos = (qi * bq + m.q_offset + _iota(bq))[:, None]
    q_seg = None if refs.q_seg is None else refs.q_seg[...][:, None]
    kv_length = None if refs.lengths is None else refs.lengths[0]
    slope = None if refs.slopes is None else refs.slopes[0]
    q_glob, rand = _row_terms(st, refs, lambda: refs.q_glob[...], lambda t: refs.rand[t, :])

    def body(j, dq, static_mask):
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        k_pos = (start + _iota(bk))[None, :]
        kv_seg = None if refs.kv_seg is None else refs.kv_seg[pl.ds(start, bk)][None, :]
        kv_glob = None if refs.kv_glob is None else refs.kv_glob[pl.ds(start, bk)][None, :]
        pattern = tiles.pattern_terms(k_pos, q_glob=q_glob, kv_glob=kv_glob, rand_starts=rand,
                                      rand_size=m.random_block_size)
        s, dscale = _mask_and_logits(st, _dot(q, k, (1, 1)), q_pos, k_pos,
                                     loaded=(slope, q_seg, kv_seg, kv_length), static_mask=static_mask,
                                     check_kv_len=check_kv_len, pattern=pattern)
        pr = jnp.exp(s - lse)
        ds = pr * (_dot(do, v, (1, 1)) - delta) * dscale
        return dq + _dot(ds.astype(k.dtype), k, (1, 0))

    dq = _kv_loop(st.schedule(bq, bk), qi, body, refs.tiles)(jnp.zeros(q.shape, _F32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dq_call(q, k, v, do, lse, delta, ops: Operands, st: _Static):
    B, Tp, N, Hp = q.shape
    Sp, K = k.shape[1], k.shape[2]
    G = N // K
    bq, bk = st.blocks.block_q_dq, st.blocks.block_k_dq
    q_spec = pl.BlockSpec((None, bq, None, Hp), lambda b, n, i: (b, i, n, 0))
    kv_spec = pl.BlockSpec((None, Sp, None, Hp), lambda b, n, i: (b, 0, n // G, 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i))
    kernel = functools.partial(_dq_kernel, st=st, bq=bq, bk=bk, check_kv_len=Sp != st.mask.kv_len)
    return pl.pallas_call(
        kernel,
        grid=(B, N, Tp // bq),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, _row_specs(ops, ops.dq_list, bq, Sp)],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(st.launch[1]),
        interpret=st.interpret,
        name="flash_attention_dq",
    )(q, k, v, do, lse, delta, ops.refs(ops.dq_list))


# --------------------------------------------------------------------------- backward: dk, dv


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, refs: Refs, dk_ref, dv_ref, *, st: _Static,
                bq: int, bk: int, G: int, check_kv_len: bool):
    """dk, dv of one kv block, its tiles transposed (``[bk, bq]``: keys down, queries across).

    ``sT = k qT``, ``dv += pT do``, ``dpT = v doT``, ``dk += dsT q``: every dot takes its register
    operand as it was computed, so no ``[bq, bk]`` tile is transposed in registers (that costs a trip
    through shared memory and, on sm_80/sm_90, the registers that made this kernel spill).
    """
    m = st.mask
    kj = pl.program_id(2)
    k = k_ref[...]
    v = v_ref[...]
    k_pos = (kj * bk + _iota(bk))[:, None]
    kv_seg = None if refs.kv_seg is None else refs.kv_seg[...][:, None]
    kv_length = None if refs.lengths is None else refs.lengths[0]
    kv_glob = None if refs.kv_glob is None else refs.kv_glob[...][:, None]
    if refs.tiles is None:
        lo, hi = st.schedule(bq, bk).q_range(kj)

    def head(g, carry):
        slope = None if refs.slopes is None else refs.slopes[g]

        def body(i, carry):
            dk, dv = carry
            start = pl.multiple_of(i * bq, bq)
            q = q_ref[pl.ds(start, bq), g, :]
            do = do_ref[pl.ds(start, bq), g, :]
            lse = lse_ref[g, pl.ds(start, bq)][None, :]
            delta = delta_ref[g, pl.ds(start, bq)][None, :]
            q_pos = (start + m.q_offset + _iota(bq))[None, :]
            q_seg = None if refs.q_seg is None else refs.q_seg[pl.ds(start, bq)][None, :]
            q_glob, rand = _row_terms(st, refs, lambda: refs.q_glob[pl.ds(start, bq)],
                                      lambda t: refs.rand[g, t, pl.ds(start, bq)], transposed=True)
            pattern = tiles.pattern_terms(k_pos, q_glob=q_glob, kv_glob=kv_glob, rand_starts=rand,
                                          rand_size=m.random_block_size)
            s, dscale = _mask_and_logits(st, _dot(k, q, (1, 1)), q_pos, k_pos,
                                         loaded=(slope, q_seg, kv_seg, kv_length), static_mask=True,
                                         check_kv_len=check_kv_len, pattern=pattern)
            pr = jnp.exp(s - lse)
            dv = dv + _dot(pr.astype(do.dtype), do, (1, 0))
            ds = pr * (_dot(v, do, (1, 1)) - delta) * dscale
            dk = dk + _dot(ds.astype(q.dtype), q, (1, 0))
            return dk, dv

        if refs.tiles is not None:
            return jax.lax.fori_loop(0, refs.tiles[g, 0], lambda t, c: body(refs.tiles[g, 1 + t], c), carry)
        return jax.lax.fori_loop(lo, hi, body, carry)

    zeros = jnp.zeros(k.shape, _F32)
    dk, dv = jax.lax.fori_loop(0, G, head, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dkv_call(q, k, v, do, lse, delta, ops: Operands, st: _Static):
    B, Tp, N, Hp = q.shape
    Sp, K = k.shape[1], k.shape[2]
    G = N // K
    bq, bk = st.blocks.block_q_dkv, st.blocks.block_k_dkv
    spec = _spec_if
    op_specs = Refs(
        q_seg=spec(ops.q_seg, (None, Tp), lambda b, h, j: (b, 0)),
        kv_seg=spec(ops.kv_seg, (None, bk), lambda b, h, j: (b, j)),
        lengths=spec(ops.lengths, (None, 1), lambda b, h, j: (b, 0)),
        slopes=spec(ops.slopes, (None, G), lambda b, h, j: (b, h)),
        tiles=spec(ops.dkv_list, (G, None, None if ops.dkv_list is None else ops.dkv_list.shape[2]),
                   lambda b, h, j: (h, j, 0)),
        q_glob=spec(ops.q_glob, (None, Tp), lambda b, h, j: (b, 0)),
        kv_glob=spec(ops.kv_glob, (None, bk), lambda b, h, j: (b, j)),
        rand=spec(ops.rand, (G, None if ops.rand is None else ops.rand.shape[1], Tp), lambda b, h, j: (h, 0, 0)),
    )
    q_spec = pl.BlockSpec((None, Tp, G, Hp), lambda b, h, j: (b, 0, h, 0))
    kv_spec = pl.BlockSpec((None, bk, None, Hp), lambda b, h, j: (b, j, h, 0))
    row_spec = pl.BlockSpec((None, G, Tp), lambda b, h, j: (b, h, 0))
    kernel = functools.partial(_dkv_kernel, st=st, bq=bq, bk=bk, G=G, check_kv_len=Sp != st.mask.kv_len)
    return pl.pallas_call(
        kernel,
        grid=(B, K, Sp // bk),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, op_specs],
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_compiler_params(st.launch[2]),
        interpret=st.interpret,
        name="flash_attention_dkv",
    )(q, k, v, do, lse, delta, ops.refs(ops.dkv_list))


# --------------------------------------------------------------------------- wrapper + custom_vjp


def _padded_sizes(st: _Static) -> tuple[int, int, int]:
    b = st.blocks
    Tp = round_up(st.mask.q_len, max(b.block_q, b.block_q_dq, b.block_q_dkv))
    Sp = round_up(st.mask.kv_len, max(b.block_k, b.block_k_dq, b.block_k_dkv))
    Hp = max(MIN_BLOCK, next_pow2(st.H))
    return Tp, Sp, Hp


def _pad_all(q, k, v, ops: Operands, st: _Static):
    Tp, Sp, Hp = _padded_sizes(st)
    q = pad_axis(pad_axis(q, 1, Tp), 3, Hp)
    k = pad_axis(pad_axis(k, 1, Sp), 3, Hp)
    v = pad_axis(pad_axis(v, 1, Sp), 3, Hp)
    ops = ops._replace(q_seg=pad_axis(ops.q_seg, 1, Tp), kv_seg=pad_axis(ops.kv_seg, 1, Sp))
    return q, k, v, ops


def _forward(q, k, v, ops: Operands, st: _Static):
    T, H = q.shape[1], q.shape[3]
    o, lse = _fwd_call(*_pad_all(q, k, v, ops, st), st)
    return o[:, :T, :, :H], lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, ops: Operands, st: _Static):
    return _forward(q, k, v, ops, st)[0]


def _flash_fwd(q, k, v, ops, st):
    o, lse = _forward(q, k, v, ops, st)
    return o, (q, k, v, ops, o, lse)


def _flash_bwd(st, res, do):
    q, k, v, ops, o, lse = res
    T, S, H = q.shape[1], k.shape[1], q.shape[3]
    Tp, _, Hp = _padded_sizes(st)
    # Padding rows see keys the forward pass never visited; an infinite lse makes their p exactly 0
    # (a finite one can overflow exp(s - lse) to inf, and inf * 0 = NaN in dk, dv).
    lse = jnp.where(jax.lax.broadcasted_iota(jnp.int32, lse.shape, 2) < T, lse, tiles.EMPTY_ROW_LSE)
    delta = jnp.einsum("BTNH,BTNH->BNT", do.astype(_F32), o.astype(_F32))
    delta = pad_axis(delta, 2, Tp)
    do = pad_axis(pad_axis(do.astype(q.dtype), 1, Tp), 3, Hp)
    qp, kp, vp, opsp = _pad_all(q, k, v, ops, st)
    dq = _dq_call(qp, kp, vp, do, lse, delta, opsp, st)
    dk, dv = _dkv_call(qp, kp, vp, do, lse, delta, opsp, st)
    no_grad = Operands(*(None for _ in ops))
    return dq[:, :T, :, :H], dk[:, :S, :, :H], dv[:, :S, :, :H], no_grad


_flash.defvjp(_flash_fwd, _flash_bwd)


def attend(q, k, v, mask: KernelMask, logits: Logits, block_sizes: BlockSizes | None = None,
           interpret: bool = False):
    """Differentiable FlashAttention on the Pallas Triton backend (``interpret=True`` runs it on CPU).

    ``mask`` and ``logits`` as ``flash_attention`` checked them (``checks.check_mask`` /
    ``check_logits``); slopes and ids get zero cotangents.
    """
    B, _, N, H = q.shape
    Hp = max(MIN_BLOCK, next_pow2(H))
    itemsize = jnp.dtype(q.dtype).itemsize
    if block_sizes is None:  # the table's tiles with its warps and stages, for the device read at trace time
        arch = block_table.gpu_arch()
        block_sizes = table_block_sizes(Hp, q.dtype, arch)
        launch = tuple((c.num_warps, c.num_stages) for c in
                       (block_table.lookup(kernel, Hp, q.dtype, arch) for kernel in ("fwd", "dq", "dkv")))
    else:  # a caller's tiles: the generic launch (the table's stages were sized for the table's tiles)
        launch = ((4 if Hp <= 64 else 8, 2),) * 3
    blocks = check_block_sizes(block_sizes, pow2=True, minimum=MIN_BLOCK, H=Hp, itemsize=itemsize,
                               max_tile_bytes=MAX_TILE_BYTES).clipped(mask.q_len, mask.kv_len, MIN_BLOCK)
    st = _Static(mask=mask.static(), logits=logits.static(), blocks=blocks, interpret=bool(interpret), H=H,
                 launch=launch)
    ops = Operands(
        q_seg=mask.q_segment_ids,
        kv_seg=mask.kv_segment_ids,
        lengths=None if mask.kv_lengths is None else mask.kv_lengths.reshape(B, 1),
        slopes=None if logits.alibi_slopes is None else jnp.broadcast_to(logits.alibi_slopes, (B, N)),
    )
    if mask.block_map is not None:
        ops = ops._replace(**_pattern_operands(st, mask, B, N))
    return _flash(q, k, v, ops, st)


def table_block_sizes(head_dim: int, dtype, arch: str | None = None) -> BlockSizes:
    """The forward, dq and dk/dv tiles of :mod:`pallas_kernels.block_table` for a padded ``head_dim``,
    ``dtype`` and ``arch`` (default: this machine's GPU, sm90 without one)."""
    fwd, dq, dkv = (block_table.lookup(kernel, head_dim, dtype, arch) for kernel in ("fwd", "dq", "dkv"))
    return BlockSizes(block_q=fwd.block_q, block_k=fwd.block_k, block_q_dkv=dkv.block_q, block_k_dkv=dkv.block_k,
                      block_q_dq=dq.block_q, block_k_dq=dq.block_k)


def _tile_lists(st: _Static, N: int, bq: int, bk: int, rows: int, transpose: bool):
    """Int32 ``[N, rows, W]``: per row of tiles its count, then its listed blocks (W a power of two)."""
    live = st.schedule(bq, bk).live(N)
    if transpose:
        live = live.transpose(0, 2, 1)
    idx, cnt = block_lists(live)
    nh, nr, w = idx.shape
    out = np.zeros((nh, rows, next_pow2(1 + w)), np.int32)
    out[:, :nr, 0] = cnt
    out[:, :nr, 1:] = idx[..., -1:]
    out[:, :nr, 1:1 + w] = idx
    return jnp.asarray(np.broadcast_to(out, (N,) + out.shape[1:]))


def _pattern_operands(st: _Static, mask: KernelMask, B: int, N: int):
    """Padded int32 operands of the block-sparse path (see :class:`Operands`)."""
    Tp, Sp, _ = _padded_sizes(st)
    b = st.blocks
    ops = dict(
        fwd_list=_tile_lists(st, N, b.block_q, b.block_k, Tp // b.block_q, False),
        dq_list=_tile_lists(st, N, b.block_q_dq, b.block_k_dq, Tp // b.block_q_dq, False),
        dkv_list=_tile_lists(st, N, b.block_q_dkv, b.block_k_dkv, Sp // b.block_k_dkv, True),
    )
    for name, x, n in (("q_glob", mask.q_global, Tp), ("kv_glob", mask.kv_global, Sp)):
        if x is not None:
            x = jnp.broadcast_to(x, (B, jnp.shape(x)[1]))
            ops[name] = pad_axis(x, 1, n)
    if mask.random_kv_starts is not None:
        r = mask.random_kv_starts
        r = jnp.broadcast_to(r, (N,) + r.shape[1:])
        rp = next_pow2(r.shape[1])
        ops["rand"] = jnp.pad(r, ((0, 0), (0, rp - r.shape[1]), (0, Tp - r.shape[2])), constant_values=-1)
    return ops
