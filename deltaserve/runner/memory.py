"""How many bytes the cache pools may take: on the GPU, measured after a warm-up forward of the largest
step the scheduler will ever issue (and, with CUDA graphs, a decode forward of the largest graph bucket,
whose activations the graphs' private pool keeps for good); on the CPU, a configured size. The byte count
goes to cache/memory.py, which turns it into slot and block counts."""

from __future__ import annotations

import logging

import torch

from ..batch import ForwardBatch
from ..models.qwen3_next import HybridForCausalLM
from .cuda_graphs import capture_sizes, padded_decode_batch
from .model_runner import allocate_cache

logger = logging.getLogger(__name__)

MiB = 1 << 20
# Per captured graph, on top of the measured activations: the pool's segment rounding and each graph's
# live output. Measured on an H200: 11 graphs of a 4-layer hidden-64 model (activations < 1 MiB) held 68 MiB.
GRAPH_SLACK_BYTES = 8 * MiB


def dummy_prefill_batch(num_tokens: int, block_size: int, device: torch.device) -> ForwardBatch:
    """One fresh sequence of num_tokens tokens in slot 0, blocks 0, 1, 2, ..."""
    nblocks = -(-num_tokens // block_size)
    t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    return ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.long, device=device),
        positions=torch.arange(num_tokens, device=device), cu_seqlens=t([0, num_tokens], torch.int32),
        seq_lens=t([num_tokens], torch.int32), state_slots=t([0], torch.int32),
        has_initial_state=t([False], torch.bool),
        slot_mapping=torch.arange(num_tokens, device=device),
        block_tables=torch.arange(nblocks, device=device, dtype=torch.int32)[None],
        num_prefills=1, num_prefill_tokens=num_tokens)


@torch.inference_mode()
def profile_gpu_cache_budget(model: HybridForCausalLM, *, device: torch.device, dtype: torch.dtype,
                             max_num_batched_tokens: int, max_num_seqs: int, block_size: int,
                             utilization: float, graph_batch_size: int = 0) -> int:
    """total x utilization, minus what the process needs besides the pools: weights, the activation peak of
    a max_num_batched_tokens forward plus max_num_seqs rows of logits, memory not owned by torch, and
    (graph_batch_size > 0) the CUDA graphs' pool, estimated as the activation peak of a decode forward of
    graph_batch_size rows plus GRAPH_SLACK_BYTES per graph (the graphs are captured after the cache exists,
    so their memory is set aside here; the capture logs what they really took)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    n = max_num_batched_tokens
    scratch = allocate_cache(model, num_slots=1, num_blocks=-(-n // block_size), block_size=block_size,
                             device=device, dtype=dtype)
    hidden = model(dummy_prefill_batch(n, block_size, device), scratch)
    rows = hidden[-1:].expand(min(max_num_seqs, n), -1)
    torch.softmax(model.compute_logits(rows).float(), dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del hidden, rows
    graphs = 0
    if graph_batch_size > 0:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = model(padded_decode_batch(graph_batch_size, device), scratch)
        torch.cuda.synchronize(device)
        graphs = torch.cuda.max_memory_allocated(device) - base
        graphs += len(capture_sizes(graph_batch_size)) * GRAPH_SLACK_BYTES
        del out
    del scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    not_torch = (total - free) - torch.cuda.memory_reserved(device)   # CUDA context, other processes
    budget = int(total * utilization - peak - max(not_torch, 0) - graphs)
    logger.info("GPU memory: total %.0f MiB x %.2f, weights + activation peak %.0f MiB, outside torch %.0f MiB, "
                "CUDA graphs ~%.0f MiB -> %.0f MiB for the cache", total / MiB, utilization, peak / MiB,
                not_torch / MiB, graphs / MiB, budget / MiB)
    if budget <= 0:
        raise ValueError(f"no GPU memory left for the cache: {total / MiB:.0f} MiB x {utilization} is less than the "
                         f"{(peak + not_torch + graphs) / MiB:.0f} MiB the model needs (raise gpu_memory_utilization, "
                         "lower max_num_batched_tokens, or free the GPU)")
    return budget
