"""BlockManager: a hypothesis state machine over add / extend / fork / finish, plus targeted cases.

A numpy array of page contents stands in for the device pools. Like a real key/value, the
value written for position ``pos`` depends on the whole prefix ``tokens[:pos+1]`` (a hash of
it), so "a sequence's logical contents equal a contiguous cache" becomes "reading its
computed positions through its block table gives the prefix hashes of its tokens".
"""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxformer.decode.block_manager import BlockManager, OutOfPages

L, P = 4, 12


def kv(tokens, pos):
    return hash(tuple(tokens[: pos + 1])) % (1 << 62)


class Sim:
    """Device pages simulated as token ids; applies copies and writes like the engine does."""

    def __init__(self, mgr):
        self.mgr = mgr
        self.pages = np.full((mgr.num_pages, mgr.page_size), -1, np.int64)

    def compute(self, sid, chunk: int) -> bool:
        """Write the pending tokens of ``sid`` in chunks; False if pages ran out (state kept)."""
        mgr = self.mgr
        toks = mgr.tokens(sid)
        while mgr.num_computed(sid) < len(toks):
            start = mgr.num_computed(sid)
            n = min(chunk, len(toks) - start)
            before = (mgr.block_table(sid), mgr.num_free)
            try:
                copies = mgr.prepare_write(sid, n)
            except OutOfPages:
                assert (mgr.block_table(sid), mgr.num_free) == before
                return False
            for src, dst in copies:  # all reads before writes, like copy_pages
                self.pages[dst] = self.pages[src].copy()
            table = mgr.block_table(sid)
            for pos in range(start, start + n):
                self.pages[table[pos // L], pos % L] = kv(toks, pos)
            mgr.commit(sid, n)
        return True


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.mgr = BlockManager(P, L)
        self.sim = Sim(self.mgr)
        self.expected: dict[int, list[int]] = {}
        self.next_id = 0

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    @rule(data=st.data(), n=st.integers(1, 11), chunk=st.integers(1, 6))
    def add(self, data, n, chunk):
        # half the time start from an existing sequence's tokens, so prefixes get shared
        toks = []
        if self.expected and data.draw(st.booleans()):
            src = data.draw(st.sampled_from(sorted(self.expected)))
            toks = self.expected[src][: data.draw(st.integers(0, len(self.expected[src])))]
        toks = toks + data.draw(st.lists(st.integers(0, 2), min_size=max(0, n - len(toks)), max_size=n))
        toks = toks or [0]
        sid = self._new_id()
        free_before = self.mgr.num_free
        try:
            computed = self.mgr.add(sid, toks)
        except OutOfPages:
            assert self.mgr.num_free == free_before and sid not in self.mgr
            return
        assert computed % L == 0 and computed < len(toks)
        self.expected[sid] = list(toks)
        self.sim.compute(sid, chunk)

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=6), chunk=st.integers(1, 6))
    def extend(self, data, new, chunk):
        sid = data.draw(st.sampled_from(sorted(self.expected)))
        self.mgr.append(sid, new)
        self.expected[sid] += new
        self.sim.compute(sid, chunk)

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.expected)))
        child = self._new_id()
        self.mgr.fork(parent, child)
        self.expected[child] = list(self.expected[parent])

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def finish(self, data):
        sid = data.draw(st.sampled_from(sorted(self.expected)))
        self.mgr.finish(sid)
        del self.expected[sid]

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), chunk=st.integers(1, 6))
    def retry_pending(self, data, chunk):
        self.sim.compute(data.draw(st.sampled_from(sorted(self.expected))), chunk)

    @invariant()
    def pages_accounted(self):
        if not hasattr(self, "mgr"):
            return
        free = self.mgr.free_pages()
        assert len(free) == len(set(free)), f"a page is on the free list twice: {free}"
        holders = np.zeros(P, np.int64)
        for sid in self.mgr.seq_ids():
            table = self.mgr.block_table(sid)
            assert len(table) == len(set(table)), f"seq {sid} holds a page twice: {table}"
            for page in table:
                holders[page] += 1
        for page in range(P):
            assert self.mgr.refcount(page) == holders[page], (page, self.mgr.refcount(page), holders[page])
        assert set(free) == {p for p in range(P) if holders[p] == 0}, "leaked or double-used page"

    @invariant()
    def contents_match_contiguous(self):
        if not hasattr(self, "mgr"):
            return
        assert sorted(self.mgr.seq_ids()) == sorted(self.expected)
        for sid, toks in self.expected.items():
            assert self.mgr.tokens(sid) == toks
            table = self.mgr.block_table(sid)
            n = self.mgr.num_computed(sid)
            got = [int(self.sim.pages[table[p // L], p % L]) for p in range(n)]
            assert got == [kv(toks, p) for p in range(n)], f"seq {sid} {toks}: wrong contents at {n} computed"


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=30, stateful_step_count=25)


def _computed(mgr, sid, toks):
    sim = Sim(mgr)
    mgr.add(sid, toks)
    assert sim.compute(sid, 100)
    return sim


def test_prefix_sharing_by_chained_block_hash():
    mgr = BlockManager(16, L)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    _computed(mgr, "a", a)
    # same two full blocks, then more: both pages shared, 8 tokens already computed
    assert mgr.add("b", a[:8] + [0, 0]) == 8
    assert mgr.block_table("b")[:2] == mgr.block_table("a")[:2]
    assert mgr.refcount(mgr.block_table("a")[0]) == 2
    # exactly the 8 tokens: the last block is recomputed so the last token has logits
    assert mgr.add("c", a[:8]) == 4
    # second block equal but first differs: the chain breaks, nothing shared
    assert mgr.add("d", [0, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    assert set(mgr.block_table("d")).isdisjoint(mgr.block_table("a"))


def test_equal_block_after_a_different_prefix_is_not_shared():
    mgr = BlockManager(16, L)
    x, y = [1, 1, 1, 1, 2, 2, 2, 2, 0], [3, 3, 3, 3, 2, 2, 2, 2, 0]
    _computed(mgr, "x", x)
    _computed(mgr, "y", y)
    assert mgr.add("z", y[:8] + [5]) == 8
    assert mgr.block_table("z")[:2] == mgr.block_table("y")[:2]


def test_uncomputed_blocks_are_not_shared_and_finish_forgets_hashes():
    mgr = BlockManager(16, L)
    mgr.add("a", list(range(9)))  # pages allocated, nothing computed yet
    assert mgr.add("b", list(range(9))) == 0
    mgr.finish("a")
    mgr.finish("b")
    assert mgr.num_free == 16
    _computed(mgr, "c", list(range(9)))
    mgr.finish("c")
    assert mgr.add("d", list(range(9))) == 0  # freed pages are not reused as a cache


def test_fork_then_write_copies_on_write():
    mgr = BlockManager(8, L)
    sim = _computed(mgr, "p", [1, 2, 3, 4, 5, 6])
    mgr.fork("p", "c")
    shared_last = mgr.block_table("p")[1]
    assert mgr.refcount(shared_last) == 2
    mgr.append("c", [9])
    copies = mgr.prepare_write("c", 1)
    assert copies == [(shared_last, mgr.block_table("c")[1])]
    assert mgr.block_table("c")[0] == mgr.block_table("p")[0]  # the full page stays shared
    assert mgr.refcount(shared_last) == 1
    sim.pages[copies[0][1]] = sim.pages[copies[0][0]]
    mgr.commit("c", 1)


def test_out_of_pages_changes_nothing_and_errors_are_clear():
    mgr = BlockManager(2, L)
    with pytest.raises(OutOfPages, match="needs 3 pages, 2 free"):
        mgr.add("a", list(range(9)))
    assert mgr.num_free == 2 and "a" not in mgr
    mgr.add("a", list(range(8)))
    mgr.append("a", [1])
    with pytest.raises(OutOfPages):
        mgr.prepare_write("a", 9)
    assert mgr.block_table("a") == [0, 1]
    with pytest.raises(ValueError, match="already exists"):
        mgr.add("a", [1])
    with pytest.raises(ValueError, match="no tokens"):
        mgr.add("z", [])
    with pytest.raises(ValueError, match="cannot write"):
        mgr.prepare_write("a", 10)
