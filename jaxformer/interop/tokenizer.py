"""A checkpoint's own tokenizer: ``tokenizer.json`` (the ``tokenizers`` library) or a SentencePiece model.

:func:`load_tokenizer` returns an :class:`HFTokenizer` with the interface of
jaxformer's training tokenizers (``name``, ``vocab_size``, ``bos_id``, ``eos_id``,
``pad_id``, ``encode``, ``decode``, ``token_bytes``) plus ``encode_prompt``, which
adds the special tokens the checkpoint's own tokenizer adds to an input (Llama's
BOS, Marian's EOS), as ``transformers`` does by default.

Sources, in order: a GGUF file (``model.gguf``: its ``tokenizer.ggml.*`` metadata, see
:mod:`jaxformer.interop.gguf`); ``tokenizer.json``; else a SentencePiece model (``source.spm``
/ ``target.spm`` with ``vocab.json`` as Marian ships them: pieces are mapped to
ids through ``vocab.json``; or ``tokenizer.model``, as older Llama checkpoints ship,
whose own ids are the model's). Special tokens come from ``tokenizer_config.json``
/ ``special_tokens_map.json``, then ``config.json``'s ``*_token_id``. The chat template (``chat_template.jinja``,
``tokenizer_config.json``'s ``chat_template``, a GGUF's ``tokenizer.chat_template``) renders with
:meth:`HFTokenizer.apply_chat_template` (jinja2, sandboxed, as transformers renders it).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jaxformer.interop.byte_level import byte_decoder


def _read_json(file: Path) -> dict:
    return json.loads(file.read_text()) if file.is_file() else {}


def _token_str(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _piece_text_bytes(piece: str, byte_level: bool, decoder: dict[str, int]) -> bytes:
    """The bytes of text a vocabulary piece stands for (a byte-level piece's characters mapped back to their
    bytes; a SentencePiece byte-fallback piece ``<0xNN>`` its byte; else the piece, ``\u2581`` a space)."""
    if byte_level:
        return bytes(decoder[c] for c in piece if c in decoder)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


class Codec(NamedTuple):
    """What a tokenizer library does for :class:`HFTokenizer`: ``encode(text) -> ids`` with no special
    tokens, ``decode(ids) -> text`` skipping them, ``prompt(text) -> ids`` with the specials the checkpoint
    adds to an input."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    prompt: Callable[[str], list[int]]


class HFTokenizer:
    """A Hugging Face checkpoint's tokenizer behind jaxformer's tokenizer interface."""

    name = "hf"

    def __init__(self, *, path: Path, vocab: dict[str, int], specials: dict[str, str | None], codec: Codec,
                 byte_level: bool, special_ids: set[int], chat_template: str | None = None,
                 text_ids: frozenset[int] = frozenset()):
        self.path = path
        self._text_ids = text_ids  # added tokens that are text, stored as it (not in a byte-level alphabet)
        self.chat_template = chat_template
        self._specials = specials
        self._vocab = vocab
        self._pieces = {i: piece for piece, i in vocab.items()}
        self._encode, self._decode, self._prompt = codec
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = (
            vocab.get(specials.get(k)) if specials.get(k) is not None else None
            for k in ("bos", "eos", "pad", "unk"))
        self._byte_level = byte_level
        self._special_ids = special_ids | {i for i in (self.bos_id, self.eos_id, self.pad_id) if i is not None}

    def encode(self, data: bytes | str) -> np.ndarray:
        """Text -> ids int32 ``[n]``, no special tokens added (as the training tokenizers)."""
        if isinstance(data, bytes):
            data = data.decode("utf-8", errors="replace")
        return np.asarray(self._encode(data), np.int32)

    def encode_prompt(self, text: str) -> np.ndarray:
        """Text -> ids with the special tokens the checkpoint's tokenizer adds (BOS for Llama...)."""
        return np.asarray(self._prompt(text), np.int32)

    def decode(self, ids) -> str:
        """Ids -> text, special tokens left out."""
        ids = [int(i) for i in np.asarray(ids).reshape(-1) if int(i) not in self._special_ids]
        return self._decode(ids)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = False, **variables) -> str:
        """``messages`` (``[{"role": ..., "content": ...}]``) rendered by the checkpoint's chat template, as
        transformers' ``apply_chat_template(..., tokenize=False)`` renders them; ``encode`` the result (it
        holds its special tokens as text)."""
        if self.chat_template is None:
            raise ValueError(f"{self.path}: the tokenizer has no chat template")
        tokens = {f"{k}_token": v for k, v in self._specials.items() if v is not None}
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    **{**tokens, **variables})

    def piece_bytes(self, i: int) -> bytes:
        """The bytes of text id ``i`` stands for, a part of a character included (empty for a special token or
        an id outside the vocabulary): what the chat API's logprobs ``bytes`` carry."""
        piece = self._pieces.get(int(i))
        if piece is None or int(i) in self._special_ids:
            return b""
        if int(i) in self._text_ids:  # an added token that is text: its own UTF-8, not a byte-level spelling
            return piece.encode("utf-8")
        return _piece_text_bytes(piece, self._byte_level, byte_decoder())

    @property
    def token_bytes(self) -> np.ndarray:
        """Bytes of text each id stands for (0 for special tokens), for bits per byte: :meth:`piece_bytes`'s
        lengths."""
        return np.asarray([len(self.piece_bytes(i)) for i in range(self.vocab_size)], np.int64)


