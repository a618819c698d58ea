"""The Transformer: presets run, the properties it is known for, the KV-cache hook, scan/remat, dtypes."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxformer.model import ModelConfig, Transformer, apply, count_params, init, presets
from jaxformer.nn import KVCacheLayer
from jaxformer.ops.attention import dot_product_attention
from jaxformer.ops.masks import MaskSpec

from .helpers import TINY, B, T, key, random_model, tokens

# Same fp32 math on differently shaped / ordered work: logits are O(0.1-1), allow 1e-5 absolute.
ATOL = 1e-5


def call(japply, gd, st, cfg, toks, **kw):
    """Forward for any kind (encoder_decoder gets the same tokens as source and target)."""
    return japply(gd, st, toks, toks, **kw) if cfg.kind == "encoder_decoder" else japply(gd, st, toks, **kw)


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_initialises_and_runs_under_jit(name, tiny_models, japply):
    cfg, gd, st = tiny_models[name]
    assert sum(x.size for x in jax.tree.leaves(st)) == count_params(cfg)
    logits = call(japply, gd, st, cfg, tokens(0))
    assert logits.shape == (B, T, cfg.vocab_size) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    assert float(jnp.std(logits)) > 1e-4  # not a constant output


@pytest.mark.parametrize("name", ["gpt2_tiny", "llama_tiny", "bloom_tiny", "vaswani_tiny"])
def test_causal_output_at_t_ignores_later_tokens(name, tiny_models, japply):
    cfg, gd, st = tiny_models[name]
    t = 4
    base = tokens(1)[0]
    changed = base.at[t + 1:].set((base[t + 1:] + 7) % cfg.vocab_size)
    toks = jnp.stack([base, changed])
    if cfg.kind == "encoder_decoder":  # same source, target suffix changed
        logits = japply(gd, st, jnp.stack([base, base]), toks)
    else:
        logits = japply(gd, st, toks)
    np.testing.assert_allclose(logits[0, :t + 1], logits[1, :t + 1], rtol=0, atol=ATOL)
    assert float(jnp.abs(logits[0, t + 1:] - logits[1, t + 1:]).max()) > 1e-4


# [rope], [sinusoidal], [learned] slow, 1.4 s: each position scheme against the float64 oracle is test_oracle's
# (llama*, vaswani* / gpt2_deepnorm_sinusoidal, gpt2* and bert), a model that ignored its positions would fail there,
# and the equivariance itself is [none]'s (default-run)
@pytest.mark.parametrize("position", ["none", *(pytest.param(p, marks=pytest.mark.slow)
                                                for p in ("rope", "sinusoidal", "learned"))])
def test_encoder_permutation_equivariance_only_without_positions(position, japply):
    cfg = ModelConfig(kind="encoder", vocab_size=64, d_model=32, n_layers=2, n_heads=4, position=position,
                      max_seq_len=16, norm_position="pre", logits_softcap=3.0)
    gd, st = random_model(cfg, seed=2)
    i, j = 1, 6
    base = tokens(3, (T,), vocab=64)
    swapped = base.at[i].set(base[j]).at[j].set(base[i])
    logits = japply(gd, st, jnp.stack([base, swapped]))
    perm = np.arange(T)
    perm[[i, j]] = [j, i]
    assert float(jnp.abs(logits).max()) < 3.0  # logits soft-capped at 3 * tanh(./3)
    diff = float(jnp.abs(logits[1] - logits[0][perm]).max())
    if position == "none":
        assert diff < ATOL * 10  # outputs swap with the inputs (up to summation order)
    else:
        assert diff > 1e-3, f"position={position!r} should break permutation equivariance"


# ---------------------------------------------------------------- KV-cache hook
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ConcatCache:
    """The simplest KVCacheLayer: concatenate new keys/values, attend with a causal mask
    aligned bottom-right (query i of the chunk sits at position S - T + i)."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def empty(cls, cfg):
        shape = (B, 0, cfg.resolved_kv_heads, cfg.resolved_head_dim)
        return cls(jnp.zeros(shape), jnp.zeros(shape))

    def attend(self, q, k, v, *, scale, alibi_slopes, softcap, impl):
        del impl
        k, v = jnp.concatenate([self.k, k], axis=1), jnp.concatenate([self.v, v], axis=1)
        out = dot_product_attention(q, k, v, mask=MaskSpec(causal=True), scale=scale,
                                    alibi_slopes=alibi_slopes, softcap=softcap, impl="xla")
        return out, ConcatCache(k, v)


