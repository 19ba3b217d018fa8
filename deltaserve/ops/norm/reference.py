"""RMSNorm variants in plain PyTorch (fp32 arithmetic, one rounding to the input dtype at the end).

rms_norm:       y = x * rsqrt(mean(x^2) + eps) * w', with w' = 1 + w (zero-centred, Qwen3-Next/3.5 layer
                norms) or w' = w (plain). With residual: x <- x + residual first, and the sum is returned too.
rms_norm_gated: the GDN output norm, norm before gate, per head over the last dim:
                y = (x * rsqrt(mean(x^2) + eps) * w) * act(z), act = silu (Qwen) or sigmoid (the variant).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, zero_centered: bool = True,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    w = _f32(weight) + 1.0 if zero_centered else _f32(weight)
    y = _normalize(_f32(x), eps).mul_(w).to(x.dtype)
    return y if residual is None else (y, x)


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim (fp32 x)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_gated(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, *, activation: str = "silu",
) -> torch.Tensor:
    if activation in ("silu", "swish"):
        gate = F.silu(_f32(z))
    elif activation == "sigmoid":
        gate = torch.sigmoid(_f32(z))
    else:
        raise ValueError(f"rms_norm_gated: unsupported gate activation {activation!r} (expected 'silu' or 'sigmoid')")
    return _normalize(_f32(x), eps).mul_(_f32(weight)).mul_(gate).to(x.dtype)
