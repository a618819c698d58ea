"""The Transformer in three forms, a class per ``ModelConfig.kind`` over the shared :class:`Stack`.

* :class:`DecoderLM` (``"decoder"``): causal LM. ``model(tokens) -> logits [B, T, V]``; ``decode``.
* :class:`Encoder` (``"encoder"``): bidirectional encoder with a per-token head over the vocabulary
  (an MLM head). ``model(tokens) -> logits [B, T, V]``; ``encode`` gives the hidden states.
* :class:`EncoderDecoder` (``"encoder_decoder"``): ``model(src_tokens, tgt_tokens) -> logits [B, T, V]``
  over the target; ``encode`` / ``decode`` expose the two halves.

``Transformer(config)`` builds the class ``config.kind`` names (and ``isinstance(m, Transformer)`` holds
for all three); each class refuses a config of another kind.

Token and output embeddings are one table when ``tie_embeddings``; source and
target share the token table in the encoder-decoder (Vaswani et al. §3.4).
Logits are float32 whatever the compute dtype.

Options for loading published checkpoints (all off by default):

* ``hf_options.type_vocab_size > 0``: a token-type table ``type_embed`` added to the token embedding of
  every stream the model embeds (``token_types [B, T]``, default 0); BERT's order is
  ``norm.embed(token + type + position)``.
* ``hf_options.head_transform``: ``logits`` first applies ``head_transform`` (``norm(act(x W + b))``,
  :class:`jaxformer.nn.HeadTransform`; BERT's MLM head), so ``encode`` still returns the last
  hidden states.
* ``hf_options.head_bias``: ``logits_bias [V]`` added to the logits (before ``logits_softcap``).

Self-attention (encoder and decoder) follows the config's sparse pattern
(``sparsity.window``, ``global_tokens``, ``random_blocks``): global positions
are absolute row positions, so in a packed row only the first document sees
position 0 as global. A KV cache owns its mask: a decoder band ``(W-1, right)`` is a sliding
window a cache applies (its ``window`` must be ``config.sparsity.causal_window``); global tokens and random
blocks refuse a cache.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from jaxformer.model.config import ModelConfig
from jaxformer.model.stack import Stack, make_norm_for
from jaxformer.nn.embedding import Embed, HeadTransform, LearnedPositions, LMHead
from jaxformer.nn.params import add_bias, param, zeros
from jaxformer.ops.masks import MaskSpec
from jaxformer.ops.normalization import DeepNormConstants, deepnorm_constants
from jaxformer.ops.positional import sinusoidal_positions
from jaxformer.typing import (
    Activations,
    KvPositions,
    KvSegmentIds,
    Lengths,
    Logits,
    Memory,
    Positions,
    SegmentIds,
    SourceTokens,
    Tokens,
)


def _check_tokens(name: str, tokens) -> None:
    if jnp.ndim(tokens) != 2:
        raise ValueError(f"{name} must be int [B, T]; got {name}.shape={jnp.shape(tokens)}")
    if not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
        raise ValueError(f"{name} must be an integer array; got dtype {jnp.result_type(tokens)}")


def _check_bt(name: str, x, tokens_name: str, tokens, allow_t: bool) -> None:
    if x is None:
        return
    B, T = jnp.shape(tokens)
    ok = jnp.shape(x) == (B, T) or (allow_t and jnp.shape(x) == (T,))
    if not ok:
        want = "[B, T] or [T]" if allow_t else "[B, T]"
        raise ValueError(f"{name}.shape={jnp.shape(x)} must be {want} for {tokens_name}.shape={(B, T)}")


def _check_cache_window(cfg: ModelConfig, cache: Sequence) -> None:
    """ValueError unless a KV cache can give this config's self-attention mask (see the module doc)."""
    sp = cfg.sparsity
    if sp.random_blocks is not None or sp.global_tokens:
        raise ValueError(
            f"a KV cache takes no sparsity.global_tokens={sp.global_tokens}, random_blocks={sp.random_blocks} "
            "(the cache owns the mask and supports neither); decode without cache, or use a config without them")
    want = sp.causal_window
    if want is None:
        return
    for i, c in enumerate(cache):
        got = getattr(c, "window", None)
        if got != want:
            raise ValueError(
                f"cache[{i}].window={got} but config.sparsity.window={sp.window} is a sliding window "
                f"of sparsity.causal_window={want} positions; build the caches from this config "
                "(init_caches(config, ...), or an Engine, which takes the window from the config)")


class _ByKind(type(nnx.Module)):
    """``Transformer(config)`` builds the class of ``config.kind`` (:data:`MODEL_CLASSES`)."""

    def __call__(cls, config: ModelConfig, *args, **kwargs):
        if cls is Transformer:
            if not isinstance(config, ModelConfig):
                raise TypeError(f"Transformer(config) takes a ModelConfig, got {type(config).__name__}")
            cls = MODEL_CLASSES[config.kind]
        return type(nnx.Module).__call__(cls, config, *args, **kwargs)


