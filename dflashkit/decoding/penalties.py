"""Penalties and logit bias: OpenAI's presence / frequency penalties and ``logit_bias``, and the multiplicative
repetition penalty of transformers and vLLM.

They make the target's next-token distribution depend on the text so far, so speculative decoding stays
exact only if every verify row is adjusted with its own history: the output before the block, then the anchor
and the drafts before that row. `PenaltyState.apply` does that for a whole verify block at once; the plain loop
calls the same function on its single row, so both decode the same adjusted target. In order, on fp32 logits:

1. repetition penalty r (tokens in the prompt or the output so far): a logit x becomes x / r if x > 0, else x * r;
2. x - frequency * count - presence * [count > 0], counts over the output so far (the prompt excluded, as OpenAI);
3. + logit_bias[token].

Temperature, top-k, top-p and any grammar come after. Log-probabilities (`dflashkit.target.logprobs`) are reported
before all of this, as the target's own.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dflashkit.errors import InvalidInputError

MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on |logit_bias|


@dataclass(frozen=True)
class Penalties:
    """presence / frequency: OpenAI's (-2 to 2; 0: off); repetition: transformers' / vLLM's (> 0; 1: off);
    logit_bias: {token id: bias in [-100, 100]}."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, low, high in (("presence", -2.0, 2.0), ("frequency", -2.0, 2.0)):
            value = getattr(self, name)
            if not _is_real(value) or not low <= value <= high:
                raise InvalidInputError(f"{name}_penalty must be a number in [{low:g}, {high:g}], got {value!r}")
        if not _is_real(self.repetition) or not (0 < self.repetition < math.inf):
            raise InvalidInputError(f"repetition_penalty must be a finite number > 0 (1: off), got {self.repetition!r}")
        if not isinstance(self.logit_bias, Mapping):
            raise InvalidInputError(f"logit_bias must map token ids to biases, got {type(self.logit_bias).__name__}")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, numbers.Integral) or isinstance(token, bool) or token < 0:
                raise InvalidInputError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not _is_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidInputError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for {token}")
        object.__setattr__(self, "logit_bias", {int(t): float(b) for t, b in self.logit_bias.items()})

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.logit_bias)

    def check_vocab(self, vocab_size: int) -> None:
        bad = [t for t in self.logit_bias if t >= vocab_size]
        if bad:
            raise InvalidInputError(f"logit_bias names token {bad[0]}, outside the vocabulary [0, {vocab_size})")

    def start(self, prompt_ids: Sequence[int], vocab_size: int, device: torch.device | str) -> PenaltyState:
        """The state of one generation after `prompt_ids`."""
        self.check_vocab(vocab_size)
        return PenaltyState(self, prompt_ids, vocab_size, device)


class PenaltyState:
    """Token counts of one generation's output (and which tokens its prompt holds)."""

    def __init__(
        self, penalties: Penalties, prompt_ids: Sequence[int], vocab_size: int, device: torch.device | str
    ) -> None:
        self.penalties = penalties
        self.counts = torch.zeros(vocab_size, device=device)  # [vocab] output tokens so far
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.in_prompt[torch.tensor(list(prompt_ids), dtype=torch.long, device=device)] = True
        self.bias = torch.zeros(vocab_size, device=device)
        if penalties.logit_bias:
            tokens = torch.tensor(list(penalties.logit_bias), dtype=torch.long, device=device)
            self.bias[tokens] = torch.tensor(list(penalties.logit_bias.values()), device=device)

    def consume(self, tokens: Sequence[int]) -> None:
        """Count emitted tokens into the history."""
        for t in tokens:
            self.counts[t] += 1

    def apply(self, logits: Tensor, drafts: Sequence[int] | Tensor = ()) -> Tensor:
        """Adjusted fp32 logits [rows, vocab] of a verify block: row r's history is the output so far plus
        drafts[:r] (row 0 follows the output so far; the drafts are the tokens in the block after the anchor)."""
        p = self.penalties
        rows = logits.shape[0]
        counts = self.counts.expand(rows, -1).clone()  # [rows, vocab]
        for r, t in enumerate(torch.as_tensor(drafts).tolist()[: rows - 1], start=1):
            counts[r:, t] += 1
        x = logits.float()
        if p.repetition != 1.0:
            seen = self.in_prompt | (counts > 0)
            x = torch.where(seen, torch.where(x > 0, x / p.repetition, x * p.repetition), x)
        if p.frequency:
            x = x - p.frequency * counts
        if p.presence:
            x = x - p.presence * (counts > 0).float()
        if p.logit_bias:
            x = x + self.bias
        return x


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
