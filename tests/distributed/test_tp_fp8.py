"""Tensor / expert parallelism with block-FP8 weights (gloo, two CPU ranks): each rank holds its slices of the
e4m3 values with their checkpoint blocks' multipliers (the tiny checkpoints' tensors are narrower than one
128-block, so every split cuts a block: the block's multiplier lives on both ranks), and the TP = 2 / EP = 2
engine gives the TP = 1 FP8 engine's greedy tokens and prompt logprobs (fp32, within 1e-4). Online FP8
quantises each rank's shard; a shard that would put two checkpoint blocks in one scale group is refused."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.distributed.parallel import ShardingError
from deltaserve.layers.weights import Slices, fp8_shard_dense, fp8_shard_rows
from deltaserve.ops.quant.fp8 import dequantize_blocks, dequantize_packed, quantize_blocks
from tests.conftest import TinySpec, random_ids
from tests.models.fp8_checkpoints import write_fp8_checkpoint

ENGINE = {"device": "cpu", "dtype": "float32", "max_num_batched_tokens": 32, "max_num_seqs": 4, "block_size": 16}
PARAMS = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0, ignore_eos=True)
PROMPT_LENGTHS = (5, 40, 19)


def _run(llm: LLM):
    prompts = [random_ids(n, seed=n) for n in PROMPT_LENGTHS]
    return prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)


def _assert_same(ref, ours) -> None:
    prompts, ref_outs = ref
    for ids, a, b in zip(prompts, ref_outs, ours[1]):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        err = max(abs(a.prompt_logprobs[i][ids[i]].logprob - b.prompt_logprobs[i][ids[i]].logprob)
                  for i in range(1, len(ids)))
        assert err < 1e-4, f"prompt logprobs of a {len(ids)}-token prompt differ by {err}"


@pytest.mark.parametrize("spec,ep", [
    (TinySpec(family="qwen3_next", ratio=2, mtp=True, seed=2), False),
    (TinySpec(family="qwen3_5", ratio=3, seed=3), False),
    (TinySpec(family="qwen3_5_moe", ratio=2, fused_experts=True, seed=5), False),
    (TinySpec(family="qwen3_5_moe", ratio=2, fused_experts=True, seed=5), True),
    (TinySpec(family="qwen3_next", ratio=2, mtp=True, seed=2), True),
], ids=["next-tp2", "qwen3_5-tp2", "qwen3_5_moe-tp2", "qwen3_5_moe-ep2", "next-ep2"])
def test_fp8_checkpoint_tp2_matches_tp1(tiny_model, tmp_path, spec, ep):
    path = write_fp8_checkpoint(tiny_model(spec), tmp_path / "fp8")
    ref = _run(LLM(path, **ENGINE))
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=ep, **ENGINE)
    try:
        model = llm.model
        assert model.layers[-1].self_attn.o_proj.is_fp8
        assert model.mtp is None or model.mtp.layers[0].self_attn.o_proj.is_fp8
        _assert_same(ref, _run(llm))
    finally:
        llm.shutdown()


def test_online_fp8_tp2_quantises_each_shard(tiny_model):
    """Online FP8 under TP: each rank's holders are its dense shard quantised in its own blocks (not the
    TP = 1 blocks, so tokens may differ from TP = 1: checked against the rank's own shard instead)."""
    path = tiny_model(TinySpec(family="qwen3_5", ratio=3, seed=3))
    dense = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        rank0_dense = dense.model.layers[-1].mlp.down_proj.weight.detach().clone()
        rank0_o = dense.model.layers[-1].self_attn.o_proj.weight.detach().clone()
    finally:
        dense.shutdown()
    llm = LLM(path, tensor_parallel_size=2, quantization="fp8", **ENGINE)
    try:
        layer = llm.model.layers[-1]
        for holder, shard in ((layer.mlp.down_proj.weight, rank0_dense), (layer.self_attn.o_proj.weight, rank0_o)):
            q, s = quantize_blocks(shard, (128, holder.col_group))
            assert torch.equal(holder.dequantize(), dequantize_blocks(q, s, (128, holder.col_group)))
        out = llm.generate({"prompt_token_ids": random_ids(20, seed=1)}, PARAMS, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == PARAMS.max_tokens
    finally:
        llm.shutdown()


def _checkpoint(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.linspace(0.1, 4.0, n)[:, None] * torch.linspace(0.2, 3.0, k)
    return quantize_blocks(w)


@pytest.mark.parametrize("dim,ranges", [(0, ((64, 192),)), (0, ((0, 64), (256, 320))), (1, ((192, 320),)),
                                        (1, ((64, 128), (320, 384)))])
def test_an_fp8_shard_carries_its_blocks_multipliers(dim, ranges):
    """Any row / column ranges, also ones cutting 128-blocks: the shard's packed rows dequantise to exactly
    the same slice of the dequantised checkpoint tensor."""
    q, s = _checkpoint(384, 384)
    full = dequantize_blocks(q, s)
    read = Slices(dim, ranges)
    want = read(full)
    block_k = 64 if dim == 1 else 128
    packed = fp8_shard_rows("w", read(q), s, read, block_k=block_k, row_group=64)
    assert torch.equal(dequantize_packed(packed, want.shape[-1], block_k), want)
    assert torch.equal(fp8_shard_dense("w", read(q), s, read), want)


def test_experts_shard_on_their_leading_dim():
    q, s = quantize_blocks(torch.randn(4, 96, 200))
    read = Slices(0, ((1, 3),))
    assert torch.equal(dequantize_packed(fp8_shard_rows("e", read(q), s, read), 200), dequantize_blocks(q, s)[1:3])


@pytest.mark.parametrize("dim,ranges,words", [(0, ((32, 96),), "rows 32..96"), (1, ((0, 96),), "columns 0..96")])
def test_a_shard_that_mixes_two_blocks_in_a_scale_group_is_refused_by_name(dim, ranges, words):
    """A holder whose scale groups (64 here) the rank's range does not start and end on would give one
    group values of two checkpoint blocks: refused, naming the tensor."""
    q, s = _checkpoint(256, 256)
    read = Slices(dim, ranges)
    with pytest.raises(ShardingError, match=f"model.layers.0.mlp.down_proj.weight: this rank's {words}"):
        fp8_shard_rows("model.layers.0.mlp.down_proj.weight", read(q), s, read, block_k=64, row_group=64)


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_fp8_checkpoint_tp2_matches_tp1_on_gpus(tiny_model, tmp_path):
    """The same on two GPUs (NCCL, the dequantise-first FP8 path, decode CUDA graphs where the kernels allow);
    fp32, so the all-reduce's summation order is the only difference."""
    path = write_fp8_checkpoint(tiny_model(TinySpec(family="qwen3_5_moe", ratio=2, fused_experts=True, seed=5)),
                                tmp_path / "fp8")
    gpu = {**ENGINE, "device": "cuda", "num_gpu_blocks": 64}
    llm = LLM(path, **gpu)
    ref = _run(llm)
    del llm
    torch.cuda.empty_cache()
    llm = LLM(path, tensor_parallel_size=2, **gpu)
    try:
        _assert_same(ref, _run(llm))
    finally:
        llm.shutdown()


def test_a_copy_that_would_mix_two_blocks_in_a_scale_group_is_refused():
    """The copy's own check (for targets that do not know their holder's groups): rows 64..192 straddle two
    checkpoint blocks with different multipliers, the holder has one multiplier per 128 rows."""
    from deltaserve.layers.linear import Fp8Layout, Linear
    from deltaserve.ops import select_kernels

    q, s = _checkpoint(256, 256)
    read = Slices(0, ((64, 192),))
    packed = fp8_shard_rows("w", read(q), s, read)
    linear = Linear(256, 128, select_kernels(torch.device("cpu")), dtype=torch.float32, device="cpu",
                    fp8=Fp8Layout(128, 128))
    with pytest.raises(ShardingError, match="FP8 rows 0..128 put values of checkpoint blocks"):
        linear.load_rows(0, packed)
    ok = Linear(256, 128, select_kernels(torch.device("cpu")), dtype=torch.float32, device="cpu",
                fp8=Fp8Layout(64, 128))
    ok.load_rows(0, packed)
    assert torch.equal(ok.weight.dequantize(), dequantize_blocks(q, s)[64:192])
