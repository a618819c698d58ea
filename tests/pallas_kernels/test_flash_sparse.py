"""Block-sparse path of the Pallas GPU flash kernel (interpret mode): Longformer / BigBird masks.

Oracles: ``xla_attention`` under the same ``MaskSpec`` (dense ``[T, S]`` mask from
``MaskSpec.dense_heads``) and, for the tile-list test, a dense masked softmax
written here from the block map alone.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.ops import MaskSpec, xla_attention
from jaxformer.ops.attention import dot_product_attention
from jaxformer.ops.flash import pallas_attention
from jaxformer.ops.masks import RandomBlocks
from pallas_kernels.flash_attention import BlockSizes, flash_attention
from tests.attention_helpers import assert_close as _close
from tests.attention_helpers import attention_inputs as _inputs
from tests.attention_helpers import fwd_bwd

# fp32 throughout; kernel and oracle differ only in summation order (online softmax, block sums):
# 1e-5 forward, 1e-4 gradients, relative to max(1, max|want|).
TOL_FWD, TOL_GRAD = 1e-5, 1e-4
MIXED = BlockSizes(16, 32, block_q_dkv=32, block_k_dkv=16, block_q_dq=16, block_k_dq=32)
B16 = BlockSizes(16, 16, block_q_dkv=16, block_k_dkv=16, block_q_dq=16, block_k_dq=16)


CASES = {
    # Longformer, causal, per-sequence global tokens, padded keys; T = S = 45 (not a block multiple).
    "longformer_causal": (dict(B=2, T=45, S=45, N=2, K=1, H=16),
                          lambda: MaskSpec(causal=True, window=(4, 0), global_tokens=[[3, 30], [17, -1]],
                                           kv_lengths=jnp.array([45, 38]))),
    # BigBird, bidirectional, shared random blocks + global tokens; cross-length T=37 < S=100, offset 5.
    "bigbird_shared": (dict(B=1, T=37, S=100, N=2, K=2, H=8),
                       lambda: MaskSpec(window=(3, 3), global_tokens=[0, 20],
                                        random_blocks=RandomBlocks(2, 8, seed=4), q_offset=5)),
    # BigBird, per-head random blocks (R not a block multiple), GQA N=4, K=2.
    "bigbird_per_head": (dict(B=1, T=40, S=40, N=4, K=2, H=16),
                         lambda: MaskSpec(window=(2, 2), random_blocks=RandomBlocks(1, 5, seed=1, num_heads=4))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_patterns_match_xla(name):
    dims, make_mask = CASES[name]
    mask = make_mask()
    q, k, v, do = _inputs(dims["B"], dims["T"], dims["S"], dims["N"], dims["K"], dims["H"])
    live = mask.block_map(dims["T"], dims["S"], 16, 32, per_head=True)
    assert not live.all(), "the case must leave tiles out, or it tests nothing about skipping"
    got = jax.jit(fwd_bwd(lambda q, k, v: pallas_attention(q, k, v, mask=mask, block_sizes=MIXED)))(q, k, v, do)
    want = jax.jit(fwd_bwd(lambda q, k, v: xla_attention(q, k, v, mask=mask)))(q, k, v, do)
    for g, w, what, tol in zip(got, want, ("out", "dq", "dk", "dv"), (TOL_FWD, TOL_GRAD, TOL_GRAD, TOL_GRAD)):
        _close(g, w, tol, f"{name} {what}")


def test_dot_product_attention_routes_patterns_to_pallas():
    mask = MaskSpec(window=(1, 1), global_tokens=[2], random_blocks=RandomBlocks(1, 4, seed=0))
    q, k, v, do = _inputs(1, 20, 20, 2, 1, 8, seed=3)
    got = jax.jit(fwd_bwd(lambda q, k, v: dot_product_attention(q, k, v, mask=mask, impl="pallas")))(q, k, v, do)
    want = jax.jit(fwd_bwd(lambda q, k, v: dot_product_attention(q, k, v, mask=mask, impl="xla")))(q, k, v, do)
    for g, w, what, tol in zip(got, want, ("out", "dq", "dk", "dv"), (TOL_FWD, TOL_GRAD, TOL_GRAD, TOL_GRAD)):
        _close(g, w, tol, what)


def _dense_blocked(q, k, v, allowed):
    """Masked softmax attention, ``allowed`` bool [N, T, S]; fully masked rows give 0."""
    N, K = q.shape[2], k.shape[2]
    kr, vr = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
    s = jnp.einsum("BTNH,BSNH->BNTS", q, kr, precision="highest") / np.sqrt(q.shape[-1])
    ok = jnp.broadcast_to(allowed[None], s.shape)
    m = jax.lax.stop_gradient(jnp.max(jnp.where(ok, s, -jnp.inf), axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(ok, jnp.exp(jnp.where(ok, s - m, 0.0)), 0.0)  # exp never sees -inf
    z = jnp.sum(e, axis=-1, keepdims=True)
    return jnp.einsum("BNTS,BSNH->BTNH", e / jnp.where(z > 0, z, 1.0), vr, precision="highest")


def test_only_listed_tiles_are_visited():
    """A per-head tile map with no window: the kernel must attend exactly inside the listed 16x16 tiles.

    V (and K) of a kv block no head lists is NaN: any read of it would poison the output or the gradients.
    """
    T, S, N, K, H = 40, 64, 2, 1, 16
    rng = np.random.default_rng(7)
    live = rng.random((N, 3, 4)) < 0.5
    live[:, :, 2] = False  # keys 32..47: listed nowhere, poisoned below
    live[0, 1] = False  # q block 1 of head 0 sees nothing: zero output and gradients
    live[1, 0, 0] = True

    def block_map(bq, bk):
        assert (bq, bk) == (16, 16)
        return live

    allowed = np.kron(live, np.ones((16, 16), bool))[:, :T, :S]
    q, k, v, do = _inputs(1, T, S, N, K, H, seed=1)
    poison = jnp.zeros((1, S, K, H)).at[:, 32:48].set(jnp.nan)
    attn = lambda q, k, v: flash_attention(q, k, v, block_map=block_map, block_sizes=B16, interpret=True)
    got = jax.jit(fwd_bwd(attn))(q, k + poison, v + poison, do)
    want = jax.jit(fwd_bwd(lambda q, k, v: _dense_blocked(q, k, v, jnp.asarray(allowed))))(q, k, v, do)
    for g, w, what, tol in zip(got, want, ("out", "dq", "dk", "dv"), (TOL_FWD, TOL_GRAD, TOL_GRAD, TOL_GRAD)):
        _close(g, w, tol, what)
    assert not np.asarray(got[0])[0, 16:32, 0].any(), "an empty tile list must give zero rows"
    assert not np.asarray(got[3])[0, 32:48].any()


@pytest.mark.no_typecheck
def test_bad_pattern_operands_raise():
    q = k = v = jnp.zeros((1, 8, 2, 8))
    live = lambda bq, bk: np.ones((1, 1, 1), bool)
    with pytest.raises(ValueError, match="need a block_map"):
        flash_attention(q, k, v, window=(1, 1), kv_global=np.ones((1, 8), bool), interpret=True)
    with pytest.raises(ValueError, match=r"q_global.shape=\(1, 7\) must be \(1 or B, 8\)"):
        flash_attention(q, k, v, window=(1, 1), block_map=live, q_global=np.ones((1, 7), bool), interpret=True)
    with pytest.raises(ValueError, match=r"random_kv_starts.shape=\(3, 1, 8\) must be \(1 or N, r, T\)"):
        flash_attention(q, k, v, window=(1, 1), block_map=live, random_kv_starts=np.zeros((3, 1, 8), np.int32),
                        random_block_size=4, interpret=True)
    with pytest.raises(ValueError, match=r"block_map\(16, 16\).shape=\(1, 2, 2\) must be \(1 or N, 1, 1\)"):
        flash_attention(q, k, v, block_map=lambda bq, bk: np.ones((1, 2, 2), bool), interpret=True)