def restack(cfg_scanned, state):
    """Move an unscanned model's parameters into the scanned layout (blocks stacked on axis 0)."""
    gd, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg_scanned)))
    pure = nnx.to_pure_dict(state)
    for stack in ("encoder", "decoder"):
        if pure.get(stack):
            blocks = pure[stack]["blocks"]
            pure[stack]["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *[blocks[i] for i in sorted(blocks)])
    nnx.replace_by_pure_dict(abstract, pure)
    return gd, abstract


@pytest.mark.parametrize("name,scan,chunks", [
    # default-run: RoPE + GQA prefill, then one- and two-token chunks through the contiguous cache (the decode
    # tests' llama_tiny twin, tests/decode/test_kv_cache.py's [llama_tiny], is slow)
    ("llama_tiny", False, [(0, 5), (5, 6), (6, 8)]),
    ("bloom_tiny", True, [(0, 7), (7, 8)]),
    # slow, 2 s: the hook is the two cases above's; an encoder-decoder's cached decode against a reference is
    # tests/interop/test_marian.py's generation (default-run)
    pytest.param("vaswani_tiny", False, [(0, 7), (7, 8)], marks=pytest.mark.slow),
])
def test_kv_cache_hook_chunk_by_chunk_equals_full_forward(name, scan, chunks, tiny_models, japply):
    """RoPE + GQA (llama: prefill, one token, two tokens), ALiBi with a scanned stack (bloom),
    and ``decode`` of an encoder-decoder against its encoded source (sinusoidal; cross-attention
    is not cached). Each chunk's logits equal the full causal forward's."""
    cfg, gd, st = tiny_models[name]
    toks, src = tokens(4), tokens(12)
    enc_dec = cfg.kind == "encoder_decoder"
    full = japply(gd, st, src, toks) if enc_dec else japply(gd, st, toks)
    if scan:
        cfg = cfg.model_copy(update=dict(scan_layers=True))
        gd, st = restack(cfg, st)
    assert isinstance(ConcatCache.empty(cfg), KVCacheLayer)
    caches = [ConcatCache.empty(cfg)] * cfg.n_layers
    if enc_dec:
        memory = jax.jit(lambda s: nnx.merge(gd, s).encode(src))(st)
        step = jax.jit(lambda s, t, p, c: nnx.merge(gd, s).decode(t, memory, positions=p, cache=c))
    else:
        step = jax.jit(lambda s, t, p, c: apply(gd, s, t, positions=p, cache=c))
    for a, b in chunks:
        pos = jnp.broadcast_to(jnp.arange(a, b, dtype=jnp.int32), (B, b - a))
        logits, caches = step(st, toks[:, a:b], pos, caches)
        np.testing.assert_allclose(logits, full[:, a:b], rtol=0, atol=ATOL)
    assert len(caches) == cfg.n_layers and caches[0].k.shape[1] == T


# 0.7 s; packed documents (segment ids, restarting positions) against the float64 oracle are test_oracle's
# [llama_packed], [mistral_window_packed], [bloom_6heads_packed], [encoder_rope_packed] (default-run)
@pytest.mark.slow
def test_packed_sequences_equal_separate_sequences(tiny_models, japply):
    """Two documents packed in one row with segment ids and restarting positions give the
    logits each document gets alone (right padding after a document cannot leak back)."""
    cfg, gd, st = tiny_models["llama_tiny"]
    a, b = tokens(5, (5,)), tokens(6, (3,))
    pad = jnp.zeros((8,), jnp.int32)
    alone = japply(gd, st, jnp.stack([pad.at[:5].set(a), pad.at[:3].set(b)]))
    packed = jnp.stack([jnp.concatenate([a, b]), pad.at[:3].set(b)])
    seg = jnp.array([[1] * 5 + [2] * 3, [1] * 3 + [0] * 5], jnp.int32)
    pos = jnp.array([list(range(5)) + list(range(3)), list(range(8))], jnp.int32)
    logits = japply(gd, st, packed, positions=pos, segment_ids=seg)
    np.testing.assert_allclose(logits[0, :5], alone[0, :5], rtol=0, atol=ATOL)
    np.testing.assert_allclose(logits[0, 5:], alone[1, :3], rtol=0, atol=ATOL)


@pytest.mark.slow  # 1 s; a padded source against the float64 oracle (its masked keys) is test_oracle's [vaswani]
def test_encoder_decoder_ignores_padded_source(tiny_models, japply):
    cfg, gd, st = tiny_models["vaswani_tiny"]
    src, tgt = tokens(7), tokens(8)
    lengths = jnp.array([T, 5], jnp.int32)
    src2 = src.at[1, 5:].set((src[1, 5:] + 3) % cfg.vocab_size)
    l1 = japply(gd, st, src, tgt, lengths=lengths)
    l2 = japply(gd, st, src2, tgt, lengths=lengths)
    np.testing.assert_allclose(l1[1], l2[1], rtol=0, atol=ATOL)
    l3 = japply(gd, st, src2, tgt)  # without lengths the padding is attended to
    assert float(jnp.abs(l3[1] - l1[1]).max()) > 1e-4


# ---------------------------------------------------------------- scan / remat / jit / dtypes
def test_scan_and_remat_match_the_plain_stack(tiny_models, japply):
    """Loss and gradients: list + nnx.remat == scanned stack + jax.checkpoint == the plain forward."""
    cfg, gd, st = tiny_models["llama_tiny"]
    toks = tokens(9)

    def loss_and_grad(g, s):
        return jax.jit(jax.value_and_grad(lambda s_: jnp.mean(apply(g, s_, toks) ** 2)))(s)

    remat_gd = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model_copy(update=dict(remat=True)))))[0]
    loss_r, grads_r = loss_and_grad(remat_gd, st)
    scan_cfg = cfg.model_copy(update=dict(remat=True, scan_layers=True))
    scan_gd, scan_st = restack(scan_cfg, st)
    loss_s, grads_s = loss_and_grad(scan_gd, scan_st)
    # Recomputation and the scanned loop change no math, only the schedule: fp32 rounding only.
    np.testing.assert_allclose(loss_r, jnp.mean(japply(gd, st, toks) ** 2), rtol=1e-6)
    np.testing.assert_allclose(loss_s, loss_r, rtol=1e-6)
    _, grads_restacked = restack(scan_cfg, grads_r)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-7), grads_s, grads_restacked)


