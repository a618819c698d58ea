"""Parameter count and training FLOPs per token, by formula from a ModelConfig.

Notation: V vocab, D d_model, N heads, K kv heads, H head dim, F ffn width,
L layers. Per component:

* token embedding ``V D``; untied output head ``D V``; learned positions ``max_seq_len D``;
  token types ``type_vocab_size D``
* output side: head transform ``D D`` (+ bias ``D`` with ``use_bias``) + one norm; logits bias ``V``
* norm: ``2 D`` for LayerNorm with bias, ``D`` otherwise (RMSNorm, bias-free LayerNorm)
* attention: ``W_q D N H + W_k, W_v 2 D K H + W_o N H D`` (+ q/k/v biases ``N H + 2 K H`` with
  ``resolved_qkv_bias``, + output bias ``D`` with ``use_bias``)
* MLP: ``2 D F`` plain, ``3 D F`` gated (+ biases ``F + D`` plain, ``2 F + D`` gated)
* block: self-attention + MLP (+ cross-attention in an encoder-decoder's decoder),
  one norm per sublayer (two with sandwich norm); final norm per stack if enabled.
* LoRA (``lora``): ``R (prod(I) + prod(O))`` per adapted kernel ``[*I, *O]`` per layer (:func:`lora_params`).

FLOPs per token for one training step (forward + backward = 3 x forward), after
Kaplan et al. 2020 / PaLM (Chowdhery et al. 2022, App. B)::

    6 * P_matmul + 12 * T * N H * (L_self + L_cross)

``P_matmul`` counts the weights used in matrix products (attention and MLP
weights of every layer plus the output head ``D V`` and the head transform ``D D``;
not embeddings lookups, norms or biases). The second term is ``q k^T`` and ``p v`` (2 matmuls x 2 flops
x T keys x N H, times 3) with the full T x T score matrix, causal or not (the
usual convention). For an encoder-decoder, "per token" means per target token
of a (source, target) pair both of length ``seq_len``: encoder and decoder
costs are summed; ``L_self = L_enc + L_dec``, ``L_cross = L_dec``.

With LoRA the base is frozen: its weight gradients are not computed, so its matmuls cost 4 (forward
+ input gradient) instead of 6 FLOPs per weight, and the adapters 6: ``4 * P_matmul + 6 * P_lora``
plus the attention term.
"""

from __future__ import annotations

from jaxformer.model.config import ModelConfig


def _norm(cfg: ModelConfig) -> int:
    return 2 * cfg.d_model if (cfg.norm.kind == "layernorm" and cfg.use_bias) else cfg.d_model


def _attention(cfg: ModelConfig, *, cross: bool = False) -> tuple[int, int]:
    """Self-attention (W_k / W_v absent when ``qkv_sharing`` reuses W_q) or cross-attention (never shared)."""
    D, N, K, H = cfg.d_model, cfg.attention.n_heads, cfg.resolved_kv_heads, cfg.resolved_head_dim
    n_kv = 2 if cross else {"none": 2, "qk": 1, "qkv": 0}[cfg.attention.qkv_sharing]  # separate K/V projections
    weights = D * N * H + n_kv * D * K * H + N * H * D
    biases = (N * H + n_kv * K * H if cfg.resolved_qkv_bias else 0) + (D if cfg.use_bias else 0)
    return weights, biases


def _mlp(cfg: ModelConfig) -> tuple[int, int]:
    D, F = cfg.d_model, cfg.resolved_d_ff
    n_in = 2 if cfg.ffn.gated else 1
    weights = n_in * D * F + F * D
    biases = n_in * F + D if cfg.use_bias else 0
    return weights, biases


def _block_matmul(cfg: ModelConfig, cross: bool) -> int:
    return _attention(cfg)[0] + (_attention(cfg, cross=True)[0] if cross else 0) + _mlp(cfg)[0]


def _block(cfg: ModelConfig, cross: bool) -> int:
    n_sub = 3 if cross else 2
    norms = n_sub * (2 if cfg.norm.sandwich else 1) * _norm(cfg)
    return sum(_attention(cfg)) + (sum(_attention(cfg, cross=True)) if cross else 0) + sum(_mlp(cfg)) + norms


def _projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(prod(I), prod(O))`` of each self-attention / MLP kernel ``[*I, *O]``."""
    D, N, K, H, F = cfg.d_model, cfg.attention.n_heads, cfg.resolved_kv_heads, cfg.resolved_head_dim, cfg.resolved_d_ff
    return {"w_q": (D, N * H), "w_k": (D, K * H), "w_v": (D, K * H), "w_o": (N * H, D), "w_gate": (D, F),
            "w_up": (D, F), "w_down": (F, D), "w_in": (D, F), "w_out": (F, D)}


def lora_params(config: ModelConfig) -> int:
    """Parameters of the adapters alone (0 without ``lora``): what a LoRA run trains."""
    cfg = config
    if cfg.lora is None:
        return 0
    shapes = _projection_shapes(cfg)
    per_layer = sum(cfg.lora.rank * (shapes[t][0] + shapes[t][1]) for t in cfg.lora_targets)
    return (cfg.n_encoder_stack_layers + cfg.n_decoder_layers) * per_layer


def count_params(config: ModelConfig) -> int:
    """Number of parameters the model has (the module docstring lists every term)."""
    cfg = config
    V, D = cfg.vocab_size, cfg.d_model
    cross = cfg.kind == "encoder_decoder"
    n_enc, n_dec = cfg.n_encoder_stack_layers, cfg.n_decoder_layers
    total = V * D
    if not cfg.tie_embeddings:
        total += D * V
    if cfg.positions.kind == "learned":
        total += cfg.max_seq_len * D
    total += cfg.hf_options.type_vocab_size * D
    if cfg.norm.embed:
        total += _norm(cfg)
    if cfg.hf_options.head_transform:
        total += D * D + (D if cfg.use_bias else 0) + _norm(cfg)
    if cfg.hf_options.head_bias:
        total += V
    total += n_enc * _block(cfg, cross=False) + n_dec * _block(cfg, cross=cross)
    if cfg.norm.resolved_final:
        total += ((n_enc > 0) + (n_dec > 0)) * _norm(cfg)
    return total + lora_params(cfg)


def matmul_params(config: ModelConfig) -> int:
    """Weights used in matrix products per token: all blocks' attention and MLP weights + the head
    (+ the head transform)."""
    cfg = config
    cross = cfg.kind == "encoder_decoder"
    return (cfg.n_encoder_stack_layers * _block_matmul(cfg, cross=False)
            + cfg.n_decoder_layers * _block_matmul(cfg, cross=cross)
            + cfg.d_model * cfg.vocab_size + (cfg.d_model ** 2 if cfg.hf_options.head_transform else 0))


def flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token at sequence length ``seq_len``."""
    if seq_len <= 0:
        raise ValueError(f"seq_len={seq_len} must be > 0")
    cfg = config
    d_attn = cfg.attention.n_heads * cfg.resolved_head_dim
    n_self = cfg.n_encoder_stack_layers + cfg.n_decoder_layers
    n_cross = cfg.n_decoder_layers if cfg.kind == "encoder_decoder" else 0
    attention = 12 * seq_len * d_attn * (n_self + n_cross)
    if cfg.lora is not None:  # a frozen base: no weight gradients (see the module doc)
        return 4 * matmul_params(cfg) + 6 * lora_params(cfg) + attention
    return 6 * matmul_params(cfg) + attention
