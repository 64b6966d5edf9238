"""Sampling exactness: warping, the rejection step against its analytic distribution, and the whole decode
loop against the target's exact sequence distribution.

Statistical checks use fixed seeds (so they are deterministic) and two criteria:

* a chi-square goodness-of-fit test over bins with expected count >= 5 (rarer cells pooled into one bin),
  passing when its p-value is > 1e-3 (> 1e-4 in the end-to-end tests, which make 51 such checks);
* a total-variation bound. For the 8-token analytic tests it is a fixed TV < 0.02 at 20k draws (the
  expected TV of an exact sampler there is ~0.008). For the end-to-end tests, whose bins vary, it is
  ``E_bound + sqrt(ln(1/delta) / (2 N))`` with delta = 1e-3: ``E_bound = 1/2 sum_i sqrt(p_i (1 - p_i) / N)``
  bounds the expected TV of N exact samples, and the second term is McDiarmid's deviation (the empirical
  TV moves by at most 1/N per sample), so an exact sampler exceeds it with probability < 1e-3.

Every test that involves a drafter asserts that drafts were both accepted and rejected, so none of them
can pass vacuously.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats as sps

from dflashkit.decoding.loop import DecodeOptions, decode
from dflashkit.decoding.sampling import (
    PositionNoise,
    SamplingParams,
    argmax,
    check_sampler,
    coupled_scores,
    propose,
    warp,
)
from dflashkit.decoding.stats import DecodeStats
from dflashkit.decoding.tree import sample_without_replacement
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.errors import InvalidInputError
from dflashkit.target.adapter import TargetAdapter
from tests.conftest import VOCAB, tiny_drafter, tiny_target

BASE_SEED = 0  # every random draw in this file derives from it (all pass with 0, 1000, ..., 7000)
P_MIN = 1e-3  # chi-square p-value threshold of the analytic tests
P_MIN_E2E = 1e-4  # ... of the end-to-end tests: 51 checks, so a family-wise false alarm rate < 0.6%
TV_ANALYTIC = 0.02  # TV tolerance of the analytic tests (20k draws, vocab 8)
N_ANALYTIC = 20_000
N_CHAIN = 10_000
N_E2E = 1000  # decodes per speculative end-to-end setting
N_E2E_PLAIN = 800  # decodes per plain (drafter None) end-to-end setting


# ---- statistics helpers ------------------------------------------------------------------------------


def tv(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * float(np.abs(np.asarray(p, float) - np.asarray(q, float)).sum())


def tv_tolerance(probs: np.ndarray, n: int, delta: float = 1e-3) -> float:
    """TV that n exact samples from `probs` exceed with probability < delta (see the module docstring)."""
    probs = np.asarray(probs, float)
    return 0.5 * float(np.sqrt(probs * (1 - probs) / n).sum()) + math.sqrt(math.log(1 / delta) / (2 * n))


def pooled_chisquare(observed: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, int]:
    """Chi-square p-value of counts `observed` against cell probabilities `probs`; rare cells pooled.

    Also fails outright if any sample fell in a cell of probability 0 (e.g. a token outside top-k).
    """
    observed = np.asarray(observed, float).ravel()
    probs = np.asarray(probs, float).ravel()
    n = observed.sum()
    impossible = observed[probs <= 0].sum()
    assert impossible == 0, f"{impossible:.0f} samples fell in cells of probability 0"
    probs = probs / probs.sum()
    expected = probs * n
    keep = expected >= min_expected
    obs_bins, exp_bins = list(observed[keep]), list(expected[keep])
    rest_obs, rest_exp = observed[~keep].sum(), expected[~keep].sum()
    if rest_exp > 0:
        if rest_exp >= min_expected or not exp_bins:
            obs_bins.append(rest_obs)
            exp_bins.append(rest_exp)
        else:  # too small on its own: merge into the smallest kept bin
            i = int(np.argmin(exp_bins))
            obs_bins[i] += rest_obs
            exp_bins[i] += rest_exp
    if len(exp_bins) < 2:
        return 1.0, len(exp_bins)
    return float(sps.chisquare(obs_bins, exp_bins).pvalue), len(exp_bins)


def assert_matches(
    observed: np.ndarray, probs: np.ndarray, what: str, tv_tol: float | None = None, p_min: float = P_MIN
) -> None:
    """Counts `observed` are a plausible sample of `probs`: pooled chi-square and a TV bound."""
    observed = np.asarray(observed, float).ravel()
    probs = np.asarray(probs, float).ravel()
    n = int(observed.sum())
    pvalue, bins = pooled_chisquare(observed, probs)
    dist = tv(observed / n, probs / probs.sum())
    tol = tv_tol if tv_tol is not None else tv_tolerance(probs / probs.sum(), n)
    assert pvalue > p_min, f"{what}: chi-square p={pvalue:.2e} over {bins} bins (n={n}, TV={dist:.4f})"
    assert dist < tol, f"{what}: TV {dist:.4f} >= {tol:.4f} (n={n}, chi-square p={pvalue:.2e})"


# ---- a. warp and SamplingParams ------------------------------------------------------------------------


def naive_warp(logits: list[float], temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Reference in float64 and plain Python: temperature, then top-k, then top-p (smallest sorted prefix
    whose mass reaches top_p), renormalising after each filter."""
    x = np.asarray(logits, np.float64) / temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if top_k and top_k < len(probs):
        kth = probs[order[top_k - 1]]
        probs = np.where(probs >= kth, probs, 0.0)
        probs /= probs.sum()
    if top_p < 1.0:
        kept, mass = [], 0.0
        for i in order:
            kept.append(i)
            mass += probs[i]
            if mass >= top_p:
                break
        mask = np.zeros(len(probs), bool)
        mask[kept] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return probs


