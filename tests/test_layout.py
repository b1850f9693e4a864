"""Chunk packing as pure code: layouts in read order, chunk sizes, what is not packed,
and the next epoch's log built from the files read in this one."""

from __future__ import annotations

import itertools
import random
from collections.abc import Hashable, Sequence

import pytest

from bucketfs.prefetch.layout import ChunkPlan, NextEpochPacker, Placement, plan_chunks

KIB = 1024


def check_layout(chunks: Sequence[ChunkPlan], chunk_bytes: int) -> None:
    for chunk in chunks:
        offset = 0
        for file in chunk.files:
            assert file.offset == offset
            offset += file.length
        assert chunk.size == offset
        assert chunk.size <= chunk_bytes or len(chunk.files) == 1


def packed_keys(chunks: Sequence[ChunkPlan]) -> list[Hashable]:
    return [file.key for chunk in chunks for file in chunk.files]


def test_small_files_are_packed_in_read_order() -> None:
    order = [(f"f{i}", 300 * KIB) for i in range(10)]
    chunks = plan_chunks(order, chunk_bytes=1024 * KIB, small_limit=512 * KIB)
    assert [len(chunk.files) for chunk in chunks] == [3, 3, 3, 1]
    assert packed_keys(chunks) == [key for key, _ in order]
    assert chunks[1].files[0] == Placement("f3", 0, 300 * KIB)
    assert chunks[1].files[2] == ("f5", 600 * KIB, 300 * KIB)
    assert [chunk.sequence for chunk in chunks] == [0, 3, 6, 9]
    check_layout(chunks, 1024 * KIB)


def test_large_empty_and_repeated_files_are_not_packed() -> None:
    order = [("a", 100), ("big", 1000), ("empty", 0), ("b", 999), ("a", 100), ("c", 50)]
    chunks = plan_chunks(order, chunk_bytes=10_000, small_limit=1000)
    assert packed_keys(chunks) == ["a", "b", "c"]
    assert chunks[0].sequence == 0
    assert plan_chunks(order, chunk_bytes=10_000, small_limit=1000,
                       exclude={"a"})[0].sequence == 3


def test_random_sizes_fill_chunks_without_overflowing() -> None:
    rng = random.Random(0)
    order = [(i, rng.randrange(1, 300 * KIB)) for i in range(2000)]
    chunks = plan_chunks(order, chunk_bytes=4096 * KIB, small_limit=1024 * KIB)
    check_layout(chunks, 4096 * KIB)
    assert packed_keys(chunks) == list(range(2000))
    # every chunk but the last is closed only when the next file would not fit
    for chunk, after in itertools.pairwise(chunks):
        assert chunk.size + after.files[0].length > 4096 * KIB


def test_bad_parameters() -> None:
    with pytest.raises(ValueError):
        plan_chunks([], chunk_bytes=0)
    with pytest.raises(ValueError):
        NextEpochPacker(small_limit=0)


# -- the next epoch's log -----------------------------------------------------------------

def test_without_the_next_order_chunks_follow_the_reads() -> None:
    packer = NextEpochPacker(chunk_bytes=1000, small_limit=500)
    emitted: list[ChunkPlan] = []
    for key in "abcdefg":
        emitted += packer.add(key, 400)
    emitted += packer.add("a", 400)  # read again: already packed
    emitted += packer.add("g", 400)  # read again: waiting in the open chunk
    emitted += packer.add("huge", 800)
    assert [packed_keys([chunk]) for chunk in emitted] == [["a", "b"], ["c", "d"],
                                                           ["e", "f"]]
    assert [chunk.sequence for chunk in emitted] == [0, 2, 4]
    last = packer.flush()
    assert packed_keys(last) == ["g"]
    assert packer.flush() == []


def test_with_the_next_order_a_chunk_goes_when_all_its_files_were_read() -> None:
    next_order = [(key, 400) for key in "dcbagfe"]
    packer = NextEpochPacker(chunk_bytes=1000, small_limit=500, next_order=next_order)
    emitted: list[ChunkPlan] = []
    for key in "abc":
        emitted += packer.add(key, 400)
    assert [packed_keys([chunk]) for chunk in emitted] == [["b", "a"]]
    emitted += packer.add("d", 400)
    assert packed_keys(emitted[1:]) == ["d", "c"]
    assert [chunk.sequence for chunk in emitted] == [2, 0]  # its place in the next epoch
    check_layout(emitted, 1000)


def test_flush_packs_what_was_read_of_incomplete_chunks_in_next_order() -> None:
    next_order = [(key, 400) for key in "abcdef"]  # planned chunks: ab cd ef
    packer = NextEpochPacker(chunk_bytes=1000, small_limit=500, next_order=next_order)
    for key in "fdbxy":  # one file of each chunk; x and y are not read next epoch
        assert packer.add(key, 400) == []
    chunks = packer.flush()
    # b, d, f in next-epoch order, cut again at the chunk size
    assert [packed_keys([chunk]) for chunk in chunks] == [["b", "d"], ["f"]]
    assert [chunk.sequence for chunk in chunks] == [1, 5]
    check_layout(chunks, 1000)
    assert packer.flush() == []


