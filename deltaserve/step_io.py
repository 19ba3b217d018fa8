"""The plain data objects that cross from the engine (CPU bookkeeping) to the runner (device work) and
back: what to run this step (SchedulerOutput) and what came out (RunnerOutput). A leaf: the engine and the
runner both import it, it imports neither (nor torch), so it is also what a process boundary serialises.

The runner keeps a little state per sequence between steps (its tokens, where its cache lives, how to
sample it), sent once in `NewSequence` when the sequence joins the running batch and dropped when its
id appears in `freed_seq_ids`. Each step then only says how many tokens of each sequence to feed and
which blocks were added, so this object stays small whatever the context lengths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .outputs import PositionLogprobs
from .sampling_params import SamplingParams


@dataclasses.dataclass
class NewSequence:
    """A sequence joining the running batch (first admission, or again after preemption)."""

    seq_id: int
    token_ids: list[int]             # prompt + tokens generated so far; computed from its first chunk's
                                     # num_computed on (> 0: resumed from the prefix cache)
    num_prompt_tokens: int
    params: SamplingParams
    seed: int | None                 # the sequence's own sampling seed; None: the runner's shared generator
    stop_token_ids: frozenset[int]   # EOS + stop_token_ids: suppressed while fewer than min_tokens generated
    prompt_logprobs: int | None      # return top-n prompt logprobs while prefilling the prompt; None: don't
    state_slot: int
    block_ids: list[int]


@dataclasses.dataclass
class ScheduledChunk:
    """Feed tokens [num_computed, num_computed + num_new) of a sequence. When that reaches the end of its
    known tokens the runner samples the next one."""

    seq_id: int
    num_computed: int                # tokens of the sequence already in the cache
    num_new: int
    new_block_ids: list[int]         # blocks appended to the sequence's block table this step
    # speculative decoding: a verify chunk feeds the sequence's last known token and these drafts
    # (num_new = 1 + len(draft_token_ids)); the runner samples up to num_new tokens for it
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class GrammarMasks:
    """Token bitmasks of the step's constrained sequences (structured/manager.py), maybe still being filled
    on a host thread: `get()` waits and returns an int32 host tensor [len(seq_ids), ceil(vocab / 32)], row i
    for seq_ids[i] (bit t set: token t allowed). The runner calls it only after queueing the forward."""

    seq_ids: list[int]
    get: Callable[[], Any]


@dataclasses.dataclass
class SchedulerOutput:
    new_seqs: list[NewSequence]
    chunks: list[ScheduledChunk]     # in scheduling order; the runner packs prefills before decodes
    freed_seq_ids: list[int]         # forget these first: finished, aborted or preempted since the last step
    num_preempted: int = 0           # sequences preempted while scheduling this step
    # Cache copies applied before the forward, in order (prefix cache: slot -> snapshot saves, snapshot ->
    # slot restores, copy-on-write of a cached partly filled block into a sequence's fresh block):
    state_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)   # (src slot, dst slot)
    block_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)   # (src block, dst block)
    grammar: GrammarMasks | None = None  # masks of the constrained sequences sampling this step (the engine's)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclasses.dataclass
class RunnerOutput:
    seq_ids: list[int]                                   # sequences that sampled a token, packed order
    token_ids: list[int]                                 # the sampled tokens, aligned with seq_ids
    logprobs: list[PositionLogprobs | None]              # per sampled token (None where not asked for)
    prompt_logprobs: dict[int, list[PositionLogprobs]] = dataclasses.field(default_factory=dict)
    # seq id -> logprobs of the prompt tokens following each position fed this step (prompt chunks only)
    # Speculative decoding. seq id -> the drafts a verify chunk accepted, which come before its entry in
    # token_ids (the token after them), and their logprobs (None where not asked for):
    accepted_token_ids: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    accepted_logprobs: dict[int, list[PositionLogprobs | None]] = dataclasses.field(default_factory=dict)
    num_drafts_verified: dict[int, int] = dataclasses.field(default_factory=dict)   # seq id -> drafts it verified
    # seq id -> drafts proposed for its next step (the scheduler feeds them as a verify chunk)
    draft_token_ids: dict[int, list[int]] = dataclasses.field(default_factory=dict)
