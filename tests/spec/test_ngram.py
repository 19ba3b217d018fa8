import random
import time

import pytest

from deltaserve.spec.ngram import NgramIndex, propose_ngram


def _index(tokens, lo, hi):
    ix = NgramIndex(lo, hi)
    ix.extend(tokens)
    return ix


def test_longest_suffix_wins_over_a_shorter_more_recent_match():
    # suffix [1, 2, 3]: the 3-gram occurs at 0..2 (followed by 7); the 1-gram 3 occurs later (followed by 9)
    toks = [1, 2, 3, 7, 8, 3, 9, 1, 2, 3]
    assert propose_ngram(toks, 1, 3, 2) == [7, 8]
    assert _index(toks, 1, 3).propose(2) == [7, 8]
    # capped at 1-grams: the most recent 3 (position 5) is followed by 9, 1
    assert _index(toks, 1, 1).propose(2) == [9, 1]


def test_most_recent_occurrence_and_short_tail():
    toks = [5, 6, 1, 5, 6, 2, 5, 6]
    assert _index(toks, 2, 2).propose(3) == [2, 5, 6]
    # the match right before the suffix gives fewer than k tokens
    toks = [4, 4, 4]
    assert _index(toks, 2, 2).propose(5) == [4]


def test_no_match_and_min_n():
    assert _index([1, 2, 3, 4], 1, 3).propose(3) == []
    assert _index([1, 2, 9, 1, 2], 3, 3).propose(3) == []       # only a 2-gram repeats
    assert _index([1, 2, 9, 1, 2], 2, 3).propose(3) == [9, 1, 2]
    assert _index([], 1, 3).propose(3) == [] and _index([7], 1, 3).propose(3) == []
    assert _index([1, 1], 1, 3).propose(0) == []


def test_index_equals_scan_incrementally():
    rng = random.Random(0)
    for lo, hi in ((1, 1), (1, 3), (2, 4), (3, 5)):
        toks = [rng.randrange(4) for _ in range(300)]
        ix = NgramIndex(lo, hi)
        for i, t in enumerate(toks):
            ix.sync(toks[:i + 1])
            assert ix.propose(4) == propose_ngram(toks[:i + 1], lo, hi, 4), (lo, hi, i)


def test_sync_refuses_a_shorter_sequence_and_bad_bounds():
    ix = _index([1, 2, 3], 1, 2)
    with pytest.raises(ValueError, match="shrank"):
        ix.sync([1, 2])
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramIndex(3, 2)


def test_fast_on_an_8k_sequence():
    rng = random.Random(1)
    toks = [rng.randrange(1000) for _ in range(8192)]
    t0 = time.perf_counter()
    ix = NgramIndex(1, 4)
    ix.extend(toks)
    for _ in range(256):                         # decode: append one token, propose
        ix.extend([rng.randrange(1000)])
        ix.propose(4)
    assert time.perf_counter() - t0 < 1.0
