"""Gated DeltaNet layer (model_spec.md §3): projections, causal conv + SiLU, gates, L2-norm, delta rule,
gated RMSNorm, output projection. At a one-token decode step the gated RMSNorm moves into the output
projection's kernel (kernels.gated_linear; gdn_decode then returns o before the norm). At decode steps of
CONV_FOLD_ROWS sequences, where the Triton op runs, the causal conv update of the q|k|v channels moves into
the input projection's GEMV (kernels.rms_norm_linear_conv, asked for by the caller through `conv_fold`;
gdn_decode then gets post-conv q|k|v, conv_applied=True, and no program of it touches a conv window).

The recurrent state and conv window of each sequence live outside the layer, in the CacheBuffers pools
indexed by the batch's state slots: prefill chunks continue from a saved state, decode tokens update
it in place. The input projections are fused into one matrix with rows
    q (nk*dk) | k (nk*dk) | v (nv*dv) | z (nv*dv) | b (nv) | a (nv)
i.e. Qwen3.5's split layout; Qwen3-Next's interleaved in_proj_qkvz / in_proj_ba are de-interleaved on load.
"""

from __future__ import annotations

import torch
from torch import nn

from ..batch import ForwardBatch
from ..config import ModelConfig
from ..ops import Kernels
from .linear import Linear, folds_gate, gated_projection
from .weights import Target, WeightMap, rows, whole

