"""Gated DeltaNet layer (model_spec.md §3): projections, causal conv + SiLU, gates, L2-norm, delta rule,
gated RMSNorm, output projection. The input projection (with its pre-norm) and the output half (the decode
tokens' recurrence and the output projection) are composite ops (kernels.gdn_in_proj / gdn_out_proj,
ops/fusion.py) that fold the conv or the gated norm into the projections where the batch shape makes that pay.

The recurrent state and conv window of each sequence live outside the layer, in the CacheBuffers pools
indexed by the batch's state slots: prefill chunks continue from a saved state, decode tokens update
it in place. The input projections are fused into one matrix with rows
    q (nk*dk) | k (nk*dk) | v (nv*dv) | z (nv*dv) | b (nv) | a (nv)
i.e. Qwen3.5's split layout; Qwen3-Next's interleaved in_proj_qkvz / in_proj_ba are de-interleaved on load.

Tensor parallelism (distributed/parallel.py) splits the layer by key-head groups: a rank holds nk / tp key
heads with their nv / tp value heads (each of the six in_proj segments, the conv channels, A_log and
dt_bias cut the same way; the gated norm is per head, so local), out_proj is row-parallel and its output
is summed over the ranks (one all-reduce). The state pools hold only the rank's heads.
"""

from __future__ import annotations

import torch
from torch import nn

