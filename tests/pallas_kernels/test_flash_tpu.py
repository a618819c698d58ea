"""The Mosaic (TPU) FlashAttention kernels, run on CPU in TPU interpret mode.

Every kernel result (forward, dq, dk, dv) is compared with the dense reference
``jaxformer.ops.attention.xla_attention`` under ``MaskSpec.dense()`` in fp32.
Interpret mode is slow (~seconds per compiled config), so shapes are tiny,
blocks are 8/16, and features are combined per case.
"""

import collections
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from jaxformer.ops.attention import xla_attention
from jaxformer.ops.masks import MaskSpec
from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.flash_attention.blocks import BlockSizes
from pallas_kernels.flash_attention.api import flash_attention_tpu
from tests.attention_helpers import (
    assert_all_close,
    attention_inputs,
    fwd_bwd,
    mosaic_custom_calls,
    sorted_segments,
)
from tests.pallas_kernels.tpu_recording import record_tpu_interpreter

# fp32: kernel and reference differ only in summation order.
TOL_F32 = dict(atol=2e-5, rtol=2e-5)
# bf16 / fp16 vs the fp32 reference on the same rounded inputs: outputs and grads are rounded to
# the input dtype (eps 2^-8 / 2^-11) and the bf16 kernel also rounds p and dS to bf16 before its
# matmuls; values here are O(1) and the observed errors ~8e-3 (bf16) and ~3e-4 (fp16).
TOL = {jnp.float32: TOL_F32, jnp.bfloat16: dict(atol=2e-2, rtol=2e-2), jnp.float16: dict(atol=2e-3, rtol=2e-3)}


def _kernel_and_ref(q, k, v, ct, *, block_sizes, via_api=False, **kw):
    """(out, dq, dk, dv) of the kernel (in TPU interpret mode) and of the fp32 dense reference.

    ``via_api``: call ``flash_attention(backend="tpu", interpret=True)`` instead of forcing
    interpret mode around ``flash_attention_tpu``.
    """
    mask_kw = {n: kw.get(n) for n in ("causal", "window", "q_segment_ids", "kv_segment_ids",
                                      "kv_lengths", "q_offset")}
    mask_kw["causal"] = bool(mask_kw["causal"])
    spec = MaskSpec(**mask_kw)
    logit_kw = {n: kw.get(n) for n in ("alibi_slopes", "softcap", "scale")}

    def ref(q, k, v):
        return xla_attention(q, k, v, mask=spec, **logit_kw)

    def ker(q, k, v):
        if via_api:
            return flash_attention(q, k, v, block_sizes=block_sizes, backend="tpu", interpret=True,
                                   **kw).astype(jnp.float32)
        return flash_attention_tpu(q, k, v, block_sizes=block_sizes, **kw).astype(jnp.float32)

    f32 = [x.astype(jnp.float32) for x in (q, k, v, ct)]
    with contextlib.nullcontext() if via_api else pltpu.force_tpu_interpret_mode():
        got = jax.jit(fwd_bwd(ker))(q, k, v, f32[3])
    want = jax.jit(fwd_bwd(ref))(*f32)
    return got, want


# --------------------------------------------------------------------------- parity


CASES = {
    # name: (B, T, S, N, K, H, dtype, block sizes, kwargs builder); tiny grids keep interpret mode fast.
    # The fp16 case goes through the public flash_attention(backend="tpu", interpret=True) with the
    # default block sizes (clipped to the lengths).
    "causal_gqa_segments_lens_alibi_softcap": (
        2, 13, 19, 4, 2, 16, jnp.float32, BlockSizes(16, 8),
        lambda B, T, S, N: dict(causal=True, q_segment_ids=sorted_segments(B, T, 2, 0),
                                kv_segment_ids=sorted_segments(B, S, 2, 1), kv_lengths=jnp.array([19, 11]),
                                alibi_slopes=jnp.linspace(0.05, 0.4, N), softcap=3.0)),
    "window_mqa_offset_mixed_blocks": (
        1, 13, 30, 2, 1, 8, jnp.float32,
        BlockSizes(8, 8, block_q_dkv=16, block_k_dkv=8, block_q_dq=8, block_k_dq=16),
        lambda B, T, S, N: dict(window=(5, 3), q_offset=7, scale=0.3)),
    "bf16_causal_bottom_right_window_alibi": (
        1, 12, 21, 2, 1, 16, jnp.bfloat16, BlockSizes(8, 8),
        lambda B, T, S, N: dict(causal=True, window=(9, None), alibi_slopes=jnp.full((B, N), 0.2))),
    "fp16_lens_softcap_default_blocks": (
        1, 9, 17, 1, 1, 8, jnp.float16, None,
        lambda B, T, S, N: dict(kv_lengths=jnp.array([13]), softcap=2.0)),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.fp16) if n.startswith("fp16") else n
                                  for n in CASES])
