"""Triton chunked prefill of the gated delta rule (same signatures as reference.chunk_gated_delta_rule /
reference.gdn_prefill, plus an optional `config`), in two launches where FLA has five and fills:

1. the prep (`triton_prep`), one program per (chunk of 64 tokens, value head): norms, gates, the cumulative
   decay, the UT transform's inverse (`triton_ut`) and its products W, U, P;
2. the chain (`triton_chain`; on sm_90 `gluon_chain` / `gluon_chain_t`), one program per (sequence, value head,
   state columns): the chunk recurrence, the outputs and the final state, read from and written to the pool.

Which kernels run is `dispatch.chunk_config_for`'s choice from the shapes and the device. Exactness: no
contribution is truncated, chunks never cross sequence boundaries and padding rows are masked before any exp.
Host work is shape-only, so the op is CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from ..triton_common import check, check_head_dim, check_index, check_last_contiguous, check_pool, check_same_device
from .dispatch import (  # noqa: F401  (re-exported: the op's configuration beside the op)
    CHAINS,
    CHUNK,
    DEVICE_VERIFIED_DIMS,
    FAST_PATH_DIMS,
    LAYOUTS,
    PRECISIONS,
    PREPS,
    ChunkConfig,
    check_chunk_config,
    chunk_config_for,
    default_chunk_config,
)
from .reference import check_max_seqlen
from .triton_chain import launch_chain
from .triton_prep import launch_prep, operand_dtype  # noqa: F401


def _chunk_forward(q, k, v, g, beta, *, gates_in_kernel, A_log, dt_bias, scale, cu_seqlens, ssm_state,
                   state_indices, has_initial_state, use_qk_l2norm_in_kernel, config, op, max_seqlen=None,
                   chunk_offsets=None):
    check(q.dim() == 3 and k.shape == q.shape and v.dim() == 3 and v.shape[0] == q.shape[0], op,
          f"q, k must be [T, HK, K] and v [T, HV, V], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    T, HK, K = q.shape
    HV, V = v.shape[1:]
    check(HV % HK == 0 and HV // HK <= 8, op, f"value heads {HV} must be 1..8 x key heads {HK}")
    check_head_dim(op, "K", K)
    check_head_dim(op, "V", V)
    check(q.dtype in (torch.bfloat16, torch.float16, torch.float32) and k.dtype == q.dtype and v.dtype == q.dtype,
          op, f"q, k, v must share a float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check(g.shape == (T, HV) and beta.shape == (T, HV), op,
          f"{'a and b' if gates_in_kernel else 'g and beta'} must be [{T}, {HV}], "
          f"got {tuple(g.shape)}, {tuple(beta.shape)}")
    check_last_contiguous(op, q=q, k=k, v=v, g=g, beta=beta)
    check_pool(op, ssm_state, HV, K, V)
    N = state_indices.shape[0]
    check_index(op, "cu_seqlens", cu_seqlens, N + 1)
    check_index(op, "state_indices", state_indices, N)
    check(has_initial_state.dim() == 1 and has_initial_state.shape[0] == N, op,
          f"has_initial_state must be [{N}], got {tuple(has_initial_state.shape)}")
    check_same_device(op, q, k, v, g, beta, cu_seqlens, ssm_state, state_indices, has_initial_state)
    if gates_in_kernel:
        check(A_log.shape == (HV,) and dt_bias.shape == (HV,), op, f"A_log and dt_bias must be [{HV}]")
    check_max_seqlen(op, max_seqlen)
    verified = K in DEVICE_VERIFIED_DIMS and V in DEVICE_VERIFIED_DIMS
    check(q.device.type != "cuda" or q.dtype == torch.float32 or verified, op,
          f"head dims K={K}, V={V} with {q.dtype} activations are not verified on the GPU (only "
          f"{DEVICE_VERIFIED_DIMS}; at 16 / 32 the kernels gave non-finite outputs on the H200): use the reference op")
    cfg = config if config is not None else chunk_config_for(q, HV, V, N, max_seqlen)
    check_chunk_config(cfg, q, HV, V, op)
    o = torch.empty((T, HV, V), dtype=v.dtype, device=v.device)
    if T == 0 or N == 0:
        return o
    bufs = launch_prep(q, k, v, g, beta, gates_in_kernel, A_log, dt_bias, scale, cu_seqlens, N,
                       use_qk_l2norm_in_kernel, cfg, chunk_offsets)
    launch_chain(q, k, v, o, bufs, cu_seqlens, ssm_state, state_indices, has_initial_state, cfg)
    return o


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    *, scale: float, cu_seqlens: torch.Tensor, ssm_state: torch.Tensor,
    state_indices: torch.Tensor, has_initial_state: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = True, chunk_size: int = CHUNK, config: ChunkConfig | None = None,
    max_seqlen: int | None = None, chunk_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """reference.chunk_gated_delta_rule on the GPU. Domain of the wide prep's fp16 inverse (bf16 at head dims
    128): g <= 0 and 0 <= beta <= 2 with the in-kernel q/k norms, where every entry of the UT inverse is bounded
    by max(1, beta) (triton_ut); the layer's gates (g = -exp(A_log) softplus(.), beta = sigmoid(.)) always are.
    Outside it the recurrence itself grows geometrically. chunk_offsets: chunk_offsets(cu_seqlens, 64) when the
    caller has it (once per step)."""
    check(chunk_size == CHUNK, "chunk_gated_delta_rule", f"only chunk_size={CHUNK} is implemented, got {chunk_size}")
    return _chunk_forward(q, k, v, g, beta, gates_in_kernel=False, A_log=None, dt_bias=None, scale=scale,
                          cu_seqlens=cu_seqlens, ssm_state=ssm_state, state_indices=state_indices,
                          has_initial_state=has_initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                          config=config, op="chunk_gated_delta_rule", max_seqlen=max_seqlen,
                          chunk_offsets=chunk_offsets)


def gdn_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    *, A_log: torch.Tensor, dt_bias: torch.Tensor, scale: float, cu_seqlens: torch.Tensor,
    ssm_state: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
    config: ChunkConfig | None = None, max_seqlen: int | None = None,
) -> torch.Tensor:
    return _chunk_forward(q, k, v, a, b, gates_in_kernel=True, A_log=A_log, dt_bias=dt_bias, scale=scale,
                          cu_seqlens=cu_seqlens, ssm_state=ssm_state, state_indices=state_indices,
                          has_initial_state=has_initial_state, use_qk_l2norm_in_kernel=True, config=config,
                          op="gdn_prefill", max_seqlen=max_seqlen)