def near_top_p_boundary(logits: torch.Tensor, params: SamplingParams, eps: float = 1e-5) -> bool:
    """True when a cumulative sorted mass lies within eps of top_p (float32 vs float64 could disagree)."""
    ref = naive_warp(logits.tolist(), params.temperature, params.top_k, 1.0)
    cum = np.cumsum(np.sort(ref)[::-1])
    return bool(np.any(np.abs(cum - params.top_p) < eps))


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.0, 2.5])
def test_warp_temperature_is_softmax_of_scaled_logits(temperature):
    g = torch.Generator().manual_seed(BASE_SEED)
    logits = torch.randn(5, 40, generator=g) * 3
    probs = warp(logits, SamplingParams(temperature))
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, -1), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))
    if temperature < 1:  # lower temperature sharpens: the top token gains mass
        assert bool((probs.max(-1).values > torch.softmax(logits, -1).max(-1).values).all())


@pytest.mark.parametrize("k", [1, 2, 5, 39, 40, 41, 1000])
def test_warp_top_k_keeps_exactly_the_k_largest(k):
    g = torch.Generator().manual_seed(BASE_SEED + k)
    logits = torch.randn(6, 40, generator=g) * 2  # continuous: no ties
    probs = warp(logits, SamplingParams(1.0, top_k=k))
    kept = probs > 0
    assert kept.sum(-1).tolist() == [min(k, 40)] * 6
    top = torch.topk(logits, min(k, 40), -1).indices
    assert bool(kept.gather(-1, top).all())
    # the kept tokens keep their relative probabilities (renormalised softmax)
    ref = torch.softmax(logits, -1) * kept
    torch.testing.assert_close(probs, ref / ref.sum(-1, keepdim=True), rtol=1e-5, atol=1e-7)


def test_warp_top_k_keeps_ties_at_the_kth_value():
    logits = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, 0.0])
    probs = warp(logits, SamplingParams(1.0, top_k=2))
    # the three tokens tied with the 2nd largest logit all stay (as transformers' TopKLogitsWarper)
    assert (probs > 0).tolist() == [True, True, True, True, False, False]
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


def test_warp_matches_naive_reference_for_random_settings():
    g = torch.Generator().manual_seed(BASE_SEED)
    rng = np.random.default_rng(BASE_SEED)
    checked = 0
    for case in range(400):
        vocab = int(rng.integers(2, 60))
        logits = torch.randn(vocab, generator=g) * float(rng.choice([0.5, 2.0, 5.0]))
        params = SamplingParams(
            temperature=float(rng.choice([0.3, 0.7, 1.0, 1.3, 2.0])),
            top_k=int(rng.choice([0, 0, 1, 2, 5, 20, 100])),
            top_p=float(rng.choice([1.0, 1.0, 0.05, 0.3, 0.5, 0.8, 0.95, 0.999])),
        )
        if params.top_p < 1 and near_top_p_boundary(logits, params):
            continue
        got = warp(logits, params).double().numpy()
        ref = naive_warp(logits.tolist(), params.temperature, params.top_k, params.top_p)
        assert ((got > 0) == (ref > 0)).all(), f"case {case}: kept sets differ for {params}"
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6, err_msg=f"case {case}: {params}")
        assert abs(got.sum() - 1) < 1e-5
        checked += 1
    assert checked > 350


def test_warp_top_p_keeps_smallest_prefix_reaching_top_p():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))

    def kept(top_p):
        return (warp(logits, SamplingParams(1.0, top_p=top_p)) > 0).tolist()

    assert kept(0.35) == [True, False, False, False]
    assert kept(0.5) == [True, True, False, False]  # 0.4 < 0.5: the second token is needed
    assert kept(0.75) == [True, True, True, False]  # 0.7 < 0.75
    assert kept(0.95) == [True, True, True, True]
    assert kept(1e-9) == [True, False, False, False]  # always keeps the most likely token
    torch.testing.assert_close(warp(logits, SamplingParams(1.0, top_p=0.5)), torch.tensor([0.4, 0.3, 0.0, 0.0]) / 0.7)


