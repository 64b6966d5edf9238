"""Log-probabilities of the emitted tokens, as OpenAI's ``logprobs`` report them.

Each emitted token comes from one row of a target pass (the verify row before it), so its log-probability
is read off logits the loop computes anyway: nothing is run again. They are the target's own
log-probabilities, log-softmax of its logits in fp32: before temperature, top-k, top-p and any grammar (as
vLLM reports them by default), so they do not depend on how the token was chosen. Speculative and plain
decoding report the same values up to the rounding of a multi-row pass (in bf16: about one bf16 step).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dflashkit.errors import InvalidInputError

MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target, and the `top` likeliest tokens at its position
    as (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_top_logprobs(top: object, name: str = "logprobs") -> int | None:
    """A requested number of alternatives: None (no log-probabilities) or an integer in [0, 20]."""
    if top is not None and (
        not isinstance(top, numbers.Integral) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS
    ):
        raise InvalidInputError(
            f"{name} must be None or an integer in [0, {MAX_TOP_LOGPROBS}] (the alternatives "
            f"listed per token), got {top!r}"
        )
    return top


def token_logprobs(logits: Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Row i of `logits` [rows >= len(tokens), vocab] is the target's distribution of tokens[i]."""
    if not tokens:
        return []
    logp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)  # [n, vocab]
    ids = torch.tensor(list(tokens), device=logp.device)
    chosen = logp.gather(1, ids[:, None])[:, 0].tolist()
    if not top:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    values, indices = logp.topk(min(top, logp.shape[-1]), dim=-1)  # [n, top], sorted, most likely first
    return [
        TokenLogprob(t, lp, tuple(zip(i, v))) for t, lp, i, v in zip(tokens, chosen, indices.tolist(), values.tolist())
    ]
