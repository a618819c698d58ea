"""PagedKVCache vs the contiguous KVCache on the same history, and page copies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.decode.kv_cache import KVCache
from jaxformer.decode.paged_cache import PagedKVCache, copy_pages

B, K, G, H, L, M, P = 3, 2, 2, 8, 4, 4, 16


def setup_history(rng, hist_lengths):
    """The same random history in a contiguous cache and, written chunk by chunk, in shuffled pages."""
    S = M * L
    k_hist = jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.float32)
    v_hist = jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.float32)
    tables = jnp.asarray(rng.permutation(P)[: B * M].reshape(B, M), jnp.int32)
    pages = jnp.zeros((K, P, L, H), jnp.float32)
    paged = PagedKVCache(pages, pages, tables, jnp.zeros(B, jnp.int32), jnp.zeros(B, jnp.int32))
    write = jax.jit(lambda c, k, v: c.write(k, v))
    lengths = np.asarray(hist_lengths)
    for start in range(0, S, 5):  # chunks of 5 cross page boundaries; num_new stops at each length
        n = np.clip(lengths - start, 0, 5)
        c = PagedKVCache(paged.k_pages, paged.v_pages, tables, jnp.full(B, start, jnp.int32), jnp.asarray(n))
        sl = slice(start, start + 5)
        pad = 5 - k_hist[:, sl].shape[1]
        kk, vv = (jnp.pad(x[:, sl], ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (k_hist, v_hist))
        paged = write(c, kk, vv)
    contiguous = KVCache(k_hist, v_hist, jnp.asarray(lengths, jnp.int32))
    return contiguous, paged, tables


@pytest.mark.parametrize("T,backend", [(3, "reference"), (1, "reference"), (1, "gpu")])
def test_paged_attend_equals_contiguous_attend(T, backend):
    rng = np.random.default_rng(T)
    hist = [0, 5, 16 - T]  # empty, mid-page, up to the last slot
    contiguous, paged, tables = setup_history(rng, hist)
    # the write put each token at page tables[pos // L], row pos % L, and nothing past each length
    k_pages, t, k_hist = np.asarray(paged.k_pages), np.asarray(tables), np.asarray(contiguous.k)
    for b, n in enumerate(hist):
        for pos in range(M * L):
            got = k_pages[:, t[b, pos // L], pos % L]
            want = k_hist[b, pos] if pos < n else np.zeros((K, H))
            np.testing.assert_array_equal(got, want)
    q = jnp.asarray(rng.normal(size=(B, T, K * G, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32)
    kw = dict(scale=0.35, alibi_slopes=jnp.asarray([0.5, 0.3, 0.2, 0.1]), softcap=5.0)
    cache = PagedKVCache(paged.k_pages, paged.v_pages, tables, jnp.asarray(hist, jnp.int32),
                         jnp.full(B, T, jnp.int32), backend=backend, interpret=backend != "reference")
    got, new = jax.jit(lambda c, q, k, v: c.attend(q, k, v, **kw))(cache, q, k, v)
    want, _ = jax.jit(lambda c, q, k, v: c.attend(q, k, v, **kw))(contiguous, q, k, v)
    # fp32, different summation order (gathered pages / online softmax): 1e-5
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(new.lengths, np.asarray(hist) + T)


def test_copy_pages_copies_every_layer_and_skips_padding():
    rng = np.random.default_rng(0)
    pools = [tuple(jnp.asarray(rng.normal(size=(K, 6, L, H)), jnp.float32) for _ in range(2)) for _ in range(2)]
    before = [tuple(np.asarray(p) for p in kv) for kv in pools]
    out = copy_pages(pools, jnp.asarray([1, 4, 0, 0]), jnp.asarray([4, 2, 6, 6]))  # 1->4, 4->2 (old 4)
    for (k0, v0), (k1, v1) in zip(before, out):
        for a, b in ((k0, k1), (v0, v1)):
            np.testing.assert_array_equal(b[:, 4], a[:, 1])
            np.testing.assert_array_equal(b[:, 2], a[:, 4])
            np.testing.assert_array_equal(b[:, [0, 1, 3, 5]], a[:, [0, 1, 3, 5]])


def test_attend_shape_error():
    pages = jnp.zeros((K, P, L, H))
    c = PagedKVCache(pages, pages, jnp.zeros((1, M), jnp.int32), jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32))
    with pytest.raises(ValueError, match="does not fit"):
        c.attend(jnp.zeros((1, 1, 4, H)), jnp.zeros((1, 1, 3, H)), jnp.zeros((1, 1, 3, H)), scale=1.0)
