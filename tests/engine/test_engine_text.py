"""Text in and out: tokenized prompts, incremental detokenization (multi-byte characters), stop strings cut
before the match, streamed text never retracted, decoded logprob tokens."""

from __future__ import annotations

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def llm(byte_model):
    return LLM(byte_model, device="cpu")


def greedy_text(llm, prompt, n=48, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw), use_tqdm=False)[0]


def pick_stop(text: str, start: int) -> tuple[str, int]:
    """A 2-character stop string first occurring at or after `start`, free of replacement characters."""
    for k in range(start, len(text) - 2):
        s = text[k : k + 2]
        if "\ufffd" not in s and text.find(s) == k:
            return s, k
    pytest.skip("no usable stop string in this output")


def test_text_prompt_is_tokenized_and_echoed(llm):
    out = greedy_text(llm, "Hello wörld", n=4)
    assert out.prompt == "Hello wörld"
    assert out.prompt_token_ids == list("Hello w".encode()) + list("ö".encode()) + list("rld".encode())


def test_stop_string_cuts_the_text_and_the_generation(llm):
    full = greedy_text(llm, "The stop test")
    stop, k = pick_stop(full.outputs[0].text, 6)
    cut = greedy_text(llm, "The stop test", stop=[stop]).outputs[0]
    assert cut.text == full.outputs[0].text[:k]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.token_ids == full.outputs[0].token_ids[: len(cut.token_ids)]
    assert len(cut.token_ids) < len(full.outputs[0].token_ids)
    kept = greedy_text(llm, "The stop test", stop=[stop], include_stop_str_in_output=True).outputs[0]
    assert kept.text == full.outputs[0].text[: k + len(stop)] and kept.token_ids == cut.token_ids


def test_streamed_text_is_never_retracted(byte_model):
    engine = LLMEngine.from_args(byte_model, device="cpu")
    full = ""
    engine.add_request("probe", "abc", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    while engine.has_unfinished_requests():
        for o in engine.step():
            full = o.outputs[0].text
    stop, _ = pick_stop(full, 10)
    engine.add_request("s", "abc", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "\x00zz"]))
    texts = []
    while engine.has_unfinished_requests():
        texts.extend(o.outputs[0].text for o in engine.step())
    for a, b in zip(texts, texts[1:]):
        assert b.startswith(a), "streamed text was retracted"
    assert not texts[-1].endswith(stop)


def test_min_tokens_delays_stop_strings(llm):
    full = greedy_text(llm, "xyz").outputs[0]
    stop, k = pick_stop(full.text, 0)
    # with min_tokens covering the first occurrence's tokens, the stop string is not searched there
    n_before = len(greedy_text(llm, "xyz", stop=[stop]).outputs[0].token_ids)
    late = greedy_text(llm, "xyz", stop=[stop], min_tokens=n_before + 1).outputs[0]
    assert len(late.token_ids) > n_before


def test_logprobs_carry_decoded_tokens(llm):
    out = greedy_text(llm, "hi", n=3, logprobs=2, prompt_logprobs=1)
    entry = out.outputs[0].logprobs[0]
    assert all(lp.decoded_token is not None for lp in entry.values())
    tok = out.outputs[0].token_ids[0]
    assert entry[tok].decoded_token == llm.tokenizer.decode([tok], skip_special_tokens=False)
    assert out.prompt_logprobs[0] is None and out.prompt_logprobs[1][ord("i")].decoded_token == "i"


def test_detokenize_false_gives_tokens_only(llm):
    out = greedy_text(llm, "hi", n=5, detokenize=False).outputs[0]
    assert out.text == "" and len(out.token_ids) == 5
    with pytest.raises(ValueError, match="detokenize"):
        greedy_text(llm, "hi", n=5, detokenize=False, stop=["x"])


def test_eos_from_the_tokenizer_config_is_a_stop_token(llm):
    assert 256 in llm.engine.eos_token_ids


# ---- the detokenizer alone --------------------------------------------------------------------

def test_detokenizer_waits_for_complete_characters(byte_model):
    tok = Tokenizer(byte_model)
    d = IncrementalDetokenizer(tok, list(b"say: "))
    seen = []
    for b in "wö✓!".encode():
        d.add_token(b)
        seen.append(d.text)
    assert seen == ["w", "w", "wö", "wö", "wö", "wö✓", "wö✓!"]


def test_detokenizer_stop_across_tokens_and_holdback(byte_model):
    tok = Tokenizer(byte_model)
    d = IncrementalDetokenizer(tok, [], stop=["END", "x"])
    for b in b"abcE":
        assert not d.add_token(b)
    assert d.text == "abcE" and d.stream_text == "abc"     # "E" may start "END"
    assert not d.add_token(ord("N"))
    assert d.stream_text == "abc"
    assert d.add_token(ord("D"))
    assert d.text == "abc" and d.stop_reason == "END"
    keep = IncrementalDetokenizer(tok, [], stop=["END"], include_stop_str_in_output=True)
    hits = [keep.add_token(b) for b in b"zzEND"]
    assert hits == [False] * 4 + [True] and keep.text == "zzEND"
    quiet = IncrementalDetokenizer(tok, [], stop=["zz"])
    assert not quiet.add_token(ord("z"), check_stop=False) and not quiet.add_token(ord("z"), check_stop=False)
    assert quiet.text == "zz" and quiet.stop_reason is None


def test_detokenizer_matches_whole_decode_on_a_real_bpe_tokenizer():
    """The embedded model's byte-level BPE: token-at-a-time text equals decoding everything at once, across
    multi-byte characters split over tokens and a leading space that depends on the prompt."""
    from pathlib import Path

    import deltaserve

    tok = Tokenizer(Path(deltaserve.__file__).parent / "default_model")
    prompt = tok.encode("Answer:", add_special_tokens=False)
    text = " Grüße, 世界! 🤖🚀 tabs\tand  spaces; naïve café — done."
    gen = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt)
    for t in gen:
        d.add_token(t)
    whole = tok.decode(prompt + gen)
    assert d.text == whole[len(tok.decode(prompt)):] == text
