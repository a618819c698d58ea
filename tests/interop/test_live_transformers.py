"""Live checks against ``transformers`` itself (marked ``slow``; skipped where torch / transformers are absent).

1. ``make_fixtures.py`` regenerates every committed fixture: the recorded outputs must come back equal
   (the fixtures are not stale, and the script that made them still runs).
2. The round trip the other way: a random jaxformer model of each family, ``save_pretrained``, then
   ``transformers.AutoModel*.from_pretrained`` gives jaxformer's logits (float32, within 1e-4).

Run (a CPU build of torch; a plain ``pip install torch`` pulls a CUDA build of several GB)::

    python -m venv /tmp/hfenv && /tmp/hfenv/bin/pip install torch==2.13.0 transformers -e '.[test,interop]'
    # elsewhere: pip install torch --index-url https://download.pytorch.org/whl/cpu
    /tmp/hfenv/bin/python -m pytest -m slow tests/interop/test_live_transformers.py
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxformer.interop import save_pretrained  # noqa: E402
from jaxformer.model import ModelConfig  # noqa: E402
from jaxformer.model.functional import apply  # noqa: E402
from tests.interop import decoder_checks as dc  # noqa: E402
from tests.interop.common import ATOL, FIXTURES, assert_regenerated, fixture, max_diff  # noqa: E402

D = dict(vocab_size=80, d_model=32, n_heads=4, max_seq_len=64)
CONFIGS = {
    "gpt2": ModelConfig(kind="decoder", n_layers=2, activation="gelu_tanh", norm="layernorm", position="learned",
                        tie_embeddings=True, use_bias=True, **D),
    "llama": ModelConfig(kind="decoder", n_layers=2, n_kv_heads=2, d_ff=64, activation="swiglu", norm="rmsnorm",
                         position="rope", tie_embeddings=False, rope_scaling=dict(
                             kind="llama3", factor=8.0, original_max_position=32), rope_base=5e5, **D),
    "qwen2": ModelConfig(kind="decoder", n_layers=2, n_kv_heads=2, d_ff=64, activation="swiglu", norm="rmsnorm",
                         position="rope", tie_embeddings=True, qkv_bias=True, **D),
    "qwen2_window": ModelConfig(kind="decoder", n_layers=2, n_kv_heads=2, d_ff=64, activation="swiglu",
                                norm="rmsnorm", position="rope", tie_embeddings=False, qkv_bias=True,
                                attention_window=(3, 0), **D),
    "llama_geglu_bias": ModelConfig(kind="decoder", n_layers=2, head_dim=16, d_ff=64, activation="geglu",
                                    norm="rmsnorm", position="rope", tie_embeddings=True, use_bias=True,
                                    rope_scaling=dict(kind="linear", factor=2.0), **D),
    "mistral": ModelConfig(kind="decoder", n_layers=2, n_kv_heads=1, d_ff=64, activation="swiglu", norm="rmsnorm",
                           position="rope", tie_embeddings=False, attention_window=(2, 0), **D),
    "bloom": ModelConfig(kind="decoder", n_layers=2, activation="gelu_tanh", norm="layernorm", position="alibi",
                         embed_norm=True, tie_embeddings=True, use_bias=True, **{**D, "n_heads": 8}),
    "bert": ModelConfig(kind="encoder", n_layers=2, activation="gelu", norm="layernorm", norm_position="post",
                        norm_eps=1e-12, position="learned", embed_norm=True, type_vocab_size=2, head_transform=True,
                        head_bias=True, tie_embeddings=True, use_bias=True, **D),
    "marian": ModelConfig(kind="encoder_decoder", n_layers=2, n_encoder_layers=2, d_ff=64, activation="silu",
                          norm="layernorm", norm_position="post", position="sinusoidal", sinusoidal_layout="halves",
                          scale_embeddings=True, head_bias=True, tie_embeddings=True, use_bias=True, **D),
}


@pytest.mark.filterwarnings("default")  # transformers' own warnings (e.g. "pip install sacremoses") are not ours
def test_fixtures_regenerate_identically(tmp_path):
    from tests.interop import make_fixtures

    assert make_fixtures.main(["--out", str(tmp_path)]) == 0
    # make_fixtures.py's own directories (gguf/ and peft/ have their own generators and live checks)
    for d in sorted(p for p in FIXTURES.iterdir() if (p / "expected.npz").is_file()):
        _, committed, _ = fixture(d.name)
        with np.load(tmp_path / d.name / "expected.npz") as z:
            fresh = {k: z[k] for k in z.files}
        assert_regenerated(fresh, committed, d.name)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_transformers_reads_what_jaxformer_writes(model_type, tmp_path):
    config = CONFIGS[model_type]
    graphdef, state = dc.random_state(config, seed=1, std=0.2)
    out = save_pretrained(tmp_path / model_type, config, state, model_type=model_type.split("_")[0])
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, config.vocab_size, (2, 12)).astype(np.int64)
    with torch.no_grad():
        if model_type == "bert":
            model = transformers.BertForMaskedLM.from_pretrained(out, attn_implementation="eager").eval()
            types = np.zeros_like(tokens)
            types[:, 6:] = 1
            theirs = model(torch.tensor(tokens), token_type_ids=torch.tensor(types)).logits.numpy()
            ours = apply(graphdef, state, jnp.asarray(tokens, jnp.int32), token_types=jnp.asarray(types, jnp.int32))
        elif model_type == "marian":
            model = transformers.MarianMTModel.from_pretrained(out, attn_implementation="eager").eval()
            tgt = tokens[:, :8]
            theirs = model(input_ids=torch.tensor(tokens), decoder_input_ids=torch.tensor(tgt)).logits.numpy()
            ours = apply(graphdef, state, jnp.asarray(tokens, jnp.int32), jnp.asarray(tgt, jnp.int32))
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
            theirs = model(torch.tensor(tokens)).logits.numpy()
            ours = apply(graphdef, state, jnp.asarray(tokens, jnp.int32))
    print(f"{model_type}: max |jaxformer - transformers| = {max_diff(ours, theirs):.2e}")
    assert max_diff(ours, theirs) < ATOL, (model_type, max_diff(ours, theirs))
    assert float(np.std(theirs)) > 0.1  # not a degenerate comparison
    jax.clear_caches()
