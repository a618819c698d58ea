"""Every attention backend means the same thing: dot_product_attention(impl=...) and a model using it.

"pallas" runs the GPU kernel in interpret mode on CPU; a traced q_offset makes it
fall back to blockwise. A tiny LLaMA trained a few steps with
attention_impl="pallas" (and "blockwise") follows attention_impl="xla".
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxformer.ops import MaskSpec, dot_product_attention
from jaxformer.ops.losses import cross_entropy
from tests.attention_helpers import attention_inputs as _inputs


def _max_err(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


@pytest.mark.parametrize("mask", [
    MaskSpec(causal=True, window=(9, None),
             q_segment_ids=jnp.array([[0] * 12 + [1] * 12, [0] * 24]),
             kv_segment_ids=jnp.array([[0] * 12 + [1] * 12, [0] * 24]),
             kv_lengths=jnp.array([24, 17])),
    MaskSpec(causal=True, q_offset=jnp.array([3, 0])),  # traced offset: pallas -> blockwise fallback
], ids=["static", "traced-offset"])
def test_impls_agree(mask):
    q, k, v, do = _inputs(2, 24, 24, 4, 2, 16)
    slopes = jnp.array([0.3, 0.2, 0.1, 0.05])

    def go(q, k, v, do, mask):
        outs = {}
        for impl in ("xla", "blockwise", "pallas"):  # ("auto" is one of these; test_attention covers its choice)
            o, vjp = jax.vjp(lambda q, k, v, impl=impl: dot_product_attention(
                q, k, v, mask=mask, alibi_slopes=slopes, softcap=5.0, impl=impl), q, k, v)
            outs[impl] = (o, *vjp(do))
        return outs

    outs = jax.jit(go)(q, k, v, do, mask)
    # fp32, identical math, different summation order: 1e-5 forward, 1e-4 gradients
    for impl in ("blockwise", "pallas"):
        for name, a, b, tol in zip(("out", "dq", "dk", "dv"), outs[impl], outs["xla"], (1e-5, 1e-4, 1e-4, 1e-4)):
            assert _max_err(a, b) <= tol, f"{impl} {name}: {_max_err(a, b):.3g}"


STEPS = 3


@functools.cache
def _train(impl: str):
    """STEPS Adam steps of llama_tiny (GQA, RoPE) with ``attention_impl=impl``: (losses, final params)."""
    from jaxformer.model import apply as model_apply
    from jaxformer.model import init, presets

    B, T = 2, 16
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (B, T + 1)), jnp.int32)
    opt = optax.adam(1e-2)
    cfg = presets.get("llama_tiny", attention_impl=impl)
    graphdef, state = init(cfg, jax.random.key(0))

    def loss_fn(state):
        return cross_entropy(model_apply(graphdef, state, tokens[:, :-1]), tokens[:, 1:])[0]

    def step(carry, _):
        state, opt_state = carry
        loss, grads = jax.value_and_grad(loss_fn)(state)
        updates, opt_state = opt.update(grads, opt_state, state)
        return (optax.apply_updates(state, updates), opt_state), loss

    def run(state):
        (state, _), losses = jax.lax.scan(step, (state, opt.init(state)), None, length=STEPS)
        return losses, state

    return jax.jit(run)(state)


# [pallas] slow, 4.5 s (interpret mode): the kernel's values and gradients through dot_product_attention are
# test_impls_agree's, and a model trained with another attention_impl is [blockwise]'s (default-run)
@pytest.mark.parametrize("impl", [pytest.param("pallas", marks=pytest.mark.slow), "blockwise"])
def test_tiny_model_training_follows_xla(impl):
    """A tiny model trained with impl="pallas" / "blockwise" gives the losses and parameters of impl="xla"."""
    losses_x, state_x = _train("xla")
    losses_i, state_i = _train(impl)
    # fp32 attention differs at ~1e-6; Adam's first steps (update ~ lr * sign(g)) can amplify
    # such noise on near-zero gradients, so parameters are compared at 1e-3 absolute.
    np.testing.assert_allclose(losses_i, losses_x, rtol=1e-5, atol=1e-5)
    assert float(losses_x[-1]) < float(losses_x[0])
    for a, b in zip(jax.tree.leaves(state_i), jax.tree.leaves(state_x)):
        np.testing.assert_allclose(a, b, atol=1e-3)
