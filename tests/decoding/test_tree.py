"""Token trees: best-first construction, the ancestor mask, the tree verify pass against fresh forwards, the
cache after keeping a path, and tree decoding == plain greedy decoding (fp32, token for token)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dflashkit.decoding.loop import DecodeOptions, decode
from dflashkit.decoding.stats import DecodeStats
from dflashkit.decoding.tree import DraftTree, build_tree, hybrid_tree, sample_tree
from dflashkit.drafter.network import DFlashDrafter
from dflashkit.errors import InvalidInputError
from dflashkit.target.adapter import TargetAdapter
from tests.conftest import VOCAB, tiny_drafter, tiny_target

# ---- construction -------------------------------------------------------------------------------------


def all_node_values(probs: torch.Tensor, top: int) -> dict[tuple[int, ...], float]:
    """Every node (ranks r1..rd of the drafter's sorted rows) and the product of its probabilities."""
    sorted_probs = probs.sort(-1, descending=True).values
    out = {}
    for depth in range(1, probs.shape[0] + 1):
        for ranks in itertools.product(range(top), repeat=depth):
            out[ranks] = math.prod(float(sorted_probs[d, r]) for d, r in enumerate(ranks))
    return out


@pytest.mark.parametrize("budget", [1, 3, 6, 10, 20])
def test_build_tree_keeps_the_nodes_of_largest_path_probability(budget):
    g = torch.Generator().manual_seed(budget)
    scores = torch.randn(3, 12, generator=g) * 2  # 3 block positions, 12 columns
    tree = build_tree(scores, None, budget, top=3)
    probs = scores.softmax(-1)
    order = probs.argsort(-1, descending=True)
    # each node's rank path, read back from its tokens and parents
    rank_of = [{int(t): r for r, t in enumerate(order[d])} for d in range(3)]
    paths: list[tuple[int, ...]] = []
    for token, parent, depth in zip(tree.tokens, tree.parents, tree.depths):
        prefix = paths[parent - 1] if parent else ()
        assert len(prefix) == depth - 1
        paths.append(prefix + (rank_of[depth - 1][token],))
    values = all_node_values(probs, 3)
    best = sorted(values.values(), reverse=True)[:budget]
    assert len(tree) == budget and len(set(paths)) == budget
    assert sorted((values[p] for p in paths), reverse=True) == pytest.approx(best)


def test_build_tree_maps_columns_to_token_ids_and_is_a_chain_for_a_confident_drafter():
    scores = torch.full((4, 5), -20.0)
    scores[torch.arange(4), torch.tensor([1, 3, 0, 2])] = 20.0  # certain of one column per position
    columns = torch.tensor([40, 41, 42, 43, 44])
    tree = build_tree(scores, columns, budget=4)
    assert tree.tokens == [41, 43, 40, 42] and tree.parents == [0, 1, 2, 3] and tree.depths == [1, 2, 3, 4]
    unsure = build_tree(torch.zeros(4, 5), columns, budget=4)  # uniform: the anchor's 4 children first
    assert unsure.depths == [1, 1, 1, 1] and unsure.parents == [0, 0, 0, 0]


def hybrid_worths(probs: torch.Tensor, top: int, copy: list[int], worth: float) -> dict[tuple[int, ...], float]:
    """Every node a hybrid tree may hold (token paths) and its worth: the copy's prefix of depth d is worth
    worth^d, a drafter candidate (one of a position's `top` tokens) its parent's worth times its probability;
    the larger where a path is both."""
    top_tokens = probs.topk(top, -1).indices.tolist()
    out: dict[tuple[int, ...], float] = {(): 1.0}
    frontier = [()]
    for depth in range(1, max(probs.shape[0], len(copy)) + 1):
        nxt = []
        for path in frontier:
            options = {}
            if path == tuple(copy[: depth - 1]) and depth <= len(copy):
                options[copy[depth - 1]] = worth**depth
            if depth <= probs.shape[0]:
                for t in top_tokens[depth - 1]:
                    options[t] = max(options.get(t, 0.0), out[path] * float(probs[depth - 1, t]))
            for t, w in options.items():
                out[path + (t,)] = w
                nxt.append(path + (t,))
        frontier = nxt
    del out[()]
    return out


@pytest.mark.parametrize("budget", [1, 3, 7, 15])
@pytest.mark.parametrize("copy_len", [1, 4, 9])
def test_hybrid_tree_keeps_the_nodes_of_largest_worth(budget, copy_len):
    """build_tree with a copy: the `budget` nodes of largest worth (brute force over every node of the copy and
    the drafter's top 3 per position), the copy's tokens reachable from the anchor along its own path."""
    g = torch.Generator().manual_seed(100 * budget + copy_len)
    scores = torch.randn(5, 10, generator=g) * 2
    copy = torch.randint(10, (copy_len,), generator=g).tolist()
    copy[0] = int(scores[0].argmin())  # the copy's first token is the drafter's least likely one
    tree = build_tree(scores, None, budget, top=3, copy=copy, copy_worth=0.9)
    paths: list[tuple[int, ...]] = []
    for token, parent, depth in zip(tree.tokens, tree.parents, tree.depths):
        prefix = paths[parent - 1] if parent else ()
        assert len(prefix) == depth - 1
        paths.append(prefix + (token,))
    worths = hybrid_worths(scores.softmax(-1), 3, copy, 0.9)
    assert len(set(paths)) == len(paths) == min(budget, len(worths))
    best = sorted(worths.values(), reverse=True)[: len(paths)]
    assert sorted((worths[p] for p in paths), reverse=True) == pytest.approx(best)
    kept_copy = [p for p in paths if p == tuple(copy[: len(p)])]
    assert kept_copy and max(map(len, kept_copy)) == len(kept_copy)  # the copy's prefix, from the anchor
    assert build_tree(scores, None, budget, top=3, copy=[]).tokens == build_tree(scores, None, budget, top=3).tokens
    # a worth threshold keeps exactly the nodes at or above it among those (the estimate script's variant)
    probs, index = scores.softmax(-1).topk(3, -1)
    for threshold in (0.03, 0.07, 0.15, 0.4):
        trimmed = hybrid_tree(probs.tolist(), index.tolist(), copy, budget, 0.9, min_worth=threshold)
        kept: list[tuple[int, ...]] = []
        for token, parent in zip(trimmed.tokens, trimmed.parents):
            kept.append((kept[parent - 1] if parent else ()) + (token,))
        assert set(kept) == {p for p in paths if worths[p] >= threshold}, threshold


@pytest.mark.parametrize("budget", [1, 4, 9])
def test_sample_tree_has_the_greedy_shape_and_draws_its_children(budget):
    """A sampled tree has build_tree's shape for the same distributions (a function of q alone), every node's
    children are distinct tokens the drafter gives probability > 0, and the anchor's children are draws in order
    (the first is distributed as q: checked against its frequencies)."""
    g = torch.Generator().manual_seed(budget)
    scores = torch.randn(3, 6, generator=g) * 2
    scores[1, :3] = float("-inf")  # position 2 has 3 possible tokens
    columns = torch.tensor([50, 51, 52, 53, 54, 55])
    probs = scores.softmax(-1)
    greedy = build_tree(scores, columns, budget)
    first = torch.zeros(6)
    for _ in range(3000):
        tree = sample_tree(probs, columns, budget, g)
        assert tree.parents == greedy.parents and tree.depths == greedy.depths
        for row in range(len(tree) + 1):
            tokens = [token for token, _ in tree.children(row)]
            depth = tree.row_depth(row)
            assert len(set(tokens)) == len(tokens)
            assert all(probs[depth, token - 50] > 0 for token in tokens)
        first[tree.children(0)[0][0] - 50] += 1
    torch.testing.assert_close(first / 3000, probs[0], atol=0.035, rtol=0)
    chain = sample_tree(torch.eye(6)[:3], None, 3, g)  # certain of one token per position: a chain of them
    assert chain.tokens == [0, 1, 2] and chain.parents == [0, 1, 2]
    assert len(sample_tree(torch.zeros(2, 6), None, 3, g)) == 0  # nothing to draw: no nodes


@pytest.mark.parametrize("budget", [4, 11, 15])
def test_build_tree_over_bf16_scores_keeps_the_nodes_of_largest_path_probability(budget):
    """bf16 scores on a CPU with the row kernels take their one-pass top probabilities (row_kernels.top_probs): the
    tree still holds the `budget` nodes of largest path probability under torch's softmax (up to rounding)."""
    g = torch.Generator().manual_seed(budget)
    scores = (torch.randn(3, 300, generator=g) * 3).bfloat16()
    columns = torch.randperm(1000, generator=g)[:300]
    tree = build_tree(scores, columns, budget)
    probs = scores.float().softmax(-1)
    prob_of = [dict(zip(columns.tolist(), row.tolist())) for row in probs]
    values: list[float] = []
    for token, parent, depth in zip(tree.tokens, tree.parents, tree.depths):
        values.append((values[parent - 1] if parent else 1.0) * prob_of[depth - 1][token])
    best = sorted(all_node_values(probs, 4).values(), reverse=True)[:budget]
    assert sorted(values, reverse=True) == pytest.approx(best, rel=1e-5)


def test_ancestor_mask_offsets_and_walk():
    # anchor -> a(1) -> c(3); anchor -> b(2) -> d(4) -> e(5)
    tree = DraftTree(tokens=[10, 11, 12, 13, 14], parents=[0, 0, 1, 2, 4], depths=[1, 1, 2, 2, 3])
    mask = tree.attention_mask()
    ancestors = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 2, 4}, 5: {0, 2, 4, 5}}
    expected = torch.tensor([[c in ancestors[r] for c in range(6)] for r in range(6)])
    assert torch.equal(mask, expected)
    assert tree.position_offsets().tolist() == [0, 1, 1, 2, 2, 3]
    assert tree.depth == 3
    follow = {0: 11, 2: 13, 4: 14, 5: 99}  # the target's token after each row
    assert tree.walk(follow.__getitem__) == ([2, 4, 5], 99)
    assert tree.walk({0: 77}.__getitem__) == ([], 77)