def test_the_next_order_can_arrive_mid_epoch() -> None:
    packer = NextEpochPacker(chunk_bytes=1000, small_limit=500)
    emitted: list[ChunkPlan] = []
    for key in "abc":
        emitted += packer.add(key, 400)
    assert packed_keys(emitted) == ["a", "b"]  # laid out in read order already
    # c is waiting; the next epoch reads e, c, a, d, b
    emitted = packer.set_next_order([(key, 400) for key in "ecadb"])
    assert emitted == []  # planned: [e, c], [d]; a and b stay where they are
    emitted += packer.add("d", 400)
    assert [packed_keys([chunk]) for chunk in emitted] == [["d"]]
    assert emitted[0].sequence == 3
    emitted += packer.add("e", 400)
    assert packed_keys(emitted[1:]) == ["e", "c"]
    # a second next order takes over whatever is still waiting
    packer2 = NextEpochPacker(chunk_bytes=1000, small_limit=500,
                              next_order=[(key, 400) for key in "xzy"])
    assert packer2.add("z", 400) == []  # planned with x, which is not read
    assert packer2.set_next_order([(key, 400) for key in "zq"]) == []
    assert packed_keys(packer2.add("q", 400)) == ["z", "q"]


# -- the next order announced: planned apart, held for, settled ----------------------------

def test_a_plan_made_apart_is_the_same_as_set_next_order() -> None:
    order = [(key, 300) for key in "hgfedcba"]
    direct = NextEpochPacker(chunk_bytes=1000, small_limit=500)
    apart = NextEpochPacker(chunk_bytes=1000, small_limit=500)
    plan = NextEpochPacker(chunk_bytes=1000, small_limit=500).plan(order)  # any packer's
    assert [packed_keys([c]) for c in plan.chunks] == [list("hgf"), list("edc"), list("ba")]
    for key in "ab":
        assert direct.add(key, 300) == apart.add(key, 300) == []
    assert direct.set_next_order(order) == apart.use(plan) == [
        ChunkPlan((Placement("b", 0, 300), Placement("a", 300, 300)), 6)]


def test_while_the_next_order_is_expected_reads_wait_for_it() -> None:
    packer = NextEpochPacker(chunk_bytes=1000, small_limit=500)
    packer.expect_next()
    assert packer.expecting and not packer.planned
    for key in "abcdef":  # would make three read-order chunks
        assert packer.add(key, 400, packed=key == "f") == []
    assert packer.waiting() == list("abcdef")
    emitted = packer.use(packer.plan([(key, 400) for key in "fedcba"]))
    # in the order they complete, each laid out by the next order
    assert [packed_keys([chunk]) for chunk in emitted] == [["b", "a"], ["d", "c"], ["f", "e"]]
    assert [chunk.sequence for chunk in emitted] == [4, 2, 0]
    assert not packer.expecting and packer.planned


def test_a_next_order_that_never_comes_leaves_reads_in_read_order() -> None:
    packer = NextEpochPacker(chunk_bytes=1000, small_limit=500)
    packer.add("a", 400)
    packer.expect_next()
    for key in "bcd":
        packer.add(key, 400, packed=key == "c")
    # c was laid out already: kept only for the next order, never in read order
    assert [packed_keys([chunk]) for chunk in packer.flush()] == [["a", "b"], ["d"]]
    assert not packer.expecting and packer.flush() == []


def test_settled_files_are_left_out_of_planned_chunks() -> None:
    packer = NextEpochPacker(chunk_bytes=1000, small_limit=500)
    packer.expect_next()
    for key in "ab":
        packer.add(key, 300)
    # planned: [a b c] [d e f]; b is laid out where the plan wants it already
    emitted = packer.use(packer.plan([(key, 300) for key in "abcdef"]), settled=["b"])
    assert emitted == []
    emitted = packer.add("c", 300)
    assert emitted == [ChunkPlan((Placement("a", 0, 300), Placement("c", 300, 300)), 0)]
    assert packer.add("b", 300) == []  # never packed again
    for key in "df":
        assert packer.add(key, 300) == []
    # e turns out to be where it belongs too: its chunk is complete without it
    assert packer.settle(["e"]) == [
        ChunkPlan((Placement("d", 0, 300), Placement("f", 300, 300)), 3)]
    assert packer.settle(["e"]) == [] and packer.flush() == []


def test_a_chunk_left_empty_by_settling_is_never_emitted() -> None:
    packer = NextEpochPacker(chunk_bytes=1000, small_limit=500,
                             next_order=[(key, 300) for key in "abcdef"])
    assert packer.settle("def") == []
    for key in "abc":
        packer.add(key, 300)
    assert packer.flush() == []
    assert NextEpochPacker(chunk_bytes=1000, small_limit=500).settle(["x"]) == [], \
        "no next order: nothing to settle"
