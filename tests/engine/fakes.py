"""A fake model runner with real cache semantics, for testing the scheduler and the engine without a model.

It keeps a "state" per GDN slot (a hash chain of every token fed to it) and a paged "KV cache" (the token
written at each block position), and before every chunk it checks that the sequence's slot and blocks
hold exactly that sequence's computed tokens. A scheduler or cache bug (a shared or stale block, a slot
reused without a reset, a chunk starting at the wrong position) therefore raises instead of passing
silently. The next token is a function of the whole token history, like a real model's.
"""

from __future__ import annotations

import dataclasses

from deltaserve.config import ModelConfig
from deltaserve.step_io import RunnerOutput, SchedulerOutput

VOCAB = 97


def tiny_model_config(vocab_size: int = VOCAB, eos_token_id: int | None = None, max_len: int = 4096) -> ModelConfig:
    return ModelConfig.from_dict(dict(
        model_type="qwen3_next", vocab_size=vocab_size, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, intermediate_size=96, num_experts=0,
        full_attention_interval=2, max_position_embeddings=max_len, eos_token_id=eos_token_id))


def next_token(history: list[int], vocab: int = VOCAB) -> int:
    """What the fake model predicts after `history`."""
    h = 17
    for t in history:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return h % vocab


@dataclasses.dataclass
class _Seq:
    tokens: list[int]
    slot: int
    blocks: list[int]
    computed: int = 0


class FakeRunner:
    def __init__(self, block_size: int, vocab: int = VOCAB):
        self.block_size = block_size
        self.vocab = vocab
        self.seqs: dict[int, _Seq] = {}
        self.slot_state: dict[int, tuple[int, ...]] = {}   # slot -> tokens fed so far
        self.kv: dict[int, int] = {}                        # flat kv position -> token
        self.steps: list[SchedulerOutput] = []
        self.fail_on: set[int] = set()

    # the async-scheduling interface: the fake "device" computes at launch, the host reads at collect
    def launch(self, out: SchedulerOutput) -> "_Handle":
        return _Handle(self.execute(out))

    def collect(self, handle: "_Handle") -> RunnerOutput:
        assert not handle.collected, "a step collected twice"
        handle.collected = True
        return handle.result

    def can_launch_ahead(self, out: SchedulerOutput) -> bool:
        return not self.needs_sync

    needs_sync = False

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.steps.append(out)
        for sid in out.freed_seq_ids:
            self.seqs.pop(sid)
        for new in out.new_seqs:
            assert new.seq_id not in self.seqs, f"seq {new.seq_id} added twice"
            self.seqs[new.seq_id] = _Seq(list(new.token_ids), new.state_slot, list(new.block_ids))
        live_slots = [s.slot for s in self.seqs.values()]
        assert len(set(live_slots)) == len(live_slots), "two live sequences share a state slot"
        live_blocks = [b for s in self.seqs.values() for b in s.blocks]
        assert len(set(live_blocks)) == len(live_blocks), "two live sequences share a KV block"
        ids, toks = [], []
        seen = set()
        for chunk in out.chunks:
            assert chunk.seq_id not in seen, "a sequence scheduled twice in one step"
            seen.add(chunk.seq_id)
            s = self.seqs[chunk.seq_id]
            s.blocks.extend(chunk.new_block_ids)
            assert chunk.num_computed == s.computed, "chunk does not start where the cache ends"
            assert chunk.num_new >= 1
            end = chunk.num_computed + chunk.num_new
            assert end <= len(s.tokens), "chunk runs past the known tokens"
            assert len(s.blocks) * self.block_size >= end, "blocks do not cover the chunk"
            # the cache must hold exactly this sequence's computed tokens
            if s.computed:
                assert self.slot_state[s.slot] == tuple(s.tokens[: s.computed]), "stale or foreign GDN state"
            for p in range(s.computed):
                assert self.kv[self._flat(s, p)] == s.tokens[p], "KV block overwritten"
            state = list(self.slot_state[s.slot]) if s.computed else []
            for p in range(chunk.num_computed, end):
                self.kv[self._flat(s, p)] = s.tokens[p]
                state.append(s.tokens[p])
            self.slot_state[s.slot] = tuple(state)
            s.computed = end
            if end == len(s.tokens):
                tok = next_token(s.tokens, self.vocab)
                s.tokens.append(tok)
                ids.append(chunk.seq_id)
                toks.append(tok)
        return RunnerOutput(ids, toks, [None] * len(ids))

    def _flat(self, s: _Seq, p: int) -> int:
        return s.blocks[p // self.block_size] * self.block_size + p % self.block_size


@dataclasses.dataclass
class _Handle:
    result: RunnerOutput
    collected: bool = False

    @property
    def seq_ids(self) -> list[int]:
        return self.result.seq_ids


def reference_tokens(prompt: list[int], n: int, vocab: int = VOCAB) -> list[int]:
    """The fake model's greedy continuation of `prompt`, computed directly."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq, vocab))
    return seq[len(prompt):]
