"""The prefix index on its own (ids only): exact-position hits, branch detection, copy-on-write tails,
eviction order and consistency, reset, and the snapshot pool sized from the budget."""

from __future__ import annotations

from deltaserve.cache.manager import HybridCacheManager
from deltaserve.cache.plan import CacheSpec, plan_cache

BS = 4


def manager(num_blocks=32, snapshots=4) -> HybridCacheManager:
    return HybridCacheManager(num_blocks=num_blocks, block_size=BS, num_slots=2, num_snapshot_slots=snapshots,
                              enable_prefix_caching=True)


def finish(m: HybridCacheManager, seq_id: int, tokens: list[int], hit=None) -> None:
    """A sequence computes all its tokens and leaves (its state saved at the end)."""
    from deltaserve.cache.prefix_index import MISS

    held = m.admit(seq_id, len(tokens), hit or MISS)
    assert held is not None
    m.release(seq_id, tokens, len(tokens))
    m.check_integrity()


def test_hit_at_an_exact_position_with_a_copied_tail():
    m = manager()
    tokens = list(range(10))                               # 2 full blocks + a 2-token tail
    finish(m, 0, tokens)
    m.take_copies()
    hit = m.lookup(tokens + [99], max_len=10)
    assert hit.length == 10 and len(hit.blocks) == 2 and hit.tail_block is not None and hit.slot >= 2
    slot, blocks = m.admit(1, 11, hit)
    assert blocks[:2] == list(hit.blocks) and blocks[2] != hit.tail_block
    state, block = m.take_copies()
    assert state == [(hit.slot, slot)] and block == [(hit.tail_block, blocks[2])]
    m.check_integrity()
    assert m.lookup(tokens, max_len=9).length == 0           # no state at 9: nothing, however much KV matches
    assert m.lookup(tokens, max_len=9).kv_len == 10


def test_branch_is_where_the_kv_stops_matching():
    m = manager()
    finish(m, 0, list(range(12)))
    hit = m.lookup([0, 1, 2, 3, 4, 5, 50, 51, 52], max_len=8)
    assert hit.length == 0 and hit.kv_len == 6


def test_eviction_frees_least_recently_used_leaves_and_their_snapshots():
    m = manager(num_blocks=8, snapshots=8)
    finish(m, 0, list(range(8)))                         # 2 blocks + a snapshot at 8
    finish(m, 1, list(range(100, 108)))
    m.lookup(list(range(9)), max_len=8)                  # touch the first
    assert m.blocks.num_free == 4
    assert m.admit(2, 24) is not None                    # 6 blocks: the second prefix must go
    m.check_integrity()
    assert m.lookup(list(range(100, 109)), max_len=8).length == 0
    assert m.lookup(list(range(9)), max_len=8).length == 8
    m.free(2)
    m.check_integrity()


def test_snapshot_slots_evict_by_recency_and_saved_work_and_reset_empties_everything():
    m = manager(snapshots=2)
    for i in range(3):
        finish(m, i, [i * 10 + t for t in range(8)])
    assert m.prefix.num_snapshots == 2 and m.prefix.num_evicted_snapshots == 1
    assert m.lookup([t for t in range(8)] + [1], max_len=8).length == 0      # the oldest went
    m.reset_prefix_cache()
    m.check_integrity()
    assert m.blocks.num_used == 0 and m.prefix.num_snapshots == 0


def test_a_live_sequences_blocks_are_never_evicted():
    m = manager(num_blocks=4)
    tokens = list(range(8))
    m.admit(0, 8)
    m.save_state(0, tokens, 8)                           # indexed while it runs
    assert m.admit(1, 16) is None                        # needs 4 blocks, 2 are the live sequence's
    m.check_integrity()
    m.free(0)
    assert m.admit(1, 16) is not None                    # now they are the cache's alone: evicted
    m.check_integrity()


def test_plan_sets_a_share_of_the_budget_aside_for_snapshots():
    spec = CacheSpec(block_size=16, kv_block_bytes=1000, state_slot_bytes=10_000)
    plan = plan_cache(spec, budget_bytes=1_000_000, max_num_seqs=8, max_model_len=256, snapshot_fraction=0.1)
    assert plan.num_snapshot_slots == 10 and plan.num_slots == 8 + 10
    assert plan.used_bytes <= 1_000_000
    off = plan_cache(spec, budget_bytes=1_000_000, max_num_seqs=8, max_model_len=256)
    assert off.num_snapshot_slots == 0 and off.num_blocks > plan.num_blocks
