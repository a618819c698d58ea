"""Host-side page bookkeeping for the paged KV cache: which pages each sequence holds.

A sequence's token at position ``pos`` lives in page ``block_table[pos // L]`` at row
``pos % L`` (``L`` tokens per page). :class:`BlockManager` owns the bookkeeping: a free
list, one block table and token list per sequence, a refcount per page, and prefix sharing:
a full block of ``L`` tokens is identified by the hash of its tokens chained with
the hash of the block before it, and once its keys/values are computed
(:meth:`BlockManager.commit`) a later sequence whose tokens start the same way
reuses the page instead of recomputing it. A write into a page held by more than
one table first copies it (copy-on-write). Pages go back to the free list as
soon as no table holds them.

Sliding window: :meth:`BlockManager.drop_before` frees a sequence's leading pages
once every token in them lies behind the window; its table then starts at logical
page :meth:`BlockManager.num_dropped`, so a token at position ``pos`` sits in
``table[pos // L - dropped]``. Attention reads such a table from position
``dropped * L`` on; only distances matter there (RoPE is applied before the cache,
ALiBi and the window are relative), so nothing else changes.

The manager never touches device memory (numpy and the standard library only):
:meth:`BlockManager.prepare_write` returns the ``(src, dst)`` page copies the caller
applies (:func:`jaxformer.decode.paged_cache.copy_pages`) before writing new tokens
through :class:`jaxformer.decode.paged_cache.PagedKVCache`.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Hashable, Sequence

import numpy as np


class OutOfPages(RuntimeError):
    """Not enough free pages; nothing was changed."""


def _chain_hash(prev: bytes, block: Sequence[int]) -> bytes:
    return hashlib.blake2b(prev + np.asarray(block, np.int64).tobytes(), digest_size=16).digest()


@dataclasses.dataclass
class _Seq:
    tokens: list[int]
    table: list[int]
    computed: int = 0
    hashes: list[bytes] = dataclasses.field(default_factory=list)  # of committed full blocks
    dropped: int = 0  # leading logical pages freed behind a sliding window; table[0] is page `dropped`


class BlockManager:
    """Host-side page bookkeeping for the paged KV cache (see the module docstring).

    Life of a sequence: :meth:`add` (pages for its tokens; a computed shared prefix is
    reused), then per step :meth:`prepare_write` (pages for the next tokens, copy-on-write)
    -> device write -> :meth:`commit`; :meth:`append` adds sampled tokens; :meth:`fork`
    shares every page with a new sequence; :meth:`drop_before` frees pages behind a
    sliding window; :meth:`finish` releases its pages.
    """

    def __init__(self, num_pages: int, page_size: int, *, prefix_sharing: bool = True):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages={num_pages} and page_size={page_size} must be >= 1")
        self.num_pages, self.page_size, self.prefix_sharing = num_pages, page_size, prefix_sharing
        self._free: collections.deque[int] = collections.deque(range(num_pages))
        self._ref = np.zeros(num_pages, np.int64)
        self._seqs: dict[Hashable, _Seq] = {}
        self._cached: dict[bytes, int] = {}  # hash of a committed full block -> page
        self._page_hash: dict[int, bytes] = {}

    # -- queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_pages(self) -> list[int]:
        return list(self._free)

    def refcount(self, page: int) -> int:
        return int(self._ref[page])

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list:
        return list(self._seqs)

    def block_table(self, seq_id) -> list[int]:
        """The pages a sequence still holds, from logical page :meth:`num_dropped` on."""
        return list(self._seqs[seq_id].table)

    def num_dropped(self, seq_id) -> int:
        """Leading logical pages freed by :meth:`drop_before` (the table starts after them)."""
        return self._seqs[seq_id].dropped

    def tokens(self, seq_id) -> list[int]:
        return list(self._seqs[seq_id].tokens)

    def num_computed(self, seq_id) -> int:
        return self._seqs[seq_id].computed

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    # -- prefix sharing
    def _shared_prefix(self, tokens: Sequence[int]) -> list[int]:
        """Pages of committed blocks equal to ``tokens``' leading full blocks, leaving >= 1 token to compute."""
        if not self.prefix_sharing:
            return []
        L, pages, h = self.page_size, [], b""
        for i in range((len(tokens) - 1) // L):
            h = _chain_hash(h, tokens[i * L:(i + 1) * L])
            page = self._cached.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def pages_needed_to_add(self, tokens: Sequence[int]) -> int:
        return self.pages_for(len(tokens)) - len(self._shared_prefix(tokens))

    # -- page primitives
    def _take(self) -> int:
        page = self._free.popleft()
        self._ref[page] = 1
        return page

    def _release(self, page: int) -> None:
        if self._ref[page] <= 0:
            raise AssertionError(f"page {page} released with refcount {self._ref[page]}")
        self._ref[page] -= 1
        if self._ref[page] == 0:
            h = self._page_hash.pop(page, None)
            if h is not None and self._cached.get(h) == page:
                del self._cached[h]
            self._free.append(page)

    # -- sequence operations
    def add(self, seq_id, tokens: Sequence[int]) -> int:
        """Register a sequence with pages for all its tokens; return how many are already computed."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError(f"sequence {seq_id!r}: no tokens")
        shared = self._shared_prefix(tokens)
        need = self.pages_for(len(tokens)) - len(shared)
        if need > self.num_free:
            raise OutOfPages(f"sequence {seq_id!r} needs {need} pages, {self.num_free} free")
        for page in shared:
            self._ref[page] += 1
        table = shared + [self._take() for _ in range(need)]
        seq = _Seq(tokens, table, computed=len(shared) * self.page_size)
        seq.hashes = [self._page_hash[p] for p in shared]
        self._seqs[seq_id] = seq
        return seq.computed

    def append(self, seq_id, tokens: Sequence[int]) -> None:
        """Add tokens to a sequence (pages come at :meth:`prepare_write`)."""
        self._seqs[seq_id].tokens.extend(int(t) for t in tokens)

    def prepare_write(self, seq_id, n: int) -> list[tuple[int, int]]:
        """Make the pages for the next ``n`` uncomputed tokens exist and be private to this sequence.

        Returns the ``(src, dst)`` page copies to apply on the device first. Raises
        :class:`OutOfPages` (changing nothing) when the free list is too short.
        """
        seq = self._seqs[seq_id]
        start, stop = seq.computed, seq.computed + n
        if n < 1 or stop > len(seq.tokens):
            raise ValueError(f"sequence {seq_id!r}: cannot write {n} tokens at {start} "
                             f"(it has {len(seq.tokens)} tokens)")
        L = self.page_size
        first, last = start // L - seq.dropped, (stop - 1) // L - seq.dropped  # indices into the table
        if first < 0:
            raise ValueError(f"sequence {seq_id!r}: cannot write at {start}, its pages before "
                             f"{seq.dropped * L} were dropped")
        grow = max(0, last + 1 - len(seq.table))
        cow = [i for i in range(first, min(last + 1, len(seq.table))) if self._ref[seq.table[i]] > 1]
        if grow + len(cow) > self.num_free:
            raise OutOfPages(f"sequence {seq_id!r} needs {grow + len(cow)} pages, {self.num_free} free")
        copies = []
        for i in cow:
            old, new = seq.table[i], self._take()
            copies.append((old, new))
            seq.table[i] = new
            self._release(old)
        seq.table.extend(self._take() for _ in range(grow))
        return copies

    def commit(self, seq_id, n: int) -> None:
        """Mark ``n`` more tokens as written; make newly completed full blocks shareable."""
        seq = self._seqs[seq_id]
        held = seq.dropped + len(seq.table)  # logical pages up to the table's end
        if seq.computed + n > len(seq.tokens) or self.pages_for(seq.computed + n) > held:
            raise ValueError(f"sequence {seq_id!r}: commit of {n} tokens past its tokens or pages")
        seq.computed += n
        L = self.page_size
        while len(seq.hashes) < seq.computed // L:
            i = len(seq.hashes)
            h = _chain_hash(seq.hashes[-1] if seq.hashes else b"", seq.tokens[i * L:(i + 1) * L])
            seq.hashes.append(h)
            page = seq.table[i - seq.dropped]  # blocks are hashed at commit, before any drop
            if self.prefix_sharing and h not in self._cached and page not in self._page_hash:
                self._cached[h] = page
                self._page_hash[page] = h

    def fork(self, parent_id, child_id) -> None:
        """A new sequence sharing every page and token of ``parent_id`` (copy-on-write later)."""
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already exists")
        p = self._seqs[parent_id]
        for page in p.table:
            self._ref[page] += 1
        self._seqs[child_id] = _Seq(list(p.tokens), list(p.table), p.computed, list(p.hashes), p.dropped)

    def drop_before(self, seq_id, pos: int) -> int:
        """Free the sequence's pages whose tokens all sit before position ``pos`` (behind a sliding
        window); return how many were dropped. Only computed tokens may fall behind."""
        seq = self._seqs[seq_id]
        if not 0 <= pos <= seq.computed:
            raise ValueError(f"sequence {seq_id!r}: cannot drop before {pos}; "
                             f"{seq.computed} tokens are computed")
        n = min(pos // self.page_size - seq.dropped, len(seq.table))
        if n <= 0:
            return 0
        for page in seq.table[:n]:
            self._release(page)
        del seq.table[:n]
        seq.dropped += n
        return n

    def finish(self, seq_id) -> None:
        """Drop a sequence; its pages return to the free list when no other table holds them."""
        seq = self._seqs.pop(seq_id)
        for page in reversed(seq.table):
            self._release(page)
