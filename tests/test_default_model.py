"""The embedded default model (deltaserve/default_model): what it ships, that deltaserve runs it as transformers
does, and that it is a real language model with a real MTP drafter.

The held-out numbers are measured on tests/data/heldout.txt (text the model never trained on); the values
`scripts/train_default_model.py package` recorded for it are in tests/data/heldout_expected.json.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deltaserve import DEFAULT_MODEL_PATH, LLM, SamplingParams
from deltaserve.batch import CacheBuffers, ForwardBatch
from deltaserve.config import ModelConfig
from deltaserve.models.loader import _OPTIONAL, load_model
from deltaserve.ops import select_kernels
from deltaserve.tokenizer import Tokenizer
from tests.conftest import check_greedy, hf_logprobs, hf_reference

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
EXPECTED = json.loads((DATA / "heldout_expected.json").read_text())
PROMPTS = ["The meaning of life is", "Once upon a time, there was a little girl who",
           "The President said on Tuesday that"]
# The 60 most frequent English words: real English has a third or more of its words among them, noise almost none.
COMMON_WORDS = set("""the of and to a in is you that it he was for on are as with his they i at be this have from or
one had by word but not what all were we when your can said there use an each which she do how their if will up other
about out many then them these so""".split())


def heldout_windows(tokenizer: Tokenizer) -> list[list[int]]:
    """The sample in consecutive windows of the training length, as `package` scored it."""
    ids = tokenizer.encode((DATA / "heldout.txt").read_text(), add_special_tokens=False)
    n = EXPECTED["seq_len"]
    return [ids[i : i + n] for i in range(0, len(ids), n) if len(ids[i : i + n]) >= 3]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", dtype="float32")  # no model given: the default


@pytest.fixture(scope="module")
def hf():
    return hf_reference(DEFAULT_MODEL_PATH)


@pytest.fixture(scope="module")
def model():
    return load_model(DEFAULT_MODEL_PATH, device="cpu", dtype=torch.float32, kernels=select_kernels("cpu"),
                      show_progress=False)


# ---- the shipped directory ---------------------------------------------------------------------------
def test_directory_is_a_complete_small_hf_checkpoint():
    files = {p.name for p in DEFAULT_MODEL_PATH.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "README.md"} <= files
    assert sum(p.stat().st_size for p in DEFAULT_MODEL_PATH.iterdir()) <= 40_000_000
    with safe_open(str(DEFAULT_MODEL_PATH / "model.safetensors"), framework="pt") as st:
        dtypes = {st.get_slice(name).get_dtype() for name in st.keys()}
        params = sum(math.prod(st.get_slice(name).get_shape()) for name in st.keys())
    assert dtypes == {"BF16"}
    assert 10e6 <= params <= 20e6
    digest = hashlib.sha256((DEFAULT_MODEL_PATH / "model.safetensors").read_bytes()).hexdigest()
    assert digest == EXPECTED["model_sha256"], "model changed: re-run `train_default_model.py package` to re-record"


def test_config_is_qwen3_next_hybrid_moe_with_mtp():
    raw = json.loads((DEFAULT_MODEL_PATH / "config.json").read_text())
    cfg = ModelConfig.from_hf(DEFAULT_MODEL_PATH)
    assert raw["model_type"] == "qwen3_next" and raw["architectures"] == ["Qwen3NextForCausalLM"]
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + (
        "full_attention",)
    assert all(cfg.moe_layers) and cfg.num_experts > cfg.num_experts_per_tok >= 2
    assert cfg.shared_expert_intermediate_size > 0
    assert cfg.mtp_num_layers == 1 and cfg.max_position_embeddings == 4096


def test_special_tokens_ids_and_generation_config_agree():
    tok = Tokenizer(DEFAULT_MODEL_PATH)
    raw = json.loads((DEFAULT_MODEL_PATH / "config.json").read_text())
    gen = json.loads((DEFAULT_MODEL_PATH / "generation_config.json").read_text())
    ids = {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                                          "<tool_call>", "</tool_call>")}
    assert None not in ids.values() and len(set(ids.values())) == len(ids)
    for t, i in ids.items():  # each is one token, also inside text
        assert tok.encode(f"a{t}b", add_special_tokens=False)[1] == i
    assert raw["eos_token_id"] == ids["<|im_end|>"] == tok.eos_token_id
    assert raw["bos_token_id"] == raw["pad_token_id"] == ids["<|endoftext|>"]
    assert set(gen["eos_token_id"]) == {ids["<|im_end|>"], ids["<|endoftext|>"]}
    assert tok.vocab_size == raw["vocab_size"]


def test_chat_template_matches_transformers_and_has_qwen_markup():
    from transformers import AutoTokenizer

    ours, theirs = Tokenizer(DEFAULT_MODEL_PATH), AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"celsius": 21}'},
        {"role": "assistant", "content": "It is 21 degrees.", "reasoning_content": "The tool said 21."},
        {"role": "user", "content": "Thanks!"},
    ]
    for kwargs in ({"tools": tools, "enable_thinking": False}, {"tools": None}, {"tools": tools}):
        rendered = ours.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        assert rendered == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    rendered = ours.apply_chat_template(messages, add_generation_prompt=True, tools=tools, enable_thinking=False)
    assert rendered.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in rendered
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in rendered
    assert "<|im_start|>user\n<tool_response>\n{\"celsius\": 21}\n</tool_response><|im_end|>" in rendered
    assert "The tool said 21." not in rendered  # reasoning before the last user turn is dropped
    assert rendered.endswith("<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


# ---- deltaserve runs it as transformers does -----------------------------------------------------------
def test_loads_every_tensor_and_the_mtp_head(model, caplog):
    with caplog.at_level(logging.WARNING):
        load_model(DEFAULT_MODEL_PATH, device="cpu", dtype=torch.float32, kernels=select_kernels("cpu"),
                   show_progress=False)
    assert not [r for r in caplog.records if "unexpected" in r.getMessage()]
    with safe_open(str(DEFAULT_MODEL_PATH / "model.safetensors"), framework="pt") as st:
        names = set(st.keys())
    expected = {n for n in model.checkpoint_weights(fused_experts=False) if n in names or not _OPTIONAL.search(n)}
    assert expected == names  # nothing missing, nothing ignored (optional: the FP8 KV multipliers)
    assert model.mtp is not None and len(model.mtp.layers) == 1
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.experts.0.gate_proj.weight",
            "mtp.layers.0.mlp.shared_expert_gate.weight", "mtp.layers.0.input_layernorm.weight"} <= names


def test_default_llm_writes_english(llm):
    assert Path(llm.model_path) == DEFAULT_MODEL_PATH
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    words = [w for o in outs for w in re.findall(r"[a-z']+", o.outputs[0].text.lower())]
    assert len(words) >= 30
    share = sum(w in COMMON_WORDS for w in words) / len(words)
    assert share >= 0.25, f"only {share:.0%} common English words in {[o.outputs[0].text for o in outs]}"


def test_greedy_matches_transformers(llm, hf):
    n = 24
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    for out in outs:
        tokens = out.outputs[0].token_ids
        assert len(tokens) == n
        check_greedy(hf_logprobs(hf, out.prompt_token_ids + tokens), len(out.prompt_token_ids), tokens)


def test_heldout_perplexity_matches_transformers_and_the_recorded_value(llm, hf):
    windows = heldout_windows(llm.tokenizer)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ours = theirs = 0.0
    count = 0
    for w, out in zip(windows, outs):
        ours -= sum(pos[t].logprob for pos, t in zip(out.prompt_logprobs[1:], w[1:]))
        lp = hf_logprobs(hf, w)
        theirs -= float(lp[torch.arange(len(w) - 1), torch.tensor(w[1:])].sum())
        count += len(w) - 1
    assert count == EXPECTED["scored_tokens"]
    ppl, ppl_hf = math.exp(ours / count), math.exp(theirs / count)
    assert abs(ppl / ppl_hf - 1) < 0.005, (ppl, ppl_hf)
    assert ppl <= EXPECTED["ppl_transformers_fp32"] * 1.02, (ppl, EXPECTED["ppl_transformers_fp32"])


# ---- the MTP drafter ---------------------------------------------------------------------------------------
def _prefill_batch(tokens: torch.Tensor, block_size: int) -> ForwardBatch:
    n = len(tokens)
    return ForwardBatch(
        input_ids=tokens, positions=torch.arange(n), cu_seqlens=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), state_slots=torch.tensor([0], dtype=torch.int32),
        has_initial_state=torch.tensor([False]), slot_mapping=torch.arange(n),
        block_tables=torch.arange(-(-n // block_size), dtype=torch.int32)[None], num_prefills=1,
        num_prefill_tokens=n)


def mtp_hidden(model, window: list[int]) -> torch.Tensor:
    """deltaserve's MTP output at positions t = 0..n-3: from token t+1's embedding and the main model's final
    hidden state at t, predicting token t+2 (model_spec.md §7)."""
    bs, ids = 16, torch.tensor(window)
    cfg = model.config
    blocks = -(-len(window) // bs)
    cache = CacheBuffers.allocate(cfg, num_slots=1, num_blocks=blocks, block_size=bs, device="cpu",
                                  dtype=torch.float32)
    mtp_cache = CacheBuffers.allocate(cfg, num_slots=1, num_blocks=blocks, block_size=bs, device="cpu",
                                      dtype=torch.float32, num_attention_layers=1)
    with torch.inference_mode():
        hidden = model(_prefill_batch(ids, bs), cache)
        n = len(window) - 2
        return model.mtp(model.embed_tokens[ids[1 : n + 1]], hidden[:n], _prefill_batch(ids[1 : n + 1], bs),
                         mtp_cache.kv[0], model.rope)


def test_mtp_head_predicts_next_next_token_well_above_unigram(model, llm):
    hits = unigram = total = 0
    for w in heldout_windows(llm.tokenizer):
        with torch.inference_mode():
            predicted = model.compute_logits(mtp_hidden(model, w)).argmax(-1)
        target = torch.tensor(w[2:])
        hits += int((predicted == target).sum())
        unigram += int((target == EXPECTED["unigram_token"]).sum())
        total += len(target)
    acc, base = hits / total, unigram / total
    assert base == pytest.approx(EXPECTED["unigram_accuracy"])
    assert acc >= max(2 * base, base + 0.08), (acc, base)
    assert acc == pytest.approx(EXPECTED["mtp_next_next_accuracy"], abs=0.01)


def test_mtp_head_matches_the_training_module(model, hf, llm, monkeypatch):
    """deltaserve's MTPHead == the module the training script trained (transformers' layers), in fp32."""
    spec = importlib.util.spec_from_file_location("train_default_model", REPO / "scripts" / "train_default_model.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclasses look their module up there
    spec.loader.exec_module(script)
    from safetensors.torch import load_file

    trained = script.build_mtp(hf.config).eval()
    script.reload_weights(hf, trained, load_file(str(DEFAULT_MODEL_PATH / "model.safetensors")))
    w = heldout_windows(llm.tokenizer)[0][:200]
    x = torch.tensor([w])
    n = len(w) - 2
    with torch.no_grad():
        h = hf.model(input_ids=x).last_hidden_state
        ref = trained(hf.model.embed_tokens(x[:, 1 : n + 1]), h[:, :n],
                      hf.model.rotary_emb(h, torch.arange(n)[None]))[0]
    ours = mtp_hidden(model, w)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
