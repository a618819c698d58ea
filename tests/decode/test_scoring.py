"""token_logprobs: one padded forward pass equals the log-softmax of the model's logits on the tokens alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxformer.decode.scoring import token_logprobs


def test_token_logprobs_equal_log_softmax_of_a_forward_pass(llama):
    cfg, graphdef, state = llama
    tokens = list(map(int, np.random.default_rng(0).integers(0, cfg.vocab_size, size=11)))  # padded to 16
    out = token_logprobs(graphdef, state, tokens, top=3, max_len=cfg.max_seq_len)
    ref = np.asarray(jax.nn.log_softmax(nnx.merge(graphdef, state)(jnp.asarray([tokens]))[0], axis=-1))
    np.testing.assert_allclose(out.logprobs, ref[np.arange(10), tokens[1:]], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-ref[:10], axis=-1)[:, :3])
    np.testing.assert_allclose(out.top_logprobs, np.sort(ref[:10], axis=-1)[:, ::-1][:, :3], rtol=1e-5, atol=1e-5)
    assert token_logprobs(graphdef, state, tokens[:1]).logprobs.shape == (0,)
    with pytest.raises(ValueError, match="longer than the context"):
        token_logprobs(graphdef, state, [0] * (cfg.max_seq_len + 1), max_len=cfg.max_seq_len)