def test_matches_dense_reference(name):
    B, T, S, N, K, H, dtype, bs, make_kw = CASES[name]
    q, k, v, ct = attention_inputs(B, T, S, N, K, H, dtype, seed=len(name))
    got, want = _kernel_and_ref(q, k, v, ct, block_sizes=bs, via_api=name.startswith("fp16"),
                                **make_kw(B, T, S, N))
    assert got[0].shape == (B, T, N, H)
    assert_all_close(got, want, **TOL[dtype])


def test_fully_masked_rows_give_zero_output_and_zero_grads():
    B, T, S, N, K, H = 2, 16, 16, 1, 1, 8
    q, k, v, ct = attention_inputs(B, T, S, N, K, H, seed=7)
    # batch 0: rows 6-7 (segment 1's keys are all in their future) and 12-15 (segment 5 has no keys)
    # see nothing; batch 1: every key is padding.
    q_seg = jnp.array([[0] * 6 + [1] * 6 + [5] * 4, [0] * 16], jnp.int32)
    kv_seg = jnp.array([[0] * 8 + [1] * 8, [0] * 16], jnp.int32)
    kw = dict(causal=True, q_segment_ids=q_seg, kv_segment_ids=kv_seg, kv_lengths=jnp.array([16, 0]),
              softcap=4.0)
    got, want = _kernel_and_ref(q, k, v, ct, block_sizes=BlockSizes(8, 8), **kw)
    out, dq, dk, dv = (np.asarray(x) for x in got)
    for x in (out, dq):
        assert (x[0, 6:8] == 0).all() and (x[0, 12:] == 0).all() and (x[1] == 0).all()
    assert (np.abs(out[0, :6]).sum(-1) > 0).all()
    assert (dk[1] == 0).all() and (dv[1] == 0).all()
    assert_all_close(got, want, **TOL_F32)


def test_padding_rows_never_reach_dk_dv():
    """T = 17 pads to 32 rows for the dk/dv tiles; padding rows see keys 24..31 that the forward
    pass never visited for them, and a steep slope would overflow exp(s - lse) there."""
    q, k, v, ct = attention_inputs(1, 17, 32, 1, 1, 8, seed=5)
    got, want = _kernel_and_ref(q, k, v, ct, block_sizes=BlockSizes(8, 8, block_q_dkv=32, block_k_dkv=32),
                                causal=True, q_offset=0, alibi_slopes=jnp.array([16.0]))
    assert_all_close(got, want, **TOL_F32)


# slow (2.7 s): 1 drawn example (hypothesis's simplest: one query, one key, no mask feature), which runs the Mosaic
# kernel in TPU interpret mode. Every feature is pinned by CASES above, default-run (causal, windows, offsets,
# segments, lengths, ALiBi, softcap, GQA, bf16, fp16), as are fully masked rows, padding rows and dead blocks;
# the slow test below draws 30.
@pytest.mark.slow
@settings(max_examples=1)
@given(data=st.data())
def test_hypothesis_shapes_and_masks(data):
    _check_drawn(data)


@pytest.mark.slow
@settings(max_examples=30)
@given(data=st.data())
def test_hypothesis_shapes_and_masks_many(data):
    _check_drawn(data)


def _check_drawn(data):
    T = data.draw(st.sampled_from([1, 7, 16, 21]), "T")
    S = data.draw(st.sampled_from([1, 5, 16, 29]), "S")
    N, K = data.draw(st.sampled_from([(1, 1), (2, 1)]), "heads")
    B, H = 1, 8
    kw = dict(causal=data.draw(st.booleans(), "causal"))
    kw["window"] = data.draw(st.sampled_from([None, (3, None), (None, 2), (4, 6)]), "window")
    kw["q_offset"] = data.draw(st.sampled_from([None, 0, 3, -2]), "q_offset")
    if data.draw(st.booleans(), "segments"):
        kw["q_segment_ids"] = sorted_segments(B, T, 3, T)
        kw["kv_segment_ids"] = sorted_segments(B, S, 3, S + 1)
    if data.draw(st.booleans(), "kv_lengths"):
        kw["kv_lengths"] = jnp.array([data.draw(st.integers(0, S + 2), "kv_length")])
    if data.draw(st.booleans(), "alibi"):
        kw["alibi_slopes"] = jnp.linspace(0.1, 0.5, N)
    kw["softcap"] = data.draw(st.sampled_from([None, 2.5]), "softcap")
    bq, bk = data.draw(st.sampled_from([(8, 8), (16, 8), (8, 16)]), "blocks")
    q, k, v, ct = attention_inputs(B, T, S, N, K, H, seed=T * 100 + S)
    got, want = _kernel_and_ref(q, k, v, ct, block_sizes=BlockSizes(bq, bk), **kw)
    assert_all_close(got, want, **TOL_F32)


# --------------------------------------------------------------------------- block skipping


