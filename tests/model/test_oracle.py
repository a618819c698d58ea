"""A whole-model oracle: every preset family's logits against a float64 numpy forward written from the papers.

The oracle below reads only the parameter tree (``nnx.to_pure_dict`` of the model's state: names
and layouts) and ``ModelConfig`` fields. It imports nothing from ``jaxformer.nn`` or
``jaxformer.ops``: norms, RoPE, ALiBi slopes, sinusoidal tables, GELU, GQA grouping, masks,
residual placement and DeepNorm's alpha are all written out again here, from

* Vaswani et al. 2017 (post-LN, sinusoidal table sin/cos interleaved, sqrt(d) embedding scale,
  shared source/target/output embedding, encoder-decoder cross-attention);
* Radford et al. 2019 / GPT-2 (pre-LN, learned positions, tanh-GELU, final LN);
* Touvron et al. 2023 / LLaMA (RMSNorm, RoPE half-split pairing, SwiGLU; Ainslie et al. 2023 GQA);
* Press et al. 2022 / BLOOM (ALiBi slopes incl. non-power-of-two heads, LN after the embedding);
* Su et al. 2021 (RoFormer, interleaved pairing), Shazeer 2020 (GeGLU), Xiong et al. 2020
  and Ding et al. 2021 (sandwich norm), Wang et al. 2022 (DeepNet alpha);
* Beltagy et al. 2020 / Zaheer et al. 2020 (Longformer band + global tokens; BigBird's random blocks
  only in the case where they cover every key block, since the draw itself is the library's hash);
  Jiang et al. 2023 / Mistral (sliding window: query i sees keys i-W < j <= i);
* the Hugging Face layouts loaded by ``jaxformer.interop``: Devlin et al. 2019 / BERT (token-type
  embeddings, LayerNorm(word + position + type), the MLM head's dense+act+LayerNorm transform and
  output bias), Qwen2 (biases on q, k, v only), Marian / tensor2tensor (sinusoids in two halves,
  sin then cos; ``final_logits_bias``).

Parameters are re-drawn from N(0, 0.3^2) (numpy) so norm scales and biases are far from 1 / 0,
and two cases draw the input tables at std 1e-3 so that the first norm's mean(x^2) / variance is
~eps (RMSNorm) or below it (LayerNorm): eps's placement then shows in the logits.
Every parameter leaf must be consumed by the oracle (a parameter the model has and the papers do
not is a failure, and so is one the oracle needs that the tree lacks).
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from flax import nnx

from jaxformer.model import abstract_init, apply, presets

# Measured (CPU, fp32 model vs this float64 oracle), max |model - oracle| / max |oracle| per case:
# 3.5e-7 .. 8.9e-7 (worst: encoder_rope_packed; max |logit| 2.5-4.4). REL_TOL is ~11x the worst.
# The seeded bugs tried against it gave 2.4e-5 (LayerNorm eps dropped, seen only by `bloom`) to 18
# (final norm dropped); the one closest to the tolerance is also caught at 0.29 by
# `gpt2_untied_tiny_inputs`.
REL_TOL = 1e-5

_erf = np.vectorize(math.erf, otypes=[np.float64])


# ---------------------------------------------------------------------------- parameters
class Params:
    """A nested dict of float64 leaves that records which leaves were read."""

    def __init__(self, tree, prefix=(), used=None):
        self._tree, self._prefix = tree, prefix
        self.used = set() if used is None else used

    def __contains__(self, key):
        return str(key) in self._tree

    def __getitem__(self, key):
        v = self._tree[str(key)]
        path = self._prefix + (str(key),)
        if isinstance(v, dict):
            return Params(v, path, self.used)
        self.used.add(path)
        return v

    def keys(self):
        return self._tree.keys()


def leaf_paths(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from leaf_paths(v, prefix + (str(k),))
        else:
            yield prefix + (str(k),)


def to_float64_dict(tree):
    return {str(k): to_float64_dict(v) if isinstance(v, dict) else np.asarray(v, np.float64)
            for k, v in tree.items()}


def random_state(cfg, seed, std=0.3, small=()):
    """``(graphdef, state)`` with every leaf from N(0, std^2) by numpy (no compiled init);
    leaves whose dotted path starts with an entry of ``small`` get std 1e-3."""
    graphdef, state = abstract_init(cfg)
    rng = np.random.default_rng(seed)
    hit = set()

    def fill(path, leaf):
        name = ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
        tiny = {p for p in small if name.startswith(p)}
        hit.update(tiny)
        return np.asarray((1e-3 if tiny else std) * rng.standard_normal(leaf.shape), leaf.dtype)

    state = jax.tree_util.tree_map_with_path(fill, state)
    assert hit == set(small), f"no parameter under {set(small) - hit}"
    return graphdef, state


# ---------------------------------------------------------------------------- the oracle (float64 numpy)
def norm(cfg, p, x):
    """LayerNorm (Ba et al. 2016) or RMSNorm (Zhang & Sennrich 2019) over the last axis."""
    eps = cfg.norm.eps
    if cfg.norm.kind == "rmsnorm":
        assert "bias" not in p, "RMSNorm has no bias"
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * p["scale"]
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps) * p["scale"]
    if cfg.use_bias:
        y = y + p["bias"]
    return y


def gelu(x):
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def silu(x):
    return x / (1.0 + np.exp(-x))


ACT = {"identity": lambda x: x, "relu": lambda x: np.maximum(x, 0.0), "gelu": gelu, "gelu_tanh": gelu_tanh, "silu": silu,
       "swiglu": silu, "geglu": gelu}


def sinusoid_table(pos, d, layout="interleaved"):
    """PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(p / 10000^(2i/d))  (Vaswani §3.5);
    "halves" (tensor2tensor's get_timing_signal_1d, Marian): PE(p, i) = sin, PE(p, d/2 + i) = cos."""
    pe = np.zeros(pos.shape + (d,))
    for i in range(d // 2):
        angle = pos / 10000.0 ** (2 * i / d)
        sin_at, cos_at = (2 * i, 2 * i + 1) if layout == "interleaved" else (i, d // 2 + i)
        pe[..., sin_at], pe[..., cos_at] = np.sin(angle), np.cos(angle)
    return pe


def rope(cfg, x, pos):
    """Rotate ``x [B, T, n, H]``: pair j (of H/2) turns by pos * base^(-2j/H) (RoFormer eq. 15)."""
    H = x.shape[-1]
    theta = np.array([cfg.positions.rope_base ** (-2.0 * j / H) for j in range(H // 2)])
    if cfg.positions.rope_scaling is not None:
        assert cfg.positions.rope_scaling.kind == "linear", "oracle knows only linear position interpolation"
        theta = theta / cfg.positions.rope_scaling.factor   # Chen et al. 2023: position p acts as p / s
    ang = pos[:, :, None, None] * theta           # [B, T, 1, H/2]
    c, s = np.cos(ang), np.sin(ang)
    if cfg.positions.rope_interleaved:                      # GPT-J: pairs (2j, 2j+1)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out
    a, b = x[..., : H // 2], x[..., H // 2:]      # GPT-NeoX / LLaMA: pairs (j, j + H/2)
    return np.concatenate([a * c - b * s, a * s + b * c], -1)


def alibi_slopes(n):
    """Press et al.'s reference code: geometric from 2^(-8/n); non-powers of two take the
    closest smaller power 2^k's slopes then every other slope of 2^(k+1)'s."""
    def geometric(m):
        start = 2.0 ** (-8.0 / m)
        return [start ** (i + 1) for i in range(m)]
    if math.log2(n).is_integer():
        return np.array(geometric(n))
    c = 2 ** math.floor(math.log2(n))
    return np.array(geometric(c) + geometric(2 * c)[0::2][: n - c])


def attention(cfg, p, x, ctx, *, allowed, q_pos=None, k_pos=None, self_attn=True):
    """Multi-head / grouped-query attention; ``allowed [B, T, S]`` bool (False rows give zeros)."""
    # Shared projections (self-attention only): "qk" keys from W_q (Reformer), "qkv" values too.
    share = cfg.attention.qkv_sharing if self_attn else "none"
    wk, bk = ("w_q", "b_q") if share in ("qk", "qkv") else ("w_k", "b_k")
    wv, bv = ("w_q", "b_q") if share == "qkv" else ("w_v", "b_v")
    q = np.einsum("btd,dnh->btnh", x, p["w_q"])
    k = np.einsum("bsd,dkh->bskh", ctx, p[wk])
    v = np.einsum("bsd,dkh->bskh", ctx, p[wv])
    if cfg.use_bias if cfg.attention.qkv_bias is None else cfg.attention.qkv_bias:   # Qwen2: q/k/v biases without use_bias
        q, k, v = q + p["b_q"], k + p[bk], v + p[bv]
    N, K, H = q.shape[2], k.shape[2], q.shape[3]
    assert (N, K) == (cfg.attention.n_heads, cfg.attention.n_kv_heads or cfg.attention.n_heads)
    if self_attn and cfg.positions.kind == "rope":
        q, k = rope(cfg, q, q_pos), rope(cfg, k, k_pos)
    # GQA: query head n reads kv head n // (N / K) (consecutive query heads share one kv head).
    k, v = np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2)
    s = np.einsum("btnh,bsnh->bnts", q, k) * (1.0 / math.sqrt(H) if cfg.attention.scale is None else cfg.attention.scale)
    if cfg.attention.softcap is not None:
        s = cfg.attention.softcap * np.tanh(s / cfg.attention.softcap)
    if self_attn and cfg.positions.kind == "alibi":
        # |i - j| in token positions. (The library measures ALiBi distance in row indices and
        # ignores `positions`; the two agree whenever positions are contiguous within a
        # document, as in every case here.)
        dist = np.abs(q_pos[:, None, :, None] - k_pos[:, None, None, :])
        s = s - alibi_slopes(N)[None, :, None, None] * dist
    m = allowed[:, None]
    s = np.where(m, s, -np.inf)
    smax = np.max(np.where(m, s, -1e300), -1, keepdims=True)
    e = np.where(m, np.exp(s - smax), 0.0)
    den = e.sum(-1, keepdims=True)
    w = np.divide(e, den, out=np.zeros_like(e), where=den > 0)
    o = np.einsum("bnts,bsnh->btnh", w, v)
    y = np.einsum("btnh,nhd->btd", o, p["w_o"])
    return y + p["b_o"] if cfg.use_bias else y


def mlp(cfg, p, x):
    act = ACT[cfg.ffn.activation]
    if cfg.ffn.activation in ("swiglu", "geglu"):     # Shazeer 2020: act(x W) * (x V), then W2
        g, u = x @ p["w_gate"], x @ p["w_up"]
        if cfg.use_bias:
            g, u = g + p["b_gate"], u + p["b_up"]
        y = (act(g) * u) @ p["w_down"]
        return y + p["b_down"] if cfg.use_bias else y
    h = x @ p["w_in"]
    h = act(h + p["b_in"] if cfg.use_bias else h)
    y = h @ p["w_out"]
    return y + p["b_out"] if cfg.use_bias else y


def residual(cfg, p, x, branch, alpha):
    """pre: x + Lb(f(Ln x)); post: Ln(x + f(x)); deepnorm: Ln(alpha x + f(x)) (Lb: sandwich only)."""
    # residual=False (the residuals study): the same without the identity path
    keep = 1.0 if cfg.residual else 0.0
    if cfg.norm.placement == "pre":
        h = branch(norm(cfg, p["norm"], x))
        if cfg.norm.sandwich:
            h = norm(cfg, p["branch_norm"], h)
        return keep * x + h
    a = alpha if cfg.norm.placement == "deepnorm" else 1.0
    h = branch(x)
    if cfg.norm.sandwich:
        h = norm(cfg, p["branch_norm"], h)
    return norm(cfg, p["norm"], keep * a * x + h)


def deepnet_alpha(cfg, which):
    """DeepNet (Wang et al. 2022) Fig. 2: alpha for the encoder / decoder stack."""
    if cfg.kind == "encoder_decoder":
        N, M = cfg.n_encoder_layers, cfg.n_layers
        return 0.81 * (N ** 4 * M) ** (1 / 16) if which == "encoder" else (3 * M) ** 0.25
    return (2 * cfg.n_layers) ** 0.25


def layer(stack, i, n):
    """Block i of n: ``blocks.<i>`` (a list), or slice i of every leaf's leading ``[n]`` axis
    (``scan_layers``; reads are recorded against the stacked leaf's path)."""
    blocks = stack["blocks"]
    if "0" in blocks:
        assert set(blocks.keys()) == {str(k) for k in range(n)}
        return blocks[str(i)]

    def take(t):
        if isinstance(t, dict):
            return {k: take(v) for k, v in t.items()}
        assert t.shape[0] == n, t.shape
        return t[i]
    return Params(take(blocks._tree), blocks._prefix, blocks.used)


def embed(cfg, P, tokens, pos, token_types=None):
    x = P["embed"]["embedding"][tokens]
    if cfg.scale_embeddings:
        x = x * math.sqrt(cfg.d_model)
    if cfg.hf_options.type_vocab_size:                       # BERT: word + position + token type, then LayerNorm
        types = np.zeros_like(tokens) if token_types is None else np.asarray(token_types)
        x = x + P["type_embed"]["embedding"][types]
    if cfg.positions.kind == "sinusoidal":
        x = x + sinusoid_table(pos.astype(np.float64), cfg.d_model, cfg.positions.sinusoidal_layout)
    elif cfg.positions.kind == "learned":
        x = x + P["pos_embed"]["embedding"][np.clip(pos, 0, cfg.max_seq_len - 1)]
    if cfg.norm.embed:
        x = norm(cfg, P["embed_norm"], x)
    return x


def has_final_norm(cfg):
    return cfg.norm.final if cfg.norm.final is not None else cfg.norm.placement == "pre"


def sparse_allowed(cfg, T):
    """Longformer / BigBird widening of the band: band OR global query OR global key (OR random)."""
    if cfg.sparsity.window is None or cfg.sparsity.window == (None, None):
        return np.ones((1, T, T), bool)
    left, right = cfg.sparsity.window
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    ok = np.ones((T, T), bool)
    if left is not None:
        ok &= j >= i - left
    if right is not None:
        ok &= j <= i + right
    g = np.isin(np.arange(T), cfg.sparsity.global_tokens)
    ok |= g[:, None] | g[None, :]
    if cfg.sparsity.random_blocks is not None and cfg.sparsity.random_blocks.num_blocks > 0:
        assert cfg.sparsity.random_blocks.num_blocks >= -(-T // cfg.sparsity.random_blocks.block_size), \
            "the oracle only knows random blocks that cover every key block"
        ok[:] = True
    return ok[None]


def stack(cfg, P, x, *, which, allowed, pos, ctx=None, cross_allowed=None):
    alpha = deepnet_alpha(cfg, which) if cfg.norm.placement == "deepnorm" else 1.0
    n = cfg.n_layers if which == "decoder" or cfg.kind == "encoder" else cfg.n_encoder_layers
    for i in range(n):
        b = layer(P, i, n)
        x = residual(cfg, b["attn_residual"], x,
                     lambda h, b=b: attention(cfg, b["self_attn"], h, h, allowed=allowed, q_pos=pos, k_pos=pos),
                     alpha)
        if ctx is not None:
            x = residual(cfg, b["cross_residual"], x,
                         lambda h, b=b: attention(cfg, b["cross_attn"], h, ctx, allowed=cross_allowed,
                                                  self_attn=False),
                         alpha)
        x = residual(cfg, b["mlp_residual"], x, lambda h, b=b: mlp(cfg, b["mlp"], h), alpha)
    if has_final_norm(cfg):
        x = norm(cfg, P["final_norm"], x)
    return x


def _pos(positions, B, T):
    return np.broadcast_to(np.arange(T) if positions is None else np.asarray(positions), (B, T))


def _segments(seg, B, T):
    return np.zeros((B, T), int) if seg is None else np.asarray(seg)


def encode(cfg, P, tokens, positions=None, segment_ids=None, lengths=None, token_types=None):
    B, S = tokens.shape
    pos, seg = _pos(positions, B, S), _segments(segment_ids, B, S)
    allowed = (seg[:, :, None] == seg[:, None, :]) & sparse_allowed(cfg, S)
    if lengths is not None:
        allowed = allowed & (np.arange(S)[None, None, :] < np.asarray(lengths)[:, None, None])
    return stack(cfg, P["encoder"], embed(cfg, P, tokens, pos, token_types), which="encoder", allowed=allowed,
                 pos=pos)


def oracle_logits(cfg, tree, tokens, tgt=None, *, positions=None, segment_ids=None, lengths=None,
                  tgt_positions=None, tgt_segment_ids=None, token_types=None):
    """float64 logits [B, T, V] for ``apply(graphdef, state, tokens, tgt, ...)``; also returns
    the set of parameter paths never read."""
    P = Params(to_float64_dict(tree))
    tokens = np.asarray(tokens)
    if cfg.kind == "encoder":
        x = encode(cfg, P, tokens, positions, segment_ids, lengths, token_types)
    else:
        memory, cross_allowed = None, None
        if cfg.kind == "encoder_decoder":
            memory = encode(cfg, P, tokens, positions, segment_ids, lengths, token_types)
            B, S = tokens.shape
            T = np.shape(tgt)[1]
            cross_allowed = np.ones((B, T, S), bool)
            if segment_ids is not None:      # a target document reads its own source document
                cross_allowed &= (_segments(tgt_segment_ids, B, T)[:, :, None]
                                  == np.asarray(segment_ids)[:, None, :])
            if lengths is not None:          # source padding
                cross_allowed &= np.arange(S)[None, None, :] < np.asarray(lengths)[:, None, None]
            tokens, positions, segment_ids = np.asarray(tgt), tgt_positions, tgt_segment_ids
            token_types = None                  # the target takes token type 0
        B, T = tokens.shape
        pos, seg = _pos(positions, B, T), _segments(segment_ids, B, T)
        i, j = np.arange(T)[:, None], np.arange(T)[None, :]
        allowed = (j <= i)[None] & (seg[:, :, None] == seg[:, None, :]) & sparse_allowed(cfg, T)
        x = stack(cfg, P["decoder"], embed(cfg, P, tokens, pos, token_types), which="decoder", allowed=allowed,
                  pos=pos, ctx=memory, cross_allowed=cross_allowed)
    if cfg.hf_options.head_transform:                        # BERT's cls.predictions.transform: LN(act(x W + b))
        h = x @ P["head_transform"]["w"]
        x = norm(cfg, P["head_transform"]["norm"], ACT[cfg.ffn.activation](h + P["head_transform"]["b"]
                                                                       if cfg.use_bias else h))
    if cfg.tie_embeddings:
        logits = x @ P["embed"]["embedding"].T
    else:
        logits = x @ P["head"]["kernel"]
    if cfg.hf_options.head_bias:                             # BERT's cls.predictions.bias, Marian's final_logits_bias
        logits = logits + P["logits_bias"]
    if cfg.logits_softcap is not None:
        logits = cfg.logits_softcap * np.tanh(logits / cfg.logits_softcap)
    unused = set(leaf_paths(P._tree)) - P.used
    return logits, unused


# ---------------------------------------------------------------------------- cases
B, T, S_SRC, T_TGT = 2, 12, 10, 8


def _packed(lengths_per_row, T):
    """segment ids (1, 2, ...) and positions restarting at 0 in each document."""
    seg = np.zeros((len(lengths_per_row), T), np.int32)
    pos = np.zeros((len(lengths_per_row), T), np.int32)
    for b, docs in enumerate(lengths_per_row):
        start = 0
        for d, n in enumerate(docs):
            seg[b, start:start + n] = d + 1
            pos[b, start:start + n] = np.arange(n)
            start += n
        assert start == T
    return seg, pos


SEG, POS = _packed([(5, 7), (3, 4, 5)], T)
SRC_SEG, SRC_POS = _packed([(4, 6), (7, 3)], S_SRC)
TGT_SEG, TGT_POS = _packed([(3, 5), (6, 2)], T_TGT)
LENGTHS = np.array([T, 7], np.int32)
SRC_LENGTHS = np.array([S_SRC, 6], np.int32)
TYPES = np.array([[0] * 5 + [1] * 7, [0] * 3 + [1] * 9], np.int32)   # BERT sentence A / B
SRC_TYPES = np.array([[0, 1, 2] * 3 + [0], [2] * S_SRC], np.int32)
# BERT-base's layout at tiny size: post-LN encoder, learned positions, exact GELU, biases, LayerNorm
# after the (word + position + type) embedding, MLM head transform and output bias, tied.
BERT = dict(kind="encoder", norm_position="post", embed_norm=True, activation="gelu", type_vocab_size=2,
            head_transform=True, head_bias=True, norm_eps=1e-12)

# id: (preset, overrides, call kwargs, parameter paths drawn tiny)
CASES = {
    # decoder, RoPE half-split, GQA 4:2, SwiGLU, RMSNorm pre + final, untied head
    "llama": ("llama_tiny", {}, {}, ()),
    # same with packed documents: segment ids + positions restarting per document
    "llama_packed": ("llama_tiny", {}, dict(segment_ids=SEG, positions=POS), ()),
    # RoPE interleaved + base 500 + linear scaling, MQA, GeGLU, sandwich norm, attention and logit
    # soft-caps, scanned layers, and an embedding of std 1e-3 (the first RMSNorm's mean(x^2) ~ eps)
    "llama_variant": ("llama_tiny", dict(rope_interleaved=True, rope_base=500.0, n_kv_heads=1,
                                         rope_scaling=dict(kind="linear", factor=2.0),
                                         activation="geglu", sandwich_norm=True, attn_softcap=2.0,
                                         logits_softcap=4.0, scan_layers=True), {}, ("embed.",)),
    # shared-QK projections (W_k = W_q, Reformer) with RoPE, MHA, and an unscaled logit (attn_scale 1)
    "llama_shared_qk_unscaled": ("llama_tiny", dict(n_kv_heads=None, qkv_sharing="qk", attn_scale=1.0), {}, ()),
    # Qwen2: biases on q, k, v only (use_bias=False), with GQA and a sliding window (2, 0) (W = 3 < T)
    "qwen2_window": ("llama_tiny", dict(qkv_bias=True, attention_window=(2, 0)), {}, ()),
    # Mistral's sliding window W = 4 (band (3, 0); right side moot under causality) with packed documents
    "mistral_window_packed": ("llama_tiny", dict(attention_window=(3, 5)), dict(segment_ids=SEG, positions=POS), ()),
    # decoder, learned positions, LayerNorm pre + final, tanh-GELU, tied, biases
    "gpt2": ("gpt2_tiny", {}, {}, ()),
    # biases on the output projections, MLP and norms but not on q, k, v; token types in a decoder
    "gpt2_no_qkv_bias_types": ("gpt2_tiny", dict(qkv_bias=False, type_vocab_size=3),
                               dict(token_types=np.minimum(TYPES * 2, 2)), ()),
    # W_k = W_v = W_q with biases (one b_q too), logit scale 0.3
    "gpt2_shared_qkv": ("gpt2_tiny", dict(qkv_sharing="qkv", attn_scale=0.3), {}, ()),
    # no residual paths, pre-LN with sandwich norm, and a linear FFN (identity activation)
    "gpt2_no_residual_linear": ("gpt2_tiny", dict(residual=False, sandwich_norm=True, activation="identity"),
                                {}, ()),
    # no residual paths in a post-LN stack
    "gpt2_post_no_residual": ("gpt2_tiny", dict(residual=False, norm_position="post"), {}, ()),
    # the same untied, with token and position tables of std 1e-3: the first LayerNorm's variance
    # (~2e-6) is below eps (1e-5), so eps's placement shows in the logits
    "gpt2_untied_tiny_inputs": ("gpt2_tiny", dict(tie_embeddings=False), {}, ("embed.", "pos_embed.")),
    # decoder, sinusoidal positions, DeepNorm (alpha = (2M)^1/4, no final norm), exact GELU
    "gpt2_deepnorm_sinusoidal": ("gpt2_tiny", dict(position="sinusoidal", norm_position="deepnorm",
                                                   activation="gelu"), {}, ()),
    # decoder, ALiBi (4 heads), LayerNorm after the embedding
    "bloom": ("bloom_tiny", {}, {}, ()),
    # ALiBi with 6 heads (non-power-of-two slopes), N*H != D, packed documents
    "bloom_6heads_packed": ("bloom_tiny", dict(n_heads=6, head_dim=8),
                            dict(segment_ids=SEG, positions=POS), ()),
    # BERT (bert-base layout) with sentence A/B token types and right padding; and with the default types
    "bert": ("gpt2_tiny", BERT, dict(token_types=TYPES, lengths=LENGTHS), ()),
    "bert_default_types": ("gpt2_tiny", BERT, {}, ()),
    # head transform with RMSNorm and no biases, output bias on an untied head, SiLU, qkv biases alone
    "encoder_head_transform_rms": ("llama_tiny", dict(kind="encoder", activation="silu", head_transform=True,
                                                      head_bias=True, qkv_bias=True, type_vocab_size=2),
                                   dict(token_types=TYPES), ()),
    # encoder (bidirectional), RoPE, RMSNorm; right padding and packed documents
    "encoder_rope_padded": ("llama_tiny", dict(kind="encoder"), dict(lengths=LENGTHS), ()),
    "encoder_rope_packed": ("llama_tiny", dict(kind="encoder"), dict(segment_ids=SEG, positions=POS), ()),
    # Longformer encoder: learned positions, band (3, 2) + global position 0, right padding
    "longformer": ("longformer_tiny", dict(attention_window=(3, 2)), dict(lengths=LENGTHS), ()),
    # BigBird encoder: band (1, 1) + global 0 + random blocks that cover every key block
    "bigbird": ("bigbird_tiny", dict(attention_window=(1, 1),
                                     random_blocks=dict(num_blocks=3, block_size=4)), {}, ()),
    # encoder-decoder: sinusoidal, post-LN (no final norm), ReLU, sqrt(d) embedding scale, shared
    # embedding; source padding
    "vaswani": ("vaswani_tiny", {}, dict(lengths=SRC_LENGTHS), ()),
    # Marian: sinusoids in halves, final_logits_bias; source token types (the target takes type 0)
    "marian_halves": ("vaswani_tiny", dict(sinusoidal_layout="halves", head_bias=True, type_vocab_size=3),
                      dict(lengths=SRC_LENGTHS, token_types=SRC_TYPES), ()),
    # qkv biases on (cross-)attention of an encoder-decoder without any other bias
    "vaswani_qkv_bias_only": ("vaswani_tiny", dict(use_bias=False, qkv_bias=True), {}, ()),
    # shared-QK self-attention in encoder and decoder; cross-attention keeps its own W_k, W_v
    "vaswani_shared_qk": ("vaswani_tiny", dict(qkv_sharing="qk"), dict(lengths=SRC_LENGTHS), ()),
    # encoder-decoder with DeepNorm (alpha_enc = 0.81 (N^4 M)^1/16, alpha_dec = (3M)^1/4) and packed
    # source and target documents (cross-attention within the same document)
    "vaswani_deepnorm_packed": ("vaswani_tiny", dict(norm_position="deepnorm"),
                                dict(segment_ids=SRC_SEG, positions=SRC_POS, tgt_segment_ids=TGT_SEG,
                                     tgt_positions=TGT_POS), ()),
}

_japply = jax.jit(apply, static_argnums=0)


def run_case(name, seed=0):
    """``(model logits, oracle logits, unused parameter paths)`` for CASES[name]."""
    preset, overrides, kw, small = CASES[name]
    cfg = presets.get(preset, **overrides)
    graphdef, state = random_state(cfg, seed, small=small)
    rng = np.random.default_rng(seed + 1)
    if cfg.kind == "encoder_decoder":
        src = rng.integers(0, cfg.vocab_size, (B, S_SRC)).astype(np.int32)
        tgt = rng.integers(0, cfg.vocab_size, (B, T_TGT)).astype(np.int32)
        args = (src, tgt)
    else:
        args = (rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32),)
    got = np.asarray(_japply(graphdef, state, *args, **kw), np.float64)
    want, unused = oracle_logits(cfg, nnx.to_pure_dict(state), *args, **kw)
    return got, want, unused


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_float64_oracle(name):
    got, want, unused = run_case(name)
    assert not unused, f"parameters the oracle (the papers) has no use for: {sorted(unused)}"
    assert got.shape == want.shape
    scale = np.max(np.abs(want))
    assert scale > 0.1 and np.std(want, axis=(0, 1)).mean() > 1e-3 * scale   # a real, varying output
    err = np.max(np.abs(got - want)) / scale
    assert err < REL_TOL, f"{name}: max |model - oracle| / max |oracle| = {err:.2e} (tolerance {REL_TOL:.0e})"


# ---------------------------------------------------------------- gradients of the checkpoint-loading options
# (case, parameter paths whose gradient is checked). Each gradient is checked along 2 random unit
# directions d against the float64 oracle's central difference (L(p + e d) - L(p - e d)) / 2e, e = 1e-4,
# of L = sum(logits * w) with fixed random w. The difference's own error (e^2 L''' ~ 1e-8) is far
# below the fp32 model gradient's rounding. Error relative to |grad| (the largest directional
# derivative) measured 3e-10 .. 1.7e-7 on these cases (CPU); GRAD_TOL is ~60x the worst.
GRAD_CASES = {
    "bert": ("type_embed.embedding", "head_transform.w", "head_transform.b", "head_transform.norm.scale",
             "head_transform.norm.bias", "logits_bias"),
    "qwen2_window": ("decoder.blocks.0.self_attn.b_q", "decoder.blocks.0.self_attn.b_v",
                     "decoder.blocks.1.self_attn.b_v", "decoder.blocks.0.self_attn.w_q"),
    "marian_halves": ("type_embed.embedding", "logits_bias", "decoder.blocks.0.cross_attn.b_v"),
}
GRAD_TOL = 1e-5


def _get(tree, path):
    for k in path.split("."):
        tree = tree[k if k in tree else int(k)]
    return tree


def _set(tree, path, value):
    *head, last = path.split(".")
    parent = _get(tree, ".".join(head)) if head else tree
    parent[last if last in parent else int(last)] = value


# [marian_halves] slow, 3.5 s: token-type and output-bias gradients are [bert]'s, an attention bias's [qwen2_window]'s,
# and its forward is test_logits_match_float64_oracle[marian_halves] (default-run)
@pytest.mark.parametrize("name", [n if n != "marian_halves" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in GRAD_CASES])
def test_gradients_match_float64_oracle_differences(name):
    preset, overrides, kw, small = CASES[name]
    cfg = presets.get(preset, **overrides)
    graphdef, state = random_state(cfg, 0, small=small)
    rng = np.random.default_rng(7)
    if cfg.kind == "encoder_decoder":
        args = (rng.integers(0, cfg.vocab_size, (B, S_SRC)).astype(np.int32),
                rng.integers(0, cfg.vocab_size, (B, T_TGT)).astype(np.int32))
    else:
        args = (rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32),)
    T_out = np.shape(args[-1])[1]
    w = rng.standard_normal((B, T_out, cfg.vocab_size))

    def model_loss(st):
        return (apply(graphdef, st, *args, **kw) * w.astype(np.float32)).sum()

    grads = nnx.to_pure_dict(jax.jit(jax.grad(model_loss))(state))
    pure = to_float64_dict(nnx.to_pure_dict(state))

    def oracle_loss(tree):
        return float((oracle_logits(cfg, tree, *args, **kw)[0] * w).sum())

    eps = 1e-4
    for path in GRAD_CASES[name]:
        p0, g = _get(pure, path), np.asarray(_get(grads, path), np.float64)
        assert np.abs(g).max() > 1e-3, f"{path}: a vanishing gradient tests nothing"
        for _ in range(2):
            d = rng.standard_normal(p0.shape)
            d /= np.linalg.norm(d)
            _set(pure, path, p0 + eps * d)
            up = oracle_loss(pure)
            _set(pure, path, p0 - eps * d)
            down = oracle_loss(pure)
            _set(pure, path, p0)
            fd, got = (up - down) / (2 * eps), float((g * d).sum())
            err = abs(got - fd) / np.linalg.norm(g)
            assert err < GRAD_TOL, f"{name} {path}: model {got:.6g} vs oracle difference {fd:.6g} ({err:.1e})"
