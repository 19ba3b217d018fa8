"""Adaptive K: how many drafts each sequence gets this step, from the batch size, the measured cost of a
step with drafts and the measured acceptance. Plain Python (the scheduler owns it).

Rule: with a_j the acceptance of draft position j (an EWMA of the fraction of verified drafts at j that
were accepted), a step with K drafts emits on average E(K) = 1 + a_0 + a_0 a_1 + ... + a_0 ... a_{K-1}
tokens per sequence (a rejection ends the run) and costs c(B, K) plain decode steps at B decoding
sequences (`step_cost`: drafting + verify + commit against the plain step, measured per device and
drafter). K = argmax_K E(K) / c(B, K) over 0..num_speculative_tokens, with E(0) = c(B, 0) = 1: drafts are
off wherever they do not pay (a large batch, a poor drafter). B above the table's last row: off (not
measured; large batches are compute-bound and vLLM lost to no-spec at 256 concurrent).
When acceptance alone turned drafts off (some K would pay at full acceptance), every `probe_interval`-th
step drafts one token anyway, so a_0 keeps being measured and drafting comes back when it pays again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

CostTable = tuple[tuple[int, tuple[float, ...]], ...]     # rows (max_batch, (c(B, 1), c(B, 2), ...))

# c(B, K) measured with benchmarks/spec_decode.py (docs/PERFORMANCE.md has the runs and their conditions).
# On CUDA: the mean step with K drafts all accepted over the mean plain step (what throughput sees); the verify
# step replays a CUDA graph per (batch bucket, K + 1) up to runner/verify_graphs.MAX_VERIFY_BATCH sequences.
# "free" drafters (n-gram, a host lookup) pay verify + commit; "mtp" adds its K head forwards and lm_heads (run
# eagerly: ~3-4 ms a draft position at batch 1, so no K pays with MTP drafts on CUDA yet). Batch 64 is left
# out of the CUDA rows (above the table drafts are off): its verify steps run eagerly, its all-accepted means
# (0.87-1.20) cannot be trusted as a cost (runs with rejections lost: 0.59-1.02x plain at acceptance 2.0-3.39).
# On CPU: the median step over the median plain step.
STEP_COST: dict[tuple[str, str], CostTable] = {
    # H200, Qwen3.5-35B-A3B shape, bf16, 1,024-token prompts, 48 new tokens
    ("cuda", "free"): ((1, (1.48, 1.68, 1.87, 2.02)), (8, (1.53, 1.78, 1.98, 2.06))),
    ("cuda", "mtp"): ((1, (3.29, 3.66, 4.81, 5.57)), (8, (2.36, 3.13, 3.54, 4.04))),
    # this project's 2-CPU machine, the embedded model's shape, eager decode path, 64 new tokens
    ("cpu", "free"): ((1, (1.33, 1.49, 1.72, 1.98)), (8, (1.25, 1.39, 1.61, 1.86))),
    ("cpu", "mtp"): ((1, (1.58, 1.93, 2.41, 2.74)), (8, (1.45, 1.84, 2.30, 2.68))),
}
DEFAULT_PRIOR = 0.8               # starting acceptance per position (published p1 acceptance: 0.83-0.87)
DEFAULT_ALPHA = 0.2               # EWMA weight of one step's measurement
DEFAULT_PROBE_INTERVAL = 32


@dataclasses.dataclass(frozen=True)
class AdaptivePolicy:
    step_cost: CostTable = STEP_COST[("cuda", "free")]
    prior: float = DEFAULT_PRIOR
    alpha: float = DEFAULT_ALPHA
    probe_interval: int = DEFAULT_PROBE_INTERVAL
    fixed_k: int | None = None        # tests and benchmarks: this K every step, whatever the batch

    def __post_init__(self):
        bounds = [b for b, _ in self.step_cost]
        if not bounds or any(b < 1 for b in bounds) or bounds != sorted(set(bounds)):
            raise ValueError(f"adaptive K: step_cost bounds must be increasing and >= 1, got {bounds}")
        for _, costs in self.step_cost:
            if not costs or any(not c > 0 for c in costs):
                raise ValueError(f"adaptive K: step_cost costs must be > 0, got {costs}")
        for key in ("prior",):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"adaptive K: {key} must be in [0, 1], got {getattr(self, key)}")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"adaptive K: alpha must be in (0, 1], got {self.alpha}")
        if self.probe_interval < 1:
            raise ValueError(f"adaptive K: probe_interval must be >= 1, got {self.probe_interval}")
        if self.fixed_k is not None and self.fixed_k < 0:
            raise ValueError(f"adaptive K: fixed_k must be >= 0, got {self.fixed_k}")

    @classmethod
    def pinned(cls, k: int) -> AdaptivePolicy:
        return cls(fixed_k=k)

    @classmethod
    def for_device(cls, device_type: str, method: str) -> AdaptivePolicy:
        """The measured cost table of this device kind and drafter (unmeasured devices use the H200's)."""
        kind = "mtp" if method == "mtp" else "free"
        return cls(step_cost=STEP_COST.get((device_type, kind), STEP_COST[("cuda", kind)]))

    def costs(self, batch_size: int) -> tuple[float, ...]:
        """c(B, 1..) for a step of `batch_size` decoding sequences; () above the table: no drafts."""
        for bound, costs in self.step_cost:
            if batch_size <= bound:
                return costs
        return ()


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """E(K): mean tokens a step with k drafts emits per sequence."""
    total, reach = 1.0, 1.0
    for j in range(k):
        reach *= acceptance[j]
        total += reach
    return total


class AdaptiveK:
    def __init__(self, max_k: int, policy: AdaptivePolicy = AdaptivePolicy()):
        if max_k < 1:
            raise ValueError(f"adaptive K: num_speculative_tokens must be >= 1, got {max_k}")
        self.max_k = max_k
        self.policy = policy
        self.acceptance = [policy.prior] * max_k      # EWMA per draft position
        self._steps_off = 0                           # steps since drafts were last turned off by acceptance

    def best_k(self, batch_size: int) -> int:
        """argmax_K E(K) / c(B, K) (no probing)."""
        if self.policy.fixed_k is not None:
            return min(self.max_k, self.policy.fixed_k)
        costs = self.policy.costs(batch_size)
        best, best_rate = 0, 1.0
        for k in range(1, min(self.max_k, len(costs)) + 1):
            rate = expected_tokens(self.acceptance, k) / costs[k - 1]
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def k_for_step(self, batch_size: int) -> int:
        """The drafts per speculating sequence for a step of `batch_size` decoding sequences."""
        k = self.best_k(batch_size)
        if k == 0 and self.policy.fixed_k is None and self._could_pay(batch_size):
            self._steps_off += 1
            if self._steps_off >= self.policy.probe_interval:
                self._steps_off = 0
                return 1
        return k

    def _could_pay(self, batch_size: int) -> bool:
        """Whether some K would pay at full acceptance (K + 1 tokens for c(B, K)): else probing is waste."""
        costs = self.policy.costs(batch_size)
        return any(k + 1 > c for k, c in enumerate(costs[: self.max_k], start=1))

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
        if self.policy.fixed_k is not None:
            return f"speculative K fixed at {min(self.max_k, self.policy.fixed_k)}"
        rows = ", ".join(f"batch<={b}: " + "/".join(f"{c:.2f}" for c in costs[: self.max_k])
                         for b, costs in self.policy.step_cost)
        return (f"adaptive speculative K (max {self.max_k}): K maximises expected tokens / step cost, step cost "
                f"of K = 1..{self.max_k} drafts in plain steps {rows}, larger batches: K=0; acceptance per "
                f"position an EWMA (prior {self.policy.prior}); with drafts off one probe step every "
                f"{self.policy.probe_interval}")
