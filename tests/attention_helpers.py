"""Helpers shared by the attention-path tests (blockwise, sparse, Pallas flash, dispatch)."""

import jax
import jax.numpy as jnp
import numpy as np


def assert_close(got, want, tol, what):
    """Max abs error <= tol * max(1, max|want|), and ``got`` finite."""
    got = np.asarray(got).astype(np.float32)
    want = np.asarray(want).astype(np.float32)
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    err = np.abs(got - want).max(initial=0.0)
    bound = tol * max(1.0, np.abs(want).max(initial=0.0))
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def attention_inputs(B, T, S, N, K, H, dtype=np.float32, seed=0):
    """Standard-normal ``q [B,T,N,H], k, v [B,S,K,H]`` and an output cotangent ``do [B,T,N,H]``."""
    rng = np.random.default_rng(seed)
    shapes = ((B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H))
    return tuple(jnp.asarray(rng.standard_normal(sh, np.float32).astype(dtype)) for sh in shapes)


def sorted_segments(B, L, n_segs, seed):
    """Packed-document segment ids ``[B, L]`` int32: sorted draws from ``0..n_segs-1``."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.sort(rng.integers(0, n_segs, (B, L)), axis=1), jnp.int32)


def fwd_bwd(attn):
    """``run(q, k, v, do) -> (out, dq, dk, dv)``: ``attn(q, k, v)`` and its vjp of the cotangent ``do``."""

    def run(q, k, v, do):
        out, vjp = jax.vjp(attn, q, k, v)
        return (out, *vjp(do))

    return run


def assert_all_close(got, want, *, atol, rtol, names=("out", "dq", "dk", "dv")):
    """Each of ``got`` finite and elementwise within ``atol + rtol * |want|`` of ``want`` (fp32)."""
    for name, g, w in zip(names, got, want, strict=True):
        g = np.asarray(g, np.float32)
        assert np.isfinite(g).all(), f"{name}: non-finite values"
        np.testing.assert_allclose(g, np.asarray(w, np.float32), err_msg=name, atol=atol, rtol=rtol)


def mosaic_custom_calls(q_shape, k_shape, kw) -> int:
    """Export forward+backward of ``flash_attention_tpu(**kw)`` for the TPU platform (the real Mosaic
    lowering, run on CPU); the number of Mosaic kernels in the module (3: fwd, dq, dk/dv)."""
    from pallas_kernels.flash_attention.api import flash_attention_tpu

    q, k = jnp.zeros(q_shape, jnp.bfloat16), jnp.zeros(k_shape, jnp.bfloat16)

    def grads(q, k, v):
        return jax.grad(lambda *a: jnp.sum(flash_attention_tpu(*a, **kw).astype(jnp.float32)),
                        argnums=(0, 1, 2))(q, k, v)

    return jax.export.export(jax.jit(grads), platforms=["tpu"])(q, k, k).mlir_module().count("tpu_custom_call")
