"""Which sequences run this step, and how many tokens each: continuous batching with chunked prefill.

Every step has a token budget (max_num_batched_tokens) and a cap on running sequences. Policy, in order:

1. Running sequences, oldest admission first, each get what they still need: one token when decoding,
   the rest of their prompt (cut to the remaining budget) when prefilling. A sequence that needs a new
   KV block when the pool is empty takes it from the most recently admitted running sequence, which is
   preempted: its blocks and state slot are freed and it goes back to the front of the waiting queue,
   to be recomputed from scratch later (the GDN state cannot be rolled back). Preemption never changes
   a sequence's output: it recomputes the same tokens, and sampling draws depend only on the seed and
   the position (runner/sampler.py).
2. If nothing was preempted, waiting sequences are admitted in arrival order while there is budget, a
   free state slot and room in the pool for their first chunk. Admission stops at the first one that
   does not fit (no overtaking), so a long prompt is not starved by short ones.

The scheduler deals in sequence ids and token counts; it reads `seq_id`, the token counts, `num_computed`
and `status` of its sequences and asks the cache manager for blocks and slots.

With async scheduling (llm_engine.py) a step is scheduled while the previous one still runs: a token being
sampled counts as known (`num_pending`), so a decoding sequence is fed its next position before the host
has read the token (the runner takes it from the device). A sequence whose last allowed token is in
flight is skipped; one that turns out to have stopped (EOS, stop string) runs one wasted position, which
is discarded.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable

from ..cache.manager import HybridCacheManager
from ..step_io import ScheduledChunk, SchedulerOutput
from .sequence import SeqStatus, Sequence


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: HybridCacheManager):
        self.config = config
        self.cache = cache
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []          # admission order: preemption takes from the end
        self._freed: list[int] = []                # ids the runner must forget at the next step
        self._scheduled: list[Sequence] = []       # the sequences of the last schedule(), chunk order
        self.num_preempted_total = 0

    # ---- queue changes -----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its cache resources now."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def finish_many(self, seqs: Iterable[Sequence]) -> None:
        """finish() for several sequences at once (one pass over the queues)."""
        seqs = list(seqs)
        done = {s.seq_id for s in seqs if s.status is not SeqStatus.FINISHED}
        if not done:
            return
        for seq in self.running:
            if seq.seq_id in done:
                self._release(seq)
        self.running = [s for s in self.running if s.seq_id not in done]
        if any(s.seq_id in done for s in self.waiting):
            self.waiting = collections.deque(s for s in self.waiting if s.seq_id not in done)
        for seq in seqs:
            seq.status = SeqStatus.FINISHED

    def _release(self, seq: Sequence) -> None:
        self.cache.free(seq.seq_id)
        self._freed.append(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.reset_for_recompute()
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preempted_total += 1

    @property
    def max_running(self) -> int:
        return min(self.config.max_num_seqs, self.cache.slots.num_slots)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: list[Sequence] = []
        preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending and seq.generation_done:       # its last token is still in flight
                i += 1
                continue
            n = min(seq.num_scheduled_tokens - seq.num_computed, budget)
            new_blocks = self.cache.grow(seq.seq_id, seq.num_computed + n)
            while new_blocks is None:                       # pool short: preempt the newest
                victim = self.running.pop()
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
                new_blocks = self.cache.grow(seq.seq_id, seq.num_computed + n)
            if new_blocks is None:
                break
            chunks.append(ScheduledChunk(seq.seq_id, seq.num_computed, n, new_blocks))
            scheduled.append(seq)
            budget -= n
            i += 1

        new_seqs = []
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if seq.num_pending:                  # preempted with a token in flight: admit once it is read
                break
            n = min(seq.num_tokens, budget)
            held = self.cache.admit(seq.seq_id, n)
            if held is None:
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            slot, blocks = held
            new_seqs.append(seq.runner_data(slot, blocks))
            chunks.append(ScheduledChunk(seq.seq_id, 0, n, []))
            scheduled.append(seq)
            budget -= n

        freed, self._freed = self._freed, []
        self._scheduled = scheduled
        return SchedulerOutput(new_seqs, chunks, freed, preempted)

    def update(self, out: SchedulerOutput) -> list[Sequence]:
        """The step ran: the scheduled tokens are in the cache now. Returns the scheduled sequences in
        chunk order."""
        scheduled, self._scheduled = self._scheduled, []
        for seq, chunk in zip(scheduled, out.chunks):
            seq.num_computed += chunk.num_new
        return scheduled
