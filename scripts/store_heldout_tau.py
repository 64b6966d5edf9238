"""The n-gram store's own τ on answers it has not seen, without running any model: which store to ship.

    python scripts/store_heldout_tau.py --data DATA_DIR --stores OLD_STORE[,OTHER...] [--holdout 0.2]

Splits the greedy answers of a `dflashkit data` folder (seeded), builds a store from the first part, and walks
each held-out answer as the decode loop would with the store as the only drafter (propose up to BLOCK-1 tokens
from the last n tokens, accept the prefix that equals the answer, then one token of the target's own; a step
without a proposal is a plain step). Prints that τ for each given store, for the store of the training part, and
for the training part's store merged with each given store (`dflashkit ngram-store --merge`). A given store built
from these same answers has seen the held-out ones (the shipped v10 store holds session 30's: 2.107 on them, against
1.571 for v9's): compare stores built from other answers.
"""

from __future__ import annotations

import argparse
import random

from dflashkit.drafter.ngram_store import NgramStore, find_store
from dflashkit.training.dataset import load_shards


def store_tau(store: NgramStore, records: list[dict], block: int) -> float:
    """Tokens per step over the records' answers with the store as the only drafter."""
    steps = tokens = 0
    for r in records:
        seq = r["prompt_ids"][-store.n :] + r["response_ids"]
        pos = min(store.n, len(r["prompt_ids"]))
        start = pos
        while pos < len(seq):
            proposal = store.propose(seq[:pos], block - 1)
            accepted = 0
            while accepted < len(proposal) and pos + accepted < len(seq) and proposal[accepted] == seq[pos + accepted]:
                accepted += 1
            pos += min(accepted + 1, len(seq) - pos)
            steps += 1
        tokens += len(seq) - start
    return tokens / max(1, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a `dflashkit data` folder of greedy answers")
    ap.add_argument("--stores", default="", help="stores (files or drafter folders) to compare, comma-separated")
    ap.add_argument("--holdout", type=float, default=0.2, help="share of the answers held out (default 0.2)")
    ap.add_argument("--answers", type=int, default=1500, help="held-out answers walked (default 1500)")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=3, help="context length of the training part's store (default 3)")
    ap.add_argument(
        "--max-entries",
        default="",
        help="also each merged store cut to these sizes, comma-separated "
        "(`dflashkit ngram-store --max-entries`: the n-grams counted most often kept)",
    )
    args = ap.parse_args()
    records = load_shards(args.data, include_partial=True)
    random.Random(args.seed).shuffle(records)
    cut = int(len(records) * (1 - args.holdout))
    train, held = records[:cut], records[cut:][: args.answers]
    own = NgramStore.build([r["prompt_ids"][-args.n :] + r["response_ids"] for r in train], n=args.n)
    print(f"{len(train)} answers build the store, {len(held)} held-out answers walked, block {args.block}")
    rows = [("training part's store", own)]
    for path in filter(None, args.stores.split(",")):
        store = NgramStore.load(find_store(path) or path)
        merged = own.merged(store)
        rows += [(path, store), (f"training part's + {path}", merged)]
        rows += [
            (f"training part's + {path}, cut to {int(size):,d}", merged.pruned(int(size)))
            for size in filter(None, args.max_entries.split(","))
        ]
    for name, store in rows:
        print(f"{store_tau(store, held, args.block):.3f}  {len(store):8,d} {store.n}-grams  {name}")


if __name__ == "__main__":
    main()
