"""The MTP drafter (spec/mtp.py): paged, incremental drafting over many steps equals the MTP head run over the
whole committed sequence at once; a batch drafts as each sequence alone; it writes only the MTP KV layer of the
sequence's own blocks; the pools and the memory plan count that layer only when asked; a model without a
head is refused by name; and on the embedded model the head's greedy drafts are accepted measurably often.

The oracle: the target run once over the committed tokens (a fresh contiguous cache), then model.mtp over
every row at once (model_spec.md §7: row t takes token t+1's embedding and the target's hidden state at t);
each further draft re-runs the head over the whole sequence with the previous draft and the head's own
output appended. MTPHead itself equals the training module (tests/test_default_model.py).

The simulated steps give the drafter what the runner gives it: the target's hidden states of the step's rows,
the token after each row (a rejected draft past a rejection), the last accepted row, and which blocks are
the sequence's; what gets accepted is scripted (the drafter must not care why).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import random
import sys
import types
from pathlib import Path

import pytest
import torch

from deltaserve.batch import CacheBuffers, ForwardBatch
from deltaserve.cache.plan import CacheSpec
from deltaserve.config import ModelConfig
from deltaserve.models.loader import load_model
from deltaserve.ops import select_kernels
from deltaserve.runner.worker import Worker, WorkerConfig
from deltaserve.spec.config import SpeculativeConfig, check_model
from deltaserve.spec.mtp import MTPDrafter
from tests.conftest import TinySpec

MTP_SPEC = TinySpec(family="qwen3_next", ratio=3, decoder_sparse_step=2, mtp=True, seed=2)
BS = 4                 # small blocks: draft rows cross block boundaries often
FOREIGN = 0            # a block no sequence owns: stale block-table entries point at it
SENTINEL = 7.0
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tiny_model):
    return load_model(tiny_model(MTP_SPEC), device="cpu", dtype=torch.float32, kernels=select_kernels("cpu"),
                      show_progress=False)


# ---- the oracle: whole sequences, contiguous caches -------------------------------------------------
def _prefill(n: int, bs: int = 16) -> ForwardBatch:
    return ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.long), positions=torch.arange(n),
        cu_seqlens=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
        state_slots=torch.tensor([0], dtype=torch.int32), has_initial_state=torch.tensor([False]),
        slot_mapping=torch.arange(n), block_tables=torch.arange(-(-n // bs), dtype=torch.int32)[None],
        num_prefills=1, num_prefill_tokens=n)


@torch.inference_mode()
def target_hidden(model, tokens: list[int]) -> torch.Tensor:
    cfg, n = model.config, len(tokens)
    cache = CacheBuffers.allocate(cfg, num_slots=1, num_blocks=-(-n // 16), block_size=16, device="cpu",
                                  dtype=torch.float32)
    return model(dataclasses.replace(_prefill(n), input_ids=torch.tensor(tokens)), cache)


@torch.inference_mode()
def oracle_drafts(model, committed: list[int], k: int) -> list[int]:
    """The k greedy drafts after `committed` (its last token: the one just emitted, at position t + 1)."""
    hidden = target_hidden(model, committed[:-1])                       # positions 0..t
    embeds, hid = model.embed_tokens[torch.tensor(committed[1:])], hidden
    drafts = []
    for _ in range(k):
        n = embeds.shape[0]
        cache = CacheBuffers.allocate(model.config, num_slots=1, num_blocks=-(-n // 16), block_size=16,
                                      device="cpu", dtype=torch.float32, num_attention_layers=1)
        out = model.mtp(embeds, hid, _prefill(n), cache.kv[0], model.rope)
        d = int(model.compute_logits(out[-1:]).argmax(-1))
        drafts.append(d)
        embeds = torch.cat([embeds, model.embed_tokens[d][None]])
        hid = torch.cat([hid, out[-1:]])
    return drafts


# ---- the simulated engine: paged pool, scripted acceptance --------------------------------------------
@dataclasses.dataclass
class Seq:
    prompt: list[int]
    rng: random.Random
    committed: list[int] = dataclasses.field(default_factory=list)   # known tokens (prompt, accepted, emitted)
    blocks: list[int] = dataclasses.field(default_factory=list)
    prefilled: int = 0
    drafts: list[int] | None = None                                   # proposed for the next step
    log: list[list[int]] = dataclasses.field(default_factory=list)    # every proposal


class Sim:
    """Steps of several sequences through one pool. `lookahead`: blocks are allocated for the draft rows too
    and the drafter is told (kv_capacity, wide tables); otherwise only the step's rows get blocks."""

    def __init__(self, model, seqs: list[Seq], *, k_max: int, chunk: int, lookahead: bool, num_blocks: int = 96,
                 block_seed: int = 0):
        self.model, self.seqs, self.k_max, self.chunk, self.lookahead = model, seqs, k_max, chunk, lookahead
        self.cache = CacheBuffers.allocate(model.config, num_slots=4, num_blocks=num_blocks, block_size=BS,
                                           device="cpu", dtype=torch.float32, mtp_kv_layers=1)
        self.cache.kv[:, :, FOREIGN] = SENTINEL
        self.free = [b for b in range(num_blocks) if b != FOREIGN]
        random.Random(block_seed).shuffle(self.free)                  # block ids out of order
        self.drafter = MTPDrafter(model, self.cache, "cpu")
        self.vocab = model.config.vocab_size

    def _own(self, s: Seq, num_tokens: int) -> None:
        while len(s.blocks) * BS < num_tokens:
            s.blocks.append(self.free.pop())

    def step(self, active: list[Seq]) -> None:
        """One step for each sequence in `active`: the next prompt chunk, or the verify of its drafts."""
        chunks = []                                      # (seq, start, row tokens, next tokens, accepted row or None)
        for s in active:
            if s.prefilled < len(s.prompt):
                start = s.prefilled
                end = min(len(s.prompt), start + self.chunk)
                s.prefilled = end
                rows = s.prompt[start:end]
                if end < len(s.prompt):
                    chunks.append((s, start, rows, s.prompt[start + 1 : end + 1], None))
                    continue
                emitted = s.rng.randrange(self.vocab)
                s.committed = list(s.prompt) + [emitted]
                chunks.append((s, start, rows, s.prompt[start + 1 :] + [emitted], len(rows) - 1))
                continue
            drafts = s.drafts or []
            start = len(s.committed) - 1
            rows = [s.committed[-1]] + drafts
            a = s.rng.randint(0, len(drafts))            # drafts accepted (scripted)
            bonus = s.rng.randrange(self.vocab)
            nxt = drafts + [s.rng.randrange(self.vocab)]  # the next row's input; a rejected draft past a
            nxt[a] = bonus
            s.committed += drafts[:a] + [bonus]
            chunks.append((s, start, rows, nxt, a))
        chunks.sort(key=lambda c: len(c[2]) == 1)        # multi-row chunks first, as the runner packs
        self._run(chunks)

    def _run(self, chunks) -> None:
        ks = {id(s): (s.rng.randint(0, self.k_max) if acc is not None else 0) for s, _, _, _, acc in chunks}
        k = max(ks.values())                              # one k for the step; each keeps its own first ks
        hidden, pos, slots, cu, seq_lens, nxt, last_rows, seq_index, caps = [], [], [], [0], [], [], [], [], []
        for i, (s, start, rows, next_tokens, acc) in enumerate(chunks):
            end = start + len(rows)
            self._own(s, end + (k if self.lookahead and acc is not None else 0))
            h = target_hidden(self.model, (s.committed[:start] if s.committed else s.prompt[:start]) + rows)
            hidden.append(h[start:])
            pos += range(start, end)
            slots += [s.blocks[p // BS] * BS + p % BS for p in range(start, end)]
            nxt += next_tokens
            if acc is not None:
                last_rows.append(cu[-1] + acc)
                seq_index.append(i)
                caps.append(len(s.blocks) * BS)
            cu.append(cu[-1] + len(rows))
            seq_lens.append(end)
        width = max(len(s.blocks) for s, *_ in chunks) if self.lookahead else max(-(-n // BS) for n in seq_lens)
        tables = torch.full((len(chunks), width), FOREIGN, dtype=torch.int32)   # stale entries: a foreign block
        for i, (s, *_) in enumerate(chunks):
            own = s.blocks[:width] if self.lookahead else s.blocks[: -(-seq_lens[i] // BS)]
            tables[i, : len(own)] = torch.tensor(own, dtype=torch.int32)
        batch = ForwardBatch(
            input_ids=torch.zeros(len(pos), dtype=torch.long), positions=torch.tensor(pos),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            state_slots=torch.arange(len(chunks), dtype=torch.int32),
            has_initial_state=torch.tensor([p > 0 for p in cu[:-1]]), slot_mapping=torch.tensor(slots),
            block_tables=tables, num_prefills=sum(len(c[2]) > 1 for c in chunks),
            num_prefill_tokens=sum(len(c[2]) for c in chunks if len(c[2]) > 1))
        index = torch.tensor(seq_index, dtype=torch.long)
        extra = {}
        if self.lookahead:
            extra = {"kv_capacity": torch.tensor(caps), "block_tables": tables.index_select(0, index)}
        drafts = self.drafter.draft(torch.cat(hidden), batch, torch.tensor(nxt), torch.tensor(last_rows), index, k,
                                    **extra)
        assert drafts.shape == (len(seq_index), k) and drafts.dtype == torch.long
        for row, i in enumerate(seq_index):
            s = chunks[i][0]
            s.drafts = drafts[row, : ks[id(s)]].tolist()
            s.log.append(list(s.drafts))

    def run(self, num_steps: int, check=None) -> None:
        for _ in range(num_steps):
            self.step(self.seqs)
            if check is not None:
                for s in self.seqs:
                    if s.committed and s.prefilled == len(s.prompt):
                        check(s)

    def untouched_outside_own_mtp_blocks(self) -> None:
        kv, n_attn = self.cache.kv, len(self.model.config.attention_layer_ids)
        assert torch.all(kv[:, :, FOREIGN] == SENTINEL), "a draft row wrote into a block the sequence does not hold"
        assert torch.all(kv[:n_attn, :, 1:] == 0), "the drafter wrote into the target's KV layers"
        owned = sorted(b for s in self.seqs for b in s.blocks)
        assert len(owned) == len(set(owned))
        never = [b for b in range(kv.shape[2]) if b not in owned and b != FOREIGN]
        assert torch.all(kv[:, :, never] == 0), "a block no sequence holds was written"


def _seqs(seeds: list[int], vocab: int) -> list[Seq]:
    out = []
    for seed in seeds:
        rng = random.Random(seed)
        out.append(Seq(prompt=[rng.randrange(vocab) for _ in range(rng.randint(5, 14))], rng=rng))
    return out


# ---- incremental == whole sequence; a batch == each alone ----------------------------------------------
def test_incremental_paged_drafts_equal_the_head_over_the_whole_sequence(model):
    """Chunked prefill, then verify steps with scripted acceptance (all, some, none) and k from 0 to 4: each
    step's drafts are the oracle's for the committed tokens (rows past a rejection and draft rows wrote K/V
    that the next steps overwrote before reading)."""
    seqs = _seqs([11], model.config.vocab_size)
    sim = Sim(model, seqs, k_max=4, chunk=5, lookahead=True)
    checked = []

    def check(s: Seq) -> None:
        assert s.drafts == oracle_drafts(model, s.committed, len(s.drafts)), (len(s.committed), s.drafts)
        checked.append(len(s.drafts))

    sim.run(12, check)
    assert sum(checked) >= 12 and max(checked) >= 3, checked       # real multi-draft steps were compared
    sim.untouched_outside_own_mtp_blocks()


@torch.inference_mode()
def test_first_pass_of_some_rows_stores_every_rows_kv_and_gives_those_rows_outputs(model):
    """mtp_forward with out_rows (the drafter's first pass): the same K/V for every row as the whole pass, and
    for the rows asked (attention as one-row queries) the whole pass's outputs at those rows."""
    cfg, n, bs = model.config, 37, 16
    rng = random.Random(5)
    tokens = [rng.randrange(cfg.vocab_size) for _ in range(n + 1)]
    hidden = target_hidden(model, tokens[:n])
    batch = dataclasses.replace(_prefill(n, bs), input_ids=torch.tensor(tokens[:n]))
    rows = torch.tensor([3, 20, n - 1])
    queries = ForwardBatch(
        input_ids=torch.zeros(3, dtype=torch.long), positions=rows, cu_seqlens=torch.arange(4, dtype=torch.int32),
        seq_lens=(rows + 1).to(torch.int32), state_slots=torch.zeros(3, dtype=torch.int32),
        has_initial_state=torch.ones(3, dtype=torch.bool), slot_mapping=torch.full((3,), -1),
        block_tables=batch.block_tables.expand(3, -1), num_prefills=0, num_prefill_tokens=0)
    caches = [CacheBuffers.allocate(cfg, num_slots=1, num_blocks=3, block_size=bs, device="cpu", dtype=torch.float32,
                                    mtp_kv_layers=1) for _ in range(2)]
    nxt = torch.tensor(tokens[1:])
    whole = model.mtp_forward(nxt, hidden, batch, caches[0])
    some = model.mtp_forward(nxt, hidden, batch, caches[1], out_rows=rows, queries=queries)
    assert torch.equal(caches[0].kv, caches[1].kv), "every row's K/V, as the whole pass stores them"
    torch.testing.assert_close(some, whole[rows], rtol=1e-5, atol=1e-5)


def test_a_batch_drafts_as_each_sequence_alone(model):
    """Three sequences in one pool, prefill chunks beside verify steps: the same drafts as each run alone."""
    vocab, seeds = model.config.vocab_size, [3, 4, 5]
    together = Sim(model, _seqs(seeds, vocab), k_max=3, chunk=4, lookahead=True)
    together.run(9)
    together.untouched_outside_own_mtp_blocks()
    for seed, s in zip(seeds, together.seqs):
        alone = Sim(model, _seqs([seed], vocab), k_max=3, chunk=4, lookahead=True, block_seed=seed)
        alone.run(9)
        assert alone.seqs[0].log == s.log
        assert sum(map(len, s.log)) >= 6


def test_without_lookahead_blocks_draft_rows_never_leave_the_sequences_blocks(model):
    """Only the step's rows hold blocks (the default capacity: the step's context in whole blocks); stale table
    entries point at a foreign block. Nothing is written outside the MTP layer of the sequences' own blocks,
    drafts still equal the oracle's whenever their rows fit, and a batch still drafts as each alone."""
    vocab, seeds = model.config.vocab_size, [21, 22]
    sim = Sim(model, _seqs(seeds, vocab), k_max=4, chunk=6, lookahead=False)
    fits = []

    def check(s: Seq) -> None:
        t = len(s.committed) - 2
        if t + len(s.drafts) - 1 < len(s.blocks) * BS:
            assert s.drafts == oracle_drafts(model, s.committed, len(s.drafts))
            fits.append(len(s.drafts))

    sim.run(10, check)
    sim.untouched_outside_own_mtp_blocks()
    assert sum(fits) >= 6
    alone = Sim(model, _seqs(seeds[:1], vocab), k_max=4, chunk=6, lookahead=False, block_seed=1)
    alone.run(10)
    assert alone.seqs[0].log == sim.seqs[0].log


# ---- the Drafter protocol -----------------------------------------------------------------------------
def _context(**kw):
    """A DraftContext (spec/drafter.py) when that module exists, else a stand-in with its fields."""
    fields = {"seq_ids": [], "k": 0, "token_ids": [], "batch": None, "hidden": None, "batch_index": [],
              "last_rows": torch.empty(0, dtype=torch.long), "next_tokens": None,
              "num_accepted": torch.empty(0, dtype=torch.long), "cache": None}
    fields.update(kw)
    if importlib.util.find_spec("deltaserve.spec.drafter") is not None:
        from deltaserve.spec.drafter import DraftContext

        return DraftContext(**fields)
    return types.SimpleNamespace(**fields)


def test_propose_reads_the_draft_context(model):
    sim = Sim(model, _seqs([8], model.config.vocab_size), k_max=2, chunk=16, lookahead=False)
    s = sim.seqs[0]
    n = len(s.prompt)
    emitted = 5
    h = target_hidden(model, s.prompt)
    batch = dataclasses.replace(_prefill(n, BS), block_tables=torch.tensor([list(range(1, 1 + -(-n // BS)))],
                                                                          dtype=torch.int32))
    batch.slot_mapping = torch.tensor([batch.block_tables[0, p // BS].item() * BS + p % BS for p in range(n)])
    nxt = torch.tensor(s.prompt[1:] + [emitted])
    ctx = _context(seq_ids=[42], k=3, token_ids=[s.prompt + [emitted]], batch=batch, hidden=h, batch_index=[0],
                   last_rows=torch.tensor([n - 1]), next_tokens=nxt, num_accepted=torch.tensor([0]),
                   cache=sim.cache)
    drafts = sim.drafter.propose(ctx)
    assert drafts.shape == (1, 3)
    # the rows of the first two drafts fit the prompt's last block; compare what fits
    fit = min(3, -(-n // BS) * BS - (n - 1))
    assert drafts[0, :fit].tolist() == oracle_drafts(model, s.prompt + [emitted], fit)
    fields = {name: getattr(ctx, name) for name in vars(ctx)}
    # a context that says the sequence holds a block more (lookahead): every draft row fits
    m = batch.block_tables.shape[1] + 1
    wide = types.SimpleNamespace(**{**fields, "kv_capacity": torch.tensor([m * BS]),
                                    "block_tables": torch.arange(1, m + 1, dtype=torch.int32)[None]})
    assert sim.drafter.propose(wide)[0].tolist() == oracle_drafts(model, s.prompt + [emitted], 3)
    # nothing drafting: the first pass still runs (k = 0), and a step without hidden states gives no drafts
    assert sim.drafter.propose(types.SimpleNamespace(**{**fields, "k": 0})).shape == (1, 0)
    none = _context(seq_ids=[1, 2], k=2, cache=sim.cache)
    assert sim.drafter.propose(none).tolist() == [[-1, -1], [-1, -1]]
    sim.drafter.release([42])


# ---- refusals, pools, memory plan -----------------------------------------------------------------------
def _worker_args(cfg: ModelConfig, path: Path) -> dict:
    return {"model": cfg, "model_path": path, "load_format": "auto", "device": torch.device("cpu"),
            "dtype": torch.float32, "max_num_seqs": 2, "max_num_batched_tokens": 32, "max_model_len": 64,
            "block_size": 8, "gpu_memory_utilization": 0.9, "cpu_cache_bytes": 1 << 22}


def test_a_checkpoint_without_an_mtp_head_is_refused_by_name(tiny_model):
    path = tiny_model(TinySpec(family="qwen3_next", seed=5))
    cfg = ModelConfig.from_hf(path)
    with pytest.raises(ValueError, match="MTP head"):
        check_model(SpeculativeConfig(method="mtp", num_speculative_tokens=2), cfg)
    plain = load_model(path, device="cpu", dtype=torch.float32, kernels=select_kernels("cpu"), show_progress=False)
    cache = CacheBuffers.allocate(cfg, num_slots=1, num_blocks=2, block_size=BS, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="MTP head"):
        MTPDrafter(plain, cache, "cpu")
    base = _worker_args(cfg, path)
    with pytest.raises(ValueError, match="MTP head"):
        Worker(WorkerConfig(**base, mtp_kv_layers=1)).load_model()


def test_drafter_refuses_pools_without_the_mtp_layer(model):
    cache = CacheBuffers.allocate(model.config, num_slots=1, num_blocks=2, block_size=BS, device="cpu",
                                  dtype=torch.float32)
    with pytest.raises(ValueError, match="mtp_kv_layers=1"):
        MTPDrafter(model, cache, "cpu")
    with pytest.raises(ValueError, match="no MTP layer 0"):
        cache.mtp_kv(model.config, 0)


def test_the_mtp_kv_layer_is_planned_and_allocated_only_when_asked(model, tiny_model):
    cfg = model.config
    n_attn = len(cfg.attention_layer_ids)
    plain = CacheSpec.from_model(cfg, block_size=16, kv_dtype_bytes=2, conv_dtype_bytes=2)
    mtp = CacheSpec.from_model(cfg, block_size=16, kv_dtype_bytes=2, conv_dtype_bytes=2, mtp_kv_layers=1)
    assert mtp.kv_block_bytes * n_attn == plain.kv_block_bytes * (n_attn + 1)
    assert mtp.state_slot_bytes == plain.state_slot_bytes
    path = tiny_model(MTP_SPEC)
    base = _worker_args(cfg, path)
    off, on = Worker(WorkerConfig(**base)), Worker(WorkerConfig(**base, mtp_kv_layers=1))
    off.start(), on.start()
    assert off.runner.cache.kv.shape[0] == n_attn and on.runner.cache.kv.shape[0] == n_attn + 1
    spec_on, spec_off = on.cache_spec(), off.cache_spec()
    assert spec_on.kv_block_bytes * n_attn == spec_off.kv_block_bytes * (n_attn + 1)
    assert spec_on.state_slot_bytes == spec_off.state_slot_bytes
    assert on.plan.num_blocks < off.plan.num_blocks                    # the same budget, a layer more per block
    assert "+1 MTP KV layer" in on.summary() and "MTP KV" not in off.summary()
    MTPDrafter(on.model, on.runner.cache, "cpu")                        # the worker's pools serve the drafter


# ---- the embedded model's head on held-out English ----------------------------------------------------------
def test_embedded_mtp_drafts_are_accepted_on_held_out_english(monkeypatch):
    """Teacher-forced on text written for this test: the head's first draft matches the target's greedy
    next-next token far more often than chance; longer drafts are accepted less per position (the benchmark
    prints the full numbers)."""
    spec = importlib.util.spec_from_file_location("mtp_acceptance", REPO / "benchmarks" / "mtp_acceptance.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)   # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    result = bench.measure(bench.HELD_OUT_TEXT[:1], k_max=2)
    assert result.positions >= 80
    mean1, mean2 = result.mean_accepted_length(1), result.mean_accepted_length(2)
    assert mean1 >= 1.15, result.summary()
    assert mean1 <= mean2 <= 2 * mean1 - 1 + 1e-9, result.summary()   # draft 2 is accepted only after draft 1


# ---- CUDA: nothing read on the host --------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_propose_on_cuda_reads_nothing_on_the_host(tiny_model, model):
    """Triton ops (the tiny model's head dims are supported): the first pass over a prompt and 3 draft steps
    with torch's sync debug mode raising on any synchronizing call; the drafts equal the CPU drafter's."""
    dev = torch.device("cuda")
    path = tiny_model(MTP_SPEC)
    cfg = ModelConfig.from_hf(path)
    gpu = load_model(path, device=dev, dtype=torch.float32, kernels=select_kernels(dev, shapes=cfg.kernel_shapes),
                     show_progress=False)
    rng = random.Random(0)
    prompt = [rng.randrange(cfg.vocab_size) for _ in range(37)]
    n, emitted, bs = len(prompt), 9, 16
    results = []
    for m, device in ((gpu, dev), (model, torch.device("cpu"))):
        cache = CacheBuffers.allocate(cfg, num_slots=1, num_blocks=4, block_size=bs, device=device,
                                      dtype=torch.float32, mtp_kv_layers=1)
        batch = dataclasses.replace(_prefill(n, bs), input_ids=torch.tensor(prompt))
        batch = dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device)
                                              for f in dataclasses.fields(batch)
                                              if isinstance(getattr(batch, f.name), torch.Tensor)})
        with torch.inference_mode():
            hidden = m(batch, cache)
        drafter = MTPDrafter(m, cache, device)
        ctx = _context(seq_ids=[0], k=4, token_ids=[prompt + [emitted]], batch=batch, hidden=hidden, batch_index=[0],
                       last_rows=torch.tensor([n - 1], device=device),
                       next_tokens=torch.tensor(prompt[1:] + [emitted], device=device),
                       num_accepted=torch.zeros(1, dtype=torch.long, device=device), cache=cache)
        if device.type == "cuda":
            drafter.propose(ctx)                      # builds the Triton kernels (their first launch may sync)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                drafts = drafter.propose(ctx)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        else:
            drafts = drafter.propose(ctx)
        results.append(drafts.cpu().tolist())
    assert results[0] == results[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_start_up_profiles_the_mtp_first_pass_and_allocates_its_layer(tiny_model):
    """On a GPU the budget is measured with the head's first pass over the largest step (it must run there),
    and the pools the plan sizes carry the MTP layer, which the drafter accepts."""
    path = tiny_model(MTP_SPEC)
    cfg = ModelConfig.from_hf(path)
    args = {**_worker_args(cfg, path), "device": torch.device("cuda"), "gpu_memory_utilization": 0.3,
            "max_num_batched_tokens": 256}
    worker = Worker(WorkerConfig(**args, mtp_kv_layers=1))
    runner = worker.start()
    assert runner.cache.kv.shape[0] == len(cfg.attention_layer_ids) + 1
    assert worker.plan.used_bytes <= worker.plan.budget_bytes
    MTPDrafter(worker.model, runner.cache, "cuda")
