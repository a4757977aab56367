"""The n-gram proposer: the longest earlier match of a request's suffix, what followed its
latest occurrence, from an index kept as tokens arrive (checked against a plain scan)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmbus.services.scheduler.ngram_proposer import NgramIndex


def scan(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    end = len(tokens)
    for n in range(min(n_max, end - 1), n_min - 1, -1):
        suffix = tokens[end - n:]
        for start in range(end - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_the_longest_match_wins_and_its_latest_occurrence():
    index = NgramIndex(1, 3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 5, 6, 7]
    # suffix (5, 6, 7) occurred at 0 (followed by 8); (6, 7) later at 5 (followed by 1)
    assert index.propose((), tokens, 3) == [8, 9, 6]
    tokens.append(2)  # (7, 2), (2) never seen: nothing
    assert index.propose((), tokens, 3) == []
    tokens.append(7)  # (2, 7) no; (7) latest at 10 -> followed by 2
    assert index.propose((), tokens, 3) == [2, 7]


def test_a_repeated_token_proposes_more_of_itself():
    assert NgramIndex(1, 4).propose([3, 3], [3, 3, 3], 4) == [3]
    assert NgramIndex(2, 4).propose([1, 2, 1, 2, 1, 2], [], 4) == [1, 2]


@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 3),
       st.integers(0, 3), st.integers(1, 5), st.lists(st.integers(1, 6), max_size=8))
def test_the_index_agrees_with_a_scan_as_tokens_arrive(tokens, n_min, extra, k, cuts):
    n_max = n_min + extra
    index = NgramIndex(n_min, n_max)
    prompt = tokens[:cuts[0] if cuts else 1]  # then the output grows, step by step
    grown = len(prompt)
    for cut in [*cuts[1:], len(tokens)]:
        grown = min(len(tokens), grown + cut)
        output = tokens[len(prompt):grown]
        assert index.propose(prompt, output, k) == scan(tokens[:grown], k, n_min, n_max)


def test_a_lookup_indexes_only_the_tokens_that_arrived_since_the_last():
    index = NgramIndex(2, 4)
    tokens = list(range(1000))
    index.propose((), tokens, 4)
    size = len(index._after)
    tokens.append(7)
    index.propose((), tokens, 4)
    assert len(index._after) - size == 3  # one new n-gram per n, not the whole history again
