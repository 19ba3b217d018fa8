"""Gated delta rule in plain PyTorch: the executable specification, the CPU path and the test oracle.

Layouts (FLA's names, packed variable-length batches without a batch dimension):
  q, k        [T, HK, K]   bf16/fp32 activations, T tokens of N sequences packed back to back
  v           [T, HV, V]   HV = r * HK value heads; value head h reads key head h // r
  g           [T, HV]      fp32 log-decay (<= 0); the state is multiplied by exp(g) each step
  beta        [T, HV]      fp32 write strength in (0, 1)
  cu_seqlens  [N + 1]      int32 token offsets of the sequences
  ssm_state   [S, HV, K, V] fp32 pool of recurrent states, one slot per live sequence
  state_indices [N]        int32 slot of each sequence; -1 marks a padded row (skipped, output zero)

Per token and value head, with S the [K, V] state:
  S <- exp(g) * S;  u = S^T k;  S <- S + k (beta * (v - u))^T;  o = S^T (q * scale)
q and k are L2-normalised first (x * rsqrt(sum(x^2) + 1e-6)) when use_qk_l2norm_in_kernel is set.
All arithmetic is fp32; o is returned in v's dtype.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.nn.functional as F

from ..conv1d import reference as _conv  # the layer-level ops below compose these
from ..norm import reference as _norm

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (eps on the sum, as FLA and transformers do)."""
    x = _f32(x)
    return x * torch.rsqrt(torch.linalg.vecdot(x, x).unsqueeze(-1) + eps)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); both fp32 [T, HV]."""
    g = _f32(A_log).exp().neg_() * F.softplus(_f32(a) + _f32(dt_bias))
    beta = torch.sigmoid(_f32(b))
    return g, beta


def _expand_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """[T, HK, D] -> [T, HV, D]: value head h uses key head h // r (repeat_interleave, not tile)."""
    r = num_v_heads // x.shape[1]
    return x if r == 1 else x.repeat_interleave(r, dim=1)


