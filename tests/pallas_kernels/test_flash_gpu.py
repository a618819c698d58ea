"""The Pallas GPU (Triton) FlashAttention kernel: forward and dq, dk, dv against two dense oracles.

Oracles: ``pallas_kernels.flash_attention.reference`` (plain einsum) and
``jaxformer.ops.xla_attention`` under ``MaskSpec.dense`` (the project's meaning).
``FlashGpuBase`` holds the tests; ``TestFlashGpuInterpret`` runs them on CPU in
Pallas interpret mode, ``TestFlashGpuDevice`` compiled on a GPU (skipped, with
the reason shown, elsewhere). Shapes are tiny and blocks 16/32 so interpret
mode stays fast.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from jaxformer.ops import MaskSpec, xla_attention
from pallas_kernels.flash_attention import BlockSizes, flash_attention, reference
from tests.attention_helpers import assert_close as _close
from tests.attention_helpers import attention_inputs as _inputs

# Tolerances, relative to max(1, max|want|):
#   fp32: kernel and oracles differ only in summation order (online softmax, block sums) -> 1e-5 forward,
#         1e-4 for gradients (sums over T or S of products).
#   bf16/fp16: p is rounded to the input dtype before p @ v, outputs are rounded -> 2e-2 (bf16 has 8 bits).
TOL = {jnp.float32: (1e-5, 1e-4), jnp.bfloat16: (2e-2, 4e-2), jnp.float16: (1e-2, 2e-2)}
SMALL = BlockSizes(16, 16)
MIXED = BlockSizes(16, 32, block_q_dkv=32, block_k_dkv=16, block_q_dq=16, block_k_dq=32)


def _spec(kw):
    return MaskSpec(causal=kw.get("causal", False), window=kw.get("window"), q_offset=kw.get("q_offset"),
                    q_segment_ids=kw.get("q_segment_ids"), kv_segment_ids=kw.get("kv_segment_ids"),
                    kv_lengths=kw.get("kv_lengths"))


class FlashGpuBase:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_device(self):
        if not self.INTERPRET and jax.default_backend() != "gpu":
            pytest.skip(f"compiled Triton kernels need a GPU; jax.default_backend()={jax.default_backend()!r}")
        with jax.default_matmul_precision("highest"):  # the dense oracles must not use TF32 on a GPU
            yield

    def run(self, shape, kw=None, *, dtype=jnp.float32, block_sizes=SMALL, seed=0):
        """Kernel vs both oracles, forward and (dq, dk, dv); returns the kernel's (o, grads)."""
        kw = dict(kw or {})
        q, k, v, do = _inputs(*shape, dtype, seed)
        mask_kw = {n: kw.pop(n) for n in ("causal", "window", "q_offset", "q_segment_ids", "kv_segment_ids",
                                          "kv_lengths") if n in kw}
        spec = _spec(mask_kw)
        f32 = lambda *xs: [x.astype(jnp.float32) for x in xs]  # noqa: E731

        def go(q, k, v, do):
            kern = lambda q, k, v: flash_attention(q, k, v, backend="gpu", interpret=self.INTERPRET,  # noqa: E731
                                                   block_sizes=block_sizes, **mask_kw, **kw)
            ref = lambda q, k, v: reference(q, k, v, **mask_kw, **kw)  # noqa: E731
            dense = lambda q, k, v: xla_attention(q, k, v, mask=spec, **kw)  # noqa: E731
            o, vjp = jax.vjp(kern, q, k, v)
            o_r, vjp_r = jax.vjp(ref, *f32(q, k, v))
            o_d, vjp_d = jax.vjp(dense, *f32(q, k, v))
            dof = do.astype(jnp.float32)
            return (o, vjp(do)), (o_r, vjp_r(dof)), (o_d, vjp_d(dof))

        (o, g), (o_r, g_r), (o_d, g_d) = jax.jit(go)(q, k, v, do)
        assert o.dtype == dtype and all(x.dtype == dtype for x in g)
        ftol, gtol = TOL[dtype]
        for name, want_o, want_g in (("reference", o_r, g_r), ("xla dense", o_d, g_d)):
            _close(o, want_o, ftol, f"out vs {name}")
            for n, a, b in zip(("dq", "dk", "dv"), g, want_g):
                _close(a, b, gtol, f"{n} vs {name}")
        return o, g

    def test_plain_gqa_unaligned_lengths(self):
        self.run((2, 37, 45, 4, 2, 24), block_sizes=MIXED)

    # slow (1.2 s): causal tiles are default-run in test_segments_lengths_and_empty_rows, test_low_precision and the
    # first pinned example of test_drawn (causal, GQA 2x3, 37 x 29), MQA (one kv head) in test_drawn's second pinned
    # example, test_length_one and test_cross_lengths_and_offsets
    @pytest.mark.slow
    def test_causal_mqa(self):
        self.run((1, 40, 40, 3, 1, 16), dict(causal=True))

    # slow (1.8 s): test_drawn's first pinned example runs causal + a window + ALiBi + softcap together on GQA with the
    # MIXED blocks (and segments, lengths, an offset); [N]-shaped slopes are default-run in test_low_precision
    @pytest.mark.slow
    def test_causal_window_alibi_softcap(self):
        slopes = jnp.array([0.5, 0.25, 0.125, 0.0625])
        self.run((1, 33, 33, 4, 2, 16), dict(causal=True, window=(7, None), alibi_slopes=slopes, softcap=2.0),
                 block_sizes=MIXED)

    @pytest.mark.parametrize("T, S, kw", [
        (19, 41, dict(window=(5, 3), q_offset=7)),        # two-sided window, explicit offset
        # chunked prefill: bottom-right. Slow (1.4 s): the default offset S - T under causal is default-run in
        # test_length_one[1-29], several query rows under a causal offset in test_drawn's first pinned example, ALiBi
        # with an offset in its second
        pytest.param(5, 29, dict(causal=True, alibi_slopes=jnp.array([0.3, 0.7])), marks=pytest.mark.slow),
    ])
    def test_cross_lengths_and_offsets(self, T, S, kw):
        self.run((2, T, S, 2, 1, 16), kw)

    def test_segments_lengths_and_empty_rows(self):
        B, T, S = 2, 24, 24
        q_seg = jnp.array([[0] * 10 + [1] * 10 + [7] * 4, [0] * 24])  # segment 7 has no keys: empty rows
        kv_seg = jnp.array([[0] * 12 + [1] * 12, [0] * 24])
        lengths = jnp.array([20, 0])  # batch 1: every row empty
        o, (dq, dk, dv) = self.run((B, T, S, 2, 2, 16), dict(causal=True, q_segment_ids=q_seg,
                                                            kv_segment_ids=kv_seg, kv_lengths=lengths))
        assert (o[0, 20:] == 0).all() and (o[1] == 0).all()
        assert (dq[0, 20:] == 0).all() and (dq[1] == 0).all()
        assert (dk[1] == 0).all() and (dv[1] == 0).all() and (dk[0, 20:] == 0).all()

    # (29, 1) slow (2.5 s): rows with no key under a causal offset are default-run in test_drawn's first pinned example
    # (offset -3) and test_segments_lengths_and_empty_rows, a key block of padding in every unaligned S (45, 41, 29)
    @pytest.mark.parametrize("T, S", [(1, 29), pytest.param(29, 1, marks=pytest.mark.slow)])
    def test_length_one(self, T, S):
        self.run((1, T, S, 2, 1, 16), dict(causal=True))

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.fp16)])
    def test_low_precision(self, dtype):
        self.run((1, 48, 48, 4, 2, 32), dict(causal=True, alibi_slopes=jnp.array([0.1, 0.2, 0.3, 0.4])),
                 dtype=dtype)

    def test_padding_rows_never_reach_dk_dv(self):
        """T = 33 pads to 64 rows for the dk/dv tiles; padding rows see keys 48..63 that the forward
        pass never visited for them, and a steep slope would overflow exp(s - lse) there."""
        self.run((1, 33, 64, 1, 1, 16), dict(causal=True, q_offset=0, alibi_slopes=jnp.array([8.0])),
                 block_sizes=BlockSizes(16, 16, block_q_dkv=64, block_k_dkv=64))

    def test_dead_blocks_are_skipped_not_masked(self):
        """NaN in blocks the mask never reaches must not leak: skipped blocks are never read."""
        B, T, N, H = 1, 64, 2, 16
        q, k, v, do = _inputs(B, T, T, N, 1, H, jnp.float32)
        kern = lambda q, k, v, **kw: flash_attention(  # noqa: E731
            q, k, v, backend="gpu", interpret=self.INTERPRET, block_sizes=SMALL, **kw)
        # causal + window (8, 0): q block 2 (rows 32..47) visits kv blocks 1 and 2 only
        v_bad = np.array(v)
        v_bad[:, 48:] = v_bad[:, :8] = np.nan
        o = jax.jit(lambda q, k, v: kern(q, k, v, causal=True, window=(8, 0)))(q, k, v_bad)
        want = jax.jit(lambda q, k, v: reference(q, k, v, causal=True, window=(8, 0)))(q, k, v)
        _close(o[:, 32:48], want[:, 32:48], 1e-5, "rows whose live blocks are clean")
        # backward: kv blocks 1..3 never see q block 0 under causal
        q_bad = np.array(q)
        q_bad[:, :16] = np.nan
        do_clean = np.array(do)
        do_clean[:, :16] = 0.0

        def grads(q, k, v, do, fn):
            return jax.vjp(lambda q, k, v: fn(q, k, v, causal=True), q, k, v)[1](do)

        _, dk, dv = jax.jit(lambda *a: grads(*a, kern))(q_bad, k, v, do)
        _, dk_r, dv_r = jax.jit(lambda *a: grads(*a, reference))(q, k, v, do_clean)
        _close(dk[:, 16:], dk_r[:, 16:], 1e-4, "dk of kv blocks not seeing q block 0")
        _close(dv[:, 16:], dv_r[:, 16:], 1e-4, "dv of kv blocks not seeing q block 0")

    DRAWS = dict(B=st.integers(1, 2), T=st.integers(1, 40), S=st.integers(1, 40), K=st.sampled_from([1, 2]),
                 G=st.sampled_from([1, 3]), H=st.sampled_from([8, 16, 20]), causal=st.booleans(),
                 window=st.sampled_from([None, (4, None), (6, 2)]), offset=st.sampled_from([None, 0, -3, 5]),
                 use_seg=st.booleans(), use_len=st.booleans(), use_alibi=st.booleans(),
                 softcap=st.sampled_from([None, 4.0]), blocks=st.sampled_from([SMALL, MIXED]), seed=st.integers(0, 99))

    # The pinned examples alone (each runs the kernel in interpret mode, seconds): they reach every feature at once
    # (causal + window + offset + segments + lengths + ALiBi + softcap + GQA) and a non-causal window with ALiBi,
    # so coverage does not hang on a draw; the slow test below draws 3.
    @settings(phases=[Phase.explicit])
    @example(B=2, T=37, S=29, K=2, G=3, H=16, causal=True, window=(6, 2), offset=-3, use_seg=True, use_len=True,
             use_alibi=True, softcap=4.0, blocks=MIXED, seed=1)
    @example(B=1, T=21, S=40, K=1, G=3, H=20, causal=False, window=(4, None), offset=5, use_seg=False,
             use_len=False, use_alibi=True, softcap=None, blocks=SMALL, seed=2)
    @given(**DRAWS)
    def test_drawn(self, B, T, S, K, G, H, causal, window, offset, use_seg, use_len, use_alibi, softcap, blocks,
                   seed):
        self._drawn(B, T, S, K, G, H, causal, window, offset, use_seg, use_len, use_alibi, softcap, blocks, seed)

    @pytest.mark.slow  # 6 s in interpret mode: 3 draws; the test above runs its two pinned examples alone
    @settings(max_examples=3)
    @given(**DRAWS)
    def test_drawn_many(self, B, T, S, K, G, H, causal, window, offset, use_seg, use_len, use_alibi, softcap,
                        blocks, seed):
        self._drawn(B, T, S, K, G, H, causal, window, offset, use_seg, use_len, use_alibi, softcap, blocks, seed)

    def _drawn(self, B, T, S, K, G, H, causal, window, offset, use_seg, use_len, use_alibi, softcap, blocks, seed):
        rng = np.random.default_rng(seed)
        N = K * G
        kw = dict(causal=causal, window=window, q_offset=offset, softcap=softcap)
        if use_seg:
            kw |= dict(q_segment_ids=jnp.asarray(rng.integers(0, 2, (B, T))),
                       kv_segment_ids=jnp.asarray(rng.integers(0, 2, (B, S))))
        if use_len:
            kw |= dict(kv_lengths=jnp.asarray(rng.integers(0, S + 1, (B,))))
        if use_alibi:
            kw |= dict(alibi_slopes=jnp.asarray(rng.uniform(0.05, 1.0, (B, N)), jnp.float32))
        self.run((B, T, S, N, K, H), kw, block_sizes=blocks, seed=seed)


