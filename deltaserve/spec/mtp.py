"""The MTP drafter (method "mtp", runner side, torch): the checkpoint's MTP head drafts k tokens a step.

Per step (model_spec.md §7, wave2.md §2.1), after the target's tokens were verified:
1. First pass, over every packed row of the step (prefill chunks, plain decodes, verify rows): row r at
   position t takes the embedding of the token after it (`next_tokens[r]`; a -1 past a rejection is read
   as any token, since those rows are rewritten later) and the target's post-final-norm hidden state at
   t, as the head was trained; its attention layer writes its K/V at the target's slot for t, in its own
   KV layer of the pool (`CacheBuffers.mtp_kv`: the target's block tables and slot mappings address it).
   The head's output at each drafting sequence's last accepted row gives draft 1 (greedy).
2. Draft steps 2..k: one row per drafting sequence at position t + j - 1, from the previous draft's
   embedding and the head's own output (after mtp.norm) of the step before; greedy argmax over the shared
   lm_head each time.

Why stale K/V is harmless: a row's K/V depends only on tokens and hidden states at positions <= its own,
and a position past the accepted prefix (rows after a rejection, the draft steps' rows) is rewritten by
the first pass of the step that verifies it (the target recomputes every position after the accepted
prefix, and the first pass covers all of the target's rows) before any query at or after that position
attends to it; queries attend to positions <= their own only.

What the runner gives (runner/speculation.py): the token after every row, including the last row of a prompt
chunk that is not the prompt's last (the prompt token at the chunk's end, from the host at packing; a wrong
one there would leave that position's K/V wrong for good: worse drafts, never wrong output).

Where draft steps write: only into blocks the sequence holds. The runner passes `kv_capacity` / `block_tables`
(the sequence's blocks, the scheduler's lookahead blocks for the K - 1 positions after a sampling chunk
included, when the pool had them free); without them, what this step's rows guarantee: its context rounded
up to whole blocks. A draft row past the capacity stores nothing (slot -1) and attends to the positions below
it only: a slightly worse draft, never another sequence's block.

After a prefix-cache hit of length L, the K/V at L - 1 is what the writer of that block stored: exact when its
token at L is this sequence's (a resent prompt, the next turn of a conversation, n > 1, a readmitted preempted
sequence), another branch's when the hit ends where two prompts diverge. Rewriting it would need the target's
hidden state at L - 1, which a hit does not compute; the drafts that attend to it may be slightly worse.

Nothing here reads the device on the host: positions, slots and lengths of the draft rows are computed
on the device from the step's batch.

Not yet: CUDA graphs for the draft steps (shapes are static per (N, k), so they can be captured); an MTP
head of more than one layer (no released checkpoint has one; refused by name); sampled (non-greedy)
drafts (the drafts are one-hot, which spec/rejection.py's coupled rule takes for sampled rows too).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ..batch import CacheBuffers, ForwardBatch
from ..ops.quant.fp8 import FP8_DTYPE
from ..runner.sampler import to_device

if TYPE_CHECKING:
    from ..models.qwen3_next import HybridForCausalLM
    from .drafter import DraftContext

logger = logging.getLogger(__name__)


class MTPDrafter:
    """The checkpoint's MTP head as a drafter (the Drafter protocol of spec/drafter.py). It keeps no
    per-sequence state of its own: its K/V live in the pool's MTP layer, under the sequence's blocks."""

    name = "mtp"
    uses_hidden = True     # reads the step's hidden states, batch and next tokens (spec/drafter.py)

    def __init__(self, model: HybridForCausalLM, cache: CacheBuffers, device: torch.device | str):
        config = model.config
        if model.mtp is None:
            raise ValueError("speculative_config: method 'mtp' needs a checkpoint with an MTP head, and this model "
                             "has none (mtp_num_hidden_layers / num_nextn_predict_layers is 0)")
        n_layers = len(model.mtp.layers)
        if n_layers != 1:
            raise ValueError(f"speculative_config: method 'mtp' with {n_layers} MTP layers "
                             "(mtp_num_hidden_layers / num_nextn_predict_layers) is not implemented: only 1")
        expected = len(config.attention_layer_ids) + n_layers
        if cache.kv.shape[0] != expected:
            raise ValueError(f"the KV pool has {cache.kv.shape[0]} layers, the MTP drafter needs {expected} (the "
                             f"model's {len(config.attention_layer_ids)} + {n_layers} MTP): allocate it with "
                             f"mtp_kv_layers={n_layers}")
        attn = model.mtp.layers[0].self_attn
        if cache.kv.dtype == FP8_DTYPE and bool(torch.isnan(attn.kv_scale).any()):
            raise ValueError("speculative_config: method 'mtp' with kv_cache_dtype='fp8' is not implemented (the "
                             "MTP head's KV multipliers are not calibrated); use kv_cache_dtype='auto'")
        self.model, self.cache, self.device = model, cache, torch.device(device)
        self._warned_no_hidden = False

    # ---- the Drafter protocol ------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> torch.Tensor:
        """Drafts [len(ctx.seq_ids), ctx.k] (device int64). Runs the first pass over the step's rows even
        when nothing drafts (k == 0 or no sequence), so the head's K/V follow every prompt and token."""
        n, k = len(ctx.seq_ids), max(ctx.k, 0)
        if ctx.batch is None or ctx.hidden is None or ctx.next_tokens is None:
            if not self._warned_no_hidden:
                logger.warning("MTP drafter: a step ran without exposing its hidden states; no drafts for it (its "
                               "positions keep stale MTP K/V: later drafts may be worse, outputs are unchanged)")
                self._warned_no_hidden = True
            return torch.full((n, k), -1, dtype=torch.long, device=self.device)
        seq_index = to_device(torch.tensor(ctx.batch_index, dtype=torch.long), self.device)
        # optional context fields (a scheduler that allocates lookahead blocks for the draft rows says so)
        return self.draft(ctx.hidden, ctx.batch, ctx.next_tokens, ctx.last_rows, seq_index, k,
                          kv_capacity=getattr(ctx, "kv_capacity", None), block_tables=getattr(ctx, "block_tables", None))

    def release(self, seq_ids: list[int]) -> None:
        """Nothing to forget: the head's K/V go with the sequence's blocks."""

    # ---- the drafting itself ---------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, hidden: torch.Tensor, batch: ForwardBatch, next_tokens: torch.Tensor, last_rows: torch.Tensor,
              seq_index: torch.Tensor, k: int, *, kv_capacity: torch.Tensor | None = None,
              block_tables: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [T, H]: the target's post-final-norm hidden states of the batch's rows; next_tokens [T]: the
        token after each row; last_rows [N]: each drafting sequence's last accepted row; seq_index [N]: its
        index among the batch's sequences. kv_capacity [N] (optional): the token positions its blocks hold,
        with block_tables [N, >= ceil(capacity / block_size)] (optional) listing them; default: the batch's
        context rounded up to whole blocks, the batch's tables. Returns the drafts [N, k] int64."""
        model = self.model
        rows = (hidden.shape[0], next_tokens.shape[0], batch.positions.shape[0])
        if len(set(rows)) != 1:
            raise ValueError(f"MTP drafter: hidden states, next tokens and the batch's rows differ in count: {rows}")
        # first pass: every row's K/V (a padded row's token, if negative, is any valid id: it stores nothing), the
        # head's output at the drafting rows only (their attention as one-row queries: draft step 0's rows)
        n = last_rows.shape[0]
        ids = next_tokens.clamp_min(0)
        if n == 0:
            model.mtp_forward(ids, hidden, batch, self.cache)
            return torch.empty((0, k), dtype=torch.long, device=hidden.device)
        draft_rows = _DraftRows(batch, last_rows, seq_index, self.cache.block_size, kv_capacity, block_tables)
        h = model.mtp_forward(ids, hidden, batch, self.cache, out_rows=last_rows, queries=draft_rows.step(0))
        if k == 0:
            return torch.empty((n, 0), dtype=torch.long, device=hidden.device)
        token = model.compute_logits(h).argmax(dim=-1)
        drafts = [token]
        for j in range(1, k):
            h = model.mtp_forward(token, h, draft_rows.step(j), self.cache, step=j)
            token = model.compute_logits(h).argmax(dim=-1)
            drafts.append(token)
        return torch.stack(drafts, dim=1)