def test_jit_init_and_apply_equal_eager(tiny_models, japply):
    cfg, gd, st = tiny_models["bloom_tiny"]  # initialised eagerly by the fixture
    st_jit = jax.jit(lambda k: init(cfg, k)[1])(key(0))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), st_jit, st)
    toks = tokens(10)
    np.testing.assert_allclose(apply(gd, st, toks), japply(gd, st, toks), rtol=1e-5, atol=ATOL)


def test_fp32_params_bf16_compute_close_to_fp32(tiny_models, japply):
    cfg, gd, st = tiny_models["gpt2_tiny"]
    toks = tokens(11)
    ref = japply(gd, st, toks)
    gd16 = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model_copy(update=dict(compute_dtype="bfloat16")))))[0]
    out = japply(gd16, st, toks)  # same fp32 parameters
    assert out.dtype == jnp.float32 and all(x.dtype == jnp.float32 for x in jax.tree.leaves(st))
    # bf16 keeps 8 mantissa bits (relative 2^-8 ~ 0.4% per rounding); through 2 blocks and the
    # head the logits differ by 0.57% of their own scale (measured); bound 2%.
    err = float(jnp.abs(out - ref).max())
    assert err < 0.02 * float(jnp.abs(ref).max()), err
    assert err > 0.0  # bf16 really was used
    all16 = nnx.eval_shape(lambda: Transformer(cfg.model_copy(update=dict(param_dtype="bfloat16",
                                                                           compute_dtype="bfloat16"))))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(nnx.state(all16)))
    out16 = nnx.eval_shape(lambda m, t: m(t), all16, jax.ShapeDtypeStruct((B, T), jnp.int32))
    assert out16.dtype == jnp.float32


