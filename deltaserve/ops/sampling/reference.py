"""Plain-torch sampling math (the CPU path and the oracle of triton.py).

Sampling inverts the CDF with one uniform number per row, in two levels (which block of 128 tokens, then
which token in it) with the cumulative sums in float64, so a 150k vocabulary loses no precision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 128


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [N, V] (unnormalised, >= 0, some mass in every row), u [N] float64 in [0, 1) -> token [N]: the
    first token whose cumulative mass exceeds u x total. Never picks a zero-probability token."""
    N, V = probs.shape
    pad = (-V) % BLOCK
    blocks = (F.pad(probs, (0, pad)) if pad else probs).view(N, -1, BLOCK)
    mass = blocks.sum(-1).double()            # [N, C]; a 128-term fp32 sum is exact to ~1e-7 of the block
    cdf = mass.cumsum(-1)
    x = (u * cdf[:, -1])[:, None]
    b = torch.searchsorted(cdf, x, right=True).clamp_max_(cdf.shape[1] - 1)     # [N, 1] block holding x
    before = torch.where(b > 0, cdf.gather(1, (b - 1).clamp_min(0)), 0.0)
    frac = ((x - before) / mass.gather(1, b)).clamp(0.0, 1.0 - 2.0 ** -52)
    inner = blocks.gather(1, b[:, :, None].expand(N, 1, BLOCK))[:, 0].double().cumsum(-1)   # [N, BLOCK]
    j = torch.searchsorted(inner, frac * inner[:, -1:], right=True).clamp_max_(BLOCK - 1)
    return (b * BLOCK + j)[:, 0]


def temperature_sample(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor, *,
                       record: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One token per row of logits [N, V] from softmax(logits / temperature) (no top-k / top-p / min-p),
    by inverse CDF at the row's uniform u [N] (float64 in [0, 1)). temperature [N] > 0, float32 or float64
    (used as float32). Returns int64 [N]. Rows may hold -inf (suppressed tokens) but need one finite logit.
    record = (last_tokens, slots [N] int32 / int64): also writes row i's token to last_tokens[slots[i]]."""
    x = logits.float() / temperature.float()[:, None]
    probs = (x - x.amax(dim=-1, keepdim=True)).exp_()
    tokens = inverse_cdf(probs, u.double())
    if record is not None:
        record[0].index_copy_(0, record[1].long(), tokens)
    return tokens


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """In place: logits [N, V] keep only the tokens allowed by bitmask (int32 [M, ceil(V / 32)], bit t of
    word t // 32 set = token t allowed); the rest become -inf. rows [M] int64: the logits row of each mask
    row (None: M == N, row i for row i). Words past V are ignored; tokens past the mask's width are banned."""
    V = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] < V:
        allowed = F.pad(allowed, (0, V - allowed.shape[1]), value=False)
    allowed = allowed[:, :V]
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
