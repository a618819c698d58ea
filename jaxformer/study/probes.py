"""Probes for studies: what attention's softmax sees, the gradient that reaches each layer, dead FFN units.

:func:`attention_probe` runs the model once on one batch with every :class:`~jaxformer.nn.attention.Attention`
recording :func:`~jaxformer.ops.attention.attention_logit_stats` (``record_stats``), and takes the gradient
of the mean next-token loss (at W_q / W_k, and per block): the √d_k and residual studies read it at
initialisation and after training. :func:`mlp_probe` counts the FFN units that never fire on a set of
batches (the activations study).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxformer.model import abstract_init, per_layer_config, unstack_layers
from jaxformer.nn.attention import Attention
from jaxformer.nn.mlp import MLP, GatedMLP
from jaxformer.train.evaluation import token_nll
from jaxformer.train.packing import Batch
from jaxformer.train.step import model_loss, block_grad_norms

STATS = ("logit_var", "entropy", "entropy_ratio", "max_weight")


def _recording(graphdef, params, kinds=(Attention,)):
    """The model with ``record_stats`` on in every module of ``kinds`` (attention: self-attention only)."""
    model = nnx.merge(graphdef, params)
    for path, m in nnx.iter_modules(model):
        if isinstance(m, kinds) and (not isinstance(m, Attention) or path[-1] == "self_attn"):
            m.record_stats = True
    return model


def _layer_stats(captured, name: str = "attention_stats") -> list:
    """The values sown as ``name`` (``nnx.capture``'s state), one per call, in module order."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            for k in sorted(node, key=lambda k: (0, k, "") if isinstance(k, int) else (1, 0, str(k))):
                if k == name:
                    found.extend(node[k] if isinstance(node[k], (tuple, list)) else [node[k]])
                else:
                    walk(node[k])

    walk(nnx.to_pure_dict(captured))
    return found


@functools.partial(jax.jit, static_argnums=0)
def _probe(graphdef, params, batch):
    model = _recording(graphdef, params)
    _, captured = nnx.capture(model, nnx.Intermediate)(batch.tokens, positions=batch.positions,
                                                          segment_ids=batch.segment_ids)
    layers = _layer_stats(captured)

    def mean_loss(p):
        loss_sum, (_, n) = model_loss(graphdef, p, batch, 0.0)
        return loss_sum / jnp.maximum(n, 1.0)

    grads = jax.grad(mean_loss)(params)
    qk = [g for path, g in jax.tree_util.tree_leaves_with_path(grads)
          if any(getattr(k, "key", None) in ("w_q", "w_k") for k in path)]
    return ({k: jnp.stack([s[k] for s in layers]) for k in STATS},
            optax.tree.norm(qk), optax.tree.norm(grads), block_grad_norms(grads))


def _per_layer(graphdef, params):
    """``(graphdef, params)`` of the per-layer model holding the same weights (a scanned model's layers
    unstacked, :func:`jaxformer.model.unstack_layers`): one recorded statistic per layer needs one call per
    block, which a scanned stack's single traced block cannot give."""
    config = nnx.merge(graphdef, params).config
    if not config.scan_layers:
        return graphdef, params
    flat = per_layer_config(config)
    return abstract_init(flat)[0], unstack_layers(params, flat)


def attention_probe(graphdef, params, batch) -> dict:
    """Attention statistics and gradient norms of the model ``(graphdef, params)`` on ``batch``.

    Returns floats: per statistic of :data:`STATS` its mean over the self-attention layers and its
    value in the first and last layer (``logit_var``, ``logit_var_first``, ``logit_var_last``, ...),
    ``qk_grad_norm`` (the norm of the mean-loss gradient over every W_q and W_k), ``grad_norm``
    (over all parameters), ``grad_norm_layers`` (per block, first first) and ``grad_norm_first_block``.
    Statistics are of self-attention only (cross-attention is not recorded). A model with scanned
    layers is probed as the per-layer model with the same weights (same statistics and gradients).
    """
    graphdef, params = _per_layer(graphdef, params)
    per_layer, qk, total, layers = jax.device_get(_probe(graphdef, params, batch))
    out = {}
    for k in STATS:
        v = per_layer[k]
        out[k], out[f"{k}_first"], out[f"{k}_last"] = float(v.mean()), float(v[0]), float(v[-1])
    out["qk_grad_norm"], out["grad_norm"] = float(qk), float(total)
    out["grad_norm_layers"] = [float(x) for x in layers]
    out["grad_norm_first_block"] = out["grad_norm_layers"][0]
    return out


@functools.partial(jax.jit, static_argnums=0)
def _fired(graphdef, params, batch):
    """Per FFN (in module order), whether each unit's activation input was positive on any real token."""
    model = _recording(graphdef, params, (MLP, GatedMLP))
    _, captured = nnx.capture(model, nnx.Intermediate)(batch.tokens, positions=batch.positions,
                                                          segment_ids=batch.segment_ids)
    real = batch.segment_ids > 0  # padding rows and tails are not data
    return jnp.stack([jnp.any(f & real[..., None], axis=(0, 1)) for f in _layer_stats(captured, "fired")])


def mlp_probe(graphdef, params, batches) -> dict:
    """The FFN units whose activation input is never positive on any token of ``batches`` (for ReLU:
    dead units, they never fire): ``dead_fraction`` over all layers and ``dead_fraction_layers``
    (a scanned model: per layer of the same weights, as in :func:`attention_probe`)."""
    graphdef, params = _per_layer(graphdef, params)
    fired = None
    for b in batches:
        f = np.asarray(_fired(graphdef, params, b))
        fired = f if fired is None else fired | f
    if fired is None:
        raise ValueError("mlp_probe: no batches")
    dead = 1.0 - fired.mean(axis=1)
    return {"dead_fraction": float(1.0 - fired.mean()), "dead_fraction_layers": [float(x) for x in dead]}


def order_probe(graphdef, params, batches, *, keep: float = 0.25, seed: int = 0) -> dict:
    """Does the model read the *order* of its context, or only which tokens it holds (a bag of words)?

    On the validation windows that lie inside one document (one segment, no padding), the next-token loss of
    the last ``keep`` of each window's positions, with the window intact and with every token before those
    positions shuffled (one random permutation per window, ``seed``; positions, targets and the scored tokens
    unchanged): ``order_nll`` and ``order_nll_shuffled`` (nats per scored token) and ``order_gain``, the second
    minus the first: 0 for a model that sees its prefix as a bag of words (a one-layer causal model without
    positions is exactly that at the scored positions), above 0 as far as it uses the order."""
    if not 0.0 < keep < 1.0:
        raise ValueError(f"order_probe: keep={keep} must be in (0, 1): the scored fraction of each window")
    rng = np.random.default_rng(seed)
    sums = np.zeros(2)
    count = 0.0
    for b in batches:
        seg = np.asarray(b.segment_ids)
        whole = (seg == seg[:, :1]).all(axis=1) & (seg[:, 0] > 0) & np.asarray(b.loss_mask).all(axis=1)
        if not whole.any():
            continue
        tokens, targets = np.asarray(b.tokens)[whole], np.asarray(b.targets)[whole]
        positions, seg = np.asarray(b.positions)[whole], seg[whole]
        T = tokens.shape[1]
        prefix = T - max(1, int(round(keep * T)))
        scored = np.broadcast_to(np.arange(T) >= prefix, tokens.shape)
        shuffled = tokens.copy()
        for i in range(len(shuffled)):
            shuffled[i, :prefix] = shuffled[i, rng.permutation(prefix)]
        for k, t in enumerate((tokens, shuffled)):
            nll = token_nll(graphdef, params, Batch(t, targets, scored, seg, positions))  # 0 where not scored
            sums[k] += float(np.asarray(nll, np.float64).sum())
        count += float(scored.sum())
    if not count:
        raise ValueError("order_probe: no validation window lies inside one document")
    intact, shuffled_nll = sums / count
    return {"order_nll": float(intact), "order_nll_shuffled": float(shuffled_nll),
            "order_gain": float(shuffled_nll - intact)}
