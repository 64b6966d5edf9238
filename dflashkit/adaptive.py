"""Adaptive block size: pick each step's verify block to maximise expected tokens per second.

A block of size b costs one drafter pass over b positions plus one target pass over b tokens; on a CPU the
target's cost grows with b (its GEMMs are not free at 16 rows), while the tokens a step yields grow only as
long as drafts keep being accepted. With α_i = P(draft i accepted | drafts 1..i-1 accepted), a step with
block b yields E[b] = 1 + Σ_{i<b} Π_{j≤i} α_j tokens. The policy keeps a running estimate of every α_i
(counts with a Beta prior, decayed so that it follows the text being generated) and of the wall time of a
step at each candidate size, and chooses argmax_b E[b] / time(b). Size 1 is a plain autoregressive step (no
drafting): when no block pays for its drafting and verification, the loop falls back to it. Every size is
tried once first, and the largest one is tried again every ``explore_every`` steps so that estimates for deep
positions stay current.

Any block size is exact: this only changes speed, never the output.
"""

from __future__ import annotations

from collections.abc import Sequence


class AdaptiveBlockSize:
    """Chooses the block size of each decode step among ``candidates`` (all <= the drafter's block size)."""

    def __init__(self, max_block: int, candidates: Sequence[int] = (1, 2, 4, 8, 16), *,
                 prior: tuple[float, float] = (1.0, 1.0), decay: float = 0.995, time_smoothing: float = 0.2,
                 explore_every: int = 16) -> None:
        sizes = sorted({int(c) for c in candidates if 1 <= int(c) <= max_block} | {max_block})
        if max_block < 2:
            raise ValueError(f"adaptive block size needs a drafter block size >= 2, got {max_block}")
        self.candidates = sizes
        self.max_block = max_block
        self.prior = prior
        self.decay, self.time_smoothing, self.explore_every = decay, time_smoothing, explore_every
        self.reached = [0.0] * max_block  # index i: steps that proposed draft i+1 with drafts 1..i accepted
        self.accepted = [0.0] * max_block  # ... and accepted it
        self.step_seconds: dict[int, float] = {}  # block size -> smoothed wall time of a step
        self.steps = 0

    def acceptance(self, position: int) -> float:
        """Estimated α at draft position ``position`` (1-based)."""
        a, b = self.prior
        i = position - 1
        return (self.accepted[i] + a) / (self.reached[i] + a + b)

    def expected_tokens(self, block: int) -> float:
        """Expected tokens per step with this block size (accepted drafts + the target's own token)."""
        total, survive = 1.0, 1.0
        for position in range(1, block):
            survive *= self.acceptance(position)
            total += survive
        return total

    def choose(self) -> int:
        untried = [c for c in self.candidates if c not in self.step_seconds]
        if untried:
            return untried[0]
        if self.explore_every and self.steps % self.explore_every == self.explore_every - 1:
            return self.max_block
        return max(self.candidates, key=lambda c: self.expected_tokens(c) / self.step_seconds[c])

    def observe(self, block: int, drafted: int, accepted: int, seconds: float) -> None:
        """Record a step: its block size, drafts proposed and accepted, and its wall time (draft + verify + rest)."""
        self.steps += 1
        for i in range(self.max_block):
            self.reached[i] *= self.decay
            self.accepted[i] *= self.decay
        for i in range(min(drafted, accepted + 1)):  # positions 1..accepted+1 were judged (the last one rejected)
            self.reached[i] += 1
            if i < accepted:
                self.accepted[i] += 1
        if drafted == block - 1:  # a full-size step (not cut short by max_new_tokens): a fair timing
            old = self.step_seconds.get(block)
            self.step_seconds[block] = seconds if old is None else old + self.time_smoothing * (seconds - old)

    def summary(self) -> dict:
        return {
            "candidates": self.candidates,
            "step_ms": {b: round(t * 1e3, 3) for b, t in sorted(self.step_seconds.items())},
            "acceptance": [round(self.acceptance(i), 3) for i in range(1, self.max_block)],
            "expected_tokens": {b: round(self.expected_tokens(b), 3) for b in self.candidates},
        }
