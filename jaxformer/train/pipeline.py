"""The training stream: a grain pipeline of packed batches with checkpointable state.

Each document of the corpus is cut into pieces of at most ``seq_len + 1`` tokens;
shuffled pieces are packed (grain concat-then-split) into rows of ``seq_len + 1``
with segment ids, so attention never crosses a piece or document boundary; rows
become model batches (:func:`jaxformer.train.packing.model_batch`).
"""

from __future__ import annotations

import json

import grain
import numpy as np
from grain.experimental import ConcatThenSplitIterDataset

from jaxformer.train.corpus import Corpus
from jaxformer.train.packing import Batch, model_batch, split_segments


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

    def __next__(self) -> Batch:
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
