"""Greedy chain τ of k drafts, teacher-forced, with the drafter scoring its draft vocabulary alone, that and the
text's own tokens outside it (:mod:`dflashkit.drafter.text_columns`, the default), or the whole vocabulary.

    .venv/bin/python scripts/text_columns_tau.py [--drafter DIR] [--limit 6] [--k 15] [--max-new-tokens 128]

The target answers each prompt greedily; at every anchor of the answer the drafter (context: the answer's verified
features up to the anchor; text: the prompt and the answer up to the anchor) drafts k tokens in one block, compared
with the answer: τ = 1 + the mean count of leading drafts that match; p1: the share of anchors whose first draft
matches. Also the share of the answers' tokens outside the draft vocabulary. No timing.
"""

from __future__ import annotations

import argparse

import torch
from block_length_tau import answers, leading_matches  # scripts/block_length_tau.py

from dflashkit.generator import SpeculativeGenerator

VARIANTS = ("draft vocabulary", "+ text", "whole vocabulary")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--sets", default="mt-bench,humaneval,math500")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=15, help="drafts per anchor")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.load(drafter=args.drafter)
    drafter, target = gen.drafter, gen.target
    if drafter.draft_vocab is None:
        raise SystemExit("this drafter scores the whole vocabulary: nothing to compare")
    target.set_feature_layers(drafter.config.target_layer_ids)
    draft_vocab = drafter.draft_vocab
    in_vocab = set(draft_vocab.tolist())
    for name in args.sets.split(","):
        matched = dict.fromkeys(VARIANTS, 0)
        first = dict.fromkeys(VARIANTS, 0)
        anchors = outside = 0  # anchors: one per answer token (the last prompt token's, then all but the last)
        for ids, y, features in answers(gen, name, args.limit, args.max_new_tokens):
            outside += sum(t not in in_vocab for t in y[len(ids) :])
            anchors += len(y) - len(ids)
            for variant in VARIANTS:
                drafter.draft_vocab = None if variant == "whole vocabulary" else draft_vocab
                drafter.text_columns = variant == "+ text"
                context = drafter.new_context(capacity=len(y) + args.k + 2)
                context.note_text(y[: len(ids)])
                have = 0  # context rows taken so far: positions < have
                for a in range(len(ids) - 1, len(y) - 1):  # anchor y[a] at position a, context = positions < a
                    new = features[:, have:a] if a > have else None
                    scores, columns = drafter.draft_scores(
                        context, new, have, y[a], a, args.k, target.embed_tokens, target.lm_head
                    )
                    best = scores.argmax(-1)
                    drafts = (columns[best] if columns is not None else best).tolist()
                    m = leading_matches(drafts, y, a, args.k)
                    matched[variant] += m
                    first[variant] += m > 0
                    have = max(have, a)
                    context.note_text([y[a + 1]])  # the answer's next token, verified before the next anchor
        drafter.draft_vocab, drafter.text_columns = draft_vocab, True
        cells = [f"{v}: τ {1 + matched[v] / anchors:.3f} p1 {first[v] / anchors:.3f}" for v in VARIANTS]
        print(
            f"{name} ({anchors} anchors; {outside / anchors:.1%} of the answers' tokens outside the draft "
            f"vocabulary)\n  " + "\n  ".join(cells),
            flush=True,
        )


if __name__ == "__main__":
    main()
