"""The engine's structured-output and sampling-extras bookkeeping, kept out of llm_engine.py: request checks
that need the vocabulary or tokenizer (logit_bias ids, bad_words tokenized, grammars compiled), matchers per
sequence from admission to retirement, which sequences of a step are constrained, and their masks.
The StructuredOutputManager (and xgrammar) is made on the first constrained request."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from ..sampling_params import SamplingParams
from ..step_io import GrammarMasks, SchedulerOutput


class EngineGrammars:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, frozenset(eos_token_ids)
        self._manager = None
        self._lock = threading.Lock()
        self._compiled: dict[str, tuple[Any, str]] = {}   # request id -> (compiled grammar, kind), until admitted

    # ---- add_request (any thread) ------------------------------------------------------------
    def check(self, request_id: str, params: SamplingParams) -> SamplingParams:
        """Validate what needs the vocabulary or tokenizer (ValueError naming the field); returns the params
        (bad_words resolved to token ids, on a copy). A grammar is compiled now and kept for `admit`."""
        bad = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer: the model directory has no tokenizer.json")
            params = params.clone()
            params.resolve_bad_words(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        so = params.structured_outputs
        if so is not None:
            compiled = self.manager().compile(so)
            with self._lock:
                self._compiled[request_id] = (compiled, so.kind)
        return params

    def forget(self, request_id: str) -> None:
        """A checked request that was not queued after all."""
        with self._lock:
            self._compiled.pop(request_id, None)

    def manager(self):
        """The StructuredOutputManager, made on first use (it imports xgrammar and reads the vocabulary)."""
        with self._lock:
            if self._manager is None:
                if self.tokenizer is None:
                    raise ValueError("structured_outputs need a tokenizer: the model directory has no "
                                     "tokenizer.json")
                from .manager import StructuredOutputManager

                self._manager = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._manager

    # ---- the step thread ---------------------------------------------------------------------
    def admit(self, request_id: str, seq_ids: list[int]) -> None:
        """The request joins the engine: one matcher per sequence (n > 1: one each)."""
        with self._lock:
            compiled = self._compiled.pop(request_id, None)
        if compiled is not None:
            for seq_id in seq_ids:
                self._manager.add(seq_id, *compiled)

    def retire(self, seq_id: int) -> None:
        if self._manager is not None:
            self._manager.remove(seq_id)

    def accept(self, seq_id: int, token: int) -> bool:
        """Advance a constrained sequence's matcher (others: nothing); True when its grammar has completed."""
        return self._manager is not None and seq_id in self._manager and self._manager.accept(seq_id, token)

    def constrained(self, seq_id: int) -> bool:
        """Whether the sequence samples under a grammar (its masks need every token: it never speculates)."""
        return self._manager is not None and seq_id in self._manager

    def samplers(self, sched: SchedulerOutput, seqs: dict) -> list[int]:
        """Running constrained sequences that sample a token in `sched` (their chunk reaches their end)."""
        if not self._manager:
            return []
        out = []
        for c in sched.chunks:
            seq = seqs.get(c.seq_id)
            if (c.seq_id in self._manager and seq is not None and seq.status.value == "running"
                    and c.num_computed + c.num_new == seq.num_scheduled_tokens):
                out.append(c.seq_id)
        return out

    def needs_pending(self, sched: SchedulerOutput, seqs: dict) -> bool:
        """A constrained sequence of `sched` has a token in flight: its mask needs that token first."""
        return any(seqs[s].num_pending for s in self.samplers(sched, seqs))

    def masks(self, sched: SchedulerOutput, seqs: dict) -> GrammarMasks | None:
        """Start filling the bitmasks of the constrained sequences sampling in `sched` (None: there are none)."""
        seq_ids = self.samplers(sched, seqs)
        return self._manager.masks(seq_ids) if seq_ids else None
