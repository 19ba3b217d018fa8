"""Adaptive K: how many drafts each sequence gets this step, from the batch size and the measured
acceptance. Plain Python (the scheduler owns it).

Rule, in two caps on `num_speculative_tokens` (the user's maximum):
1. batch table: the step's number of decoding sequences picks K from `batch_table`, rows (max_batch, K)
   in increasing max_batch; above the last row K = 0 (large batches are compute-bound: verifying K+1
   positions costs ~K+1 plain steps and drafts do not pay: vLLM lost to no-spec at 256 concurrent).
2. acceptance: draft position j (0-based) is kept only while the measured probability that it is
   reached, prod_{i<j} acceptance[i], is >= `min_reach`. acceptance[i] is an EWMA of the fraction of
   verified drafts at position i that were accepted. Position 0 is always reached, so acceptance alone
   never turns drafting off (K >= 1 whenever the table allows drafts): position 0 keeps being measured
   and K grows back when acceptance recovers.

The numbers below are placeholders TO BE MEASURED on the H200 (issue 27's benchmark: step time of
K = 1..4 against the plain step at batch 1, 8, 64); only the rule's shape is tested.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

# TO BE MEASURED on the H200 (wave2.md §2.5's starting point: K=3 at <= 16, 1 at <= 64, 0 above)
DEFAULT_BATCH_TABLE: tuple[tuple[int, int], ...] = ((4, 4), (16, 3), (64, 1))
DEFAULT_MIN_REACH = 0.35          # TO BE MEASURED: the reach probability at which a draft stops paying
DEFAULT_PRIOR = 0.8               # starting acceptance per position (published p1 acceptance: 0.83-0.87)
DEFAULT_ALPHA = 0.1               # EWMA weight of one step's measurement


@dataclasses.dataclass(frozen=True)
class AdaptivePolicy:
    batch_table: tuple[tuple[int, int], ...] = DEFAULT_BATCH_TABLE
    min_reach: float = DEFAULT_MIN_REACH
    prior: float = DEFAULT_PRIOR
    alpha: float = DEFAULT_ALPHA

    def __post_init__(self):
        bounds = [b for b, _ in self.batch_table]
        if any(b < 1 for b in bounds) or bounds != sorted(set(bounds)):
            raise ValueError(f"adaptive K: batch_table bounds must be increasing and >= 1, got {bounds}")
        if any(k < 0 for _, k in self.batch_table):
            raise ValueError(f"adaptive K: batch_table K values must be >= 0, got {self.batch_table}")
        for key in ("min_reach", "prior"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"adaptive K: {key} must be in [0, 1], got {getattr(self, key)}")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"adaptive K: alpha must be in (0, 1], got {self.alpha}")

    def table_k(self, batch_size: int) -> int:
        for bound, k in self.batch_table:
            if batch_size <= bound:
                return k
        return 0


class AdaptiveK:
    def __init__(self, max_k: int, policy: AdaptivePolicy = AdaptivePolicy()):
        if max_k < 1:
            raise ValueError(f"adaptive K: num_speculative_tokens must be >= 1, got {max_k}")
        self.max_k = max_k
        self.policy = policy
        self.acceptance = [policy.prior] * max_k      # EWMA per draft position

    def k_for_step(self, batch_size: int) -> int:
        """The drafts per speculating sequence for a step of `batch_size` decoding sequences."""
        k = min(self.max_k, self.policy.table_k(batch_size))
        reach = 1.0
        for j in range(k):
            if reach < self.policy.min_reach:
                return j
            reach *= self.acceptance[j]
        return k

    def observe(self, num_drafts: Sequence[int], num_accepted: Sequence[int]) -> None:
        """One verify step's results per row: drafts proposed and how many of them were accepted. Row
        positions < accepted count as accepted, position `accepted` (if drafted) as rejected; positions
        after it were never verified and teach nothing."""
        verified = [0] * self.max_k
        accepted = [0] * self.max_k
        for n, a in zip(num_drafts, num_accepted, strict=True):
            if not 0 <= a <= n <= self.max_k:
                raise ValueError(f"adaptive K: {a} accepted of {n} drafts (max {self.max_k})")
            for j in range(min(a + 1, n)):
                verified[j] += 1
                accepted[j] += j < a
        w = self.policy.alpha
        for j in range(self.max_k):
            if verified[j]:
                self.acceptance[j] += w * (accepted[j] / verified[j] - self.acceptance[j])

    def describe(self) -> str:
        """The start-up log line."""
        rows = ", ".join(f"batch<={b}: K={min(k, self.max_k)}" for b, k in self.policy.batch_table)
        return (f"adaptive speculative K (max {self.max_k}): {rows}, larger: K=0; a draft position is kept "
                f"while its reach probability (EWMA of acceptance, prior {self.policy.prior}) is >= "
                f"{self.policy.min_reach}")
