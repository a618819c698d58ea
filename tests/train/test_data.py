"""Data: the stdlib corpus split, packing with segment ids, eval windows, exact iterator-state restore."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from jaxformer.train import config as C
from jaxformer.train.corpus import build_corpus, is_validation, stdlib_files
from jaxformer.train.eval_windows import eval_windows
from jaxformer.train.packing import positions_from_segments, split_segments
from jaxformer.train.pipeline import TrainIterator
from jaxformer.train.tokenizers import ByteTokenizer
from tests.train.helpers import make_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = make_corpus(tmp_path_factory.mktemp("corpus"), n_files=60)
    return build_corpus(C.DataConfig(source="text", path=str(root), val_fraction=0.2))


def test_stdlib_listing_is_sorted_relative_and_excludes_site_packages():
    root, rels = stdlib_files()
    assert root == Path(sysconfig.get_paths()["stdlib"])
    assert rels == sorted(rels) and len(rels) > 100
    assert all(r.endswith(".py") and not r.startswith("/") for r in rels)
    assert not any("site-packages" in r.split("/") for r in rels)
    assert "os.py" in rels and "json/__init__.py" in rels


def test_validation_split_is_a_stable_hash_of_the_path():
    _, rels = stdlib_files()
    val = [r for r in rels if is_validation(r, 0.02)]
    assert 0.005 < len(val) / len(rels) < 0.05
    # independent reimplementation of the rule: sha256 prefix as a fraction of 2**32
    import hashlib
    again = [r for r in rels if int(hashlib.sha256(r.encode()).hexdigest()[:8], 16) / 2**32 < 0.02]
    assert val == again


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "déf f(x):\n\treturn x  # ünïcode\n"
    ids = tok.encode(text)
    assert ids.max() < 256 and tok.decode(ids) == text
    assert tok.decode(np.concatenate([[tok.bos_id], ids, [tok.eos_id]])) == text
    assert tok.token_bytes.sum() == 256 and tok.vocab_size == 259


def test_documents_are_wrapped_and_split(corpus):
    tok = corpus.tokenizer
    assert all(d[0] == tok.bos_id and d[-1] == tok.eos_id for d in corpus.train_docs)
    n_files = len(corpus.train_docs) + corpus.n_val_docs
    assert n_files == 60 and corpus.n_val_docs > 0
    assert np.sum(corpus.val_stream == tok.bos_id) == corpus.n_val_docs


def _check_rows(batch, corpus_docs, pad_id, T):
    inputs, targets, seg, pos, mask = batch.tokens, batch.targets, batch.segment_ids, batch.positions, batch.loss_mask
    assert inputs.shape == targets.shape == seg.shape == pos.shape == mask.shape and inputs.shape[1] == T
    joined = [bytes(d.astype(np.uint16).tobytes()) for d in corpus_docs]
    for b in range(inputs.shape[0]):
        for s in np.unique(seg[b]):
            if s == 0:
                assert np.all(inputs[b][seg[b] == 0] == pad_id)
                continue
            idx = np.flatnonzero(seg[b] == s)
            assert np.all(np.diff(idx) == 1), "a segment is contiguous"
            np.testing.assert_array_equal(pos[b][idx], np.arange(len(idx)))
            piece = inputs[b][idx]
            # every segment is a contiguous piece of one document
            needle = piece.astype(np.uint16).tobytes()
            assert any(needle in d for d in joined)
            # targets are next tokens inside the segment; only the segment's last target is unscored
            assert np.all(mask[b][idx[:-1]])
            np.testing.assert_array_equal(targets[b][idx[:-1]], inputs[b][idx[1:]])


def test_packing_segments_positions_and_mask(corpus):
    T = 32
    it = TrainIterator(corpus, seq_len=T, batch_size=4, seed=0)
    for _ in range(5):
        b = next(it)
        _check_rows(b, corpus.train_docs, corpus.tokenizer.pad_id, T)
    assert b.loss_mask.dtype == np.bool_ and b.tokens.dtype == np.int32


def test_stream_is_deterministic_and_seed_dependent(corpus):
    a = [next(it).tokens for it in [TrainIterator(corpus, seq_len=32, batch_size=4, seed=1)] for _ in range(6)]
    b = [next(it).tokens for it in [TrainIterator(corpus, seq_len=32, batch_size=4, seed=1)] for _ in range(6)]
    c = [next(it).tokens for it in [TrainIterator(corpus, seq_len=32, batch_size=4, seed=2)] for _ in range(6)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_iterator_state_restores_the_exact_stream(corpus):
    """Save the state (JSON, as orbax stores it) at every step; each restore replays the rest exactly."""
    n = 25  # several epochs of this corpus at batch 4 x 32 tokens
    it = TrainIterator(corpus, seq_len=32, batch_size=4, seed=0)
    states, ref = [], []
    for _ in range(n):
        states.append(json.loads(it.get_state().decode()))
        ref.append(next(it))
    for k in range(n):
        again = TrainIterator(corpus, seq_len=32, batch_size=4, seed=0)
        again.set_state(json.dumps(states[k]).encode())
        for j in range(k, min(k + 4, n)):
            got = next(again)
            for key in ref[j]._fields:
                np.testing.assert_array_equal(getattr(got, key), getattr(ref[j], key),
                                              err_msg=f"restore at {k}, step {j}, {key}")


def test_process_shards_are_disjoint_halves(corpus):
    p0 = TrainIterator(corpus, seq_len=32, batch_size=4, seed=0, shuffle=False, process_index=0, process_count=2)
    p1 = TrainIterator(corpus, seq_len=32, batch_size=4, seed=0, shuffle=False, process_index=1, process_count=2)
    assert next(p0).tokens.shape == (2, 32)
    assert not np.array_equal(next(p0).tokens, next(p1).tokens)


def test_eval_windows_score_every_token_once(corpus):
    tok = corpus.tokenizer
    T = 16
    ev = eval_windows(corpus.val_stream, seq_len=T, tokenizer=tok)
    scored = ev.target_ids()
    stream = corpus.val_stream
    # every token except each document's BOS is a target exactly once, in stream order
    np.testing.assert_array_equal(scored, stream[1:][stream[1:] != tok.bos_id])
    # bytes scored == the validation text (specials carry no bytes)
    assert tok.decode_bytes(scored) == tok.decode_bytes(stream)
    sub = eval_windows(corpus.val_stream, seq_len=T, tokenizer=tok, max_tokens=64)
    assert sub.rows.shape == (4, T + 1)
    b = next(sub.batches(3))
    assert b.tokens.shape == (3, T)


def test_split_segments_and_positions_against_a_loop():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 6, size=(3, 20))
    seg = np.sort(rng.integers(0, 4, size=(3, 20)), axis=1)
    got = split_segments(seg, tokens, eos_id=5)
    pos = positions_from_segments(got)
    for b in range(3):
        cur, want, p, wpos = 0, [], 0, []
        for i in range(20):
            new = i == 0 or seg[b, i] != seg[b, i - 1] or tokens[b, i - 1] == 5
            cur = cur + 1 if new else cur
            p = 0 if new else p + 1
            want.append(0 if seg[b, i] == 0 else cur)
            wpos.append(p)
        np.testing.assert_array_equal(got[b], want)
        nz = got[b] > 0
        np.testing.assert_array_equal(pos[b][nz], np.asarray(wpos)[nz])


def test_bin_source_memmap(tmp_path):
    ids = (np.arange(5000) % 97).astype(np.uint16)
    ids[::50] = 999  # document separators
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    cfg = C.DataConfig(source="bin", path=str(path), bin_vocab_size=1000, bin_eos_id=999, val_fraction=0.1)
    corpus = build_corpus(cfg)
    assert len(corpus.val_stream) == 500 and corpus.n_train_tokens == 4500
    it = TrainIterator(corpus, seq_len=32, batch_size=2, seed=0)
    b = next(it)
    for r in range(2):
        # a new segment starts right after each EOS
        after_eos = np.flatnonzero(b.tokens[r][:-1] == 999) + 1
        for i in after_eos:
            assert b.segment_ids[r][i] != b.segment_ids[r][i - 1] and not b.loss_mask[r][i - 1]


def test_bin_source_ids_must_be_below_its_vocab_size(tmp_path):
    """A token file from another tokenizer (ids past ``bin_vocab_size``) is refused at start-up naming the file, the
    id and where it is, not found as a NaN loss at step 1; likewise a separator id outside the vocabulary."""
    ids = (np.arange(3000) % 250).astype(np.uint16)
    ids[1234] = 49999
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    with pytest.raises(ValueError, match=r"tokens\.bin'?: token id 49999 at position 1234 is not below "
                                         r"data\.bin_vocab_size=264"):
        build_corpus(C.DataConfig(source="bin", path=str(path), bin_vocab_size=264))
    assert build_corpus(C.DataConfig(source="bin", path=str(path), bin_vocab_size=50000)).n_train_tokens > 0
    assert build_corpus(C.DataConfig(source="bin", path=str(path), bin_vocab_size=65536,
                                     val_fraction=0.0)).n_train_tokens == 3000
    with pytest.raises(ValidationError, match=r"bin_eos_id=264 is not a token id below bin_vocab_size=264"):
        C.DataConfig(source="bin", path=str(path), bin_vocab_size=264, bin_eos_id=264)


def test_bpe_tokenizer(tmp_path):
    """`tokenizers` comes with the test extra (and the `bpe` extra): this test is never skipped."""
    root = make_corpus(tmp_path / "c", n_files=30)
    cfg = C.DataConfig(source="text", path=str(root), tokenizer="bpe", bpe_vocab_size=300, val_fraction=0.2)
    corpus = build_corpus(cfg, tokenizer_path=tmp_path / "tok.json")
    tok = corpus.tokenizer
    assert tok.vocab_size <= 300 and (tmp_path / "tok.json").exists()
    text = "def f3_1(x):\n    return x * 1 + 3\n"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode()) and tok.decode(ids) == text
    assert tok.token_bytes[ids].sum() == len(text.encode())
    again = build_corpus(cfg, tokenizer_path=tmp_path / "tok.json")
    np.testing.assert_array_equal(again.val_stream, corpus.val_stream)


def _unwrap(tok, ids) -> bytes:
    """The bytes of wrapped documents, BOS and EOS dropped."""
    return tok.decode_bytes(np.asarray([t for t in ids if t not in (tok.bos_id, tok.eos_id)]))


@pytest.mark.parametrize("one_file", ["folder", "file"])
def test_a_one_file_text_is_split_inside_the_text(tmp_path, one_file):
    """No whole file falls in the hash split: validation is the last val_fraction of the bytes, cut at a
    character boundary; training is every byte before it (disjoint, together the whole text)."""
    text = ("#" * 6 + "".join(f"def f{i}(x):  # é 漢\n    return x + {i}\n" for i in range(300))).encode()
    cut = len(text) - round(0.1 * len(text))
    assert text[cut] & 0xC0 == 0x80  # the plain cut would fall inside a character
    (tmp_path / "texts").mkdir()
    path = tmp_path / "texts" / "notes.txt"
    path.write_bytes(text)
    cfg = C.DataConfig(source="text", path=str(path.parent if one_file == "folder" else path), val_fraction=0.1)
    corpus = build_corpus(cfg)
    tok = corpus.tokenizer
    train, val = b"".join(_unwrap(tok, d) for d in corpus.train_docs), _unwrap(tok, corpus.val_stream)
    assert train + val == text
    assert abs(len(val) - round(0.1 * len(text))) < 4 and val.decode("utf-8") and train.decode("utf-8")
    assert corpus.n_val_docs == 1 and corpus.val_stream[0] == tok.bos_id and corpus.val_stream[-1] == tok.eos_id
    assert corpus.split_note == (f"validation: the last {len(val):,} of {len(text):,} bytes of the text (the "
                                 "file-level split at data.val_fraction=0.1 held out nothing)")
    # a folder whose hash split holds files out is split by file, as before
    many = build_corpus(C.DataConfig(source="text", path=str(make_corpus(tmp_path / "many", 40)), val_fraction=0.2))
    assert many.split_note is None and 0 < many.n_val_docs < 40
    assert build_corpus(cfg.model_copy(update={"val_fraction": 0.0})).val_stream.size == 0


def test_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="neither a file nor a directory"):
        build_corpus(C.DataConfig(source="text", path=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no files match"):
        build_corpus(C.DataConfig(source="text", path=str(tmp_path / "empty")))


@pytest.mark.parametrize("stride", [1, 5, 16])
def test_sliding_eval_windows_score_every_token_once_with_context(corpus, stride):
    """Strided windows: each stream token a target exactly once, with >= T - stride tokens of context.

    Context is counted independently from the stream: a target at stream index i is predicted from
    min(its position in its document + 1, T - stride + 1) or more inputs of its own document.
    """
    tok = corpus.tokenizer
    T = 16
    stream = corpus.val_stream
    ev = eval_windows(stream, seq_len=T, tokenizer=tok, stride=stride)
    np.testing.assert_array_equal(ev.target_ids(), stream[1:][stream[1:] != tok.bos_id])
    bos = np.flatnonzero(stream == tok.bos_id)
    doc_pos = np.arange(len(stream)) - bos[np.searchsorted(bos, np.arange(len(stream)), side="right") - 1]
    scored_at, r0 = [], 0
    for b in ev.batches(7):
        for r in range(len(b.tokens)):
            if r0 + r >= len(ev.rows):
                assert not b.loss_mask[r].any()  # padding rows score nothing
                continue
            for j in np.flatnonzero(b.loss_mask[r]):
                i = (r0 + r) * stride + j  # stream index of the input token
                assert b.tokens[r, j] == stream[i] and b.targets[r, j] == stream[i + 1]
                assert b.positions[r, j] + 1 >= min(doc_pos[i] + 1, T - stride + 1), (r0 + r, j)
                scored_at.append(i + 1)
        r0 += len(b.tokens)
    want = np.arange(1, len(stream))
    np.testing.assert_array_equal(scored_at, want[stream[1:] != tok.bos_id])
    with pytest.raises(ValueError, match="eval.stride"):
        eval_windows(stream, seq_len=T, tokenizer=tok, stride=T + 1)
    # a subset (periodic evals): evenly spaced windows, each scoring its own targets once
    sub = eval_windows(stream, seq_len=T, tokenizer=tok, stride=stride, max_tokens=8 * stride)
    assert len(sub.rows) == 8 and (sub.score_from is None) == (stride == T)
    ids = sub.target_ids()
    assert len(ids) == sum(int(b.loss_mask.sum()) for b in sub.batches(3)) <= T + 7 * stride