class Transformer(nnx.Module, metaclass=_ByKind):
    """What the three model classes share: embeddings, the stacks ``config`` asks for, the output head.

    ``Transformer(config)`` returns a :class:`DecoderLM`, :class:`Encoder` or :class:`EncoderDecoder`.
    """

    kind: str = ""  # the ModelConfig.kind a subclass builds

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs | None = None):
        cfg = config
        if cfg.kind != self.kind:
            raise ValueError(f"{type(self).__name__} builds kind={self.kind!r}, got config.kind={cfg.kind!r}; "
                             f"Transformer(config) picks the class ({MODEL_CLASSES[cfg.kind].__name__})")
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.config = cfg
        dtypes = dict(param_dtype=cfg.param_dtype, dtype=cfg.compute_dtype)
        hf = cfg.hf_options
        self.embed = Embed(cfg.vocab_size, cfg.d_model, std=cfg.init_std, rngs=rngs, **dtypes)
        self.pos_embed = (LearnedPositions(cfg.max_seq_len, cfg.d_model, rngs=rngs, **dtypes)
                          if cfg.positions.kind == "learned" else None)
        self.type_embed = (Embed(hf.type_vocab_size, cfg.d_model, std=cfg.init_std, rngs=rngs, **dtypes)
                           if hf.type_vocab_size else None)
        self.embed_norm = make_norm_for(cfg, rngs) if cfg.norm.embed else None

        n_enc, n_dec = cfg.n_encoder_stack_layers, cfg.n_decoder_layers
        if cfg.norm.placement == "deepnorm":
            dn = deepnorm_constants(n_enc, n_dec)
        else:
            dn = DeepNormConstants(None, None, None, None)
        self.encoder = (Stack(cfg, n_enc, cross=False, alpha=dn.encoder_alpha, beta=dn.encoder_beta,
                              rngs=rngs) if n_enc else None)
        self.decoder = (Stack(cfg, n_dec, cross=cfg.kind == "encoder_decoder", alpha=dn.decoder_alpha,
                              beta=dn.decoder_beta, rngs=rngs) if n_dec else None)
        self.head = (None if cfg.tie_embeddings
                     else LMHead(cfg.d_model, cfg.vocab_size, std=cfg.init_std, rngs=rngs, **dtypes))
        self.head_transform = (HeadTransform(cfg.d_model, cfg.ffn.activation, norm=cfg.norm, use_bias=cfg.use_bias,
                                             std=cfg.init_std, rngs=rngs, **dtypes)
                               if hf.head_transform else None)
        self.logits_bias = (param(rngs, zeros, (cfg.vocab_size,), ("vocab",), cfg.param_dtype)
                            if hf.head_bias else None)

    # -- pieces
    def _check_token_types(self, token_types, tokens) -> None:
        if token_types is None:
            return
        if self.type_embed is None:
            raise ValueError(f"token_types given to a model with config.hf_options.type_vocab_size="
                             f"{self.config.hf_options.type_vocab_size} (no token-type embedding)")
        _check_bt("token_types", token_types, "tokens", tokens, allow_t=False)
        if not jnp.issubdtype(jnp.result_type(token_types), jnp.integer):
            raise ValueError(f"token_types must be an integer array; got dtype {jnp.result_type(token_types)}")

    def embed_tokens(self, tokens: Tokens, positions: Positions | None = None,
                     token_types: Tokens | None = None) -> Float[Array, "B T D"]:
        """``tokens [B, T] -> x [B, T, D]``: token embedding (+ token types) (+ absolute positions) (+ norm)."""
        cfg = self.config
        kind = cfg.positions.kind
        T = tokens.shape[1]
        self._check_token_types(token_types, tokens)
        x = self.embed(tokens)
        if cfg.scale_embeddings:
            x = x * jnp.asarray(math.sqrt(cfg.d_model), x.dtype)
        if self.type_embed is not None:
            x = x + self.type_embed(jnp.zeros_like(tokens) if token_types is None else token_types)
        if kind in ("sinusoidal", "learned"):
            if positions is None:
                if kind == "learned" and T > cfg.max_seq_len:
                    raise ValueError(f"tokens.shape={tokens.shape}: T={T} exceeds max_seq_len={cfg.max_seq_len}")
                positions = jnp.arange(T, dtype=jnp.int32)
            pos = positions if positions.ndim == 2 else positions[None, :]
            if kind == "sinusoidal":
                pe = sinusoidal_positions(pos, cfg.d_model, layout=cfg.positions.sinusoidal_layout).astype(x.dtype)
            else:
                pe = self.pos_embed(pos)
            x = x + pe
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        return x

    def logits(self, x: Activations) -> Logits:
        """Final hidden states ``[B, T, D] -> logits float32 [B, T, V]``: head transform (if configured),
        output projection (tied or not), ``+ logits_bias`` (if configured), soft cap (if configured)."""
        if self.head_transform is not None:
            x = self.head_transform(x)
        out = self.embed.attend(x) if self.head is None else self.head(x)
        out = add_bias(out, self.logits_bias, jnp.float32)
        cap = self.config.logits_softcap
        return out if cap is None else cap * jnp.tanh(out / cap)