def test_warp_shapes_and_dtypes():
    g = torch.Generator().manual_seed(BASE_SEED)
    logits = torch.randn(2, 3, 17, generator=g).to(torch.bfloat16)
    probs = warp(logits, SamplingParams(0.8, top_k=5, top_p=0.9))
    assert probs.shape == (2, 3, 17) and probs.dtype == torch.float32
    assert bool((probs >= 0).all())
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))
    assert bool(((probs > 0).sum(-1) <= 5).all())


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.1),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(temperature=1.0, top_p=0.0),
        dict(temperature=1.0, top_p=1.5),
        dict(temperature=1.0, top_p=-0.2),
        dict(temperature=1.0, top_p=float("nan")),
        dict(temperature=1.0, top_k=-1),
    ],
)
def test_sampling_params_reject_bad_values(kwargs):
    with pytest.raises(InvalidInputError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("top_k", [2.5, float("nan")])
def test_sampling_params_reject_non_integer_top_k(top_k):
    with pytest.raises(InvalidInputError):
        SamplingParams(1.0, top_k=top_k)


def test_sampling_params_accept_good_values_and_greedy_flag():
    assert SamplingParams().greedy and SamplingParams(0.0, top_k=5).greedy
    assert SamplingParams(1.0, top_k=1).greedy
    assert not SamplingParams(1.0).greedy and not SamplingParams(0.5, top_k=2, top_p=0.3).greedy
    SamplingParams(1e-3, top_k=0, top_p=1.0)  # no error
    with pytest.raises(InvalidInputError):
        propose(torch.zeros(2, 5), SamplingParams(1.0), "beam", None)


@pytest.mark.parametrize(
    "params", [SamplingParams(1.0), SamplingParams(0.7, top_k=3), SamplingParams(1.3, top_p=0.8), SamplingParams(0.0)]
)
def test_propose_over_a_draft_vocabulary_equals_proposing_over_the_scattered_row(params):
    """Columns [k, V'] of token ids [V'] give the same drafts (argmax) and the same q as the [k, vocab] row with
    -inf outside; sampled drafts are always inside the draft vocabulary and follow q."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.tensor(sorted(torch.randperm(VOCAB, generator=gen)[:20].tolist()))
    sub = torch.randn(4, len(ids), generator=gen) * 2
    full = torch.full((4, VOCAB), float("-inf")).index_copy_(1, ids, sub)
    if params.greedy:
        drafts, q = propose(sub, params, "sample", gen, ids, VOCAB)
        assert q is None and torch.equal(drafts, propose(full, params, "sample", gen)[0])
        return
    assert torch.equal(propose(sub, params, "argmax", gen, ids, VOCAB)[0], propose(full, params, "argmax", gen)[0])
    counts = torch.zeros(4, VOCAB)
    for _ in range(3000):
        drafts, q = propose(sub, params, "sample", gen, ids, VOCAB)
        counts[torch.arange(4), drafts] += 1
    torch.testing.assert_close(q, warp(full, params))
    assert counts[:, [i for i in range(VOCAB) if i not in ids.tolist()]].sum() == 0
    for row in range(4):
        support = q[row] > 0
        expected = q[row][support].double().numpy()
        expected *= 3000 / expected.sum()
        assert sps.chisquare(counts[row][support].numpy(), expected).pvalue > 1e-4
    with pytest.raises(InvalidInputError):
        propose(sub, params, "sample", gen, ids)  # the vocabulary size is needed to scatter q


# ---- b. the rejection step against its analytic distribution -------------------------------------------

V = 8


def pq_pair(case: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(p, p_next, q): warped target rows for the draft position and the bonus position, and a drafter q."""
    g = torch.Generator().manual_seed(BASE_SEED + 7)
    p_logits, q_logits, next_logits = (torch.randn(V, generator=g) * 1.5 for _ in range(3))
    if case == "full_support":
        p = warp(p_logits, SamplingParams(1.0))
        q = warp(q_logits, SamplingParams(1.0))
    else:  # p has zeros (top-k 5) where q proposes, and q has zeros where p has mass (incl. p's mode)
        p = warp(p_logits, SamplingParams(1.0, top_k=5))
        s = torch.argsort(p, descending=True)  # s[:5]: p's support, most likely first; s[5:]: p == 0
        q = torch.zeros(V)
        q[s[[1, 2, 3, 5, 6]]] = torch.tensor([0.35, 0.15, 0.10, 0.25, 0.15])  # argmax q = p's 2nd token
    return p, warp(next_logits, SamplingParams(1.3)), q


def markov_chain(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A 6-token Markov target (row = previous token) and 3 fixed drafter rows (proposals do not depend on
    earlier drafts, as in DFlash's parallel block), roughly aligned with the chain's likely path."""
    g = torch.Generator().manual_seed(seed)
    trans = warp(torch.randn(6, 6, generator=g) * 2.0, SamplingParams(1.0))
    path, rows = 0, []
    for _ in range(3):
        rows.append(0.6 * trans[path] + 0.4 * warp(torch.randn(6, generator=g), SamplingParams(1.0)))
        path = int(trans[path].argmax())
    return trans, torch.stack(rows)


def prefix_rows(kind: str, vocab: int, seed: int):
    """row(prefix, who): a fixed random float64 distribution per (prefix, "p" target | "q" drafter); rows may
    depend on the whole prefix (block verification allows any q). "sparse": some zeros in both (as top-k / a
    draft vocabulary give); "shared": q equals p at about half of the prefixes (ratios of exactly 1)."""
    g = torch.Generator().manual_seed(seed)
    rows: dict = {}

    def row(prefix: tuple, who: str) -> torch.Tensor:
        if (prefix, who) not in rows:
            logits = torch.randn(vocab, generator=g, dtype=torch.float64) * 2
            if kind == "sparse":
                zero = torch.rand(vocab, generator=g) < 0.4
                zero[int(torch.randint(vocab, (1,), generator=g))] = False
                logits = logits.masked_fill(zero, float("-inf"))
            probs = logits.softmax(-1)
            if kind == "shared" and who == "q" and float(torch.rand(1, generator=g)) < 0.5:
                probs = row(prefix, "p")
            rows[prefix, who] = probs
        return rows[prefix, who]

    return row


def test_draws_without_replacement_follow_the_sequential_distribution():
    """Gumbel-top-k: the ordered pair (first, second) has probability p_a * p_b / (1 - p_a); zero-probability
    entries are never drawn, and a row with fewer such entries than asked yields fewer real draws."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
    g = torch.Generator().manual_seed(BASE_SEED + 21)
    index, real = sample_without_replacement(probs.expand(N_ANALYTIC, 5), 2, g)
    assert real.all()
    pairs = np.zeros((5, 5))
    np.add.at(pairs, (index[:, 0].numpy(), index[:, 1].numpy()), 1)
    p = probs.double().numpy()
    exact = np.array([[p[a] * p[b] / (1 - p[a]) if a != b else 0.0 for b in range(5)] for a in range(5)])
    assert_matches(pairs, exact, "ordered pairs drawn without replacement")
    index, real = sample_without_replacement(probs[None], 6, g)
    assert real[0].tolist() == [True] * 4 + [False] and sorted(index[0, :4].tolist()) == [0, 1, 2, 3]


def rrs_acceptance(p: np.ndarray, q: np.ndarray, width: int) -> float:
    """P(one of `width` candidates drawn without replacement from q is accepted) under recursive rejection
    sampling, by enumerating every ordered draw (the algorithm written out independently of the library's)."""
    if width == 0 or q.sum() <= 0:
        return 0.0
    qn, total = q / q.sum(), 0.0
    for x in np.flatnonzero(qn > 0):
        accept = min(1.0, p[x] / qn[x])
        residual = np.clip(p - qn, 0, None)
        residual = residual / residual.sum() if residual.sum() > 0 else p
        rest = q.copy()
        rest[x] = 0
        total += qn[x] * (accept + (1 - accept) * rrs_acceptance(residual, rest, width - 1))
    return total


# ---- c/d. the decode loop against the target's exact sequence distribution ------------------------------

PROMPT = [5, 17, 33, 8, 60]
# max_new_tokens: t1 comes from the prefill; with block size 4, the first step drafts one token (k is capped
# by the tokens left), so t2 is an accepted draft or a residual sample, and t3 the bonus token of that step
# or, after a rejection, the token of a second step on the cropped cache.
N_TOKENS = 3
SETTINGS = {
    "t1.0": SamplingParams(1.0),
    "t0.7_k10": SamplingParams(0.7, top_k=10),
    "t1.3_p0.8": SamplingParams(1.3, top_p=0.8),
}


class World:
    """A tiny fp32 target (2 layers, to keep thousands of decodes fast) and cached exact computations."""

    def __init__(self) -> None:
        self.model = tiny_target("llama", num_hidden_layers=2)
        self.drafter = tiny_drafter(self.model, block_size=4, num_layers=1)
        self.target = TargetAdapter(self.model, self.drafter.config.target_layer_ids)
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}
        self._exact: dict[tuple, Exact] = {}

    @torch.inference_mode()
    def logits(self, ids: tuple[int, ...]) -> torch.Tensor:
        """Target logits of the token after `ids` (no cache: a fresh forward over the whole sequence)."""
        if ids not in self._logits:
            self._logits[ids] = self.model(torch.tensor([ids])).logits[0, -1].float()
        return self._logits[ids]

    @torch.inference_mode()
    def exact(self, setting: str, prompt: tuple[int, ...] = tuple(PROMPT)) -> Exact:
        if (setting, prompt) not in self._exact:
            self._exact[setting, prompt] = Exact(self.model, SETTINGS[setting], list(prompt))
        return self._exact[setting, prompt]


RANK_EDGES = [1, 2, 3, 5, 10]  # rank bins under the exact conditional: 0, 1, 2, 3-4, 5-9, >= 10


class Exact:
    """The warped target's exact distribution of (t1, t2, t3) after PROMPT, from batched fresh forwards.

    Besides the joint [V, V, V] it gives every cell a coarse bin: the ranks of t1, t2 and t3 under their
    exact conditionals, binned by RANK_EDGES (6 x 6 x 6 bins). A coarsening of an exact distribution is
    exact too, and this one stays well populated at temperature 1 over the full vocabulary (where the raw
    joint spreads over ~10^5 cells) while being sensitive to what a wrong acceptance rule or residual does:
    move mass between the drafted (likely) tokens and the others.
    """

    def __init__(self, model, params: SamplingParams, prompt: list[int] = PROMPT) -> None:
        def next_probs(prefixes: list[tuple[int, ...]]) -> torch.Tensor:
            out = []
            for i in range(0, len(prefixes), 2048):
                batch = torch.tensor([prompt + list(pre) for pre in prefixes[i : i + 2048]])
                out.append(warp(model(batch).logits[:, -1].float(), params).double())
            return torch.cat(out)

        p1 = next_probs([()])[0]
        firsts = p1.nonzero()[:, 0].tolist()
        p2 = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
        p2[firsts] = next_probs([(a,) for a in firsts])
        pairs = (p1[:, None] * p2).nonzero().tolist()
        p3 = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
        p3[tuple(torch.tensor(pairs).T)] = next_probs([tuple(pair) for pair in pairs])
        self.joint = (p1[:, None, None] * p2[:, :, None] * p3).numpy()

        def rank_bin(probs: torch.Tensor) -> np.ndarray:  # bin of each token's rank along the last axis
            order = np.argsort(-probs.numpy(), axis=-1, kind="stable")
            ranks = np.empty_like(order)
            np.put_along_axis(ranks, order, np.arange(VOCAB), axis=-1)
            return np.searchsorted(RANK_EDGES, ranks, side="right")

        nb = len(RANK_EDGES) + 1
        self.cell_bin = (rank_bin(p1)[:, None, None] * nb + rank_bin(p2)[:, :, None]) * nb + rank_bin(p3)
        self.n_bins = nb**3

    def coarse(self, cells: np.ndarray) -> np.ndarray:
        """Sum of `cells` [V, V, V] (probabilities or counts) per rank bin -> [6, 6, 6]."""
        nb = len(RANK_EDGES) + 1
        flat = np.bincount(self.cell_bin.ravel(), weights=np.asarray(cells, float).ravel(), minlength=self.n_bins)
        return flat.reshape(nb, nb, nb)


@pytest.fixture(scope="module")
def world() -> World:
    return World()


class NoisyOracleDrafter(DFlashDrafter):
    """Drafts from the target itself, distorted: logits 0.8 * target + a fixed random bias.

    Row j of a block continues the prefix with the target's greedy tokens, so proposals are often right
    (many acceptances) but, being distorted, are also often rejected, exercising the residual. The
    emitted tokens are followed through the decode loop's observer.
    """

    def __init__(self, world: World) -> None:
        super().__init__(world.drafter.config)
        self.world = world
        self.bias = torch.randn(VOCAB, generator=torch.Generator().manual_seed(BASE_SEED + 5)) * 0.7
        self.tokens: list[int] = []
        self.columns: torch.Tensor | None = None  # draft vocabulary (None: the whole vocabulary)

    def start(self, prompt: list[int]) -> None:
        self.tokens = list(prompt)

    def observe(self, _logits: torch.Tensor, emitted: list[int]) -> None:
        self.tokens += emitted

    def draft_scores(self, context, new_features, new_start, anchor, pos, k, embed_tokens, lm_head):
        assert len(self.tokens) == pos + 1 and self.tokens[pos] == anchor
        prefix, rows = tuple(self.tokens), []
        for _ in range(k):
            logits = self.world.logits(prefix)
            rows.append(0.8 * logits + self.bias)
            prefix += (int(logits.argmax()),)
        scores = torch.stack(rows)  # [k, VOCAB]
        if self.columns is None:
            return scores, None
        return scores[:, self.columns], self.columns  # [k, V'] over a draft vocabulary


class NoisyOracleVocabDrafter(NoisyOracleDrafter):
    """The noisy oracle restricted to a draft vocabulary (every third token, plus the greedy first token):
    proposals are sampled over those columns and q is 0 elsewhere."""

    def start(self, prompt: list[int]) -> None:
        super().start(prompt)
        first = int(self.world.logits(tuple(prompt)).argmax())
        self.columns = torch.tensor(sorted(set(range(0, VOCAB, 3)) | {first}))


def sample_sequences(
    world: World,
    drafter,
    params: SamplingParams,
    proposal: str,
    n: int,
    seed0: int,
    max_new: int = N_TOKENS,
    prompt: list[int] = PROMPT,
    lookup: bool = False,
    copied: list[bool] | None = None,
    tree: int | None = None,
    sampler: str = "rejection",
    block_size: int | None = None,
):
    """Decode max_new tokens for seeds seed0..seed0+n-1; counts [V, V, V] of the first N_TOKENS, and the
    decode statistics (per step; `copied`, when given, gets each step's copied flag)."""
    counts = np.zeros((VOCAB,) * N_TOKENS)
    accepted, drafted, sequences = [], [], []
    for s in range(seed0, seed0 + n):
        stats = DecodeStats(block_size=1)
        observer = None
        if isinstance(drafter, NoisyOracleDrafter):
            drafter.start(prompt)
            observer = drafter.observe
        options = DecodeOptions(
            max_new_tokens=max_new,
            sampling=params,
            seed=s,
            proposal=proposal,
            lookup=lookup,
            tree=tree,
            sampler=sampler,
            block_size=block_size,
        )
        tokens = [t for step in decode(world.target, drafter, prompt, options, stats, observer) for t in step.tokens]
        assert len(tokens) == max_new
        counts[tuple(tokens[:N_TOKENS])] += 1
        sequences.append(tokens)
        accepted += stats.accepted_lengths
        drafted += stats.drafted_lengths
        if copied is not None:
            copied += stats.copied_steps
    return counts, accepted, drafted, sequences


def check_sequences(counts: np.ndarray, exact: Exact, what: str) -> None:
    assert_matches(counts, exact.joint, f"{what}: joint (t1, t2, t3)", p_min=P_MIN_E2E)
    ranks, ranks_exact = exact.coarse(counts), exact.coarse(exact.joint)
    assert_matches(ranks, ranks_exact, f"{what}: joint of rank bins", p_min=P_MIN_E2E)
    assert_matches(ranks.sum((0, 2)), ranks_exact.sum((0, 2)), f"{what}: rank bin of t2", p_min=P_MIN_E2E)
    assert_matches(ranks.sum((0, 1)), ranks_exact.sum((0, 1)), f"{what}: rank bin of t3", p_min=P_MIN_E2E)
    # the 3rd token given the most frequent (t1, t2) prefix
    t1, t2 = np.unravel_index(int(counts.sum(2).argmax()), counts.shape[:2])
    cond = exact.joint[t1, t2] / exact.joint[t1, t2].sum()
    assert_matches(counts[t1, t2], cond, f"{what}: 3rd token given (t1, t2) = ({t1}, {t2})", p_min=P_MIN_E2E)


@torch.inference_mode()
def check_last_token_rank(world: World, params: SamplingParams, sequences: list[list[int]], what: str) -> None:
    """The last token's rank bin under its exact conditional given the sampled prefix before it.

    Given its prefix, each sample's bin is distributed as that conditional says, so the expected bin
    counts are the sums of the per-sample bin probabilities (only the observed prefixes are computed).
    This reaches the token decoded after the caches were cropped mid-block, which t1..t3 do not (though the
    tiny random target depends little on tokens before the last, so this is no test of cache bookkeeping:
    test_decode checks the caches exactly)."""
    prefixes = sorted({tuple(seq[:-1]) for seq in sequences})
    probs = warp(world.model(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1].float(), params)
    probs = probs.double().numpy()
    order = np.argsort(-probs, axis=-1, kind="stable")
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(VOCAB), axis=-1)
    bins = np.searchsorted(RANK_EDGES, ranks, side="right")  # [prefixes, V]
    nb = len(RANK_EDGES) + 1
    per_prefix = np.stack([np.bincount(b, weights=p, minlength=nb) for b, p in zip(bins, probs)])
    row = {p: i for i, p in enumerate(prefixes)}
    observed, expected = np.zeros(nb), np.zeros(nb)
    for seq in sequences:
        i = row[tuple(seq[:-1])]
        observed[bins[i, seq[-1]]] += 1
        expected += per_prefix[i]
    assert_matches(observed, expected, f"{what}: rank bin of the last token given its prefix", p_min=P_MIN_E2E)


SPECULATIVE_CASES = [
    ("t1.0", "argmax", "oracle"),
    ("t1.0", "sample", "tiny"),  # the real random drafter: ~25% of its sampled drafts are accepted here
    ("t0.7_k10", "argmax", "oracle"),
    ("t0.7_k10", "sample", "oracle"),
    ("t1.3_p0.8", "argmax", "oracle"),
    ("t1.3_p0.8", "sample", "oracle"),
    # 4 new tokens: the first step drafts 2, so t2 and t3 can both be accepted drafts of one block, and a
    # rejection of the 2nd draft crops the caches in the middle of the block
    ("t1.0", "sample", "oracle-4"),
    ("t1.0", "sample", "oracle-vocab"),  # proposals sampled over a draft vocabulary, scattered back for q
    ("t0.7_k10", "sample", "oracle-vocab"),
    # the drafter proposes at half the request's temperature (its config's proposal_temperature): q is sharper
    ("t1.0", "sample", "oracle-sharp"),
    ("t1.3_p0.8", "sample", "oracle-sharp"),
]


@pytest.mark.parametrize("setting,proposal,kind", SPECULATIVE_CASES)
def test_speculative_decode_matches_target_distribution(world, setting, proposal, kind):
    oracle = NoisyOracleVocabDrafter if kind == "oracle-vocab" else NoisyOracleDrafter
    drafter = oracle(world) if kind.startswith("oracle") else world.drafter
    if kind == "oracle-sharp":
        drafter.config = drafter.config.replace(proposal_temperature=0.5)
    max_new = 4 if kind == "oracle-4" else N_TOKENS
    counts, accepted, drafted, sequences = sample_sequences(
        world, drafter, SETTINGS[setting], proposal, N_E2E, seed0=BASE_SEED * 10_000 + 1, max_new=max_new
    )
    steps_with_drafts = [(a, d) for a, d in zip(accepted, drafted) if d > 0]
    n_accepted = sum(a for a, _ in steps_with_drafts)
    n_rejected = sum(a < d for a, d in steps_with_drafts)
    assert n_accepted >= 0.05 * len(steps_with_drafts), (n_accepted, len(steps_with_drafts))
    assert n_rejected >= 0.05 * len(steps_with_drafts), (n_rejected, len(steps_with_drafts))
    if max_new == 4:  # every partial outcome of a 2-draft block occurred
        outcomes = Counter((a, d) for a, d in steps_with_drafts)
        assert all(outcomes[(a, 2)] >= 20 for a in range(3)), outcomes
        check_last_token_rank(world, SETTINGS[setting], sequences, f"{setting}/{proposal}/{kind}")
    check_sequences(counts, world.exact(setting), f"{setting}/{proposal}/{kind}")


@pytest.mark.parametrize("setting", ["t1.0", "t0.7_k10"])
def test_token_tree_decode_matches_target_distribution(world, setting):
    """Token trees (dflashkit.decoding.tree): the target samples at each node it reaches and the walk follows its token.

    4 new tokens: the first step drafts a tree over 2 block positions (up to 4 choices each, 6 nodes), so t2 and
    t3 can be nodes of one tree, reached through the drafter's first or later choices, or samples where the
    target's token is not a child."""
    drafter = NoisyOracleDrafter(world)
    counts, accepted, drafted, sequences = sample_sequences(
        world, drafter, SETTINGS[setting], "sample", N_E2E, seed0=BASE_SEED * 10_000 + 90_001, max_new=4, tree=6
    )
    steps = [(a, d) for a, d in zip(accepted, drafted) if d > 0]
    outcomes = Counter(a for a, _ in steps)
    assert all(outcomes[a] >= 0.03 * len(steps) for a in range(3)), outcomes  # 0, 1 and 2 nodes accepted
    check_last_token_rank(world, SETTINGS[setting], sequences, f"{setting}/tree")
    check_sequences(counts, world.exact(setting), f"{setting}/tree")


@pytest.mark.parametrize("with_drafter", [True, False])
def test_prompt_lookup_decode_matches_target_distribution(world, with_drafter):
    """Copied drafts (prompt lookup) are one-hot proposals: sampled output keeps the target's distribution.

    The prompt repeats the 2-gram (5, 17), followed the first time by the target's likely next tokens, so the
    first step often copies (when t1 continues the 2-gram as before) and the copy is sometimes accepted,
    sometimes rejected (its residual exercised); elsewhere the drafter drafts (or, without one, a plain step)."""
    a, b = 5, 17
    c1 = int(world.logits((a, b)).argmax())
    c2 = int(world.logits((a, b, c1)).argmax())
    prompt = [a, b, c1, c2, 60, 8, a, b]
    setting = "t1.0"
    copied: list[bool] = []
    counts, accepted, drafted, _ = sample_sequences(
        world,
        world.drafter if with_drafter else None,
        SETTINGS[setting],
        "sample",
        N_E2E,
        seed0=BASE_SEED * 10_000 + 70_001,
        prompt=prompt,
        lookup=True,
        copied=copied,
    )
    steps = [(acc, d) for acc, d, c in zip(accepted, drafted, copied) if c and d > 0]
    assert len(steps) >= 0.1 * N_E2E, len(steps)
    assert sum(acc for acc, _ in steps) >= 0.05 * len(steps) and sum(acc < d for acc, d in steps) >= 0.05 * len(steps)
    check_sequences(counts, world.exact(setting, tuple(prompt)), f"{setting}/lookup/drafter={with_drafter}")


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_plain_decode_matches_target_distribution(world, setting):
    counts, accepted, drafted, _ = sample_sequences(
        world, None, SETTINGS[setting], "argmax", N_E2E_PLAIN, seed0=BASE_SEED * 10_000 + 50_001
    )
    assert sum(accepted) == 0 and sum(drafted) == 0
    check_sequences(counts, world.exact(setting), f"{setting}/plain")


def test_exact_distribution_is_consistent(world):
    """Sanity of the reference itself: a distribution over sequences, and top-k confines every token."""
    for setting in SETTINGS:
        exact = world.exact(setting)
        assert abs(exact.joint.sum() - 1) < 1e-6  # float32 warps
        assert abs(exact.coarse(exact.joint).sum() - 1) < 1e-6
    k10 = world.exact("t0.7_k10").joint
    assert (k10.sum((1, 2)) > 0).sum() == 10 and (k10.sum((0, 2)) > 0).sum() <= 100


# ---- e. seeded reproducibility ------------------------------------------------------------------------


# (the random tiny drafter's argmax drafts are essentially never accepted, so it is paired with "sample")
@pytest.mark.parametrize("kind,proposal", [("oracle", "argmax"), ("oracle", "sample"), ("tiny", "sample")])
def test_same_seed_same_tokens(world, kind, proposal):
    params = SamplingParams(1.0, top_p=0.95)

    def run(seed):
        drafter = NoisyOracleDrafter(world) if kind == "oracle" else world.drafter
        observer = None
        if kind == "oracle":
            drafter.start(PROMPT)
            observer = drafter.observe
        stats = DecodeStats(block_size=1)
        options = DecodeOptions(max_new_tokens=16, sampling=params, seed=seed, proposal=proposal)
        tokens = [t for step in decode(world.target, drafter, PROMPT, options, stats, observer) for t in step.tokens]
        return tokens, stats.accepted_lengths

    runs = {seed: run(seed) for seed in range(BASE_SEED + 100, BASE_SEED + 106)}
    for seed, (tokens, accepted) in runs.items():
        assert len(tokens) == 16
        assert run(seed) == (tokens, accepted)
    assert len({tuple(t) for t, _ in runs.values()}) > 1  # the seed matters
    assert sum(sum(a) for _, a in runs.values()) > 0  # drafts were accepted: the speculative path ran


def test_argmax_over_allowed_tokens_equals_the_argmax_of_masked_logits():
    """argmax(logits, allowed) skips the masking where the plain argmax is allowed: same index, ties included."""
    from dflashkit.decoding.grammar import masked

    g = torch.Generator().manual_seed(BASE_SEED + 11)
    logits = torch.randint(0, 4, (64, 40), generator=g).float()  # many ties
    allowed = torch.rand(64, 40, generator=g) < 0.5
    allowed[:, 0] = True  # every row allows something
    expected = masked(logits, allowed).argmax(-1)
    assert torch.equal(argmax(logits, allowed), expected)
    assert torch.equal(argmax(logits.bfloat16(), allowed), expected)
    assert torch.equal(argmax(logits[3], allowed[3]), expected[3])
    plain_ok = allowed.gather(1, logits.argmax(-1)[:, None])[:, 0]
    assert 0 < int(plain_ok.sum()) < 64  # both paths ran


# ---- f. coupled sampling: the seed's plain output, whatever the drafts -----------------------------------


NOISE_PATHS = [pytest.param(True, id="kernel"), pytest.param(False, id="torch")]


def position_noise(seed: int, vocab: int, use_kernel: bool) -> PositionNoise:
    """PositionNoise on the row kernel or on torch's ops (the kernel case skipped where the kernels do not run)."""
    noise = PositionNoise(seed, vocab)
    if use_kernel and not noise.kernel:
        pytest.skip("dflashkit's row kernels do not run here")
    noise.kernel = use_kernel
    return noise


@pytest.mark.parametrize("use_kernel", NOISE_PATHS)
def test_position_noise_is_a_function_of_seed_position_and_token(use_kernel):
    noise = position_noise(7, VOCAB, use_kernel)
    late_first = noise.rows(3, 2)  # positions 3, 4 computed before 2
    rows = noise.rows(2, 4)  # [4, V]: positions 2..5
    assert torch.equal(rows, position_noise(7, VOCAB, use_kernel).rows(2, 4)) and torch.equal(rows[1:3], late_first)
    assert rows.shape == (4, VOCAB) and rows.dtype == torch.float32 and not torch.equal(rows[0], rows[1])
    assert not torch.equal(position_noise(8, VOCAB, use_kernel).rows(2, 1)[0], rows[0])  # the seed matters
    columns = torch.tensor([VOCAB - 1, 0, 5, 5, 17])  # a draft vocabulary's tokens: the same noise, column by column
    assert torch.equal(noise.rows(2, 4, columns), rows[:, columns])
    assert noise.rows(9, 0).shape == (0, VOCAB) and noise.rows(9, 0, columns).shape == (0, 5)
    big = position_noise(2**62 + 3, 49_152, use_kernel)  # any seed and position (keys past 2^63 included)
    assert torch.isfinite(big.rows(2**40, 2)).all()


def test_position_noise_kernel_and_torch_compute_the_same_hash():
    """The kernel and torch hash alike and differ at most in their logs' last bits (a seed's output is a function
    of where it runs: docs/losslessness.md); a planted change of the hash would move most entries by O(1)."""
    kernel, plain = position_noise(11, 49_152, True), position_noise(11, 49_152, False)
    columns = torch.randperm(49_152, generator=torch.Generator().manual_seed(BASE_SEED + 31))[:5000]
    for start, count, cols in ((0, 3, None), (12_345, 2, columns)):
        a, b = kernel.rows(start, count, cols), plain.rows(start, count, cols)
        assert torch.allclose(a, b, rtol=2e-6, atol=1e-6), float((a - b).abs().max())
        assert float((a == b).double().mean()) > 0.5


@pytest.mark.parametrize("use_kernel", NOISE_PATHS)
def test_position_noise_is_standard_gumbel_and_independent(use_kernel):
    """Kolmogorov-Smirnov against Gumbel(0, 1) over many positions and tokens; no correlation between
    neighbouring tokens or positions (a weak hash or key schedule would show in both)."""
    noise = position_noise(BASE_SEED + 41, 4096, use_kernel).rows(1000, 64)  # [64, 4096]
    values = noise.double().numpy()
    assert sps.kstest(values.ravel(), sps.gumbel_r.cdf).pvalue > P_MIN
    for a, b in ((values[:, :-1], values[:, 1:]), (values[:-1], values[1:])):
        assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 0.02


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_coupled_kernel_scores_and_argmax_are_torchs_of_the_same_noise(dtype, temperature):
    """The kernel's fused scores equal coupled_scores over its own noise rows bit for bit, and its argmax is
    torch's argmax of them (the first largest; a NaN counts as the largest; -inf rows give 0): the decode loop
    decides with the argmax and observes the scores, so the two must agree exactly."""
    noise = position_noise(5, 3000, True)
    g = torch.Generator().manual_seed(BASE_SEED + 51)
    logits = (torch.randn(6, 3000, generator=g) * 4).to(dtype)
    logits[1, 7] = logits[1, 2900] = float("nan")
    logits[2] = float("-inf")
    logits[3, 100:] = float("-inf")
    logits[4, 5] = logits[4, 9] = float("inf")
    params = SamplingParams(temperature)
    scores = noise.scores(logits, params, 40)
    expected = coupled_scores(logits, params, noise.rows(40, 6))
    assert torch.equal(scores.nan_to_num(), expected.nan_to_num()) and scores.isnan().sum() == 2
    assert noise.argmax(logits, params, 40) == expected.argmax(-1).tolist()
    assert noise.argmax(logits, params, 40)[1:3] == [7, 0] and noise.argmax(logits, params, 40)[4] == 5
    columns = torch.tensor([2999, 4, 4, 1000, 0, 17, 256, 1])  # over a draft vocabulary's columns
    sub = logits[:, columns].contiguous()
    assert torch.equal(
        noise.scores(sub, params, 40, columns).nan_to_num(),
        coupled_scores(sub, params, noise.rows(40, 6, columns)).nan_to_num(),
    )
    sub_expected = coupled_scores(sub, params, noise.rows(40, 6, columns))
    assert noise.argmax(sub, params, 40, columns) == sub_expected.argmax(-1).tolist()
    filtered = SamplingParams(temperature, top_k=5)  # filters: torch's scores over the kernel's noise
    assert torch.equal(noise.scores(logits[5:], filtered, 3), coupled_scores(logits[5:], filtered, noise.rows(3, 1)))


@pytest.mark.parametrize("use_kernel", NOISE_PATHS)
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=3), SamplingParams(1.3, top_p=0.8)])
def test_coupled_scores_argmax_is_a_sample_of_the_warped_distribution(params, use_kernel):
    """Gumbel-max over many positions: the decision is distributed as warp(logits), filtered tokens never win."""
    logits = torch.randn(8, generator=torch.Generator().manual_seed(BASE_SEED + 21)) * 1.5
    probs = warp(logits[None], params)[0].double().numpy()
    noise = position_noise(BASE_SEED + 22, 8, use_kernel)
    winners = noise.argmax(logits.expand(20_000, 8).contiguous(), params, 0)  # positions 0 .. 19,999
    assert winners == coupled_scores(logits.expand(20_000, 8), params, noise.rows(0, 20_000)).argmax(-1).tolist()
    counts = np.bincount(winners, minlength=8)
    assert counts[probs == 0].sum() == 0
    assert_matches(counts, probs, f"coupled argmax {params}", tv_tol=0.02)


