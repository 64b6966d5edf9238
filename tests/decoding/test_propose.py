"""A step's proposal (dflashkit.decoding.propose): copies of earlier text, their length limits, and no drafts
without a drafter or room."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dflashkit.decoding.lookup import NgramLookup
from dflashkit.decoding.propose import Proposer
from dflashkit.decoding.sampling import SamplingParams
from dflashkit.decoding.stats import DecodeStats
from dflashkit.decoding.verify import Verifier


def proposer(tokens: list[int], *, largest: int = 8, lookup: bool = True) -> Proposer:
    target = SimpleNamespace(device=torch.device("cpu"), vocab_size=100)
    return Proposer(
        target, None, None, None, lookup=NgramLookup(tokens) if lookup else None, block=1, largest=largest,
        policy=None, copy_policy=None, rule=Verifier(), params=SamplingParams(), proposal="sample", tree=None,
        tree_copies=False, constraint=None, generator=torch.Generator(), stats=DecodeStats(largest),
    )  # fmt: skip


def test_a_repeated_ngram_proposes_what_followed_it_up_to_the_room_and_the_block():
    text = [5, 6, 7, 8, 9, 10, 11, 12, 13, 5, 6, 7]  # "5 6 7" seen before, followed by 8 9 10 ...
    p = proposer(text).propose(7, len(text) - 1, 3, room=20)
    assert p.copied == [8, 9, 10, 11, 12, 13, 5] and p.drafts.tolist() == p.copied  # largest block 8: 7 drafts
    assert p.drafted == len(p.copied) and p.size == 8 and not p.from_store and p.tree is None and p.q is None
    p = proposer(text).propose(7, len(text) - 1, 3, room=2)
    assert p.copied == [8, 9]


def test_no_copy_and_no_drafter_proposes_nothing():
    for p in (
        proposer([1, 2, 3, 4]).propose(4, 3, 1, room=10),
        proposer([5, 6, 5, 6], lookup=False).propose(6, 3, 1, 9),
    ):
        assert p.drafts.numel() == 0 and p.copied == [] and p.drafted == 0 and p.masks is None


def test_after_acceptance_the_copies_see_the_emitted_tokens():
    prop = proposer([1, 2, 3, 4])
    prop.accepted([1, 2], None, 4)  # the text is now 1 2 3 4 1 2: "1 2" was followed by 3
    assert prop.propose(2, 5, 2, room=10).copied == [3, 4, 1, 2]
