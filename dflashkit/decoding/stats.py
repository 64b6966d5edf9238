"""Statistics of one generation: acceptance (τ, per-position, histogram), forwards and time per phase.

Conventions follow the DFlash paper: τ = accepted draft tokens per verification step + 1 (the target's
own token), so τ is 1 for plain decoding and at most the block size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DecodeStats:
    block_size: int  # 1 for plain autoregressive decoding
    prompt_tokens: int = 0
    cached_prompt_tokens: int = (
        0  # of them, restored from a prefix cache instead of prefilled (dflashkit.decoding.prefix_cache)
    )
    new_tokens: int = 0
    target_forwards: int = 0  # prefill + one per verification step
    accepted_lengths: list[int] = field(default_factory=list)  # accepted drafts per step (0..block_size-1)
    drafted_lengths: list[int] = field(default_factory=list)  # drafts proposed per step (< block_size near the end)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    decode_s: float = 0.0  # wall time after prefill, all phases
    finish_reason: str | None = None  # "stop" (eos/stop token/stop string) or "length"
    adaptive: bool = False  # block size chosen per step (drafted_lengths + 1 gives each step's block)
    target_weights: str | None = (
        None  # what the target computed with: "bfloat16", "int8 weight-only (per-channel)", ...
    )
    engine: str | None = None  # which target forward decoded (TargetAdapter.engine): the fast path or eager
    lookup: bool = False  # prompt lookup on: some steps' drafts were copied from earlier text
    copied_steps: list[bool] = field(default_factory=list)  # per step: drafts copied (True) or the drafter's
    store_steps: list[bool] = field(default_factory=list)  # per step: copied from the n-gram store of past answers
    tree: int | None = None  # drafter steps verified token trees of up to this many nodes (None: chains)
    tree_nodes: list[int] = field(default_factory=list)  # per step: nodes of its tree (0: a chain)
    draft_window: int | None = None  # drafting attended to the last this many context tokens (None: all)
    grammar: str | None = None  # structured output: the kind of grammar the output was constrained to
    sampler: str | None = (
        None  # when sampling: "rejection" or "coupled" (dflashkit.decoding.sampling); None when greedy
    )

    def record_step(
        self, drafted: int, accepted: int, copied: bool = False, from_store: bool = False, tree_nodes: int = 0
    ) -> None:
        """`drafted`: block positions proposed (a tree's depth); `accepted`: drafts kept (a tree's path length)."""
        self.drafted_lengths.append(drafted)
        self.accepted_lengths.append(accepted)
        self.copied_steps.append(copied)
        self.store_steps.append(from_store)
        self.tree_nodes.append(tree_nodes)

    @classmethod
    def combined(cls, runs: list[DecodeStats]) -> DecodeStats:
        """The stats of several generations of one prompt as one (the server's n choices): their steps
        together, tokens and times summed; settings (block size, engine, ...) from the first."""
        first = runs[0]
        out = cls(
            block_size=max(r.block_size for r in runs),
            prompt_tokens=first.prompt_tokens,
            cached_prompt_tokens=first.cached_prompt_tokens,
            adaptive=first.adaptive,
            target_weights=first.target_weights,
            engine=first.engine,
            lookup=first.lookup,
            tree=first.tree,
            draft_window=first.draft_window,
            grammar=first.grammar,
            sampler=first.sampler,
        )
        for r in runs:
            out.new_tokens += r.new_tokens
            out.target_forwards += r.target_forwards
            for name in ("accepted_lengths", "drafted_lengths", "copied_steps", "store_steps", "tree_nodes"):
                getattr(out, name).extend(getattr(r, name))
            for name in ("prefill_s", "draft_s", "verify_s", "decode_s"):
                setattr(out, name, getattr(out, name) + getattr(r, name))
        return out

    @property
    def steps(self) -> int:
        return len(self.accepted_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens per verification step (accepted drafts + 1); 1.0 for plain decoding."""
        return (sum(self.accepted_lengths) / self.steps + 1.0) if self.steps else 0.0

    @property
    def accepted_per_position(self) -> list[int]:
        """accepted_per_position[k-1]: steps whose k-th draft token was accepted."""
        counts = [0] * (self.block_size - 1)
        for a in self.accepted_lengths:
            for k in range(a):
                counts[k] += 1
        return counts

    @property
    def drafted_per_position(self) -> list[int]:
        """drafted_per_position[k-1]: steps that proposed a k-th draft token."""
        counts = [0] * (self.block_size - 1)
        for d in self.drafted_lengths:
            for k in range(d):
                counts[k] += 1
        return counts

    @property
    def acceptance_histogram(self) -> list[int]:
        """histogram[a]: steps that accepted exactly a drafts (a = 0 .. block_size-1)."""
        hist = [0] * self.block_size
        for a in self.accepted_lengths:
            hist[a] += 1
        return hist

    @property
    def other_s(self) -> float:
        """Decode time outside the drafter and the target's verify passes (bookkeeping, sampling, Python)."""
        return max(0.0, self.decode_s - self.draft_s - self.verify_s)

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of wall time, prefill included."""
        total = self.prefill_s + self.decode_s
        return self.new_tokens / total if total > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second after the prompt: the tokens after the first (which the prefill chooses) over the decode
        time; None before any decoding. Its ratio between two runs is their speedup, prefill excluded."""
        return max(1, self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "adaptive": self.adaptive,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "new_tokens": self.new_tokens,
            "tau": self.tau,
            "steps": self.steps,
            "target_forwards": self.target_forwards,
            "draft_tokens": sum(self.drafted_lengths),
            "accepted_tokens": sum(self.accepted_lengths),
            "accepted_per_position": self.accepted_per_position,
            "drafted_per_position": self.drafted_per_position,
            "acceptance_histogram": self.acceptance_histogram,
            "tokens_per_s": self.tokens_per_s,
            "time_s": {
                "prefill": self.prefill_s,
                "draft": self.draft_s,
                "verify": self.verify_s,
                "other": self.other_s,
                "decode": self.decode_s,
            },
            "finish_reason": self.finish_reason,
            "target_weights": self.target_weights,
            "engine": self.engine,
            "draft_window": self.draft_window,
            "grammar": self.grammar,
            "sampler": self.sampler,
            "lookup": self.lookup_summary() if self.lookup else None,
            "tree": self.tree_summary() if self.tree else None,
        }

    def tree_summary(self) -> dict[str, Any]:
        """Token-tree steps: the node budget, how many steps verified a tree, their mean nodes and τ."""
        acc = [a for a, n in zip(self.accepted_lengths, self.tree_nodes) if n]
        nodes = [n for n in self.tree_nodes if n]
        return {
            "budget": self.tree,
            "tree_steps": len(acc),
            "mean_nodes": sum(nodes) / len(nodes) if nodes else None,
            "tree_tau": sum(acc) / len(acc) + 1.0 if acc else None,
        }

    def lookup_summary(self) -> dict[str, Any]:
        """Steps whose drafts were copied (by prompt lookup from the text, or from the n-gram store of past
        answers) vs drafted by the drafter, with each one's τ."""
        out = {}
        kinds = {"copied": lambda c, st: c, "store": lambda c, st: st, "drafter": lambda c, st: not c}
        for name, want in kinds.items():
            acc = [a for a, c, st in zip(self.accepted_lengths, self.copied_steps, self.store_steps) if want(c, st)]
            out[f"{name}_steps"] = len(acc)
            out[f"{name}_tau"] = sum(acc) / len(acc) + 1.0 if acc else None
        return out