def test_coupled_draft_equal_to_the_target_is_always_accepted_and_close_drafts_often():
    """The coupling: the same noise makes equal distributions choose alike, and close ones mostly (P(match) is at
    least (1 - TV) / (1 + TV) for the Gumbel coupling; rejection sampling reaches 1 - TV)."""
    g = torch.Generator().manual_seed(BASE_SEED + 23)
    p_logits, q_logits = torch.randn(2000, VOCAB, generator=g), torch.randn(2000, VOCAB, generator=g)
    q_logits = p_logits + 0.5 * q_logits  # a distorted copy
    noise = PositionNoise(BASE_SEED + 24, VOCAB).rows(0, 2000)
    params = SamplingParams(1.0)
    p_choice = coupled_scores(p_logits, params, noise).argmax(-1)
    assert torch.equal(coupled_scores(p_logits, params, noise).argmax(-1), p_choice)
    match = float((coupled_scores(q_logits, params, noise).argmax(-1) == p_choice).double().mean())
    tv = float(0.5 * (warp(p_logits, params) - warp(q_logits, params)).abs().sum(-1).mean())
    assert (1 - tv) / (1 + tv) - 0.03 <= match <= 1 - tv + 0.03, (match, tv)


def test_check_sampler():
    assert check_sampler("coupled") == "coupled" and check_sampler("rejection") == "rejection"
    with pytest.raises(InvalidInputError, match="sampler"):
        check_sampler("gumbel")
    with pytest.raises(InvalidInputError, match="sampler"):
        DecodeOptions(sampler="nope")


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_coupled_plain_decode_matches_target_distribution(world, setting):
    counts, *_ = sample_sequences(
        world, None, SETTINGS[setting], "sample", N_E2E_PLAIN, seed0=BASE_SEED * 10_000 + 110_001, sampler="coupled"
    )
    check_sequences(counts, world.exact(setting), f"{setting}/coupled/plain")


