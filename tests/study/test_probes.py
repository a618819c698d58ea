"""The attention probe against a float64 numpy reference (logit statistics) and plain ``jax.grad``
(the gradient norm at W_q / W_k)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxformer.model import ModelConfig, Transformer, apply, init
from jaxformer.study.probes import attention_probe
from jaxformer.train.packing import Batch
from jaxformer.train.step import model_loss
from tests.ops.test_attention import numpy_logit_stats

B, T, V = 2, 12, 64


def batch(seed=0):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, V, (B, T + 1)).astype(np.int32)
    seg = np.ones((B, T), np.int32)
    seg[1, 7:] = 2  # two documents in the second row
    pos = np.where(seg == 2, np.arange(T) - 7, np.arange(T)).astype(np.int32)
    return Batch(tokens=toks[:, :-1], targets=toks[:, 1:], loss_mask=np.ones((B, T), bool), segment_ids=seg,
                 positions=pos)


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
    h = layer_norm64(p["embed"]["embedding"][b.tokens], blk["attn_residual"]["norm"]["scale"])
    q = np.einsum("btd,dnh->btnh", h, blk["self_attn"]["w_q"])
    k = np.einsum("btd,dnh->btnh", h, blk["self_attn"]["w_k"])
    seg = b.segment_ids
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
        s, (_, n) = model_loss(gd, p, b, 0.0)
        return s / n

    g = jax.jit(jax.grad(loss))(params)  # the same gradient as one program, not op by op (a small compile an op)
    blocks = g["decoder"]["blocks"]
    qk = [blocks[i]["self_attn"][w] for i in range(3) for w in ("w_q", "w_k")]
    np.testing.assert_allclose(got["qk_grad_norm"], float(optax.tree.norm(qk)), rtol=1e-5)
    np.testing.assert_allclose(got["grad_norm"], float(optax.tree.norm(g)), rtol=1e-5)
    assert 0 < got["qk_grad_norm"] < got["grad_norm"]
    per_block = [float(optax.tree.norm(blocks[i])) for i in range(3)]
    np.testing.assert_allclose(got["grad_norm_layers"], per_block, rtol=1e-5)


def test_block_grad_norms_agree_between_plain_and_scanned_layouts():
    from jaxformer.train.step import block_grad_norms

    rng = np.random.default_rng(0)
    plain = {"decoder": {"blocks": {i: {"a": rng.normal(size=(3, 4)), "b": {"c": rng.normal(size=5)}}
                                    for i in range(4)}}}
    scanned = {"decoder": {"blocks": jax.tree.map(lambda *xs: np.stack(xs), *[plain["decoder"]["blocks"][i]
                                                                               for i in range(4)])}}
    want = [math.sqrt(sum(float(np.sum(x ** 2)) for x in jax.tree.leaves(plain["decoder"]["blocks"][i])))
            for i in range(4)]
    np.testing.assert_allclose(block_grad_norms(plain), want, rtol=1e-6)
    np.testing.assert_allclose(block_grad_norms(scanned), want, rtol=1e-6)


@pytest.mark.parametrize("activation", ["relu", "swiglu"])
def test_dead_units_match_numpy(activation):
    """One pre-LN layer: the FFN input is LN(x + attention(LN(x))); recomputed here from the module's own
    attention output is circular, so the check uses position='none' attention with W_o = 0: the FFN then
    sees LN(embedding) exactly, and a unit is dead iff (LN(e) W_in + b)[unit] <= 0 on every real token."""
    from jaxformer.study.probes import mlp_probe

    cfg = ModelConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, position="none", norm="layernorm",
                      activation=activation, max_seq_len=T, use_bias=True, init_std=0.3)
    gd, st = init(cfg, jax.random.key(4))
    params = nnx.to_pure_dict(st)
    blk = params["decoder"]["blocks"][0]
    blk["self_attn"]["w_o"] = jnp.zeros_like(blk["self_attn"]["w_o"])
    blk["self_attn"]["b_o"] = jnp.zeros_like(blk["self_attn"]["b_o"])
    w_name, b_name = ("w_in", "b_in") if activation == "relu" else ("w_gate", "b_gate")
    blk["mlp"][b_name] = blk["mlp"][b_name] - 3.0 * (jnp.arange(cfg.resolved_d_ff) % 2)  # half pushed down
    b1, b2 = batch(0), batch(1)
    b2.segment_ids[0, 5:] = 0  # padding: those tokens must not count
    got = mlp_probe(gd, params, [b1, b2])

    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    pb = p["decoder"]["blocks"][0]
    fired = np.zeros(cfg.resolved_d_ff, bool)
    for b in (b1, b2):
        e = p["embed"]["embedding"][b.tokens]
        n = pb["mlp_residual"]["norm"]
        pre = layer_norm64(e, n["scale"]) + n["bias"]
        pre = pre @ pb["mlp"][w_name] + pb["mlp"][b_name]
        fired |= np.any((pre > 0) & (b.segment_ids > 0)[..., None], axis=(0, 1))
    assert 0 < got["dead_fraction"] < 1
    np.testing.assert_allclose(got["dead_fraction"], 1 - fired.mean(), atol=1e-12)
    assert got["dead_fraction_layers"] == [got["dead_fraction"]]


def test_scanned_models_are_probed_per_layer():
    """A scanned model's probes are those of the per-layer model with the same weights (stacked here with
    np.stack, block i at index i). Layer i's first (i + 1) * F / 8 FFN units are pushed dead, so the per-layer
    lists see the order of the layers."""
    from jaxformer.study.probes import mlp_probe

    cfg = ModelConfig(vocab_size=V, d_model=16, n_layers=3, n_heads=2, max_seq_len=T, activation="relu",
                      use_bias=True)
    gd, st = init(cfg, jax.random.key(5))
    params = nnx.to_pure_dict(st)
    blocks = params["decoder"]["blocks"]
    F = cfg.resolved_d_ff
    for i in range(3):
        blocks[i]["mlp"]["b_in"] = blocks[i]["mlp"]["b_in"] - 10.0 * (jnp.arange(F) < (i + 1) * F // 8)
    scanned = {**params, "decoder": {**params["decoder"], "blocks": jax.tree.map(
        lambda *xs: np.stack(xs), *[blocks[i] for i in range(3)])}}
    s_gd = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model_copy(update={"scan_layers": True}))))[0]
    b = batch()
    got, want = attention_probe(s_gd, scanned, b), attention_probe(gd, params, b)
    assert got == want  # the same computation on the same weights
    assert len(set(want["grad_norm_layers"])) == 3 and want["logit_var_first"] != want["logit_var_last"]
    got, want = mlp_probe(s_gd, scanned, [b]), mlp_probe(gd, params, [b])
    assert got == want
    assert want["dead_fraction_layers"] == sorted(want["dead_fraction_layers"]) and \
        len(set(want["dead_fraction_layers"])) == 3


def test_layer_grad_norms_in_the_metrics(tmp_path):
    """``logging.layer_grad_norms``: each train row carries one norm per block; together they are part
    of the whole gradient (the embeddings and final norm hold the rest). Without the flag the rows stay as they
    were: tests/train/test_mfu.py::test_metrics_rows_carry_mfu checks that in its run's rows."""
    from jaxformer.train import config as C
    from jaxformer.train.loop import train
    from jaxformer.train.metrics import read_metrics
    from tests.train.helpers import make_corpus, tiny_raw

    corpus = make_corpus(tmp_path / "corpus")
    train(C.from_dict(tiny_raw(corpus, steps=3, logging={"layer_grad_norms": True})), tmp_path / "run")
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 3
    for r in rows:
        layers = r["grad_norm_layers"]
        assert len(layers) == 2 and all(x > 0 for x in layers)
        assert math.sqrt(sum(x * x for x in layers)) < r["grad_norm"]


