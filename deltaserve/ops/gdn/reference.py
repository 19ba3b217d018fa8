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

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (eps on the sum, as FLA and transformers do)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); both fp32 [T, HV]."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
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


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    *, scale: float, cu_seqlens: torch.Tensor, ssm_state: torch.Tensor,
    state_indices: torch.Tensor, has_initial_state: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = True, chunk_size: int = 64,
) -> torch.Tensor:
    """Prefill over packed sequences. Sequence n starts from ssm_state[state_indices[n]] when
    has_initial_state[n] is true (else from zero) and writes its final state back to that slot."""
    HV = v.shape[1]
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    bounds = cu_seqlens.tolist()
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
        heads_first = lambda x: x.float().transpose(0, 1)  # noqa: E731
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
    padding: skipped, output zero, no state touched. Vectorised over the batch."""
    HV = v.shape[1]
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    live = (state_indices >= 0).nonzero().flatten()
    if live.numel() == 0:
        return out
    slots = state_indices[live].long()
    qt, kt = _expand_heads(q[live], HV), _expand_heads(k[live], HV)
    if use_qk_l2norm_in_kernel:
        qt, kt = l2norm(qt), l2norm(kt)
    qt, kt, vt = qt.float() * scale, kt.float(), v[live].float()
    S = ssm_state[slots].float() * g[live].float().exp()[..., None, None]
    u = torch.einsum("nhkv,nhk->nhv", S, kt)
    delta = beta[live].float()[..., None] * (vt - u)
    S = S + kt[..., :, None] * delta[..., None, :]
    out[live] = torch.einsum("nhkv,nhk->nhv", S, qt).to(v.dtype)
    ssm_state[slots] = S.to(ssm_state.dtype)
    return out
