"""Data: corpora, tokenizers, a grain packing pipeline with checkpointable state, eval windows.

Corpora (``DataConfig.source``):

* ``stdlib``: the ``.py`` files of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``, sorted relative paths, ``site-packages``
  excluded). Always present, no download.
* ``text``: a text file (cut into 64 KiB documents) or a directory of files.
* ``bin``: a flat pre-tokenized ``uint16``/``uint32`` memmap; ``bin_eos_id``
  separates documents; the last ``val_fraction`` of tokens is validation.

Documents are held out for validation by a stable hash of their relative path.
Each document is ``[BOS] + tokens + [EOS]``, cut into pieces of at most
``seq_len + 1`` tokens; shuffled pieces are packed (grain concat-then-split)
into rows of ``seq_len + 1`` with segment ids, so attention never crosses a
piece or document boundary. A row gives ``inputs = row[:-1]``,
``targets = row[1:]``, and a target counts only inside its input's segment.
"""

from __future__ import annotations

import hashlib
import json
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grain
import numpy as np
from grain.experimental import ConcatThenSplitIterDataset

from jaxformer.train.config import DataConfig

TEXT_DOC_BYTES = 65536


# -- tokenizers -------------------------------------------------------------------------------

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

    @property
    def token_bytes(self) -> np.ndarray:
        """Bytes each token id stands for (0 for specials)."""
        return (np.arange(self.vocab_size) < 256).astype(np.int64)


def _byte_unicode_table() -> dict[int, str]:
    """The reversible byte -> printable character map of byte-level BPE (GPT-2's scheme)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class BPETokenizer:
    """Byte-level BPE trained locally with the optional ``tokenizers`` package."""

    name = "bpe"
    SPECIALS = ("<bos>", "<eos>", "<pad>")

    def __init__(self, tok):
        self._tok = tok
        self.bos_id, self.eos_id, self.pad_id = (tok.token_to_id(s) for s in self.SPECIALS)
        self.vocab_size = tok.get_vocab_size()
        inv = {c: b for b, c in _byte_unicode_table().items()}
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

    @property
    def token_bytes(self) -> np.ndarray:
        return np.asarray([len(b) for b in self._bytes], np.int64)


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


# -- corpora ----------------------------------------------------------------------------------

def stdlib_files() -> tuple[Path, list[str]]:
    """``(root, sorted relative paths)`` of the interpreter's stdlib ``.py`` files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = sorted(
        p.relative_to(root).as_posix() for p in root.rglob("*.py")
        if "site-packages" not in p.relative_to(root).parts and "dist-packages" not in p.relative_to(root).parts
    )
    return root, rels