COUPLED_CASES = [  # setting, drafter, block size, tree, prompt lookup
    ("t1.0", "oracle", None, None, False),
    ("t1.0", "oracle", 2, None, False),
    ("t0.7_k10", "oracle-vocab", None, None, False),
    ("t1.3_p0.8", "oracle", None, None, False),
    ("t1.0", "oracle", None, 6, False),
    ("t0.7_k10", "tiny", None, None, True),
]


@pytest.mark.parametrize("setting,kind,block,tree,lookup", COUPLED_CASES)
def test_coupled_speculative_decode_is_the_seeds_plain_output(world, setting, kind, block, tree, lookup):
    """fp32: every seed's tokens equal plain coupled sampling's, token for token, whatever was drafted (chains of
    any block size, a draft vocabulary, token trees, copies); with the distribution test of the plain coupled
    decode above, the speculative output's distribution is the target's."""
    params, n, max_new = SETTINGS[setting], 100, 8
    drafter = {"oracle": NoisyOracleDrafter, "oracle-vocab": NoisyOracleVocabDrafter}.get(kind)
    drafter = drafter(world) if drafter else world.drafter
    prompt = [5, 17, 33, 8, 60, 5, 17] if lookup else PROMPT  # a repeat, so some steps copy
    common = {"max_new": max_new, "prompt": prompt, "sampler": "coupled"}
    *_, plain = sample_sequences(world, None, params, "sample", n, BASE_SEED + 120_001, **common)
    copied: list[bool] = []
    _, accepted, drafted, spec = sample_sequences(
        world,
        drafter,
        params,
        "sample",
        n,
        BASE_SEED + 120_001,
        tree=tree,
        lookup=lookup,
        copied=copied,
        block_size=block,
        **common,
    )
    assert spec == plain
    steps = [(a, d) for a, d in zip(accepted, drafted) if d > 0]
    assert sum(a for a, _ in steps) >= 0.05 * len(steps) and sum(a < d for a, d in steps) >= 0.05 * len(steps)
    if lookup:
        assert sum(copied) >= 0.05 * len(copied)
    assert len({tuple(t) for t in plain}) > 10  # sampled, not one sequence
