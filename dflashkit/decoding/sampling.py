"""Sampling and verification math: warping, greedy acceptance, exact speculative (rejection) sampling.

Every emitted token is distributed exactly as the target's warped distribution given the tokens emitted
before it (Leviathan et al. / Chen et al.), whatever the drafter proposes:

* proposal x ~ q (or x = argmax q, i.e. a one-hot q) is accepted with probability min(1, p(x) / q(x));
* at the first rejection the token is drawn from norm(max(0, p - q));
* if all drafts are accepted, one more token is drawn from p at the next position.

A chain of sampled drafts is verified as a block instead (:func:`block_verification`, Sun et al. 2024): the same
exactness, and never fewer drafts kept in expectation (the shipped drafter at T=1, block 16, no lookup: +2-6%).

Greedy decoding (temperature 0) is the limit: accept the longest prefix equal to the target's argmax,
then emit the target's argmax.

Coupled sampling (``sampler="coupled"``, :class:`PositionNoise`) is the other exact scheme: the token at output
position t is the Gumbel-max sample argmax(log p_t + G_t), with noise G_t a fixed function of (seed, t). The
drafter proposes argmax(log q_t + G_t) with the same noise and verification is greedy on the noisy scores, so
the output is the plain sampled sequence for that seed, whatever the drafter, block size, prompt lookup, batch
or timing did (drafter-invariant speculative sampling, Daliri et al. 2024, "Coupling without communication").
A draft is accepted a little less often than under rejection sampling (shipped SmolLM2 drafter, T=1, first
draft position: 0.30 vs 0.34 = sum min(p, q)).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from dflashkit.errors import InvalidInputError
from dflashkit.kernels import row_kernels


@dataclass(frozen=True)
class SamplingParams:
    """Temperature 0 means greedy. top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise InvalidInputError(f"{name} must be a number, got {value!r}")
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise InvalidInputError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.top_k, numbers.Integral) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise InvalidInputError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def warp(logits: Tensor, params: SamplingParams) -> Tensor:
    """Probabilities [..., vocab] after temperature, then top-k, then top-p (transformers' order)."""
    logits = logits.float()
    if params.temperature != 1.0:  # dividing by 1 is exact: skip the pass over [rows, vocab]
        logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (always keeps the first)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def argmax(logits: Tensor, allowed: Tensor | None = None) -> Tensor:
    """Index of the largest logit per row [..., vocab] -> [...]; the first one on ties, as ``Tensor.argmax``.

    bf16 logits on a CPU with dflashkit's row kernels: :func:`dflashkit.kernels.row_kernels.argmax` (16 x 49152 logits:
    0.06 ms). Otherwise in fp32: the conversion is exact and keeps the order, and torch's CPU argmax is 4-5x faster
    on fp32 than on bf16 (16 x 49152 logits: 1.6 ms in bf16, 0.33 ms with the conversion).

    With ``allowed`` [..., vocab] (bool; a grammar's masks): the largest allowed logit, i.e. the argmax of the
    logits set to -inf elsewhere. Where the plain argmax is allowed it is that one (masking only removes
    entries, and no earlier entry ties with the first maximum), so only the other rows are masked.
    """
    best = row_kernels.argmax(logits)
    if best is None:
        best = logits.float().argmax(-1)
    if allowed is None:
        return best
    flat_best, flat_allowed = best.reshape(-1), allowed.to(best.device).reshape(-1, allowed.shape[-1])
    redo = ~flat_allowed.gather(1, flat_best[:, None])[:, 0]  # [rows]: plain argmax not allowed
    if bool(redo.any()):
        rows = logits.reshape(-1, logits.shape[-1])[redo].float()
        flat_best[redo] = rows.masked_fill(~flat_allowed[redo], float("-inf")).argmax(-1)
    return flat_best.view(best.shape)


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of probs [..., vocab] -> [...] (long), by inverting the cumulative distribution.

    ``torch.multinomial`` draws one exponential variate per vocabulary entry; one uniform per row against the
    float64 running sum is 10-40x faster on a CPU (a 49K-entry row: 0.06 ms against 0.84).
    Rows need not be normalised (the residual distributions of speculative sampling are not).
    """
    flat = probs.reshape(-1, probs.shape[-1])
    at = 1 - torch.rand(flat.shape[0], 1, generator=generator, dtype=torch.float64, device=flat.device)
    return _invert(flat, at).view(probs.shape[:-1])


def sample_at(probs: Tensor, at: float) -> int:
    """The token of one row of probs [vocab] (need not be normalised) at the point ``at`` in (0, 1] of its running
    sum: what :func:`sample` does with ``at`` = 1 - a uniform."""
    flat = probs.reshape(1, -1)
    return int(_invert(flat, torch.tensor([[at]], dtype=torch.float64, device=flat.device))[0])


def _invert(flat: Tensor, at: Tensor) -> Tensor:
    """Per row of flat [rows, vocab], the first index whose float64 running sum reaches at [rows, 1] (in (0, 1]) times
    the row's total: that index always has probability > 0."""
    cdf = flat.cumsum(-1, dtype=torch.float64)  # [rows, vocab]
    point = at * cdf[:, -1:]  # [rows, 1], in (0, total]
    return torch.searchsorted(cdf, point).clamp_max(flat.shape[-1] - 1)[:, 0]  # clamp: only a sum rounding past it


