"""A tiny hybrid checkpoint with a real tokenizer (byte-level, 256 byte tokens + 2 specials), for the tests
that need text: stop strings, incremental detokenization, EOS from tokenizer_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

EOS = "<|endoftext|>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


def save_byte_tokenizer(path: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS, special=True), AddedToken("<|im_end|>", special=True)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "add_bos_token": False}))


@pytest.fixture(scope="session")
def byte_model(tmp_path_factory) -> Path:
    """A Qwen3-Next-shaped model (3 GDN + 1 attention layer, dense MLP) over 258 tokens, with tokenizer."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen3NextConfig(
        vocab_size=258, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0,
        max_position_embeddings=2048, initializer_range=0.08, eos_token_id=256)
    model = tf.Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(4.0)   # peaky logits: greedy far from ties
        model.lm_head.weight.mul_(4.0)
    path = tmp_path_factory.mktemp("byte-model")
    model.save_pretrained(path)
    save_byte_tokenizer(path)
    return path


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """Tiny models run fastest on one thread, and intra-op threads collapse on a shared, oversubscribed CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
