"""Acceptance of the embedded model's MTP head as a drafter (spec/mtp.py), teacher-forced on held-out English.

For every position t of a text (the text itself as context), the target emits its greedy token g_1 at t and
the drafter proposes d_1..d_K from there, exactly as in serving: its first pass over the rows the target
just ran (the text token after each, g_1 after t), then K - 1 steps from its own output. The target's greedy
continuation g_2..g_{K+1} from text[:t+1] + g_1 decides: the accepted length at K is 1 (the emitted token) plus
the number of leading drafts among the first K that equal it; the mean over positions is what greedy
speculative decoding would accept per step with K drafts (SGLang's "acceptance length", 3.39 at K = 3 for
Qwen3.5 at full size: wave2.md §2.3).

The paragraphs are written for this benchmark (not from the Brown corpus or nlp-corpus the model was trained
on). Run: PYTHONPATH=. python benchmarks/mtp_acceptance.py [--k-max 4] [--heldout-file tests/data/heldout.txt]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

HELD_OUT_TEXT = [
    ("On the morning of the storm, the ferry to the island did not run, and the people who had come down to "
     "the dock stood for a while under the roof of the ticket office, watching the gray water. A woman with a "
     "basket of bread said that her brother had crossed in worse weather, years ago, and had never been sorry "
     "for it. Nobody answered her. By ten o'clock most of them had gone back up the hill to the town, and the "
     "man who sold the tickets closed his window and sat down to read the paper."),
    ("The city council met on Thursday night to discuss the new bridge. Several members said that the cost of "
     "the project had grown too large, and that the money would be better spent on the schools. The mayor "
     "told the council that the state had promised to pay for half of the work, but only if the city agreed "
     "to begin before the end of the year. After two hours of debate, the council voted to delay its decision "
     "until the next meeting."),
    ("My grandfather kept a small garden behind the house, where he grew beans, tomatoes and a few rows of "
     "corn. Every evening after supper he would walk out with a bucket of water and look at each plant as if "
     "it were an old friend. He did not talk much about the war or about the years he spent working on the "
     "railroad, but he could tell you the name of every bird that came to the fence."),
    ("Many students find that the first year of college is harder than they expected. They must learn to "
     "manage their own time, to live with people they have never met, and to study without a teacher telling "
     "them what to do each day. Some of them do well from the start, while others need a semester or two "
     "before they feel at home. In either case, the experience changes the way they think about themselves."),
    ("The doctor came out of the room and closed the door behind him. He looked tired, and for a moment he "
     "said nothing at all. Then he told the family that the operation had gone well, that the boy was "
     "sleeping, and that they could see him in the morning. The mother began to cry, and the father put his "
     "hand on her shoulder and thanked the doctor again and again."),
]


@dataclasses.dataclass
class Result:
    k_max: int
    positions: int
    matches: list[int]        # per position: leading drafts (of k_max) equal to the target's greedy continuation
    seconds: float

    def mean_accepted_length(self, k: int) -> float:
        """Mean tokens per step with k drafts: the emitted token plus the accepted leading drafts."""
        return 1 + sum(min(m, k) for m in self.matches) / max(1, self.positions)

    def accept_rate(self, i: int) -> float:
        """P(draft i accepted | drafts 1..i-1 accepted)."""
        reached = sum(m >= i - 1 for m in self.matches)
        return sum(m >= i for m in self.matches) / max(1, reached)

    def summary(self) -> str:
        lines = [f"MTP acceptance, embedded model, {self.positions} positions ({self.seconds:.1f} s)",
                 "K  mean accepted length  P(draft K accepted | 1..K-1 accepted)"]
        for k in range(1, self.k_max + 1):
            lines.append(f"{k}  {self.mean_accepted_length(k):.3f}                 {self.accept_rate(k):.3f}")
        return "\n".join(lines)


def _batch(token: int, pos: int, slot: int, num_blocks: int, block_size: int, *, prefill: bool):
    from deltaserve.batch import ForwardBatch

    i32 = {"dtype": torch.int32}
    return ForwardBatch(
        input_ids=torch.tensor([token]), positions=torch.tensor([pos]), cu_seqlens=torch.tensor([0, 1], **i32),
        seq_lens=torch.tensor([pos + 1], **i32), state_slots=torch.tensor([slot], **i32),
        has_initial_state=torch.tensor([not prefill]), slot_mapping=torch.tensor([pos]),
        block_tables=torch.arange(num_blocks, **i32)[None], num_prefills=int(prefill),
        num_prefill_tokens=int(prefill))


def _rows(positions: list[int], num_blocks: int, block_size: int):
    """The rows t-1, t of the one sequence (blocks 0, 1, 2, ... in order: slot = position)."""
    from deltaserve.batch import ForwardBatch

    n, end = len(positions), positions[-1] + 1
    i32 = {"dtype": torch.int32}
    return ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.long), positions=torch.tensor(positions),
        cu_seqlens=torch.tensor([0, n], **i32), seq_lens=torch.tensor([end], **i32),
        state_slots=torch.tensor([0], **i32), has_initial_state=torch.tensor([positions[0] > 0]),
        slot_mapping=torch.tensor(positions), block_tables=torch.arange(num_blocks, **i32)[None],
        num_prefills=int(n > 1), num_prefill_tokens=n if n > 1 else 0)


@torch.inference_mode()
def measure_ids(model, ids: list[int], k_max: int, block_size: int = 16) -> list[int]:
    """Leading matches per position of one token sequence (see the module docstring)."""
    from deltaserve.batch import CacheBuffers
    from deltaserve.spec.mtp import MTPDrafter

    n = len(ids)
    num_blocks = -(-(n + k_max + 2) // block_size)
    cache = CacheBuffers.allocate(model.config, num_slots=2, num_blocks=num_blocks, block_size=block_size,
                                  device="cpu", dtype=torch.float32, mtp_kv_layers=1)
    drafter = MTPDrafter(model, cache, "cpu")
    capacity = torch.tensor([num_blocks * block_size])
    tables = torch.arange(num_blocks, dtype=torch.int32)[None]
    matches, prev_hidden = [], None
    for t in range(n):
        h = model(_batch(ids[t], t, 0, num_blocks, block_size, prefill=t == 0), cache)          # main: slot 0
        g = [int(model.compute_logits(h).argmax(-1))]
        # the drafter: row t-1 (its next token is the text's) and row t (the emitted one)
        positions = [t - 1, t] if t else [t]
        hidden = torch.cat([prev_hidden, h]) if t else h
        nxt = torch.tensor(([ids[t]] if t else []) + [g[0]])
        drafts = drafter.draft(hidden, _rows(positions, num_blocks, block_size), nxt,
                               torch.tensor([len(positions) - 1]), torch.tensor([0]), k_max,
                               kv_capacity=capacity, block_tables=tables)[0].tolist()
        prev_hidden = h
        # the target's greedy continuation, on a copy of the state (its K/V rows past t are rewritten later)
        cache.copy_slot(0, 1)
        for j in range(k_max):
            hb = model(_batch(g[-1], t + 1 + j, 1, num_blocks, block_size, prefill=False), cache)
            g.append(int(model.compute_logits(hb).argmax(-1)))
        m = 0
        while m < k_max and drafts[m] == g[m + 1]:
            m += 1
        matches.append(m)
    return matches


def measure(texts: list[str], k_max: int = 4) -> Result:
    from deltaserve import DEFAULT_MODEL_PATH
    from deltaserve.models.loader import load_model
    from deltaserve.ops import select_kernels
    from deltaserve.tokenizer import Tokenizer

    model = load_model(DEFAULT_MODEL_PATH, device="cpu", dtype=torch.float32, kernels=select_kernels("cpu"),
                       show_progress=False)
    tokenizer = Tokenizer(DEFAULT_MODEL_PATH)
    start = time.perf_counter()
    matches = []
    for text in texts:
        matches += measure_ids(model, tokenizer.encode(text, add_special_tokens=False), k_max)
    return Result(k_max, len(matches), matches, time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--k-max", type=int, default=4)
    p.add_argument("--heldout-file", type=Path, default=None,
                   help="also measure this text (e.g. tests/data/heldout.txt, the training split's held-out part)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (one suits this small model)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure(HELD_OUT_TEXT, args.k_max)
    print("text written for this benchmark (5 paragraphs)")
    print(result.summary(), flush=True)
    if args.heldout_file is not None:
        text = args.heldout_file.read_text()
        chunks = [c for c in text.split("\n\n") if c.strip()]
        other = measure(chunks, args.k_max)
        print(f"\n{args.heldout_file}")
        print(other.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
