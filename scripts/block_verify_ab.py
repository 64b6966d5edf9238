"""Block verification against token-by-token acceptance of sampled drafts, in one process, interleaved.

    .venv/bin/python scripts/block_verify_ab.py [--limit 12] [--block-sizes 16,auto] [--temperature 1.0] [--same-drafts]

For each evaluation set and block-size setting, every prompt is sampled (rejection sampler, the same seed for
both rules) once with each rule, in alternating order, after one warm-up generation. The token-by-token rule is
the loop's verification before block verification (accept x_i with probability min(1, p/q) until the first
rejection), patched into the decode loop for its turns. Prints τ (drafts kept per verify + 1) and tokens/s per
rule; the median of the per-prompt tok/s ratios (block / token). Both rules run in torch (the decode loop's
``verify_sampled_logits`` replaced for every run: warp, q over the whole vocabulary, then the rule), not in the row
kernels' one-call verification, so that only the rule differs. Sampled texts differ from run to run, so those
are noisy; with ``--same-drafts`` the block rule's runs also record, at each verify of sampled drafts, the drafts
each rule keeps in expectation on those very drafts (exact, from the stop probabilities): a paired comparison,
whose bookkeeping (every row's stop probability) then weighs on the block rule's tok/s.
"""

from __future__ import annotations

import argparse
import importlib
import statistics

import torch

from dflashkit.decoding.sampling import over_vocabulary, sample, warp
from dflashkit.decoding.verify import block_verification, verify_sampled, verify_sampled_logits
from dflashkit.generator import SpeculativeGenerator
from dflashkit.training.evalsets import load_set

decode_module = importlib.import_module("dflashkit.decoding.loop")  # the package re-exports a function named decode


def token_by_token(target_probs, drafts, draft_probs, generator):
    """The pre-block rule: x_i kept with probability min(1, p/q) until the first rejection."""
    if draft_probs is None or drafts.shape[0] == 0:
        return verify_sampled(target_probs, drafts, draft_probs, generator)  # one-hot: the same rule
    k = drafts.shape[0]
    idx = torch.arange(k, device=drafts.device)
    p_x, q_x = target_probs[idx, drafts], draft_probs[idx, drafts]
    u = torch.rand(k, generator=generator, device=p_x.device)
    accepted = int(torch.cumprod((u * q_x < p_x).int(), 0).sum())
    if accepted == k:
        return k, int(sample(target_probs[k], generator))
    residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
    total = residual.sum()
    return accepted, int(sample(residual / total if total > 0 else target_probs[accepted], generator))


PAIRED: list[tuple[float, float]] = []  # per verify of sampled drafts: E[kept] by block, by token


def block_recording(target_probs, drafts, draft_probs, generator):
    """verify_sampled, recording both rules' expected kept drafts for these drafts (sampled ones only)."""
    if draft_probs is not None and drafts.shape[0]:
        weights, stops = block_verification(target_probs, drafts, draft_probs)
        later, block = 1.0, 0.0
        for i in range(len(stops), 0, -1):
            later *= 1 - stops[i - 1]
            block += 1 - later  # P(kept >= i)
        token = sum(_token_prefixes(target_probs, drafts, draft_probs))
        PAIRED.append((block, token))
    return verify_sampled(target_probs, drafts, draft_probs, generator)


def _token_prefixes(target_probs, drafts, draft_probs):
    """P(kept >= i) under token-by-token acceptance, i = 1..k."""
    idx = torch.arange(drafts.shape[0])
    ratios = (target_probs[idx, drafts] / draft_probs[idx, drafts]).clamp(max=1).double()
    return torch.cumprod(ratios, 0).tolist()


RULES = {"block": verify_sampled, "token": token_by_token}


def on_logits(rule):
    """The decode loop's verify_sampled_logits, in torch with ``rule`` deciding."""

    def verify(logits, params, drafts, draft_probs, generator, columns=None):
        if draft_probs is not None and columns is not None:
            draft_probs = over_vocabulary(draft_probs, columns, logits.shape[-1])
        return rule(warp(logits, params), drafts, draft_probs, generator)

    return verify


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    ap.add_argument("--sets", default="mt-bench,humaneval,math500")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument(
        "--block-sizes", default="16,auto", help="comma-separated; 'auto' = the adaptive policy with lookup"
    )
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--same-drafts",
        action="store_true",
        help="record both rules' expected kept drafts on the block rule's drafts (slows the block rule's runs)",
    )
    args = ap.parse_args()
    if args.same_drafts:
        RULES["block"] = block_recording
    torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.load(drafter=args.drafter) if args.drafter else SpeculativeGenerator.load()
    gen.generate("Hello!", max_new_tokens=32, temperature=args.temperature, sampler="rejection", seed=0)  # warm-up
    for setting in args.block_sizes.split(","):
        block = setting if setting == "auto" else int(setting)
        for name in args.sets.split(","):
            runs = {rule: [] for rule in RULES}
            PAIRED.clear()
            for n, prompt in enumerate(load_set(name, limit=args.limit)):
                order = list(RULES) if n % 2 == 0 else list(RULES)[::-1]
                for rule in order:
                    decode_module.verify_sampled_logits = on_logits(RULES[rule])
                    try:
                        result = gen.generate(
                            prompt,
                            max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature,
                            sampler="rejection",
                            seed=n,
                            block_size=block,
                            lookup=block == "auto",
                        )
                    finally:
                        decode_module.verify_sampled_logits = verify_sampled_logits
                    runs[rule].append(result.stats)
            line = [f"block {setting:>4} {name:>9}:"]
            for rule, stats in runs.items():
                steps = sum(s.steps for s in stats)
                kept = sum(sum(s.accepted_lengths) for s in stats)
                seconds = sum(s.prefill_s + s.decode_s for s in stats)
                tokens = sum(s.new_tokens for s in stats)
                line.append(f"{rule} τ {(kept + steps) / steps:.3f} {tokens / seconds:6.1f} tok/s")
            ratio = statistics.median(b.tokens_per_s / t.tokens_per_s for b, t in zip(runs["block"], runs["token"]))
            kept_block, kept_token = (sum(x) / len(PAIRED) for x in zip(*PAIRED)) if PAIRED else (0.0, 0.0)
            if PAIRED:
                line.append(
                    f"same drafts ({len(PAIRED)} verifies): kept {kept_block:.3f} vs {kept_token:.3f} "
                    f"({100 * (kept_block / kept_token - 1):+.1f}%)"
                )
            print(
                "  ".join(line[:3])
                + f"  median tok/s ratio block/token {ratio:.3f}"
                + "".join(f"; {extra}" for extra in line[3:]),
                flush=True,
            )


if __name__ == "__main__":
    main()
