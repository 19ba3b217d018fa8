"""MTP speculative decoding through the engine on the embedded model (fp32, CPU): the output never changes
(greedy with MTP drafts == greedy without, token for token; seeded sampling likewise), the head's drafts
are accepted (stats), and the drafts the engine proposes are the MTP head's over the whole committed
sequence (spec/mtp.py; the oracle of tests/spec/test_mtp.py) wherever the head's K/V can be exact: after
a prompt split into chunks (prefix caching always splits off its last token), in a batch."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.batch import CacheBuffers
from deltaserve.config import ConfigError
from tests.spec.helpers import generate, greedy, mixed_prompts, pin_k, tokens
from tests.spec.test_mtp import _prefill, oracle_drafts, target_hidden

MTP = {"method": "mtp", "num_speculative_tokens": 4}


def mtp_llm(k: int = 4, **kw) -> LLM:
    llm = LLM(device="cpu", speculative_config={**MTP, "num_speculative_tokens": k}, **kw)
    pin_k(llm, k)
    return llm


class Recorder:
    """Wraps the engine's drafter: every proposal (the sequence's known tokens, its drafts) is kept."""

    def __init__(self, llm: LLM):
        self.speculation = llm.engine.runner.speculation
        self.inner = self.speculation.drafter
        self.name, self.uses_hidden = self.inner.name, self.inner.uses_hidden
        self.log: list[tuple[list[int], list[int]]] = []
        self.kv: list[tuple[list[int], torch.Tensor]] = []   # (known tokens, the head's K/V at positions 0..t)
        self.speculation.drafter = self

    def propose(self, ctx) -> torch.Tensor:
        out = self.inner.propose(ctx)
        if ctx.k <= 0:
            return out
        pool = ctx.cache.mtp_kv(self.inner.model.config, 0)            # [2, B, BS, NKV, HD]
        for i, (tokens, row) in enumerate(zip(ctx.token_ids, out.tolist(), strict=True)):
            self.log.append((list(tokens), row))
            t = len(tokens) - 1                                         # the emitted token's position
            table = ctx.batch.block_tables[ctx.batch_index[i]].long()
            bs = pool.shape[2]
            slots = torch.arange(t)
            self.kv.append((list(tokens), pool[:, table[slots // bs], slots % bs].clone()))
        return out

    def release(self, seq_ids):
        self.inner.release(seq_ids)

    def restore(self) -> None:
        self.speculation.drafter = self.inner


@pytest.fixture(scope="module")
def plain():
    return LLM(device="cpu", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def spec():
    return mtp_llm(4)


def test_drafts_after_a_chunked_prompt_are_the_heads_over_the_whole_sequence():
    """The prompt's chunks end inside the prompt (a small step budget, and prefix caching splitting off the
    last prompt token): the head's K/V at each chunk's last position takes the prompt token after it, so the
    first drafts after the prompt equal the head run over the whole sequence at once."""
    llm = mtp_llm(3, max_num_batched_tokens=16, enable_prefix_caching=True)
    rec = Recorder(llm)
    prompts = [p[:40] for p in mixed_prompts(3, seed=5, lo=20, hi=40)]
    for p in prompts:                             # one at a time: each prompt's chunks are steps of their own
        generate(llm, [p], greedy(2))
    rec.restore()
    firsts = [(toks, row) for toks, row in rec.log if any(toks[:-1] == p for p in prompts)]
    assert len(firsts) == len(prompts)
    for toks, row in firsts:
        assert row == oracle_drafts(llm.model, toks, 3), len(toks)
    for toks, kv in rec.kv:
        if any(toks[:-1] == p for p in prompts):
            want = oracle_kv(llm.model, toks)
            bad = [t for t in range(len(toks) - 1) if not torch.allclose(kv[:, t], want[:, t], atol=1e-4, rtol=1e-4)]
            assert not bad, f"the head's K/V differs at positions {bad} of {len(toks) - 1}"


@torch.inference_mode()
def oracle_kv(model, committed: list[int]) -> torch.Tensor:
    """The MTP head's K/V [2, t, NKV, HD] at positions 0..t-1 (t + 1 = len(committed)), written by one pass of
    the head over the whole sequence (contiguous cache)."""
    n = len(committed) - 1
    hidden = target_hidden(model, committed[:-1])
    cache = CacheBuffers.allocate(model.config, num_slots=1, num_blocks=-(-n // 16), block_size=16, device="cpu",
                                  dtype=torch.float32, num_attention_layers=1)
    model.mtp(model.embed_tokens[torch.tensor(committed[1:])], hidden, _prefill(n), cache.kv[0], model.rope)
    kv = cache.kv[0]                                                    # [2, B, 16, NKV, HD]
    return kv.reshape(2, -1, *kv.shape[3:])[:, :n]


def test_mtp_is_refused_with_an_fp8_kv_cache_and_tensor_parallelism():
    with pytest.raises(ConfigError, match="method 'mtp' with kv_cache_dtype='fp8'"):
        LLM(device="cpu", kv_cache_dtype="fp8", speculative_config=MTP)
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1"):
        LLM(device="cpu", tensor_parallel_size=2, speculative_config=MTP)


def test_seeded_sampling_is_unchanged(plain, spec):
    prompts = mixed_prompts(3, seed=7)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True, seed=123)
    want = tokens(generate(plain, prompts, params))
    assert tokens(generate(spec, prompts, params)) == want
