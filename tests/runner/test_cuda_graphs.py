"""Decode CUDA graphs: the bucket ladder and padding (CPU), when capture is refused (CPU), and on a GPU that
graph replay gives the tokens eager execution gives, for batches that hit and miss buckets, with sequences
finishing and joining mid-stream, with the shared expert folded into the MoE op, and with seeded sampling."""

from __future__ import annotations

import gc
import logging
import random

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.models.loader import load_model
from deltaserve.ops import REFERENCE_OPS, Kernels, select_kernels
from deltaserve.runner import cuda_graphs
from deltaserve.runner.cuda_graphs import DECODE_PATH_OPS, bucket_for, capture_sizes, eager_reason, padded_decode_batch
from deltaserve.runner.memory import allocate_cache
from deltaserve.runner.model_runner import ModelRunner
from deltaserve.step_io import NewSequence, ScheduledChunk, SchedulerOutput
from tests.conftest import TinySpec, random_ids


def gpu_test(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(fn))


# ---- buckets and padding (no GPU) -------------------------------------------------------------------

def test_capture_sizes_follow_the_ladder_and_cover_the_largest_batch():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    s = capture_sizes(256)
    assert s[:6] == [1, 2, 4, 8, 16, 24] and s[-1] == 256 and all(b - a == 8 for a, b in zip(s[3:], s[4:]))
    big = capture_sizes(300)
    assert big[-2:] == [288, 304] and big[-1] >= 300
    assert capture_sizes(10_000)[-1] == cuda_graphs.MAX_CAPTURE_SIZE and capture_sizes(0) == []


@pytest.mark.parametrize("n, want", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (17, 24), (24, 24), (25, None)])
def test_bucket_is_the_smallest_size_holding_the_batch(n, want):
    assert bucket_for(n, capture_sizes(24)) == want


def test_capture_is_refused_off_cuda_forced_or_with_reference_ops():
    ref = select_kernels("cpu")
    assert "enforce_eager" in eager_reason(torch.device("cuda"), ref, enforce_eager=True)
    assert "cpu" in eager_reason(torch.device("cpu"), ref, enforce_eager=False)
    why = eager_reason(torch.device("cuda"), ref, enforce_eager=False)
    assert "paged_attention" in why and "gdn_decode" in why
    # all Triton but one op on the decode path: still refused, naming it
    backend = {name: "triton" for name in REFERENCE_OPS}
    backend["attention_prologue"] = "reference"
    mixed = Kernels(backend=backend, **REFERENCE_OPS)
    assert eager_reason(torch.device("cuda"), mixed, enforce_eager=False).count("attention_prologue") == 1
    backend["attention_prologue"] = "triton"
    backend["chunk_gated_delta_rule"] = "reference"        # a prefill-only op does not matter
    assert eager_reason(torch.device("cuda"), Kernels(backend=backend, **REFERENCE_OPS), enforce_eager=False) is None
    assert set(DECODE_PATH_OPS) <= set(REFERENCE_OPS)


@pytest.fixture(scope="module")
def model(tiny_model):
    path = tiny_model(TinySpec(family="qwen3_next", ratio=2, seed=5))
    return load_model(path, device="cpu", dtype=torch.float32, kernels=select_kernels("cpu"), show_progress=False)


def test_padded_rows_touch_no_state(model):
    """A batch of padding rows (slot -1, KV slot -1, context 0) leaves every pool as it was: what lets a
    graph run more rows than the step has."""
    cache = allocate_cache(model, num_slots=2, num_blocks=4, block_size=4, device=torch.device("cpu"),
                           dtype=torch.float32)
    for t in (cache.ssm, cache.conv, cache.kv):
        t.normal_()
    before = [t.clone() for t in (cache.ssm, cache.conv, cache.kv)]
    hidden = model(padded_decode_batch(5, torch.device("cpu"), max_blocks=3), cache)
    assert hidden.shape == (5, model.config.hidden_size) and torch.isfinite(hidden).all()
    for a, b in zip(before, (cache.ssm, cache.conv, cache.kv)):
        assert torch.equal(a, b)


def test_decode_packing_matches_the_eager_batch(model):
    """The host values a graph step copies in are those of the eager batch (the graph path packs them
    separately, without the prefill machinery)."""
    cache = allocate_cache(model, num_slots=4, num_blocks=16, block_size=4, device=torch.device("cpu"),
                           dtype=torch.float32)
    r = ModelRunner(model, cache, device="cpu", max_model_len=64)
    params = SamplingParams(temperature=0)
    prompts = {0: random_ids(6, seed=1), 1: random_ids(9, seed=2)}
    news = [NewSequence(0, prompts[0], 6, params, None, frozenset(), None, 2, [5, 1]),
            NewSequence(1, prompts[1], 9, params, None, frozenset(), None, 0, [7, 3, 9])]
    r.execute(SchedulerOutput(news, [ScheduledChunk(0, 0, 6, []), ScheduledChunk(1, 0, 9, [])], []))
    chunks = [ScheduledChunk(0, 6, 1, []), ScheduledChunk(1, 9, 1, [])]
    batch = r.build_batch(chunks)
    ids, pos, slot_map, seq_lens, slots = r._pack_decodes(chunks)
    assert ids == batch.input_ids.tolist() and pos == batch.positions.tolist()
    assert slot_map == batch.slot_mapping.tolist() and seq_lens == batch.seq_lens.tolist()
    assert slots == batch.state_slots.tolist()
    assert batch.num_prefills == 0


