"""Tokenizers: bytes, byte-level BPE (trained locally), a Hugging Face checkpoint's own, and pre-tokenized ids.

Each has ``name``, ``vocab_size``, ``bos_id``, ``eos_id``, ``pad_id``, ``encode``,
``decode`` and ``token_bytes`` (bytes each id stands for, for bits per byte; None
when ids are not text).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxformer.interop.byte_level import byte_decoder


class ByteTokenizer:
    """Bytes 0..255, then BOS=256, EOS=257, PAD=258."""

    name = "bytes"
    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

    def encode(self, data: bytes | str) -> np.ndarray:
        if isinstance(data, str):
            data = data.encode("utf-8")
        return np.frombuffer(data, np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids) -> bytes:
        ids = np.asarray(ids).reshape(-1)
        return ids[ids < 256].astype(np.uint8).tobytes()

    def piece_bytes(self, i: int) -> bytes:
        """The bytes id ``i`` stands for (empty for a special token)."""
        return self.decode_bytes([i])

    @property
    def token_bytes(self) -> np.ndarray:
        """Bytes each token id stands for (0 for specials)."""
        return (np.arange(self.vocab_size) < 256).astype(np.int64)


class BPETokenizer:
    """Byte-level BPE trained locally with the optional ``tokenizers`` package."""

    name = "bpe"
    SPECIALS = ("<bos>", "<eos>", "<pad>")

    def __init__(self, tok):
        self._tok = tok
        self.bos_id, self.eos_id, self.pad_id = (tok.token_to_id(s) for s in self.SPECIALS)
        self.vocab_size = tok.get_vocab_size()
        inv = byte_decoder()
        self._bytes = [b""] * self.vocab_size
        for piece, i in tok.get_vocab().items():
            if piece not in self.SPECIALS:
                self._bytes[i] = bytes(inv[c] for c in piece)

    @classmethod
    def train(cls, texts, vocab_size: int) -> BPETokenizer:
        try:
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        except ImportError:
            raise ValueError("data.tokenizer='bpe' needs the optional `tokenizers` package "
                             "(pip install 'jaxformer[bpe]', or tokenizers)") from None
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(cls.SPECIALS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        from tokenizers import Tokenizer
        return cls(Tokenizer.from_file(str(path)))

    def save(self, path: str | Path) -> None:
        self._tok.save(str(path))

    def encode(self, data: bytes | str) -> np.ndarray:
        if isinstance(data, bytes):
            data = data.decode("utf-8", errors="replace")
        return np.asarray(self._tok.encode(data).ids, np.int32)

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids) -> bytes:
        return b"".join(self._bytes[int(i)] for i in np.asarray(ids).reshape(-1))

    def piece_bytes(self, i: int) -> bytes:
        """The bytes id ``i`` stands for, a part of a character included (empty for a special token)."""
        return self._bytes[int(i)]

    @property
    def token_bytes(self) -> np.ndarray:
        return np.asarray([len(b) for b in self._bytes], np.int64)


class HFTextTokenizer:
    """The tokenizer of a Hugging Face checkpoint directory (:func:`jaxformer.interop.load_tokenizer`).

    ``encode`` adds no special tokens (documents become ``[BOS] + text + [EOS]`` as with the
    other tokenizers; no BOS when the checkpoint has none); ``encode_prompt`` adds what the
    checkpoint's tokenizer adds to an input, as ``transformers`` does. A checkpoint without a
    pad token (Llama) pads with its EOS (padding is never scored).
    """

    name = "hf"

    def __init__(self, tok):
        self.hf = tok
        self.path = tok.path
        self.vocab_size = tok.vocab_size
        self.bos_id, self.eos_id = tok.bos_id, tok.eos_id
        self.pad_id = next((i for i in (tok.pad_id, tok.eos_id, tok.unk_id) if i is not None), 0)
        self._token_bytes = None

    @classmethod
    def load(cls, path: str | Path) -> HFTextTokenizer:
        from jaxformer.interop.tokenizer import load_tokenizer
        return cls(load_tokenizer(path))

    def encode(self, data: bytes | str) -> np.ndarray:
        return self.hf.encode(data)

    def encode_prompt(self, text: str) -> np.ndarray:
        return self.hf.encode_prompt(text)

    def decode(self, ids) -> str:
        return self.hf.decode(ids)

    def decode_bytes(self, ids) -> bytes:
        return self.decode(ids).encode("utf-8")

    def piece_bytes(self, i: int) -> bytes:
        """The bytes id ``i`` stands for, a part of a character included (:meth:`HFTokenizer.piece_bytes`)."""
        return self.hf.piece_bytes(i)

    @property
    def token_bytes(self) -> np.ndarray:
        if self._token_bytes is None:
            self._token_bytes = self.hf.token_bytes
        return self._token_bytes


class BinTokenizer:
    """Pre-tokenized ids: no text mapping, so no bits per byte."""

    name = "bin"
    bos_id = None

    def __init__(self, vocab_size: int, eos_id: int | None):
        self.vocab_size, self.eos_id = vocab_size, eos_id
        self.pad_id = 0

    token_bytes = None

    def encode(self, data) -> np.ndarray:
        raise ValueError("source='bin' has no text tokenizer; prompts cannot be encoded")

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in np.asarray(ids).reshape(-1))
