"""Structured output, logit_bias and bad_words through the engine (the byte-level tiny model: one token per
byte, so grammars are exercised character by character)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from deltaserve.llm import LLM
from deltaserve.ops.sampling.reference import apply_token_bitmask
from deltaserve.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "blue"]},
        "pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                "name": {"type": "string", "pattern": "^[a-z]{1,3}$"}},
               "required": ["x", "name"], "additionalProperties": False},
        "list": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["id", "ok", "tag", "pt", "list"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(byte_model):
    return LLM(byte_model, device="cpu")


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_json_schema_outputs_validate_n50(llm):
    params = SamplingParams(n=50, temperature=1.0, seed=7, max_tokens=120,
                            structured_outputs=so(json=SCHEMA, disable_any_whitespace=True))
    out = gen(llm, ["{"], params)[0]
    assert len(out.outputs) == 50
    texts = set()
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
        texts.add(c.text)
    assert len(texts) > 10                 # really sampled, not one forced string


def test_regex_choice_json_object_and_grammar(llm):
    outs = gen(llm, ["a", "b", "c", "d"], [
        SamplingParams(n=4, seed=1, max_tokens=20, structured_outputs=so(regex=r"[0-9]{3}-[a-z]{2}")),
        SamplingParams(n=4, seed=2, max_tokens=20, structured_outputs=so(choice=["yes", "no", "maybe not"])),
        SamplingParams(n=2, seed=3, max_tokens=60, structured_outputs=so(json_object=True)),
        SamplingParams(n=2, seed=4, max_tokens=20, structured_outputs=so(grammar='root ::= "x" [ab]+ "y"')),
    ])
    import re

    for c in outs[0].outputs:
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", c.text) and c.finish_reason == "stop"
    for c in outs[1].outputs:
        assert c.text in ("yes", "no", "maybe not") and c.finish_reason == "stop"
    for c in outs[2].outputs:            # may be cut by max_tokens; a finished one is an object
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.text.lstrip().startswith("{")
    for c in outs[3].outputs:
        assert re.fullmatch(r"x[ab]+y", c.text) or (c.finish_reason == "length" and re.fullmatch(r"x[ab]*", c.text))


def test_free_requests_unchanged_beside_constrained(llm):
    free = [SamplingParams(seed=11, max_tokens=12, ignore_eos=True), SamplingParams(temperature=0, max_tokens=12,
                                                                                    ignore_eos=True)]
    alone = [gen(llm, ["hello"], p)[0].outputs[0].token_ids for p in free]
    constrained = SamplingParams(n=3, seed=5, max_tokens=12, structured_outputs=so(regex=r"[a-c]{1,12}"))
    mixed = gen(llm, ["hello", "abc", "hello"], [free[0], constrained, free[1]])
    assert mixed[0].outputs[0].token_ids == alone[0]
    assert mixed[2].outputs[0].token_ids == alone[1]
    assert all(set(c.text) <= set("abc") for c in mixed[1].outputs)


def test_async_scheduling_matches_sync(byte_model, llm):
    params = SamplingParams(n=4, seed=9, max_tokens=40, structured_outputs=so(json=SCHEMA, disable_any_whitespace=True))
    free = SamplingParams(seed=3, max_tokens=20, ignore_eos=True)
    sync = gen(llm, ["{", "x"], [params, free])
    async_llm = LLM(byte_model, device="cpu", async_scheduling=True)
    got = gen(async_llm, ["{", "x"], [params, free])
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in sync]


def test_grammar_end_stops_even_with_ignore_eos(llm):
    out = gen(llm, ["q"], SamplingParams(n=3, seed=1, max_tokens=30, ignore_eos=True,
                                         structured_outputs=so(choice=["alpha", "be"])))[0]
    for c in out.outputs:
        assert c.finish_reason == "stop"
        assert llm.tokenizer.decode(c.token_ids) in ("alpha", "be")


def test_bad_grammar_is_a_value_error_naming_the_field(llm):
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        llm.engine.add_request("bad-re", "x", SamplingParams(structured_outputs=so(regex="([a-")))
    with pytest.raises(ValueError, match=r"structured_outputs\.json"):
        llm.engine.add_request("bad-js", "x", SamplingParams(structured_outputs=so(json={"type": "nonsense"})))
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar"):
        llm.engine.add_request("bad-g", "x", SamplingParams(structured_outputs=so(grammar="root ::= undefined_rule")))
    assert not llm.engine.has_unfinished_requests()


def test_structured_params_validation():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=so(regex="a+"))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: float("nan")})
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["  "])


def test_logit_bias(llm):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    base = gen(llm, ["hello"], greedy)[0].outputs[0].token_ids
    forced = gen(llm, ["hello"], greedy.clone(logit_bias={ord("z"): 100.0}))[0].outputs[0].token_ids
    assert forced == [ord("z")] * 8
    banned = gen(llm, ["hello"], greedy.clone(logit_bias={base[0]: -100.0}))[0].outputs[0].token_ids
    assert banned[0] != base[0]
    with pytest.raises(ValueError, match="logit_bias"):
        llm.engine.add_request("lb", "x", SamplingParams(logit_bias={10_000: 1.0}))


def test_bad_words(llm):
    """Biased towards 'a', then 'b': banning "aa" bans 'a' right after an 'a' only; banning "a" always."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={ord("a"): 60.0, ord("b"): 50.0})
    assert gen(llm, ["x"], greedy)[0].outputs[0].text == "a" * 8
    assert gen(llm, ["x"], greedy.clone(bad_words=["aa"]))[0].outputs[0].text == "ab" * 4
    assert gen(llm, ["x"], greedy.clone(bad_words=["a"]))[0].outputs[0].text == "b" * 8
    assert gen(llm, ["a"], greedy.clone(bad_words=["aa"]))[0].outputs[0].text.startswith("a")  # the prompt is not output
    with pytest.raises(ValueError, match="bad_words"):
        _ = SamplingParams(bad_words=["x"]).bad_words_token_ids                       # not resolved


