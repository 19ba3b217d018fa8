"""Which sequences run this step, and how many tokens each: continuous batching with chunked prefill.

Every step has a token budget (max_num_batched_tokens) and a cap on running sequences. Policy, in order:

1. Running sequences, oldest admission first, each get what they still need: one token when decoding,
   the rest of their prompt (cut to the remaining budget) when prefilling. A sequence that needs a new
   KV block when the pool is empty takes it from the most recently admitted running sequence (with the
   "priority" policy: the least urgent one not yet scheduled this step), which is preempted: its blocks and state slot are freed and it goes back to the front of the waiting queue,
   to be recomputed from scratch later (the GDN state cannot be rolled back). Preemption never changes
   a sequence's output: it recomputes the same tokens, and sampling draws depend only on the seed and
   the position (runner/sampler.py).
2. If nothing was preempted, waiting sequences are admitted in queue order (arrival; with the "priority"
   policy by `queue_key`: lower priority value first, ties by arrival) while there is budget, a
   free state slot and room in the pool for their first chunk. Admission stops at the first one that
   does not fit (no overtaking), so a long prompt is not starved by short ones.

Prefix caching (cache/prefix_index.py; on when the cache manager has an index): an admitted sequence looks
up the longest cached prefix of its tokens (the last one is always recomputed: its logits are needed;
prompt-logprob sequences look nothing up, so every position they report is computed) and starts there.
Its commit points, positions whose state is saved for later requests, are set then (`_commit_points`):
the end of the prompt less its last token (a resent or retried prompt hits), the branch point where the
cached KV stops matching when that is deeper than the hit (every later request through that branch hits
it exactly), and optional coarse checkpoints. A prefill chunk never runs past its next commit point, so
the state in the slot after that chunk is the state at the point (`update` queues the copy). A sequence
that leaves (finish, abort, preemption) is saved at its computed length, so the next turn of a
conversation and a readmitted preempted sequence resume there. A commit point is only ever a position all
of whose tokens are final (speculative tokens must never be committed). With n > 1 the other sequences
of a request wait until the first one has passed its prompt's commit point and then resume from it
instead of prefilling the prompt again.

Shared prefixes still being prefilled: a waiting sequence whose prompt shares at least `min_shared_prefix`
tokens beyond its hit with a running sequence that has not computed them yet (a burst of requests over one
new system prompt) is not admitted beside it, to prefill the same tokens again. The running sequence gets a
commit point where the two diverge (its chunk this step is cut there when it would pass it) and the
waiting one is held aside until that state is saved; then it is admitted and hits it. It is requeued at
once if the running sequence leaves first.

Speculative decoding: a decoding sequence with drafts (proposed by the runner after its last step,
`Sequence.draft_token_ids`) is fed its last token and up to K drafts as one verify chunk, cut so that every
token it may emit fits max_tokens and the context limit, and within the step's budget; a sequence with a
commit point still ahead never verifies (snapshots are committed states only). `update` counts every
position of the chunk, as it counts a token still in flight: a sequence that leaves before the step is read
(abort) has computed more than it knows and is not snapshotted; the engine takes the rejected drafts back
once the step's tokens are read (`accept`). KV written for rejected drafts lies past num_computed and is
overwritten later (the block or so reserved for them stays with the sequence).

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
from collections.abc import Iterable

from ..cache.manager import HybridCacheManager
from ..cache.prefix_index import PrefixHit
from ..step_io import ScheduledChunk, SchedulerOutput
from .sequence import SeqStatus, Sequence


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    checkpoint_interval: int = 0     # prefix caching: also save the state every this many prompt tokens (0: off)
    policy: str = "fcfs"             # waiting-queue order (`queue_key`): "fcfs" or "priority"
    # prefix caching: wait for a running sequence's prefill of at least this many shared tokens (0: never)
    min_shared_prefix: int = 256
    # MTP drafts: a chunk that samples also takes blocks for this many positions past it when they are free
    # (the draft rows of the head's steps 2..K write their K/V there; 0: none)
    draft_lookahead: int = 0


_KEY = 16   # prompts are matched for shared prefills by their first this many tokens


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens a and b share, at most limit (compared a block of 64 at a time)."""
    n = 0
    while n + 64 <= limit and a[n : n + 64] == b[n : n + 64]:
        n += 64
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def queue_key(seq: Sequence) -> tuple[int, float, int]:
    """The "priority" policy's order of the waiting queue: lower priority value first, then arrival, then
    sequence index (the n sequences of a request stay together). FCFS is plain arrival order."""
    return seq.request.priority, seq.request.arrival_time, seq.seq_id


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: HybridCacheManager):
        self.config = config
        self.cache = cache
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []          # admission order: preemption takes from the end
        self._freed: list[int] = []                # ids the runner must forget at the next step
        self._scheduled: list[Sequence] = []       # the sequences of the last schedule(), chunk order
        self.num_preempted_total = 0
        self._deferred: dict[int, list[Sequence]] = {}   # first sequence's id -> its siblings waiting for its prompt
        # running sequence's id -> (position, waiting sequence) pairs held until its state at that position is saved
        self._sharers: dict[int, list[tuple[int, Sequence]]] = {}
        self.prefix_queries_total = 0              # tokens looked up at first admissions
        self.prefix_hits_total = 0                 # ... and how many of them were cached

    # ---- queue changes -----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        first = seq.request.seqs[0]
        if self.cache.prefix_caching and seq is not first and first.num_computed < first.num_prompt_tokens - 1:
            self._deferred.setdefault(first.seq_id, []).append(seq)
            return
        self._enqueue(seq, front=False)

    def _enqueue(self, seq: Sequence, *, front: bool) -> None:
        """FCFS: new sequences at the back, preempted ones at the front. Priority: each at its place by
        `queue_key` (a preempted sequence keeps its rank, so a more urgent arrival overtakes it)."""
        if self.config.policy != "priority":
            if front:
                self.waiting.appendleft(seq)
            else:
                self.waiting.append(seq)
            return
        key = queue_key(seq)
        i = next((i for i, other in enumerate(self.waiting) if queue_key(other) > key), len(self.waiting))
        self.waiting.insert(i, seq)

    @property
    def num_waiting(self) -> int:
        return (len(self.waiting) + sum(len(v) for v in self._deferred.values())
                + sum(len(v) for v in self._sharers.values()))

    def _remove_waiting(self, ids: set[int]) -> None:
        if any(s.seq_id in ids for s in self.waiting):
            self.waiting = collections.deque(s for s in self.waiting if s.seq_id not in ids)
        for key in list(self._deferred):
            kept = [s for s in self._deferred[key] if s.seq_id not in ids]
            if kept:
                self._deferred[key] = kept
            else:
                del self._deferred[key]
        for key in list(self._sharers):
            held = [(p, s) for p, s in self._sharers[key] if s.seq_id not in ids]
            if held:
                self._sharers[key] = held
            else:
                del self._sharers[key]

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its cache resources now."""
        self.finish_many([seq])

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
        self._remove_waiting(done)
        for seq in seqs:
            seq.status = SeqStatus.FINISHED

    def _release(self, seq: Sequence) -> None:
        self.cache.release(seq.seq_id, seq.token_ids, seq.num_computed)
        self._freed.append(seq.seq_id)
        self._requeue([s for _, s in self._sharers.pop(seq.seq_id, [])])

    def _requeue(self, seqs: list[Sequence]) -> None:
        """Put held-aside sequences back at the front of the waiting queue, in their order."""
        if self.config.policy == "priority":
            for s in seqs:
                self._enqueue(s, front=True)
        else:
            self.waiting.extendleft(reversed(seqs))

    def _victim(self, first_unscheduled: int) -> Sequence:
        """Which running sequence gives its blocks back: FCFS the newest admitted; "priority" the least urgent
        (the largest `queue_key`) of those this step has not scheduled yet, so no chunk already planned is lost."""
        if self.config.policy != "priority":
            return self.running[-1]
        return max(self.running[first_unscheduled:], key=queue_key)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.reset_for_recompute()
        seq.status = SeqStatus.WAITING
        self._enqueue(seq, front=True)
        self.num_preempted_total += 1

    @property
    def max_running(self) -> int:
        return min(self.config.max_num_seqs, self.cache.slots.num_slots)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._deferred or self._sharers)

    # ---- prefix caching ------------------------------------------------------------------------
    def _lookup(self, seq: Sequence) -> PrefixHit:
        max_len = 0 if seq.needs_prompt_logprobs else seq.num_tokens - 1
        hit = self.cache.lookup(seq.token_ids, max_len)
        return hit

    def _commit_points(self, seq: Sequence, hit: PrefixHit) -> list[int]:
        """Positions after which this sequence's state is saved (see the module docstring)."""
        if not self.cache.prefix_caching:
            return []
        last = seq.num_tokens - 1
        points = {seq.num_prompt_tokens - 1}
        if hit.kv_len > hit.length:
            points.add(hit.kv_len)
        step = self.config.checkpoint_interval
        if step > 0:
            points.update(range(step, seq.num_prompt_tokens - 1, step))
        return sorted(p for p in points if hit.length < p <= last)

    def _after_chunk(self, seq: Sequence) -> None:
        points = seq.commit_points
        while points and points[0] <= seq.num_computed:
            if points.pop(0) == seq.num_computed:
                self.cache.save_state(seq.seq_id, seq.token_ids, seq.num_computed)
        if seq.seq_id in self._deferred and seq.num_computed >= seq.num_prompt_tokens - 1:
            self._requeue(self._deferred.pop(seq.seq_id))
        held = self._sharers.get(seq.seq_id)
        if held and any(p <= seq.num_computed for p, _ in held):
            self._requeue([s for p, s in held if p <= seq.num_computed])
            kept = [(p, s) for p, s in held if p > seq.num_computed]
            if kept:
                self._sharers[seq.seq_id] = kept
            else:
                del self._sharers[seq.seq_id]

    def _hold_for_shared_prefill(self, seq: Sequence, hit: PrefixHit, prefilling: dict[tuple, list[Sequence]],
                                 planned: dict[int, int], chunks: list[ScheduledChunk]) -> int:
        """If a running sequence is about to prefill at least `min_shared_prefix` of seq's tokens past its hit,
        give it a commit point where they diverge (cutting its chunk of this step there), hold seq aside
        until then and return the budget the cut gave back; -1 when seq is admitted as usual."""
        least = self.config.min_shared_prefix
        if least <= 0 or seq.needs_prompt_logprobs or seq.num_tokens - 1 - hit.length < least:
            return -1
        best, best_len = None, 0
        for other in prefilling.get(tuple(seq.token_ids[:_KEY]), ()):
            limit = min(seq.num_tokens - 1, other.num_prompt_tokens - 1)
            shared = _common_prefix(seq.token_ids, other.token_ids, limit)
            if shared - hit.length >= least and shared > other.num_computed and shared > best_len:
                best, best_len = other, shared
        if best is None:
            return -1
        if best_len not in best.commit_points:
            best.commit_points = sorted([*best.commit_points, best_len])
        given_back = 0
        i = planned.get(best.seq_id)
        if i is not None and chunks[i].num_computed + chunks[i].num_new > best_len:
            old = chunks[i]
            chunks[i] = ScheduledChunk(old.seq_id, old.num_computed, best_len - old.num_computed, old.new_block_ids)
            given_back = old.num_new - chunks[i].num_new
        self._sharers.setdefault(best.seq_id, []).append((best_len, seq))
        return given_back

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        wants_lookahead: list[int] = []          # chunks that sample (draft_lookahead)
        scheduled: list[Sequence] = []
        preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending and seq.generation_done:       # its last token is still in flight
                i += 1
                continue
            n = seq.cut_at_commit(min(seq.num_scheduled_tokens - seq.num_computed, budget))
            samples = seq.num_computed + n == seq.num_scheduled_tokens
            drafts = self._drafts(seq, n, budget)
            n += len(drafts)
            new_blocks = self.cache.grow(seq.seq_id, seq.num_computed + n)
            while new_blocks is None:                       # pool short: preempt a sequence not yet scheduled
                victim = self._victim(i)
                self.running.remove(victim)
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
                new_blocks = self.cache.grow(seq.seq_id, seq.num_computed + n)
            if new_blocks is None:
                break
            if samples:
                wants_lookahead.append(len(chunks))
            chunks.append(ScheduledChunk(seq.seq_id, seq.num_computed, n, new_blocks, drafts))
            scheduled.append(seq)
            budget -= n
            i += 1

        new_seqs = []
        sharing = self.cache.prefix_caching and self.config.min_shared_prefix > 0
        planned = {c.seq_id: k for k, c in enumerate(chunks)}          # chunk index of each scheduled sequence
        prefilling: dict[tuple, list[Sequence]] = {}                   # by first tokens: prompts being prefilled
        if sharing and self.waiting:
            for seq in self.running:
                if seq.num_computed < seq.num_prompt_tokens - 1:
                    prefilling.setdefault(tuple(seq.token_ids[:_KEY]), []).append(seq)
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if seq.num_pending:                  # preempted with a token in flight: admit once it is read
                break
            hit = self._lookup(seq)
            if sharing:
                given_back = self._hold_for_shared_prefill(seq, hit, prefilling, planned, chunks)
                if given_back >= 0:
                    self.waiting.popleft()
                    budget += given_back
                    continue
            seq.num_computed = hit.length
            seq.commit_points = self._commit_points(seq, hit)
            n = seq.cut_at_commit(min(seq.num_tokens - hit.length, budget))
            held = self.cache.admit(seq.seq_id, hit.length + n, hit)
            if held is None:
                seq.num_computed, seq.commit_points = 0, []
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = hit.length
                if self.cache.prefix_caching:
                    self.prefix_queries_total += seq.num_tokens
                    self.prefix_hits_total += hit.length
            slot, blocks = held
            if hit.length + n == seq.num_tokens:
                wants_lookahead.append(len(chunks))
            new_seqs.append(seq.runner_data(slot, blocks))
            planned[seq.seq_id] = len(chunks)
            chunks.append(ScheduledChunk(seq.seq_id, hit.length, n, []))
            if sharing and seq.num_computed < seq.num_prompt_tokens - 1:
                prefilling.setdefault(tuple(seq.token_ids[:_KEY]), []).append(seq)
            scheduled.append(seq)
            budget -= n

        if self.config.draft_lookahead > 0:
            self._add_lookahead(chunks, wants_lookahead, scheduled)
        freed, self._freed = self._freed, []
        self._scheduled = scheduled
        state_copies, block_copies = self.cache.take_copies()
        return SchedulerOutput(new_seqs, chunks, freed, preempted, state_copies, block_copies)

    def _add_lookahead(self, chunks: list[ScheduledChunk], which: list[int], scheduled: list[Sequence]) -> None:
        """Blocks for the `draft_lookahead` positions after each sampling chunk (never past the tokens its
        sequence may hold), once every chunk has its own: only blocks the pool has free beyond one per running
        sequence (next step's growth), so they never cost an eviction, an admission or a preemption. Without
        them a draft row past the sequence's blocks stores nothing (spec/mtp.py): a slightly worse draft."""
        for k in which:
            c, seq = chunks[k], scheduled[k]
            want = min(c.num_computed + c.num_new + self.config.draft_lookahead, seq.max_num_tokens)
            missing = self.cache.blocks_for(want) - len(self.cache.block_ids(seq.seq_id))
            if missing <= 0:
                continue
            if missing > self.cache.num_free_blocks - len(self.running):
                return
            extra = self.cache.grow(seq.seq_id, want)
            if extra:
                chunks[k] = dataclasses.replace(c, new_block_ids=[*c.new_block_ids, *extra])

    @staticmethod
    def _drafts(seq: Sequence, n: int, budget: int) -> list[int]:
        """The drafts a decoding sequence verifies this step (consumed either way: they follow its last
        token only until it moves). None while its prompt is not done, a commit point lies ahead or a token
        is in flight; at most what the budget holds and one fewer than the tokens it may still emit."""
        drafts, seq.draft_token_ids = seq.draft_token_ids, []
        if not drafts or n != 1 or seq.num_pending or seq.commit_points or seq.num_computed != seq.num_tokens - 1:
            return []
        room = seq.max_num_tokens - seq.num_tokens - 1
        return drafts[: max(0, min(len(drafts), budget - 1, room))]

    def update(self, out: SchedulerOutput) -> list[Sequence]:
        """The step ran: the scheduled tokens are in the cache now (of a verify chunk, every position until
        `accept` takes the rejected drafts back). Returns the scheduled sequences in chunk order."""
        scheduled, self._scheduled = self._scheduled, []
        for seq, chunk in zip(scheduled, out.chunks):
            seq.num_computed += chunk.num_new
            if self.cache.prefix_caching:
                self._after_chunk(seq)
        return scheduled

    @staticmethod
    def accept(seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """A verify chunk was read: its rejected drafts are not in the cache (the state committed the
        accepted ones only)."""
        seq.num_computed -= num_drafts - num_accepted