@functools.cache
def _generation_block():
    """A jinja2 extension for transformers' ``{% generation %} ... {% endgeneration %}``: renders the body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return GenerationBlock


def render_chat_template(template: str, messages: list[dict], *, add_generation_prompt: bool = False,
                         **variables) -> str:
    """A jinja2 chat template rendered as transformers renders it: a sandboxed environment with
    ``trim_blocks`` and ``lstrip_blocks``, ``loopcontrols``, ``raise_exception``, ``strftime_now``, a
    ``tojson`` that does not escape HTML, and ``{% generation %}`` blocks (rendered as their body: transformers
    uses them only to mark the assistant's tokens); ``variables`` (``bos_token``, ``tools``...) are visible to
    it."""
    from datetime import datetime

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _generation_block()])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            **{"tools": None, "documents": None, **variables})


def _chat_template(path: Path) -> str | None:
    file = path / "chat_template.jinja"
    if file.is_file():
        return file.read_text()
    template = _read_json(path / "tokenizer_config.json").get("chat_template")
    return template if isinstance(template, str) else None


def _specials(path: Path) -> dict[str, str | None]:
    cfg = {**_read_json(path / "special_tokens_map.json"), **_read_json(path / "tokenizer_config.json")}
    return {k: _token_str(cfg.get(f"{k}_token")) for k in ("bos", "eos", "pad", "unk")}


def _from_tokenizer_json(path: Path) -> HFTokenizer:
    from tokenizers import Tokenizer

    file = path / "tokenizer.json"
    tok = Tokenizer.from_file(str(file))
    spec = json.loads(file.read_text())
    kinds = json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])
    vocab = tok.get_vocab(with_added_tokens=True)
    specials = _specials(path)
    model_cfg = _read_json(path / "config.json")
    inverse = {i: p for p, i in vocab.items()}
    for k in ("bos", "eos", "pad"):
        if specials[k] is None and isinstance(model_cfg.get(f"{k}_token_id"), int):
            specials[k] = inverse.get(model_cfg[f"{k}_token_id"])
    added = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    text = frozenset(t["id"] for t in spec.get("added_tokens", []) if not t.get("special"))
    return HFTokenizer(
        path=path, vocab=vocab, specials=specials,
        codec=Codec(encode=lambda s: tok.encode(s, add_special_tokens=False).ids,
                    decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                    prompt=lambda s: tok.encode(s, add_special_tokens=True).ids),
        byte_level='"ByteLevel"' in kinds, special_ids=added, chat_template=_chat_template(path), text_ids=text)


def _from_sentencepiece(path: Path, model_file: Path) -> HFTokenizer:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    specials = _specials(path)
    vocab_file = path / "vocab.json"
    if vocab_file.is_file():  # Marian: pieces -> ids through vocab.json, EOS appended to every input
        vocab = json.loads(vocab_file.read_text())
        specials = {**{"eos": "</s>", "unk": "<unk>", "pad": "<pad>"},
                    **{k: v for k, v in specials.items() if v is not None}}
        inverse = {i: p for p, i in vocab.items()}
        unk = vocab.get(specials["unk"])

        def encode(s):
            return [vocab.get(p, unk) for p in sp.encode(s, out_type=str)]

        def decode(ids):
            return sp.decode_pieces([inverse[i] for i in ids if i in inverse])

        eos = vocab[specials["eos"]]
        tok = HFTokenizer(path=path, vocab=vocab, specials=specials,
                          codec=Codec(encode=encode, decode=decode, prompt=lambda s: encode(s) + [eos]),
                          byte_level=False, special_ids=set())
        return tok
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    for k, pid in (("bos", sp.bos_id()), ("eos", sp.eos_id()), ("pad", sp.pad_id()), ("unk", sp.unk_id())):
        if specials.get(k) is None and pid >= 0:
            specials[k] = sp.id_to_piece(pid)
    bos = sp.bos_id()
    controls = {i for i in range(sp.get_piece_size()) if sp.is_control(i)}
    return HFTokenizer(path=path, vocab=vocab, specials=specials,
                       codec=Codec(encode=lambda s: sp.encode(s), decode=lambda ids: sp.decode(ids),
                                   prompt=lambda s: ([bos] if bos >= 0 else []) + sp.encode(s)),
                       byte_level=False, special_ids=controls)


def load_tokenizer(path: str | os.PathLike, *, side: str = "source") -> HFTokenizer:
    """The tokenizer of the checkpoint directory ``path`` (or of the GGUF file ``path``).

    ``side``: for a translation checkpoint with separate SentencePiece models
    (Marian's ``source.spm`` / ``target.spm``), which one splits the text.
    """
    from jaxformer.interop.gguf import gguf_tokenizer_fields, is_gguf

    path = Path(path)
    if side not in ("source", "target"):
        raise ValueError(f"side={side!r} must be 'source' or 'target'")
    if is_gguf(path):
        fields = gguf_tokenizer_fields(path)
        return HFTokenizer(**{**fields, "codec": Codec(*fields["codec"])})
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a directory")
    if (path / "tokenizer.json").is_file():
        return _from_tokenizer_json(path)
    for name in (f"{side}.spm", "tokenizer.model"):
        if (path / name).is_file():
            return _from_sentencepiece(path, path / name)
    raise FileNotFoundError(f"{path}: no tokenizer.json, {side}.spm or tokenizer.model")
