"""The two plain data objects a forward pass needs: what to run (ForwardBatch) and where per-sequence
state lives (CacheBuffers). Layers read both; they never allocate state themselves.
"""

from __future__ import annotations

import dataclasses

import torch

from .cache.plan import pool_shapes
from .config import ModelConfig
from .ops.chunks import PREFILL_CHUNK, chunk_offsets


@dataclasses.dataclass
class ForwardBatch:
    """N sequences packed into T tokens. The first `num_prefills` sequences are prefill chunks (any
    length, possibly continuing from saved state); the remaining N - num_prefills are decodes (exactly
    one token each, always continuing from saved state), so the decode tokens are the last
    T - num_prefill_tokens tokens.

    Speculative verify chunks (a sequence's last token and its K drafts) are the last `num_verifies` of
    the prefill sequences (their `num_verify_tokens` tokens end the prefill tokens): attention runs them
    like prefill chunks (all K+1 K/V written, causal within the chunk), GDN layers run them through
    gdn_verify, which leaves the pools untouched and records into `verify` what gdn_commit applies once
    the accepted counts are known (spec/verify.py).

    Device tensors:
      input_ids [T] int64, positions [T] int64,
      cu_seqlens [N + 1] int32      token offsets of the sequences in the packed batch
      seq_lens [N] int32            context length of each sequence after this step (cached + new)
      state_slots [N] int32         GDN state slot of each sequence (-1 = padded row)
      has_initial_state [N] bool    continue from the slot's saved state (False: start from zero)
      slot_mapping [T] int64        flat KV-cache slot of each token (-1 = padded token)
      block_tables [N, max_blocks] int32
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lens: torch.Tensor
    state_slots: torch.Tensor
    has_initial_state: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    num_prefills: int
    num_prefill_tokens: int
    # The decodes' state slots (state_slots[num_prefills:]) as a tensor of their own, 16-byte aligned (the
    # runner packs one): Triton builds a kernel variant per pointer alignment, so a slice whose start moves
    # with num_prefills would trigger builds in the middle of serving. None: the slice is used.
    decode_state_slots: torch.Tensor | None = None
    # Decode-only batches (token row == sequence row): a negative input id means "the token the previous
    # step is still sampling", read on the device from last_tokens[state_slots[row]] (int64 per slot).
    # None: every input id is a token.
    last_tokens: torch.Tensor | None = None
    # The longest prefill chunk's token count (host int, from the scheduler's lengths): the chunked prefill's kernel
    # choice reads it (its cu_seqlens live on the device). None: not known.
    max_prefill_len: int | None = None
    num_verifies: int = 0
    num_verify_tokens: int = 0
    verify: "VerifyRecord | None" = None        # set when num_verifies > 0

    @property
    def num_plain_prefills(self) -> int:
        """The prefill sequences that are not verify chunks (they come first)."""
        return self.num_prefills - self.num_verifies

    # Per-step metadata the prefill ops read, built on first use and reused by every layer of the step
    # (prefill_chunk_offsets): (the cu_seqlens and num_prefills it was built from, the offsets). None: not built.
    step_metadata: tuple | None = dataclasses.field(default=None, repr=False)

    def prefill_chunk_offsets(self) -> torch.Tensor:
        """[num_plain_prefills + 1] int32 cumulative PREFILL_CHUNK-token chunk counts of the prefill sequences (every GDN
        layer's conv and chunked delta rule locate their chunks from them): built once per step, on the device
        (again for a copy of the batch with other cu_seqlens or prefills)."""
        memo = self.step_metadata
        n = self.num_plain_prefills                 # verify chunks follow the prefills and have no chunks
        if memo is None or memo[0] is not self.cu_seqlens or memo[1] != n:
            offsets = chunk_offsets(self.cu_seqlens[: n + 1], PREFILL_CHUNK)
            memo = self.step_metadata = (self.cu_seqlens, n, offsets)
        return memo[2]

    def decode_slots(self) -> torch.Tensor:
        """State slots of the decode sequences."""
        if self.decode_state_slots is not None:
            return self.decode_state_slots
        return self.state_slots[self.num_prefills :]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.state_slots.shape[0])

    @property
    def num_decodes(self) -> int:
        return self.num_seqs - self.num_prefills

    def prefill_part(self) -> "ForwardBatch":
        """The prefill sequences only (a view; offsets are unchanged since they come first)."""
        n, t = self.num_prefills, self.num_prefill_tokens
        return dataclasses.replace(
            self, input_ids=self.input_ids[:t], positions=self.positions[:t],
            cu_seqlens=self.cu_seqlens[: n + 1], seq_lens=self.seq_lens[:n], state_slots=self.state_slots[:n],
            has_initial_state=self.has_initial_state[:n], slot_mapping=self.slot_mapping[:t],
            block_tables=self.block_tables[:n], num_prefills=n, num_prefill_tokens=t, decode_state_slots=None,
            last_tokens=None, max_prefill_len=self.max_prefill_len,
        )


@dataclasses.dataclass
class VerifyRecord:
    """A verify step's per-layer results: each GDN layer appends (stash, conv pool, ssm pool) as it runs its
    verify chunks, and the runner commits them all once the accepted counts are known. cu_seqlens [V + 1]
    int32 (token offsets within the verify tokens) and state_slots [V] int32 of the verify chunks."""

    cu_seqlens: torch.Tensor
    state_slots: torch.Tensor
    layers: list = dataclasses.field(default_factory=list)
    # a VerifyStash per GDN layer, in layer order, of at least the step's verify tokens (a verify graph's,
    # shared by its buckets); None: each layer allocates its own
    stashes: list | None = None


@dataclasses.dataclass
class CacheBuffers:
    """Per-sequence model state, owned by the caller and indexed by slot / block ids.

      ssm  [L_gdn, S, HV, K, V]   fp32 recurrent state of every GDN layer (state slot S)
      conv [L_gdn, S, W-1, D]     conv window (last W-1 pre-conv inputs) of every GDN layer
      kv   [L_attn + L_mtp, 2, B, BS, NKV, HD]  paged K/V of every full-attention layer, then (speculation
                                  with mtp) of each MTP layer: the same block ids and slots address both
    """

    ssm: torch.Tensor
    conv: torch.Tensor
    kv: torch.Tensor

    @classmethod
    def allocate(
        cls, config: ModelConfig, *, num_slots: int, num_blocks: int, block_size: int,
        device: torch.device | str, dtype: torch.dtype, state_dtype: torch.dtype = torch.float32,
        num_attention_layers: int | None = None, mtp_kv_layers: int = 0,
    ) -> "CacheBuffers":
        """Zeroed pools of the layout cache/plan.py sizes."""
        shapes = pool_shapes(config, num_slots=num_slots, num_blocks=num_blocks, block_size=block_size,
                             num_attention_layers=num_attention_layers, mtp_kv_layers=mtp_kv_layers)
        return cls(ssm=torch.zeros(shapes.ssm, dtype=state_dtype, device=device),
                   conv=torch.zeros(shapes.conv, dtype=dtype, device=device),
                   kv=torch.zeros(shapes.kv, dtype=dtype, device=device))

    @property
    def num_slots(self) -> int:
        return int(self.ssm.shape[1])

    @property
    def num_blocks(self) -> int:
        return int(self.kv.shape[2])

    @property
    def block_size(self) -> int:
        return int(self.kv.shape[3])

    def mtp_kv(self, config: ModelConfig, layer: int) -> torch.Tensor:
        """The paged K/V [2, B, BS, NKV, HD] of MTP layer `layer` (appended after the model's attention layers)."""
        index = len(config.attention_layer_ids) + layer
        if not 0 <= layer < self.kv.shape[0] - len(config.attention_layer_ids):
            raise ValueError(f"the KV pool has {self.kv.shape[0]} layers: no MTP layer {layer} after the model's "
                             f"{len(config.attention_layer_ids)} (allocate the pools with mtp_kv_layers)")
        return self.kv[index]

    def slot_bytes(self) -> int:
        return (self.ssm[:, 0].numel() * self.ssm.element_size()
                + self.conv[:, 0].numel() * self.conv.element_size())

    def snapshot(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of one slot's GDN state across all layers (prefix caching, speculation)."""
        return self.ssm[:, slot].clone(), self.conv[:, slot].clone()

    def restore(self, slot: int, snap: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.ssm[:, slot].copy_(snap[0])
        self.conv[:, slot].copy_(snap[1])

    def copy_slot(self, src: int, dst: int) -> None:
        self.ssm[:, dst].copy_(self.ssm[:, src])
        self.conv[:, dst].copy_(self.conv[:, src])
