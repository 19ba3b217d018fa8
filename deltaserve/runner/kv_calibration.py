"""FP8 KV-cache multipliers measured at start-up, for attention layers whose checkpoint has no k_scale / v_scale.

A seeded token-id prompt (like the engine's warm-up requests: throw-away ids, no trace left) runs once through
the model over a scratch cache in the activation dtype; each attention layer's stored keys and values (after
q/k norm and RoPE, what the FP8 cache will hold) give its amax, and its multiplier is amax * HEADROOM / 448.
e4m3 keeps 3 mantissa bits at every magnitude, so headroom costs only the bottom of the range, while a key or
value beyond the calibrated amax would clip. Logged per layer: never a silent 1.0.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..config import FULL_ATTENTION
from ..models.qwen3_next import HybridForCausalLM
from ..ops.quant.fp8 import FP8_MAX
from .memory import allocate_cache, dummy_prefill_batch

logger = logging.getLogger(__name__)

CALIBRATION_TOKENS = 512
HEADROOM = 4.0


@torch.inference_mode()
def calibrate_kv_scales(model: HybridForCausalLM, *, device: torch.device, dtype: torch.dtype, block_size: int,
                        seed: int = 0, num_tokens: int = CALIBRATION_TOKENS) -> dict[int, tuple[float, float]]:
    """Set kv_scale of every main-model attention layer not given one by the checkpoint; returns layer id ->
    (k multiplier, v multiplier) of the layers it set. The MTP head's layers are left alone (the engine does
    not run the head)."""
    todo = [i for i, layer in enumerate(model.layers)
            if layer.layer_type == FULL_ATTENTION and layer.self_attn.kv_scale_source != "checkpoint"]
    if not todo:
        return {}
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (num_tokens,), generator=gen).to(device)
    batch = dataclasses.replace(dummy_prefill_batch(num_tokens, block_size, device), input_ids=ids)
    scratch = allocate_cache(model, num_slots=1, num_blocks=-(-num_tokens // block_size), block_size=block_size,
                             device=device, dtype=dtype)
    model(batch, scratch)
    set_scales = {}
    kv_index = {layer_id: j for j, layer_id in enumerate(model.config.attention_layer_ids)}
    for i in todo:
        attn = model.layers[i].self_attn
        kv = scratch.kv[kv_index[i]].reshape(2, -1, attn.num_kv_heads, attn.head_dim)[:, :num_tokens]
        amax = kv.float().abs().amax(dim=(1, 2, 3)).clamp(min=1e-6)
        attn.kv_scale.copy_((amax * HEADROOM / FP8_MAX).view(2, 1))
        attn.kv_scale_source = "calibration"
        set_scales[i] = (float(attn.kv_scale[0]), float(attn.kv_scale[1]))
    logger.info("FP8 KV cache: multipliers calibrated over %d tokens (amax x %.0f / 448) for %d layer(s): %s",
                num_tokens, HEADROOM, len(set_scales),
                ", ".join(f"layer {i} k {k:.3g} v {v:.3g}" for i, (k, v) in set_scales.items()))
    return set_scales
