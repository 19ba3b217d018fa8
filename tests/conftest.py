"""Shared fixtures: tiny random checkpoints of each family, built and saved by transformers itself, in the
layouts published checkpoints use (flat Qwen3-Next, nested vision-language Qwen3.5, text-only Qwen3.5,
sharded, fused experts, an MTP head), plus the transformers reference run on them."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No compiled CPU decode step (an inductor compile per engine) except in tests/runner/test_cpu_compile.py.
os.environ.setdefault("DELTASERVE_COMPILE", "off")
# One intra-op thread: the tensors here are tiny, and OpenMP spin-waits collapse when the two cores
# are shared with a server subprocess or another job.
torch.set_num_threads(1)


@dataclasses.dataclass(frozen=True)
class TinySpec:
    family: str = "qwen3_next"        # qwen3_next | qwen3_5 | qwen3_5_moe
    layout: str = "native"            # native (flat Next / nested VLM 3.5) | text (Qwen3_5*ForCausalLM)
    ratio: int = 2                    # linear value heads / key heads
    tie: bool = False
    num_layers: int = 4
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    norm_topk_prob: bool = True
    shards: bool = False              # save with a small max_shard_size (index.json + several files)
    fused_experts: bool = False       # rewrite experts as experts.gate_up_proj / experts.down_proj
    mtp: bool = False                 # add an mtp.* head (model_spec.md §2.7)
    seed: int = 0
    vocab: int = 160
    gdn_head_dim: int = 16            # linear key and value head dim
    attn_head_dim: int = 32


def _text_config(spec: TinySpec) -> dict:
    cfg = dict(
        vocab_size=spec.vocab, hidden_size=64, num_hidden_layers=spec.num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=spec.attn_head_dim, linear_num_key_heads=2,
        linear_num_value_heads=2 * spec.ratio, linear_key_head_dim=spec.gdn_head_dim,
        linear_value_head_dim=spec.gdn_head_dim, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=spec.tie, initializer_range=0.08,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    if spec.family != "qwen3_5":
        cfg.update(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    if spec.family in ("qwen3_5", "qwen3_next"):
        cfg.update(intermediate_size=96)
    if spec.family == "qwen3_next":
        cfg.update(mlp_only_layers=list(spec.mlp_only_layers), decoder_sparse_step=spec.decoder_sparse_step,
                   norm_topk_prob=spec.norm_topk_prob)
    return cfg


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Random values for the parameters transformers initialises to constants (norm weights, dt_bias),
    so a mix-up between zero-centred and plain norms, or a dropped bias, shows in the logits."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or "lm_head" in name:
                p.mul_(4.0)  # peakier logits: greedy decisions far from ties


def build_hf_model(spec: TinySpec):
    import transformers as tf

    torch.manual_seed(spec.seed)
    text = _text_config(spec)
    if spec.family == "qwen3_next":
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**text))
    elif spec.layout == "text":
        cls = tf.Qwen3_5ForCausalLM if spec.family == "qwen3_5" else tf.Qwen3_5MoeForCausalLM
        cfg_cls = tf.Qwen3_5TextConfig if spec.family == "qwen3_5" else tf.Qwen3_5MoeTextConfig
        model = cls(cfg_cls(**text))
    else:
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
        if spec.family == "qwen3_5":
            cfg = tf.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=spec.tie)
            model = tf.Qwen3_5ForConditionalGeneration(cfg)
        else:
            cfg = tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=spec.tie)
            model = tf.Qwen3_5MoeForConditionalGeneration(cfg)
    _perturb(model, spec.seed)
    return model.eval()


def save_tiny(spec: TinySpec, path: Path) -> Path:
    model = build_hf_model(spec)
    model.save_pretrained(path, max_shard_size="60KB" if spec.shards else "5GB")
    if spec.fused_experts or spec.mtp:
        _rewrite_tensors(path, spec)
    return path


def _rewrite_tensors(path: Path, spec: TinySpec) -> None:
    """Post-process a single-file save: fuse per-expert tensors and/or add an MTP head."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    assert file.is_file(), "rewrite needs a single-file checkpoint"
    tensors = load_file(str(file))
    if spec.fused_experts:
        tensors = _fuse_experts(tensors)
    if spec.mtp:
        tensors.update(_mtp_tensors(tensors, spec))
    save_file(tensors, str(file), metadata={"format": "pt"})


