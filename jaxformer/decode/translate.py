"""Greedy and beam-search translation with an encoder-decoder :class:`~jaxformer.model.Transformer`.

The source is encoded once (one jitted call); the target is then decoded one token per step through a
contiguous :class:`~jaxformer.decode.kv_cache.KVCache` per decoder layer (self-attention only: each step's
cross-attention projects the encoder output again). Every array has a fixed shape (the cache holds
``1 + max_new_tokens`` rows, the step's position is an argument), so one compile serves every step.
The model computes on the device; the search bookkeeping (a few ``[B, beams]`` arrays) runs in numpy.

The semantics are those of ``transformers``' ``generate`` for an encoder-decoder (e.g.
``MarianMTModel``), so a checkpoint loaded with :mod:`jaxformer.interop` gives the same tokens (ties
aside). The settings travel as one :class:`TranslationConfig` (``transformers``' ``GenerationConfig``, the
part of it translation implements); ``TranslationConfig(**jaxformer.interop.marian.translation_settings(path,
max_seq_len))`` is a checkpoint's, beam settings and ``max_new_tokens`` resolved:

* the target starts with ``start_id`` (Marian: ``<pad>``) and holds at most ``1 + max_new_tokens``
  tokens (transformers' ``max_length``);
* ``suppress_ids`` are never generated (single-token ``bad_words_ids`` / ``suppress_tokens``: their
  log-probability becomes ``-inf``, after the log-softmax, without renormalising);
* ``force_eos`` (``forced_eos_token_id``): at the last allowed step every token but ``eos_id`` is ``-inf``
  and ``eos_id`` gets log-probability 0;
* greedy: a row that produced ``eos_id`` is padded with ``pad_id``; decoding stops when every row has;
* beam search (transformers' vectorised ``_beam_search``, as of 5.24): each step keeps the top
  ``2 * num_beams`` continuations of all beams by summed log-probability; those among the first
  ``num_beams`` that end in ``eos_id`` (or reach the length limit) become finished hypotheses scored
  ``sum_logprob / generated_length ** length_penalty`` (generated tokens counted with the ``eos``, without
  the start token); the best ``num_beams`` unfinished ones continue. ``early_stopping``: ``True`` stops a
  row once it has ``num_beams`` hypotheses; ``False`` (the default) once the best running beam, scored at
  the current length, cannot beat the worst kept hypothesis; ``"never"`` as ``False`` but, for a
  positive ``length_penalty``, scores the running beam at the maximum length. The best hypothesis is
  returned.

Outputs are int32 ``[B, 1 + n]`` including the start token, ``n`` the longest row's generated length,
shorter rows padded with ``pad_id`` (as ``generate`` returns them).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer.decode.kv_cache import KVCache

NEG = np.float32(-1.0e9)  # transformers' "impossible" score in beam search (finite, unlike -inf)


@dataclasses.dataclass(frozen=True)
class TranslationConfig:
    """How to decode a translation (see the module docstring for the rules).

    Attributes:
      start_id: the target's first token (``decoder_start_token_id``).
      eos_id: ends a row.
      max_new_tokens: tokens generated at most (the start token not counted); None: unset, which
        translating refuses (``config.replace(max_new_tokens=N)``).
      pad_id: fills rows after their ``eos_id`` (None: ``eos_id``).
      suppress_ids: tokens never generated.
      force_eos: the last allowed token is ``eos_id``.
      num_beams: 1 greedy, more: beam search.
      length_penalty: beam search's hypothesis score = summed log-probability / generated length **
        length_penalty.
      early_stopping: beam search's stopping rule: ``False``, ``True`` or ``"never"``.
    """

    start_id: int
    eos_id: int
    max_new_tokens: int | None = None
    pad_id: int | None = None
    suppress_ids: tuple[int, ...] = ()
    force_eos: bool = False
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self):
        object.__setattr__(self, "suppress_ids", tuple(int(i) for i in self.suppress_ids))
        if self.num_beams < 1:
            raise ValueError(f"TranslationConfig.num_beams={self.num_beams} must be >= 1")
        if self.early_stopping not in (False, True, "never"):
            raise ValueError(f"TranslationConfig.early_stopping={self.early_stopping!r} must be False, True or "
                             "'never'")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"TranslationConfig.max_new_tokens={self.max_new_tokens} must be >= 1")

    def replace(self, **changes) -> "TranslationConfig":
        """A copy with ``changes`` (field names) applied."""
        return dataclasses.replace(self, **changes)

    @property
    def pad(self) -> int:
        """The id that fills finished rows: ``pad_id``, else ``eos_id``."""
        return self.eos_id if self.pad_id is None else self.pad_id


@functools.partial(jax.jit, static_argnums=0)
def _encode(graphdef, state, src, lengths):
    return nnx.merge(graphdef, state).encode(src, lengths=lengths)


class _Source(NamedTuple):
    """What every step of one translation reads unchanged: the encoder's ``memory [B, S, D]`` and its
    ``lengths [B]``, the ``banned [V]`` tokens and ``eos_id``."""

    memory: jax.Array
    lengths: jax.Array
    banned: jax.Array
    eos_id: int


class _Beams(NamedTuple):
    """The running beams of a step: each one's last ``tokens [B*K]``, the flat beam it continues
    (``origin [B*K]``) and its summed log-probability (``scores [B, K]``)."""

    tokens: jax.Array
    origin: jax.Array
    scores: jax.Array


def _log_probs(graphdef, state, caches, source: _Source, tokens, position, force_eos):
    """Feed ``tokens [B]`` at ``position``; processed next-token log-probabilities ``[B, V]`` and caches."""
    B = tokens.shape[0]
    positions = jnp.full((B, 1), position, jnp.int32)
    logits, caches = nnx.merge(graphdef, state).decode(tokens[:, None], source.memory, positions=positions,
                                                       memory_lengths=source.lengths, cache=caches)
    logp = jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1)
    logp = jnp.where(source.banned[None, :], -jnp.inf, logp)
    only_eos = jnp.where(jnp.arange(logp.shape[-1]) == source.eos_id, 0.0, -jnp.inf)
    return jnp.where(force_eos, only_eos[None, :], logp), caches


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _greedy_step(graphdef, state, caches, source: _Source, tokens, position, force_eos):
    logp, caches = _log_probs(graphdef, state, caches, source, tokens, position, force_eos)
    return jnp.argmax(logp, axis=-1).astype(jnp.int32), caches


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
def _beam_step(graphdef, keep, state, caches, source: _Source, beams: _Beams, position, force_eos):
    """Reorder the caches to the running beams (``beams.origin [B*K]``: the flat beam each continues), feed
    their last tokens, and return the top ``keep`` continuations ``[B, keep]`` of all beams: summed
    log-probability and flat index ``beam * V + token``."""
    caches = jax.tree.map(lambda a: a[beams.origin], caches)
    logp, caches = _log_probs(graphdef, state, caches, source, beams.tokens, position, force_eos)
    running_scores = beams.scores
    B, K = running_scores.shape
    total = (logp.reshape(B, K, -1) + running_scores[:, :, None]).reshape(B, -1)
    values, index = jax.lax.top_k(total, keep)
    return values, index, caches


def _checked(config) -> TranslationConfig:
    if not isinstance(config, TranslationConfig):
        raise TypeError(f"config must be a jaxformer.decode.TranslationConfig; got {type(config).__name__} "
                        "(TranslationConfig(**jaxformer.interop.marian.translation_settings(path, max_seq_len)) is a "
                        "checkpoint's)")
    return config


def _prepare(model, src_tokens, src_lengths, settings: TranslationConfig, repeat: int):
    """``(graphdef, state, source, caches)`` (:class:`_Source`) with each row repeated ``repeat`` times."""
    max_new_tokens, suppress_ids, eos_id = settings.max_new_tokens, settings.suppress_ids, settings.eos_id
    if max_new_tokens is None:
        raise ValueError("TranslationConfig.max_new_tokens is unset: give it (config.replace(max_new_tokens=N))")
    cfg = model.config
    if cfg.kind != "encoder_decoder":
        raise ValueError(f"translation needs an encoder_decoder model; got config.kind={cfg.kind!r}")
    src = jnp.asarray(src_tokens, jnp.int32)
    if src.ndim != 2:
        raise ValueError(f"src_tokens must be int [B, S]; got shape {src.shape}")
    B, S = src.shape
    lengths = jnp.full((B,), S, jnp.int32) if src_lengths is None else jnp.asarray(src_lengths, jnp.int32)
    if lengths.shape != (B,):
        raise ValueError(f"src_lengths.shape={lengths.shape} must be [B]={(B,)}")
    if 1 + max_new_tokens > cfg.max_seq_len or S > cfg.max_seq_len:
        raise ValueError(f"source length {S} / target length 1 + max_new_tokens = {1 + max_new_tokens} exceed "
                         f"the model's max_seq_len={cfg.max_seq_len}")
    bad = [int(i) for i in suppress_ids if not 0 <= int(i) < cfg.vocab_size] + \
        ([eos_id] if not 0 <= eos_id < cfg.vocab_size else [])
    if bad:
        raise ValueError(f"token ids {bad} are outside the vocabulary [0, {cfg.vocab_size})")
    graphdef, state = nnx.split(model)
    memory = _encode(graphdef, state, src, lengths)
    if repeat > 1:
        memory, lengths = jnp.repeat(memory, repeat, axis=0), jnp.repeat(lengths, repeat, axis=0)
    dtype = jnp.dtype(cfg.compute_dtype)
    caches = [KVCache.zeros(B * repeat, 1 + max_new_tokens, cfg.resolved_kv_heads, cfg.resolved_head_dim, dtype)
              for _ in range(cfg.n_layers)]
    banned = np.zeros(cfg.vocab_size, bool)
    banned[list(suppress_ids)] = True
    return graphdef, state, _Source(memory, lengths, jnp.asarray(banned), eos_id), caches


def greedy_translate(model, src_tokens, src_lengths=None, *, config: TranslationConfig) -> np.ndarray:
    """Greedy decoding of ``model`` (an :class:`~jaxformer.model.EncoderDecoder`) from ``src_tokens [B, S]``.

    Args:
      src_lengths: ``[B]`` valid source tokens per row (right padding); None: all ``S``.
      config: the settings (``num_beams`` must be 1: :func:`beam_translate` or :func:`translate` searches).
    Returns:
      int32 ``[B, 1 + n]``: start token, then the generated tokens (see the module docstring).
    """
    if _checked(config).num_beams != 1:
        raise ValueError(f"greedy_translate: TranslationConfig.num_beams={config.num_beams}; use beam_translate "
                         "or translate for beam search")
    graphdef, state, source, caches = _prepare(model, src_tokens, src_lengths, config, 1)
    start_id, eos_id, pad_id = config.start_id, config.eos_id, config.pad
    max_new_tokens, force_eos = config.max_new_tokens, config.force_eos
    B = source.memory.shape[0]
    out = [np.full(B, start_id, np.int32)]
    running = np.ones(B, bool)
    for step in range(max_new_tokens):
        force = force_eos and step == max_new_tokens - 1
        nxt, caches = _greedy_step(graphdef, state, caches, source, jnp.asarray(out[-1]), step, force)
        nxt = np.where(running, np.asarray(nxt), pad_id).astype(np.int32)
        out.append(nxt)
        running &= nxt != eos_id
        if not running.any():
            break
    return np.stack(out, axis=1)


def beam_translate(model, src_tokens, src_lengths=None, *, config: TranslationConfig) -> np.ndarray:
    """Beam search (transformers' rules, see the module docstring) with ``config.num_beams`` beams: the best
    hypothesis per row. Arguments as :func:`greedy_translate`; returns int32 ``[B, 1 + n]``."""
    graphdef, state, source, caches = _prepare(model, src_tokens, src_lengths, config, _checked(config).num_beams)
    K, start_id, eos_id, pad_id = config.num_beams, config.start_id, config.eos_id, config.pad
    max_new_tokens, force_eos = config.max_new_tokens, config.force_eos
    length_penalty, early_stopping = config.length_penalty, config.early_stopping
    B = source.memory.shape[0] // K
    V = model.config.vocab_size
    L = 1 + max_new_tokens          # transformers' max_length; the prompt is the start token alone
    keep = 2 * K                    # max(2, 1 + number of eos ids) * num_beams
    if keep > K * V:
        raise ValueError(f"num_beams={K} needs 2 * num_beams <= num_beams * vocab_size")
    top = np.arange(keep) < K

    running_seq = np.full((B, K, L), pad_id, np.int64)
    running_seq[:, :, 0] = start_id
    running_scores = np.zeros((B, K), np.float32)
    running_scores[:, 1:] = NEG
    seqs = running_seq.copy()
    seq_len = np.zeros((B, K), np.int64)       # generated tokens of each kept hypothesis
    scores = np.full((B, K), NEG, np.float32)
    finished = np.zeros((B, K), bool)
    improvable = np.ones((B, 1), bool)
    origin = np.arange(B * K, dtype=np.int32)
    rows = np.arange(B)[:, None]
    cur = 1
    while True:
        force = force_eos and cur == L - 1
        beams = _Beams(jnp.asarray(running_seq[:, :, cur - 1].reshape(-1), jnp.int32), jnp.asarray(origin),
                       jnp.asarray(running_scores))
        values, index, caches = _beam_step(graphdef, keep, state, caches, source, beams, cur - 1, force)
        values = np.asarray(values, np.float32)
        index = np.asarray(index, np.int64)
        beam, token = index // V, index % V
        cand_seq = running_seq[rows, beam]                       # [B, keep, L]
        cand_seq[:, :, cur] = token
        hits = (token == eos_id) | (cur + 1 >= L)

        # the best K unfinished continuations run on
        run_scores = values + hits.astype(np.float32) * NEG
        pick = _topk(run_scores, K)
        running_seq = cand_seq[rows, pick]
        running_scores = run_scores[rows, pick]
        origin = (beam[rows, pick] + np.arange(B)[:, None] * K).reshape(-1).astype(np.int32)

        # continuations among the first K that just finished compete with the kept hypotheses
        just = hits & top[None, :]
        cand_scores = values / np.float32(float(cur) ** length_penalty)   # cur tokens generated
        full = finished.all(axis=1, keepdims=True) & (early_stopping is True)
        cand_scores = cand_scores + full.astype(np.float32) * NEG
        cand_scores = cand_scores + (~improvable).astype(np.float32) * NEG
        cand_scores = cand_scores + (~just).astype(np.float32) * NEG
        m_seq = np.concatenate([seqs, cand_seq], axis=1)
        m_scores = np.concatenate([scores, cand_scores], axis=1)
        m_len = np.concatenate([seq_len, np.full((B, keep), cur, np.int64)], axis=1)
        m_fin = np.concatenate([finished, just], axis=1)
        pick = _topk(m_scores, K)
        seqs, scores, seq_len, finished = m_seq[rows, pick], m_scores[rows, pick], m_len[rows, pick], m_fin[rows, pick]

        cur += 1
        best_len = (L - 1) if (early_stopping == "never" and length_penalty > 0.0) else (cur - 1)
        best_running = running_scores[:, :1] / np.float32(float(best_len) ** length_penalty)
        worst = np.where(finished, scores.min(axis=1, keepdims=True), NEG)
        improvable &= (best_running > worst).any(axis=-1, keepdims=True)
        open_beam = not (finished.all() and early_stopping is True)
        if not (improvable.any() and open_beam and not hits.all()):
            break
    n = int(seq_len[:, 0].max())
    return seqs[:, 0, : 1 + n].astype(np.int32)


def _topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest values of each row, largest first (ties: lower index first)."""
    return np.argsort(-x, axis=-1, kind="stable")[:, :k]


def pad_sources(rows, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Token rows of any lengths as ``(src int32 [B, S] right-padded with pad_id, lengths int32 [B])``."""
    rows = [np.asarray(r, np.int32) for r in rows]
    lengths = np.asarray([len(r) for r in rows], np.int32)
    src = np.full((len(rows), int(lengths.max(initial=1))), pad_id, np.int32)
    for i, r in enumerate(rows):
        src[i, :len(r)] = r
    return src, lengths


def translate(model, src_tokens, src_lengths=None, *, config: TranslationConfig) -> np.ndarray:
    """:func:`beam_translate` when ``config.num_beams`` > 1, else :func:`greedy_translate`."""
    search = beam_translate if _checked(config).num_beams > 1 else greedy_translate
    return search(model, src_tokens, src_lengths, config=config)


def add_translate_options(a) -> None:
    """``jaxformer translate``'s arguments on a parser's ``add_argument`` ``a``."""
    a("--hf", metavar="DIR", required=True, help="the checkpoint directory (config.json, model.safetensors, "
      "source.spm / target.spm / vocab.json)")
    a("--text", action="append", default=[], help="a source sentence (repeatable); one translation per line is "
      "printed, in order")
    a("--beams", type=int, help="beam search with N beams; 1: greedy (default: the checkpoint's "
      "generation_config.json num_beams, else greedy)")
    a("--max-new-tokens", type=int, help="default: the checkpoint's max_length - 1, at most the model's context - 1")
    a("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