def test_dead_blocks_are_never_fetched(monkeypatch):
    """Record every block the TPU interpreter copies into VMEM and every grid point it runs:
    no dead block is ever fetched, each live one at most once per grid row and kernel, and the
    walked grid axis is as long as the longest live run. Dead blocks come from
    ``MaskSpec.block_map``, independent of the kernel's own range math."""
    fetched, points, record_point = record_tpu_interpreter(monkeypatch)
    B, T, S, N, K, H, bq, bk = 1, 32, 40, 1, 1, 8, 8, 8  # shapes no other test uses: a fresh trace
    mask = dict(causal=True, window=(12, None))  # dead blocks above the diagonal and left of the band
    spec = MaskSpec(**mask)
    live = spec.block_map(T, S, bq, bk)
    nq, nk = live.shape
    assert (~live[:, 0]).any() and (~live[:, -1]).any() and live.sum(1).max() < nk
    q, k, v, ct = attention_inputs(B, T, S, N, K, H, seed=3)

    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(grid_point_recorder=record_point)):
        got = jax.jit(fwd_bwd(lambda *a: flash_attention_tpu(*a, block_sizes=BlockSizes(bq, bk), **mask)))(q, k, v, ct)
    want = jax.jit(jax.grad(lambda *a: jnp.vdot(xla_attention(*a, mask=spec), ct), argnums=(0, 1, 2)))(q, k, v)
    assert_all_close(got[1:], want, **TOL_F32, names=("dq", "dk", "dv"))

    kv_rows = collections.defaultdict(collections.Counter)  # q block -> k blocks copied (forward + dq)
    for point, block in fetched[(4, "k_ref")]:  # k; grid (b, n, q block, step)
        kv_rows[point[2]][block[2]] += 1
    q_cols = collections.defaultdict(collections.Counter)  # kv block -> q blocks copied (dk/dv)
    for point, block in fetched[(5, "q_ref")]:  # q; grid (b, h, kv block, g, step)
        q_cols[point[2]][block[2]] += 1
    for rows, lv, kernels in ((kv_rows, live, 2), (q_cols, live.T, 1)):
        for r, copies in rows.items():
            want_blocks = set(np.flatnonzero(lv[r]))
            assert set(copies) <= want_blocks, (r, copies, want_blocks)
            assert max(copies.values()) <= kernels
            # the row's first live block may already sit in VMEM from the previous row
            assert sum(copies.values()) >= kernels * (len(want_blocks) - 1)
    longest_row, longest_col = live.sum(1).max(), live.sum(0).max()
    assert points[4] == 2 * nq * longest_row  # forward + dq
    assert points[5] == nk * longest_col


# --------------------------------------------------------------------------- Mosaic lowering


# "none" slow, 1.2 s: the default (512) blocks over padded lengths lower for the TPU platform in
# test_tpu_compile.py's test_mosaic_lowers_for_tpu (default-run: [flash_fwd_bwd], [flash_features] at T = 2000,
# [flash_sparse] without causal)
@pytest.mark.parametrize("features", ["all", pytest.param("none", marks=pytest.mark.slow)])
def test_lowers_to_mosaic_for_tpu(features):
    """Export forward+backward for the TPU platform: runs the real Mosaic lowering (block-shape
    rules, supported ops) on CPU, with TPU-sized tiles ("none": the default 512 blocks)."""
    B, T, S, N, K, H = 1, 200, 384, 4, 2, 128
    kw = dict(block_sizes=BlockSizes(128, 128, block_q_dkv=128, block_k_dkv=256))
    if features == "all":
        kw.update(causal=True, window=(100, None), q_segment_ids=jnp.zeros((B, T), jnp.int32),
                  kv_segment_ids=jnp.zeros((B, S), jnp.int32), kv_lengths=jnp.array([300]),
                  alibi_slopes=jnp.ones((N,)), softcap=5.0)
    else:
        T, S, kw = 1000, 1500, {}
    assert mosaic_custom_calls((B, T, N, H), (B, S, K, H), kw) == 3


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, shapes, match", [
    ({}, ((1, 8, 3, 8), (1, 8, 2, 8)), r"heads 3 not divisible by kv heads 2"),
    ({"block_sizes": BlockSizes(12, 8)}, None, r"block_q=12"),
    ({"block_sizes": BlockSizes(8, 4)}, None, r"block_k=4"),
    ({"block_sizes": BlockSizes(4096, 4096)}, None, r"block_q=4096, block_k=4096"),
    ({"q_segment_ids": jnp.zeros((1, 5), jnp.int32), "kv_segment_ids": jnp.zeros((1, 8), jnp.int32)},
     None, r"q_segment_ids.shape=\(1, 5\) must be \(B, T\)=\(1, 8\)"),
    ({"kv_lengths": jnp.zeros((2,), jnp.int32)}, None, r"kv_lengths.shape=\(2,\)"),
    ({"alibi_slopes": jnp.ones((3,))}, None, r"alibi_slopes.shape=\(3,\)"),
    ({"window": (2, -1)}, None, r"window"),
    ({}, ((1, 8, 2, 300), (1, 8, 2, 300)), r"head dim H=300"),
])
@pytest.mark.no_typecheck
def test_bad_input_raises_value_error(kwargs, shapes, match):
    qs, ks = shapes or ((1, 8, 2, 8), (1, 8, 2, 8))
    q, k = jnp.zeros(qs, jnp.float32), jnp.zeros(ks, jnp.float32)
    with pytest.raises(ValueError, match=match):
        flash_attention_tpu(q, k, k, **kwargs)