def _order_batch(seed=0, T=16):
    """Three windows inside one document each, and a fourth holding two documents (left out by the probe)."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, V, (4, T + 1)).astype(np.int32)
    seg = np.ones((4, T), np.int32)
    seg[3, 9:] = 2
    pos = np.where(seg == 2, np.arange(T) - 9, np.arange(T)).astype(np.int32)
    return Batch(tokens=toks[:, :-1], targets=toks[:, 1:], loss_mask=np.ones((4, T), bool), segment_ids=seg,
                 positions=pos)


# ("none", 3): 2 s; the probe against the reference is every case's check, and a model that sees the order (gain
# > 1e-3) is the default run's RoPE case
@pytest.mark.parametrize("position,n_layers", [("none", 1), pytest.param("none", 3, marks=pytest.mark.slow),
                                               ("rope", 2)])
def test_order_probe_scores_the_last_quarter_with_the_prefix_shuffled(position, n_layers):
    """The probe against the model's own logits on windows shuffled here (the same permutations: one
    default_rng(0) draw per kept window, in order), scored in float64 on the last quarter; and the property the
    probe stands on: a one-layer causal model without positions sees its prefix as a bag of words (gain 0 to
    float rounding), while with 3 layers, or with RoPE, the order changes the loss."""
    from jaxformer.study.probes import order_probe

    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=n_layers, n_heads=4, position=position, max_seq_len=16,
                      init_std=0.3)
    gd, st = init(cfg, jax.random.key(2))
    params = nnx.to_pure_dict(st)
    batches = [_order_batch(0), _order_batch(1)]
    got = order_probe(gd, params, batches, keep=0.25, seed=0)

    fwd = jax.jit(apply, static_argnums=0)  # the model's own logits as one program, not op by op
    rng = np.random.default_rng(0)
    nll = {"order_nll": [], "order_nll_shuffled": []}
    for b in batches:
        for i in range(3):  # the one-document windows
            t = b.tokens[i:i + 1].copy()
            s = t.copy()
            s[0, :12] = t[0, rng.permutation(12)]
            for key, x in (("order_nll", t), ("order_nll_shuffled", s)):
                logits = np.asarray(fwd(gd, params, x, positions=b.positions[i:i + 1],
                                        segment_ids=b.segment_ids[i:i + 1]), np.float64)[0, 12:]
                lz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
                nll[key] += list(lz - logits[np.arange(4), b.targets[i, 12:]])
    for key, v in nll.items():
        np.testing.assert_allclose(got[key], np.mean(v), rtol=1e-5, err_msg=key)  # fp32 sums vs float64
    want_gain = np.mean(nll["order_nll_shuffled"]) - np.mean(nll["order_nll"])  # the float64 reference's
    np.testing.assert_allclose(got["order_gain"], want_gain, rtol=1e-4, atol=1e-6)
    if (position, n_layers) == ("none", 1):
        assert abs(got["order_gain"]) < 1e-5
    else:
        assert abs(got["order_gain"]) > 1e-3


def test_order_probe_needs_a_window_inside_one_document():
    from jaxformer.study.probes import order_probe

    cfg = ModelConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_seq_len=T)
    gd, st = init(cfg, jax.random.key(0))
    b = batch()
    b = b._replace(segment_ids=np.where(np.arange(T) < 3, 1, 2) * np.ones((B, 1), np.int32))
    with pytest.raises(ValueError, match="inside one document"):
        order_probe(gd, nnx.to_pure_dict(st), [b])
