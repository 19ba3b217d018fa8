"""Engine-side structured output over xgrammar.

`StructuredOutputManager` compiles a request's `StructuredOutputsParams` into a grammar (xgrammar's
`GrammarCompiler` caches compiled grammars by their text, so a schema sent again is not recompiled), keeps
one `GrammarMatcher` per constrained sequence (n > 1: one each), advances it with every token the sequence
appends, and fills the token bitmasks of a step: one int32 row of ceil(vocab / 32) words per mask, bit t
set when token t is allowed.

Life of a constrained step (engine/llm_engine.py):
1. After scheduling, the engine asks `masks(...)` for the constrained sequences that sample this step. The
   fill is submitted to a worker thread (xgrammar's batch fill runs in C++ threads without the GIL) and
   returned as a `GrammarMasks` whose `get()` waits for it; it travels in `SchedulerOutput.grammar`.
2. The runner queues the forward first and calls `get()` only when it reaches the sampler, so the masks are
   filled while the device (or, on CPU, torch's own threads) runs the forward.
3. The sampler applies the mask after logit_bias, penalties and bad words, before temperature / top-k / top-p
   (disallowed logits become -inf). Returned logprobs stay those of the raw model distribution, as in vLLM.
4. When the tokens come back, `accept` advances each matcher; a matcher that has terminated (the grammar
   accepted an end token) ends its sequence with finish_reason "stop".

A constrained row needs its previous token in the matcher before its mask can be filled, so under async
scheduling a step holding a constrained sequence with a token in flight is launched only after that token is
read (like penalty rows).

End of sequence: the matcher's stop tokens are the engine's EOS ids, which the mask allows only where the
grammar can end. A grammar that has completed allows nothing but them.

Speculative decoding (not in the engine yet): `fill` takes, per sequence, the draft tokens proposed after
its last accepted token and fills len(draft) + 1 masks for it (one per verified position: the mask for
position i is the one after accepting draft[:i]); the matcher is rolled back afterwards, so only the tokens
the verifier accepts are then passed to `accept`. Positions after a draft token the grammar rejects cannot
be accepted by the verifier; they repeat the last valid mask, so no row is left all -inf.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..sampling_params import StructuredOutputsParams
from ..step_io import GrammarMasks

logger = logging.getLogger(__name__)


def _xgr():
    import xgrammar

    return xgrammar


_SERIAL_FILL_ROWS = 4


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


@dataclasses.dataclass
class _Matcher:
    matcher: Any                     # xgrammar.GrammarMatcher
    kind: str


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int], *, max_threads: int = 8):
        """tokenizer: deltaserve's Tokenizer (HF `tokenizers` underneath); vocab_size: the model's (the
        width of the logits and masks); stop_token_ids: the ids that end a sequence (EOS)."""
        xgr = _xgr()
        backend = tokenizer._tok                       # the HF tokenizers object: vocab and its metadata
        vocab = backend.get_vocab(with_added_tokens=True)
        encoded = [""] * vocab_size
        for token, idx in vocab.items():
            if idx < vocab_size:
                encoded[idx] = token
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        stops = sorted(set(stop_token_ids))
        if not stops:
            raise ValueError("structured output needs an EOS token id (the model has none)")
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo(encoded, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                                      stop_token_ids=stops, add_prefix_space=meta["add_prefix_space"])
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=True)
        self._batch = xgr.BatchGrammarMatcher(max_threads=max_threads)
        self._matchers: dict[int, _Matcher] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

    # ---- requests -----------------------------------------------------------------------------
    def compile(self, so: StructuredOutputsParams) -> Any:
        """The compiled grammar of `so` (cached by xgrammar); ValueError naming the field and the problem."""
        kind = so.kind
        value = getattr(so, kind)
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(value if isinstance(value, str) else json.dumps(value),
                                                         any_whitespace=not so.disable_any_whitespace)
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}',      # OpenAI: an object, not any JSON
                                                         any_whitespace=not so.disable_any_whitespace)
            if kind == "regex":
                return self.compiler.compile_regex(value)
            if kind == "choice":
                return self.compiler.compile_grammar(_choice_grammar(value))
            if kind == "grammar":
                return self.compiler.compile_grammar(value)
            return self.compiler.compile_structural_tag(value if isinstance(value, str) else json.dumps(value))
        except (RuntimeError, ValueError, TypeError) as exc:     # xgrammar: RuntimeError, InvalidJSONError, ...
            text = str(exc).strip()
            # xgrammar's C++ messages start "[hh:mm:ss] /path/file.cc:123: "; the rest names the problem
            message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.splitlines()[0]) if text else type(exc).__name__
            raise ValueError(f"structured_outputs.{kind}: cannot be compiled: {message}") from None

    def add(self, seq_id: int, compiled: Any, kind: str) -> None:
        self._matchers[seq_id] = _Matcher(_xgr().GrammarMatcher(compiled), kind)

    def remove(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def accept(self, seq_id: int, token: int) -> bool:
        """Advance the sequence's matcher by one sampled token; True when the grammar has now terminated
        (the sequence must end). A token the mask did not allow is an internal error."""
        m = self._matchers[seq_id].matcher
        if not m.accept_token(token):
            raise RuntimeError(f"structured output: token {token} of sequence {seq_id} is not allowed by its "
                               "grammar although the mask was applied")
        return m.is_terminated()

    # ---- masks --------------------------------------------------------------------------------
    def fill(self, seq_ids: Sequence[int], drafts: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """Bitmasks for `seq_ids` on the host: int32 [rows, ceil(vocab / 32)]. Without drafts one row per
        sequence. With drafts (speculative decoding), len(drafts[i]) + 1 rows per sequence, in order: the
        mask before each draft token and one after the last; the matchers are rolled back afterwards."""
        xgr = _xgr()
        if drafts is None:
            mask = xgr.allocate_token_bitmask(len(seq_ids), self.vocab_size)
            live = [(i, self._matchers[s].matcher) for i, s in enumerate(seq_ids)]
            # a terminated matcher (its sequence finished in the step in flight: the extra token is dropped)
            # keeps the all-ones row allocate_token_bitmask made
            live = [(i, m) for i, m in live if not m.is_terminated()]
            if len(live) <= _SERIAL_FILL_ROWS:       # xgrammar's thread fan-out costs more than a few rows
                for i, m in live:
                    m.fill_next_token_bitmask(mask, i)
            elif live:
                self._batch.batch_fill_next_token_bitmask([m for _, m in live], mask, [i for i, _ in live])
            return mask
        rows = sum(len(d) + 1 for d in drafts)
        mask = xgr.allocate_token_bitmask(rows, self.vocab_size)
        row = 0
        for seq_id, draft in zip(seq_ids, drafts):
            m = self._matchers[seq_id].matcher
            accepted = 0
            for pos in range(len(draft) + 1):
                if m.is_terminated():
                    mask[row + pos] = mask[row + pos - 1] if pos else -1
                    continue
                m.fill_next_token_bitmask(mask, row + pos)
                if pos < len(draft):
                    if m.accept_token(draft[pos]):
                        accepted += 1
                    else:            # later positions cannot be verified: repeat this mask
                        for later in range(pos + 1, len(draft) + 1):
                            mask[row + later] = mask[row + pos]
                        break
            if accepted:
                m.rollback(accepted)
            row += len(draft) + 1
        return mask

    def masks(self, seq_ids: list[int]) -> GrammarMasks:
        """Start filling the masks of `seq_ids` on the worker thread; `get()` on the result waits for them."""
        future = self._pool.submit(self.fill, list(seq_ids))
        return GrammarMasks(list(seq_ids), future.result)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _choice_grammar(choices: Sequence[str]) -> str:
    """EBNF for exactly one of the strings (JSON string literals are valid EBNF string literals)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)
