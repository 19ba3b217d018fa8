"""Prefill and mixed steps as piecewise CUDA graphs, one set of pieces per token-count bucket.

A step with prefills (or a decode batch too large for the decode graphs) of n <= the largest bucket tokens
runs padded to the smallest bucket T >= n. The forward is cut at every mixer's core, the steps that read
the batch's sequence structure (a GDN layer's conv, gates, chunked delta rule, gated norm and the decode
rows' recurrence; an attention layer's q/k norms, RoPE, KV store and attention: DecoderLayer.mixer_core).
Everything between two cores is token-wise (the previous layer's output projection, its residual add and
norm, the MoE or MLP, the next layer's norm and input projection; the embedding before the first core, the
final norm after the last) and is captured as one graph per (bucket, piece): L layers give L + 1 pieces.
Replaying a step: copy the ids and positions into the static inputs, then piece 0, core 0, piece 1, ...,
core L-1, piece L; each core runs eagerly on the real rows [:n] of the static buffers, with the step's own
ForwardBatch and the cache, so it sees exactly what the eager forward's core sees.

Static buffers, shared by every bucket (a bucket uses rows [:T]): ids and positions, the RoPE tables, the
residual stream, per mixer kind the projection (a piece's output, its core's input) and the core's output
o (the next piece's input), and the final hidden states. A piece copies its results into them, so the
graphs own no live tensors and share one memory pool for their scratch (captured largest bucket first, in
replay order). Rows n..T-1 are padding: ids and positions hold earlier steps' values (valid ids,
finite rows), o holds earlier cores' rows; the token-wise ops compute each row from that row alone (the
MoE routes every token on its own, nothing reduces over tokens), so padding never reaches a real row,
and the cores never see it.

Piecewise graphs need the token-wise ops to be Triton kernels (the references may read device values on
the host); tensor-parallel ranks run eagerly (collectives in graphs are not validated yet), as decode
graphs do. On a CPU device a "graph" is an eager call of the piece over the same static buffers: the
padded path, testable without a GPU. The forward without graphs (HybridForCausalLM.forward) stays the CPU
path and the oracle.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from ..batch import CacheBuffers, ForwardBatch
from ..config import FULL_ATTENTION
from ..ops import Kernels
from .cuda_graphs import begin_capture

logger = logging.getLogger(__name__)

MiB = 1 << 20

# Token-count buckets: powers of two up to 256, then half octaves (a step pads to at most 1.5x its tokens' work
# there, where steps are GPU-bound; each bucket costs L + 1 captures at start-up, no memory: buffers are shared).
PREFILL_LADDER = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
# The ops the pieces call (token-wise); the cores' ops run eagerly and may be anything.
PIECE_OPS = ("embed_rope", "rms_norm", "rms_norm_linear", "linear", "gated_linear", "topk_softmax", "fused_moe",
             "fused_moe_routed", "silu_and_mul", "sigmoid_mul")
# Per bucket, on top of the measured activations: the pool's segment rounding and the graphs' own device
# memory (the pieces' outputs live in the static buffers, counted separately; the capture logs the pool).
BUCKET_SLACK_BYTES = 8 * MiB


def prefill_capture_sizes(max_num_batched_tokens: int) -> list[int]:
    """Buckets for steps of up to max_num_batched_tokens tokens: the ladder below it, then the budget itself
    (capped at the ladder's top; larger steps run eagerly)."""
    if max_num_batched_tokens < 1:
        return []
    top = min(max_num_batched_tokens, PREFILL_LADDER[-1])
    return [s for s in PREFILL_LADDER if s < top] + [top]


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding n tokens (sizes ascending), None when n exceeds them all."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def eager_reason(device: torch.device, kernels: Kernels, *, enforce_eager: bool, enabled: bool = True) -> str | None:
    """Why prefill / mixed steps cannot run as piecewise graphs on this setup (None: they can)."""
    if enforce_eager:
        return "enforce_eager=True"
    if not enabled:
        return "prefill CUDA graphs turned off (prefill_cuda_graphs=False)"
    if torch.device(device).type != "cuda":
        return f"CUDA graphs need a CUDA device, the model runs on {torch.device(device).type}"
    reference = [op for op in PIECE_OPS if kernels.backend.get(op) != "triton"]
    if reference:
        return ("token-wise ops run their torch reference, which may sync with the host: " + ", ".join(reference))
    return None


def plan_prefill_graphs(device: torch.device, kernels: Kernels, *, max_num_batched_tokens: int,
                        enforce_eager: bool, enabled: bool = True) -> list[int]:
    """The buckets to capture ([] with the reason logged once: INFO where graphs were possible, else DEBUG)."""
    why = eager_reason(device, kernels, enforce_eager=enforce_eager, enabled=enabled)
    if why is not None:
        expected = enforce_eager or not enabled or torch.device(device).type != "cuda"
        logger.log(logging.DEBUG if expected else logging.INFO, "prefill steps run eagerly (no piecewise graphs): %s",
                   why)
        return []
    return prefill_capture_sizes(max_num_batched_tokens)


def static_buffer_bytes(model: torch.nn.Module, num_tokens: int) -> int:
    """Bytes of PrefillGraphs' static buffers for buckets up to num_tokens (the cache budget sets them aside)."""
    elem = model.embed_tokens.element_size()
    h = model.config.hidden_size
    widths = 2 * h                                          # residual stream, final hidden states
    for kind in {layer.layer_type for layer in model.layers}:
        mixer = _mixer_of_kind(model, kind)
        widths += mixer.projection_width + _core_width(mixer)
    rope = 2 * model.config.rotary_dim * 4                  # cos / sin (fp32, at most rotary_dim wide)
    return num_tokens * (widths * elem + rope + 16)         # + ids, positions


def _mixer_of_kind(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    return next(layer.mixer for layer in model.layers if layer.layer_type == kind)


def _core_width(mixer: torch.nn.Module) -> int:
    return mixer.o_size if hasattr(mixer, "o_size") else mixer.value_dim


def dummy_prefill_batch(num_tokens: int, block_size: int, device: torch.device) -> ForwardBatch:
    """One fresh sequence of num_tokens tokens in slot 0, blocks 0, 1, 2, ..."""
    nblocks = -(-num_tokens // block_size)
    t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)
    return ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.long, device=device),
        positions=torch.arange(num_tokens, device=device), cu_seqlens=t([0, num_tokens], torch.int32),
        seq_lens=t([num_tokens], torch.int32), state_slots=t([0], torch.int32),
        has_initial_state=t([False], torch.bool),
        slot_mapping=torch.arange(num_tokens, device=device),
        block_tables=torch.arange(nblocks, device=device, dtype=torch.int32)[None],
        num_prefills=1, num_prefill_tokens=num_tokens)