def test_deepnorm_constants_and_init():
    L = 4
    cfg = ModelConfig(kind="decoder", vocab_size=64, d_model=64, n_layers=L, n_heads=4, norm_position="deepnorm",
                      position="rope", activation="gelu")
    model = Transformer(cfg, rngs=nnx.Rngs(params=key(1)))
    alpha, beta = (2 * L) ** 0.25, (8 * L) ** -0.25  # DeepNet, decoder-only
    blocks = list(model.decoder.blocks)
    assert all(b.attn_residual.alpha == pytest.approx(alpha) and b.mlp_residual.alpha == pytest.approx(alpha)
               for b in blocks)

    def std(name):
        return float(np.std(np.concatenate([np.ravel(getattr(b.self_attn, name)[...]) for b in blocks])))

    D = 64  # Xavier normal: gain * sqrt(2 / (fan_in + fan_out)); 16k samples -> <2% sampling error
    assert std("w_q") == pytest.approx(math.sqrt(2 / (D + D)), rel=0.05)
    assert std("w_v") == pytest.approx(beta * math.sqrt(2 / (D + D)), rel=0.05)
    assert std("w_o") == pytest.approx(beta * math.sqrt(2 / (D + D)), rel=0.05)
    w_in = np.concatenate([np.ravel(b.mlp.w_in[...]) for b in blocks])
    assert float(np.std(w_in)) == pytest.approx(beta * math.sqrt(2 / (D + 4 * D)), rel=0.05)
    # encoder-decoder: encoder alpha = 0.81 (N^4 M)^(1/16), decoder alpha = (3M)^(1/4)
    ed = nnx.eval_shape(lambda: Transformer(cfg.model_copy(update=dict(kind="encoder_decoder", n_encoder_layers=3))))
    assert ed.encoder.blocks[0].attn_residual.alpha == pytest.approx(0.81 * (3 ** 4 * L) ** (1 / 16))
    assert ed.decoder.blocks[0].cross_residual.alpha == pytest.approx((3 * L) ** 0.25)


def test_xavier_init_scheme_is_deepnorms_init_with_beta_one():
    """``init_scheme: xavier`` on a Post-LN stack: Glorot normal on every projection (gain 1, alpha 1: the
    norm-placement study's init control), the embeddings at init_std; DeepNorm's own init is unchanged."""
    L, D = 4, 64
    cfg = ModelConfig(kind="decoder", vocab_size=64, d_model=D, n_layers=L, n_heads=4, norm_position="post",
                      position="rope", activation="gelu", init_scheme="xavier", init_std=0.3)
    model = Transformer(cfg, rngs=nnx.Rngs(params=key(1)))
    blocks = list(model.decoder.blocks)
    assert all(b.attn_residual.alpha == 1.0 and b.mlp_residual.alpha == 1.0 for b in blocks)

    def std(get):
        return float(np.std(np.concatenate([np.ravel(get(b)[...]) for b in blocks])))

    for name in ("w_q", "w_k", "w_v", "w_o"):  # 16k samples -> <2% sampling error
        assert std(lambda b: getattr(b.self_attn, name)) == pytest.approx(math.sqrt(2 / (D + D)), rel=0.05)
    assert std(lambda b: b.mlp.w_in) == pytest.approx(math.sqrt(2 / (D + 4 * D)), rel=0.05)
    assert float(np.std(model.embed.embedding[...])) == pytest.approx(0.3, rel=0.05)
    normal = Transformer(cfg.model_copy(update=dict(init_scheme="normal")), rngs=nnx.Rngs(params=key(1)))
    assert float(np.std(normal.decoder.blocks[0].self_attn.w_v[...])) == pytest.approx(0.3, rel=0.1)