def test_cpu_runs_eagerly_and_says_why(tiny_model, caplog):
    """Eager decodes are the expected CPU path: the reason is DEBUG detail, the start-up summary says eager."""
    with caplog.at_level(logging.DEBUG):
        llm = LLM(tiny_model(TinySpec(family="qwen3_next", ratio=2, seed=5)), device="cpu")
    assert llm.engine.runner.graphs is None
    why = [r for r in caplog.records if "no CUDA graphs" in r.message]
    assert len(why) == 1 and "cpu" in why[0].message and why[0].levelno == logging.DEBUG
    ready = [r for r in caplog.records if r.message.startswith("engine ready")]
    assert len(ready) == 1 and ready[0].levelno == logging.INFO and "decode: eager" in ready[0].message


@pytest.mark.parametrize("sample", [False, True])
def test_padded_static_buffer_path_gives_the_eager_tokens_on_cpu(tiny_model, sample):
    """The graph path's data flow without a GPU: on CPU each "graph" is an eager forward over the static
    buffers, padded to the bucket, so packing, padding and row selection are checked against eager."""
    path = tiny_model(TinySpec(family="qwen3_next", ratio=2, seed=5))
    prompts, params = _workload(7, seed=11, sample=sample)
    results = []
    for graphs in (False, True):
        llm = LLM(path, device="cpu", max_num_seqs=8, max_num_batched_tokens=48)
        if graphs:
            llm.engine.runner.capture_decode_graphs(8)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append(([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]))
    g = llm.engine.runner.graphs
    assert g.sizes == [1, 2, 4, 8] and g.num_replays > 0 and g.num_padded_replays > 0
    (tokens, logprobs), (g_tokens, g_logprobs) = results
    assert g_tokens == tokens
    for lps, g_lps in zip(logprobs, g_logprobs):
        for la, lb in zip(lps or [], g_lps or []):
            assert la.keys() == lb.keys() and all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)


# ---- graph == eager on the GPU ----------------------------------------------------------------------

def _workload(n: int, seed: int, sample: bool = False, vocab: int = 128):
    """n requests with staggered prompt and output lengths: sequences finish and join mid-stream, so the
    decode batch size moves through several buckets (and between them)."""
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": random_ids(rng.randint(1, 40), vocab=vocab, seed=seed * 100 + i)} for i in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(3, 24), ignore_eos=True, logprobs=1 if i % 3 == 0 else None,
                             **(dict(temperature=0.8, top_p=0.9, seed=i) if sample else dict(temperature=0)))
              for i in range(n)]
    return prompts, params


def _run(path, *, eager: bool, n: int, seed: int, sample: bool = False, **kw):
    """(completions' token ids, their logprobs, the graph replay counts); the engine is freed before
    returning, so two engines never hold GPU memory at once (the second would find no room for a cache)."""
    llm = LLM(path, device="cuda", dtype="float32", enforce_eager=eager, max_num_seqs=16,
              max_num_batched_tokens=48, num_gpu_blocks=256, **kw)
    graphs = llm.engine.runner.graphs
    assert (graphs is None) == eager
    prompts, params = _workload(n, seed, sample)
    outs = llm.generate(prompts, params, use_tqdm=False)
    counts = (graphs.num_replays, graphs.num_padded_replays) if graphs is not None else (0, 0)
    del llm, graphs
    _free_gpu()
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], counts


def _free_gpu():
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("n", [3, 13])            # batch sizes 13 -> 1 as sequences finish: hits and misses
@gpu_test
def test_graph_replay_gives_the_eager_tokens(tiny_model, family, n):
    path = tiny_model(TinySpec(family=family, ratio=2, seed=41))
    tokens, logprobs, _ = _run(path, eager=True, n=n, seed=n)
    g_tokens, g_logprobs, (replays, padded) = _run(path, eager=False, n=n, seed=n)
    assert replays > 0, "no decode step replayed a graph"
    if n > 1:
        assert padded > 0, "no step ran a padded bucket"
    assert g_tokens == tokens
    for lps, g_lps in zip(logprobs, g_logprobs):
        for la, lb in zip(lps or [], g_lps or []):
            assert la.keys() == lb.keys() and all(abs(la[t].logprob - lb[t].logprob) < 1e-3 for t in la)


