"""The losslessness contract, checked: where speculative and plain greedy outputs part, and whether that
point is a numerical tie.

In fp32 speculative greedy output equals plain greedy output token for token. In bf16 a B-token verify
pass and a 1-token decode step round differently, so the two may part where the plain step's two
candidate logits are within 2 ulps of the largest absolute logit (a tie); anywhere else is a bug.
The same holds for coupled sampling (``sampler="coupled"``): speculative output is the plain sampled output
of the seed, and a departure is judged on the plain step's noisy scores (logits / temperature + noise).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

TIE_ULPS = 2
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}


def ulp(x: float, dtype: torch.dtype = torch.bfloat16) -> float:
    """Spacing of representable numbers of `dtype` at magnitude |x|."""
    x = abs(x)
    if x == 0:
        return 0.0
    return 2.0 ** (math.floor(math.log2(x)) - MANTISSA_BITS[dtype])


def is_tie(margin: float, max_abs_logit: float, dtype: torch.dtype = torch.bfloat16) -> bool:
    """A margin between two logits small enough that rounding alone can flip their order."""
    return margin <= TIE_ULPS * ulp(max_abs_logit, dtype)


@dataclass
class Divergence:
    """First index where speculative and plain greedy outputs differ, judged on plain decoding's logits."""

    index: int
    spec_token: int | None  # None: the speculative output ended here
    ar_token: int | None  # None: the plain output ended here
    margin: float | None  # plain logits: logit[ar_token] - logit[spec_token] (>= 0)
    max_abs_logit: float | None
    tie: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def classify(ar_logits: Tensor, ar_token: int, spec_token: int, index: int, dtype: torch.dtype) -> Divergence:
    """Judge one divergence from the plain step's logits row [vocab]."""
    row = ar_logits.float()
    margin = float(row[ar_token] - row[spec_token])
    finite = row[torch.isfinite(row)]  # a grammar's or top-k's -inf entries are not logits
    max_abs = float(finite.abs().max()) if finite.numel() else 0.0
    return Divergence(index, spec_token, ar_token, margin, max_abs, is_tie(margin, max_abs, dtype))


class DivergenceRecorder:
    """Observer for the plain (autoregressive) run that judges its first departure from `reference`.

    Pass it as `observer=` to the plain run; it sees every step's logits and emitted token.
    """

    def __init__(self, reference: list[int], dtype: torch.dtype) -> None:
        self.reference = reference
        self.dtype = dtype
        self.index = 0
        self.divergence: Divergence | None = None

    def __call__(self, logits: Tensor, emitted: list[int]) -> None:
        for row, token in zip(logits[-len(emitted) :], emitted):
            if self.divergence is None and self.index < len(self.reference) and token != self.reference[self.index]:
                self.divergence = classify(row, token, self.reference[self.index], self.index, self.dtype)
            self.index += 1

    def result(self, ar_tokens: list[int]) -> Divergence | None:
        """The first divergence, including one output ending before the other."""
        if self.divergence is not None:
            return self.divergence
        n = min(len(ar_tokens), len(self.reference))
        if len(ar_tokens) == len(self.reference):
            return None
        spec = self.reference[n] if n < len(self.reference) else None
        ar = ar_tokens[n] if n < len(ar_tokens) else None
        return Divergence(n, spec, ar, None, None, False)
