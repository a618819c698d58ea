"""Paged-attention decode kernels (interpret mode) and the CPU's long-context xla form vs the gather+einsum
reference, and the reference vs jaxformer's dense xla_attention on the gathered cache and float64 numpy."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from jaxformer.ops.attention import xla_attention
from jaxformer.ops.masks import MaskSpec
from pallas_kernels.paged_attention import (
    gather_pages,
    paged_attention,
    paged_attention_reference,
    paged_attention_xla,
)


def make_case(seed, *, B=4, N=4, K=2, H=16, L=4, M=5, P=None, dtype=jnp.float32, lengths=None):
    """Random pools, block tables over shuffled pages (no page shared), lengths 1..M*L."""
    rng = np.random.default_rng(seed)
    P = P or B * M + 3
    q = jnp.asarray(rng.normal(size=(B, N, H)), dtype)
    kp = jnp.asarray(rng.normal(size=(K, P, L, H)), dtype)
    vp = jnp.asarray(rng.normal(size=(K, P, L, H)), dtype)
    tables = jnp.asarray(rng.permutation(P)[: B * M].reshape(B, M), jnp.int32)
    if lengths is None:
        # on a page boundary, just past one, the full table, and anything
        lengths = [L, L + 1, M * L, int(rng.integers(1, M * L + 1))][:B]
        lengths = rng.permutation(lengths + [1] * (B - len(lengths)))
    slopes = jnp.asarray(rng.uniform(0.05, 1.0, size=(N,)), jnp.float32)
    return q, kp, vp, tables, jnp.asarray(lengths, jnp.int32), slopes


# fp32 kernels vs fp32 reference: online softmax reorders the sums, 1e-5 covers it.
TOL32 = dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend, seeds", [
    ("gpu", (0, 1, 2)),
    ("tpu", (0,)),
    # 3.5 s (TPU interpret mode): seed 0 takes every length class (a page boundary, just past one, the full table,
    # a random one), test_kernel_sliding_window_with_dropped_leading_pages[tpu] runs the TPU kernel on these shapes
    # and features (make_case's GQA 2:1, ALiBi, softcap, a ragged last split) with a window, and the default-run
    # GPU case takes all three draws
    pytest.param("tpu", (1, 2), marks=pytest.mark.slow),
], ids=["gpu", "tpu", "tpu-more-seeds"])
def test_kernel_matches_reference_random_tables(backend, seeds):
    """Same shapes (one compile), several random draws of tables and lengths; GQA 2:1,
    ALiBi and softcap on, split-K with a ragged last split (M=5, 2 pages per split)."""
    for seed in seeds:
        q, kp, vp, tables, lengths, slopes = make_case(seed)
        kw = dict(alibi_slopes=slopes, softcap=3.0, scale=0.3)
        want = paged_attention_reference(q, kp, vp, tables, lengths, **kw)
        got = paged_attention(q, kp, vp, tables, lengths, backend=backend, interpret=True,
                              pages_per_split=2, **kw)
        np.testing.assert_allclose(got, want, **TOL32, err_msg=f"seed {seed} lengths {lengths}")


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_kernel_mqa_one_split_and_unused_pages_never_read(backend):
    """MQA (K=1, G=4), a single split. Table entries past each sequence's last page point at a
    NaN page and all pages outside the tables hold NaN: the kernel must read neither."""
    q, kp, vp, tables, lengths, _ = make_case(7, K=1, L=8, M=3, lengths=[1, 8, 9, 24])
    want = paged_attention_reference(q, kp, vp, tables, lengths)
    used = np.zeros(kp.shape[1], bool)
    t = np.asarray(tables).copy()
    for b, n in enumerate(np.asarray(lengths)):
        used[t[b, : -(-n // 8)]] = True
    nan_page = int(np.flatnonzero(~used)[0])
    for b, n in enumerate(np.asarray(lengths)):
        t[b, -(-n // 8):] = nan_page
    kp = kp.at[:, ~used].set(jnp.nan)
    vp = vp.at[:, ~used].set(jnp.nan)
    got = paged_attention(q, kp, vp, jnp.asarray(t), lengths, backend=backend, interpret=True, num_splits=1)
    np.testing.assert_allclose(got, want, **TOL32)


@pytest.mark.parametrize("backend, windows", [
    ("gpu", (1, 6, 8, 30)),
    ("tpu", (8,)),
    # 9 s (TPU interpret mode); window 8 alone cuts on a page boundary (length 20), inside a page (13, 9) and is
    # wider than a sequence (3); the default-run GPU case takes all four windows
    pytest.param("tpu", (1, 6, 30), marks=pytest.mark.slow),
], ids=["gpu", "tpu", "tpu-more-windows"])
def test_kernel_sliding_window_with_dropped_leading_pages(backend, windows):
    """A sliding window W: the kernel on a table whose pages wholly behind the window were dropped
    (lengths shifted by the dropped tokens) equals the reference on the full table: only
    distances enter the logits (ALiBi included). Windows: 1, not page-aligned, page-aligned,
    wider than the sequence; NaN in every dropped page proves none is read."""
    L, M = 4, 5
    q, kp, vp, tables, _, slopes = make_case(21, L=L, M=M)
    lengths = jnp.asarray([20, 13, 9, 3], jnp.int32)
    for window in windows:
        want = paged_attention_reference(q, kp, vp, tables, lengths, alibi_slopes=slopes, softcap=3.0,
                                         window=window)
        drop = np.maximum(np.asarray(lengths) - window, 0) // L  # pages wholly behind the window
        t, kn, vn = np.asarray(tables).copy(), np.asarray(kp).copy(), np.asarray(vp).copy()
        short = np.zeros_like(t)
        for b, d in enumerate(drop):
            kn[:, t[b, :d]] = vn[:, t[b, :d]] = np.nan
            short[b, : M - d] = t[b, d:]
        got = paged_attention(q, jnp.asarray(kn), jnp.asarray(vn), jnp.asarray(short),
                              lengths - jnp.asarray(drop * L, jnp.int32), alibi_slopes=slopes, softcap=3.0,
                              window=window, backend=backend, interpret=True, pages_per_split=2)
        np.testing.assert_allclose(got, want, **TOL32, err_msg=f"window {window}")
        # and the full table with the window: the kernel skips the pages behind it
        full = paged_attention(q, kp, vp, tables, lengths, alibi_slopes=slopes, softcap=3.0, window=window,
                               backend=backend, interpret=True, pages_per_split=2)
        np.testing.assert_allclose(full, want, **TOL32, err_msg=f"window {window}, full table")


# 4.5 s (TPU interpret mode): the TPU kernel against the reference is default-run above with interpret=True (GQA 2:1,
# ALiBi, softcap, a ragged last split; MQA in one split; a window over dropped pages); under the context the kernel
# gets interpret=False and JAX interprets it, as test_flash_tpu.py's default-run tests run the flash kernels
@pytest.mark.slow
def test_tpu_kernel_under_force_tpu_interpret_mode():
    q, kp, vp, tables, lengths, slopes = make_case(3, B=2, N=2, K=2, M=3, lengths=[5, 12])
    want = paged_attention_reference(q, kp, vp, tables, lengths, alibi_slopes=slopes)
    with pltpu.force_tpu_interpret_mode():
        got = paged_attention(q, kp, vp, tables, lengths, alibi_slopes=slopes, backend="tpu", num_splits=3)
    np.testing.assert_allclose(got, want, **TOL32)


def test_gpu_kernel_bf16_and_zero_length():
    """bf16 pages against the fp32 reference on the same bf16 values; length 0 gives zeros."""
    q, kp, vp, tables, lengths, slopes = make_case(11, B=3, N=8, K=2, lengths=[0, 7, 20], dtype=jnp.bfloat16)
    want = paged_attention_reference(q.astype(jnp.float32), kp.astype(jnp.float32), vp.astype(jnp.float32),
                                     tables, lengths, alibi_slopes=slopes)
    got = paged_attention(q, kp, vp, tables, lengths, alibi_slopes=slopes, backend="gpu", interpret=True)
    assert got.dtype == jnp.bfloat16
    # bf16 probabilities before the p@v product and a bf16 output: ~3 significant digits.
    np.testing.assert_allclose(got.astype(jnp.float32), want, atol=2e-2, rtol=2e-2)
    assert np.all(np.asarray(got[0]) == 0)


def random_case(seed, B, K, G, L, M, alibi, *, slopes_shape):
    """fp32 q, pools of ``B * M + 2`` pages of head dim 8, tables over shuffled pages, lengths 1..M*L, and ALiBi
    slopes (``[N]`` for "heads", ``[B, N]`` for "rows") or None."""
    rng = np.random.default_rng(seed)
    N, H, P = K * G, 8, B * M + 2
    q = jnp.asarray(rng.normal(size=(B, N, H)), jnp.float32)
    kp = jnp.asarray(rng.normal(size=(K, P, L, H)), jnp.float32)
    vp = jnp.asarray(rng.normal(size=(K, P, L, H)), jnp.float32)
    tables = jnp.asarray(rng.permutation(P)[: B * M].reshape(B, M), jnp.int32)
    lengths = jnp.asarray(rng.integers(1, M * L + 1, size=B), jnp.int32)
    shape = (N,) if slopes_shape == "heads" else (B, N)
    slopes = jnp.asarray(rng.uniform(0.1, 1.0, size=shape), jnp.float32) if alibi else None
    return q, kp, vp, tables, lengths, slopes


DENSE_DRAWS = dict(
    seed=st.integers(0, 2**16),
    B=st.integers(1, 3),
    K=st.sampled_from([1, 2]),
    G=st.sampled_from([1, 3]),
    L=st.sampled_from([1, 4, 8]),
    M=st.integers(1, 4),
    alibi=st.booleans(),
    softcap=st.sampled_from([None, 2.0]),
    window=st.sampled_from([None, 1, 3, 6]),
)


# the pinned example alone (it turns every feature on; each example compiles new shapes, 2.4 s); the slow test below
# draws 5
@settings(phases=[Phase.explicit])
@example(seed=3, B=3, K=2, G=3, L=4, M=4, alibi=True, softcap=2.0, window=6)
@given(**DENSE_DRAWS)
def test_reference_matches_dense_attention_on_gathered_cache(seed, B, K, G, L, M, alibi, softcap, window):
    """Independent check of the reference: the query at position length-1 under
    MaskSpec(causal, window=(W-1, 0), q_offset=length-1, kv_lengths=length) in xla_attention."""
    _check_reference_against_dense(seed, B, K, G, L, M, alibi, softcap, window)


@pytest.mark.slow  # 12 s: 5 draws; the test above runs its pinned all-features example alone by default
@settings(max_examples=5)
@given(**DENSE_DRAWS)
def test_reference_matches_dense_attention_on_gathered_cache_many(seed, B, K, G, L, M, alibi, softcap, window):
    _check_reference_against_dense(seed, B, K, G, L, M, alibi, softcap, window)


def _check_reference_against_dense(seed, B, K, G, L, M, alibi, softcap, window):
    q, kp, vp, tables, lengths, slopes = random_case(seed, B, K, G, L, M, alibi, slopes_shape="heads")
    got = paged_attention_reference(q, kp, vp, tables, lengths, alibi_slopes=slopes, softcap=softcap,
                                    window=window)
    # gather with numpy, independent of gather_pages
    k = np.stack([np.concatenate([np.asarray(kp)[:, p] for p in row], axis=1) for row in np.asarray(tables)])
    v = np.stack([np.concatenate([np.asarray(vp)[:, p] for p in row], axis=1) for row in np.asarray(tables)])
    k, v = np.transpose(k, (0, 2, 1, 3)), np.transpose(v, (0, 2, 1, 3))  # [B, S, K, H]
    mask = MaskSpec(causal=True, window=None if window is None else (window - 1, 0), q_offset=lengths - 1,
                    kv_lengths=lengths)
    want = xla_attention(q[:, None], jnp.asarray(k), jnp.asarray(v), mask=mask, alibi_slopes=slopes,
                         softcap=softcap)[:, 0]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(gather_pages(kp, tables), k)


def numpy_paged(q, kp, vp, tables, lengths, *, scale, slopes=None, softcap=None):
    """float64 numpy decode attention, query b at position lengths[b]-1, key by key from the pages."""
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, kp, vp))
    B, N, H = qn.shape
    G = N // kn.shape[0]
    out = np.zeros((B, N, H))
    for b in range(B):
        n = int(lengths[b])
        pages = np.asarray(tables[b])
        for h in range(N):
            keys = np.concatenate([kn[h // G, p] for p in pages])[:n]
            vals = np.concatenate([vn[h // G, p] for p in pages])[:n]
            s = scale * keys @ qn[b, h]
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            if slopes is not None:
                s = s - float(slopes[h]) * (n - 1 - np.arange(n))
            w = np.exp(s - s.max())
            out[b, h] = (w / w.sum()) @ vals
    return out


def test_reference_against_float64_numpy():
    q, kp, vp, tables, lengths, slopes = make_case(5, B=2, N=4, K=2, M=2, lengths=[3, 8])
    got = paged_attention_reference(q, kp, vp, tables, lengths, alibi_slopes=slopes, softcap=2.5, scale=0.7)
    want = numpy_paged(q, kp, vp, tables, lengths, scale=0.7, slopes=slopes, softcap=2.5)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.no_typecheck
def test_bad_inputs_raise_value_error():
    q, kp, vp, tables, lengths, slopes = make_case(0)
    with pytest.raises(ValueError, match="not divisible by kv heads"):
        paged_attention(q[:, :3], kp, vp, tables, lengths)
    with pytest.raises(ValueError, match="head dim mismatch"):
        paged_attention(q[..., :8], kp, vp, tables, lengths)
    with pytest.raises(ValueError, match="k_pages and v_pages differ"):
        paged_attention(q, kp, vp[:, :3], tables, lengths)
    with pytest.raises(ValueError, match=r"block_tables must be \[B, M\]"):
        paged_attention(q, kp, vp, tables[:2], lengths)
    with pytest.raises(ValueError, match=r"lengths must be \[B\]"):
        paged_attention(q, kp, vp, tables, lengths[:2])
    with pytest.raises(ValueError, match="alibi_slopes"):
        paged_attention(q, kp, vp, tables, lengths, alibi_slopes=slopes[:3])
    with pytest.raises(ValueError, match="backend"):
        paged_attention(q, kp, vp, tables, lengths, backend="cuda")
    with pytest.raises(ValueError, match="not both"):
        paged_attention(q, kp, vp, tables, lengths, num_splits=2, pages_per_split=2, backend="gpu")
    with pytest.raises(ValueError, match="integer"):
        paged_attention(q, kp, vp, tables.astype(jnp.float32), lengths)
    with pytest.raises(ValueError, match="window"):
        paged_attention(q, kp, vp, tables, lengths, window=0)


@pytest.mark.no_typecheck
@pytest.mark.parametrize("fn", [paged_attention, paged_attention_reference, paged_attention_xla])
def test_every_entry_point_checks_its_inputs(fn):
    """The reference and the xla form are exported too: each names the shapes of a bad call (an empty table or
    pool, a wrong softcap) instead of failing inside XLA."""
    q, kp, vp, tables, lengths, _ = make_case(0)
    with pytest.raises(ValueError, match=r"block_tables must be \[B, M\] with B=\d+ and M >= 1"):
        fn(q, kp, vp, tables[:, :0], lengths)
    with pytest.raises(ValueError, match="at least one page"):
        fn(q, kp[:, :0], vp[:, :0], tables, lengths)
    with pytest.raises(ValueError, match="not divisible by kv heads"):
        fn(q[:, :3], kp, vp, tables, lengths)
    with pytest.raises(ValueError, match="softcap"):
        fn(q, kp, vp, tables, lengths, softcap=0.0)
    for backend in (("gpu", "tpu") if fn is paged_attention else (None,)):  # the kernels divided by B and by H
        kw = {} if backend is None else {"backend": backend}
        with pytest.raises(ValueError, match=r"empty decode operands: q.shape=\(0, 4, 16\)"):
            fn(q[:0], kp, vp, tables[:0], lengths[:0], **kw)
        with pytest.raises(ValueError, match=r"empty decode operands: q.shape=\(\d+, 4, 0\)"):
            fn(q[..., :0], kp[..., :0], vp[..., :0], tables, lengths, **kw)


def test_auto_backend_and_default_scale_against_float64_numpy():
    """``backend="auto"`` (the reference on CPU, the kernel on a device) with the default 1/sqrt(H)."""
    q, kp, vp, tables, lengths, _ = make_case(2)
    got = paged_attention(q, kp, vp, tables, lengths)
    want = numpy_paged(q, kp, vp, tables, lengths, scale=1 / math.sqrt(q.shape[-1]))
    # fp32 vs float64: 1e-5 on CPU; a device may contract in TF32 (10-bit mantissa): 2e-3
    tol = 1e-5 if jax.default_backend() == "cpu" else 2e-3
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


@pytest.mark.no_typecheck  # the annotations say `scale: float`, as in ops.attention; a traced one works there too
def test_traced_scale_with_the_plain_forms_and_a_clear_error_from_the_kernels():
    """The reference and xla forms take a traced scale (as ``paged_attention_reference`` does); the Pallas kernels
    close over it, so they refuse one with a ValueError naming it instead of a concretization error."""
    q, kp, vp, tables, lengths, _ = make_case(5)
    for backend in ("reference", "xla"):
        got = jax.jit(lambda s: paged_attention(q, kp, vp, tables, lengths, scale=s, backend=backend))(0.3)
        want = numpy_paged(q, kp, vp, tables, lengths, scale=0.3)
        np.testing.assert_allclose(got, want, **TOL32)
    with pytest.raises(ValueError, match="needs a static scale"):
        jax.jit(lambda s: paged_attention(q, kp, vp, tables, lengths, scale=s, backend="gpu", interpret=True))(0.3)


def _lowering_args(G=4, H=128):
    B, K, L, P, M = 4, 2, 16, 64, 8
    z = jnp.zeros
    return (z((B, K, G, H), jnp.bfloat16), z((K, P, L, H), jnp.bfloat16), z((K, P, L, H), jnp.bfloat16),
            z((B, M), jnp.int32), z(B, jnp.int32), z((B, K, G), jnp.float32))


def test_gpu_kernel_lowers_through_pallas_triton():
    """Interpret mode skips Triton's constraints (power-of-two tiles, dot shapes); lowering checks them."""
    from pallas_kernels.paged_attention.gpu import paged_attention_partials_gpu

    for window in (None, 24):
        low = paged_attention_partials_gpu.trace(*_lowering_args(), scale=0.1, softcap=30.0, window=window,
                                                 pages_per_split=4).lower(lowering_platforms=("cuda",))
        assert "paged_attention_gpu" in low.as_text()