def test_apply_token_bitmask_reference():
    torch.manual_seed(0)
    logits = torch.randn(3, 70)
    allowed = torch.rand(2, 70) < 0.3
    words = torch.zeros(2, 3, dtype=torch.int64)
    for r in range(2):
        for t in range(70):
            if allowed[r, t]:
                words[r, t // 32] |= 1 << (t % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    out = logits.clone()
    apply_token_bitmask(out, bitmask, torch.tensor([2, 0]))
    assert torch.equal(out[1], logits[1])
    for mrow, lrow in ((0, 2), (1, 0)):
        assert torch.equal(out[lrow] == float("-inf"), ~allowed[mrow])
        assert torch.equal(out[lrow][allowed[mrow]], logits[lrow][allowed[mrow]])


def test_sampler_bitmask_equals_reference():
    """The sampler's CPU path (xgrammar's kernel) bans exactly what the torch reference bans, on a subset of rows."""
    from deltaserve.runner.sampler import _apply_bitmask

    torch.manual_seed(1)
    logits = torch.randn(4, 100)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 4), dtype=torch.int32)
    want = logits.clone()
    apply_token_bitmask(want, bitmask, torch.tensor([3, 1]))
    got = logits.clone()
    _apply_bitmask(got, bitmask, [3, 1])
    assert torch.equal(got, want)
    want, got = logits[:2].clone(), logits[:2].clone()
    apply_token_bitmask(want, bitmask)
    _apply_bitmask(got, bitmask, [0, 1])
    assert torch.equal(got, want)


def test_draft_masks_match_sequential(llm):
    """The speculative-decoding API: len(draft) + 1 masks per sequence equal those of accepting the draft
    one token at a time, and the matcher is left where it was."""
    mgr = llm.engine.grammars.manager()
    grammar = mgr.compile(so(regex=r"ab[0-9]+c"))
    mgr.add(-1, grammar, "regex")
    mgr.add(-2, grammar, "regex")
    try:
        draft = [ord("a"), ord("b"), ord("7")]
        masks = mgr.fill([-1], [draft])
        assert masks.shape[0] == 4
        for i, tok in enumerate(draft):
            assert torch.equal(mgr.fill([-2])[0], masks[i])
            assert not mgr.accept(-2, tok)
        assert torch.equal(mgr.fill([-2])[0], masks[3])
        assert torch.equal(mgr.fill([-1])[0], masks[0])       # rolled back
    finally:
        mgr.remove(-1)
        mgr.remove(-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_constrained_on_cuda_async_matches_cpu(byte_model, llm):
    """On CUDA (async scheduling, masks filled while the GPU runs): constrained outputs validate, and a greedy
    free request beside them equals the CPU engine's (the byte model's logits are far from ties)."""
    gpu = LLM(byte_model, device="cuda", dtype="float32", async_scheduling=True)
    params = [SamplingParams(n=8, seed=2, max_tokens=120, structured_outputs=so(json=SCHEMA, disable_any_whitespace=True)),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    got = gen(gpu, ["{", "x"], params)
    for c in got[0].outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert got[1].outputs[0].token_ids == gen(llm, ["x"], params[1])[0].outputs[0].token_ids


@pytest.mark.parametrize("template", ["hermes json", "<function= xml"])
@pytest.mark.parametrize("in_reasoning", [False, True])
def test_tool_call_grammar_accepts_what_the_parser_reads(llm, template, in_reasoning):
    """The forced-call grammar of each Qwen style accepts the canonical call text (after the reasoning's end
    when the prompt opened <think>), then only the end of the sequence; QwenToolParser parses that text back."""
    from deltaserve.server.tool_parsers import QwenToolParser, ToolCallDelta
    from deltaserve.structured.tool_calls import tool_call_constraint

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}}}]
    if "xml" in template:
        call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
                "</parameter>\n</function>\n</tool_call>")
    else:
        call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    text = ("hmm</think>" if in_reasoning else "") + call
    mgr = llm.engine.grammars.manager()
    grammar = mgr.compile(tool_call_constraint(template, tools, "required", False, in_reasoning))
    mgr.add(-9, grammar, "structural_tag")
    try:
        for tok in llm.tokenizer.encode(text, add_special_tokens=False):
            assert not mgr.accept(-9, tok)
        eos = min(llm.engine.eos_token_ids)
        mask = mgr.fill([-9])[0]
        allowed = [t for t in range(llm.config.vocab_size) if (int(mask[t // 32]) >> (t % 32)) & 1]
        assert allowed == sorted(llm.engine.eos_token_ids)          # one call, then only the end
        assert mgr.accept(-9, eos)
    finally:
        mgr.remove(-9)
    parser = QwenToolParser(tools)
    events = parser.feed(call) + parser.finish()
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    assert deltas[0].name == "get_weather"
    assert json.loads("".join(d.arguments for d in deltas)) == {"city": "Paris", "days": 3}