def test_q_init_scale_folds_the_logit_scale_into_w_q_as_t5_does():
    """``attention.q_init_scale`` multiplies W_q's init std only; with ``scale=1.0`` and ``q_init_scale =
    H**-0.5`` the model starts with exactly the logits (so the outputs) of the 1/sqrt(H)-scaled one, same
    seed. Tolerance: fp32 rounding of ``(std * s) * z`` against ``s * (std * z)`` through 2 blocks, 1e-5."""
    base = presets.get("llama_tiny", init_std=0.2)
    H = base.resolved_head_dim
    folded = base.model_copy(update=dict(attention=base.attention.model_copy(
        update=dict(scale=1.0, q_init_scale=H ** -0.5))))
    plain = nnx.to_pure_dict(init(base, key(5))[1])
    gd, st = init(folded, key(5))
    fold = nnx.to_pure_dict(st)
    a, b = plain["decoder"]["blocks"][0]["self_attn"], fold["decoder"]["blocks"][0]["self_attn"]
    np.testing.assert_array_equal(a["w_k"], b["w_k"])
    np.testing.assert_allclose(b["w_q"], a["w_q"] * H ** -0.5, rtol=1e-6)
    assert float(np.std(b["w_q"])) == pytest.approx(0.2 * H ** -0.5, rel=0.1)
    toks = tokens(6)
    np.testing.assert_allclose(apply(gd, st, toks), apply(*init(base, key(5)), toks), rtol=1e-5, atol=1e-5)
    unscaled = base.model_copy(update=dict(attention=base.attention.model_copy(update=dict(scale=1.0))))
    assert not np.allclose(apply(*init(unscaled, key(5)), toks), apply(gd, st, toks), atol=1e-3)
    with pytest.raises(ValueError, match="q_init_scale"):
        base.attention.model_validate({**base.attention.model_dump(), "q_init_scale": 0.0})


# [qkv] slow, 1.5 s: shared projections through the cache are [qk]'s, and W_v = W_q (with attn_scale) against the
# float64 oracle is test_oracle's [gpt2_shared_qkv] (default-run)
@pytest.mark.parametrize("sharing", ["qk", pytest.param("qkv", marks=pytest.mark.slow)])
def test_shared_projections_and_logit_scale_through_the_kv_cache(sharing, japply):
    """Shared W_q/W_k(/W_v) and attn_scale reach the cached path too: chunks equal the full forward."""
    cfg = presets.get("llama_tiny", n_kv_heads=None, qkv_sharing=sharing, attn_scale=0.5)
    gd, st = init(cfg, key(3))
    attn = nnx.to_pure_dict(st)["decoder"]["blocks"][0]["self_attn"]
    assert "w_k" not in attn and ("w_v" in attn) == (sharing == "qk")
    assert sum(x.size for x in jax.tree.leaves(st)) == count_params(cfg)
    toks = tokens(5)
    full = japply(gd, st, toks)
    caches = [ConcatCache.empty(cfg)] * cfg.n_layers
    step = jax.jit(lambda s, t, p, c: apply(gd, s, t, positions=p, cache=c))
    for a, b in [(0, 6), (6, 8)]:
        pos = jnp.broadcast_to(jnp.arange(a, b, dtype=jnp.int32), (B, b - a))
        logits, caches = step(st, toks[:, a:b], pos, caches)
        np.testing.assert_allclose(logits, full[:, a:b], rtol=0, atol=ATOL)


