"""How close a weight-only quantized target stays to its bf16 model, on the bf16 model's own greedy answers.

For a few benchmark prompts, the bf16 target answers greedily; then the bf16 target and each quantized one read
prompt + answer in one pass (teacher forcing), and at every answer position the script compares their next-token
distributions: top-1 agreement with bf16 (how often the quantized model would have picked the same token), the mean
KL divergence KL(bf16 || quantized) in nats, and the answer's perplexity under each model. A quantized target is a
different model (its outputs are exact with respect to itself, not to bf16); this says how different.

    python scripts/quant_quality.py --target qwen2.5-coder-1.5b --methods int8,int4 --prompts 6 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import math
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="as `dflashkit generate --target` takes it (default: SmolLM2)")
    ap.add_argument("--methods", default="int8,int4", help="quantizations to compare (default: %(default)s)")
    ap.add_argument("--datasets", default="humaneval,mt-bench,math500", help="prompt sets (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=6, help="prompts in all (default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="answer length (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    from dflashkit import SpeculativeGenerator
    from dflashkit.bench.datasets import load_questions
    from dflashkit.kernels.quantize import check_method, quantize_model

    methods = [check_method(m.strip()) for m in args.methods.split(",") if m.strip()]
    if args.threads:
        torch.set_num_threads(args.threads)
    sets = [s.strip() for s in args.datasets.split(",") if s.strip()]
    per = max(1, -(-args.prompts // len(sets)))
    questions = [q for s in sets for q in load_questions(s, limit=per)[1]][: args.prompts]

    gen = SpeculativeGenerator.load(args.target, drafter=None)
    sequences = []  # (ids, answer start)
    t0 = time.perf_counter()
    for q in questions:
        ids = gen.encode_prompt(q.turns[0], True)
        answer = gen.generate(ids, max_new_tokens=args.max_new_tokens, use_drafter=False).token_ids
        sequences.append((list(ids) + list(answer), len(ids)))
    print(f"{len(sequences)} bf16 answers in {time.perf_counter() - t0:.0f} s", flush=True)

    def answer_logprobs(model: torch.nn.Module) -> list[torch.Tensor]:
        out = []
        with torch.inference_mode():
            for ids, start in sequences:
                logits = model(torch.tensor([ids])).logits[0, start - 1 : len(ids) - 1].float()
                out.append(logits.log_softmax(-1))  # [answer, vocab]: predictions of the answer's tokens
        return out

    base = answer_logprobs(gen.model)
    rows = [("bfloat16", 1.0, 0.0, _ppl(base, sequences))]
    del gen
    for method in methods:
        model = SpeculativeGenerator.load(args.target, drafter=None).model
        quantize_model(model, method)
        lp = answer_logprobs(model)
        agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(base, lp))
        total = sum(a.shape[0] for a in base)
        kl = sum(float((a.exp() * (a - b)).sum()) for a, b in zip(base, lp)) / total
        rows.append((method, agree / total, kl, _ppl(lp, sequences)))
        del model
    print(f"{'weights':10s} {'top-1 = bf16':>12s} {'KL (nats)':>10s} {'answer ppl':>10s}")
    for name, agree, kl, ppl in rows:
        print(f"{name:10s} {agree:12.3f} {kl:10.4f} {ppl:10.3f}")


def _ppl(logprobs: list[torch.Tensor], sequences: list[tuple[list[int], int]]) -> float:
    nll, count = 0.0, 0
    for lp, (ids, start) in zip(logprobs, sequences):
        target = torch.tensor(ids[start:])
        nll -= float(lp.gather(1, target[:, None]).sum())
        count += len(target)
    return math.exp(nll / max(1, count))


if __name__ == "__main__":
    main()