def test_tpu_kernel_lowers_through_mosaic(monkeypatch):
    from pallas_kernels.paged_attention.tpu import paged_attention_partials_tpu

    tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
    if not hasattr(tpu_info, "get_device_kind"):
        pytest.skip("this jax has no tpu_info.get_device_kind to stand in for a TPU")
    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5 lite")
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    for G, H, window in ((4, 128, None), (1, 64, 24)):
        low = paged_attention_partials_tpu.trace(*_lowering_args(G, H), scale=0.1, softcap=None, window=window,
                                                 pages_per_split=4).lower(lowering_platforms=("tpu",))
        assert "paged_attention_tpu" in low.as_text()



@pytest.mark.parametrize("impl", [paged_attention_reference, paged_attention_xla], ids=["reference", "xla"])
def test_table_entries_past_the_length_are_never_used(impl):
    """Entries of a table past its sequence's last page (anything: an engine may leave stale ids there, or ids
    past the pool, or negative ones) change nothing: they are read somewhere in the pool (jnp indexing clamps
    or wraps them, the xla form clamps before its in-bounds gather) and their positions masked. The same rows
    with those entries pointing at valid pages are the result."""
    q, kp, vp, tables, lengths, slopes = make_case(11, B=4, M=5, lengths=[1, 5, 12, 20])
    t = np.asarray(tables).copy()
    P = kp.shape[1]
    for b, n in enumerate(np.asarray(lengths)):
        used = -(-int(n) // 4)  # L = 4
        t[b, used:] = [P + 7, 2**20, -3, P, 0][: 5 - used]
    got = impl(q, kp, vp, jnp.asarray(t), lengths, alibi_slopes=slopes)
    np.testing.assert_array_equal(got, impl(q, kp, vp, tables, lengths, alibi_slopes=slopes))
    np.testing.assert_allclose(got, numpy_paged(q, kp, vp, tables, lengths, scale=1 / math.sqrt(q.shape[-1]),
                                                slopes=slopes), atol=1e-5, rtol=1e-5)


XLA_DRAWS = dict(seed=st.integers(0, 2**16), B=st.integers(1, 4), K=st.sampled_from([1, 3]),
                 G=st.sampled_from([1, 3]), L=st.sampled_from([1, 4, 16]), M=st.integers(1, 6), alibi=st.booleans(),
                 softcap=st.sampled_from([None, 2.0]), window=st.sampled_from([None, 1, 5]))


# the pinned example alone (it turns every feature on; each example compiles new shapes); the slow test below draws 6
@settings(phases=[Phase.explicit], deadline=None)
@example(seed=3, B=3, K=2, G=3, L=4, M=4, alibi=True, softcap=2.0, window=6)
@given(**XLA_DRAWS)
def test_xla_form_matches_reference(seed, B, K, G, L, M, alibi, softcap, window):
    """The CPU's long-context form (its own gather and logit layout; the softcap / ALiBi / mask / softmax rules
    are the reference's ``decode_weights``, which the tests above check against dense attention and float64
    numpy) against the reference: every feature, random tables over shuffled pages, lengths 1..M*L; fp32 sums
    in another order, 1e-5."""
    _check_xla_form(seed, B, K, G, L, M, alibi, softcap, window)


@pytest.mark.slow  # 11 s: 6 draws; the test above runs its pinned all-features example alone by default
@settings(max_examples=6, deadline=None)
@given(**XLA_DRAWS)
def test_xla_form_matches_reference_many(seed, B, K, G, L, M, alibi, softcap, window):
    _check_xla_form(seed, B, K, G, L, M, alibi, softcap, window)


def _check_xla_form(seed, B, K, G, L, M, alibi, softcap, window):
    q, kp, vp, tables, lengths, slopes = random_case(seed, B, K, G, L, M, alibi, slopes_shape="rows")
    kw = dict(alibi_slopes=slopes, softcap=softcap, window=window, scale=0.4)
    got = jax.jit(lambda *a: paged_attention_xla(*a, **kw))(q, kp, vp, tables, lengths)
    np.testing.assert_allclose(got, paged_attention_reference(q, kp, vp, tables, lengths, **kw), **TOL32)


def test_auto_backend_on_cpu_takes_the_xla_form_from_its_threshold(monkeypatch):
    """``backend="auto"`` on the CPU: the reference below ``XLA_MIN_POSITIONS`` table positions, the xla form
    from there on (where it is faster); both give the float64 answer."""
    import pallas_kernels.paged_attention.api as api
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU's dispatch")
    calls = []
    monkeypatch.setattr(api, "paged_attention_xla", lambda *a, **k: calls.append("xla") or paged_attention_xla(*a, **k))
    monkeypatch.setattr(api, "paged_attention_reference",
                        lambda *a, **k: calls.append("reference") or paged_attention_reference(*a, **k))
    L = 16
    for M, want in ((api.XLA_MIN_POSITIONS // L - 1, "reference"), (api.XLA_MIN_POSITIONS // L, "xla")):
        q, kp, vp, tables, lengths, _ = make_case(4, B=2, L=L, M=M, lengths=[M * L, 3])
        got = paged_attention(q, kp, vp, tables, lengths)
        assert calls[-1] == want, (M, calls)
        np.testing.assert_allclose(got, numpy_paged(q, kp, vp, tables, lengths, scale=1 / math.sqrt(q.shape[-1])),
                                   atol=1e-5, rtol=1e-5)
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:1])
    with jax.set_mesh(mesh):  # a mesh active: the reference (the xla form's gather merges kv heads and pages)
        got = paged_attention(q, kp, vp, tables, lengths)
    assert calls[-1] == "reference"
    np.testing.assert_allclose(got, numpy_paged(q, kp, vp, tables, lengths, scale=1 / math.sqrt(q.shape[-1])),
                               atol=1e-5, rtol=1e-5)


def test_xla_form_gradients_and_bf16_match_reference():
    """The xla form's gradients (its in-bounds gather and optimisation barrier are differentiated) against the
    reference's, w.r.t. the query and both pools, ALiBi and a window on; and bf16 pools against the reference
    in bf16 (both round the same bf16 products; 2e-2 covers the different fp32 summation orders, rounded)."""
    q, kp, vp, tables, lengths, slopes = make_case(9, B=3, M=4, lengths=[16, 7, 1])
    kw = dict(alibi_slopes=slopes, window=6, scale=0.5)
    g = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)

    def loss(f):
        return lambda q, kp, vp: jnp.sum(g * f(q, kp, vp, tables, lengths, **kw))

    got = jax.grad(loss(paged_attention_xla), (0, 1, 2))(q, kp, vp)
    want = jax.grad(loss(paged_attention_reference), (0, 1, 2))(q, kp, vp)
    for a, b in zip(got, want):
        assert np.all(np.isfinite(np.asarray(a)))
        np.testing.assert_allclose(a, b, **TOL32)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, kp, vp))
    got = paged_attention_xla(qb, kb, vb, tables, lengths, **kw)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(paged_attention_reference(qb, kb, vb, tables, lengths, **kw), np.float32),
                               atol=2e-2, rtol=2e-2)
