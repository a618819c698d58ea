"""Sparse self-attention in models: Longformer / BigBird presets and the config fields behind them.

The sparse path (``attention_impl="sparse"``: gathered kv blocks) is compared with the dense
reference (``attention_impl="xla"``: the full ``MaskSpec.dense`` matrix) on the same parameters.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.model import ModelConfig, apply, presets
from jaxformer.model.config import RandomBlocksConfig

from .helpers import random_model, tokens

# A multiple of neither block size in play (64: the sparse default; 16: BigBird's random blocks).
T = 200
# fp32 throughout; the paths add the same terms in a different order (softmax over gathered blocks
# vs the full row). Logits are O(1), parameter gradients up to O(10): 2e-5 absolute + 1e-4 relative.
ATOL, RTOL = 2e-5, 1e-4

# Every pattern at once in a decoder: causal band, a global position, per-head random blocks, GQA, RoPE.
DECODER = dict(sparsity=dict(window=(24, 0), global_tokens=(3,),
                             random_blocks=dict(num_blocks=1, block_size=16, seed=7, per_head=True)))


def _config(name: str, **overrides) -> ModelConfig:
    if name == "llama_tiny_sparse":
        return presets.get("llama_tiny", max_seq_len=256, **DECODER, **overrides)
    return presets.get(name, **overrides)


def _inputs(cfg: ModelConfig):
    """Two rows of different real lengths: ``lengths`` for an encoder, packed ``segment_ids`` for a decoder."""
    toks = tokens(0, (2, T), vocab=cfg.vocab_size)
    if cfg.kind == "encoder":
        return toks, dict(lengths=jnp.asarray([T, 137], jnp.int32))
    seg = np.ones((2, T), np.int32)
    seg[1, 137:] = 2
    return toks, dict(segment_ids=jnp.asarray(seg))


# longformer_tiny slow, 5.5 s: BigBird's band + global tokens, with random blocks on top, take the same sparse path
# in a model (and every pattern, forward and gradients, is tests/ops/test_sparse.py's), both default-run
@pytest.mark.parametrize("name", [pytest.param("longformer_tiny", marks=pytest.mark.slow), "bigbird_tiny",
                                  pytest.param("llama_tiny_sparse", marks=pytest.mark.slow)])  # ~8 s of compiles
def test_sparse_impl_equals_dense_forward_and_grad(name):
    cfg = _config(name)
    toks, kw = _inputs(cfg)
    weights = jnp.asarray(np.random.default_rng(2).standard_normal((2, T, cfg.vocab_size)), jnp.float32)
    _, state = random_model(cfg, seed=1)

    results = {}
    for impl in ("xla", "sparse"):
        gd, _ = random_model(_config(name, attention_impl=impl), seed=1)

        def loss(st, gd=gd):
            logits = apply(gd, st, toks, **kw)
            return jnp.sum(logits * weights) / T, logits

        results[impl] = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    ((v_x, l_x), g_x), ((v_s, l_s), g_s) = results["xla"], results["sparse"]
    assert bool(jnp.all(jnp.isfinite(l_s)))
    np.testing.assert_allclose(l_s, l_x, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(v_s, v_x, rtol=RTOL, atol=ATOL)
    flat_x, flat_s = jax.tree.leaves(g_x), jax.tree.leaves(g_s)
    assert len(flat_x) == len(flat_s) and max(float(jnp.abs(g).max()) for g in flat_x) > 1e-2
    for a, b in zip(flat_s, flat_x):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


# longformer_tiny slow, 1 s: its band and global token are a subset of BigBird's pattern (default-run)
@pytest.mark.parametrize("name", [pytest.param("longformer_tiny", marks=pytest.mark.slow), "bigbird_tiny"])
def test_one_layer_output_sees_only_window_globals_and_random_blocks(name):
    """One layer, so an output depends on exactly the tokens its query may attend to (and itself)."""
    cfg = _config(name, n_layers=1, attention_impl="sparse")
    gd, st = random_model(cfg, seed=3)
    i = 150
    left, right = cfg.sparsity.window
    allowed = np.asarray(cfg.self_attention_mask(causal=False).dense(T, T))[0, i]
    band = (np.arange(T) >= i - left) & (np.arange(T) <= i + right)
    far = [j for j in range(1, T) if not allowed[j]]  # outside window, not global, not random
    rand = [j for j in range(1, T) if allowed[j] and not band[j]]  # only via a random block
    assert far and bool(rand) == (cfg.sparsity.random_blocks is not None)

    base = np.asarray(tokens(5, (T,), vocab=cfg.vocab_size))

    def changed(j):
        row = base.copy()
        row[j] = (row[j] + 11) % cfg.vocab_size
        return row

    rows = [base, changed(far[0]), changed(far[-1]), changed(i - left), changed(0)]
    rows += [changed(j) for j in rand[:1]]
    logits = jax.jit(lambda t: apply(gd, st, t))(jnp.asarray(np.stack(rows)))
    out = np.asarray(logits)
    # masked keys get weight exactly 0: the output at i is unchanged up to nothing but exact zeros
    np.testing.assert_allclose(out[1, i], out[0, i], rtol=0, atol=1e-6)
    np.testing.assert_allclose(out[2, i], out[0, i], rtol=0, atol=1e-6)
    assert np.abs(out[3, i] - out[0, i]).max() > 1e-4  # inside the window
    assert np.abs(out[4, i] - out[0, i]).max() > 1e-4  # the global token is seen from everywhere
    assert np.abs(out[1, 0] - out[0, 0]).max() > 1e-4  # and the global query sees the far token
    if rand:
        assert np.abs(out[5, i] - out[0, i]).max() > 1e-4  # a random block outside the window


def test_presets_listed_and_random_blocks_convert():
    assert {"longformer_tiny", "bigbird_tiny"} <= set(presets.names())
    rb = RandomBlocksConfig(num_blocks=3, block_size=8, seed=5, per_head=True).to_ops(n_heads=4)
    assert (rb.num_blocks, rb.block_size, rb.seed, rb.num_heads) == (3, 8, 5, 4)
    spec = _config("bigbird_tiny").self_attention_mask(causal=False, lengths=jnp.asarray([3]))
    assert spec.window == (16, 16) and spec.global_tokens == ((0,),) and spec.random_blocks.num_heads is None
    assert spec.kv_lengths is not None and not spec.causal
    assert presets.get("gpt2_tiny").self_attention_mask(causal=True).window is None


def sparsity(**kw) -> dict:
    return dict(sparsity=kw)


@pytest.mark.parametrize("kwargs,pattern", [
    (sparsity(global_tokens=(0,)), r"sparsity\n.*global_tokens=\(0,\) needs a bounded window"),
    (sparsity(window=(None, None), global_tokens=(0,)), r"global_tokens.*window=\(None, None\)"),
    (sparsity(random_blocks=dict(num_blocks=1, block_size=4)), r"random_blocks=.* needs a bounded window"),
    (sparsity(window=(-1, 2)), r"window=\(-1, 2\) sides must be >= 0"),
    (sparsity(window=(4,)), r"sparsity.window"),
    (dict(**sparsity(window=(4, 4), global_tokens=(0, 300)), max_seq_len=256),
     r"sparsity.global_tokens.*\[300\] outside"),
    (sparsity(window=(4, 4), global_tokens=(-1,)), r"global_tokens.*\[-1\] outside"),
    (sparsity(window=(4, 4), global_tokens=(2, 2)), r"global_tokens=\(2, 2\) has repeated"),
    (sparsity(window=(4, 4), random_blocks=dict(num_blocks=-1, block_size=4)), r"num_blocks"),
    (sparsity(window=(4, 4), random_blocks=dict(num_blocks=1, block_size=0)), r"block_size"),
    (sparsity(window=(4, 4), random_blocks=dict(num_blocks=1, block_size=4, seed=-2)), r"seed"),
    (sparsity(window=(4, 4), random_blocks=dict(num_blocks=1, block_size=4, heads=2)), r"heads"),
    (dict(global_tokens=(0,)), r"global_tokens=\(0,\) needs a bounded window"),  # flat keys, migrated
])
def test_sparse_config_rejects(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ModelConfig(**kwargs)


def test_kv_cache_refuses_global_tokens_and_random_blocks():
    cfg = presets.get("llama_tiny", max_seq_len=256, **DECODER)
    gd, st = random_model(cfg, seed=0)
    toks = tokens(0, (2, 4), vocab=cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (2, 4))
    with pytest.raises(ValueError, match=r"KV cache takes no sparsity.global_tokens=\(3,\).*cache owns the mask"):
        apply(gd, st, toks, positions=pos, cache=[object()] * cfg.n_layers)