def _chunk_one_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, heads first: q, k [H, L, K], v [H, L, V], g, beta [H, L], state [H, K, V], all fp32.

    The WY / UT-transform form of the recurrence (kernels_sota.md §1.2): per chunk of C tokens,
    A = strictly_lower(diag(beta) K K^T * Gamma), T = (I + A)^-1, U = T diag(beta) V,
    W = T diag(beta exp(G)) K, then V_new = U - W S, O = (exp(G) Q) S + (Q K^T * Gamma_incl) V_new,
    S <- exp(G_last) S + (exp(G_last - G) K)^T V_new.
    """
    H, L, _ = q.shape
    pad = (-L) % chunk_size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (L + pad) // chunk_size
    q, k, v = (x.reshape(H, n, chunk_size, -1) for x in (q, k, v))
    g, beta = g.reshape(H, n, chunk_size), beta.reshape(H, n, chunk_size)

    G = g.cumsum(-1)                                        # in-chunk cumulative log decay
    diff = G.unsqueeze(-1) - G.unsqueeze(-2)                # G_i - G_j
    incl = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    gamma = diff.masked_fill(~incl, float("-inf")).exp()    # exp(G_i - G_j) for i >= j, else 0
    k_beta = k * beta.unsqueeze(-1)
    A = (k_beta @ k.transpose(-1, -2) * gamma).tril(-1)
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    T = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    U = T @ (v * beta.unsqueeze(-1))
    W = T @ (k_beta * G.exp().unsqueeze(-1))
    attn = q @ k.transpose(-1, -2) * gamma
    q_decayed = q * G.exp().unsqueeze(-1)
    k_decayed = k * (G[..., -1:] - G).exp().unsqueeze(-1)
    chunk_decay = G[..., -1].exp()

    out = torch.empty_like(U)
    for c in range(n):
        v_new = U[:, c] - W[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + attn[:, c] @ v_new
        state = state * chunk_decay[:, c, None, None] + k_decayed[:, c].transpose(-1, -2) @ v_new
    return out.reshape(H, n * chunk_size, -1)[:, :L], state


def check_max_seqlen(op: str, max_seqlen: int | None, bounds: list[int] | None = None) -> None:
    """The prefill ops' max_seqlen hint: None or a non-negative int, and (given the host cu_seqlens) at least every
    sequence's length (a smaller one would steer the GPU op's kernel choice by a wrong picture of the batch)."""
    if max_seqlen is None:
        return
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"{op}: max_seqlen must be None or a non-negative int, got {max_seqlen!r}")
    if bounds is not None:
        longest = max((e - s for s, e in itertools.pairwise(bounds)), default=0)
        if max_seqlen < longest:
            raise ValueError(f"{op}: max_seqlen={max_seqlen} is less than the longest sequence ({longest} tokens)")


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    *, scale: float, cu_seqlens: torch.Tensor, ssm_state: torch.Tensor,
    state_indices: torch.Tensor, has_initial_state: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = True, chunk_size: int = 64, max_seqlen: int | None = None,
    chunk_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill over packed sequences. chunk_offsets: the Triton op's per-step chunk metadata (ops/chunks.py),
    not needed here. Sequence n starts from ssm_state[state_indices[n]] when
    has_initial_state[n] is true (else from zero) and writes its final state back to that slot.
    max_seqlen: the longest sequence's length if the caller knows it (host int): a hint the GPU op's kernel
    choice uses (it cannot read cu_seqlens without a sync); here it is checked against cu_seqlens."""
    HV = v.shape[1]
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    bounds = cu_seqlens.tolist()
    check_max_seqlen("chunk_gated_delta_rule", max_seqlen, bounds)
    slots = state_indices.tolist()
    has_init = has_initial_state.tolist()
    for n, slot in enumerate(slots):
        s, e = bounds[n], bounds[n + 1]
        if slot < 0 or e == s:
            continue
        qs, ks = _expand_heads(q[s:e], HV), _expand_heads(k[s:e], HV)
        if use_qk_l2norm_in_kernel:
            qs, ks = l2norm(qs), l2norm(ks)
        qs = qs.float() * scale
        heads_first = lambda x: x.float().transpose(0, 1)
        init = ssm_state[slot].float() if has_init[n] else ssm_state.new_zeros(ssm_state.shape[1:], dtype=torch.float32)
        o, final = _chunk_one_sequence(
            heads_first(qs), heads_first(ks), heads_first(v[s:e]), heads_first(g[s:e]),
            heads_first(beta[s:e]), init, chunk_size,
        )
        out[s:e] = o.transpose(0, 1).to(v.dtype)
        ssm_state[slot] = final.to(ssm_state.dtype)
    return out


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    *, scale: float, cu_seqlens: torch.Tensor, ssm_state: torch.Tensor,
    state_indices: torch.Tensor, has_initial_state: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = True,
) -> torch.Tensor:
    """Token-by-token recurrence over packed sequences; same contract as chunk_gated_delta_rule.
    The literal form of the math: the oracle the chunked and fused forms are tested against."""
    HV = v.shape[1]
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    bounds = cu_seqlens.tolist()
    has_init = has_initial_state.tolist()
    for n, slot in enumerate(state_indices.tolist()):
        if slot < 0:
            continue
        S = ssm_state[slot].float() if has_init[n] else ssm_state.new_zeros(ssm_state.shape[1:], dtype=torch.float32)
        for t in range(bounds[n], bounds[n + 1]):
            qt, kt = _expand_heads(q[t : t + 1], HV)[0], _expand_heads(k[t : t + 1], HV)[0]
            if use_qk_l2norm_in_kernel:
                qt, kt = l2norm(qt), l2norm(kt)
            qt, kt, vt = qt.float() * scale, kt.float(), v[t].float()
            S = S * g[t].float().exp()[:, None, None]
            u = torch.einsum("hkv,hk->hv", S, kt)
            delta = beta[t].float()[:, None] * (vt - u)
            S = S + kt[:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", S, qt).to(v.dtype)
        ssm_state[slot] = S.to(ssm_state.dtype)
    return out


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    *, scale: float, ssm_state: torch.Tensor, state_indices: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = True,
) -> torch.Tensor:
    """Decode: one token for each of N sequences (q, k [N, HK, K], v [N, HV, V], g, beta [N, HV]),
    each continuing from ssm_state[state_indices[n]] and updating it in place. Rows with slot -1 are
    padding: skipped, output zero, no state touched. Vectorised over the batch as N*HV [K, V] matrices."""
    if min(state_indices.tolist(), default=0) < 0:
        out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
        live = (state_indices >= 0).nonzero().flatten()
        if live.numel():
            out[live] = fused_recurrent_gated_delta_rule(
                q[live], k[live], v[live], g[live], beta[live], scale=scale, ssm_state=ssm_state,
                state_indices=state_indices[live], use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return out
    return fused_recurrent_gated_delta_rule_unpadded(q, k, v, g, beta, scale=scale, ssm_state=ssm_state,
                                                     state_indices=state_indices,
                                                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def fused_recurrent_gated_delta_rule_unpadded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    *, scale: float, ssm_state: torch.Tensor, state_indices: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = True,
) -> torch.Tensor:
    """fused_recurrent_gated_delta_rule for a batch without padded rows (every slot >= 0): no host read,
    so it can be traced into a compiled graph."""
    N, HV, V = v.shape
    K = q.shape[-1]
    slots = state_indices.long()
    qt, kt = (l2norm(q), l2norm(k)) if use_qk_l2norm_in_kernel else (_f32(q), _f32(k))
    q3 = _expand_heads(qt * scale, HV).reshape(N * HV, 1, K)
    k3 = _expand_heads(kt, HV).reshape(N * HV, 1, K)
    S = ssm_state.index_select(0, slots).float().view(N * HV, K, V)   # a copy of the slot states
    S.mul_(_f32(g).exp().reshape(N * HV, 1, 1))                          # decay
    u = torch.bmm(k3, S)                                              # S^T k   [N*HV, 1, V]
    delta = (_f32(v).reshape(N * HV, 1, V) - u).mul_(_f32(beta).reshape(N * HV, 1, 1))
    S.baddbmm_(k3.transpose(1, 2), delta)                             # S += k delta^T
    o = torch.bmm(q3, S)                                              # read after the update
    ssm_state.index_copy_(0, slots, S.view(N, HV, K, V).to(ssm_state.dtype))
    return o.view(N, HV, V).to(v.dtype)


# ---- layer-level fused ops ----------------------------------------------------------------------
# The ops below cover what one GDN layer does between its input projection and its output projection,
# in the shapes the layer holds. Their references are compositions of the ops above (and of the conv
# and norm references), so a fused kernel is tested against exactly what the unfused layer computes.
#
#   mixed_qkv [T, D]       pre-conv q|k|v channels, D = 2*HK*K + HV*V (head-major within each part)
#   z         [T, HV, V]   output-gate input;  a, b [T, HV]: gate / write-strength pre-activations
#   conv_weight [D, W], A_log, dt_bias [HV] fp32, norm_weight [V]
#   conv_state [S, W-1, D], ssm_state [S, HV, K, V] fp32: the layer's pools, indexed by state_indices

def num_key_heads(conv_dim: int, num_v_heads: int, head_k_dim: int, head_v_dim: int) -> int:
    """HK from the conv channel count D = 2*HK*K + HV*V; raises when D does not fit that layout."""
    qk = conv_dim - num_v_heads * head_v_dim
    if qk <= 0 or qk % (2 * head_k_dim) or num_v_heads % (qk // (2 * head_k_dim)):
        raise ValueError(
            f"mixed_qkv width {conv_dim} is not 2*HK*{head_k_dim} + {num_v_heads}*{head_v_dim} "
            f"for a key-head count HK dividing {num_v_heads}")
    return qk // (2 * head_k_dim)


def gdn_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    *, A_log: torch.Tensor, dt_bias: torch.Tensor, scale: float, cu_seqlens: torch.Tensor,
    ssm_state: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """chunk_gated_delta_rule with the gates computed from their pre-activations (gdn_gating) and the
    q/k L2 norm applied: the prefill core of a GDN layer. Same layouts and pool contract."""
    g, beta = gdn_gating(A_log, a, dt_bias, b)
    return chunk_gated_delta_rule(
        q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens, ssm_state=ssm_state,
        state_indices=state_indices, has_initial_state=has_initial_state, use_qk_l2norm_in_kernel=True,
        max_seqlen=max_seqlen)


def _split_qkv(x: torch.Tensor, hk: int, hv: int, dk: int, dv: int):
    q, k, v = x.split([hk * dk, hk * dk, hv * dv], dim=-1)
    T = x.shape[0]
    return q.reshape(T, hk, dk), k.reshape(T, hk, dk), v.reshape(T, hv, dv)


def gdn_decode(
    mixed_qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
    conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
    eps: float, scale: float, conv_state: torch.Tensor, ssm_state: torch.Tensor,
    state_indices: torch.Tensor, norm_activation: str = "silu", gated_norm: bool = True,
    conv_applied: bool = False,
) -> torch.Tensor:
    """One decode token for each of N sequences, the whole recurrent part of the layer: conv update +
    SiLU, split, gates, q/k L2 norm, delta rule on the slot state, gated RMSNorm. Returns [N, HV, V] in
    mixed_qkv's dtype; updates conv_state and ssm_state in place. Rows with slot -1 are skipped (zero
    output, no state touched). Equal to the layer's unfused decode path op by op (o is rounded to the
    activation dtype before the norm, as there). gated_norm=False returns that o before the gated
    RMSNorm (the layer then folds the norm into its output projection: linear.gated_linear); z and
    norm_weight are then not used. conv_applied=True: mixed_qkv is already the conv's output (SiLU
    applied, in the activation dtype) and the window already shifted (the input projection did both:
    linear.rms_norm_linear_conv); conv_weight and conv_state are then not used."""
    kw = {"conv_weight": conv_weight, "A_log": A_log, "dt_bias": dt_bias, "norm_weight": norm_weight, "eps": eps,
          "scale": scale, "conv_state": conv_state, "ssm_state": ssm_state, "norm_activation": norm_activation,
          "gated_norm": gated_norm, "conv_applied": conv_applied}
    if min(state_indices.tolist(), default=0) < 0:  # padded rows: compute the live ones, zeros elsewhere
        N, (HV, _, V) = mixed_qkv.shape[0], ssm_state.shape[1:]
        out = torch.zeros((N, HV, V), dtype=mixed_qkv.dtype, device=mixed_qkv.device)
        live = (state_indices >= 0).nonzero().flatten()
        if live.numel():
            out[live] = gdn_decode_unpadded(mixed_qkv[live], z[live], a[live], b[live],
                                            state_indices=state_indices[live], **kw)
        return out
    return gdn_decode_unpadded(mixed_qkv, z, a, b, state_indices=state_indices, **kw)


def gdn_decode_unpadded(
    mixed_qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
    conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
    eps: float, scale: float, conv_state: torch.Tensor, ssm_state: torch.Tensor,
    state_indices: torch.Tensor, norm_activation: str = "silu", gated_norm: bool = True,
    conv_applied: bool = False,
) -> torch.Tensor:
    """gdn_decode for a batch without padded rows (every slot >= 0): no host read, so it can be traced
    into a compiled graph."""
    N = mixed_qkv.shape[0]
    HV, K, V = ssm_state.shape[1:]
    HK = num_key_heads(mixed_qkv.shape[1], HV, K, V)
    x = mixed_qkv if conv_applied else _conv.causal_conv1d_update_unpadded(
        mixed_qkv, conv_weight, conv_state=conv_state, state_indices=state_indices)
    qk = l2norm(x[:, : 2 * HK * K].reshape(N, 2 * HK, K))     # q and k heads normalised together
    v = x[:, 2 * HK * K :].reshape(N, HV, V)
    g, beta = gdn_gating(A_log, a, dt_bias, b)
    o = fused_recurrent_gated_delta_rule_unpadded(
        qk[:, :HK], qk[:, HK:], v, g, beta, scale=scale, ssm_state=ssm_state, state_indices=state_indices,
        use_qk_l2norm_in_kernel=False).to(mixed_qkv.dtype)
    if not gated_norm:
        return o
    return _norm.rms_norm_gated(o, z.reshape(N, HV, V), norm_weight, eps, activation=norm_activation)


def _step_major(starts: list[int], lengths: list[int], device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Sequences of `lengths` packed rows from `starts`, laid out step-major [max length, N]: (rows, live) with
    rows[i, n] = starts[n] + i (the sequence's last row repeated past its end) and live[i, n] = i < lengths[n];
    live is None when every sequence has the same length."""
    width = max(lengths)
    rows = [[s + min(i, n - 1) for s, n in zip(starts, lengths)] for i in range(width)]
    live = None if min(lengths) == width else torch.tensor([[i < n for n in lengths] for i in range(width)],
                                                           device=device)
    return torch.tensor(rows, dtype=torch.long, device=device), live


# ---- speculative verification -------------------------------------------------------------------
#
# Contract. A verify step runs T_n = K_n + 1 tokens of each sequence n (ragged, packed with
# cu_seqlens) from the sequence's slot state WITHOUT changing either pool, and records in a
# caller-owned VerifyStash what is needed to commit any accepted prefix later:
#   x     [T, D]       the pre-conv inputs (the conv window of a prefix is the last W-1 of
#                      [old window, x_0 .. x_{a-1}], so the window rollback is a copy),
#   k     [T, HK, K]   fp32 L2-normalised keys,
#   g     [T, HV]      fp32 log decays,
#   delta [T, HV, V]   fp32 written values beta * (v - S^T k) of each step.
# Since every step is S_t = exp(g_t) S_{t-1} + k_t delta_t^T, gdn_commit rebuilds the state after the
# first a_n tokens from the slot state with a rank-1 update per accepted token: one state read and one
# state write, no re-run of the conv, gates or outputs, and nothing at all for rejected tokens (the pools
# still hold the pre-verify state). Commit with a_n = T_n equals running the T_n tokens through
# gdn_decode one at a time. State traffic per sequence: verify reads the state once, commit reads and
# writes it once (vs T_n full states written by the per-step-state scheme).


@dataclasses.dataclass(frozen=True)
class VerifyStash:
    """Caller-owned scratch of one layer's verify step (see the contract above); rows = packed tokens.
    Capacity may exceed the step's token count; rows of padded sequences are left unspecified."""

    x: torch.Tensor       # [T, D] activation dtype
    k: torch.Tensor       # [T, HK, K] fp32
    g: torch.Tensor       # [T, HV] fp32
    delta: torch.Tensor   # [T, HV, V] fp32

    @classmethod
    def empty(cls, num_tokens: int, *, conv_dim: int, num_k_heads: int, head_k_dim: int, num_v_heads: int,
              head_v_dim: int, dtype: torch.dtype, device: torch.device | str) -> VerifyStash:
        f32 = torch.float32
        return cls(
            x=torch.empty(num_tokens, conv_dim, dtype=dtype, device=device),
            k=torch.empty(num_tokens, num_k_heads, head_k_dim, dtype=f32, device=device),
            g=torch.empty(num_tokens, num_v_heads, dtype=f32, device=device),
            delta=torch.empty(num_tokens, num_v_heads, head_v_dim, dtype=f32, device=device),
        )

    def check(self, num_tokens: int, conv_dim: int, num_k_heads: int, head_k_dim: int, num_v_heads: int,
              head_v_dim: int) -> None:
        want = {"x": (conv_dim,), "k": (num_k_heads, head_k_dim), "g": (num_v_heads,),
                "delta": (num_v_heads, head_v_dim)}
        for name, tail in want.items():
            t = getattr(self, name)
            if tuple(t.shape[1:]) != tail or t.shape[0] < num_tokens or not t.is_contiguous():
                raise ValueError(f"VerifyStash.{name} must be contiguous [>= {num_tokens}, {tail}], got "
                                 f"{tuple(t.shape)}")
            if name != "x" and t.dtype != torch.float32:
                raise ValueError(f"VerifyStash.{name} must be float32, got {t.dtype}")


def gdn_verify(
    mixed_qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
    conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
    eps: float, scale: float, cu_seqlens: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
    state_indices: torch.Tensor, stash: VerifyStash, norm_activation: str = "silu", gated_norm: bool = True,
) -> torch.Tensor:
    """Speculative verify: gdn_decode over T_n tokens per sequence (packed, cu_seqlens), token by token,
    starting from the slot's conv window and state, leaving both pools unchanged and filling `stash`.
    Returns [T, HV, V] (the gated-norm outputs of every token); gated_norm=False returns o before the gated
    RMSNorm, as gdn_decode (for an output projection that folds the norm: linear.gated_linear).

    The sequences step together, as the decode step does (N*HV [K, V] states): step i runs token i of every
    sequence. A sequence shorter than the longest repeats its last token past its end with g = 0 and
    beta = 0, which leaves its state exactly as it was; those steps' outputs are dropped."""
    T, D = mixed_qkv.shape
    HV, K, V = ssm_state.shape[1:]
    HK = num_key_heads(D, HV, K, V)
    stash.check(T, D, HK, K, HV, V)
    W = conv_weight.shape[1]
    g_all, beta_all = gdn_gating(A_log, a, dt_bias, b)
    bounds = cu_seqlens.tolist()
    slot_list = state_indices.tolist()
    seqs = [n for n, slot in enumerate(slot_list) if slot >= 0 and bounds[n + 1] > bounds[n]]
    o = torch.zeros((T, HV, V), dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    if seqs:
        device = mixed_qkv.device
        rows, live = _step_major([bounds[n] for n in seqs], [bounds[n + 1] - bounds[n] for n in seqs], device)
        L, N = rows.shape
        slots = torch.tensor([slot_list[n] for n in seqs], dtype=torch.long, device=device)
        # each sequence's conv over [old window, x_0 .. x_{L-1}], rounded as causal_conv1d_update rounds
        seq = torch.cat([conv_state.index_select(0, slots).float(), mixed_qkv[rows.t()].float()], dim=1)
        x = F.silu((seq.unfold(1, W, 1) * conv_weight.float()).sum(-1)).to(mixed_qkv.dtype)  # [N, L, D]
        x = x.transpose(0, 1).reshape(L * N, D)                        # step-major rows, as `rows`
        qk = l2norm(x[:, : 2 * HK * K].reshape(L * N, 2 * HK, K))      # q and k heads normalised together
        q = _expand_heads(qk[:, :HK] * scale, HV).reshape(L, N * HV, 1, K)
        k = _expand_heads(qk[:, HK:], HV).reshape(L, N * HV, 1, K)
        v = x[:, 2 * HK * K :].float().reshape(L, N * HV, 1, V)
        g, beta = g_all[rows], beta_all[rows]                           # [L, N, HV]
        if live is not None:
            g, beta = g.masked_fill(~live[..., None], 0.0), beta.masked_fill(~live[..., None], 0.0)
        decay, beta = g.exp().reshape(L, N * HV, 1, 1), beta.reshape(L, N * HV, 1, 1)
        S = ssm_state.index_select(0, slots).float().view(N * HV, K, V)   # a copy of the slot states
        o_steps, delta_steps = [], []
        for i in range(L):                                  # the decode step's update, per token, in place
            S.mul_(decay[i])
            delta = (v[i] - torch.bmm(k[i], S)) * beta[i]              # beta * (v - S^T k)   [N*HV, 1, V]
            S.baddbmm_(k[i].transpose(1, 2), delta)                    # S += k delta^T
            o_steps.append(torch.bmm(q[i], S))                         # read after the update
            delta_steps.append(delta)
        o_all, delta_all = torch.stack(o_steps).view(L * N, HV, V), torch.stack(delta_steps).view(L * N, HV, V)
        rows, k_all = rows.flatten(), qk[:, HK:]
        if live is not None:
            keep = live.flatten()
            rows, o_all, delta_all, k_all = rows[keep], o_all[keep], delta_all[keep], k_all[keep]
        o[rows] = o_all.to(o.dtype)
        stash.delta[rows] = delta_all
        stash.k[rows] = k_all
        stash.g[rows] = g_all[rows]
        stash.x[rows] = mixed_qkv[rows].to(stash.x.dtype)
    if not gated_norm:
        return o
    return _norm.rms_norm_gated(o, z.reshape(T, HV, V), norm_weight, eps, activation=norm_activation)


def gdn_commit(
    num_accepted: torch.Tensor, *, cu_seqlens: torch.Tensor, state_indices: torch.Tensor,
    conv_state: torch.Tensor, ssm_state: torch.Tensor, stash: VerifyStash,
) -> None:
    """Write the state and conv window after the first num_accepted[n] (0..T_n) verified tokens of each
    sequence into its slot (see the contract above). 0 leaves the slot as it was; padded rows skipped.
    Sequence by sequence (a few ops per accepted token: stepping the sequences together, as gdn_verify does,
    costs more in gathers and masks than it saves at the few tokens a commit has)."""
    HV = ssm_state.shape[1]
    Wm1 = conv_state.shape[1]
    bounds = cu_seqlens.tolist()
    for n, (slot, acc) in enumerate(zip(state_indices.tolist(), num_accepted.tolist())):
        s, e = bounds[n], bounds[n + 1]
        if slot < 0:
            continue
        if not 0 <= acc <= e - s:
            raise ValueError(f"gdn_commit: num_accepted[{n}] = {acc} outside 0..{e - s}")
        if acc == 0:
            continue
        k = _expand_heads(stash.k[s : s + acc], HV).unsqueeze(-1)            # [acc, HV, K, 1]
        decay = stash.g[s : s + acc].exp()[..., None, None]                   # [acc, HV, 1, 1]
        delta = stash.delta[s : s + acc].unsqueeze(2)                         # [acc, HV, 1, V]
        S = ssm_state[slot].float()
        for i in range(acc):                                 # S_t = exp(g_t) S_{t-1} + k_t delta_t^T
            S = torch.baddbmm(S * decay[i], k[i], delta[i])
        ssm_state[slot] = S.to(ssm_state.dtype)
        window = torch.cat([conv_state[slot], stash.x[s : s + acc].to(conv_state.dtype)], dim=0)
        conv_state[slot] = window[-Wm1:]