class TestFlashGpuInterpret(FlashGpuBase):
    INTERPRET = True


class TestFlashGpuDevice(FlashGpuBase):
    INTERPRET = False


@pytest.mark.parametrize("features, dtype, H", [("all", jnp.bfloat16, 64), ("none", jnp.float32, 128)])
def test_lowers_to_triton_for_gpu(features, dtype, H):
    """Export forward+backward for CUDA: runs Pallas's real Triton lowering on CPU (supported ops,
    block shapes) with the default GPU blocks. Compiling the Triton IR still needs a GPU."""
    B, T, S, N, K = 1, 200, 384, 4, 2
    kw = {}
    if features == "all":
        kw = dict(causal=True, window=(100, None), q_segment_ids=jnp.zeros((B, T), jnp.int32),
                  kv_segment_ids=jnp.zeros((B, S), jnp.int32), kv_lengths=jnp.array([300]),
                  alibi_slopes=jnp.ones((N,)), softcap=5.0)
    q = jax.ShapeDtypeStruct((B, T, N, H), dtype)
    k = jax.ShapeDtypeStruct((B, S, K, H), dtype)

    def fwd_bwd(q, k, v):
        return jax.grad(lambda *a: jnp.sum(flash_attention(*a, backend="gpu", **kw).astype(jnp.float32)),
                        argnums=(0, 1, 2))(q, k, v)

    triton = "__gpu$xla.gpu.triton"
    exported = jax.export.export(jax.jit(fwd_bwd), platforms=["cuda"],
                                 disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)])(q, k, k)
    assert exported.mlir_module().count(f"@{triton}") == 3
