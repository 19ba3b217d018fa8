"""The scheduler's half of speculative decoding, without a model: which drafts a decoding sequence verifies
(cut to the budget and to the tokens it may still emit; none mid-prompt, with a commit point ahead or a
token in flight), that drafts are consumed once, dropped on preemption, and that num_computed moves by the
chunk at `update` and back by the rejected drafts at `accept`."""

from __future__ import annotations

from deltaserve.cache.manager import HybridCacheManager
from deltaserve.engine.scheduler import Scheduler, SchedulerConfig
from deltaserve.engine.sequence import Request, Sequence
from deltaserve.sampling_params import SamplingParams


def _seq(seq_id: int, prompt_len: int, max_new: int) -> Sequence:
    req = Request(f"r{seq_id}", None, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_new),
                  float(seq_id))
    seq = Sequence(seq_id, req, 0, max_new_tokens=max_new, eos_token_ids=frozenset(), detokenizer=None)
    req.seqs = [seq]
    return seq


def _decoding(sched: Scheduler, seq: Sequence) -> None:
    """Admit and prefill the sequence, then give it its first generated token."""
    sched.add(seq)
    while seq.num_computed < seq.num_tokens:
        sched.update(sched.schedule())
    seq.append_token(7, None)


def _scheduler(budget: int = 64, num_blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
                     HybridCacheManager(num_blocks=num_blocks, block_size=4, num_slots=8))


def test_a_decoding_sequence_verifies_its_drafts_and_moves_by_the_accepted_count():
    sched = _scheduler()
    seq = _seq(0, 10, 20)
    _decoding(sched, seq)
    assert seq.num_computed == 10 and seq.num_tokens == 11
    seq.draft_token_ids = [3, 4, 5]
    out = sched.schedule()
    (chunk,) = out.chunks
    assert (chunk.num_computed, chunk.num_new, chunk.draft_token_ids) == (10, 4, [3, 4, 5])
    assert seq.draft_token_ids == []                                    # consumed
    assert sched.cache.blocks_for(14) == len(sched.cache.block_ids(seq.seq_id))   # room for all 4 positions
    sched.update(out)
    assert seq.num_computed == 14                                       # every position until read ...
    sched.accept(seq, 3, 2)                                             # ... then the rejected draft is back out
    for t in (3, 4, 9):
        seq.append_token(t, None)
    assert seq.num_computed == 13 == seq.num_tokens - 1
    out = sched.schedule()                                              # no drafts now: a plain decode
    assert (out.chunks[0].num_new, out.chunks[0].draft_token_ids) == (1, [])


def test_drafts_are_cut_to_the_budget_and_to_what_may_still_be_emitted():
    sched = _scheduler(budget=3)
    seq = _seq(0, 6, 20)
    _decoding(sched, seq)
    seq.draft_token_ids = [1, 2, 3, 4]
    assert sched.schedule().chunks[0].draft_token_ids == [1, 2]         # 1 + 2 = the budget of 3
    sched = _scheduler()
    seq = _seq(1, 6, 3)                                                 # max_tokens 3: one generated, 2 to go
    _decoding(sched, seq)
    seq.draft_token_ids = [1, 2, 3, 4]
    assert sched.schedule().chunks[0].draft_token_ids == [1]            # emits at most 2 tokens
    sched = _scheduler()
    seq = _seq(2, 6, 2)
    _decoding(sched, seq)
    seq.draft_token_ids = [1, 2]
    assert sched.schedule().chunks[0].draft_token_ids == []             # its last token: no room for a draft


def test_no_drafts_mid_prompt_with_a_commit_point_ahead_or_a_token_in_flight():
    sched = _scheduler(budget=4)
    seq = _seq(0, 10, 20)
    sched.add(seq)
    seq.draft_token_ids = [1, 2]
    out = sched.schedule()                                              # a prefill chunk
    assert out.chunks[0].draft_token_ids == [] and out.chunks[0].num_new == 4
    sched.update(out)
    sched = _scheduler()
    seq = _seq(1, 10, 20)
    _decoding(sched, seq)
    seq.commit_points = [15]
    seq.draft_token_ids = [1, 2]
    assert sched.schedule().chunks[0].draft_token_ids == []
    sched = _scheduler()
    seq = _seq(2, 10, 20)
    _decoding(sched, seq)
    sched.update(sched.schedule())                                      # a plain decode launched ...
    seq.num_pending = 1                                                 # ... its token not read yet
    seq.draft_token_ids = [1, 2]
    out = sched.schedule()
    assert out.chunks[0].draft_token_ids == [] and out.chunks[0].num_new == 1


def test_preemption_drops_the_drafts():
    sched = _scheduler()
    seq = _seq(0, 10, 20)
    _decoding(sched, seq)
    seq.draft_token_ids = [1, 2]
    sched.running.remove(seq)
    sched._preempt(seq)
    assert seq.draft_token_ids == [] and seq.num_computed == 0