from ..batch import ForwardBatch
from ..config import ModelConfig
from ..distributed import comm
from ..distributed.parallel import SINGLE, Parallel, Split, require_divisible
from ..ops import GdnProjection, Kernels
from ..ops.gdn.reference import VerifyStash
from .linear import Linear, fp8_layout
from .norm import RMSNorm
from .weights import Target, WeightMap, read_ranges, rows, sharded, whole


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, *, dtype: torch.dtype, device: torch.device | str,
                 parallel: Parallel = SINGLE):
        super().__init__()
        self.kernels = kernels
        self.parallel = parallel
        self.family = config.family
        require_divisible("linear_num_key_heads", config.linear_num_key_heads, parallel)
        # this rank's heads (all of them at tp = 1)
        self.nk, self.nv = parallel.local(config.linear_num_key_heads), parallel.local(config.linear_num_value_heads)
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_width = config.linear_conv_kernel_dim
        self.eps = config.rms_norm_eps
        self.norm_activation = config.gdn_norm_activation
        h = config.hidden_size
        self.split_sizes = [self.conv_dim, self.value_dim, self.nv, self.nv]
        quant = config.quantization
        in_names = (("in_proj_qkvz", "in_proj_ba") if self.family == "qwen3_next"
                    else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
        in_fp8 = fp8_layout(quant, tuple(f"linear_attn.{n}" for n in in_names), rows=(self.dk, self.dv, self.nv))
        self.in_proj = Linear(h, sum(self.split_sizes), kernels, dtype=dtype, device=device, fp8=in_fp8)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.conv_width, dtype=dtype, device=device),
                                        requires_grad=False)
        # Gate parameters stay fp32 whatever the activation dtype (as vLLM keeps A_log).
        self.A_log = nn.Parameter(torch.empty(self.nv, dtype=torch.float32, device=device), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.nv, dtype=torch.float32, device=device), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.empty(self.dv, dtype=dtype, device=device), requires_grad=False)
        self.out_proj = Linear(self.value_dim, h, kernels, dtype=dtype, device=device,
                               fp8=fp8_layout(quant, ("linear_attn.out_proj",),
                                              cols=(self.value_dim,) if parallel.sharded else ()))
        self.scale = self.dk ** -0.5
        if parallel.sharded:
            tp = parallel.size
            kd, vd, nv = config.gdn_key_dim, config.gdn_value_dim, config.linear_num_value_heads
            conv = Split(0, ((kd, tp), (kd, tp), (vd, tp)))
            self.in_proj.param_splits = {"weight": Split(0, conv.segments + ((vd, tp), (nv, tp), (nv, tp)))}
            self.out_proj.param_splits = {"weight": Split(1, ((vd, tp),))}
            self.param_splits = {"conv_weight": conv, "A_log": Split(0, ((nv, tp),)),
                                 "dt_bias": Split(0, ((nv, tp),))}

    def project_input(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, batch: ForwardBatch,
                      conv_state: torch.Tensor) -> GdnProjection:
        """in_proj(norm(x + residual)) with the normed rows and the sum (the next residual): kernels.gdn_in_proj,
        told the decode rows' slots when the batch is decode-only (it may then apply the conv too)."""
        return self.kernels.gdn_in_proj(
            x, residual, norm.weight, norm.eps, self.in_proj.weight, conv_weight=self.conv_weight,
            conv_state=conv_state, decode_slots=None if batch.num_prefill_tokens else batch.decode_slots(),
            zero_centered=norm.zero_centered)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, ssm_state: torch.Tensor,
                conv_state: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H] without a pre-norm; ssm_state [S, HV, K, V] and conv_state [S, W-1, D] are this
        layer's pools."""
        projection = GdnProjection(projected=self.in_proj(x), normed=x, total=x, conv_applied=False)
        return self.forward_projected(projection, batch, ssm_state, conv_state)

    def forward_projected(self, projection: GdnProjection, batch: ForwardBatch, ssm_state: torch.Tensor,
                          conv_state: torch.Tensor) -> torch.Tensor:
        """forward from the input projection (project_input's, or in_proj(x) with conv_applied False)."""
        projected = projection.projected
        T = projected.shape[0]
        mixed, z2, b, a = projected.split(self.split_sizes, dim=-1)
        z = z2.view(T, self.nv, self.dv)
        P = batch.num_prefill_tokens
        Pp = P - batch.num_verify_tokens          # the plain prefill tokens; verify chunks follow them
        prefill_out = self._prefill(mixed[:Pp], z[:Pp], a[:Pp], b[:Pp], batch, ssm_state, conv_state) if Pp else None
        if P > Pp:
            verify_out = self._verify(mixed[Pp:P], z[Pp:P], a[Pp:P], b[Pp:P], batch, ssm_state, conv_state)
            prefill_out = verify_out if prefill_out is None else torch.cat([prefill_out, verify_out])
        out = self.kernels.gdn_out_proj(
            prefill_out, mixed[P:], z[P:], a[P:], b[P:], conv_weight=self.conv_weight, A_log=self.A_log,
            dt_bias=self.dt_bias, norm_weight=self.norm_weight, eps=self.eps, scale=self.scale,
            conv_state=conv_state, ssm_state=ssm_state, state_indices=batch.decode_slots(),
            norm_activation=self.norm_activation, conv_applied=projection.conv_applied, weight=self.out_proj.weight)
        return comm.all_reduce(out) if self.parallel.sharded else out

    def core(self, projected: torch.Tensor, batch: ForwardBatch, ssm_state: torch.Tensor, conv_state: torch.Tensor,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """The part that reads the batch's sequence structure (cu_seqlens, state slots), from a projection
        without the conv applied (project_input of a batch with prefills, or in_proj(x)): the prefill rows'
        conv, gates, chunked delta rule and gated norm, the verify chunks' gdn_verify (pools untouched), then the
        decode rows' recurrence (gdn_decode) ->
        o [T, HV * V] before the output projection (into `out` when given). forward_projected computes the
        same rows for such a batch (gdn_out_proj, without a fold)."""
        T = projected.shape[0]
        mixed, z2, b, a = projected.split(self.split_sizes, dim=-1)
        z = z2.view(T, self.nv, self.dv)
        P = batch.num_prefill_tokens
        Pp = P - batch.num_verify_tokens          # the plain prefill tokens; verify chunks follow them
        parts = []
        if Pp:
            parts.append(self._prefill(mixed[:Pp], z[:Pp], a[:Pp], b[:Pp], batch, ssm_state, conv_state))
        if P > Pp:
            parts.append(self._verify(mixed[Pp:P], z[Pp:P], a[Pp:P], b[Pp:P], batch, ssm_state, conv_state))
        if T > P:
            parts.append(self.kernels.gdn_decode(
                mixed[P:], z[P:], a[P:], b[P:], conv_weight=self.conv_weight, A_log=self.A_log,
                dt_bias=self.dt_bias, norm_weight=self.norm_weight, eps=self.eps, scale=self.scale,
                conv_state=conv_state, ssm_state=ssm_state, state_indices=batch.decode_slots(),
                norm_activation=self.norm_activation, conv_applied=False))
        if out is None:
            o = parts[0] if len(parts) == 1 else torch.cat(parts)
            return o.reshape(T, self.value_dim)
        start = 0
        for part in parts:
            out[start : start + part.shape[0]].copy_(part.reshape(part.shape[0], self.value_dim))
            start += part.shape[0]
        return out

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """The token-wise rest: out_proj of o [T, HV * V] (core's)."""
        out = self.kernels.linear(o, self.out_proj.weight)
        return comm.all_reduce(out) if self.parallel.sharded else out

    @property
    def projection_width(self) -> int:
        return sum(self.split_sizes)

    def _prefill(self, mixed: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: ForwardBatch,
                 ssm_state: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
        """The prefill rows' output before the projection [P, HV, V]: conv, gates, chunked delta rule, gated norm."""
        k, P, n_pre = self.kernels, mixed.shape[0], batch.num_plain_prefills
        cu, slots, initial = batch.cu_seqlens[: n_pre + 1], batch.state_slots[:n_pre], batch.has_initial_state[:n_pre]
        offsets = batch.prefill_chunk_offsets()                 # once per step, shared by every GDN layer
        conv = k.causal_conv1d_fn(mixed, self.conv_weight, conv_state=conv_state, cu_seqlens=cu, state_indices=slots,
                                  has_initial_state=initial, chunk_offsets=offsets)
        q, key, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        g, beta = k.gdn_gating(self.A_log, a, self.dt_bias, b)
        o = k.chunk_gated_delta_rule(
            q.view(P, self.nk, self.dk), key.view(P, self.nk, self.dk), v.view(P, self.nv, self.dv), g, beta,
            scale=self.scale, cu_seqlens=cu, ssm_state=ssm_state, state_indices=slots, has_initial_state=initial,
            max_seqlen=batch.max_prefill_len, chunk_offsets=offsets)
        return k.rms_norm_gated(o, z, self.norm_weight, self.eps, activation=self.norm_activation)

    def _verify(self, mixed: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: ForwardBatch,
                ssm_state: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
        """The verify chunks' output before the projection [Tv, HV, V]: gdn_verify from each slot's state,
        the pools untouched; the stash goes to batch.verify for the commit of the accepted prefix."""
        record = batch.verify
        stash = (record.stashes[len(record.layers)] if record.stashes is not None
                 else self.verify_stash(mixed.shape[0], mixed.dtype))
        o = self.kernels.gdn_verify(
            mixed, z, a, b, conv_weight=self.conv_weight,
            A_log=self.A_log, dt_bias=self.dt_bias, norm_weight=self.norm_weight, eps=self.eps, scale=self.scale,
            cu_seqlens=record.cu_seqlens, conv_state=conv_state, ssm_state=ssm_state,
            state_indices=record.state_slots, stash=stash, norm_activation=self.norm_activation)
        record.layers.append((stash, conv_state, ssm_state))
        return o

    def verify_stash(self, num_tokens: int, dtype: torch.dtype) -> VerifyStash:
        """An empty VerifyStash of this layer's dims for num_tokens verify tokens (activations of `dtype`)."""
        return VerifyStash.empty(num_tokens, conv_dim=self.conv_dim, num_k_heads=self.nk, head_k_dim=self.dk,
                                 num_v_heads=self.nv, head_v_dim=self.dv, dtype=dtype, device=self.A_log.device)

    # ---- checkpoint layout --------------------------------------------------------------------
    def checkpoint_weights(self) -> WeightMap:
        h, par = self.in_proj.in_features, self.parallel
        offsets = {"qkv": 0, "z": self.conv_dim, "b": self.conv_dim + self.value_dim,
                   "a": self.conv_dim + self.value_dim + self.nv}
        splits = getattr(self, "param_splits", {})
        conv_split = splits.get("conv_weight")
        conv_ranges = conv_split.ranges(par) if conv_split is not None else None
        tp = par.size
        common = {
            "conv1d.weight": Target((tp * self.conv_dim, 1, self.conv_width),
                                    lambda t: self.conv_weight.data.copy_(t[:, 0, :]),
                                    read_ranges(conv_ranges) if conv_ranges else None),
            "A_log": sharded(self.A_log, splits.get("A_log"), par),
            "dt_bias": sharded(self.dt_bias, splits.get("dt_bias"), par),
            "norm.weight": whole(self.norm_weight),
            "out_proj.weight": sharded(self.out_proj.weight, getattr(self.out_proj, "param_splits", {}).get("weight"),
                                       par),
        }
        if self.family != "qwen3_next":
            nv_rows = [par.piece(tp * self.nv)] if par.sharded else None
            return {
                "in_proj_qkv.weight": rows(self.in_proj, offsets["qkv"], tp * self.conv_dim, conv_ranges),
                "in_proj_z.weight": rows(self.in_proj, offsets["z"], tp * self.value_dim,
                                         [par.piece(tp * self.value_dim)] if par.sharded else None),
                "in_proj_b.weight": rows(self.in_proj, offsets["b"], tp * self.nv, nv_rows),
                "in_proj_a.weight": rows(self.in_proj, offsets["a"], tp * self.nv, nv_rows),
                **common,
            }
        # interleaved per key-head group: a rank's groups are one contiguous row range
        qkvz_rows, ba_rows = 2 * self.key_dim + 2 * self.value_dim, 2 * self.nv
        return {
            "in_proj_qkvz.weight": Target((tp * qkvz_rows, h), self._load_qkvz,
                                          read_ranges([par.piece(tp * qkvz_rows)]) if par.sharded else None,
                                          fp8=self.in_proj.is_fp8),
            "in_proj_ba.weight": Target((tp * ba_rows, h), self._load_ba,
                                        read_ranges([par.piece(tp * ba_rows)]) if par.sharded else None,
                                        fp8=self.in_proj.is_fp8),
            **common,
        }

    def _load_qkvz(self, t: torch.Tensor) -> None:
        """Qwen3-Next: rows grouped per key head g as [q_g | k_g | v_{g r..g r+r-1} | z_{g r..}] (§2.4); `t` holds
        this rank's groups."""
        r = self.nv // self.nk
        grouped = t.reshape(self.nk, 2 * self.dk + 2 * r * self.dv, -1)
        q, k, v, z = grouped.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=1)
        flat = lambda x: x.reshape(-1, t.shape[-1])  # noqa: E731  (group-major = head-major order)
        self.in_proj.load_rows(0, flat(q))
        self.in_proj.load_rows(self.key_dim, flat(k))
        self.in_proj.load_rows(2 * self.key_dim, flat(v))
        self.in_proj.load_rows(self.conv_dim, flat(z))

    def _load_ba(self, t: torch.Tensor) -> None:
        r = self.nv // self.nk
        b, a = t.reshape(self.nk, 2 * r, -1).split([r, r], dim=1)
        self.in_proj.load_rows(self.conv_dim + self.value_dim, b.reshape(-1, t.shape[-1]))
        self.in_proj.load_rows(self.conv_dim + self.value_dim + self.nv, a.reshape(-1, t.shape[-1]))
