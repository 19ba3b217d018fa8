"""The drafter interface (runner side, torch) and the n-gram drafter.

A drafter proposes up to k draft tokens per sequence for the next step. The runner calls `propose` once
per step that ran a forward, after the step's tokens were verified / sampled and read on the host (so
`token_ids` already hold the step's accepted tokens and its bonus token) and while the step's device
tensors (`hidden`, `batch`) are still valid. It is called even when no sequence drafts (k == 0 or
seq_ids empty): a drafter with its own cache (MTP: the paged KV of its attention layer) sees every
step's rows, prefill chunks included, and can keep that cache in step with the target's.

`make_drafter` is the one place a `speculative_config` method becomes a drafter (`AVAILABLE_METHODS`
says which ones this build has; the engine refuses the others at start-up, before loading weights).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from ..batch import CacheBuffers, ForwardBatch
from ..config import ConfigError
from .config import SpeculativeConfig
from .mtp import MTPDrafter
from .ngram import NgramIndex


@dataclasses.dataclass
class DraftContext:
    """What a drafter may read for one step. Per-sequence fields are aligned with `seq_ids`, the sequences
    that draft for the next step (those that sampled a token this step and speculate), in packed order.

      seq_ids      ids of the drafting sequences
      k            drafts wanted per sequence (the same k for all; 0: nothing to propose)
      token_ids    per sequence its known tokens (host lists: prompt + accepted generated tokens, this
                   step's emitted tokens included); read-only
      batch        the step's ForwardBatch (every packed row: prefill chunks, verify chunks, plain
                   decodes; built for graph-replayed steps too); None when `uses_hidden` is False
      hidden       the target's post-final-norm hidden states [T, H] of the step's packed rows (None for
                   a drafter whose `uses_hidden` is False)
      batch_index  per sequence its index among the batch's sequences (rows cu_seqlens[i]:cu_seqlens[i+1])
      last_rows    device int64 [N]: per sequence the packed row of its last accepted position (the row
                   whose logits gave the emitted token); None when `uses_hidden` is False
      next_tokens  device int64 [T]: per packed row the token that follows it (the next input token of a
                   prompt row, the accepted draft or the emitted token of a verify / decode row; rows past
                   a rejection hold -1); None when `uses_hidden` is False
      num_accepted device int64 [N]: drafts accepted this step per sequence (0 for a plain decode or the
                   first token after a prefill); None when `uses_hidden` is False
      cache        the target's CacheBuffers
      kv_capacity  device int64 [N] (or None): per sequence the token positions its blocks hold, lookahead
                   blocks for the draft rows included (set for a drafter whose `uses_hidden` is True)
      block_tables device int32 [N, >= max blocks] (or None): those blocks, per sequence
    """

    seq_ids: list[int]
    k: int
    token_ids: list[list[int]]
    batch: ForwardBatch | None
    hidden: torch.Tensor | None
    batch_index: list[int]
    last_rows: torch.Tensor | None
    next_tokens: torch.Tensor | None
    num_accepted: torch.Tensor | None
    cache: CacheBuffers
    kv_capacity: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None


class Drafter(Protocol):
    """Proposes draft tokens (runner side). `propose` returns an int64 tensor [N, k] (on the device, or on
    the CPU for a host drafter), N = len(ctx.seq_ids); -1 marks "no draft" and must only follow real drafts in a row (a row's drafts
    are its leading non-negative entries). uses_hidden: the drafter reads ctx.hidden / batch /
    next_tokens (the runner then keeps them until the step is read, and the engine never launches a
    step before the previous one's drafts are proposed)."""

    name: str
    uses_hidden: bool

    def propose(self, ctx: DraftContext) -> torch.Tensor: ...

    def release(self, seq_ids: list[int]) -> None:
        """Forget these sequences (finished, aborted or preempted: they come back as new sequences)."""
        ...


class NgramDrafter:
    """Prompt lookup (method "ngram") over each sequence's own tokens, on the host: one NgramIndex per
    sequence, synced with the tokens the runner knows (sequences only grow while they live). Its drafts
    stay on the CPU (the runner reads them there)."""

    name = "ngram"
    uses_hidden = False

    def __init__(self, min_n: int, max_n: int, device: torch.device | str = "cpu"):
        self.min_n, self.max_n = min_n, max_n
        self.device = torch.device(device)
        self._index: dict[int, NgramIndex] = {}

    def propose(self, ctx: DraftContext) -> torch.Tensor:
        out = torch.full((len(ctx.seq_ids), max(ctx.k, 0)), -1, dtype=torch.long)
        if ctx.k <= 0:
            return out.to(self.device)
        for i, (seq_id, tokens) in enumerate(zip(ctx.seq_ids, ctx.token_ids, strict=True)):
            index = self._index.get(seq_id)
            if index is None:
                index = self._index[seq_id] = NgramIndex(self.min_n, self.max_n)
            index.sync(tokens)
            drafts = index.propose(ctx.k)
            if drafts:
                out[i, : len(drafts)] = torch.tensor(drafts, dtype=torch.long)
        return out.to(self.device)

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._index.pop(seq_id, None)


# methods of spec/config.py METHODS that have a drafter in this build
AVAILABLE_METHODS = ("mtp", "ngram")


def check_available(config: SpeculativeConfig) -> None:
    if config.method not in AVAILABLE_METHODS:
        raise ConfigError(f"speculative_config: method {config.method!r} is not implemented yet in this build "
                          f"(available: {', '.join(AVAILABLE_METHODS)})")


def make_drafter(config: SpeculativeConfig, model, cache: CacheBuffers, device: torch.device | str) -> Drafter:
    """The drafter of `config.method` (model: the target HybridForCausalLM; its MTP head, embedding and
    lm_head are what an MTP drafter shares)."""
    check_available(config)
    if config.method == "ngram":
        return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "mtp":
        return MTPDrafter(model, cache, device)
    raise ConfigError(f"speculative_config: method {config.method!r} has no drafter")
