"""One forward step: a list of scheduled sequences -> packed ForwardBatch -> model -> sampled tokens.

The runner owns the model and the cache buffers; it knows nothing about request lifecycles. Each
SeqInput says which new tokens to feed, how many tokens of the sequence are already cached, where its
state lives (GDN slot, KV blocks), and what to return (a sampled token, prompt logprobs).
"""

from __future__ import annotations

import dataclasses

import torch

from ..batch import CacheBuffers, ForwardBatch
from ..models.qwen3_next import HybridForCausalLM
from ..outputs import PositionLogprobs
from .sampler import SampleResult, SamplingRow, sample, top_logprobs


@dataclasses.dataclass
class SeqInput:
    token_ids: list[int]                 # new tokens fed this step (a prompt chunk or the last sampled token)
    num_computed: int                    # tokens of this sequence already in the cache
    state_slot: int
    block_ids: list[int]                 # KV blocks covering positions [0, num_computed + len(token_ids))
    sampling: SamplingRow | None = None  # set: sample the next token after the last fed token
    prompt_logprobs: int | None = None   # set: logprobs (top-n) of each next prompt token in this chunk
    next_prompt_token_ids: list[int] | None = None  # targets for prompt logprobs: the tokens that follow each fed token


@dataclasses.dataclass
class SeqOutput:
    sampled: SampleResult | None
    prompt_logprobs: list[PositionLogprobs] | None


class ModelRunner:
    def __init__(self, model: HybridForCausalLM, cache: CacheBuffers, *, device: torch.device,
                 seed: int | None = None):
        self.model, self.cache, self.device = model, cache, torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def new_generator(self, seed: int) -> torch.Generator:
        """A per-request generator on the model's device."""
        return torch.Generator(device=self.device).manual_seed(seed)

    @staticmethod
    def is_decode(seq: SeqInput) -> bool:
        return len(seq.token_ids) == 1 and seq.num_computed > 0

    def build_batch(self, seqs: list[SeqInput]) -> ForwardBatch:
        """Pack sequences (prefills first, then decodes, in the given order within each group)."""
        bs = self.cache.block_size
        ids, pos, slots_map, cu = [], [], [], [0]
        max_blocks = max(len(s.block_ids) for s in seqs)
        tables = []
        for s in seqs:
            n = len(s.token_ids)
            ids.extend(s.token_ids)
            positions = range(s.num_computed, s.num_computed + n)
            pos.extend(positions)
            slots_map.extend(s.block_ids[p // bs] * bs + p % bs for p in positions)
            cu.append(cu[-1] + n)
            tables.append(s.block_ids + [0] * (max_blocks - len(s.block_ids)))
        num_prefills = sum(not self.is_decode(s) for s in seqs)
        as_tensor = lambda x, dt: torch.tensor(x, dtype=dt, device=self.device)  # noqa: E731
        return ForwardBatch(
            input_ids=as_tensor(ids, torch.long), positions=as_tensor(pos, torch.long),
            cu_seqlens=as_tensor(cu, torch.int32),
            seq_lens=as_tensor([s.num_computed + len(s.token_ids) for s in seqs], torch.int32),
            state_slots=as_tensor([s.state_slot for s in seqs], torch.int32),
            has_initial_state=as_tensor([s.num_computed > 0 for s in seqs], torch.bool),
            slot_mapping=as_tensor(slots_map, torch.long), block_tables=as_tensor(tables, torch.int32),
            num_prefills=num_prefills, num_prefill_tokens=cu[num_prefills],
        )

    @torch.inference_mode()
    def execute(self, seqs: list[SeqInput]) -> list[SeqOutput]:
        """Run one step; outputs come back in the order of `seqs`."""
        order = sorted(range(len(seqs)), key=lambda i: self.is_decode(seqs[i]))  # stable: prefills first
        packed = [seqs[i] for i in order]
        batch = self.build_batch(packed)
        hidden = self.model(batch, self.cache)
        bounds = batch.cu_seqlens.tolist()

        # Rows needing logits: the last token of sampling sequences, every token of prompt-logprob chunks.
        rows, sample_rows, prompt_rows = [], [], {}
        for k, s in enumerate(packed):
            if s.prompt_logprobs is not None and s.next_prompt_token_ids:
                start = len(rows)
                rows.extend(range(bounds[k], bounds[k] + len(s.next_prompt_token_ids)))
                prompt_rows[k] = start
            if s.sampling is not None:
                sample_rows.append((k, len(rows)))
                rows.append(bounds[k + 1] - 1)
        outputs: list[SeqOutput] = [SeqOutput(None, None) for _ in packed]
        if rows:
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]).float()
            sampled = sample(logits[[r for _, r in sample_rows]], [packed[k].sampling for k, _ in sample_rows],
                             self.generator) if sample_rows else []
            for (k, _), result in zip(sample_rows, sampled):
                outputs[k].sampled = result
            for k, start in prompt_rows.items():
                s = packed[k]
                lp = torch.log_softmax(logits[start : start + len(s.next_prompt_token_ids)], dim=-1)
                outputs[k].prompt_logprobs = [top_logprobs(lp[j], t, s.prompt_logprobs)
                                              for j, t in enumerate(s.next_prompt_token_ids)]
        result: list[SeqOutput] = [None] * len(seqs)  # type: ignore[list-item]
        for k, i in enumerate(order):
            result[i] = outputs[k]
        return result
