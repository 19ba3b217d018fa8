"""The start of a forward: token embeddings and the rotary tables of the tokens' positions.

embed_rope(input_ids [T], embed [V, H], positions [T], inv_freq [rd / 2] fp32, *, last_tokens, slots)
  -> (x [T, H], cos [T, rd], sin [T, rd]), all three in embed's dtype.

A row whose input id is negative takes its token from last_tokens[slots[row]] (int64 per state slot): a
decode row whose token the previous step is still sampling (async scheduling), resolved on the device.
Without last_tokens every id must be a valid row of `embed`. The tables are the rotate-half ("NeoX") ones:
angle_j = position * inv_freq[j mod rd/2] in fp32, cos / sin in fp32, rounded once to the dtype.
"""

from __future__ import annotations

import torch


def embed_rope(input_ids: torch.Tensor, embed: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *,
               last_tokens: torch.Tensor | None = None, slots: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if (last_tokens is None) != (slots is None):
        raise ValueError("embed_rope: last_tokens and slots go together")
    ids = input_ids
    if last_tokens is not None:
        ids = torch.where(ids < 0, last_tokens[slots.long().clamp_min(0)], ids)
    x = embed[ids]
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return x, emb.cos().to(embed.dtype), emb.sin().to(embed.dtype)
