"""Adaptive block size: pick each step's verify block to maximise expected tokens per second.

A block of size b costs one drafter pass over b positions plus one target pass over b tokens; on a CPU the
target's cost grows with b (its GEMMs are not free at 16 rows), while the tokens a step yields grow only as
long as drafts keep being accepted. With α_i = P(draft i accepted | drafts 1..i-1 accepted), a step with
block b yields E[b] = 1 + Σ_{i<b} Π_{j≤i} α_j tokens. The policy keeps a running estimate of every α_i
(counts decayed so that it follows the text being generated) and of the wall time of a step at each
candidate size (the fastest of its last few steps: on a shared machine noise only adds time), and chooses
argmax_b E[b] / time(b). Size 1 is a plain autoregressive step (no drafting): when no block pays for its drafting
and verification, the loop falls back to it.

Three guards against wrong estimates (each seen on a 2-core CPU): (1) the first step at a size is not timed,
since a new shape pays one-time costs (oneDNN creates its kernels for it: a 2-token step took 45 ms once, 13 ms
after); (2) every ``explore_every`` steps the size whose timing is oldest is tried again (the largest one first),
and a size's time is the fastest of its last steps, so a size judged on a bad moment gets another chance and deep
positions keep being observed; (3) a position rarely reached borrows its prior from the position before it
(acceptance falls with depth), instead of a flat 1/2 that makes long blocks look better than they are.

Exploration is priced: sizes are tried in increasing order until two of at least 2 tokens are timed; a larger
size is then tried only when it would win with an optimistic time, the straight line through the two largest timed
sizes below it (>= 2, so that the drafter's fixed cost is not read as a per-row cost). A verify's cost grows at
least linearly with its rows on a compute-bound CPU (on AMD Zen 1 a 16-row verify took about 5x a one-row step),
so the line underestimates, and a size it rules out would have lost; on a GPU the line is flat and every size
gets tried. Without this a one-shot generation on a slow CPU spent a quarter of its steps timing blocks 8 and 16
(each as long as 3-5 plain steps) that it then never chose (docs/experiments.md).

Any block size is exact: this only changes speed, never the output.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

COPY_CANDIDATES = (2, 4, 8, 16)  # lengths + 1 of copied drafts (prompt lookup), within the policy's largest block
# The largest block of prompt lookup alone (no drafter) under the adaptive policy: copies of up to 15 tokens, the length
# measured in dflashkit.decoding.lookup, as long as the shipped drafter's blocks of 16. The policy tries 8 and 16 only
# where the times of the smaller copies say they could win, and declines copies that do not pay (plain steps).
LOOKUP_ALONE_BLOCK = 16
# Batched members' blocks (drafted or copied) are capped so that a pass holds about this many of their rows, since
# larger blocks' exploration and rows cost every member of a big batch: on an Intel Xeon with AMX, 16 rows gave each
# batch of 2, 4 and 8 sequences the cap that ran fastest (docs/experiments.md).
BATCH_ROWS = 16


class AdaptiveBlockSize:
    """Chooses the block size of each decode step among ``candidates`` (all <= the drafter's block size).

    ``prior`` = (a, b): a Beta prior of strength a + b; at position 1 its mean is a / (a + b), deeper it is the
    estimate at the position before.
    """

    def __init__(
        self,
        max_block: int,
        candidates: Sequence[int] = (1, 2, 4, 8, 16),
        *,
        prior: tuple[float, float] = (1.0, 1.0),
        decay: float = 0.995,
        time_window: int = 5,
        explore_every: int = 16,
    ) -> None:
        sizes = sorted({int(c) for c in candidates if 1 <= int(c) <= max_block} | {max_block})
        if max_block < 2:
            raise ValueError(f"adaptive block size needs a drafter block size >= 2, got {max_block}")
        self.candidates = sizes
        self.max_block = max_block
        self.prior = prior
        self.decay, self.time_window, self.explore_every = decay, time_window, explore_every
        self.reached = [0.0] * max_block  # index i: steps that proposed draft i+1 with drafts 1..i accepted
        self.accepted = [0.0] * max_block  # ... and accepted it
        self.step_seconds: dict[int, float] = {}  # block size -> wall time of a step (fastest of recent ones)
        self.recent: dict[int, list[float]] = {}  # block size -> its last `time_window` timed steps
        self.full_steps: dict[int, int] = {}  # block size -> full-size steps seen (the first is not timed)
        self.timed_at: dict[int, int] = {}  # block size -> step count when it was last timed
        self.steps = 0
        self._lock = threading.Lock()  # the generations of a batch share one policy (dflashkit.decoding.batching)
        # With prompt lookup: the policy that sizes copied drafts (their own acceptance and step times; None: as
        # long as this policy's largest block). With a drafter its sizes are >= 2: a step with a match always copies
        # (the drafter's policy weighs plain steps); with prompt lookup alone it also has size 1, a plain step.
        self.copies: AdaptiveBlockSize | None = None

    def acceptances(self, positions: int) -> list[float]:
        """Estimated α at draft positions 1..positions; a position's prior mean is the estimate before it."""
        a, b = self.prior
        alphas, mean = [], a / (a + b)
        for i in range(positions):
            mean = (self.accepted[i] + (a + b) * mean) / (self.reached[i] + a + b)
            alphas.append(mean)
        return alphas

    def acceptance(self, position: int) -> float:
        """Estimated α at draft position ``position`` (1-based)."""
        return self.acceptances(position)[-1]

    def expected_tokens(self, block: int) -> float:
        """Expected tokens per step with this block size (accepted drafts + the target's own token)."""
        total, survive = 1.0, 1.0
        for alpha in self.acceptances(block - 1):
            survive *= alpha
            total += survive
        return total

    def estimated_seconds(self, block: int) -> float | None:
        """A step's time at ``block``: measured, or else the line through the two largest timed sizes >= 2 below
        it, continued (an optimistic guess where costs grow at least linearly); None when it cannot be guessed."""
        if block in self.step_seconds:
            return self.step_seconds[block]
        below = sorted(b for b in self.step_seconds if 2 <= b < block)[-2:]
        if len(below) < 2:
            return None
        (b0, t0), (b1, t1) = ((b, self.step_seconds[b]) for b in below)
        return t1 + max(0.0, (t1 - t0) / (b1 - b0)) * (block - b1)

    def choose(self) -> int:
        with self._lock:
            return self._choose()

    def _choose(self) -> int:
        estimates = {c: self.estimated_seconds(c) for c in self.candidates}
        unknown = [c for c, t in estimates.items() if t is None]
        if unknown:  # the small sizes: time them first
            return unknown[0]
        if self.explore_every and self.steps % self.explore_every == self.explore_every - 1:  # the stalest timing again
            return min((c for c in self.candidates if c in self.step_seconds), key=lambda c: (self.timed_at[c], -c))
        # an untimed size wins only if its optimistic time makes it the best: then it is tried (and timed)
        return max(self.candidates, key=lambda c: self.expected_tokens(c) / estimates[c])

    def observe(self, block: int, drafted: int, accepted: int, seconds: float) -> None:
        """Record a step: its block size, drafts proposed and accepted, and its wall time (draft + verify + rest)."""
        with self._lock:
            self._observe(block, drafted, accepted, seconds)

    def _observe(self, block: int, drafted: int, accepted: int, seconds: float) -> None:
        self.steps += 1
        for i in range(self.max_block):
            self.reached[i] *= self.decay
            self.accepted[i] *= self.decay
        for i in range(min(drafted, accepted + 1)):  # positions 1..accepted+1 were judged (the last one rejected)
            self.reached[i] += 1
            if i < accepted:
                self.accepted[i] += 1
        if drafted == block - 1:  # a full-size step (not cut short by max_new_tokens): a fair timing ...
            self.full_steps[block] = self.full_steps.get(block, 0) + 1
            if self.full_steps[block] > 1:  # ... except the first one at this size (one-time costs)
                recent = self.recent.setdefault(block, [])
                recent.append(seconds)
                del recent[: -self.time_window]
                self.step_seconds[block] = min(recent)  # noise on a shared machine only adds time: take the floor
                self.timed_at[block] = self.steps

    def summary(self) -> dict:
        with self._lock:
            return self._summary()

    def _summary(self) -> dict:
        return {
            "candidates": self.candidates,
            "step_ms": {b: round(t * 1e3, 3) for b, t in sorted(self.step_seconds.items())},
            "step_ms_guessed": {
                b: round(t * 1e3, 3)
                for b in self.candidates
                if b not in self.step_seconds and (t := self.estimated_seconds(b)) is not None
            },
            "acceptance": [round(self.acceptance(i), 3) for i in range(1, self.max_block)],
            "expected_tokens": {b: round(self.expected_tokens(b), 3) for b in self.candidates},
            **({"copies": self.copies.summary()} if self.copies is not None else {}),
        }


class BlockPolicies:
    """One :class:`AdaptiveBlockSize` per decoding regime, greedy and sampled, each carrying its estimates over
    from one request to the next. Acceptance differs between them (a sampled draft is accepted with probability
    min(1, p/q); in one benchmark at block 4, position 1: α 0.34-0.48 greedy, 0.33-0.34 at T=1), so a server or
    a benchmark that mixes both should not judge one regime by the other's history.

    Sampled requests choose among blocks of at most ``sampled_max_block`` (4), and their copied drafts are as
    short (the decode loop copies no more than the policy's largest block). At T=1 acceptance falls fast with
    depth (with the shipped drafter α ~0.35 at position 1 and ~0.2 by position 5, so E[8] is no more than E[4]),
    and copied tokens are accepted about as often, so the larger sizes' exploration and long copies cost more than
    they yield: blocks of at most 4 beat the greedy regime's sizes at T=1, and caps of 6 and 8 were no faster than
    4 (docs/experiments.md).

    Members of a batch whose passes run together have policies of their own (their steps' costs are their shares
    of the batch's passes and drafting rounds), one per block cap: their blocks, drafted or copied, are at most
    :meth:`batched_max_block` (:data:`BATCH_ROWS` rows per pass over all members), since a large block's rows and
    its exploration are paid by every member of a big batch.

    Each regime's policy sizes its copied drafts (prompt lookup) with a policy of its own (``policy.copies``,
    lengths + 1 among :data:`COPY_CANDIDATES`): copied tokens are accepted at other rates than drafted ones, and
    a copy of 15 tokens costs a 16-row verify whether or not it holds; sized copies beat copies always as long as
    the largest block (docs/experiments.md).

    ``lookup_alone``: the policies of prompt lookup without a drafter (``max_block``: :data:`LOOKUP_ALONE_BLOCK`).
    Only their copy policies decide: where the text has a match, a copy of 1, 3, 7 or 15 tokens, or none (size 1, a
    plain step) when the estimates say a plain step yields more tokens per second than any copy; every step without
    a copy is reported to them as a plain step (its time is size 1's). A copy's verify rows cost more than they
    yield where copies are rarely accepted or long verifies are slow (a large target on a CPU).
    """

    def __init__(
        self,
        max_block: int,
        sampled_max_block: int = 4,
        batch_rows: int = BATCH_ROWS,
        *,
        lookup_alone: bool = False,
        **kwargs,
    ) -> None:
        self.max_block, self.sampled_max_block, self.batch_rows, self.kwargs = (
            max_block,
            sampled_max_block,
            batch_rows,
            kwargs,
        )
        self.lookup_alone = lookup_alone
        self._policies: dict[tuple[bool, bool, int], AdaptiveBlockSize] = {}
        self._lock = threading.Lock()

    def batched_max_block(self, members: int) -> int:
        """The largest block of a member of a batch of ``members`` sequences whose passes run together: the largest
        power of two (at least 2) with members x block <= ``batch_rows``."""
        block = 2
        while 2 * block * max(1, members) <= self.batch_rows:
            block *= 2
        return block

    def get(self, greedy: bool, batched: bool = False, members: int = 1, tree: bool = False) -> AdaptiveBlockSize:
        """The policy of greedy or sampled requests, decoding alone or as members of a batch of ``members``
        sequences whose passes run together (whose steps wait for the others' and whose passes hold their rows
        too: other costs, so other estimates; their blocks capped by :meth:`batched_max_block`)."""
        largest = self.max_block if greedy else min(self.sampled_max_block, self.max_block)
        if batched and members > 1:
            largest = min(largest, self.batched_max_block(members))
        key = (greedy, batched, largest, tree)  # token trees accept more per depth than chains: estimates apart
        with self._lock:
            if key not in self._policies:
                policy = AdaptiveBlockSize(largest, **self.kwargs)
                copies = [c for c in self.kwargs.get("candidates", COPY_CANDIDATES) if c >= 2] or [policy.max_block]
                if self.lookup_alone:  # no drafter to turn to: a plain step is the alternative to a copy
                    copies = [1, *copies]
                policy.copies = AdaptiveBlockSize(policy.max_block, **{**self.kwargs, "candidates": copies})
                self._policies[key] = policy
            return self._policies[key]

    def for_batch(self, greedy: bool, members: Callable[[], int]) -> BatchSizedPolicy:
        """The policy of a batch member whose batch changes size while it decodes (``members()``: the size now)."""
        return BatchSizedPolicy(self, greedy, members)


class BatchSizedPolicy:
    """A batch member's block-size policy: each step consults the policy of batches of the size the batch has at
    that step (:meth:`BlockPolicies.get`, blocks capped by :meth:`BlockPolicies.batched_max_block`) and reports the
    step to the policy that chose it. Members join and leave while a generation runs: a server's first request of a
    burst starts alone, and with the policy of its start it kept blocks of 16 in a batch of 8 (at 8 clients, 213
    tok/s against 277 with every member's block capped at 2, ``scripts/serve_concurrency.py``). ``max_block`` is the
    largest block any batch size allows (the decode loop sizes its caches by it); ``copies`` follows the same way."""

    def __init__(self, policies: BlockPolicies, greedy: bool, members: Callable[[], int], copies: bool = False) -> None:
        self._policies, self._greedy, self._members, self._of_copies = policies, greedy, members, copies
        self.max_block = policies.get(greedy, batched=True, members=1).max_block
        self._chosen: AdaptiveBlockSize | None = None
        self.copies = None if copies else BatchSizedPolicy(policies, greedy, members, copies=True)

    def current(self) -> AdaptiveBlockSize:
        """The policy of the batch's size now (its copy policy, for ``copies``)."""
        policy = self._policies.get(self._greedy, batched=True, members=max(1, self._members()))
        return policy.copies if self._of_copies else policy

    def choose(self) -> int:
        self._chosen = self.current()
        return self._chosen.choose()

    def observe(self, block: int, drafted: int, accepted: int, seconds: float) -> None:
        (self._chosen or self.current()).observe(block, drafted, accepted, seconds)
