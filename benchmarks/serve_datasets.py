"""Workloads of the serving benchmark (benchmarks/serve.py), deterministic for a seed.

Prompts are token ids (exact lengths; sent to /v1/completions) or, for the chat form of multi-turn, text of
random words (lengths approximate: the server's tokenizer decides). Every request carries `reusable`: how many
of its prompt tokens an ideal prefix cache could serve from earlier requests of the workload (ignoring block
granularity, eviction and requests still running), the denominator of the "hit rate of the reusable tokens".
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# token ids drawn from [TOKEN_LO, TOKEN_HI): ordinary tokens of any Qwen vocabulary (and of the embedded
# model's 8,192), far from the special ids at the top
TOKEN_LO, TOKEN_HI = 10, 1000
WORDS = ("alpha", "river", "stone", "green", "cloud", "tiger", "piano", "north", "paper", "light", "quiet",
         "forest", "silver", "window", "garden", "planet", "copper", "winter", "signal", "harbor")


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    output_len: int
    reusable: int = 0


@dataclass(frozen=True)
class Conversation:
    """A multi-turn conversation: the system prompt, then per turn the user's tokens (ids) or text; each turn
    resends the whole history (system, earlier users and the server's earlier answers) plus the new user turn."""
    system: list[int] | str
    users: list[list[int]] | list[str]
    output_len: int
    system_shared: bool = field(default=False)   # the same system prompt as an earlier conversation


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _around(rng: random.Random, length: int, ratio: float) -> int:
    """vLLM's --random-range-ratio: uniform in [length * (1 - r), length * (1 + r)], at least 1."""
    if not 0 <= ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    return max(1, rng.randint(int(length * (1 - ratio)), int(length * (1 + ratio))))


def random_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   seed: int = 0) -> list[BenchRequest]:
    """Independent random prompts (no reuse expected)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        n_in, n_out = _around(rng, input_len, range_ratio), _around(rng, output_len, range_ratio)
        out.append(BenchRequest(_ids(rng, n_in), n_out))
    return out


def prefix_repetition_dataset(num_prompts: int, num_prefixes: int, prefix_len: int, suffix_len: int,
                              output_len: int, seed: int = 0) -> list[BenchRequest]:
    """num_prefixes shared prefixes of prefix_len tokens, each request one of them (shuffled, every prefix
    used about equally) plus its own suffix of suffix_len tokens."""
    if num_prefixes < 1 or prefix_len < 1:
        raise ValueError("--prefix-repetition-num-prefixes and --prefix-repetition-prefix-len must be >= 1")
    rng = random.Random(seed)
    prefixes = [_ids(rng, prefix_len) for _ in range(num_prefixes)]
    which = [i % num_prefixes for i in range(num_prompts)]
    rng.shuffle(which)
    seen: set[int] = set()
    out = []
    for p in which:
        out.append(BenchRequest(prefixes[p] + _ids(rng, suffix_len), output_len,
                                reusable=prefix_len if p in seen else 0))
        seen.add(p)
    return out


def multi_turn_dataset(num_conversations: int, turns: int, system_len: int, user_len: int, output_len: int,
                       seed: int = 0, text: bool = False, shared_system: bool = True) -> list[Conversation]:
    """Conversations of `turns` turns. text=True: the system prompt and user turns are random words (one word
    for each wanted token: roughly that many tokens), for the chat endpoint; else token ids."""
    if turns < 1:
        raise ValueError(f"--multi-turn-turns must be >= 1, got {turns}")
    rng = random.Random(seed)
    make = (lambda n: _text(rng, n)) if text else (lambda n: _ids(rng, n))
    system = make(system_len)
    out = []
    for i in range(num_conversations):
        own = system if shared_system else make(system_len)
        out.append(Conversation(own, [make(user_len) for _ in range(turns)], output_len,
                                system_shared=shared_system and i > 0))
    return out
