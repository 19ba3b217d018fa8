"""Device memory, measured and allocated: the cache budget on a GPU (what a warm-up forward of the largest
step the scheduler will ever issue leaves, and, with CUDA graphs, a decode forward of the largest graph
bucket, whose activations the graphs' private pool keeps for good; with piecewise prefill graphs, their static
buffers and pool) and the pools themselves. The
arithmetic on those byte counts (budget, slot and block counts) is cache/plan.py's."""

from __future__ import annotations

import torch

from ..batch import CacheBuffers
from ..cache.plan import MiB, gpu_cache_budget, pool_shapes
from ..models.qwen3_next import HybridForCausalLM
from .cuda_graphs import capture_sizes, padded_decode_batch
from .prefill_graphs import BUCKET_SLACK_BYTES, dummy_prefill_batch, static_buffer_bytes
from .verify_graphs import padded_verify_batch

# Per captured graph, on top of the measured activations: the pool's segment rounding and each graph's
# live output (~6 MiB a graph on an H200 for a tiny model: torch.cuda.memory_reserved() around the capture).
GRAPH_SLACK_BYTES = 8 * MiB


def allocate_cache(model: HybridForCausalLM, *, num_slots: int, num_blocks: int, block_size: int,
                   device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                   tp_size: int = 1, mtp_kv_layers: int = 0) -> CacheBuffers:
    """The pools (cache/plan.py's layout; fp32 state, `dtype` conv windows, K/V in kv_dtype, default `dtype`:
    float8_e4m3fn for an FP8 KV cache). On CPU they are left
    uninitialised (pages are only touched once used; nothing reads a slot or block position before
    writing it). tp_size: a tensor-parallel rank's pools (its heads). mtp_kv_layers: KV layers for the MTP
    head after the model's (speculation with mtp)."""
    shapes = pool_shapes(model.config, num_slots=num_slots, num_blocks=num_blocks, block_size=block_size,
                         tp_size=tp_size, mtp_kv_layers=mtp_kv_layers)
    make = torch.zeros if device.type == "cuda" else torch.empty
    return CacheBuffers(ssm=make(shapes.ssm, dtype=torch.float32, device=device),
                        conv=make(shapes.conv, dtype=dtype, device=device),
                        kv=make(shapes.kv, dtype=kv_dtype or dtype, device=device))


@torch.inference_mode()
def profile_gpu_cache_budget(model: HybridForCausalLM, *, device: torch.device, dtype: torch.dtype,
                             max_num_batched_tokens: int, max_num_seqs: int, block_size: int,
                             utilization: float, graph_batch_size: int = 0,
                             prefill_graph_sizes: list[int] | tuple[int, ...] = (), mtp_kv_layers: int = 0,
                             verify_graphs: tuple[int, int, int] | None = None) -> int:
    """total x utilization, minus what the process needs besides the pools: weights, the activation peak of
    a max_num_batched_tokens forward plus max_num_seqs rows of logits, memory not owned by torch, and
    (graph_batch_size > 0) the CUDA graphs' pool, estimated as the activation peak of a decode forward of
    graph_batch_size rows plus GRAPH_SLACK_BYTES per graph (the graphs are captured after the cache exists,
    so their memory is set aside here; the capture logs what they really took), and (prefill_graph_sizes)
    the piecewise prefill graphs': their static buffers, their pool estimated as the activation peak of an
    eager forward of the largest bucket (a piece holds at most a layer's scratch), BUCKET_SLACK_BYTES a bucket.
    mtp_kv_layers > 0 (speculation with mtp): the scratch has the MTP KV layer and the head's first pass over
    the largest forward's rows runs inside the measured peak. verify_graphs (largest bucket, width, number of
    graphs): the speculative verify graphs' pool and stashes, the activation peak of a padded verify forward
    of that shape (its stashes allocated inside it) plus GRAPH_SLACK_BYTES per graph."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    n = max_num_batched_tokens
    scratch = allocate_cache(model, num_slots=1, num_blocks=-(-n // block_size), block_size=block_size,
                             device=device, dtype=dtype, mtp_kv_layers=mtp_kv_layers)
    base = torch.cuda.memory_allocated(device)
    batch = dummy_prefill_batch(n, block_size, device)
    hidden = model(batch, scratch)
    torch.cuda.synchronize(device)
    forward_peak = torch.cuda.max_memory_allocated(device) - base
    if mtp_kv_layers:
        model.mtp_forward(batch.input_ids, hidden, batch, scratch)
    rows = hidden[-1:].expand(min(max_num_seqs, n), -1)
    torch.softmax(model.compute_logits(rows).float(), dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del hidden, rows
    graphs = 0
    if prefill_graph_sizes:
        top = max(prefill_graph_sizes)
        if top != n:
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            out = model(dummy_prefill_batch(top, block_size, device), scratch)
            torch.cuda.synchronize(device)
            forward_peak = torch.cuda.max_memory_allocated(device) - base
            del out
        graphs += forward_peak + static_buffer_bytes(model, top) + len(prefill_graph_sizes) * BUCKET_SLACK_BYTES
    if graph_batch_size > 0:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = model(padded_decode_batch(graph_batch_size, device), scratch)
        torch.cuda.synchronize(device)
        graphs += torch.cuda.max_memory_allocated(device) - base
        graphs += len(capture_sizes(graph_batch_size)) * GRAPH_SLACK_BYTES
        del out
    if verify_graphs is not None:
        rows, width, count = verify_graphs
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = model(padded_verify_batch(rows, width, device, block_size), scratch)
        torch.cuda.synchronize(device)
        graphs += torch.cuda.max_memory_allocated(device) - base + count * GRAPH_SLACK_BYTES
        del out
    del scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return gpu_cache_budget(total_bytes=total, utilization=utilization, peak_bytes=peak,
                            outside_torch_bytes=(total - free) - torch.cuda.memory_reserved(device),  # context, others
                            graph_bytes=graphs)
