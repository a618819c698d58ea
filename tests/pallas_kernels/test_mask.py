"""pallas_kernels.mask.mask_rule: the contract its callers rely on.

Its meaning is checked against element-by-element definitions through MaskSpec.dense
(tests/ops/test_masks.py) and against the kernels' independent oracle (test_flash_api.py);
here only what every call site needs: plain array math on numpy and jax alike, None when
nothing masks, pattern terms that widen a band and nothing else, and a leaf module.
"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.mask import mask_rule

Q = np.arange(6)[:, None] + 2  # query positions 2..7
K = np.arange(9)[None, :]


def test_numpy_in_numpy_out_and_jax_in_jax_out():
    kw = {"causal": True, "window": (2, None), "kv_length": np.array(7), "num_keys": 8}
    got = mask_rule(Q, K, **kw)
    assert isinstance(got, np.ndarray) and got.shape == (6, 9) and got.dtype == bool
    traced = jax.jit(lambda q, k: mask_rule(q, k, **kw))(jnp.asarray(Q), jnp.asarray(K))
    np.testing.assert_array_equal(traced, got)
    np.testing.assert_array_equal(got, (K <= Q) & (K >= Q - 2) & (K < 7))


def test_nothing_to_mask_is_none():
    assert mask_rule(Q, K) is None
    assert mask_rule(Q, K, window=(None, None), q_global=np.ones((6, 1), bool)) is None


def test_pattern_terms_only_widen_a_band():
    glob_q = (Q == 4)
    band = mask_rule(Q, K, window=(1, 1))
    widened = mask_rule(Q, K, window=(1, 1), q_global=glob_q, kv_global=(K == 0))
    np.testing.assert_array_equal(widened, band | glob_q | (K == 0))
    hard = mask_rule(Q, K, causal=True, window=(1, 1), q_global=glob_q)
    np.testing.assert_array_equal(hard, (K <= Q) & (band | glob_q), err_msg="causal still applies to a global query")


def test_is_a_leaf_module():
    code = ("import sys, pallas_kernels.mask; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxformer', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
