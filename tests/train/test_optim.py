"""Optimiser: schedule by formula, weight-decay mask, clipping, gradient accumulation == one big batch."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from flax import nnx

from jaxformer.model import abstract_init, presets
from jaxformer.train import config as C
from jaxformer.train import sharding as S
from jaxformer.train.corpus import build_corpus
from jaxformer.train.optim import decay_mask, make_optimizer, make_schedule, param_kind
from jaxformer.train.pipeline import TrainIterator
from jaxformer.train.step import make_trainer
from tests.train.helpers import make_corpus, tiny_config


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_schedule_matches_formula(kind):
    opt = C.OptimizerConfig(lr=1e-3)
    sch = C.ScheduleConfig(kind=kind, warmup_steps=10, min_lr_ratio=0.1)
    f = make_schedule(opt, sch, total_steps=110)
    for step in [0, 5, 10, 35, 60, 109, 110, 200]:
        if step < 10:
            want = 1e-3 * step / 10
        else:
            frac = min((step - 10) / 100, 1.0)
            want = {"cosine": 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * frac)),
                    "linear": 1e-3 + (1e-4 - 1e-3) * frac, "constant": 1e-3}[kind]
        assert float(f(step)) == pytest.approx(want, rel=1e-5, abs=1e-9), (kind, step)


def test_decay_mask_classifies_parameters():
    cfg = presets.get("gpt2_tiny")  # learned positions, biases, layernorms
    _, state = abstract_init(cfg)
    params = nnx.to_pure_dict(state)
    kinds = {"/".join(str(getattr(k, "key", k)) for k in p): param_kind(p)
             for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert kinds["embed/embedding"] == "embedding" and kinds["pos_embed/embedding"] == "embedding"
    assert kinds["decoder/final_norm/scale"] == "norm" and kinds["decoder/final_norm/bias"] == "norm"
    assert kinds["decoder/blocks/0/self_attn/w_q"] == "weight"
    assert kinds["decoder/blocks/0/self_attn/b_q"] == "bias"
    assert kinds["decoder/blocks/0/mlp/w_in"] == "weight"
    mask = decay_mask(params, C.OptimizerConfig())
    flat = {"/".join(str(getattr(k, "key", k)) for k in p): v
            for p, v in jax.tree_util.tree_flatten_with_path(mask)[0]}
    assert flat["decoder/blocks/0/mlp/w_in"] and not flat["embed/embedding"]
    assert not flat["decoder/blocks/0/self_attn/b_q"] and not flat["decoder/final_norm/scale"]
    mask = decay_mask(params, C.OptimizerConfig(decay_norms=True, decay_biases=True, decay_embeddings=True))
    assert all(jax.tree.leaves(mask))


def _run(cfg, mesh, batches):
    tr = make_trainer(cfg, mesh)
    state = tr.init_state()
    out = []
    for b in batches:
        state, m = tr.train_step(state, S.put_batch(b, mesh))
        out.append({k: float(v) for k, v in jax.device_get(m).items()})
    return out, state


def test_grad_accumulation_equals_one_big_batch(tmp_path):
    corpus_dir = make_corpus(tmp_path / "c")
    cfg1 = tiny_config(corpus_dir)
    cfg2 = tiny_config(corpus_dir, optimizer={"lr": 3e-3, "grad_accum": 4})
    corpus = build_corpus(cfg1.data)
    it = TrainIterator(corpus, seq_len=32, batch_size=8, seed=0)
    batches = [next(it) for _ in range(3)]
    mesh = S.make_mesh(C.MeshConfig(data=1))
    a, sa = _run(cfg1, mesh, batches)
    b, sb = _run(cfg2, mesh, batches)
    for x, y in zip(a, b):
        # fp32 sums in a different order: relative 1e-5 on the loss, 1e-4 on norms
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
    for p, q in zip(jax.tree.leaves(sa["params"]), jax.tree.leaves(sb["params"])):
        np.testing.assert_allclose(np.asarray(q), np.asarray(p), rtol=1e-4, atol=1e-5)


def test_clipping_then_adamw_against_numpy():
    """Three updates of make_optimizer == float64 numpy: clip to global norm c, AdamW, masked decay.

    Step 1's gradient is far above c (clipped), steps 2-3 below it (not clipped). Adam's first
    update is scale-free (m / sqrt(v) = sign(g)), so the clip scale shows only later, through
    the moments: a wrong threshold or a missing clip changes steps 2-3 by O(1).
    """
    c, lr, b1, b2, eps, wd = 0.5, 1e-2, 0.9, 0.95, 1e-8, 0.1
    opt_cfg = C.OptimizerConfig(lr=lr, clip_norm=c, weight_decay=wd, b1=b1, b2=b2, eps=eps)
    rng = np.random.default_rng(0)
    params = {"mlp": {"w_in": rng.normal(size=(3, 4)).astype(np.float32)},
              "norm": {"scale": rng.normal(size=(4,)).astype(np.float32)}}
    grads = [{k: {n: (s * rng.normal(size=v.shape)).astype(np.float32) for n, v in d.items()}
              for k, d in params.items()} for s in (10.0, 0.05, 0.08)]
    opt, _ = make_optimizer(opt_cfg, C.ScheduleConfig(kind="constant"), 10, params)
    state, p = opt.init(params), params
    m = {k: {n: np.zeros(v.shape) for n, v in d.items()} for k, d in params.items()}
    v2 = {k: {n: np.zeros(v.shape) for n, v in d.items()} for k, d in params.items()}
    p64 = {k: {n: v.astype(np.float64) for n, v in d.items()} for k, d in params.items()}
    for t, g in enumerate(grads, start=1):
        updates, state = opt.update(g, state, p)
        p = jax.tree.map(lambda a, u: a + u, p, updates)
        norm = np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for d in g.values() for x in d.values()))
        assert (norm > c) == (t == 1)
        scale = min(1.0, c / norm)
        for k, n, decay in (("mlp", "w_in", True), ("norm", "scale", False)):
            gk = g[k][n].astype(np.float64) * scale
            m[k][n] = b1 * m[k][n] + (1 - b1) * gk
            v2[k][n] = b2 * v2[k][n] + (1 - b2) * gk ** 2
            mh, vh = m[k][n] / (1 - b1 ** t), v2[k][n] / (1 - b2 ** t)
            want = -lr * (mh / (np.sqrt(vh) + eps) + (wd * p64[k][n] if decay else 0.0))
            # fp32 arithmetic vs float64 over 3 steps: 1e-5 relative (measured ~1e-7)
            np.testing.assert_allclose(np.asarray(updates[k][n]), want, rtol=1e-5, atol=1e-8,
                                       err_msg=f"step {t} {k}/{n}")
            p64[k][n] = p64[k][n] + want


def test_bf16_compute_scan_and_remat_keep_fp32_master_params(tmp_path):
    corpus_dir = make_corpus(tmp_path / "c")
    base = tiny_config(corpus_dir, model={"scan_layers": True})  # same parameter draw as `fast`
    fast = tiny_config(corpus_dir, model={"compute_dtype": "bfloat16", "scan_layers": True, "remat": True})
    corpus = build_corpus(base.data)
    it = TrainIterator(corpus, seq_len=32, batch_size=8, seed=0)
    batches = [next(it) for _ in range(3)]
    mesh = S.make_mesh(C.MeshConfig(data=1))
    refs, _ = _run(base, mesh, batches)
    gots, state = _run(fast, mesh, batches)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(state["params"]))
    assert state["params"]["decoder"]["blocks"]["mlp"]["w_up"].shape[0] == 2  # stacked layers
    # Same parameters, bf16 compute + remat vs fp32 over 3 steps: measured relative differences
    # <= 3.4e-5 on the loss and <= 9e-4 on the gradient norm; bounds ~6x that. (A model with constant
    # logits is ln V = 5.5759 vs 5.5777 at step 1: 3.2e-4, outside.)
    for ref, got in zip(refs, gots):
        assert got["loss"] == pytest.approx(ref["loss"], rel=2e-4)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=5e-3)


# -- Muon -------------------------------------------------------------------------------------

def _polar(g: np.ndarray) -> np.ndarray:
    """U V^T of ``g = U S V^T`` (float64 SVD): the matrix Muon's Newton-Schulz iteration approximates."""
    u, _, vt = np.linalg.svd(g.astype(np.float64), full_matrices=False)
    return u @ vt


