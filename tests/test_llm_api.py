"""The offline API: LLM.generate with vLLM's prompt forms, SamplingParams semantics and output shapes."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.tokenizer import NoTokenizerError
from tests.conftest import TinySpec, random_ids

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_with_tokenizer):
    return LLM(tiny_model_with_tokenizer, device="cpu", dtype="float32")


def gen(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0]


def test_text_prompt_roundtrip_and_output_shape(llm):
    out = gen(llm, "The quick brown fox", max_tokens=12, **GREEDY)
    assert out.prompt == "The quick brown fox"
    assert out.prompt_token_ids == llm.tokenizer.encode("The quick brown fox")
    c = out.outputs[0]
    assert c.index == 0 and len(c.token_ids) == 12 and c.finish_reason == "length"
    # the text is the decoded tokens, less a trailing incomplete UTF-8 sequence (held back, as in streaming)
    assert c.text == llm.tokenizer.decode(c.token_ids).rstrip("\ufffd")
    assert out.finished and out.prompt_logprobs is None and c.logprobs is None


def test_prompt_forms_single_and_list(llm):
    ids = llm.tokenizer.encode("To be or not")
    a = llm.generate("To be or not", SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    b = llm.generate([{"prompt_token_ids": ids}, {"prompt": "To be or not"}], SamplingParams(max_tokens=4, **GREEDY),
                     use_tqdm=False)
    assert len(a) == 1 and len(b) == 2
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids == b[1].outputs[0].token_ids


def test_stop_string_cuts_text_before_the_match(llm):
    full = gen(llm, "All that glitters", max_tokens=30, **GREEDY).outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full.find(stop)
    out = gen(llm, "All that glitters", max_tokens=30, stop=[stop], **GREEDY).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == full[:cut]
    kept = gen(llm, "All that glitters", max_tokens=30, stop=stop, include_stop_str_in_output=True,
               **GREEDY).outputs[0]
    assert kept.text == full[: cut + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    ids = gen(llm, "A journey", max_tokens=10, **GREEDY).outputs[0].token_ids
    out = gen(llm, "A journey", max_tokens=10, stop_token_ids=[ids[3]], **GREEDY).outputs[0]
    first = ids.index(ids[3])
    assert out.token_ids == ids[: first + 1] and out.finish_reason == "stop" and out.stop_reason == ids[3]
    late = gen(llm, "A journey", max_tokens=10, stop_token_ids=[ids[0]], min_tokens=2, **GREEDY).outputs[0]
    assert late.token_ids[0] != ids[0]  # suppressed before min_tokens


def test_eos_ends_generation_unless_ignored(tiny_model_with_tokenizer, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(tiny_model_with_tokenizer, path)
    llm = LLM(path, device="cpu", dtype="float32")
    ids = gen(llm, "Hello", max_tokens=8, **GREEDY).outputs[0].token_ids
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids[2]]}))
    eos_llm = LLM(path, device="cpu", dtype="float32")
    stopped = gen(eos_llm, "Hello", max_tokens=8, temperature=0).outputs[0]
    assert stopped.token_ids == ids[: ids.index(ids[2]) + 1] and stopped.finish_reason == "stop"
    assert gen(eos_llm, "Hello", max_tokens=8, **GREEDY).outputs[0].token_ids == ids


def test_logprobs_and_prompt_logprobs(llm):
    out = gen(llm, "The lazy dog", max_tokens=6, logprobs=3, prompt_logprobs=2, **GREEDY)
    c = out.outputs[0]
    assert len(c.logprobs) == 6
    for token, pos in zip(c.token_ids, c.logprobs):
        assert token in pos and pos[token].rank == 1 and 3 <= len(pos) <= 4
        ranks = sorted(lp.rank for t, lp in pos.items() if t != token or lp.rank == 1)
        assert ranks[:3] == [1, 2, 3]
        assert math.isclose(sum(math.exp(lp.logprob) for lp in pos.values()), 1.0, rel_tol=1) and all(
            lp.logprob <= 0 for lp in pos.values())
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for tok, pos in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert tok in pos and len(pos) <= 3
    # the logprob reported for a generated token is the model's: same as a prompt logprob over prompt+output
    again = llm.generate({"prompt_token_ids": out.prompt_token_ids + c.token_ids},
                         SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY), use_tqdm=False)[0]
    n = len(out.prompt_token_ids)
    for j, token in enumerate(c.token_ids):
        assert abs(again.prompt_logprobs[n + j][token].logprob - c.logprobs[j][token].logprob) < 1e-4


def test_seeded_sampling_is_independent_of_batch_companions(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate("Héllo wörld", params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    batch = llm.generate(["To be", "Héllo wörld", "The quick"], [others, params, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = llm.generate("Héllo wörld", params.clone(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_degenerate_sampling_settings_reduce_to_greedy(llm):
    greedy = gen(llm, "The quick", max_tokens=8, **GREEDY).outputs[0].token_ids
    for kw in ({"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}):
        assert gen(llm, "The quick", max_tokens=8, temperature=1.5, ignore_eos=True, seed=5, **kw
                   ).outputs[0].token_ids == greedy, kw


def test_n_completions(llm):
    out = gen(llm, "The quick", n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(c.token_ids) == 5 for c in out.outputs)


@pytest.mark.parametrize("kw, field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"), ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logprobs": -1}, "logprobs"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"temperature": float("inf")}, "temperature"),
])
def test_invalid_sampling_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_bad_prompts_are_refused(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate({"prompt_token_ids": [1, 10_000]}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(42, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_prompt_longer_than_context_is_refused(tiny_model_with_tokenizer):
    small = LLM(tiny_model_with_tokenizer, device="cpu", dtype="float32", max_model_len=16)
    with pytest.raises(ValueError, match="context limit is 16"):
        small.generate({"prompt_token_ids": list(range(16))}, use_tqdm=False)
    out = small.generate({"prompt_token_ids": list(range(10))}, SamplingParams(max_tokens=None, **GREEDY),
                         use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"


def test_model_without_tokenizer_takes_token_ids_only(tiny_model):
    llm = LLM(tiny_model(TinySpec()), device="cpu", dtype="float32")
    out = llm.generate({"prompt_token_ids": random_ids(5)}, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and out[0].outputs[0].text == ""
    with pytest.raises(NoTokenizerError, match="no tokenizer.json"):
        llm.generate("hello", use_tqdm=False)


def test_default_decode_step_is_eager(tiny_model_with_tokenizer, monkeypatch):
    """Without DELTASERVE_COMPILE, LLM() runs no compiled CPU decode step (eager measured faster on a small CPU)."""
    monkeypatch.delenv("DELTASERVE_COMPILE", raising=False)
    llm = LLM(tiny_model_with_tokenizer, device="cpu", dtype="float32")
    assert llm.engine.runner.compiled_decode is None
