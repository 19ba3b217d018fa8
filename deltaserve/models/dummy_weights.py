"""Random weights for `load_format="dummy"` (vLLM's name): a model built from its config alone, every
tensor drawn directly on the target device (no files, no host copy), for benchmarks at published shapes.

The draws follow how the released checkpoints look, so activations stay in range through 40-64 layers in
bf16 and the kernels see realistic data:
- projections, embeddings, experts, routers: N(0, 0.02) (the models' initializer_range). A router row per
  expert with the same spread makes every expert equally likely, so the routing is close to uniform;
- zero-centred RMSNorm weights (x̂·(1+w), every layer norm and q/k norm): 0; the GDN gated norm (plain
  x̂·w): 1;
- the causal conv taps: U(±1/sqrt(width)) (PyTorch's Conv1d default, as the checkpoints were initialised);
- the GDN decay: A = exp(A_log) with A ~ U(1, 16) and softplus(dt_bias) ~ logU(1e-3, 1e-1) (Mamba-2's
  init), so per-token decays exp(g) span ~0.2 .. ~1 (short and long memories).
- block-FP8 weights (a config with a quantization_config): the same N(0, 0.02) weight, stored as e4m3 values
  with per-group multipliers drawn in U(0.5, 1.5) x 4 * 0.02 / 448, so the scales vary as real ones do;
Every parameter must be claimed by one of the rules above: a parameter no rule knows is an error, so a new
layer cannot silently keep uninitialised memory.

Under tensor parallelism a sharded parameter (its module's `param_splits`) is drawn at its full tp = 1 shape
from the same generator stream and cut to the rank's slice (distributed/parallel.py `Split.take`), so every
rank's weights are exactly the slices of the tp = 1 dummy model (one full tensor at a time is drawn on the
device: transient memory of the largest parameter).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..layers.gated_deltanet import GatedDeltaNet
from ..layers.linear import Linear
from ..layers.moe import SparseMoeBlock
from ..layers.norm import RMSNorm
from ..ops.quant.fp8 import FP8_MAX, BlockFp8Weight, is_fp8

LINEAR_STD = 0.02
A_RANGE = (1.0, 16.0)
DT_RANGE = (1e-3, 1e-1)
FP8_DRAW_ELEMENTS = 1 << 27        # transient fp32 draw of an FP8 weight: 512 MiB


@torch.no_grad()
def init_dummy_weights(model: nn.Module, *, seed: int = 0) -> None:
    """Fill every parameter of `model` in place with seeded random values on its own device."""
    params = list(model.parameters())
    if not params:
        return
    device = params[0].device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    done: set[int] = set()
    parallel = getattr(model, "parallel", None)
    splits: dict[int, object] = {}               # id(param) -> its Split, for the sharded ones
    if parallel is not None and parallel.sharded:
        for module in model.modules():
            for name, split in getattr(module, "param_splits", {}).items():
                splits[id(getattr(module, name))] = split

    def draw(p: torch.Tensor, fill_fn) -> None:
        """fill_fn(t) fills t in place; a sharded p gets its slice of a full-shape draw."""
        split = splits.get(id(p))
        if split is None:
            fill_fn(p)
        else:
            full = torch.empty(split.full_shape(tuple(p.shape)), dtype=p.dtype, device=p.device)
            fill_fn(full)
            p.copy_(split.take(full, parallel))
        done.add(id(p))

    def normal(p: torch.Tensor, std: float) -> None:
        draw(p, lambda t: t.normal_(0.0, std, generator=gen))

    def uniform(p: torch.Tensor, lo: float, hi: float, then=None) -> None:
        def fill_fn(t):
            t.uniform_(lo, hi, generator=gen)
            if then is not None:
                then(t)
        draw(p, fill_fn)

    def fill(p: torch.Tensor, value: float) -> None:
        p.fill_(value)
        done.add(id(p))

    def fp8(w: BlockFp8Weight, std: float) -> None:
        # a few leading indices (experts) at a time: the fp32 draw stays transient and the launches few
        qs = w.qweight.view(-1, *w.qweight.shape[-2:])
        ss = w.scale.view(-1, *w.scale.shape[-2:])
        n, k = qs.shape[-2:]
        step = max(1, FP8_DRAW_ELEMENTS // (n * k))
        for i in range(0, qs.shape[0], step):
            q, s = qs[i : i + step], ss[i : i + step]
            s.uniform_(0.5, 1.5, generator=gen).mul_(4 * std / FP8_MAX)
            dense = torch.empty(q.shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=gen)
            expanded = s.repeat_interleave(w.row_group, -2)[..., :n, :].repeat_interleave(w.col_group, -1)
            q.copy_(dense.div_(expanded[..., :k]).clamp_(-FP8_MAX, FP8_MAX))
        done.update({id(w.qweight), id(w.scale)})

    def normal_or_fp8(w, std: float) -> None:
        fp8(w, std) if is_fp8(w) else normal(w, std)

    for module in model.modules():
        if isinstance(module, Linear):
            normal_or_fp8(module.weight, LINEAR_STD)
        elif isinstance(module, RMSNorm):
            fill(module.weight, 0.0 if module.zero_centered else 1.0)
        elif isinstance(module, SparseMoeBlock):
            normal_or_fp8(module.w13, LINEAR_STD)
            normal_or_fp8(module.w2, LINEAR_STD)
        elif isinstance(module, GatedDeltaNet):
            bound = 1.0 / math.sqrt(module.conv_width)
            uniform(module.conv_weight, -bound, bound)
            uniform(module.A_log, *A_RANGE, then=torch.Tensor.log_)
            # dt ~ logU(DT_RANGE); dt_bias = softplus^-1(dt) = dt + log(-expm1(-dt))
            uniform(module.dt_bias, math.log(DT_RANGE[0]), math.log(DT_RANGE[1]), then=_softplus_inverse_of_exp)
            fill(module.norm_weight, 1.0)
    for name, p in model.named_parameters():
        if id(p) in done:
            continue
        if name.endswith("embed_tokens"):
            normal(p, LINEAR_STD)
        else:
            raise TypeError(f"dummy weights: no rule for parameter {name} {list(p.shape)}; "
                            "add one to deltaserve/models/dummy_weights.py")


def _softplus_inverse_of_exp(t: torch.Tensor) -> None:
    dt = t.exp_()
    t.copy_(dt + torch.log(-torch.expm1(-dt)))