@pytest.mark.parametrize("scan", [False, True])
def test_muon_dimensions_classify_every_parameter(scan):
    from optax.contrib import MuonDimensionNumbers as Dims

    from jaxformer.train.optim import muon_dimensions
    cfg = presets.get("gpt2_tiny", scan_layers=scan, tie_embeddings=False)  # biases, norms, positions, head
    _, state = abstract_init(cfg)
    params = nnx.to_pure_dict(state)
    dims = muon_dimensions(params)
    flat = {"/".join(str(getattr(k, "key", k)) for k in p): d for p, d in
            jax.tree_util.tree_flatten_with_path(dims, is_leaf=lambda d: d is None or isinstance(d, Dims))[0]}
    blk = "decoder/blocks/" + ("" if scan else "0/")
    s = 1 if scan else 0  # the stacked layers axis is a batch axis
    assert flat[blk + "self_attn/w_q"] == Dims((s,), (s + 1, s + 2))
    assert flat[blk + "self_attn/w_v"] == Dims((s,), (s + 1, s + 2))
    assert flat[blk + "self_attn/w_o"] == Dims((s, s + 1), (s + 2,))
    assert flat[blk + "mlp/w_in"] == Dims((s,), (s + 1,)) and flat[blk + "mlp/w_out"] == Dims((s,), (s + 1,))
    for adam in ("embed/embedding", "pos_embed/embedding", "head/kernel", "decoder/final_norm/scale",
                 blk + "self_attn/b_q", blk + "mlp/b_in"):
        assert flat[adam] is None, adam


