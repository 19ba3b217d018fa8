"""deltaserve with its default kernels against an independent oracle: transformers in fp32 with eager
attention, per-expert MoE and its torch GDN path (never flash-linear-attention), on the same device, on
tiny random checkpoints of each family at the head dims the production kernels take (GDN key / value
128, attention 256).

Each run batches prompts of 1, 63, 64 and 65 tokens (around the GDN chunk of 64) with a long one in one
generate call, under a step budget that splits the long prompt into chunks at offsets that are not
multiples of 64 ("chunked") or takes the whole batch in one step ("whole"), and judges every prompt
logprob and every generated token's logprob, teacher-forced on the engine's own continuation:
- fp32: within FP32_TOL of transformers' fp32 (TF32 off on both sides); greedy tokens its argmax.
- bf16: error quantiles no worse than transformers' own bf16 run's (oracle.assert_bf16_error_within, over
  the batch's positions in windows of about WINDOW, so an error confined to a few chunks shows); greedy
  tokens transformers' fp32 argmax wherever its bf16 picks the same one, up to a near-tie as wide as twice
  transformers' own bf16 error (its TIE_QUANTILE quantile over the run): the margin is a difference of two
  logprobs, each of which bf16 moves by up to that error (CPUs with and without AMX-bf16 round differently).
On CUDA (the target) every op must be a GPU kernel and the long prompt has 3000 tokens; the CPU variant
runs the same harness at the same shapes with the reference ops and a 300-token long prompt."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from deltaserve import LLM, SamplingParams
from tests.conftest import TinySpec, check_greedy, hf_logprobs, random_ids
from tests.models.oracle import (
    assert_bf16_error_within,
    assert_greedy_where_bf16_agrees,
    gdn_modules,
    hf_oracle,
    target_logprobs,
    torch_gdn_path,
)

PRODUCTION_DIMS = {"gdn_head_dim": 128, "attn_head_dim": 256}
# Seeds whose MoE router top-k gaps over these prompts are >= 3e-5 (transformers fp32 on the CPU), so fp32
# rounding differences cannot flip an expert choice and FP32_TOL can hold at every position.
FAMILIES = {
    "qwen3_next": TinySpec(family="qwen3_next", ratio=2, seed=51, **PRODUCTION_DIMS),
    "qwen3_5": TinySpec(family="qwen3_5", ratio=3, seed=52, **PRODUCTION_DIMS),
    "qwen3_5_moe": TinySpec(family="qwen3_5_moe", ratio=2, seed=54, **PRODUCTION_DIMS),
}
SHORT_PROMPTS = (1, 63, 64, 65)
LONG_PROMPT = {"cuda": 3000, "cpu": 300}
# step token budgets: "chunked" splits the long prompt (and, on CPU, the short ones), "whole" takes all at once
BUDGETS = {"cuda": {"chunked": 1000, "whole": 4096}, "cpu": {"chunked": 100, "whole": 1024}}
GREEDY_TOKENS = 16
FP32_TOL = 1e-3        # max |logprob error| in fp32, every position
WINDOW = 512
TIE_QUANTILE = 0.99

DEVICES = [pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                            reason="needs CUDA")]),
           "cpu"]


@pytest.fixture(scope="module", autouse=True)
def _no_tf32():
    """fp32 means fp32: no TF32 in torch's matmuls (the engine's fallbacks, transformers) or cuDNN's conv."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def oracle_rows():
    """oracle_rows(path, dtype, device, ids) -> transformers' logprob rows over ids (on the CPU), each model
    loaded once and run on its torch GDN path, each sequence computed once."""
    models, rows = {}, {}
    with contextlib.ExitStack() as patches:
        def get(path, dtype: torch.dtype, device: str, ids: list[int]) -> torch.Tensor:
            key = (path, dtype, device)
            if key not in models:
                models[key] = hf_oracle(path, dtype, device)
                patches.enter_context(torch_gdn_path(gdn_modules(models[key])))
            if (key, tuple(ids)) not in rows:
                rows[key, tuple(ids)] = hf_logprobs(models[key], ids).cpu()
            return rows[key, tuple(ids)]

        yield get


def _generate(path, device: str, dtype: str, budget: int, prompts: list[list[int]]):
    llm = LLM(path, device=device, dtype=dtype, max_num_seqs=8, max_num_batched_tokens=budget, num_gpu_blocks=512)
    try:
        if device == "cuda":
            on_reference = sorted(op for op, b in llm.model.kernels.backend.items() if b == "reference")
            assert not on_reference, f"ops left on their torch reference on the GPU: {on_reference}"
        params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True, prompt_logprobs=0,
                                logprobs=0)
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        del llm           # before the next engine: two engines' caches never share the GPU
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def _engine_logprobs(out) -> torch.Tensor:
    """The engine's logprob of each token of prompt + continuation after the first, given the ones before."""
    ids, comp = out.prompt_token_ids, out.outputs[0]
    prompt = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    generated = [comp.logprobs[j][t].logprob for j, t in enumerate(comp.token_ids)]
    return torch.tensor(prompt + generated, dtype=torch.float64)


@pytest.mark.parametrize("budget", ["chunked", "whole"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("device", DEVICES)
def test_default_kernels_match_transformers(tiny_model, oracle_rows, device, family, dtype, budget):
    path = tiny_model(FAMILIES[family])
    lengths = SHORT_PROMPTS + (LONG_PROMPT[device],)
    step_budget = BUDGETS[device][budget]
    assert (step_budget < LONG_PROMPT[device]) == (budget == "chunked") and step_budget >= max(SHORT_PROMPTS)
    assert budget == "chunked" or step_budget >= sum(lengths)
    prompts = [random_ids(n, seed=100 + n) for n in lengths]
    outs = _generate(path, device, dtype, step_budget, prompts)

    runs = []
    for ids, out in zip(prompts, outs):
        cont = out.outputs[0].token_ids
        assert out.prompt_token_ids == ids and len(cont) == GREEDY_TOKENS
        assert out.outputs[0].finish_reason == "length"
        seq = ids + cont
        lp32 = oracle_rows(path, torch.float32, device, seq)
        runs.append((ids, cont, _engine_logprobs(out), lp32, target_logprobs(lp32, seq)))

    if dtype == "float32":
        for ids, cont, ours, lp32, ref32 in runs:
            err = (ours - ref32.double()).abs().max().item()
            assert err <= FP32_TOL, f"fp32 logprobs after a {len(ids)}-token prompt differ by up to {err:.3g}"
            check_greedy(lp32, len(ids), cont, tie=FP32_TOL)
        return

    lp16s = [oracle_rows(path, torch.bfloat16, device, ids + cont) for ids, cont, *_ in runs]
    ours = torch.cat([r[2] for r in runs])
    ref32 = torch.cat([r[4] for r in runs]).double()
    ref16 = torch.cat([target_logprobs(lp16, ids + cont) for (ids, cont, *_), lp16 in zip(runs, lp16s)]).double()
    # the batch's positions in prompt order, in windows of about WINDOW positions
    for window in torch.arange(len(ours)).tensor_split(-(-len(ours) // WINDOW)):
        assert_bf16_error_within(ours[window], ref32[window], ref16[window],
                                 f"positions {int(window[0])}..{int(window[-1])} of prompts {lengths} + continuations")
    tie = 2 * (ref16 - ref32).abs().quantile(TIE_QUANTILE).item()
    for (ids, cont, _, lp32, _), lp16 in zip(runs, lp16s):
        assert_greedy_where_bf16_agrees(lp32, lp16, len(ids), cont, tie, f"a {len(ids)}-token prompt")