class _EagerPiece:
    """CPU stand-in for a captured piece: replay runs it."""

    def __init__(self, run):
        self.run = run

    def replay(self) -> None:
        self.run()


class PrefillGraphs:
    """The static buffers and one graph per (bucket, piece)."""

    def __init__(self, model: torch.nn.Module, sizes: list[int], *, device: torch.device):
        self.model, self.device = model, torch.device(device)
        self.sizes = sorted(sizes)
        T, dev = self.sizes[-1], self.device
        dtype, h = model.embed_tokens.dtype, model.config.hidden_size
        self.num_layers = len(model.layers)
        self._ids = torch.zeros(T, dtype=torch.long, device=dev)
        self._pos = torch.zeros(T, dtype=torch.long, device=dev)
        _, cos, sin = model.embed(self._ids[:1], self._pos[:1])      # the RoPE tables' width and dtype
        self._cos = torch.zeros(T, *cos.shape[1:], dtype=cos.dtype, device=dev)
        self._sin = torch.zeros(T, *sin.shape[1:], dtype=sin.dtype, device=dev)
        self._residual = torch.zeros(T, h, dtype=dtype, device=dev)
        self._hidden = torch.zeros(T, h, dtype=dtype, device=dev)
        kinds = {layer.layer_type for layer in model.layers}
        self._proj = {k: torch.zeros(T, _mixer_of_kind(model, k).projection_width, dtype=dtype, device=dev)
                      for k in kinds}
        self._o = {k: torch.zeros(T, _core_width(_mixer_of_kind(model, k)), dtype=dtype, device=dev) for k in kinds}
        self._graphs: dict[int, list[torch.cuda.CUDAGraph | _EagerPiece]] = {}
        self.buffer_bytes = sum(t.numel() * t.element_size() for t in (
            self._ids, self._pos, self._cos, self._sin, self._residual, self._hidden, *self._proj.values(),
            *self._o.values()))
        self.pool_bytes = 0
        self.capture_seconds = 0.0
        self.num_runs = 0                 # steps run as piecewise graphs

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    @property
    def num_graphs(self) -> int:
        return sum(len(pieces) for pieces in self._graphs.values())

    def handles(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_size

    # ---- the pieces and the cores --------------------------------------------------------------
    def _piece(self, k: int, T: int) -> None:
        """Token-wise piece k of bucket T over the static buffers: (k > 0) layer k-1's output projection and
        FFN, then (k < L) layer k's norm and input projection, or (k = L) the final norm."""
        m = self.model
        if k == 0:
            x, cos, sin = m.embed(self._ids[:T], self._pos[:T])
            self._cos[:T].copy_(cos)
            self._sin[:T].copy_(sin)
            residual = None
        else:
            prev = m.layers[k - 1]
            kind = prev.layer_type
            h = prev.mixer_output(self._o[kind][:T], self._proj[kind][:T])
            x, residual = prev.ffn(h, self._residual[:T])
        if k == self.num_layers:
            self._hidden[:T].copy_(m.norm(x, residual)[0])
            return
        layer = m.layers[k]
        projected, total = layer.mixer_input(x, residual)
        self._proj[layer.layer_type][:T].copy_(projected)
        self._residual[:T].copy_(total)

    def _core(self, k: int, batch: ForwardBatch, cache: CacheBuffers, n: int) -> None:
        """Layer k's core, eagerly, on the real rows [:n]: the projection buffer in, the o buffer out."""
        layer = self.model.layers[k]
        kind = layer.layer_type
        cos_sin = (self._cos[:n], self._sin[:n]) if kind == FULL_ATTENTION else None
        layer.mixer_core(self._proj[kind][:n], batch, self.model.layer_state(k, cache), cos_sin,
                         out=self._o[kind][:n])

    # ---- capture and replay --------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every piece of every bucket, largest bucket first, into one shared pool. The
        pieces read and write only the static buffers, so nothing touches the cache."""
        if self.device.type != "cuda":
            for T in self.sizes:
                self._graphs[T] = [_EagerPiece(lambda k=k, T=T: self._piece(k, T)) for k in range(self.num_layers + 1)]
            return
        start, reserved, pool, side = begin_capture(self.device)
        current = torch.cuda.current_stream(self.device)
        for T in reversed(self.sizes):
            pieces = []
            for k in range(self.num_layers + 1):
                side.wait_stream(current)
                with torch.cuda.stream(side):          # compiles this shape's kernels outside the capture
                    self._piece(k, T)
                current.wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._piece(k, T)
                pieces.append(graph)
            self._graphs[T] = pieces
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        torch.cuda.empty_cache()                        # drop the warm-ups' cached blocks; the pool stays
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved

    def run(self, batch: ForwardBatch, cache: CacheBuffers) -> torch.Tensor:
        """The final hidden states [n, H] of the batch's n tokens (n <= max_size), a view of the static output
        (valid until the next run): the pieces of the bucket replayed, the cores run eagerly between them."""
        n = batch.num_tokens
        T = bucket_for(n, self.sizes)
        if T is None or n == 0:
            raise ValueError(f"a step of {n} tokens is outside the captured prefill buckets (1..{self.max_size})")
        self._ids[:n].copy_(batch.input_ids)
        self._pos[:n].copy_(batch.positions)
        pieces = self._graphs[T]
        for k in range(self.num_layers):
            pieces[k].replay()
            self._core(k, batch, cache, n)
        pieces[-1].replay()
        self.num_runs += 1
        return self._hidden[:n]

    def warm_up_cores(self, cache: CacheBuffers, block_size: int) -> None:
        """Run every bucket once as a lone fresh prompt of T tokens, so the cores build their kernel variants
        for those lengths now (warm_up_lone_prompts)."""
        warm_up_lone_prompts(self.run, cache, block_size, self.sizes, self.device)


@torch.inference_mode()
def warm_up_lone_prompts(forward, cache: CacheBuffers, block_size: int, lengths: list[int],
                         device: torch.device) -> None:
    """forward(batch, cache) once per length, a lone fresh prompt (slot 0, blocks 0..: `cache` must be scratch or
    not in use yet), so that Triton builds that step's kernel variants at start-up, not under the first such
    prompt (the MoE tiles, for one, follow the token count). Lengths the KV pool cannot hold are skipped; what
    the prompts wrote (slot 0's state, the blocks) is zeroed again, as the pools were allocated."""
    done = [n for n in lengths if n <= cache.num_blocks * block_size]
    for n in done:
        forward(dummy_prefill_batch(n, block_size, device), cache)
    if done:
        cache.ssm[:, 0].zero_()
        cache.conv[:, 0].zero_()
        cache.kv[:, :, : -(-max(done) // block_size)].zero_()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