def test_muon_update_is_the_orthogonalised_gradient_and_adamw_elsewhere():
    """First Muon step on [D, N, H] / [N, H, D] / [L, D, F] weights: -lr (c * polar(G) + wd * W), per matrix.

    polar(G) = U V^T from a float64 SVD of the gradient reshaped as Muon's dimension numbers say;
    c = muon_rms * sqrt(max(fan_in, fan_out)). Newton-Schulz (5 quintic steps) only approximates
    U V^T: its singular values land in about [0.7, 1.2], so the check is a cosine >= 0.97 with
    U V^T and every singular value in [0.5, 1.5]. Embeddings and norms get AdamW's first step.
    """
    opt_cfg = C.OptimizerConfig(name="muon", lr=1e-2, clip_norm=None, weight_decay=0.1, b1=0.9, b2=0.95)
    rng = np.random.default_rng(0)
    shapes = {"attn": {"w_q": (16, 2, 4), "w_o": (2, 4, 16)}, "mlp": {"w_up": (3, 16, 24)},
              "embed": {"embedding": (10, 16)}, "norm": {"scale": (16,)}}
    params = {k: {n: rng.normal(size=s).astype(np.float32) for n, s in d.items()} for k, d in shapes.items()}
    grads = {k: {n: rng.normal(size=s).astype(np.float32) for n, s in d.items()} for k, d in shapes.items()}
    opt, _ = make_optimizer(opt_cfg, C.ScheduleConfig(kind="constant"), 10, params)
    updates, _ = jax.jit(opt.update)(grads, opt.init(params), params)

    def matrices(name, x):  # the matrices Muon orthogonalises, as float64 [.., fan_in, fan_out]
        x = np.asarray(x, np.float64)
        return {"w_q": lambda: [x.reshape(16, 8)], "w_o": lambda: [x.reshape(8, 16)],
                "w_up": lambda: list(x)}[name]()

    for k, n in (("attn", "w_q"), ("attn", "w_o"), ("mlp", "w_up")):
        direction = -(np.asarray(updates[k][n], np.float64) / 1e-2 + 0.1 * params[k][n])
        for o, g in zip(matrices(n, direction), matrices(n, grads[k][n])):
            o = o / (0.2 * np.sqrt(max(o.shape)))
            p = _polar(g)
            cos = np.sum(o * p) / (np.linalg.norm(o) * np.linalg.norm(p))
            sv = np.linalg.svd(o, compute_uv=False)
            assert cos >= 0.97, (n, cos)
            assert 0.5 <= sv.min() and sv.max() <= 1.5, (n, sv)
    for k, n, decay in (("embed", "embedding", False), ("norm", "scale", False)):
        g = grads[k][n].astype(np.float64)
        want = -1e-2 * (g / (np.abs(g) + 1e-8))  # Adam's bias-corrected first step, no decay on these
        np.testing.assert_allclose(np.asarray(updates[k][n]), want, rtol=1e-5, atol=1e-7, err_msg=f"{k}/{n}")


