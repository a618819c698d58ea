"""Named ModelConfigs: the published architectures and tiny variants of each for tests.

``get(name, **overrides)`` returns a preset with fields replaced (and re-validated);
``names()`` lists them. Published parameter counts (tests check the formula and the
built model against them): gpt2_small 124,439,808; llama_7b 6,738,415,616;
llama3_1b 1,235,814,400; bloom_560m 559,214,592.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxformer.model.config import ModelConfig


def vaswani_base() -> ModelConfig:
    """"Attention Is All You Need" base model: 6+6 layers, post-LN, sinusoidal, ReLU FFN 4d."""
    return ModelConfig(
        kind="encoder_decoder", vocab_size=37000, d_model=512, n_layers=6, n_encoder_layers=6,
        max_seq_len=512, scale_embeddings=True, tie_embeddings=True, use_bias=True,
        attention=dict(n_heads=8), positions=dict(kind="sinusoidal"), ffn=dict(activation="relu"),
        norm=dict(kind="layernorm", placement="post", eps=1e-6),
    )


def gpt2_small() -> ModelConfig:
    """GPT-2 small (124M): pre-LN, learned positions 1024, gelu_tanh, tied head, biases."""
    return ModelConfig(
        kind="decoder", vocab_size=50257, d_model=768, n_layers=12, max_seq_len=1024,
        tie_embeddings=True, use_bias=True, attention=dict(n_heads=12), positions=dict(kind="learned"),
        ffn=dict(activation="gelu_tanh"), norm=dict(kind="layernorm", placement="pre", eps=1e-5),
    )


def llama_7b() -> ModelConfig:
    """LLaMA-7B: RMSNorm, RoPE, SwiGLU (8d/3 -> 11008), untied, no biases, MHA (32 kv heads)."""
    return ModelConfig(
        kind="decoder", vocab_size=32000, d_model=4096, n_layers=32, max_seq_len=2048,
        tie_embeddings=False, use_bias=False, attention=dict(n_heads=32),
        positions=dict(kind="rope", rope_base=10000.0), ffn=dict(activation="swiglu", multiple_of=256),
        norm=dict(kind="rmsnorm", placement="pre", eps=1e-6),
    )


def llama3_1b() -> ModelConfig:
    """Llama 3.2 1B: GQA (32 heads, 8 kv heads), RoPE base 5e5 with llama3 scaling, tied."""
    return ModelConfig(
        kind="decoder", vocab_size=128256, d_model=2048, n_layers=16, max_seq_len=131072,
        tie_embeddings=True, use_bias=False, attention=dict(n_heads=32, n_kv_heads=8),
        positions=dict(kind="rope", rope_base=500000.0, rope_scaling=dict(
            kind="llama3", factor=32.0, original_max_position=8192, low_freq_factor=1.0, high_freq_factor=4.0)),
        ffn=dict(activation="swiglu", d_ff=8192), norm=dict(kind="rmsnorm", placement="pre", eps=1e-5),
    )


def bloom_560m() -> ModelConfig:
    """BLOOM-560m: ALiBi, LayerNorm (also after the embedding), gelu_tanh, tied, biases."""
    return ModelConfig(
        kind="decoder", vocab_size=250880, d_model=1024, n_layers=24, max_seq_len=2048,
        tie_embeddings=True, use_bias=True, attention=dict(n_heads=16), positions=dict(kind="alibi"),
        ffn=dict(activation="gelu_tanh"), norm=dict(kind="layernorm", placement="pre", eps=1e-5, embed=True),
    )


_TINY = dict(vocab_size=256, d_model=64, attention=dict(n_heads=4), max_seq_len=128)


def vaswani_tiny() -> ModelConfig:
    return get("vaswani_base", n_layers=2, n_encoder_layers=2, **_TINY)


def gpt2_tiny() -> ModelConfig:
    return get("gpt2_small", n_layers=2, **_TINY)


def llama_tiny() -> ModelConfig:
    """Tiny LLaMA-style decoder with GQA (4 heads, 2 kv heads)."""
    return get("llama_7b", n_layers=2, **{**_TINY, "attention": dict(n_heads=4, n_kv_heads=2)},
               ffn=dict(multiple_of=16))


def bloom_tiny() -> ModelConfig:
    return get("bloom_560m", n_layers=2, **_TINY)


_SPARSE_ENCODER = dict(
    kind="encoder", vocab_size=256, d_model=64, n_layers=2, max_seq_len=512, tie_embeddings=True,
    use_bias=True, attention=dict(n_heads=4, impl="auto"), positions=dict(kind="learned"),
    ffn=dict(activation="gelu"), norm=dict(kind="layernorm", placement="pre"),
)


def longformer_tiny() -> ModelConfig:
    """Tiny Longformer-style encoder: sliding window (32, 32) plus global attention at position 0 (CLS)."""
    return ModelConfig(**_SPARSE_ENCODER, sparsity=dict(window=(32, 32), global_tokens=(0,)))


def bigbird_tiny() -> ModelConfig:
    """Tiny BigBird-style encoder: window (16, 16), global position 0, 2 random blocks of 16 per query block."""
    return ModelConfig(**_SPARSE_ENCODER, sparsity=dict(window=(16, 16), global_tokens=(0,),
                                                        random_blocks=dict(num_blocks=2, block_size=16)))


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    f.__name__: f for f in (vaswani_base, gpt2_small, llama_7b, llama3_1b, bloom_560m,
                            vaswani_tiny, gpt2_tiny, llama_tiny, bloom_tiny, longformer_tiny, bigbird_tiny)
}


def names() -> tuple[str, ...]:
    return tuple(PRESETS)


def get(name: str, **overrides) -> ModelConfig:
    """Preset ``name`` with ``overrides`` applied (top-level fields, sections merged field by field, or the
    flat keys of before the sections); unknown names or fields raise ValueError."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {names()}")
    return PRESETS[name]().replace(**overrides)
