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


def test_write_drops_tokens_past_the_table_instead_of_overwriting_cached_ones():
    """A table of one 4-token page holding 3 tokens, and a chunk of 2: the first fills the page's last row; the
    second has no page and is dropped (clamped into the last page it would land on row 0, over token 0)."""
    kp = jnp.asarray(np.arange(1, 1 + 2 * 3 * 4 * 1, dtype=np.float32).reshape(1, 3, 4, 2)[:, :3])  # K1 P3 L4 H2
    cache = PagedKVCache(kp, kp, jnp.asarray([[1]], jnp.int32), jnp.asarray([3]), jnp.asarray([2]))
    new = jnp.full((1, 2, 1, 2), -1.0, jnp.float32)
    got = np.asarray(jax.jit(lambda c, k: c.write(k, k))(cache, new).k_pages)
    want = np.asarray(kp).copy()
    want[0, 1, 3] = -1.0  # position 3: page 1 (the table's only page), row 3
    np.testing.assert_array_equal(got, want)


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


@pytest.mark.parametrize("impl, blockwise_calls", [("auto", 1), ("xla", 0)])
def test_prefill_chunk_auto_is_blockwise(monkeypatch, impl, blockwise_calls):
    """A chunk of several tokens over the pages runs blockwise under "auto" on every platform (its offset is
    traced; on CPU the dense reference is slower at every chunk measured); an explicit impl is kept."""
    import jaxformer.ops.blockwise as blockwise

    calls = []
    real = blockwise.blockwise_attention
    monkeypatch.setattr(blockwise, "blockwise_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    rng = np.random.default_rng(0)
    _, paged, tables = setup_history(rng, [0, 5, 13])
    q = jnp.asarray(rng.normal(size=(B, 3, K * G, H)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, 3, K, H)), jnp.float32) for _ in range(2))
    cache = PagedKVCache(paged.k_pages, paged.v_pages, tables, jnp.asarray([0, 5, 13], jnp.int32),
                         jnp.full(B, 3, jnp.int32))
    cache.attend(q, k, v, scale=0.35, impl=impl)
    assert len(calls) == blockwise_calls


def test_init_page_pools_zero_and_distinct_buffers():
    """The pools come from one jitted call: every layer's K and V must be its own zeroed buffer (the engine
    updates them in place, donated; two layers sharing one would overwrite each other's history)."""
    from types import SimpleNamespace

    from jaxformer.decode.paged_cache import init_page_pools

    cfg = SimpleNamespace(kind="decoder", compute_dtype="float32", resolved_kv_heads=2, resolved_head_dim=8,
                          n_decoder_layers=3)
    pools = init_page_pools(cfg, num_pages=5, page_size=4)
    arrays = [a for kv in pools for a in kv]
    assert len(arrays) == 6 and all(a.shape == (2, 5, 4, 8) and a.dtype == jnp.float32 for a in arrays)
    assert all(not np.asarray(a).any() for a in arrays)
    assert len({a.unsafe_buffer_pointer() for a in arrays}) == 6