def test_muon_trains_on_a_sharded_mesh_like_one_device(tmp_path):
    corpus_dir = make_corpus(tmp_path / "c")
    cfg = tiny_config(corpus_dir, model={"d_model": 64, "n_heads": 4, "n_kv_heads": 2},
                      optimizer={"name": "muon", "lr": 1e-2})
    corpus = build_corpus(cfg.data)
    batches = [next(TrainIterator(corpus, seq_len=32, batch_size=8, seed=0))] * 4  # one batch, so it must fit it
    one = S.make_mesh(C.MeshConfig(data=1), jax.devices()[:1])
    init = jax.device_get(make_trainer(cfg, one).init_state())
    runs = {}
    for name, mesh in (("one", one), ("2x2x2", S.make_mesh(C.MeshConfig(data=2, fsdp=2, tensor=2)))):
        tr = make_trainer(cfg, mesh)
        if name == "one":
            state = jax.device_put(init, tr.state_shardings)
        else:  # the sharded initialisation draws the same parameters (and optimiser state) as one device
            state = tr.init_state()
            for x, y in zip(jax.tree.leaves(init), jax.tree.leaves(state), strict=True):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(jax.device_get(y)))
        runs[name] = []
        for b in batches:
            state, m = tr.train_step(state, S.put_batch(b, mesh))
            runs[name].append(float(m["loss"]))
    # fp32 reductions (and Newton-Schulz matmuls) split across devices: 1e-4 relative over 4 steps
    np.testing.assert_allclose(runs["2x2x2"], runs["one"], rtol=1e-4)
    assert runs["one"][-1] < runs["one"][1] - 0.1  # it fits the batch (step 0 has lr 0: warmup)
    # parameters and both groups' optimiser moments really sharded: Muon's momentum like its matrix,
    # AdamW's moments like the embedding; counters replicated
    P = jax.sharding.PartitionSpec
    w_up = state["params"]["decoder"]["blocks"][0]["mlp"]["w_up"]
    assert w_up.sharding.spec == P("fsdp", "tensor")
    assert w_up.addressable_shards[0].data.shape == (32, w_up.shape[1] // 2)  # d_model 64 over fsdp=2
    assert state["params"]["decoder"]["blocks"][0]["self_attn"]["w_q"].sharding.spec == P("fsdp", "tensor", None)
    assert state["params"]["embed"]["embedding"].sharding.spec == P("tensor", "fsdp")
    specs = {jax.tree_util.keystr(p): x.sharding.spec for p, x in
             jax.tree_util.tree_leaves_with_path(state["opt_state"])}
    muon_mu = [v for k, v in specs.items() if k.endswith("['decoder']['blocks'][0]['mlp']['w_up']") and ".mu" in k]
    adam = [v for k, v in specs.items() if k.endswith("['embed']['embedding']")]
    assert muon_mu and all(v == P("fsdp", "tensor") for v in muon_mu), specs
    assert len(adam) == 2 and all(v == P("tensor", "fsdp") for v in adam), adam
    assert all(v == P() for k, v in specs.items() if k.endswith("count")), specs
