"""Block pool, state pool and the hybrid manager: allocation, exhaustion, freeing, integrity."""

from __future__ import annotations

import random

import pytest

from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.manager import HybridCacheManager
from deltaserve.cache.state_pool import StatePool


def test_block_pool_allocates_all_then_refuses_without_taking_anything():
    pool = BlockPool(5)
    a = pool.allocate(3)
    assert sorted(a) == [0, 1, 2] and pool.num_free == 2
    assert pool.allocate(3) is None and pool.num_free == 2       # refused, nothing taken
    b = pool.allocate(2)
    assert set(a).isdisjoint(b) and pool.num_free == 0
    assert pool.allocate(0) == []
    pool.free(a)
    pool.free(b)
    assert pool.num_free == 5
    pool.check_integrity()


def test_block_pool_double_free_and_shared_blocks():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.share(a)                   # a second owner (prefix caching)
    pool.free(a)
    assert pool.num_free == 2       # still owned once
    pool.free(a)
    assert pool.num_free == 4
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(a)
    with pytest.raises(ValueError, match="free"):
        pool.share([3])
    pool.check_integrity()


def test_block_pool_reuses_recently_freed_blocks_first():
    pool = BlockPool(8)
    a = pool.allocate(3)
    pool.allocate(2)
    pool.free(a)
    assert pool.allocate(3) == a


def test_state_pool():
    pool = StatePool(2)
    s0, s1 = pool.allocate(), pool.allocate()
    assert {s0, s1} == {0, 1} and pool.allocate() is None
    pool.free(s0)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(s0)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(7)
    assert pool.allocate() == s0
    pool.check_integrity()


def test_manager_admit_grow_free():
    m = HybridCacheManager(num_blocks=6, block_size=4, num_slots=2)
    slot, blocks = m.admit(10, 5)                   # 5 tokens -> 2 blocks
    assert len(blocks) == 2 and m.slot_of(10) == slot
    assert m.grow(10, 8) == []                      # still fits in 2 blocks
    new = m.grow(10, 9)
    assert len(new) == 1 and m.block_ids(10) == blocks + new
    assert m.admit(11, 16) is None                  # needs 4 blocks, only 3 free: nothing taken
    assert m.num_free_blocks == 3 and m.num_free_slots == 1
    m.admit(11, 12)
    assert m.admit(12, 1) is None                   # no slot left
    assert m.grow(10, 13) is None                   # pool empty
    m.check_integrity()
    m.free(10)
    m.free(10)                                      # no-op
    m.free(11)
    assert m.num_free_blocks == 6 and m.num_free_slots == 2
    m.check_integrity()
    with pytest.raises(ValueError, match="already"):
        m.admit(5, 1)
        m.admit(5, 1)


def test_manager_random_churn_keeps_integrity():
    rng = random.Random(0)
    m = HybridCacheManager(num_blocks=40, block_size=4, num_slots=8)
    lengths: dict[int, int] = {}
    for step in range(2000):
        op = rng.random()
        if op < 0.3 and len(lengths) < 8:
            sid = step
            n = rng.randint(1, 30)
            if m.admit(sid, n) is not None:
                lengths[sid] = n
        elif op < 0.8 and lengths:
            sid = rng.choice(list(lengths))
            n = lengths[sid] + rng.randint(1, 6)
            if m.grow(sid, n) is not None:
                lengths[sid] = n
        elif lengths:
            sid = rng.choice(list(lengths))
            m.free(sid)
            del lengths[sid]
        for sid, n in lengths.items():
            assert len(m.block_ids(sid)) == m.blocks_for(n)
        m.check_integrity()
    for sid in list(lengths):
        m.free(sid)
    assert m.num_free_blocks == 40 and m.num_free_slots == 8