# Decode batches (one token per sequence, no prefill) of CONV_FOLD_ROWS[0] to [1] sequences run the conv in the
# input projection's epilogue (kernels.rms_norm_linear_conv) where that op is the Triton kernel. Measured on
# the H200 at the 35B-A3B shape, the layer's step (docs/PERFORMANCE.md, "gdn_decode at B = 1: the conv in the
# input projection"): faster at 1 (27.28 vs 28.74 us, with the op's window prefetch at M = 1: without it the
# epilogue's registers cost the M = 1 GEMV its single wave, 28.93), 4 (35.55 vs 36.98) and 8 (41.16 vs 47.74),
# a tie at 2 (33.54 vs 33.73). Not measured above 8.
CONV_FOLD_ROWS = (1, 8)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, *, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.kernels = kernels
        self.family = config.family
        self.nk, self.nv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = config.gdn_key_dim, config.gdn_value_dim
        self.conv_dim = config.gdn_conv_dim
        self.conv_width = config.linear_conv_kernel_dim
        self.eps = config.rms_norm_eps
        self.norm_activation = config.gdn_norm_activation
        h = config.hidden_size
        self.split_sizes = [self.conv_dim, self.value_dim, self.nv, self.nv]
        self.in_proj = Linear(h, sum(self.split_sizes), kernels, dtype=dtype, device=device)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.conv_width, dtype=dtype, device=device),
                                        requires_grad=False)
        # Gate parameters stay fp32 whatever the activation dtype (as vLLM keeps A_log).
        self.A_log = nn.Parameter(torch.empty(self.nv, dtype=torch.float32, device=device), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.nv, dtype=torch.float32, device=device), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.empty(self.dv, dtype=dtype, device=device), requires_grad=False)
        self.out_proj = Linear(self.value_dim, h, kernels, dtype=dtype, device=device)
        self.scale = self.dk ** -0.5
        # chosen once (token counts lo..hi, inclusive): the reference backend (and so the CPU decode twin) keeps
        # gdn_decode's own conv
        triton_conv = kernels.backend.get("rms_norm_linear_conv") == "triton"
        self.conv_fold_rows: tuple[int, int] = CONV_FOLD_ROWS if triton_conv else (0, 0)

    def conv_fold(self, batch: ForwardBatch, conv_state: torch.Tensor) -> dict | None:
        """The conv arguments of kernels.rms_norm_linear_conv when this step's input projection applies the
        conv (a decode-only batch of conv_fold_rows tokens, a dense in_proj), else None. The caller then passes
        conv_applied=True to forward_projected."""
        T, (lo, hi) = batch.num_tokens, self.conv_fold_rows
        if batch.num_prefill_tokens or not 0 < lo <= T <= hi or type(self.in_proj) is not Linear:
            return None
        return {"conv_weight": self.conv_weight, "conv_state": conv_state, "state_indices": batch.decode_slots()}

    @property
    def input_proj(self) -> Linear:
        """The projection of the layer's input (a pre-norm folds its norm into it: RMSNorm.project)."""
        return self.in_proj

    def forward(self, x: torch.Tensor, batch: ForwardBatch, ssm_state: torch.Tensor,
                conv_state: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]; ssm_state [S, HV, K, V] and conv_state [S, W-1, D] are this layer's pools."""
        return self.forward_projected(self.in_proj(x), batch, ssm_state, conv_state)

    def forward_projected(self, projected: torch.Tensor, batch: ForwardBatch, ssm_state: torch.Tensor,
                          conv_state: torch.Tensor, conv_applied: bool = False) -> torch.Tensor:
        """forward from in_proj(x) [T, in_proj.out_features], computed by the caller; conv_applied: its q|k|v
        columns are the conv's output already (kernels.rms_norm_linear_conv with `conv_fold`'s arguments)."""
        T = projected.shape[0]
        mixed, z2, b, a = projected.split(self.split_sizes, dim=-1)
        z = z2.view(T, self.nv, self.dv)
        P, n_pre = batch.num_prefill_tokens, batch.num_prefills
        if conv_applied and P:
            raise ValueError("GatedDeltaNet: conv_applied needs a decode-only batch (the prefill conv runs here)")
        k = self.kernels
        if P == 0 and folds_gate(self.out_proj, T):
            # one decode token: the gated norm goes into out_proj's GEMV, gdn_decode returns o before it
            o = k.gdn_decode(
                mixed, z, a, b, conv_weight=self.conv_weight, A_log=self.A_log, dt_bias=self.dt_bias,
                norm_weight=self.norm_weight, eps=self.eps, scale=self.scale, conv_state=conv_state,
                ssm_state=ssm_state, state_indices=batch.decode_slots(), norm_activation=self.norm_activation,
                gated_norm=False, conv_applied=conv_applied)
            return gated_projection(self.out_proj, k, o.view(T, self.value_dim), z2, norm_weight=self.norm_weight,
                                    eps=self.eps, activation=self.norm_activation)
        outs = []
        if n_pre:
            conv = k.causal_conv1d_fn(
                mixed[:P], self.conv_weight, conv_state=conv_state, cu_seqlens=batch.cu_seqlens[: n_pre + 1],
                state_indices=batch.state_slots[:n_pre], has_initial_state=batch.has_initial_state[:n_pre])
            q, key, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            g, beta = k.gdn_gating(self.A_log, a[:P], self.dt_bias, b[:P])
            o = k.chunk_gated_delta_rule(
                q.view(P, self.nk, self.dk), key.view(P, self.nk, self.dk), v.view(P, self.nv, self.dv), g, beta,
                scale=self.scale, cu_seqlens=batch.cu_seqlens[: n_pre + 1], ssm_state=ssm_state,
                state_indices=batch.state_slots[:n_pre], has_initial_state=batch.has_initial_state[:n_pre],
                max_seqlen=batch.max_prefill_len)
            outs.append(k.rms_norm_gated(o, z[:P], self.norm_weight, self.eps, activation=self.norm_activation))
        if P < T:
            # decode tokens: conv update, gates, q/k L2 norm, delta rule and gated norm in one op
            # (Triton: one launch up to 16 sequences, else two; the reference is the same ops composed)
            outs.append(k.gdn_decode(
                mixed[P:], z[P:], a[P:], b[P:], conv_weight=self.conv_weight, A_log=self.A_log,
                dt_bias=self.dt_bias, norm_weight=self.norm_weight, eps=self.eps, scale=self.scale,
                conv_state=conv_state, ssm_state=ssm_state, state_indices=batch.decode_slots(),
                norm_activation=self.norm_activation, conv_applied=conv_applied))
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.out_proj(o.reshape(T, self.value_dim))

    # ---- checkpoint layout --------------------------------------------------------------------
    def checkpoint_weights(self) -> WeightMap:
        h = self.in_proj.in_features
        offsets = {"qkv": 0, "z": self.conv_dim, "b": self.conv_dim + self.value_dim,
                   "a": self.conv_dim + self.value_dim + self.nv}
        common = {
            "conv1d.weight": Target((self.conv_dim, 1, self.conv_width),
                                    lambda t: self.conv_weight.data.copy_(t[:, 0, :])),
            "A_log": whole(self.A_log),
            "dt_bias": whole(self.dt_bias),
            "norm.weight": whole(self.norm_weight),
            "out_proj.weight": whole(self.out_proj.weight),
        }
        if self.family != "qwen3_next":
            return {
                "in_proj_qkv.weight": rows(self.in_proj, offsets["qkv"], self.conv_dim),
                "in_proj_z.weight": rows(self.in_proj, offsets["z"], self.value_dim),
                "in_proj_b.weight": rows(self.in_proj, offsets["b"], self.nv),
                "in_proj_a.weight": rows(self.in_proj, offsets["a"], self.nv),
                **common,
            }
        return {
            "in_proj_qkvz.weight": Target((2 * self.key_dim + 2 * self.value_dim, h), self._load_qkvz),
            "in_proj_ba.weight": Target((2 * self.nv, h), self._load_ba),
            **common,
        }

    def _load_qkvz(self, t: torch.Tensor) -> None:
        """Qwen3-Next: rows grouped per key head g as [q_g | k_g | v_{g r..g r+r-1} | z_{g r..}] (§2.4)."""
        r = self.nv // self.nk
        grouped = t.view(self.nk, 2 * self.dk + 2 * r * self.dv, -1)
        q, k, v, z = grouped.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=1)
        flat = lambda x: x.reshape(-1, t.shape[-1])  # noqa: E731  (group-major = head-major order)
        self.in_proj.load_rows(0, flat(q))
        self.in_proj.load_rows(self.key_dim, flat(k))
        self.in_proj.load_rows(2 * self.key_dim, flat(v))
        self.in_proj.load_rows(self.conv_dim, flat(z))

    def _load_ba(self, t: torch.Tensor) -> None:
        r = self.nv // self.nk
        b, a = t.view(self.nk, 2 * r, -1).split([r, r], dim=1)
        self.in_proj.load_rows(self.conv_dim + self.value_dim, b.reshape(-1, t.shape[-1]))
        self.in_proj.load_rows(self.conv_dim + self.value_dim + self.nv, a.reshape(-1, t.shape[-1]))
