"""Corpora: read the documents, hold some out for validation, tokenize.

Sources (``DataConfig.source``):

* ``stdlib``: the ``.py`` files of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``, sorted relative paths, ``site-packages``
  excluded). Always present, no download.
* ``text``: a text file (cut into 64 KiB documents) or a directory of files.
* ``bin``: a flat pre-tokenized ``uint16``/``uint32`` memmap; ``bin_eos_id``
  separates documents; the last ``val_fraction`` of tokens is validation.

Documents are held out for validation by a stable hash of their relative path. When that
leaves validation empty (a text folder of one file, a few files none of which the hash picks), the
split moves inside the text: the last ``val_fraction`` of its bytes (cut at a UTF-8 character
boundary) is validation, the bytes before it training, and ``Corpus.split_note`` says so (the
start line of a run prints it).
Each document becomes ``[BOS] + tokens + [EOS]`` (either left out if the tokenizer has none,
as some Hugging Face tokenizers have no BOS): training keeps a list of
documents, validation one concatenated stream.
"""

from __future__ import annotations

import functools
import hashlib
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxformer.train.config import DataConfig
from jaxformer.train.tokenizers import BinTokenizer, BPETokenizer, ByteTokenizer, HFTextTokenizer

TEXT_DOC_BYTES = 65536


def stdlib_files() -> tuple[Path, list[str]]:
    """``(root, sorted relative paths)`` of the interpreter's stdlib ``.py`` files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return root, list(_py_files(root))


@functools.lru_cache(maxsize=4)
def _py_files(root: Path) -> tuple[str, ...]:
    """The walk of :func:`stdlib_files`, once per process (~1 s on a slow disk; a sweep's evaluation at five
    lengths built its corpus six times): the installed standard library does not change under a run."""
    rels = (p.relative_to(root) for p in root.rglob("*.py"))
    return tuple(sorted(r.as_posix() for r in rels
                        if "site-packages" not in r.parts and "dist-packages" not in r.parts))


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


def split_documents(docs: list[tuple[str, bytes]], fraction: float) -> tuple[list[bytes], list[bytes], str | None]:
    """``(train, validation, note)``: whole documents by :func:`is_validation`; if that holds out none,
    the last ``fraction`` of the documents' bytes, in order (at least one byte, never all of them), cut
    at a UTF-8 character boundary, with a note saying so (else ``note`` is None)."""
    train = [d for name, d in docs if not is_validation(name, fraction)]
    val = [d for name, d in docs if is_validation(name, fraction)]
    total = sum(len(d) for _, d in docs)
    if val or fraction == 0 or total < 2:
        return train, val, None
    train, val, before = [d for _, d in docs], [], total
    need = min(max(1, round(total * fraction)), total - 1)  # validation bytes
    while total - before < need:  # whole documents from the end, then the head of the next one cut
        d = train.pop()
        before -= len(d)
        cut = max(0, total - before - need)  # of d, what training keeps
        back = _char_start(d, cut, -1)  # not inside a multi-byte character
        if back or train:
            cut = back
        elif _char_start(d, cut, +1) < len(d):  # training keeps at least a character
            cut = _char_start(d, cut, +1)
        if cut:
            train.append(d[:cut])
            before += cut
        if d[cut:]:
            val.insert(0, d[cut:])
    note = (f"validation: the last {total - before:,} of {total:,} bytes of the text (the file-level split at "
            f"data.val_fraction={fraction} held out nothing)")
    return train, val, note


def _char_start(d: bytes, i: int, step: int) -> int:
    """From offset ``i`` of ``d``, the first offset in direction ``step`` (-1, +1) that starts a UTF-8
    character (is not a continuation byte ``0b10xxxxxx``), stopping at either end."""
    while 0 < i < len(d) and (d[i] & 0xC0) == 0x80:
        i += step
    return i


@dataclass
class Corpus:
    """Token arrays for training (a list of documents) and one validation stream; ``split_note``: how
    validation was held out when it is not the file-level split (:func:`split_documents`)."""

    tokenizer: Any
    train_docs: list[np.ndarray]
    val_stream: np.ndarray
    n_val_docs: int
    split_note: str | None = None

    @property
    def n_train_tokens(self) -> int:
        return int(sum(len(d) for d in self.train_docs))


def build_corpus(cfg: DataConfig, tokenizer_path: str | Path | None = None) -> Corpus:
    """Read, split and tokenize. ``tokenizer_path``: where a trained BPE is cached (and reused);
    for ``tokenizer='hf'`` the checkpoint directory whose tokenizer to use."""
    if cfg.source == "bin":
        path = Path(cfg.path)
        if not path.is_file():
            raise ValueError(f"data.path={cfg.path!r}: no such .bin file")
        arr = np.memmap(path, dtype=np.dtype(cfg.bin_dtype), mode="r")
        if len(arr) and cfg.bin_vocab_size <= np.iinfo(arr.dtype).max:  # one pass over the file, at start-up
            top = int(arr.max())
            if top >= cfg.bin_vocab_size:
                raise ValueError(f"data.path={cfg.path!r}: token id {top} at position {int(np.argmax(arr))} is not "
                                 f"below data.bin_vocab_size={cfg.bin_vocab_size} (a file from another tokenizer, or "
                                 f"data.bin_dtype={cfg.bin_dtype!r} not the one it was written with?)")
        n_val = int(round(len(arr) * cfg.val_fraction))
        tok = BinTokenizer(cfg.bin_vocab_size, cfg.bin_eos_id)
        return Corpus(tok, [arr[: len(arr) - n_val]], np.asarray(arr[len(arr) - n_val:], np.int32),
                      n_val_docs=1 if n_val else 0)

    train, val, note = split_documents(_text_documents(cfg), cfg.val_fraction)
    if cfg.tokenizer == "hf":
        if tokenizer_path is None:
            raise ValueError("data.tokenizer='hf' needs the checkpoint directory holding the tokenizer")
        tok = HFTextTokenizer.load(tokenizer_path)
    elif cfg.tokenizer == "bpe":
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
        return np.concatenate([[t] for t in (tok.bos_id,) if t is not None] + [body]
                              + [[t] for t in (tok.eos_id,) if t is not None]).astype(np.int32)

    train_docs = [wrap(d) for d in train]
    val_stream = (np.concatenate([wrap(d) for d in val]) if val else np.zeros((0,), np.int32))
    return Corpus(tok, train_docs, val_stream, n_val_docs=len(val), split_note=note)
