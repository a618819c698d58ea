"""The Mosaic (TPU) flash kernels on Longformer / BigBird masks (block-sparse lists), TPU interpret mode.

Kernel operands come from ``jaxformer.ops.flash.pattern_operands`` (what
``dot_product_attention(impl="pallas")`` passes); forward, dq, dk and dv are
compared with the dense reference ``xla_attention`` under the same ``MaskSpec``
(``dense_heads``), and the blocks the interpreter copies into VMEM are checked
against ``MaskSpec.block_map``.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from jaxformer.ops.attention import xla_attention
from jaxformer.ops.flash import pattern_operands
from jaxformer.ops.masks import MaskSpec, RandomBlocks
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

# fp32: kernel and reference differ only in summation order (values O(1)).
TOL_F32 = dict(atol=2e-5, rtol=2e-5)


def _run(spec, q, k, v, ct, block_sizes, recorder=None, **logit_kw):
    """(out, dq, dk, dv) of the kernel in TPU interpret mode, and of the dense reference."""
    T, S = q.shape[1], k.shape[1]
    ops = pattern_operands(spec, T, S)
    kernel_kw = dict(causal=spec.causal, window=spec.window, kv_lengths=spec.kv_lengths,
                     q_segment_ids=spec.q_segment_ids, kv_segment_ids=spec.resolved_kv_segment_ids(T, S),
                     q_offset=spec.static_offset(T, S), block_sizes=block_sizes, **ops, **logit_kw)

    params = pltpu.InterpretParams(**({} if recorder is None else dict(grid_point_recorder=recorder)))
    with pltpu.force_tpu_interpret_mode(params):
        got = jax.jit(fwd_bwd(lambda *a: flash_attention_tpu(*a, **kernel_kw)))(q, k, v, ct)
    want = jax.jit(fwd_bwd(lambda *a: xla_attention(*a, mask=spec, **logit_kw)))(q, k, v, ct)
    return got, want


def test_longformer_matches_dense_and_fetches_only_listed_blocks(monkeypatch):
    """Window + per-sequence global tokens + unequal kv lengths, T not a multiple of the block.

    Records every block the interpreter copies into VMEM: no kv block outside a q block's list
    (``MaskSpec.block_map``, independent of the kernel's list building) is fetched in forward or
    dq, no q block outside a kv block's column in dk/dv, and nothing at or past a sequence's
    kv length. Grid points: forward + dq walk ``max live per row`` steps, dk/dv ``max per column``.
    """
    fetched, points, record_point = record_tpu_interpreter(monkeypatch)
    B, T, S, N, K, H, b = 2, 37, 37, 1, 1, 8, 8
    lens = np.array([37, 21])
    spec = MaskSpec(window=(4, 4), global_tokens=[[0, 19], [3, -1]], kv_lengths=jnp.asarray(lens))
    live = spec.block_map(T, S, b, b)  # [5, 5]
    assert (~live).sum() >= 4  # the test needs dead blocks
    q, k, v, ct = attention_inputs(B, T, S, N, K, H, seed=11)
    got, want = _run(spec, q, k, v, ct, BlockSizes(b, b), recorder=record_point,
                     alibi_slopes=jnp.array([0.3]), softcap=4.0)
    assert_all_close(got, want, **TOL_F32)

    cut = -(-lens // b)  # kv blocks at or past a sequence's length are never needed
    kv_rows = collections.defaultdict(set)  # q block -> kv blocks copied (forward + dq)
    for point, block in fetched[(4, "k_ref")]:  # k; grid (b, n, q block, step), block (b, k, j, 0)
        assert block[2] < cut[block[0]], (point, block)
        kv_rows[point[2]].add(block[2])
    q_cols = collections.defaultdict(set)  # kv block -> q blocks copied (dk/dv)
    for point, block in fetched[(5, "q_ref")]:  # q; grid (b, h, kv block, g, step)
        q_cols[point[2]].add(block[2])
    assert kv_rows and q_cols
    for r, blocks in kv_rows.items():
        assert blocks <= set(np.flatnonzero(live[r])), (r, blocks)
    for c, blocks in q_cols.items():
        assert blocks <= set(np.flatnonzero(live[:, c])), (c, blocks)
    nq, nk = live.shape
    assert points[4] == 2 * B * N * nq * live.sum(1).max()
    assert points[5] == B * K * nk * N // K * live.sum(0).max()


def test_bigbird_per_head_random_blocks_gqa_cross_lengths():
    """BigBird: window + a global token + per-head random blocks (block 8) under GQA, T != S
    (bottom-right offset), with dq/dkv tiles unlike the random block size."""
    B, T, S, N, K, H = 1, 24, 32, 2, 1, 8
    spec = MaskSpec(window=(3, 3), global_tokens=[2],
                    random_blocks=RandomBlocks(num_blocks=2, block_size=8, seed=5, num_heads=N))
    per_head = np.asarray(spec.dense_heads(T, S))[0]
    assert (per_head[0] != per_head[1]).any()  # heads really differ
    q, k, v, ct = attention_inputs(B, T, S, N, K, H, seed=12)
    got, want = _run(spec, q, k, v, ct,
                     BlockSizes(8, 8, block_q_dkv=16, block_k_dkv=8, block_q_dq=8, block_k_dq=16))
    assert_all_close(got, want, **TOL_F32)


@pytest.mark.slow
@settings(max_examples=12)
@given(data=st.data())
def test_hypothesis_patterns(data):
    """Drawn windows, global positions (shared or per sequence), random seeds and heads, causal,
    offsets, segments, lengths that are not block multiples and per-sequence kv lengths."""
    T = data.draw(st.sampled_from([9, 16, 23]), "T")
    S = data.draw(st.sampled_from([16, 21, 30]), "S")
    B, (N, K), H = 2, data.draw(st.sampled_from([(1, 1), (2, 1)]), "heads"), 8
    kw = dict(causal=data.draw(st.booleans(), "causal"),
              window=data.draw(st.sampled_from([(2, 2), (5, 0), (0, 7), (3, None)]), "window"),
              q_offset=data.draw(st.sampled_from([None, 0, 2]), "q_offset"))
    if data.draw(st.booleans(), "globals"):
        g = data.draw(st.lists(st.integers(0, S - 1), min_size=1, max_size=3), "global_tokens")
        kw["global_tokens"] = [g, g[:1] + [-1] * (len(g) - 1)] if data.draw(st.booleans(), "per_seq") else g
    if data.draw(st.booleans(), "random"):
        kw["random_blocks"] = RandomBlocks(num_blocks=data.draw(st.integers(1, 2), "r"), block_size=8,
                                           seed=data.draw(st.integers(0, 99), "seed"),
                                           num_heads=data.draw(st.sampled_from([None, N]), "rand_heads"))
    if data.draw(st.booleans(), "segments"):
        kw["q_segment_ids"] = sorted_segments(B, T, 2, T + S)
        kw["kv_segment_ids"] = sorted_segments(B, S, 2, T + S + 1)
    if data.draw(st.booleans(), "lengths"):
        kw["kv_lengths"] = jnp.array([S, data.draw(st.integers(0, S), "kv_length")])
    spec = MaskSpec(**kw)
    bq, bk = data.draw(st.sampled_from([(8, 8), (16, 8), (8, 16)]), "blocks")
    q, k, v, ct = attention_inputs(B, T, S, N, K, H, seed=T * 100 + S)
    got, want = _run(spec, q, k, v, ct, BlockSizes(bq, bk))
    assert_all_close(got, want, **TOL_F32)


@pytest.mark.parametrize("kwargs, match", [
    (dict(q_global=np.zeros((1, 8), bool)), r"need a block_map"),
    (dict(block_map=lambda bq, bk: np.ones((1, 3, 1), bool)), r"block_map\(8, 8\).shape=\(1, 3, 1\)"),
    (dict(block_map=lambda bq, bk: np.ones((1, 1, 1), bool), random_kv_starts=np.zeros((3, 1, 8), np.int32),
          random_block_size=8), r"random_kv_starts.shape=\(3, 1, 8\)"),
])
@pytest.mark.no_typecheck
def test_bad_pattern_operands_raise_value_error(kwargs, match):
    q = jnp.zeros((1, 8, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match=match):
        flash_attention_tpu(q, q, q, **kwargs)


def test_pattern_lowers_to_mosaic_for_tpu():
    """Export forward+backward with a per-head BigBird pattern for the TPU platform: the real Mosaic
    lowering (SMEM lists, pattern blocks) runs on CPU with TPU-sized tiles."""
    B, T, S, N, K, H = 1, 512, 512, 2, 1, 128
    spec = MaskSpec(causal=True, window=(128, 0), global_tokens=[0, 300],
                    random_blocks=RandomBlocks(num_blocks=2, block_size=128, seed=1, num_heads=N))
    kw = dict(causal=True, window=spec.window, block_sizes=BlockSizes(128, 128), **pattern_operands(spec, T, S))
    assert mosaic_custom_calls((B, T, N, H), (B, S, K, H), kw) == 3
