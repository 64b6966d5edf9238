"""The library's default decoding policy: block size, sampler, token trees, prompt lookup."""

from __future__ import annotations

from dflashkit.decoding.sampling import check_sampler


def default_block_size(
    block_size: int | str | None, has_drafter: bool, tree: int | None = None, lookup: bool = False
) -> int | str | None:
    """The block size a generation runs with: an integer or "auto" as given; None (the library's, the CLI's and the
    server's default) becomes "auto" when a drafter drafts chains or prompt lookup runs alone (``lookup`` without a
    drafter: copies sized per step, plain steps where they do not pay), and stays None (the drafter's own size) with
    a token tree (which picks its own depth and width) or for plain decoding. "auto" is the default because with
    today's drafters (the shipped one: τ ≈ 1.7) a full 16-token verify costs more on a CPU than it yields, and the
    adaptive policy falls back to the sizes, or plain steps, that pay (see :mod:`dflashkit.decoding.adaptive`)."""
    if block_size is None and (has_drafter and not tree or lookup and not has_drafter):  # tree None or 0: chains
        return "auto"
    return block_size


def default_sampler(sampler: str | None, seed: int | None) -> str:
    """The sampler a sampled generation uses: as asked; None (the default): "coupled" when a seed is given (a seed
    asks for a reproducible output, and coupled sampling gives the seed's plain output whatever the block sizes,
    which the adaptive policy picks by timing), "rejection" without one: its chains are as fast as coupled sampling's
    trees at T=1 (the trees accept more, but their steps verify more rows and draw noise for them; measured in
    docs/experiments.md, "Rejection sampling or coupled (Gumbel-max) sampling")."""
    return check_sampler(sampler) if sampler is not None else ("coupled" if seed is not None else "rejection")


# Drafter steps of a seeded sampled generation (coupled sampling) verify token trees of this many nodes by default.
# Under coupling a tree's candidates are the drafter's top choices under the target's own noise, and more of them are
# accepted: trees of 4-9 nodes decode ~4-10% faster than chains at T=1, with no size standing out; copied steps stay
# chains in these default trees (tree_copies), since a tree holding the copy runs the drafter on every step. With the
# rejection sampler (no seed) trees gain little and chains stay. Measured in docs/experiments.md, "At T > 0, how
# should a tree's candidates be chosen, and do trees pay?".
COUPLED_TREE = 6


def default_tree(
    tree: int | None,
    *,
    has_drafter: bool,
    sampled: bool,
    sampler: str,
    block_size: int | str | None,
    batched: bool,
    supports_trees: bool,
    constrained: bool = False,
) -> int | None:
    """The token tree a generation's drafter steps verify: as given (0: chains, None); None (the default):
    :data:`COUPLED_TREE` nodes for a sampled generation under coupled sampling with the adaptive block size, decoding
    alone on a forward that runs trees and without a grammar or penalties (the decode loop keeps chains under
    those), else chains (None)."""
    if tree is not None or not (has_drafter and sampled and sampler == "coupled" and block_size == "auto"):
        return tree or None
    return COUPLED_TREE if supports_trees and not batched and not constrained else None


def default_tree_copies(tree_copies: bool | None, asked_tree: int | None) -> bool:
    """Whether a greedy or seeded step that copies verifies one tree of the copy and the drafter's candidates: as
    given; None (the default): for a tree asked for (``asked_tree`` > 0), not in the default seeded trees (see
    :data:`COUPLED_TREE`)."""
    return bool(asked_tree) if tree_copies is None else bool(tree_copies)


def default_lookup(lookup: bool | None, has_drafter: bool, without_drafter: bool = False) -> bool:
    """Prompt lookup as asked; None (the default): on when a drafter drafts (copies cost nothing to propose and
    are accepted more often than drafts on repetitive text); without one, ``without_drafter``: on for a generator
    loaded with ``drafter="auto"`` for a target that no drafter ships for (prompt lookup alone, its copies sized by
    the adaptive policy, which takes plain steps where they do not pay: see
    :attr:`~dflashkit.generator.SpeculativeGenerator.lookup_without_drafter`), off otherwise (an explicit
    ``drafter=None``, or a plain run such as ``use_drafter=False``: plain decoding stays plain)."""
    if lookup is not None:
        return lookup
    return has_drafter or without_drafter
