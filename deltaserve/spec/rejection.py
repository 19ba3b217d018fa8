"""Verification of draft tokens against the target (runner side, torch): lossless rejection sampling.

For a row with drafts d_0..d_{n-1} and target probabilities p_0..p_n (already processed the way the
sampler processes logits: penalties, temperature, top-k, top-p, min-p; unnormalised is fine):
* greedy rows accept while d_i == argmax p_i, and emit argmax p_a at the first mismatch a (or the bonus
  argmax p_n when all n are accepted);
* sampled rows with draft probabilities q_i accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); on the
  first rejection they emit a token from norm(max(0, p_i - q_i)), and after n acceptances a bonus token
  from p_n. The emitted tokens are distributed exactly as the target's (Leviathan et al. 2023).
* sampled rows of a deterministic drafter (q one-hot at d_i: n-gram, greedy MTP) use the same rule in
  coupled form: x_i = the plain sampler's draw from p_i at the row's uniform for that token index, accept
  while x_i == d_i, emit x_a. P(accept) = p_i(d_i) and a rejection gives p_i restricted to tokens != d_i,
  which is the rule above with q one-hot; and the emitted tokens are the very tokens plain decoding
  draws, so a seeded request's output does not depend on K, the drafts, or the batch.

Randomness: per row and token index (the index of the token a position would become, as the sampler's
`num_generated`), one sampling uniform (the one the plain sampler would use) and, for drafts with q, one
acceptance uniform from a separate stream. Every uniform is consumed at most once: the next step starts
at the index after the emitted token. Everything stays on the device; nothing is read on the host.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from ..ops.sampling.reference import inverse_cdf
from ..runner.sampler import seeded_uniform

# the acceptance stream of a seeded row: a different seed for the same splitmix hash
_ACCEPT_SALT = 0xD1B54A32D192ED03
_MASK64 = (1 << 64) - 1


def spec_uniforms(seeds: Sequence[int | None], first_index: Sequence[int], width: int,
                  shared: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """Host uniforms for `width` = K+1 positions per row: (u_sample [B, K+1], u_accept [B, K]) float64.
    Row b position i belongs to token index first_index[b] + i; seeded rows hash (seed, index), so the
    sample uniform equals what runner/sampler.py would draw for that token; rows without a seed draw
    from `shared`."""
    us, ua = [], []
    for seed, n0 in zip(seeds, first_index):
        if seed is None:
            us.append([shared.random() for _ in range(width)])
            ua.append([shared.random() for _ in range(width - 1)])
        else:
            s2 = (seed ^ _ACCEPT_SALT) & _MASK64
            us.append([seeded_uniform(seed, n0 + i) for i in range(width)])
            ua.append([seeded_uniform(s2, n0 + i) for i in range(width - 1)])
    return (torch.tensor(us, dtype=torch.float64).view(len(us), width),
            torch.tensor(ua, dtype=torch.float64).view(len(ua), width - 1))


def rejection_sample(target_probs: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
                     greedy: torch.Tensor, u_sample: torch.Tensor, u_accept: torch.Tensor | None = None,
                     draft_probs: torch.Tensor | None = None,
                     target_argmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a batch of speculating rows.

    target_probs [B, K+1, V] (>= 0, unnormalised allowed, mass in every row); draft_tokens [B, K] int64;
    num_drafts [B] int64 in [0, K] (row b's drafts are draft_tokens[b, :num_drafts[b]], the rest padding);
    greedy [B] bool; u_sample [B, K+1] and u_accept [B, K] float64 in [0, 1) (spec_uniforms);
    draft_probs [B, K, V] or None (deterministic drafter: one-hot at the drafts; u_accept unused);
    target_argmax [B, K+1] or None (greedy rows: argmax of the target logits, to match plain greedy on
    ties exactly; default: argmax of target_probs).
    Returns (tokens [B, K+1] int64: the accepted drafts, then the emitted token, then -1;
    num_accepted [B] int64: row b emits num_accepted[b] + 1 tokens)."""
    B, W, V = target_probs.shape
    K = W - 1
    dev = target_probs.device
    if draft_tokens.shape != (B, K):
        raise ValueError(f"draft_tokens {tuple(draft_tokens.shape)} != {(B, K)}")
    probs = target_probs.float()
    # the plain draw at every position: the bonus, and the coupled-rule token of one-hot drafts
    x = inverse_cdf(probs.reshape(B * W, V), u_sample.reshape(B * W).double()).view(B, W)
    if target_argmax is None:
        target_argmax = probs.argmax(dim=-1)
    x = torch.where(greedy[:, None], target_argmax, x)
    valid = torch.arange(K, device=dev)[None, :] < num_drafts[:, None]
    d = draft_tokens.long()
    if draft_probs is None or K == 0:
        accept = x[:, :K] == d
        recovered = x[:, :K]
    else:
        if u_accept is None:
            raise ValueError("draft_probs given without u_accept")
        q = draft_probs.float()
        p_k = probs[:, :K]
        p_k = p_k / p_k.sum(-1, keepdim=True)
        q = q / q.sum(-1, keepdim=True)
        pd = p_k.gather(2, d[:, :, None])[..., 0]
        qd = q.gather(2, d[:, :, None])[..., 0]
        # u < p/q without dividing (q(d) = 0 cannot come from the drafter; it accepts where p(d) > 0)
        sampled_accept = u_accept.to(pd.dtype) * qd < pd
        residual = (p_k - q).clamp_min_(0.0)
        # p == q leaves no residual; a rejection then has probability 0, any row with mass will do
        empty = residual.sum(-1, keepdim=True) <= 0
        residual = torch.where(empty, p_k, residual)
        y = inverse_cdf(residual.reshape(B * K, V), u_sample[:, :K].reshape(B * K).double()).view(B, K)
        accept = torch.where(greedy[:, None], x[:, :K] == d, sampled_accept)
        recovered = torch.where(greedy[:, None], x[:, :K], y)
    accept = accept & valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)               # [B]
    pos = torch.arange(W, device=dev)[None, :]
    a = num_accepted[:, None]
    # the emitted token at position a: the recovered token after a rejection, else the bonus draw
    rec = torch.cat([recovered, x[:, K:]], dim=1)                         # [B, K+1]; column K is the bonus
    last = torch.where(a < num_drafts[:, None], rec.gather(1, a), x.gather(1, a))
    drafts = torch.cat([d, torch.full((B, 1), -1, dtype=torch.long, device=dev)], dim=1)
    tokens = torch.where(pos < a, drafts, torch.where(pos == a, last, torch.full_like(drafts, -1)))
    return tokens, num_accepted


def accept_draws(draws: torch.Tensor, draft_tokens: torch.Tensor,
                 num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The coupled rule of a deterministic drafter given the target's draws: draws [B, K+1] (the plain
    sampler's token at every position: argmax for greedy rows), draft_tokens [B, K], num_drafts [B].
    Accept while draws[i] == d_i, emit draws[a]. Same result as rejection_sample without draft_probs
    whose draws are `draws`; returns (tokens [B, K+1], num_accepted [B]) like it."""
    B, W = draws.shape
    K = W - 1
    dev = draws.device
    d = draft_tokens.long()
    valid = torch.arange(K, device=dev)[None, :] < num_drafts[:, None]
    num_accepted = ((draws[:, :K] == d) & valid).long().cumprod(dim=1).sum(dim=1)
    a = num_accepted[:, None]
    pos = torch.arange(W, device=dev)[None, :]
    drafts = torch.cat([d, torch.full((B, 1), -1, dtype=torch.long, device=dev)], dim=1)
    tokens = torch.where(pos < a, drafts, torch.where(pos == a, draws.gather(1, a), torch.full_like(drafts, -1)))
    return tokens, num_accepted
