"""Helpers shared by the attention-path tests (blockwise, Pallas flash, dispatch)."""

import jax
import jax.numpy as jnp
import numpy as np


def jit_fast(fn, *args):
    """``jax.jit(fn)(*args)``; tests/conftest.py already makes CPU compiles cheap."""
    return jax.jit(fn)(*args)


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