def over_vocabulary(q: Tensor, token_ids: Tensor, vocab_size: int) -> Tensor:
    """Distributions q [k, V'] over the tokens ``token_ids`` [V'] (a draft vocabulary) as rows over the whole
    vocabulary [k, vocab_size], 0 elsewhere."""
    return q.new_zeros(q.shape[0], vocab_size).index_copy_(1, token_ids.to(q.device), q)


def propose(
    draft_logits: Tensor,
    params: SamplingParams,
    mode: str,
    generator: torch.Generator | None,
    token_ids: Tensor | None = None,
    vocab_size: int | None = None,
    dense: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Draft tokens [k] and their proposal distribution q [k, vocab] (None means one-hot at the tokens).

    draft_logits [k, V'] score the tokens ``token_ids`` [V'] (a draft vocabulary: q is 0 elsewhere; None:
    the columns are the whole vocabulary). Warping and sampling over V' columns instead of the whole
    vocabulary gives the same q (tokens outside have probability 0 either way) for a fraction of the work.
    ``dense=False``: q stays [k, V'] over ``token_ids`` (what :func:`verify_sampled_logits` takes with them).

    mode "argmax": deterministic proposals (one-hot q);
    mode "sample": x ~ q independently per position from the drafter's warped distribution. When the drafter
    is close to the target, sampling accepts more (P(accept) = sum min(p, q) instead of p(argmax q)):
    with the SmolLM2 drafter shipped on 2026-11-22, at temperature 1 and block 4, τ 1.35-1.43 against 1.24-1.33
    with argmax proposals on the three evaluation sets. Warped by a temperature alone on a CPU, the softmax and the
    draws are one call (:func:`dflashkit.kernels.row_kernels.sample_rows`), which draws as :func:`sample` with the
    same uniforms.
    """
    if mode not in ("argmax", "sample"):
        raise InvalidInputError(f"proposal mode must be 'argmax' or 'sample', got {mode!r}")
    if mode == "argmax" or params.greedy:
        column = argmax(draft_logits)  # [k]
        return (token_ids[column] if token_ids is not None else column), None
    uniforms = torch.rand(draft_logits.shape[0], generator=generator, dtype=torch.float64, device=draft_logits.device)
    done = (
        row_kernels.sample_rows(draft_logits, params.temperature, uniforms)
        if temperature_only(params, draft_logits.shape[-1])
        else None
    )
    if done is not None:
        column, q = done  # [k], [k, V']
    else:
        q = warp(draft_logits, params)  # [k, V']
        column = _invert(q, 1 - uniforms[:, None])  # [k]
    if token_ids is None:
        return column, q
    if vocab_size is None:
        raise InvalidInputError("propose: vocab_size is needed with token_ids")
    return token_ids[column], (over_vocabulary(q, token_ids, vocab_size) if dense else q)


def temperature_only(params: SamplingParams, vocab: int) -> bool:
    """Whether ``warp`` applies a temperature alone to rows of ``vocab`` entries (no top-k / top-p cut)."""
    return (not params.top_k or params.top_k >= vocab) and params.top_p >= 1.0


SAMPLERS = ("rejection", "coupled")


def check_sampler(sampler: object) -> str:
    """A sampler name: "rejection" (speculative sampling of Leviathan et al.) or "coupled" (Gumbel-max with
    per-position noise: the same output for a seed with any drafter); raises InvalidInputError otherwise."""
    if sampler not in SAMPLERS:
        raise InvalidInputError(f"sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    return sampler  # type: ignore[return-value]


_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """SplitMix64's output function (Steele, Lea & Flood 2014): a 64-bit bijection that spreads every input bit."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _mul32(x: Tensor, constant: int) -> Tensor:
    """(x * constant) mod 2^32 for int64 tensors holding uint32 values, in halves that cannot overflow int64."""
    return (x * (constant & 0xFFFF) + (((x * (constant >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _lowbias32(x: Tensor) -> Tensor:
    """Chris Wellons' lowbias32 integer hash on int64 tensors holding uint32 values (csrc/row_layers.h's, lane by
    lane)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x21F0AAAD)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x735A2D97)
    return x ^ (x >> 15)


class PositionNoise:
    """Gumbel noise for coupled sampling: G[t, v] for output position t and token v, a fixed function of (seed,
    t, v), so plain and speculative decoding of one seed score each position with the same noise.

    It is counter-based: position t has a 64-bit key (SplitMix64 of the seed's and t), and G[t, v] = -log(-log u)
    with u = ((h >> 8) | 1) / 2^24, h = lowbias32(lowbias32(v ^ key_lo) ^ key_hi); so a decision computes the noise of
    the columns it reads when it reads them, nothing drawn ahead or kept. On a CPU with dflashkit's row kernels the
    noise, the scores and their argmax are one kernel call per decision (:func:`dflashkit.kernels.row_kernels.coupled`:
    ~0.05-0.08 ms a 49,152-entry row on AMD EPYC Zen 4, where numpy's PCG64 and torch's logs took ~0.36 ms plus
    the scores' small ops); elsewhere torch computes the same hash and its own logs, which may round a last bit
    differently: a seed's output is a function of the seed and of where it runs (kernels or torch, CPU or GPU), the
    same for every drafter and block size there. The implementation is chosen once per instance, so one generation
    never mixes the two.
    """

    def __init__(self, seed: int, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.seed, self.vocab_size, self.device = seed, vocab_size, torch.device(device)
        self._seed_key = _mix64(seed % 2**64)
        self.kernel = self.device.type == "cpu" and row_kernels.kernel() is not None

    def keys(self, start: int, count: int) -> list[int]:
        """The 64-bit keys of positions start .. start+count-1."""
        return [_mix64(self._seed_key ^ position) for position in range(start, start + count)]

    def _key_tensor(self, start: int, count: int) -> Tensor:  # int64 [count], the keys' bits
        return torch.tensor([k - (1 << 64) if k >> 63 else k for k in self.keys(start, count)], dtype=torch.long)

    def rows(self, start: int, count: int, columns: Tensor | None = None) -> Tensor:
        """Noise of positions start .. start+count-1 [count, vocab] fp32 (over the tokens ``columns`` [V']: [count,
        V'])."""
        width = columns.shape[0] if columns is not None else self.vocab_size
        if count == 0:
            return torch.empty(0, width, device=self.device)
        if self.kernel:
            return row_kernels.gumbel(self._key_tensor(start, count), width, columns)
        tokens = columns.to(self.device) if columns is not None else torch.arange(width, device=self.device)
        keys = self.keys(start, count)
        lo = torch.tensor([k & 0xFFFFFFFF for k in keys], dtype=torch.long, device=self.device)[:, None]  # [count, 1]
        hi = torch.tensor([k >> 32 for k in keys], dtype=torch.long, device=self.device)[:, None]
        h = _lowbias32(_lowbias32(tokens[None].long() ^ lo) ^ hi)  # [count, width], uint32 values
        u = ((h >> 8) | 1).float() * 2.0**-24  # in (0, 1), exact
        return u.log().neg_().log_().neg_()

    def _fused(self, params: SamplingParams) -> bool:  # the kernel computes scores and argmax (no top-k / top-p)
        return self.kernel and not (params.top_k or params.top_p < 1.0)

    def scores(self, logits: Tensor, params: SamplingParams, start: int, columns: Tensor | None = None) -> Tensor:
        """Noisy scores [n, V'] of rows ``logits`` [n, V'] deciding positions start.. (:func:`coupled_scores`; over
        the tokens ``columns`` where given)."""
        if self._fused(params) and logits.shape[0]:
            return self._kernel_call(logits, params, start, columns, scores=True)[0]
        return coupled_scores(logits, params, self.rows(start, logits.shape[0], columns))

    def argmax(self, logits: Tensor, params: SamplingParams, start: int, columns: Tensor | None = None) -> list[int]:
        """The column of each row's largest noisy score (the coupled sample of positions start..; the first on
        ties, as ``Tensor.argmax`` of :meth:`scores`, which it equals)."""
        if self._fused(params) and logits.shape[0]:
            return self._kernel_call(logits, params, start, columns, argmax=True)[1].tolist()
        return self.scores(logits, params, start, columns).argmax(-1).tolist()

    def _kernel_call(
        self, logits: Tensor, params: SamplingParams, start: int, columns: Tensor | None, **wanted: bool
    ) -> tuple[Tensor | None, Tensor | None]:
        rows = logits if logits.dtype in (torch.bfloat16, torch.float32) else logits.float()  # as coupled_scores
        return row_kernels.coupled(
            rows.contiguous(), params.temperature, self._key_tensor(start, rows.shape[0]), columns, **wanted
        )


def coupled_scores(logits: Tensor, params: SamplingParams, noise: Tensor) -> Tensor:
    """Noisy scores [..., V] whose argmax is a sample from warp(logits, params) (the Gumbel-max trick):
    logits x (1 / temperature) + noise, -inf where top-k / top-p drop a token (and where the logit is -inf). Without
    those filters warp is skipped: a token whose probability underflows there (< 1e-38) keeps its score and could
    win only with noise beyond ~87, which the noise (at most ~16.6) never reaches. The scale is a multiplication by
    the reciprocal in fp32, as the row kernel computes it, so that both give the same scores. ``noise`` [..., V]:
    :class:`PositionNoise` rows (over a draft vocabulary's columns where the logits are)."""
    scaled = logits.float() * (1.0 / params.temperature) if params.temperature != 1.0 else logits.float()
    if params.top_k or params.top_p < 1.0:  # the filters' dropped tokens (warp's zeros) never win
        scaled = scaled.masked_fill(warp(logits, params) <= 0, float("-inf"))
    return scaled + noise