def is_validation(name: str, fraction: float) -> bool:
    """Stable split: the first 8 hex digits of sha256(name), as a fraction of 2**32."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) < fraction * 2**32


def _text_documents(cfg: DataConfig) -> list[tuple[str, bytes]]:
    if cfg.source == "stdlib":
        root, rels = stdlib_files()
        return [(rel, (root / rel).read_bytes()) for rel in rels]
    path = Path(cfg.path)
    if path.is_file():
        data = path.read_bytes()
        return [(f"{path.name}:{i}", data[i * TEXT_DOC_BYTES:(i + 1) * TEXT_DOC_BYTES])
                for i in range(math.ceil(len(data) / TEXT_DOC_BYTES))]
    if path.is_dir():
        files = sorted(p for p in path.glob(cfg.glob) if p.is_file())
        if not files:
            raise ValueError(f"data.path={cfg.path!r}: no files match glob {cfg.glob!r}")
        return [(p.relative_to(path).as_posix(), p.read_bytes()) for p in files]
    raise ValueError(f"data.path={cfg.path!r} is neither a file nor a directory")


@dataclass
class Corpus:
    """Token arrays for training (a list of documents) and one validation stream."""

    tokenizer: Any
    train_docs: list[np.ndarray]
    val_stream: np.ndarray
    n_val_docs: int

    @property
    def n_train_tokens(self) -> int:
        return int(sum(len(d) for d in self.train_docs))


def build_corpus(cfg: DataConfig, tokenizer_path: str | Path | None = None) -> Corpus:
    """Read, split and tokenize. ``tokenizer_path``: where a trained BPE is cached (and reused)."""
    if cfg.source == "bin":
        path = Path(cfg.path)
        if not path.is_file():
            raise ValueError(f"data.path={cfg.path!r}: no such .bin file")
        arr = np.memmap(path, dtype=np.dtype(cfg.bin_dtype), mode="r")
        n_val = int(round(len(arr) * cfg.val_fraction))
        tok = BinTokenizer(cfg.bin_vocab_size, cfg.bin_eos_id)
        return Corpus(tok, [arr[: len(arr) - n_val]], np.asarray(arr[len(arr) - n_val:], np.int32),
                      n_val_docs=1 if n_val else 0)

    docs = _text_documents(cfg)
    train = [d for name, d in docs if not is_validation(name, cfg.val_fraction)]
    val = [d for name, d in docs if is_validation(name, cfg.val_fraction)]
    if cfg.tokenizer == "bpe":
        if tokenizer_path is not None and Path(tokenizer_path).exists():
            tok = BPETokenizer.load(tokenizer_path)
        else:
            tok = BPETokenizer.train((d.decode("utf-8", errors="replace") for d in train), cfg.bpe_vocab_size)
            if tokenizer_path is not None:
                tok.save(tokenizer_path)
    else:
        tok = ByteTokenizer()

    def wrap(d: bytes) -> np.ndarray:
        body = tok.encode(d)
        return np.concatenate([[tok.bos_id], body, [tok.eos_id]]).astype(np.int32)

    train_docs = [wrap(d) for d in train]
    val_stream = (np.concatenate([wrap(d) for d in val]) if val else np.zeros((0,), np.int32))
    return Corpus(tok, train_docs, val_stream, n_val_docs=len(val))


# -- packing helpers (numpy) --------------------------------------------------------------------

def split_segments(segment_ids: np.ndarray, tokens: np.ndarray, eos_id: int | None) -> np.ndarray:
    """Relabel ``[..., L]`` segment ids 1, 2, ... so a new segment also starts after each EOS.

    Segment 0 (padding) stays 0.
    """
    seg = np.asarray(segment_ids)
    starts = np.zeros(seg.shape, bool)
    starts[..., 0] = True
    starts[..., 1:] = seg[..., 1:] != seg[..., :-1]
    if eos_id is not None:
        starts[..., 1:] |= np.asarray(tokens)[..., :-1] == eos_id
    out = np.cumsum(starts, axis=-1).astype(np.int32)
    return np.where(seg == 0, 0, out).astype(np.int32)


def positions_from_segments(segment_ids: np.ndarray) -> np.ndarray:
    """Position of each token within its segment: ``[..., L]`` int32."""
    seg = np.asarray(segment_ids)
    L = seg.shape[-1]
    idx = np.broadcast_to(np.arange(L, dtype=np.int32), seg.shape)
    starts = np.ones(seg.shape, bool)
    starts[..., 1:] = seg[..., 1:] != seg[..., :-1]
    start_idx = np.maximum.accumulate(np.where(starts, idx, 0), axis=-1)
    return (idx - start_idx).astype(np.int32)


def model_batch(rows: np.ndarray, segment_ids: np.ndarray, pad_id: int) -> dict[str, np.ndarray]:
    """Rows ``[B, T+1]`` with their segment ids -> model inputs/targets ``[B, T]``.

    ``mask`` is True where the target lies in its input's segment (and is not padding).
    """
    rows = np.asarray(rows, np.int32)
    seg = np.asarray(segment_ids, np.int32)
    inputs, targets = rows[:, :-1], rows[:, 1:]
    seg_in, seg_out = seg[:, :-1], seg[:, 1:]
    return {
        "inputs": np.where(seg_in == 0, pad_id, inputs).astype(np.int32),
        "targets": np.where(seg_out == 0, pad_id, targets).astype(np.int32),
        "segment_ids": seg_in,
        "positions": positions_from_segments(seg_in),
        "mask": (seg_in == seg_out) & (seg_in > 0),
    }


# -- training stream (grain) ------------------------------------------------------------------

class _Pieces:
    """Random-access source: piece ``i`` is ``docs[d][start:stop]``, at most ``length`` tokens."""

    def __init__(self, docs: list[np.ndarray], length: int):
        self._docs = docs
        index = []
        for d, doc in enumerate(docs):
            for start in range(0, len(doc), length):
                index.append((d, start, min(start + length, len(doc))))
        if not index:
            raise ValueError("the training split is empty")
        self._index = np.asarray(index, np.int64)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        d, start, stop = self._index[i]
        return {"tokens": np.asarray(self._docs[d][start:stop], np.int32)}


def _lists_to_tuples(x):
    if isinstance(x, dict):
        return {k: _lists_to_tuples(v) for k, v in x.items()}
    if isinstance(x, list):
        return tuple(_lists_to_tuples(v) for v in x)
    return x


class TrainIterator:
    """Batches of packed rows; ``get_state``/``set_state`` (JSON bytes) resume the exact stream.

    Works with grain's orbax handler (``grain.checkpoint.CheckpointSave``), which
    stores one JSON file per process.
    """

    def __init__(self, corpus: Corpus, *, seq_len: int, batch_size: int, seed: int, shuffle: bool = True,
                 process_index: int = 0, process_count: int = 1):
        if batch_size % process_count:
            raise ValueError(f"batch_size={batch_size} not divisible by process_count={process_count}")
        self.pad_id = corpus.tokenizer.pad_id
        self.eos_id = corpus.tokenizer.eos_id
        ds = grain.MapDataset.source(_Pieces(corpus.train_docs, seq_len + 1))
        if shuffle:
            ds = ds.shuffle(seed)
        ds = ds[process_index::process_count].repeat(None)
        it = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=256))
        it = ConcatThenSplitIterDataset(it, length_struct={"tokens": seq_len + 1},
                                        split_full_length_features=False)
        self._ds = it.batch(batch_size // process_count, drop_remainder=True)
        self._it = iter(self._ds)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        b = next(self._it)
        seg = split_segments(b["tokens_segment_ids"], b["tokens"], self.eos_id)
        return model_batch(b["tokens"], seg, self.pad_id)

    def get_state(self) -> bytes:
        return json.dumps(self._it.get_state()).encode()

    def set_state(self, state: bytes | str | dict) -> None:
        if isinstance(state, (bytes, str)):
            state = json.loads(state)
        # grain's packer compares slices with tuples; JSON gives lists.
        self._it.set_state(_lists_to_tuples(state))

    def start_prefetch(self) -> None:
        """Called by grain's orbax handler after a restore; nothing to start here."""


