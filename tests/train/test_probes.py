"""The attention probe against a float64 numpy reference (logit statistics) and plain ``jax.grad``
(the gradient norm at W_q / W_k)."""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxformer.model import ModelConfig, init
from jaxformer.train.probes import attention_probe
from jaxformer.train.step import _model_loss
from tests.ops.test_attention import numpy_logit_stats

B, T, V = 2, 12, 64


def batch(seed=0):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, V, (B, T + 1)).astype(np.int32)
    seg = np.ones((B, T), np.int32)
    seg[1, 7:] = 2  # two documents in the second row
    pos = np.where(seg == 2, np.arange(T) - 7, np.arange(T)).astype(np.int32)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": seg, "positions": pos,
            "mask": np.ones((B, T), bool)}


def layer_norm64(x, scale):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * scale


@pytest.mark.parametrize("attn_scale", [None, 1.0])
def test_first_layer_statistics_match_numpy(attn_scale):
    """One pre-LN layer without positions inside attention: its input is LN(embedding), q = h W_q,
    k = h W_k, all recomputed here in float64; rows are causal within each document."""
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=4, position="none", norm="layernorm",
                      max_seq_len=T, attn_scale=attn_scale, init_std=0.3)
    gd, st = init(cfg, jax.random.key(1))
    params = nnx.to_pure_dict(st)
    b = batch()
    got = attention_probe(gd, params, b)

    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    blk = p["decoder"]["blocks"][0]
    h = layer_norm64(p["embed"]["embedding"][b["inputs"]], blk["attn_residual"]["norm"]["scale"])
    q = np.einsum("btd,dnh->btnh", h, blk["self_attn"]["w_q"])
    k = np.einsum("btd,dnh->btnh", h, blk["self_attn"]["w_k"])
    seg = b["segment_ids"]
    allowed = (seg[:, :, None] == seg[:, None, :]) & (np.arange(T)[:, None] >= np.arange(T)[None, :])
    want = numpy_logit_stats(q, k, allowed, scale=1 / math.sqrt(8) if attn_scale is None else attn_scale)
    for key, w in want.items():
        np.testing.assert_allclose(got[key], w, rtol=1e-4, err_msg=key)  # fp32 model vs float64
        assert got[f"{key}_first"] == got[key] == got[f"{key}_last"]


def test_gradient_norms_match_plain_jax_grad():
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=T)
    gd, st = init(cfg, jax.random.key(2))
    params = nnx.to_pure_dict(st)
    b = batch(1)
    got = attention_probe(gd, params, b)

    def loss(p):
        s, (_, n) = _model_loss(gd, p, b, 0.0)
        return s / n

    g = jax.grad(loss)(params)
    blocks = g["decoder"]["blocks"]
    qk = [blocks[i]["self_attn"][w] for i in range(3) for w in ("w_q", "w_k")]
    np.testing.assert_allclose(got["qk_grad_norm"], float(optax.tree.norm(qk)), rtol=1e-5)
    np.testing.assert_allclose(got["grad_norm"], float(optax.tree.norm(g)), rtol=1e-5)
    assert 0 < got["qk_grad_norm"] < got["grad_norm"]


def test_scanned_layers_are_refused():
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=T, scan_layers=True)
    gd, st = init(cfg, jax.random.key(0))
    with pytest.raises(ValueError, match="scan_layers=false"):
        attention_probe(gd, nnx.to_pure_dict(st), batch())