class _DraftRows:
    """The one-row-per-sequence batches of the draft steps, on the device: step j's row of a sequence whose
    last accepted position is t sits at t + j, attends to positions <= t + j, and stores its K/V there
    when the sequence's blocks hold that position (else nothing, and it attends to those below its capacity).
    Step 0 is the first pass's drafting rows as queries (their K/V stored by the first pass itself)."""

    def __init__(self, batch: ForwardBatch, last_rows: torch.Tensor, seq_index: torch.Tensor, block_size: int,
                 kv_capacity: torch.Tensor | None, block_tables: torch.Tensor | None):
        device = last_rows.device
        n = last_rows.shape[0]
        self.base = batch.positions.index_select(0, last_rows)
        if kv_capacity is None:       # every block this step touched is whole: round its context up
            ctx = batch.seq_lens.index_select(0, seq_index).long()
            kv_capacity = (ctx + block_size - 1) // block_size * block_size
        self.capacity = kv_capacity.long()
        self.tables = batch.block_tables.index_select(0, seq_index) if block_tables is None else block_tables
        self.block_size = block_size
        self.state_slots = batch.state_slots.index_select(0, seq_index)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.has_initial_state = torch.ones(n, dtype=torch.bool, device=device)

    def step(self, j: int) -> ForwardBatch:
        pos = self.base + j
        bs, width = self.block_size, self.tables.shape[1]
        writable = pos < self.capacity
        col = (pos // bs).clamp(max=max(width - 1, 0))
        block = self.tables.gather(1, col[:, None]).squeeze(1).long()
        slots = torch.where(writable, block * bs + pos % bs, -1)
        seq_lens = torch.minimum(pos + 1, self.capacity).to(torch.int32)
        return ForwardBatch(
            input_ids=torch.zeros_like(pos), positions=pos, cu_seqlens=self.cu_seqlens, seq_lens=seq_lens,
            state_slots=self.state_slots, has_initial_state=self.has_initial_state, slot_mapping=slots,
            block_tables=self.tables, num_prefills=0, num_prefill_tokens=0, decode_state_slots=self.state_slots)
