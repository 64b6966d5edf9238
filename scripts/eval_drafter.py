"""τ and speedup of a drafter per evaluation set: `dflashkit bench` with plain and speculative decoding only.

Runs `dflashkit bench --methods ar,dflash --temperatures 0 --max-turns 1 --block-sizes B` (B: --block-size, default
the drafter's trained block size) on MT-Bench, HumanEval and MATH-500, and exits 1 on a greedy divergence that is not
a tie, as the bench does; `dflashkit bench --help` lists what the bench itself can do. For example:

    python scripts/eval_drafter.py --drafter DIR [--limit 10] [--max-new-tokens 128] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--target", default=None)
    ap.add_argument("--sets", default="mt-bench,humaneval,math500")
    ap.add_argument("--limit", type=int, default=10, help="prompts per set (seeded subset)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="results JSON path")
    ap.add_argument("--out", default=None, help="output folder (summary.md, plots)")
    args = ap.parse_args()
    from dflashkit.cli.main import main as dflashkit_main

    config = pathlib.Path(args.drafter) / "config.json"
    block = args.block_size or (json.loads(config.read_text()).get("block_size", 16) if config.is_file() else 16)
    argv = ["bench", "--methods", "ar,dflash", "--temperatures", "0", "--max-turns", "1", "--drafter", args.drafter,
            "--datasets", args.sets, "--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens),
            "--block-sizes", str(block), "--dtype", args.dtype]  # fmt: skip
    for flag, value in (("--target", args.target), ("--threads", args.threads), ("--json", args.json),
                        ("--out", args.out)):  # fmt: skip
        if value is not None:
            argv += [flag, str(value)]
    return dflashkit_main(argv)


if __name__ == "__main__":
    sys.exit(main())
