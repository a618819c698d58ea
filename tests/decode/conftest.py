"""One tiny model shared by the decode tests (building one costs seconds of compilation)."""

import jax
import pytest

from jaxformer.model import init, presets


@pytest.fixture(scope="session")
def llama():
    """``(config, graphdef, state)``: llama_tiny (GQA 4:2, RoPE), 40-token context.

    init_std 0.3 gives peaked logits, so greedy argmax is never decided by rounding.
    """
    cfg = presets.get("llama_tiny", init_std=0.3, max_seq_len=40)
    return (cfg, *init(cfg, jax.random.key(0)))