# -- validation windows -------------------------------------------------------------------------

@dataclass
class EvalSet:
    """Windows ``[W, T+1]`` of the validation stream; each token is a target in exactly one window.

    ``score_from[w]``: window ``w`` scores only its targets at positions ``>= score_from[w]``
    (the earlier ones are context, scored by the window before).
    """

    rows: np.ndarray
    segment_ids: np.ndarray
    pad_id: int
    score_from: np.ndarray | None = None

    def _batch(self, rows, seg, score_from) -> dict[str, np.ndarray]:
        b = model_batch(rows, seg, self.pad_id)
        if score_from is not None:
            b["mask"] &= np.arange(rows.shape[1] - 1)[None, :] >= score_from[:, None]
        return b

    def batches(self, batch_size: int):
        for i in range(0, len(self.rows), batch_size):
            rows, seg = self.rows[i:i + batch_size], self.segment_ids[i:i + batch_size]
            frm = None if self.score_from is None else self.score_from[i:i + batch_size]
            n = len(rows)
            if n < batch_size:
                rows = np.concatenate([rows, np.full((batch_size - n, rows.shape[1]), self.pad_id, np.int32)])
                seg = np.concatenate([seg, np.zeros((batch_size - n, seg.shape[1]), np.int32)])
                if frm is not None:
                    frm = np.concatenate([frm, np.zeros((batch_size - n,), frm.dtype)])
            yield self._batch(rows, seg, frm)

    def target_ids(self) -> np.ndarray:
        """The ids that are scored, in order (for byte counts and compressor baselines)."""
        b = self._batch(self.rows, self.segment_ids, self.score_from)
        return b["targets"][b["mask"]]


def eval_windows(stream: np.ndarray, *, seq_len: int, tokenizer, max_tokens: int | None = None,
                 stride: int | None = None) -> EvalSet:
    """Cut the validation stream into windows of ``seq_len`` targets, ``stride`` apart (default: ``seq_len``).

    With ``stride < seq_len`` (sliding-window evaluation) every window after the first scores only
    its last ``stride`` targets, so each scored token sees at least ``seq_len - stride`` tokens of
    its document before it (as far as the document goes back); the cost is ``seq_len / stride``
    forward passes per token. ``max_tokens``: evenly spaced windows scoring about that many tokens.
    """
    stream = np.asarray(stream, np.int32)
    if len(stream) < 2:
        raise ValueError(f"the validation split has {len(stream)} tokens; raise data.val_fraction")
    T = seq_len
    stride = T if stride is None else stride
    if not 1 <= stride <= T:
        raise ValueError(f"eval.stride={stride} must be in [1, seq_len={T}]")
    n_total = 1 + math.ceil(max(len(stream) - 1 - T, 0) / stride)
    n = n_total if max_tokens is None else max(1, min(n_total, max_tokens // stride))
    starts = (np.arange(n, dtype=np.int64) * n_total // n) * stride
    rows = np.full((n, T + 1), tokenizer.pad_id, np.int32)
    seg = np.zeros((n, T + 1), np.int32)
    for r, s in enumerate(starts):
        piece = stream[s:s + T + 1]
        rows[r, :len(piece)] = piece
        seg[r, :len(piece)] = 1
    score_from = None if stride == T else np.where(starts == 0, 0, T - stride).astype(np.int32)
    return EvalSet(rows, split_segments(seg, rows, tokenizer.eos_id), tokenizer.pad_id, score_from)