def test_bad_trees_are_refused():
    with pytest.raises(InvalidInputError, match="before it"):
        DraftTree(tokens=[1, 2], parents=[0, 2], depths=[1, 2])
    with pytest.raises(InvalidInputError, match="already has a child"):
        DraftTree(tokens=[1, 1], parents=[0, 0], depths=[1, 1])
    with pytest.raises(InvalidInputError, match="at least one node"):
        build_tree(torch.zeros(2, 4), None, 0)
    for bad in (0, -3, True, 2.5):
        with pytest.raises(InvalidInputError, match="tree must be"):
            DecodeOptions(tree=bad)


# ---- the tree verify pass --------------------------------------------------------------------------------


@pytest.mark.parametrize("arch_name", ["llama", "qwen2", "qwen3"])
def test_tree_pass_rows_equal_fresh_forwards_and_kept_path_equals_a_fresh_prefill(arch_name):
    model = tiny_target(arch_name)
    target = TargetAdapter(model, [1, 4])
    assert target.supports_trees
    prefix = [5, 9, 14, 3, 22, 7]
    tree = DraftTree(tokens=[30, 31, 32, 33, 34, 35], parents=[0, 0, 1, 1, 3, 2], depths=[1, 1, 2, 2, 3, 2])
    cache = target.new_cache()
    target.forward(torch.tensor([prefix]), 0, cache, logits_rows=1)
    ids = torch.tensor([[prefix[-1]] + tree.tokens])
    start = len(prefix) - 1
    cache.crop(start)  # the anchor (last prefix token) is verified again as row 0
    shape = (tree.position_offsets(), tree.attention_mask())
    logits, features = target.forward(ids, start, cache, logits_rows=len(tree) + 1, tree=shape)

    def path_tokens(row: int) -> list[int]:
        out = []
        while row:
            out.append(tree.tokens[row - 1])
            row = tree.parents[row - 1]
        return out[::-1]

    for row in range(len(tree) + 1):
        seq = prefix + path_tokens(row)
        fresh = target.new_cache()
        exp_logits, exp_features = target.forward(torch.tensor([seq]), 0, fresh, logits_rows=1)
        torch.testing.assert_close(logits[row], exp_logits[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(features[0, row], exp_features[0, -1], rtol=1e-4, atol=1e-4)
    # keep anchor -> node 1 (row 1) -> node 3 (row 3) -> node 5 (row 5)
    TargetAdapter.keep_rows(cache, start, [0, 1, 3, 5])
    seq = prefix + path_tokens(5)
    fresh = target.new_cache()
    target.forward(torch.tensor([seq]), 0, fresh, logits_rows=1)
    assert cache.length == len(seq)
    for (k, v), (k_exp, v_exp) in zip(target.cached_key_values(cache), target.cached_key_values(fresh)):
        torch.testing.assert_close(k, k_exp, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v, v_exp, rtol=1e-4, atol=1e-4)


def test_trees_need_the_fast_forward():
    target = TargetAdapter(tiny_target("llama"), fast=False)
    assert not target.supports_trees
    tree = DraftTree(tokens=[3], parents=[0], depths=[1])
    with pytest.raises(InvalidInputError, match="fast forward"):
        target.forward(
            torch.tensor([[5, 3]]), 0, target.new_cache(), 2, tree=(tree.position_offsets(), tree.attention_mask())
        )


# ---- decoding with trees -------------------------------------------------------------------------------


class RankedOracle(DFlashDrafter):
    """Knows the target's greedy continuation and puts its token at a cycling rank per block position (mostly
    first; else second, third, fourth or below the decoys), so trees accept through other choices too."""

    def __init__(self, config, continuation: list[int]) -> None:
        super().__init__(config)
        self.current = continuation
        self.calls = 0

    def draft_scores(self, context, new_features, new_start, anchor, pos, k, embed_tokens, lm_head):
        super().draft_scores(context, new_features, new_start, anchor, pos, k, embed_tokens, lm_head)
        scores = torch.zeros(k, VOCAB)
        for j in range(k):
            i = pos + 1 + j
            true = self.current[i] if i < len(self.current) else 0
            rank = (0, 0, 1, 0, 2, 4, 3)[(self.calls + j) % 7]
            decoys = [t for t in range(4, VOCAB) if t != true][(7 * i) % 50 :][:4]
            for r, t in enumerate(decoys):
                scores[j, t] = 6.0 - r
            scores[j, true] = 6.5 - rank if rank < 4 else -5.0
        self.calls += 1
        return scores, None


def test_tree_decoding_equals_plain_greedy_and_accepts_more_than_a_chain(arch):
    model = tiny_target(arch)
    base = tiny_drafter(model, block_size=6)
    target = TargetAdapter(model, base.config.target_layer_ids)
    plain_target = TargetAdapter(model)
    taus = {"tree": [], "chain": []}
    for seed in range(6):
        prompt = torch.randint(3, VOCAB, (4 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        options = DecodeOptions(max_new_tokens=30)
        plain = [t for s in decode(plain_target, None, prompt, options) for t in s.tokens]
        for kind, tree in (("tree", 10), ("chain", None)):
            oracle = RankedOracle(base.config, prompt + plain)
            oracle.load_state_dict(base.state_dict())
            stats = DecodeStats(6)
            out = [
                t
                for s in decode(target, oracle, prompt, DecodeOptions(max_new_tokens=30, tree=tree), stats)
                for t in s.tokens
            ]
            assert out == plain, (kind, seed)
            taus[kind].append(stats.tau)
            if tree:
                assert (
                    stats.tree == 10 and all(n <= 10 for n in stats.tree_nodes) and sum(map(bool, stats.tree_nodes)) > 5
                )
    assert sum(taus["tree"]) > sum(taus["chain"]) * 1.2, taus


class WrongCopies:
    """A lookup stand-in that copies the target's continuation where ``right(pos)`` says so, else a wrong one
    (made from the text so far, as lookup's are): both kinds of copied steps occur."""

    def __init__(self, continuation: list[int], start: int, right: list[int]) -> None:
        self.continuation, self.pos, self.from_store, self.right = continuation, start, False, right

    def propose(self, max_tokens: int) -> list[int]:
        true = self.continuation[self.pos + 1 : self.pos + 1 + max_tokens]
        if not true:
            return []
        good = 0 if self.pos % 3 == 0 else 2  # wrong from the first token on, or right for two tokens
        self.right.append(min(good, len(true)))  # what a chain of this copy accepts
        return true[:good] + [(t + 1) % VOCAB for t in true[good:]]

    def extend(self, tokens: list[int]) -> None:
        self.pos += len(tokens)


def test_hybrid_trees_hold_copy_and_drafter_and_equal_plain_greedy(arch, monkeypatch):
    """With lookup and --tree, a copied step verifies one tree of the copy and the drafter's candidates: output ==
    plain greedy (fp32); copies verified as chains (no tree, or tree_copies=False) accept exactly their right
    tokens, while in trees the drafter's branches carry steps past where the copy goes wrong."""
    import sys

    decode_module = sys.modules["dflashkit.decoding.loop"]
    model = tiny_target(arch)
    base = tiny_drafter(model, block_size=8)
    target = TargetAdapter(model, base.config.target_layer_ids)
    for tree, tree_copies in ((12, True), (12, False), (None, True)):
        copied_steps, tree_steps, accepted, right = 0, 0, 0, 0
        for seed in range(4):
            prompt = torch.randint(3, VOCAB, (5 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
            plain = [
                t
                for s in decode(TargetAdapter(model), None, prompt, DecodeOptions(max_new_tokens=30))
                for t in s.tokens
            ]
            full = prompt + plain
            proposals: list[int] = []
            monkeypatch.setattr(
                decode_module, "NgramLookup", lambda ids, store=None: WrongCopies(full, len(ids) - 1, proposals)
            )
            oracle = RankedOracle(base.config, full)
            oracle.load_state_dict(base.state_dict())
            stats = DecodeStats(8)
            options = DecodeOptions(max_new_tokens=30, tree=tree, lookup=True, tree_copies=tree_copies)
            out = [t for s in decode(target, oracle, prompt, options, stats) for t in s.tokens]
            assert out == plain, (tree, tree_copies, seed)
            copied = [a for a, c in zip(stats.accepted_lengths, stats.copied_steps) if c]
            assert len(copied) == len(proposals) >= stats.steps - 1  # a copy at every step with room for one
            copied_steps += len(copied)
            tree_steps += sum(1 for c, n in zip(stats.copied_steps, stats.tree_nodes) if c and n)
            accepted += sum(copied)
            right += sum(proposals)
            if not (tree and tree_copies):
                assert copied == proposals  # a chain of the copy: its right tokens, no more
        assert copied_steps > 10
        if tree and tree_copies:
            assert tree_steps == copied_steps  # every copied step was a tree
            assert accepted > right * 1.3, (accepted, right)  # the drafter's branches carried past wrong copies
        else:
            assert tree_steps == 0


def test_tree_decoding_keeps_the_caches_equal_to_a_fresh_prefill():
    model = tiny_target("llama")
    base = tiny_drafter(model, block_size=5)

    class CheckingTarget(TargetAdapter):
        def new_cache(self, capacity=None):
            self.cache = super().new_cache(capacity)
            return self.cache

    target = CheckingTarget(model, base.config.target_layer_ids)
    fresh_target = TargetAdapter(model)
    prompt = [7, 3, 9, 12, 5]
    plain = [t for s in decode(TargetAdapter(model), None, prompt, DecodeOptions(max_new_tokens=40)) for t in s.tokens]
    oracle = RankedOracle(base.config, prompt + plain)
    oracle.load_state_dict(base.state_dict())
    full, emitted, lengths = prompt + plain, [], set()

    def observer(logits, tokens):
        assert logits.shape[0] == len(tokens)  # one logits row per emitted token: the accepted path's rows
        emitted.extend(tokens)
        lengths.add(len(tokens))
        verified = len(prompt) + len(emitted) - 1
        assert target.cache.length == verified
        fresh = fresh_target.new_cache()
        fresh_target.forward(torch.tensor([full[:verified]]), 0, fresh, logits_rows=1)
        for (k, v), (k_exp, v_exp) in zip(target.cached_key_values(target.cache), target.cached_key_values(fresh)):
            torch.testing.assert_close(k, k_exp, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, v_exp, rtol=1e-4, atol=1e-4)

    out = [
        t
        for s in decode(target, oracle, prompt, DecodeOptions(max_new_tokens=40, tree=12), observer=observer)
        for t in s.tokens
    ]
    assert out == plain
    assert len(lengths) >= 3, lengths  # several accepted path lengths occurred


def test_tree_on_an_eager_target_falls_back_to_chains():
    model = tiny_target("llama")
    drafter = tiny_drafter(model, block_size=4)
    eager = TargetAdapter(model, drafter.config.target_layer_ids, fast=False)
    stats = DecodeStats(4)
    prompt = [4, 8, 15, 16]
    out = [t for s in decode(eager, drafter, prompt, DecodeOptions(max_new_tokens=12, tree=6), stats) for t in s.tokens]
    plain = [t for s in decode(TargetAdapter(model), None, prompt, DecodeOptions(max_new_tokens=12)) for t in s.tokens]
    assert out == plain
    assert stats.tree is None and not any(stats.tree_nodes)


def test_copies_join_the_trees_asked_for_not_the_default_seeded_ones(monkeypatch):
    """generate's tree_copies: None means copies join a tree asked for (tree=N) and stay chains in the default trees
    of seeded sampling (measured slower on a CPU); an explicit value wins either way."""
    import sys

    from dflashkit.decoding.defaults import COUPLED_TREE
    from dflashkit.generator import SpeculativeGenerator
    from tests.conftest import record_decode_options, word_tokenizer

    seen = record_decode_options(monkeypatch, sys.modules["dflashkit.generator"], "tree", "tree_copies")
    model = tiny_target("llama")
    gen = SpeculativeGenerator(model, word_tokenizer(), tiny_drafter(model, block_size=8))
    gen.generate([5, 9, 5, 9], max_new_tokens=6, temperature=1.0, seed=1)  # the default seeded trees
    gen.generate([5, 9, 5, 9], max_new_tokens=6, tree=4)  # greedy, a tree asked for
    gen.generate([5, 9, 5, 9], max_new_tokens=6, temperature=1.0, seed=1, tree_copies=True)
    gen.generate([5, 9, 5, 9], max_new_tokens=6, tree=4, tree_copies=False)
    assert seen == [(COUPLED_TREE, False), (4, True), (COUPLED_TREE, True), (4, False)]


def test_seeded_sampling_verifies_trees_by_default_and_keeps_the_seeds_output():
    """A seeded sampled generation (coupled sampling) with the adaptive block size verifies token trees of
    COUPLED_TREE nodes by default, and its output is still plain sampling's for that seed; chains elsewhere."""
    from dflashkit.decoding.defaults import COUPLED_TREE, default_tree
    from dflashkit.generator import SpeculativeGenerator
    from tests.conftest import word_tokenizer

    model = tiny_target("llama")
    gen = SpeculativeGenerator(model, word_tokenizer(), tiny_drafter(model, block_size=8))
    for seed in (1, 2, 3):
        r = gen.generate([5, 9, 11, 3], max_new_tokens=24, temperature=1.0, seed=seed, compare_ar=True)
        assert r.stats.tree == COUPLED_TREE and r.stats.sampler == "coupled" and r.identical
    assert gen.generate([5, 9], max_new_tokens=8, temperature=1.0).stats.tree is None  # no seed: rejection, chains
    assert gen.generate([5, 9], max_new_tokens=8, seed=1).stats.tree is None  # greedy
    assert gen.generate([5, 9], max_new_tokens=8, temperature=1.0, seed=1, block_size=4).stats.tree is None
    assert gen.generate([5, 9], max_new_tokens=8, temperature=1.0, seed=1, tree=3).stats.tree == 3  # as asked
    # tree=0: chains whatever the default, with the adaptive block size and the same output for the seed
    trees = gen.generate([5, 9, 11, 3], max_new_tokens=24, temperature=1.0, seed=2)
    chains = gen.generate([5, 9, 11, 3], max_new_tokens=24, temperature=1.0, seed=2, tree=0)
    assert chains.stats.tree is None and chains.stats.adaptive and chains.token_ids == trees.token_ids
    assert trees.stats.tree == COUPLED_TREE
    for bad in (-1, True, 2.5, "4"):
        with pytest.raises(InvalidInputError, match="tree must be"):
            gen.generate([5, 9], max_new_tokens=4, tree=bad)
    common = {"has_drafter": True, "sampled": True, "sampler": "coupled", "block_size": "auto", "batched": False}
    assert default_tree(None, **common, supports_trees=True) == COUPLED_TREE
    assert default_tree(None, **common, supports_trees=False) is None  # eager forwards: chains
    assert default_tree(None, **{**common, "batched": True}, supports_trees=True) is None  # batch members: chains
    assert default_tree(None, **common, supports_trees=True, constrained=True) is None  # grammar, penalties: chains
    penalised = gen.generate([5, 9], max_new_tokens=8, temperature=1.0, seed=1, presence_penalty=0.5)
    assert penalised.stats.tree is None
