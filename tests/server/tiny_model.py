"""A tiny model directory for server tests: a BPE tokenizer trained here on a few sentences, with Qwen's
special tokens and a Qwen-style chat template (tools, <think>, enable_thinking), plus a tiny random
dense Qwen3.5 checkpoint saved by transformers."""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]   # plain added tokens, as in Qwen's tokenizers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the weather like in Paris today? It is sunny and warm.",
    "Tell me a story about a dragon and a knight who became friends.",
    "The answer is 4. Two plus two makes four, and three plus three makes six.",
    "user assistant system tool function parameter arguments name city days unit",
    '{"name": "get_weather", "arguments": {"city": "Paris"}} <function=get_weather> <parameter=city>',
    "Hello! How can I help you today? I am a helpful assistant.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation , . ; : ! ? ( ) [ ] { } < > = + - * /",
]

# A Qwen3.5-style template: tools in the system turn, tool calls as <tool_call> JSON, reasoning of the
# last assistant turn in <think>, and a generation prompt that opens <think> unless enable_thinking=false.
CHAT_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call one or more functions. Signatures:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\nAnswer a call with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}{{- raise_exception('the system message must come first') }}{%- endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if message.reasoning_content and loop.last %}
{{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' }}
{%- endif %}
{{- message.content }}
{%- for tc in message.tool_calls or [] %}
{{- '\n<tool_call>\n{"name": "' + tc.function.name + '", "arguments": ' }}
{{- (tc.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{%- if not loop.last or add_generation_prompt %}{{- '<|im_end|>\n' }}{%- endif %}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}
{%- else %}{{- '<think>\n' }}{%- endif %}
{%- endif %}
"""


def build_tokenizer(path: Path) -> int:
    """Write tokenizer.json + tokenizer_config.json into `path`; returns the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=380, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "add_bos_token": False,
              "chat_template": CHAT_TEMPLATE.strip(), "model_max_length": 512}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return tok.get_vocab_size(with_added_tokens=True)


def build_model_dir(path: Path) -> Path:
    """Tokenizer + a tiny random dense Qwen3.5 text checkpoint (3 GDN layers + 1 attention layer)."""
    import torch
    import transformers as tf

    vocab = build_tokenizer(path)
    eos = json.loads((path / "tokenizer.json").read_text())
    eos_id = next(t["id"] for t in eos["added_tokens"] if t["content"] == "<|im_end|>")
    torch.manual_seed(0)
    config = tf.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, intermediate_size=96, max_position_embeddings=4096,
        initializer_range=0.08, eos_token_id=eos_id, bos_token_id=None, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    model = tf.Qwen3_5ForCausalLM(config)
    with torch.no_grad():  # peakier logits: greedy choices far from ties, so batching can't flip them
        for name, p in model.named_parameters():
            if "embed_tokens" in name or "lm_head" in name:
                p.mul_(4.0)
    model.save_pretrained(path)
    return path


if __name__ == "__main__":
    import sys

    print(build_model_dir(Path(sys.argv[1])))
