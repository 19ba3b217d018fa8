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


def _lookahead_scheduler(num_blocks: int, lookahead: int = 3) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, draft_lookahead=lookahead),
                     HybridCacheManager(num_blocks=num_blocks, block_size=4, num_slots=8))


def test_sampling_chunks_get_lookahead_blocks_for_the_draft_rows():
    """MTP drafts (draft_lookahead = K - 1): a chunk that samples also holds the blocks of the K - 1 positions
    after it (capped at the tokens the sequence may hold), in the chunk's new blocks; mid-prompt chunks do not."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=5, draft_lookahead=3),
                      HybridCacheManager(num_blocks=64, block_size=4, num_slots=8))
    seq = _seq(0, 8, 20)
    sched.add(seq)
    out = sched.schedule()                                              # positions 0..4: mid-prompt
    assert len(sched.cache.block_ids(0)) == 2 and out.new_seqs[0].block_ids == sched.cache.block_ids(0)
    sched.update(out)
    out = sched.schedule()                                              # 5..7 ends the prompt: + 3 positions
    assert len(sched.cache.block_ids(0)) == sched.cache.blocks_for(8 + 3) == 3
    assert out.chunks[0].new_block_ids == sched.cache.block_ids(0)[2:]
    sched.update(out)
    seq.append_token(7, None)
    seq.draft_token_ids = [3, 4, 5]
    sched.schedule()                                                    # verify 8..11, draft rows up to 14
    assert len(sched.cache.block_ids(0)) == sched.cache.blocks_for(12 + 3)
    sched = _lookahead_scheduler(num_blocks=64)
    sched.add(_seq(1, 6, 2))                                            # may hold 8 tokens: no block past them
    sched.schedule()
    assert len(sched.cache.block_ids(1)) == sched.cache.blocks_for(8) == 2


def test_lookahead_blocks_never_cost_an_admission_or_a_preemption():
    """A pool barely bigger than the sequences' own blocks (one spare per running sequence is kept free): the
    same sequences run in each step with or without lookahead, and some lookahead blocks were handed out."""
    runs, most = [], []
    for lookahead in (0, 3):
        sched = _lookahead_scheduler(num_blocks=14, lookahead=lookahead)
        seqs = [_seq(i, 8, 4) for i in range(4)]
        for s in seqs:
            sched.add(s)
        admitted = []
        for _ in range(8):
            out = sched.schedule()
            admitted.append(sorted(c.seq_id for c in out.chunks))
            most.append((lookahead, sched.cache.num_free_blocks))
            sched.update(out)
            for c in out.chunks:
                s = seqs[c.seq_id]
                if c.num_computed + c.num_new == s.num_tokens and not s.generation_done:
                    s.append_token(5, None)
        runs.append((admitted, sched.num_preempted_total))
    assert runs[0] == runs[1] and runs[0][1] == 0, runs
    first = dict(most[:: len(most) // 2])                              # free blocks after each run's first step
    assert first[3] < first[0], most
