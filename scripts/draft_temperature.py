"""Teacher-forced acceptance at temperature 1 by proposal rule and drafter temperature, per block offset.

The target answers each evaluation prompt (T=1, or greedily with `--contexts greedy`); on that text, at every anchor
and block offset d, p is the target's distribution of the token at d and q_t the drafter's softmax at temperature t
over its draft vocabulary (`--full-vocab`: the whole vocabulary). Prints per offset E[sum_x min(p, q_t)] (a sampled
draft's acceptance), p(argmax q), p(top-2 / top-3 of q) (what a tree of that width accepts), E[max p] and the mass of
p inside the draft vocabulary; `--coupled M` adds coupled sampling's acceptance at each t over M Gumbel draws. Several
`--drafters` are scored on the same contexts. Use it, with scripts/proposal_temperature.py, to choose a drafter's
`proposal_temperature`, or to compare training recipes by their T=1 acceptance with less noise than decoding gives.

    python scripts/draft_temperature.py [--drafters auto,NEW] [--limit 6] [--positions 4] [--coupled 16]
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dflashkit.generator import SpeculativeGenerator

TEMPERATURES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25)


@torch.inference_mode()
def scores_and_target(gen: SpeculativeGenerator, ids: list[int], start: int, positions: int, full_vocab: bool = False):
    """Drafter scores [N, positions, V'] at every anchor start..L-2 and the target's probabilities [L, V'] (V' the
    draft vocabulary; ``full_vocab``: the whole vocabulary, the drafter's hidden states through the target's head)."""
    from dflashkit.training.losses import block_hidden

    d, target = gen.drafter, gen.target
    L = len(ids)
    seq = torch.tensor([ids])
    cache = target.new_cache(capacity=L + 4)
    logits, _ = target.forward(seq, 0, cache, logits_rows=L)  # [L, vocab]: row j predicts token j+1
    p = logits.float().softmax(-1)
    if not full_vocab:
        p = p[:, d.draft_vocab]  # mass outside the draft vocabulary is never proposed
    context = d.context_key_values(target.features(seq), torch.arange(L))  # injected K/V of the whole text
    head = target.lm_head if full_vocab else d._draft_head(target.lm_head)[0]
    anchors = torch.arange(start, L - 1)[None]  # [1, N]
    keep = torch.ones_like(anchors, dtype=torch.bool)
    hidden = block_hidden(d, seq, anchors, keep, target.embed_tokens, context=context)[0, :, :positions]  # [N, pos, H]
    return head(hidden).float(), p, anchors[0]


def coupled_acceptance(
    p: torch.Tensor, scores: torch.Tensor, draws: int, generator: torch.Generator, chunk: int = 16
) -> list[torch.Tensor]:
    """Per row and drafter temperature, the share of `draws` Gumbel vectors under which the drafter's noisy argmax is
    the target's: p [n, V'] (within the draft vocabulary), scores [n, V']; returns one [n] tensor per temperature."""
    rest = (1 - p.sum(-1, keepdim=True)).clamp_min(0)  # the mass outside, one bucket
    log_p = torch.cat((p, rest), -1).log()  # [n, V'+1]
    out = [torch.zeros(p.shape[0]) for _ in TEMPERATURES]
    for start in range(0, p.shape[0], chunk):
        rows = slice(start, start + chunk)
        u = torch.rand(draws, *log_p[rows].shape, generator=generator).clamp_min(1e-20)
        g = -(-u.log()).log()  # [draws, rows, V'+1]
        target = (log_p[rows] + g).argmax(-1)  # [draws, rows]
        for i, t in enumerate(TEMPERATURES):
            draft = (scores[rows] / t + g[..., :-1]).argmax(-1)
            out[i][rows] = (draft == target).float().mean(0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="mt-bench,humaneval,math500")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--positions", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--full-vocab",
        action="store_true",
        help="q over the whole vocabulary (the drafter's hidden states through the target's head)",
    )
    ap.add_argument(
        "--coupled",
        type=int,
        default=0,
        metavar="M",
        help="also coupled sampling's acceptance per drafter temperature, over M Gumbel draws per position",
    )
    ap.add_argument(
        "--contexts",
        choices=("sampled", "greedy"),
        default="sampled",
        help="teacher-force on the target's T=1 answers (what T=1 decoding meets; default) or on its greedy ones",
    )
    ap.add_argument("--drafters", default="auto", help="comma-separated drafter folders, scored on the same contexts")
    args = ap.parse_args()
    from dflashkit import DecodeOptions, SpeculativeGenerator, decode, load_drafter
    from dflashkit.decoding.sampling import SamplingParams
    from dflashkit.drafter.registry import drafter_folder
    from dflashkit.training.evalsets import load_set

    if args.threads:
        torch.set_num_threads(args.threads)
    paths = args.drafters.split(",")
    gen = SpeculativeGenerator.load(drafter=paths[0])  # also decodes the contexts
    gens = [gen] + [
        SpeculativeGenerator(
            gen.model,
            gen.tokenizer,
            load_drafter(drafter_folder(path, None), dtype=gen.model.dtype, device=gen.model.device),
        )
        for path in paths[1:]
    ]
    generator = torch.Generator().manual_seed(0)
    labels = [f"q at T={t:g}" for t in TEMPERATURES] + ["argmax q", "top-2 of q", "top-3 of q", "max p", "mass of p"]
    if args.coupled:
        labels += [f"coupled T={t:g}" for t in TEMPERATURES]
    for name in args.sets.split(","):
        sums = torch.zeros(len(gens), len(labels), args.positions)
        counts = torch.zeros(args.positions)
        for i, prompt in enumerate(load_set(name, limit=args.limit, seed=0)):
            ids = gen.encode_prompt(prompt)
            temperature = 1.0 if args.contexts == "sampled" else 0.0
            options = DecodeOptions(
                max_new_tokens=args.max_new_tokens,
                seed=i,
                sampling=SamplingParams(temperature=temperature),
                stop_token_ids=frozenset(gen.eos_token_ids),
            )
            out = [t for step in decode(gen.target, None, ids, options) for t in step.tokens]
            length = len(ids) + len(out)
            for g, scored in enumerate(gens):
                generator.manual_seed(i)  # every drafter meets the same Gumbel draws
                scores, p_all, anchors = scores_and_target(scored, ids + out, len(ids), args.positions, args.full_vocab)
                for k in range(args.positions):
                    valid = anchors + k + 1 < length
                    p = p_all[anchors[valid] + k]  # [n, V']: the token at offset k+1
                    s = scores[valid, k]
                    rows = [torch.minimum(p, (s / t).softmax(-1)).sum(-1) for t in TEMPERATURES]
                    top = p.gather(1, s.topk(3, -1).indices)  # [n, 3]
                    rows += [top[:, 0], top[:, :2].sum(-1), top.sum(-1), p.max(-1).values, p.sum(-1)]
                    if args.coupled:
                        rows += coupled_acceptance(p, s, args.coupled, generator)
                    sums[g, :, k] += torch.stack([r.sum() for r in rows])
                    if g == 0:
                        counts[k] += valid.sum()
        print(f"{name}: {int(counts[0])} anchors; offsets 1..{args.positions}")
        for path, drafter_sums in zip(paths, sums):
            if len(paths) > 1:
                print(f" drafter {path}")
            for label, row in zip(labels, drafter_sums / counts):
                print(f"  {label:12s} " + " ".join(f"{v:.3f}" for v in row.tolist()), flush=True)


if __name__ == "__main__":
    main()
