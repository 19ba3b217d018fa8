"""Which kernels run each GDN op: the launch configurations and the rules that pick them, once per call, from
the shapes and the device alone (no host sync, so a CUDA graph captures one path).

- chunked prefill (`triton_chunk`): `ChunkConfig`, picked by `chunk_config_for` / `default_chunk_config`;
- decode and speculative verify (`triton_recurrent`, `triton_verify`): `RecurrentConfig`, picked by
  `default_decode_config` / `default_verify_config` (and `default_recurrent_config` for the plain decode).

The numbers behind the rules are in docs/PERFORMANCE.md (benchmarks/gdn_kernels.py, gdn_decode_latency.py).
"""

from __future__ import annotations

import dataclasses
import types

import torch

from . import gluon_chain, gluon_chain_t

CHUNK = 64
# Operand precisions of the chain's products (fp32 accumulation, fp32 state): "bf16x2" splits the fp32 operand
# into two bf16 limbs (~16 mantissa bits; the default for 16-bit activations), "ieee" is exact fp32 (the default
# for fp32 activations); "bf16" (FLA's precision) and "tf32" are kept for accuracy comparisons only.
PRECISIONS = ("bf16x2", "bf16", "tf32", "ieee")
# The prep (`triton_prep`): "blocks" inverts the UT system by 16 x 16 diagonal blocks and tensor-core joins (any
# head dims); "wide" runs every doubling level on the whole 64 x 64 tile in fp16 products, with the q / k norms
# from the Gram diagonals, every load issued first (TMA where the rows allow), a heads-first grid and a
# 168-register cap (bf16 at head dims 128: the fast path).
PREPS = ("blocks", "wide")
# "token": the prep's products per token, read with row masks; "chunk": per chunk, zero-padded to 64 rows, read
# whole through TMA descriptors.
LAYOUTS = ("token", "chunk")
# The chain over a sequence's chunks: "triton" (`triton_chain`), or on sm_90 the Gluon chain on 32-column
# programs ("gluon", `gluon_chain`) or the transposed one on 64 / 128 ("gluon_t", `gluon_chain_t`). A Gluon chain
# takes U's factor and K rows from the inputs themselves, stores outputs by TMA and runs behind the Gluon prep.
CHAINS = ("triton", "gluon", "gluon_t")
# (K, V) head dims at which the wide prep and the chunk layout are verified on the H200 (at K = 16 / V = 32 the
# compiled TMA chain's products were wrong there while exact under the interpreter): CUDA refuses the others.
FAST_PATH_DIMS = ((128, 128),)
# Head dims at which the bf16 / fp16 chunked prefill is verified on the H200 (at 16 and 32 its outputs were
# non-finite there; fp32 activations pass everywhere): CUDA refuses the others, and triton_registry keeps the
# reference op for such models.
DEVICE_VERIFIED_DIMS = (64, 128)


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """The chunked prefill's kernels. bv: state columns per chain program; prec: the chain's operand precision
    (PRECISIONS); prep, layout, chain: PREPS, LAYOUTS, CHAINS (a chunk layout needs the wide prep, a Gluon chain
    the chunk layout)."""

    bv: int = 32
    prec: str = "bf16x2"
    prep: str = "blocks"
    layout: str = "token"
    chain: str = "triton"

    @property
    def gluon(self) -> bool:
        """A Gluon chain: U formed in the chain, whole chunks' K rows from k, outputs by TMA, the Gluon prep."""
        return self.chain != "triton"

    def state_stages(self) -> int:
        """Pipeline depth of the Triton chain: 3 with bf16 operand tiles of <= 32 columns, else 2 (3 stages of fp32
        or 64-column tiles exceed the H200's 227 KiB of shared memory; one stage computed wrong values there)."""
        return 3 if self.prec.startswith("bf16") and self.bv <= 32 else 2


