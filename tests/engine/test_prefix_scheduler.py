"""Prefix caching against a fake runner that checks the cache exactly: before every chunk the sequence's
state slot must hold the state of exactly its computed tokens and its blocks their KV, so a hit that
resumes from a wrong snapshot, a shared block written over, or a copy applied in the wrong order fails.
Outputs must equal the fake model's reference (= cache off) in every scenario, and every block, slot and
snapshot must be accounted for after every step (`check_integrity`)."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaserve.cache.manager import HybridCacheManager
from deltaserve.cache.plan import CachePlan
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.sampling_params import SamplingParams
from deltaserve.step_io import RunnerOutput, SchedulerOutput

from .fakes import VOCAB, next_token, reference_tokens, tiny_model_config
from .test_scheduler import greedy, run_all


class CopyingFakeRunner:
    """FakeRunner's checks, plus the prefix cache's device side: state and block copies, shared blocks."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.seqs: dict[int, dict] = {}
        self.slot_state: dict[int, tuple[int, ...]] = {}
        self.kv: dict[int, int] = {}
        self.steps: list[SchedulerOutput] = []

    def launch(self, out):
        return _Handle(self.execute(out))

    def collect(self, handle):
        return handle.result

    def can_launch_ahead(self, out) -> bool:
        return True

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.steps.append(out)
        bs = self.block_size
        for sid in out.freed_seq_ids:
            self.seqs.pop(sid)
        for src, dst in out.state_copies:
            assert src in self.slot_state, f"copy from slot {src}, which was never written"
            self.slot_state[dst] = self.slot_state[src]
        reads = [[self.kv.get(src * bs + o) for o in range(bs)] for src, _ in out.block_copies]
        assert len({d for _, d in out.block_copies}) == len(out.block_copies)
        for (_, dst), values in zip(out.block_copies, reads):
            for o, v in enumerate(values):
                if v is not None:
                    self.kv[dst * bs + o] = v
        for new in out.new_seqs:
            self.seqs[new.seq_id] = {"tokens": list(new.token_ids), "slot": new.state_slot,
                                     "blocks": list(new.block_ids), "computed": None}
        ids, toks = [], []
        for chunk in out.chunks:
            s = self.seqs[chunk.seq_id]
            s["blocks"].extend(chunk.new_block_ids)
            if s["computed"] is None:
                s["computed"] = chunk.num_computed
            assert chunk.num_computed == s["computed"]
            computed, end, tokens = s["computed"], chunk.num_computed + chunk.num_new, s["tokens"]
            assert end <= len(tokens) and len(s["blocks"]) * bs >= end
            if computed:
                assert self.slot_state.get(s["slot"]) == tuple(tokens[:computed]), "resumed from a wrong state"
            for p in range(computed):
                assert self.kv.get(self._flat(s, p)) == tokens[p], f"KV at {p} wrong or overwritten"
            written = {s["blocks"][p // bs] for p in range(computed, end)}
            for other_id, other in self.seqs.items():
                if other_id != chunk.seq_id:
                    assert not written & set(other["blocks"]), "a chunk writes a block another sequence holds"
            state = list(tokens[:computed])
            for p in range(computed, end):
                self.kv[self._flat(s, p)] = tokens[p]
                state.append(tokens[p])
            self.slot_state[s["slot"]] = tuple(state)
            s["computed"] = end
            if end == len(tokens):
                tok = next_token(tokens)
                tokens.append(tok)
                ids.append(chunk.seq_id)
                toks.append(tok)
        return RunnerOutput(ids, toks, [None] * len(ids))

    def _flat(self, s, p: int) -> int:
        return s["blocks"][p // self.block_size] * self.block_size + p % self.block_size


class _Handle:
    def __init__(self, result):
        self.result = result
        self.seq_ids = result.seq_ids


def prefix_engine(*, num_blocks=512, block_size=16, num_slots=8, snapshots=32, budget=4096, max_model_len=4096,
                  eos=None, async_scheduling=False, interval=0) -> LLMEngine:
    plan = CachePlan(num_slots=num_slots + snapshots, num_blocks=num_blocks, max_num_seqs=num_slots,
                     max_model_len=max_model_len, budget_bytes=0, used_bytes=0, num_snapshot_slots=snapshots)
    cache = HybridCacheManager(num_blocks=num_blocks, block_size=block_size, num_slots=num_slots,
                               num_snapshot_slots=snapshots, enable_prefix_caching=True)
    return LLMEngine(model_config=tiny_model_config(eos_token_id=eos, max_len=max_model_len), tokenizer=None,
                     runner=CopyingFakeRunner(block_size), cache=cache, plan=plan,
                     config=EngineConfig(max_num_seqs=num_slots, max_num_batched_tokens=budget, block_size=block_size,
                                         async_scheduling=async_scheduling, prefix_cache_checkpoint_interval=interval))


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def run_one(engine, rid, prompt, max_tokens=5, **kw):
    engine.add_request(rid, prompt, greedy(max_tokens, **kw))
    out = run_all(engine)[rid]
    assert [c.token_ids for c in out.outputs] == [reference_tokens(prompt, max_tokens)] * len(out.outputs)
    return out


def assert_idle(engine):
    engine.cache.check_integrity()
    stats = engine.get_stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0 and stats.num_waiting == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_identical_prompt_resent_hits_all_but_its_last_token(async_scheduling):
    engine = prefix_engine(async_scheduling=async_scheduling)
    prompt = ids(37, 1)
    assert run_one(engine, "a", prompt).num_cached_tokens == 0
    out = run_one(engine, "b", prompt)
    assert out.num_cached_tokens == 36
    first_b = [c for s in engine.runner.steps for c in s.chunks if c.num_computed == 36 and c.num_new == 1]
    assert first_b, "the resent prompt recomputes only its last token"
    stats = engine.get_stats()
    assert stats.prefix_cache_queries_total == 74 and stats.prefix_cache_hits_total == 36
    assert_idle(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_shared_prefix_then_long_distinct_suffixes_hit_the_branch_point(async_scheduling):
    """A 101-token prefix (not a block multiple) and suffixes of 40, 376 and 1296 tokens: the second request
    finds the branch point and saves it, every later one hits it exactly."""
    engine = prefix_engine(async_scheduling=async_scheduling, budget=256)
    prefix = ids(101, 2)
    hits = [run_one(engine, f"r{i}", prefix + ids(n, 10 + i)).num_cached_tokens
            for i, n in enumerate([40, 376, 1296, 40])]
    assert hits[0] == 0 and hits[2] == 101 and hits[3] == 101
    assert_idle(engine)


def test_second_conversation_turn_hits_the_first_turns_prompt_and_answer():
    engine = prefix_engine()
    turn1 = ids(50, 3)
    out = run_one(engine, "t1", turn1, max_tokens=8)
    turn2 = turn1 + out.outputs[0].token_ids + ids(20, 4)
    assert run_one(engine, "t2", turn2).num_cached_tokens == 50 + 8 - 1   # the last answer token was never fed
    assert_idle(engine)


def test_a_branch_inside_an_earlier_prompt():
    engine = prefix_engine()
    long = ids(200, 5)
    run_one(engine, "a", long)
    assert run_one(engine, "b", long[:150] + ids(30, 6)).num_cached_tokens == 0      # finds and saves 150
    assert run_one(engine, "c", long[:150] + ids(30, 7)).num_cached_tokens == 150
    assert run_one(engine, "d", long[:170]).num_cached_tokens == 150                 # deepest state on its path
    assert_idle(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_eviction_under_memory_pressure_keeps_outputs_exact(async_scheduling):
    engine = prefix_engine(num_blocks=40, snapshots=3, budget=64, async_scheduling=async_scheduling)
    prefixes = [ids(60, 20 + i) for i in range(3)]
    rng = random.Random(0)
    prompts = [rng.choice(prefixes)[: rng.randint(20, 60)] + ids(rng.randint(1, 60), 100 + i) for i in range(30)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(6))
    finals = run_all(engine)
    for i, p in enumerate(prompts):
        assert finals[f"r{i}"].outputs[0].token_ids == reference_tokens(p, 6)
    stats = engine.get_stats()
    assert stats.prefix_cache_snapshot_evictions_total > 0 and stats.prefix_cache_hits_total > 0
    assert_idle(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preempted_sequences_resume_from_what_they_computed(async_scheduling):
    engine = prefix_engine(num_blocks=14, block_size=4, snapshots=8, budget=32, async_scheduling=async_scheduling)
    prompts = [ids(random.Random(i).randint(3, 20), 200 + i) for i in range(10)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(30))
    finals = run_all(engine)
    assert engine.get_stats().num_preempted_total > 0
    for i, p in enumerate(prompts):
        assert finals[f"r{i}"].outputs[0].token_ids == reference_tokens(p, 30)
    resumed = [c for s in engine.runner.steps for n in s.new_seqs for c in s.chunks
               if c.seq_id == n.seq_id and c.num_computed > 0]
    assert resumed, "no readmitted sequence resumed from the cache"
    assert_idle(engine)


def test_n4_children_resume_from_the_prompt_instead_of_prefilling_it():
    engine = prefix_engine()
    prompt = ids(90, 8)
    out = run_one(engine, "n4", prompt, max_tokens=4, n=4)
    assert len(out.outputs) == 4
    firsts = [c for s in engine.runner.steps for n in s.new_seqs for c in s.chunks if c.seq_id == n.seq_id]
    assert sorted(c.num_computed for c in firsts) == [0, 89, 89, 89]
    assert engine.get_stats().num_batched_tokens_total == 90 + 3 * 1 + 4 * 3
    assert_idle(engine)


def test_abort_of_a_request_whose_children_wait_for_its_prompt():
    engine = prefix_engine(budget=16)
    engine.add_request("a", ids(90, 9), greedy(4, n=3))
    engine.step()
    assert engine.get_stats().num_waiting == 2
    engine.abort_request("a")
    outs = engine.step()
    assert outs[0].finished and [c.finish_reason for c in outs[0].outputs] == ["abort"] * 3
    assert not engine.has_unfinished_requests()
    assert_idle(engine)


def test_hits_and_misses_are_admitted_in_one_step():
    engine = prefix_engine()
    shared = ids(64, 11)
    run_one(engine, "warm", shared + [1, 2, 3])
    prompts = [shared + [1, 2, 3], ids(40, 12), shared + [1, 2, 3, 4, 5], ids(33, 13)]
    for i, p in enumerate(prompts):
        engine.add_request(f"m{i}", p, greedy(5))
    step_no = len(engine.runner.steps)
    finals = run_all(engine)
    first = engine.runner.steps[step_no]
    assert sorted(c.num_computed for c in first.chunks) == [0, 0, 66, 66]
    for i, p in enumerate(prompts):
        assert finals[f"m{i}"].outputs[0].token_ids == reference_tokens(p, 5)
    assert [finals[f"m{i}"].num_cached_tokens for i in range(4)] == [66, 0, 66, 0]
    assert_idle(engine)


def share_from(engine, least: int) -> None:
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, min_shared_prefix=least)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_burst_over_a_new_shared_prefix_prefills_it_once(async_scheduling):
    engine = prefix_engine(async_scheduling=async_scheduling)
    share_from(engine, 32)
    shared = ids(100, 21)
    prompts = [shared + [i] + ids(10 + 7 * i, 30 + i) for i in range(4)]
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, greedy(5))
    step_no = len(engine.runner.steps)
    finals = run_all(engine)
    first, second = engine.runner.steps[step_no : step_no + 2]
    # the first prompt's chunk stops where the others diverge from it; they wait for that state, then hit it
    assert [(c.num_computed, c.num_new) for c in first.chunks] == [(0, 100)]
    assert sorted(c.num_computed for c in second.chunks) == [100, 100, 100, 100]
    for i, p in enumerate(prompts):
        assert finals[f"b{i}"].outputs[0].token_ids == reference_tokens(p, 5)
    assert [finals[f"b{i}"].num_cached_tokens for i in range(4)] == [0, 100, 100, 100]
    assert_idle(engine)


def test_a_short_shared_prefix_or_a_prefix_already_passed_is_not_waited_for():
    engine = prefix_engine(budget=64)
    share_from(engine, 32)
    a = ids(100, 22)
    engine.add_request("a", a, greedy(3))
    engine.step()                                        # a has computed 64 tokens; 35 to go, the rest admits
    engine.add_request("ahead", a[:90] + [0] + ids(30, 25), greedy(3))   # shares 90: waits for a at 90
    engine.add_request("short", a[:20] + ids(30, 23), greedy(3))   # shares 20 < 32
    engine.add_request("passed", a[:50] + ids(30, 24), greedy(3))  # shares 50, already computed by a
    finals = run_all(engine)
    assert finals["short"].num_cached_tokens == 0 and finals["passed"].num_cached_tokens == 0
    assert finals["ahead"].num_cached_tokens == 90
    for rid in ("a", "short", "passed", "ahead"):
        assert finals[rid].outputs[0].token_ids == reference_tokens(finals[rid].prompt_token_ids, 3)
    assert_idle(engine)


@pytest.mark.parametrize("leaves", ["abort", "preempt"])
def test_a_held_sequence_is_requeued_when_the_one_it_waits_for_leaves(leaves):
    engine = prefix_engine(budget=64, num_blocks=40 if leaves == "preempt" else 512)
    share_from(engine, 32)
    a = ids(300, 26)
    engine.add_request("a", a, greedy(3))
    engine.add_request("b", a[:250] + [1] + ids(20, 27), greedy(3))
    engine.step()
    assert engine.get_stats().num_waiting == 1          # b is held for a's state at 250
    if leaves == "abort":
        engine.abort_request("a")
        finals = run_all(engine)
        assert finals["b"].outputs[0].token_ids == reference_tokens(finals["b"].prompt_token_ids, 3)
    else:
        engine.add_request("c", ids(300, 28), greedy(3))
        finals = run_all(engine)
        for rid in ("a", "b", "c"):
            assert finals[rid].outputs[0].token_ids == reference_tokens(finals[rid].prompt_token_ids, 3)
    assert_idle(engine)


def test_prompt_logprob_requests_start_at_zero():
    engine = prefix_engine()
    prompt = ids(40, 14)
    run_one(engine, "a", prompt)
    assert run_one(engine, "b", prompt, prompt_logprobs=1).num_cached_tokens == 0


def test_coarse_checkpoints_and_reset():
    engine = prefix_engine(interval=32)
    long = ids(130, 15)
    run_one(engine, "a", long)
    assert run_one(engine, "b", long[:100] + ids(10, 16)).num_cached_tokens == 96
    assert engine.reset_prefix_cache()
    assert engine.get_stats().prefix_cache_blocks == 0 and engine.get_stats().prefix_cache_snapshots_used == 0
    assert run_one(engine, "c", long).num_cached_tokens == 0
    assert_idle(engine)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_interleavings_over_shared_prefixes_equal_cache_off(data):
    """Requests over a few shared prefixes, added at random steps, with random lengths, n, EOS stops,
    aborts, small pools (eviction, preemption) and either scheduling mode: every completed output equals
    the fake model's own continuation, and the cache is consistent after every step."""
    seed = data.draw(st.integers(0, 10_000))
    rng = random.Random(seed)
    engine = prefix_engine(num_blocks=data.draw(st.sampled_from([24, 60, 400])), block_size=rng.choice([4, 16]),
                           snapshots=data.draw(st.integers(1, 6)), num_slots=rng.randint(1, 5),
                           budget=rng.choice([7, 32, 200]), eos=rng.choice([None, 5]),
                           async_scheduling=data.draw(st.booleans()), max_model_len=512)
    share_from(engine, rng.choice([0, 4, 256]))
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(5, 70))] for _ in range(3)]
    pending = []
    for i in range(rng.randint(3, 10)):
        base = rng.choice(prefixes)
        prompt = base[: rng.randint(1, len(base))] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 20))]
        pending.append((f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=rng.randint(1, 12),
                                                        n=rng.choice([1, 1, 2]))))
    aborted: set[str] = set()
    finals = {}
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and rng.random() < 0.5:
            rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
            if rng.random() < 0.1:
                engine.abort_request(rid)
                aborted.add(rid)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.cache.check_integrity()
        steps += 1
        assert steps < 5000
    for rid, out in finals.items():
        if rid in aborted:
            continue
        for c in out.outputs:
            full = reference_tokens(out.prompt_token_ids, len(c.token_ids))
            assert c.token_ids == full
    assert_idle(engine)