@gpu_test
def test_graph_replay_seeded_sampling_and_folded_shared_expert():
    """A MoE config whose shared expert is folded into fused_moe (same width), sampled with per-request seeds."""
    from tests.models.test_dummy_weights import tiny_config

    cfg = tiny_config("qwen3_5_moe", layers=4)
    tokens, _, _ = _run(cfg, eager=True, n=10, seed=3, sample=True, load_format="dummy")
    g_tokens, _, (replays, _) = _run(cfg, eager=False, n=10, seed=3, sample=True, load_format="dummy")
    assert replays > 0 and g_tokens == tokens


@gpu_test
def test_reference_ops_fall_back_to_eager(tiny_model, caplog):
    path = tiny_model(TinySpec(family="qwen3_next", ratio=2, seed=41))
    with caplog.at_level(logging.INFO, logger="deltaserve.runner.cuda_graphs"):
        llm = LLM(path, device="cuda", enforce_reference_ops=True, max_num_seqs=4, num_gpu_blocks=256)
    assert llm.engine.runner.graphs is None
    assert any("no CUDA graphs" in r.message and "reference" in r.message and r.levelno == logging.INFO
               for r in caplog.records)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@gpu_test
def test_embedded_model_on_gpu_runs_eagerly():
    """Its head dims (GDN 48, attention 96) keep the GDN / attention references, so no graphs."""
    llm = LLM(device="cuda", max_num_seqs=4, num_gpu_blocks=256)
    assert llm.engine.runner.graphs is None


@gpu_test
def test_graphs_cover_max_num_seqs():
    from tests.models.test_dummy_weights import tiny_config

    llm = LLM(tiny_config("qwen3_5_moe", layers=4), device="cuda", load_format="dummy", max_num_seqs=64,
              num_gpu_blocks=256)
    g = llm.engine.runner.graphs
    assert g is not None and g.sizes[-1] == 64 and g.capture_seconds > 0
    assert llm.model.layers[0].mlp.shared_slices == 1          # the shared expert runs inside fused_moe
    print(f"graphs {g.sizes}: capture {g.capture_seconds:.2f} s, pool {g.pool_bytes / 2**20:.1f} MiB")


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Each GPU test's engine gives its memory back before the next one sizes its cache."""
    yield
    if torch.cuda.is_available():
        _free_gpu()


class _SyncsAllowed:
    """Run `fn` with torch's sync debug mode off (the one sync a step is allowed), counting the calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        torch.cuda.set_sync_debug_mode(0)
        try:
            return self.fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("error")


@gpu_test
def test_sampler_reads_the_device_once(monkeypatch):
    """Penalties, min_tokens, top-k / top-p / min-p, seeded and unseeded draws, logprobs: no synchronizing
    CUDA call but the one transfer of tokens and logprobs (torch's sync debug mode raises on the others)."""
    from deltaserve.runner import sampler as sampler_mod
    from deltaserve.runner.sampler import Sampler, SamplingRow

    reads = _SyncsAllowed(sampler_mod.HostCopy.get)
    monkeypatch.setattr(sampler_mod.HostCopy, "get", lambda self: reads(self))
    logits = torch.randn(6, 1000, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 3
    rows = [SamplingRow(SamplingParams(**kw), seed, [1, 2, 3, 5, 5], 3, frozenset({7}))
            for seed, kw in [(None, dict(temperature=0)), (3, dict(temperature=0.8, top_k=20, logprobs=2)),
                             (None, dict(temperature=1.0, top_p=0.7, repetition_penalty=1.3)),
                             (5, dict(temperature=1.2, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.2)),
                             (None, dict(temperature=0, min_tokens=4, logprobs=0)), (9, dict(temperature=0.5))]]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler(torch.device("cuda"), 0)(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert reads.calls == 1 and len(out.token_ids) == 6 and out.logprobs[1] is not None
    assert out.token_ids[0] == int(logits[0].argmax())


@gpu_test
def test_a_decode_step_syncs_only_to_read_its_tokens(tiny_model, monkeypatch):
    """An engine step of decodes (graph replay, sampling with logprobs) makes one synchronizing call: reading
    the tokens (of the step before, with async scheduling)."""
    from deltaserve.runner import sampler as sampler_mod

    llm = LLM(tiny_model(TinySpec(family="qwen3_5_moe", ratio=2, seed=41)), device="cuda", max_num_seqs=8,
              num_gpu_blocks=256)
    engine = llm.engine
    for i in range(5):
        engine.add_request(str(i), {"prompt_token_ids": random_ids(5 + i, seed=i)},
                           SamplingParams(max_tokens=50, ignore_eos=True, temperature=0.7, seed=i, logprobs=1),
                           stream=False)
    for _ in range(3):                                   # prefill (eager, allowed to sync) and a first decode
        engine.step()
    graphs = engine.runner.graphs
    graphs._copied = type("Ev", (), {"record": graphs._copied.record,
                                     "synchronize": _SyncsAllowed(graphs._copied.synchronize)})()
    reads = _SyncsAllowed(sampler_mod.HostCopy.get)
    monkeypatch.setattr(sampler_mod.HostCopy, "get", lambda self: reads(self))
    replays = graphs.num_replays
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert reads.calls == 4 and graphs.num_replays == replays + 4