# Microseconds per chunk step of a Gluon chain program on the H200, (chain, bv) -> us: the whole op less its prep
# over the chunks of the longest program (benchmarks/gdn_kernels.py --sweep prefill).
CHAIN_STEP_US = types.MappingProxyType({("gluon", 32): 1.85, ("gluon_t", 64): 2.25, ("gluon_t", 128): 3.4})


def chain_step_estimate(chain: str, bv: int, num_v_heads: int, v: int, tokens: int, max_seqlen: int,
                        sms: int) -> float:
    """Estimated microseconds of a Gluon chain over a batch known by its token count and longest length: taken as
    k = tokens // max_seqlen sequences of the longest length (the critical path: their programs in waves of `sms`,
    one CTA per SM) plus the remaining tokens as short work filling spare slots, and no less than all programs'
    chunk steps spread over the SMs. Its pick was within 1.6 % of the fastest chain in 42 measured batches."""
    step = CHAIN_STEP_US[(chain, bv)]
    programs = num_v_heads * (v // bv)  # per sequence
    longest = -(-max_seqlen // CHUNK)
    k = max(tokens // max(max_seqlen, 1), 1)
    rest = max(tokens - k * max_seqlen, 0) / CHUNK
    critical = longest * -(-(k * programs) // sms)
    spread = (k * longest + rest) * programs / sms
    return step * max(critical, spread)


def default_chunk_config(num_seqs: int, num_v_heads: int, v: int, dtype: torch.dtype, k: int | None = None,
                         tokens: int | None = None, gluon: bool = False, sms: int = 132,
                         max_seqlen: int | None = None) -> ChunkConfig:
    """The fastest configuration verified on the H200 (benchmarks/gdn_kernels.py; docs/PERFORMANCE.md):
    - bf16 at head dims 128 (FAST_PATH_DIMS): the wide prep and the chunk layout, unless many short sequences
      would pad its buffers past 1.25 T rows (then the token layout: the scratch the memory profile measured);
    - with the Gluon chain (`gluon`: the device runs it): where the lengths are known (`tokens`, `max_seqlen`) the
      chain and width `chain_step_estimate` ranks fastest, else 32 columns while (32-column slice, sequence, value
      head) programs fit one wave of the `sms` SMs, the one-consumer transposed chain on 64 past it;
    - otherwise the Triton chain on 64 columns from 128 (sequence, value head) pairs (they fill the SMs), else 32.
    fp32 activations keep every product exact."""
    fast = dtype == torch.bfloat16 and (k or v, v) in FAST_PATH_DIMS
    padded_rows = None if tokens is None else (-(-tokens // CHUNK) + num_seqs) * CHUNK
    chunk = fast and (padded_rows is None or padded_rows <= tokens + tokens // 4 + CHUNK)
    chain = "triton"
    if chunk and gluon:
        if v == 128 and tokens is not None and max_seqlen is not None:
            chain, bv = min(CHAIN_STEP_US, key=lambda cb: chain_step_estimate(*cb, num_v_heads, v, tokens, max_seqlen,
                                                                              sms))
        else:  # one CTA per (32-column slice, sequence, value head): more than one wave -> 64 columns
            bv = 64 if num_seqs * num_v_heads * (v // 32) > sms and v >= 64 else min(32, v)
            chain = "gluon_t" if bv == 64 and v == 128 else "gluon"
    else:
        bv = 64 if num_seqs * num_v_heads >= 128 and v >= 64 else min(32, v)
    return ChunkConfig(bv=bv, prec="ieee" if dtype == torch.float32 else "bf16x2", prep="wide" if fast else "blocks",
                       layout="chunk" if chunk else "token", chain=chain)


def chunk_config_for(q: torch.Tensor, num_v_heads: int, v: int, num_seqs: int, max_seqlen: int | None) -> ChunkConfig:
    """`default_chunk_config` for a call on q's device: the Gluon chain where the device runs it (compute
    capability 9.0) and its TMA boxes fit the head count (elsewhere the Triton chain: the same products)."""
    gluon = gluon_chain.supported(q.device) and gluon_chain.heads_supported(num_v_heads)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if gluon else 132
    return default_chunk_config(num_seqs, num_v_heads, v, q.dtype, k=q.shape[2], tokens=q.shape[0], gluon=gluon,
                                sms=sms, max_seqlen=max_seqlen)


def check_chunk_config(cfg: ChunkConfig, q: torch.Tensor, num_v_heads: int, v: int, op: str) -> None:
    """Refuse a configuration the kernels do not implement for this call (ValueError naming the field)."""
    K = q.shape[2]
    cuda = q.device.type == "cuda"

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ValueError(f"{op} (triton): config {msg}")

    need(v % cfg.bv == 0, f"bv={cfg.bv} must divide V={v}")
    need(cfg.prec in PRECISIONS, f"prec={cfg.prec!r} is not one of {PRECISIONS}")
    need(cfg.prep in PREPS, f"prep={cfg.prep!r} is not one of {PREPS}")
    need(cfg.layout in LAYOUTS, f"layout={cfg.layout!r} is not one of {LAYOUTS}")
    need(cfg.chain in CHAINS, f"chain={cfg.chain!r} is not one of {CHAINS}")
    need(cfg.prep == "blocks" or not cuda or (K, v) in FAST_PATH_DIMS,
         f"prep='wide' is verified on the GPU only at head dims (K, V) in {FAST_PATH_DIMS}, got ({K}, {v})")
    need(cfg.layout == "token" or (cfg.prep == "wide" and cfg.prec.startswith("bf16") and q.dtype == torch.bfloat16),
         f"layout='chunk' needs prep='wide', a bf16 precision and bf16 activations, got prep={cfg.prep!r}, "
         f"prec={cfg.prec!r}, dtype {q.dtype}")
    if cfg.gluon:
        bvs = gluon_chain.BVS if cfg.chain == "gluon" else gluon_chain_t.BVS
        need(cfg.layout == "chunk" and cfg.prec == "bf16x2" and gluon_chain.supported(q.device)
             and (K, v) == gluon_chain.DIMS and cfg.bv in bvs and gluon_chain.heads_supported(num_v_heads),
             f"chain={cfg.chain!r} needs layout='chunk', prec='bf16x2', a CUDA device of compute capability 9.0, "
             f"head dims {gluon_chain.DIMS}, bv in {bvs} and a value-head count that is a multiple of 4 and either "
             f">= 32 or a divisor of 32, got layout={cfg.layout!r}, prec={cfg.prec!r}, device {q.device}, "
             f"({K}, {v}), bv={cfg.bv}, {num_v_heads} value heads")


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """Launch shape of the per-token kernels. bv: state columns per program; num_warps per program;
    one_launch: gdn_decode / gdn_verify in one kernel (the gated norm and the window update or stash inside);
    pdl (one launch, compute capability 9.0+): launched as a programmatic dependent of the previous kernel (it
    starts while that one drains, prefetches its state lines to L2 and waits before reading anything);
    qk_prepass (one-launch verify): the tokens' q / k conv and norms in a token-parallel pre-kernel, once per
    token and key head instead of in each of the key head's programs; gram (one-launch verify): each unrolled
    chunk of tokens from the state it starts with and the tokens' q / k dot products (the chunked prefill's
    algebra) instead of token after token."""

    bv: int = 32
    num_warps: int = 4
    one_launch: bool = False
    pdl: bool = False
    qk_prepass: bool = False
    gram: bool = False


# gdn_decode batches up to this size take the one-launch path ...
ONE_LAUNCH_MAX_ROWS = 16
# ... launched programmatically up to this many (sequence, value head) rows.
PDL_MAX_ROWS = 64
# gdn_verify takes the one-launch path up to this many (sequence, value head) rows ...
VERIFY_ONE_LAUNCH_MAX_ROWS = 64
# ... and up to this many tokens per sequence on average (the unrolled chunk of the one-launch kernel).
VERIFY_MAX_CHUNK = 8


def default_recurrent_config(num_programs_bv32: int, v: int) -> RecurrentConfig:
    """Plain decode: 64-column slices with 4 warps from batch ~8 up, 16-column slices with 2 warps below (more
    programs). benchmarks/gdn_kernels.py --decode."""
    if num_programs_bv32 >= 1024:
        return RecurrentConfig(bv=min(64, v), num_warps=4)
    return RecurrentConfig(bv=min(16, v), num_warps=2)


def default_tokens_config(num_programs_bv32: int, v: int) -> RecurrentConfig:
    """The multi-launch fused decode / verify: 32-column slices with 2 warps from batch ~8 up, one-warp 8-column
    slices below. benchmarks/gdn_decode_latency.py."""
    if num_programs_bv32 >= 1024:
        return RecurrentConfig(bv=min(32, v), num_warps=2)
    return RecurrentConfig(bv=min(8, v), num_warps=1)


def default_decode_config(n: int, hk: int, hv: int, v: int, pdl: bool = False) -> RecurrentConfig:
    """gdn_decode of n sequences: one launch up to ONE_LAUNCH_MAX_ROWS sequences, on one-warp 16-column slices up
    to 256 (sequence, value head) rows while a key head has at most 16 programs (they count in one by one on its
    counter), else two-warp 32-column slices; programmatic (where `pdl`) up to PDL_MAX_ROWS rows, where the L2
    prefetch it carries pays. benchmarks/gdn_decode_latency.py."""
    if n <= ONE_LAUNCH_MAX_ROWS:
        narrow = n * hv <= 256 and (hv // hk) * (v // 16) <= 16
        bv, warps = (16, 1) if narrow else (32, 2)
        return RecurrentConfig(bv=min(bv, v), num_warps=warps, one_launch=True, pdl=pdl and n * hv <= PDL_MAX_ROWS)
    return default_tokens_config(n * hv * max(v // 32, 1), v)


def default_verify_config(n: int, t: int, hk: int, hv: int, v: int, pdl: bool = False) -> RecurrentConfig:
    """gdn_verify of t tokens over n sequences: one launch up to VERIFY_ONE_LAUNCH_MAX_ROWS (sequence, value head)
    rows at up to VERIFY_MAX_CHUNK tokens per sequence on average (where the three dependent launches of the
    token-parallel path are the time), programmatic where the device has it: the gram form where the unrolled
    chunk is 2 tokens; from 2 tokens per sequence one-warp 8-column programs, with the q / k pre-kernel from 3
    (below, its launch costs more than it saves); else two-warp 16-column programs.
    benchmarks/gdn_decode_latency.py --verify."""
    if n * hv <= VERIFY_ONE_LAUNCH_MAX_ROWS and t <= VERIFY_MAX_CHUNK * n:
        if verify_chunk(t, n) == 2:
            wide = n * hv > 32
            return RecurrentConfig(bv=min(16 if wide else 8, v), num_warps=2 if wide else 1, one_launch=True,
                                   pdl=pdl, gram=True)
        if t >= 2 * n:
            return RecurrentConfig(bv=min(8, v), num_warps=1, one_launch=True, pdl=pdl,
                                   qk_prepass=pdl and t >= 3 * n)
        return RecurrentConfig(bv=min(16, v), num_warps=2, one_launch=True, pdl=pdl)
    return default_tokens_config(n * hv * max(v // 32, 1), v)


def verify_chunk(t: int, n: int) -> int:
    """Tokens per unrolled chunk of the one-launch verify: the mean tokens per sequence (power of two, at most
    VERIFY_MAX_CHUNK); longer sequences take several chunks (any length is correct)."""
    mean = max(1, -(-t // max(n, 1)))
    return min(1 << (mean - 1).bit_length(), VERIFY_MAX_CHUNK)


def has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (griddepcontrol): CUDA devices of compute capability 9.0 and newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