class _Encodes:
    """``encode``: the bidirectional stack (:class:`Encoder`, :class:`EncoderDecoder`)."""

    def encode(self, tokens: SourceTokens, *, positions: KvPositions | None = None,
               segment_ids: KvSegmentIds | None = None, lengths: Lengths | None = None,
               token_types: SourceTokens | None = None) -> Float[Array, "B S D"]:
        """Bidirectional encoder: ``tokens [B, S] -> hidden [B, S, D]``.

        ``segment_ids [B, S]`` (packed sequences) and/or ``lengths [B]`` (right padding) mask keys;
        ``token_types [B, S]`` (needs ``hf_options.type_vocab_size > 0``; default zeros) select token-type
        embeddings.
        """
        _check_tokens("tokens", tokens)
        _check_bt("positions", positions, "tokens", tokens, allow_t=True)
        _check_bt("segment_ids", segment_ids, "tokens", tokens, allow_t=False)
        mask = self.config.self_attention_mask(causal=False, segment_ids=segment_ids, lengths=lengths)
        x = self.embed_tokens(tokens, positions, token_types)
        x, _ = self.encoder(x, positions=positions, mask=mask)
        return x


class _Decodes:
    """The causal stack and the head (:class:`DecoderLM`, :class:`EncoderDecoder`); each class's ``decode``
    says what it takes and builds the cross-attention ``context`` (``(memory, context_mask)``, or None)."""

    def _decode(self, tokens: Tokens, context: tuple | None, *, positions: Positions | None,
                segment_ids: SegmentIds | None, cache: Sequence | None, token_types: Tokens | None,
                logits_at: Lengths | None) -> Float[Array, "B _ V"] | tuple[Float[Array, "B _ V"], list]:
        cfg = self.config
        if cache is not None:
            if positions is None:
                raise ValueError("positions [B, T] (absolute) are required with cache")
            if segment_ids is not None:
                raise ValueError("segment_ids cannot be combined with cache (the cache owns the mask)")
            _check_cache_window(cfg, cache)
        memory, context_mask = (None, None) if context is None else context
        mask = cfg.self_attention_mask(causal=True, segment_ids=segment_ids)
        x = self.embed_tokens(tokens, positions, token_types)
        x, new_caches = self.decoder(x, positions=positions, mask=mask, context=memory,
                                     context_mask=context_mask, caches=cache)
        if logits_at is not None:
            if jnp.shape(logits_at) != (tokens.shape[0],):
                raise ValueError(f"logits_at.shape={jnp.shape(logits_at)} must be [B]=({tokens.shape[0]},)")
            x = jnp.take_along_axis(x, jnp.asarray(logits_at, jnp.int32)[:, None, None], axis=1)
        logits = self.logits(x)
        return logits if cache is None else (logits, new_caches)


def _check_decode_inputs(tokens, positions, segment_ids) -> None:
    _check_tokens("tokens", tokens)
    _check_bt("positions", positions, "tokens", tokens, allow_t=True)
    _check_bt("segment_ids", segment_ids, "tokens", tokens, allow_t=False)


class DecoderLM(_Decodes, Transformer):
    """A causal language model (``kind="decoder"``): ``model(tokens) -> logits [B, T, V]``."""

    kind = "decoder"

    def __call__(self, tokens: Tokens, *, positions: Positions | None = None,
                 segment_ids: SegmentIds | None = None, cache: Sequence | None = None,
                 token_types: Tokens | None = None, logits_at: Lengths | None = None,
                 ) -> Float[Array, "B _ V"] | tuple[Float[Array, "B _ V"], list]:
        """Logits ``float32 [B, T, V]``, or ``(logits, new_caches)`` when ``cache`` is given.

        ``positions`` default to ``arange(T)``; packed sequences pass ``positions [B, T]`` and
        ``segment_ids [B, T]``. ``cache``: one :class:`~jaxformer.nn.KVCacheLayer` per layer.
        ``token_types [B, T]`` (``hf_options.type_vocab_size > 0``; default zeros). ``logits_at [B]``:
        logits ``[B, 1, V]`` of that position of each row only (the head runs there alone; equal to
        ``[:, logits_at]`` of the full logits; a sampler needs no others).
        """
        _check_decode_inputs(tokens, positions, segment_ids)
        return self._decode(tokens, None, positions=positions, segment_ids=segment_ids, cache=cache,
                            token_types=token_types, logits_at=logits_at)

    decode = __call__  # the causal decoder is the whole model: ``model.decode(tokens)`` == ``model(tokens)``


