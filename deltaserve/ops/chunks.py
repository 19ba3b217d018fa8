"""Per-step prefill metadata the Triton ops read on the device, in plain torch (no triton import): a step
computes it once (ForwardBatch.prefill_chunk_offsets) and hands it to every GDN layer's conv and chunked
delta rule instead of each op rebuilding it (two ops x every GDN layer, ~5 launches each)."""

from __future__ import annotations

import torch

# The chunk length of the prefill kernels that locate their chunk from these offsets (the conv's token
# tiles and the chunked delta rule's chunks: triton_common.locate_chunk).
PREFILL_CHUNK = 64


def chunk_offsets(cu_seqlens: torch.Tensor, chunk: int) -> torch.Tensor:
    """[N + 1] int32 cumulative chunk counts (chunks of `chunk` tokens aligned to sequence starts), on the
    device of cu_seqlens, without a host sync (CUDA-graph capturable)."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    out = torch.zeros(cu_seqlens.shape[0], dtype=torch.int32, device=cu_seqlens.device)
    torch.cumsum((lens + chunk - 1) // chunk, 0, dtype=torch.int32, out=out[1:])
    return out
