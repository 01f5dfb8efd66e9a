"""Where a vLLM job's blocks land in kvtier's chunks (kvtier.integrations.vllm.placement): pure
arithmetic, tested without vLLM or torch."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.integrations.vllm.placement import Misplaced, consecutive_runs, header_span, place


@dataclass(frozen=True)
class Item:  # what placement reads of common.ChunkItem
    group: int
    name: str = ""


def test_whole_chunks_of_one_group_take_positions_in_order() -> None:
    a, b = Item(0, "a"), Item(0, "b")
    got = place([10, 11, 12, 13], [4], [0], [a, b], 2)
    assert got == [(0, [(a, [(10, 0), (11, 1)]), (b, [(12, 0), (13, 1)])])]


def test_the_first_chunk_may_start_mid_chunk() -> None:
    # 6 blocks from logical block 6 with 4 blocks a chunk: chunk 1 holds positions 2, 3; chunk 2 all 4
    a, b = Item(0, "a"), Item(0, "b")
    got = place([7, 8, 9, 10, 11, 12], [6], [6], [a, b], 4)
    assert got == [(0, [(a, [(7, 2), (8, 3)]), (b, [(9, 0), (10, 1), (11, 2), (12, 3)])])]
    # a job of one chunk from mid-chunk (a sliding group's store, a load of the needed tail)
    assert place([5], [1], [2], [a], 4) == [(0, [(a, [(5, 2)])])]


def test_several_groups_split_the_flat_block_list_and_skip_empty_groups() -> None:
    # group 0: 4 blocks from 0 (2 chunks of 2); group 1: none; group 2: 3 blocks from 1 (mid-chunk)
    f0, f1, s0, s1 = Item(0, "f0"), Item(0, "f1"), Item(2, "s0"), Item(2, "s1")
    got = place([1, 2, 3, 4, 21, 22, 23], [4, 0, 3], [0, 0, 1], [f0, f1, s0, s1], 2)
    assert got == [
        (0, [(f0, [(1, 0), (2, 1)]), (f1, [(3, 0), (4, 1)])]),
        (2, [(s0, [(21, 1)]), (s1, [(22, 0), (23, 1)])]),
    ]


def test_block_ids_of_any_int_like_type_become_ints() -> None:
    class Id(int):
        pass

    got = place([Id(3), Id(4)], [2], [0], [Item(0)], 2)
    assert got != [] and all(type(b) is int for _, placed in got for _, blocks in placed for b, _ in blocks)


def test_items_of_another_group_are_a_layout_mismatch() -> None:
    got = place([1, 2], [2, 0], [0, 0], [Item(1)], 2)
    assert isinstance(got, Misplaced) and not got.noncontiguous
    assert got.reason == "job layout mismatch in group 0 (2 blocks from 0, 1 items)"


def test_too_few_items_are_a_layout_mismatch() -> None:
    got = place([1, 2, 3], [3], [0], [Item(0)], 2)
    assert isinstance(got, Misplaced) and "group 0 (3 blocks from 0, 1 items)" in got.reason


def test_items_left_over_are_a_mismatch() -> None:
    got = place([1, 2], [2], [0], [Item(0), Item(0)], 2)
    assert isinstance(got, Misplaced) and got.reason == "job has 2 chunk items, vLLM's block spec covers 1"


def test_a_short_later_chunk_is_noncontiguous_and_fails() -> None:
    # only the first chunk may be partial: a later one short of blocks means vLLM left out null
    # blocks inside it (sliding windows with prefix-cache retention), so positions derived from
    # the count would be wrong; the job fails instead
    got = place([1, 2, 3, 4, 5], [5], [0], [Item(0), Item(0)], 4)
    assert isinstance(got, Misplaced) and got.noncontiguous
    assert got.reason == ("group 0's blocks are not contiguous (5 blocks from 0 for 2 chunks); "
                          "the job fails rather than guess positions")


def test_header_span_claims_only_the_positions_moved() -> None:
    assert header_span(256, 16, [(7, 0), (8, 1), (9, 2), (10, 3)]) == (256, 320)
    assert header_span(256, 16, [(7, 2), (8, 3)]) == (288, 320)  # a mid-chunk first chunk
    assert header_span(0, 64, [(5, 1)]) == (64, 128)


def test_runs_are_consecutive_chunks_of_one_group_in_order() -> None:
    # (group, index in group, blocks, slot): chunk 2 of group 0 is copied otherwise (a gap)
    a, b, d = (0, 0, [(1, 3)], 7), (0, 1, [(2, 0)], 4), (0, 3, [(4, 0)], 5)
    x, y = (1, 0, [(9, 0)], 0), (1, 1, [(10, 0)], 1)
    assert consecutive_runs([y, d, b, x, a]) == [[a, b], [d], [x, y]]
    assert consecutive_runs([]) == []
