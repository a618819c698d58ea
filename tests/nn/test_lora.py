"""jaxformer.nn.lora and the adapters in the projections, against numpy float64 written from the formula
``y = x W + s (drop(x) A) B`` (peft's LoRA), with peft's initialisation checked by its bounds."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.nn.builders import attention, gated_mlp
from jaxformer.nn.lora import Dims, LoRA, LoRASpec, lora_delta, lora_scale
from tests.nn.test_modules import ATOL, RTOL, run
from tests.nn.test_params import assert_rank2_dots

D, N, K, H, F, R = 16, 4, 2, 4, 24, 3


def randomised(module, seed, std=0.3):
    """``module`` with every Param (adapters included: B is no longer zero) drawn from N(0, std^2)."""
    graphdef, state = nnx.split(module)
    rng = np.random.default_rng(seed)
    leaves, tree = jax.tree.flatten(state)
    return nnx.merge(graphdef, jax.tree.unflatten(
        tree, [jnp.asarray(std * rng.standard_normal(x.shape), x.dtype) if jnp.issubdtype(x.dtype, jnp.floating)
               else x for x in leaves]))


def np_params(module) -> dict:
    return {".".join(map(str, p)): np.asarray(v[...], np.float64) for p, v in nnx.to_flat_state(nnx.state(module))
            if jnp.issubdtype(v[...].dtype, jnp.floating)}


def test_scale_is_alpha_over_rank_or_its_square_root():
    assert lora_scale(16.0, 8) == 2.0
    assert lora_scale(16.0, 16, rslora=True) == 4.0
    assert LoRASpec(frozenset({"w_q"}), 4, 6.0, rslora=True).scale == pytest.approx(3.0)


def test_init_is_peft_kaiming_uniform_for_a_and_zero_for_b():
    """peft: kaiming_uniform_(lora_A.weight [R, in], a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)); lora_B zeros."""
    fan_in = N * H
    lora = LoRA(Dims((N, H), ("heads", "head_dim")), Dims((D,), ("embed",)), rank=64, scale=1.0, rngs=nnx.Rngs(0))
    a, b = np.asarray(lora.a[...]), np.asarray(lora.b[...])
    assert a.shape == (N, H, 64) and b.shape == (64, D) and a.dtype == np.float32
    bound = 1 / math.sqrt(fan_in)
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.95 * bound  # the bound is reached, not exceeded
    assert abs(a.std() - bound / math.sqrt(3)) < 0.05 * bound  # uniform: std = bound / sqrt(3)
    assert not b.any()
    assert isinstance(lora.a, nnx.LoRAParam) and isinstance(lora.a, nnx.Param)
    assert lora.a.get_metadata()["out_sharding"] == ("heads", "head_dim", None)
    assert lora.b.get_metadata()["out_sharding"] == (None, "embed")


def _attention(lora, seed):
    return randomised(attention(D, N, K, H, position="rope", use_bias=True, lora=lora, rngs=nnx.Rngs(0)), seed)


# slow, 3 s: adapters on the attention projections, applied and merged, are default-run against peft's own logits in
# tests/interop/test_peft.py (llama: all seven projections, GQA; qwen2: rsLoRA on q and v with q/k/v biases), and
# the module-level float64 check (forward and gradients) in test_gated_mlp_adapters_... below
@pytest.mark.slow
@pytest.mark.parametrize("rslora", [False, True])
def test_attention_projections_add_the_scaled_low_rank_update(rslora):
    """Adapters on q and o: each projection equals the kernel's plus ``s (x A) B`` (float64 reference), and
    the whole attention equals the same module with W_q, W_o replaced by W + s A B (``lora_delta``)."""
    spec = LoRASpec(frozenset({"w_q", "w_o"}), R, 5.0, rslora=rslora)
    attn = _attention(spec, seed=1)
    assert attn.w_k_lora is None and attn.w_v_lora is None
    p = np_params(attn)
    x = np.random.default_rng(2).standard_normal((2, 5, D)).astype(np.float32)
    s = spec.scale
    q_ref = np.einsum("btd,dnh->btnh", x, p["w_q"]) + s * np.einsum(
        "btd,dr,rnh->btnh", x, p["w_q_lora.a"], p["w_q_lora.b"]) + p["b_q"]
    q = attn._project(jnp.asarray(x), "w_q", attn.b_q, attn.w_q_lora)
    np.testing.assert_allclose(q, q_ref, rtol=RTOL, atol=ATOL)
    o = np.random.default_rng(3).standard_normal((2, 5, N, H))
    o_ref = np.einsum("btnh,nhd->btd", o, p["w_o"]) + s * np.einsum("btnh,nhr,rd->btd", o, p["w_o_lora.a"],
                                                                    p["w_o_lora.b"])
    np.testing.assert_allclose(attn.w_o_lora(jnp.asarray(o, jnp.float32)) + np.einsum("btnh,nhd->btd", o, p["w_o"]),
                               o_ref, rtol=RTOL, atol=ATOL)
    merged = attention(D, N, K, H, position="rope", use_bias=True, rngs=nnx.Rngs(0))
    for name in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"):
        value = getattr(attn, name)[...]
        lora = getattr(attn, name + "_lora", None)
        if lora is not None:
            value = value + lora_delta(lora.a[...], lora.b[...], s, value.shape)
        getattr(merged, name)[...] = value
    np.testing.assert_allclose(run(attn, jnp.asarray(x)), run(merged, jnp.asarray(x)), rtol=RTOL, atol=ATOL)


def test_gated_mlp_adapters_and_their_gradients_follow_the_chain_rule_through_the_merged_kernel():
    spec = LoRASpec(frozenset({"w_gate", "w_up", "w_down"}), R, 8.0)
    mlp = randomised(gated_mlp(D, F, "swiglu", lora=spec, rngs=nnx.Rngs(0)), seed=4)
    p = np_params(mlp)
    x = np.random.default_rng(5).standard_normal((3, D))
    s = spec.scale

    def lin(x, name):
        return x @ p[name] + s * (x @ p[name + "_lora.a"]) @ p[name + "_lora.b"]

    g, u = lin(x, "w_gate"), lin(x, "w_up")
    ref = lin(g / (1 + np.exp(-g)) * u, "w_down")
    np.testing.assert_allclose(run(mlp, jnp.asarray(x, jnp.float32)), ref, rtol=RTOL, atol=ATOL)
    graphdef, adapter, base = nnx.split(mlp, nnx.LoRAParam, nnx.Param)
    xj = jnp.asarray(x, jnp.float32)
    grads = jax.grad(lambda a: jnp.sum(nnx.merge(graphdef, a, base)(xj) ** 2))(adapter)
    got = {".".join(map(str, k)): np.asarray(v[...], np.float64) for k, v in nnx.to_flat_state(grads)}
    assert sorted(got) == [f"{w}_lora.{ab}" for w in ("w_down", "w_gate", "w_up") for ab in ("a", "b")]
    # the chain rule through the merged kernel W' = W + s A B (a plain GatedMLP, no adapter code):
    # dL/dA = s G B^T and dL/dB = s A^T G, with G = dL/dW' of the merged module
    merged = gated_mlp(D, F, "swiglu", rngs=nnx.Rngs(0))
    for w in ("w_gate", "w_up", "w_down"):
        getattr(merged, w)[...] = jnp.asarray(p[w] + s * p[w + "_lora.a"] @ p[w + "_lora.b"], jnp.float32)
    mg, mstate = nnx.split(merged)
    G = jax.grad(lambda st: jnp.sum(nnx.merge(mg, st)(xj) ** 2))(mstate)
    for w in ("w_gate", "w_up", "w_down"):
        g = np.asarray(getattr(G, w)[...], np.float64)
        a, b = p[w + "_lora.a"], p[w + "_lora.b"]
        scale = np.abs(s * g @ b.T).max()
        assert scale > 1e-3  # a gradient to check, not zeros
        np.testing.assert_allclose(got[w + "_lora.a"], s * g @ b.T, rtol=1e-4, atol=1e-5 * scale)
        np.testing.assert_allclose(got[w + "_lora.b"], s * a.T @ g, rtol=1e-4, atol=1e-5 * np.abs(s * a.T @ g).max())


# slow, 1.3 s: B is zero as initialised (test_init_is_peft_kaiming_uniform_for_a_and_zero_for_b), and a model with
# adapters at step 0 gives the base model's numbers exactly in tests/train/test_lora.py::
# test_step_zero_is_the_base_model_exactly (default-run)
@pytest.mark.slow
def test_a_zero_b_leaves_the_projection_exactly_as_it_was():
    spec = LoRASpec(frozenset({"w_q", "w_k", "w_v", "w_o"}), R, 16.0)
    plain = randomised(attention(D, N, K, H, position="rope", rngs=nnx.Rngs(0)), seed=6)
    adapted = attention(D, N, K, H, position="rope", lora=spec, rngs=nnx.Rngs(1))  # B = 0 as initialised
    for name in ("w_q", "w_k", "w_v", "w_o"):
        getattr(adapted, name)[...] = getattr(plain, name)[...]
    x = jnp.asarray(np.random.default_rng(7).standard_normal((2, 6, D)), jnp.float32)
    np.testing.assert_array_equal(run(plain, x), run(adapted, x))


def test_dropout_acts_only_when_not_deterministic_and_keeps_the_mean():
    lora = LoRA(Dims((D,), ("embed",)), Dims((D,), ("embed",)), rank=R, scale=1.0, dropout=0.5, rngs=nnx.Rngs(0))
    lora.b[...] = jnp.ones((R, D))
    x = jnp.ones((4096, D))
    clean = lora(x)
    assert lora.deterministic  # evaluation and decoding never drop
    lora.set_attributes(deterministic=False)
    lora.key[...] = jax.random.key_data(jax.random.key(3))
    dropped = lora(x)
    assert not np.allclose(dropped, clean)
    np.testing.assert_allclose(np.mean(dropped, axis=0), clean[0], rtol=0.05)  # inverted dropout: same mean
    lora.key[...] = jax.random.key_data(jax.random.key(4))
    assert not np.allclose(lora(x), dropped)  # a new key, a new mask


def test_targets_a_module_lacks_are_refused():
    with pytest.raises(ValueError, match=r"LoRA targets \['w_k'\]: qkv_sharing='qk'"):
        attention(D, N, position="rope", share="qk", lora=LoRASpec(frozenset({"w_k"}), R, 1.0), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"LoRA targets \['w_in'\]: a GatedMLP has only"):
        gated_mlp(D, F, "swiglu", lora=LoRASpec(frozenset({"w_in"}), R, 1.0), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("inputs, outputs", [(((D,), ("embed",)), ((N, H), ("heads", "head_dim"))),
                                             (((N, H), ("heads", "head_dim")), ((D,), ("embed",)))])
def test_adapter_gradients_are_plain_2d_products(inputs, outputs):
    """An adapter on ``[B, T, ...]`` activations differentiates as rank-2 products (one contracted axis per operand),
    as every projection does (``jaxformer.nn.params.project``): the form XLA's CPU backend runs on its fast
    kernels; a ``tensordot`` over ``[B, T, D]`` made LoRA fine-tuning of SmolLM2-135M 1.5x slower per step."""
    lora = randomised(LoRA(Dims(*inputs), Dims(*outputs), rank=R, scale=2.0, rngs=nnx.Rngs(0)), 0)
    graphdef, state = nnx.split(lora)
    x = jnp.ones((2, 5, *inputs[0]))

    def loss(st):
        return jnp.sum(nnx.merge(graphdef, st)(x))

    dots = assert_rank2_dots(jax.make_jaxpr(jax.grad(loss))(state))
    assert len(dots) >= 4  # the forward's two products and the gradients' (x^T g B^T, h^T g, g B^T)