def _fuse_experts(tensors: dict) -> dict:
    out, groups = {}, {}
    for name, t in tensors.items():
        if ".mlp.experts." in name and name.endswith("_proj.weight"):
            prefix, rest = name.split(".mlp.experts.")
            e, proj = rest.split(".")[:2]
            groups.setdefault(prefix, {}).setdefault(proj, {})[int(e)] = t
        else:
            out[name] = t
    for prefix, projs in groups.items():
        n = len(projs["gate_proj"])
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in range(n)]).contiguous()
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)]).contiguous()
    return out


def _mtp_tensors(tensors: dict, spec: TinySpec) -> dict:
    """An MTP head per model_spec.md §2.7: one full-attention decoder layer (copied from the last main
    layer, which is full attention) plus fc [H, 2H], the two pre-fc norms and a final norm."""
    prefix = "model." if spec.family == "qwen3_next" else "model.language_model."
    src = f"{prefix}layers.{spec.num_layers - 1}."
    g = torch.Generator().manual_seed(7)
    h = tensors[f"{prefix}norm.weight"].shape[0]
    mtp = {"mtp.layers.0." + n[len(src):]: t.clone() for n, t in tensors.items() if n.startswith(src)}
    mtp["mtp.fc.weight"] = 0.05 * torch.randn(h, 2 * h, generator=g)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = 0.1 * torch.randn(h, generator=g)
    return mtp


_CACHE: dict[TinySpec, Path] = {}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(TinySpec(...)) -> path of a saved checkpoint (built once per session per spec)."""

    def make(spec: TinySpec = TinySpec()) -> Path:
        if spec not in _CACHE:
            _CACHE[spec] = save_tiny(spec, tmp_path_factory.mktemp(f"{spec.family}-{spec.layout}"))
        return _CACHE[spec]

    return make


def hf_reference(path: Path, dtype: torch.dtype = torch.float32, **kwargs):
    """The transformers model for a checkpoint dir, in `dtype`, eager attention (the oracle); kwargs go to
    from_pretrained."""
    import transformers as tf

    config = json.loads((path / "config.json").read_text())
    cls = tf.AutoModelForImageTextToText if "text_config" in config else tf.AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=dtype, attn_implementation="eager", **kwargs)
    return model.eval()


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids], device=model.device)).logits[0].float().log_softmax(-1)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        # An explicit mask: generate() would otherwise infer padding from pad_token_id occurrences.
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def check_greedy(hf_lp: torch.Tensor, prompt_len: int, continuation: list[int], tie: float = 1e-5) -> None:
    """Teacher-forced greedy check: with hf_lp the transformers logprobs over prompt + continuation, each
    continuation token must be transformers' argmax at its step, which is exactly what transformers'
    greedy generate() would produce (generate == forward argmax, checked separately); a token within `tie`
    of the argmax counts as a tie."""
    for j, token in enumerate(continuation):
        row = hf_lp[prompt_len - 1 + j]
        best = int(row.argmax())
        assert token == best or abs(float(row[token] - row[best])) < tie, (
            f"greedy token {j} after a {prompt_len}-token prompt: deltaserve {token}, transformers {best} "
            f"(margin {float(row[best] - row[token]):.3g})")


def random_ids(n: int, vocab: int = 160, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


TOKENIZER_TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "To be or not to be, that is the question. All that glitters is not gold. Héllo wörld, ünïcode ✓ 你好."
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def add_tiny_tokenizer(path: Path, vocab_size: int = 300) -> Path:
    """Write a byte-level BPE tokenizer (Qwen style special tokens, a chat template) into a model dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TOKENIZER_TEXT] * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE}))
    return path


@pytest.fixture(scope="session")
def tiny_model_with_tokenizer(tiny_model, tmp_path_factory):
    import shutil

    dst = tmp_path_factory.mktemp("with-tokenizer") / "model"
    shutil.copytree(tiny_model(TinySpec(family="qwen3_next", ratio=2, vocab=320, seed=9)), dst)
    return add_tiny_tokenizer(dst)


def has_cuda() -> bool:
    return torch.cuda.is_available()


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