# ---------------------------------------------------------------- options for loading published checkpoints
BERT_TINY = dict(kind="encoder", vocab_size=64, d_model=32, n_layers=2, n_heads=4, activation="gelu",
                 norm_position="post", embed_norm=True, position="learned", max_seq_len=16, use_bias=True,
                 type_vocab_size=2, head_transform=True, head_bias=True, tie_embeddings=True)


def test_checkpoint_option_parameters_names_shapes_and_axes():
    cfg = ModelConfig(**BERT_TINY)
    _, st = nnx.split(nnx.eval_shape(lambda: Transformer(cfg)))
    flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(st)}
    want = {"type_embed.embedding": ((2, 32), ("vocab", "embed")),
            "head_transform.w": ((32, 32), ("embed", None)), "head_transform.b": ((32,), ("embed",)),
            "head_transform.norm.scale": ((32,), ("embed",)), "head_transform.norm.bias": ((32,), ("embed",)),
            "logits_bias": ((64,), ("vocab",))}
    for name, (shape, axes) in want.items():
        assert flat[name].shape == shape and tuple(flat[name].get_metadata()["out_sharding"]) == axes, name
    assert sum(v.size for v in flat.values()) == count_params(cfg)
    # Qwen2's layout: biases on q, k, v only (self-attention and, in an encoder-decoder, cross-attention)
    qwen = nnx.to_pure_dict(nnx.split(nnx.eval_shape(lambda: Transformer(presets.get(
        "vaswani_tiny", use_bias=False, qkv_bias=True))))[1])
    for attn in (qwen["decoder"]["blocks"][0]["self_attn"], qwen["decoder"]["blocks"][0]["cross_attn"]):
        assert {k for k in attn if k.startswith("b_")} == {"b_q", "b_k", "b_v"}
    assert "bias" not in qwen["decoder"]["blocks"][0]["mlp_residual"]["norm"]


# 3.5 s; token types given and defaulted against the float64 oracle (test_oracle's [bert], [bert_default_types]),
# and encode's hidden states and the logits against transformers (tests/interop/test_bert.py) are default-run
@pytest.mark.slow
def test_token_types_default_zero_and_head_transform_only_in_logits(japply):
    cfg = ModelConfig(**BERT_TINY)
    gd, st = random_model(cfg, seed=4)
    toks = tokens(6, vocab=64)
    zeros = jnp.zeros_like(toks)
    ones = jnp.ones_like(toks)
    default = japply(gd, st, toks)
    np.testing.assert_array_equal(japply(gd, st, toks, token_types=zeros), default)
    assert float(jnp.abs(japply(gd, st, toks, token_types=ones) - default).max()) > 1e-3
    # encode returns the last hidden states; logits applies the head transform, the head and the bias
    model = nnx.merge(gd, st)
    hidden = model.encode(toks, token_types=ones)
    assert hidden.shape == (B, T, 32)
    np.testing.assert_allclose(model.logits(hidden), japply(gd, st, toks, token_types=ones), rtol=1e-5, atol=1e-5)


@pytest.mark.no_typecheck
def test_token_types_errors():
    bert = nnx.eval_shape(lambda: Transformer(ModelConfig(**BERT_TINY)))
    gpt = nnx.eval_shape(lambda: Transformer(presets.get("gpt2_tiny")))
    t = jax.ShapeDtypeStruct((2, 5), "int32")
    with pytest.raises(ValueError, match=r"token_types given to a model with config.hf_options.type_vocab_size=0"):
        nnx.eval_shape(lambda m, t, y: m(t, token_types=y), gpt, t, t)
    with pytest.raises(ValueError, match=r"token_types.shape=\(2, 4\) must be \[B, T\] for tokens.shape=\(2, 5\)"):
        nnx.eval_shape(lambda m, t, y: m(t, token_types=y), bert, t, jax.ShapeDtypeStruct((2, 4), "int32"))
    with pytest.raises(ValueError, match=r"token_types must be an integer array; got dtype float32"):
        nnx.eval_shape(lambda m, t, y: m(t, token_types=y), bert, t, jax.ShapeDtypeStruct((2, 5), "float32"))