class Encoder(_Encodes, Transformer):
    """A bidirectional encoder with an MLM head (``kind="encoder"``): ``model(tokens) -> logits [B, T, V]``."""

    kind = "encoder"

    def __call__(self, tokens: Tokens, *, positions: Positions | None = None,
                 segment_ids: SegmentIds | None = None, lengths: Lengths | None = None,
                 token_types: Tokens | None = None) -> Float[Array, "B T V"]:
        """Logits ``float32 [B, T, V]`` at every position; ``segment_ids [B, T]`` and/or ``lengths [B]`` mask
        keys (see :meth:`encode`)."""
        x = self.encode(tokens, positions=positions, segment_ids=segment_ids, lengths=lengths,
                        token_types=token_types)
        return self.logits(x)


class EncoderDecoder(_Encodes, _Decodes, Transformer):
    """Encoder-decoder (``kind="encoder_decoder"``): ``model(src_tokens, tgt_tokens) -> logits [B, T, V]``."""

    kind = "encoder_decoder"

    def __call__(self, tokens: SourceTokens, tgt_tokens: Tokens | None = None, *,
                 positions: KvPositions | None = None, segment_ids: KvSegmentIds | None = None,
                 lengths: Lengths | None = None, token_types: SourceTokens | None = None,
                 tgt_positions: Positions | None = None, tgt_segment_ids: SegmentIds | None = None,
                 ) -> Float[Array, "B T V"]:
        """Target logits ``float32 [B, T, V]`` of the whole target (teacher forcing).

        ``positions``, ``segment_ids``, ``lengths``, ``token_types`` describe the source ``tokens [B, S]``;
        ``tgt_positions``, ``tgt_segment_ids`` the target (which takes token type 0). Step-by-step decoding
        encodes once and calls :meth:`decode` with a cache (and ``logits_at``) per step.
        """
        if tgt_tokens is None:
            raise ValueError("encoder_decoder needs model(src_tokens, tgt_tokens); encode(src_tokens) gives "
                             "the memory alone")
        memory = self.encode(tokens, positions=positions, segment_ids=segment_ids, lengths=lengths,
                             token_types=token_types)
        return self.decode(tgt_tokens, memory, positions=tgt_positions, segment_ids=tgt_segment_ids,
                           memory_segment_ids=segment_ids, memory_lengths=lengths)

    def decode(self, tokens: Tokens, memory: Memory | None, *, positions: Positions | None = None,
               segment_ids: SegmentIds | None = None, memory_segment_ids: KvSegmentIds | None = None,
               memory_lengths: Lengths | None = None, cache: Sequence | None = None,
               logits_at: Lengths | None = None) -> Float[Array, "B _ V"] | tuple[Float[Array, "B _ V"], list]:
        """Causal decoder over ``memory [B, S, D]`` (``encode(src_tokens)``): ``tokens [B, T] -> logits
        [B, T, V]`` (``, new_caches`` with ``cache``). The memory is masked by ``memory_segment_ids [B, S]``
        (with ``segment_ids``) and/or ``memory_lengths [B]``; the target takes token type 0; ``logits_at``
        as :meth:`DecoderLM.decode`.
        """
        _check_decode_inputs(tokens, positions, segment_ids)
        if memory is None:
            raise ValueError("encoder_decoder decode needs memory = encode(src_tokens)")
        if memory.ndim != 3 or memory.shape[0] != tokens.shape[0] or memory.shape[2] != self.config.d_model:
            raise ValueError(f"memory.shape={memory.shape} must be [B, S, D] with B={tokens.shape[0]}, "
                             f"D={self.config.d_model}")
        if (segment_ids is None) != (memory_segment_ids is None):
            raise ValueError("segment_ids and memory_segment_ids must be given together")
        context_mask = MaskSpec(q_segment_ids=segment_ids, kv_segment_ids=memory_segment_ids,
                                kv_lengths=memory_lengths)
        return self._decode(tokens, (memory, context_mask), positions=positions, segment_ids=segment_ids,
                            cache=cache, token_types=None, logits_at=logits_at)


MODEL_CLASSES: dict[str, type[Transformer]] = {c.kind: c for c in (DecoderLM, Encoder, EncoderDecoder)}
"""The model class of each ``ModelConfig.kind``."""
