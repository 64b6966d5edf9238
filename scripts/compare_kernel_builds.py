"""A/B of two builds of dflashkit's row kernels in one process, interleaved: the default target's step time by rows.

A build directory is one of ~/.cache/dflashkit/kernels/dflashkit_rows_<isa>_<hash> (the kernels build there once per
source version: edit the C++, run anything that loads the kernels, and a new directory appears). Both builds must be
of the instruction set that runs here and take the running source's packed weight layout. The builds alternate per
round, the first two rounds are dropped, and the medians and the ratio NEW/OLD are printed: on a shared machine whose
speed swings by tens of percent from minute to minute, this is how a kernel change is judged. `--sequences S` times
batched passes of S sequences (what batched serving and data regeneration run), `--trees` token-tree steps too.
`--decode N` compares whole generations instead (N prompts per evaluation set, 128 tokens, speculative then plain,
one generator per build, each packing its own weights, so builds whose packed layouts differ compare too); each
build's speculative output must equal its own plain output.

    python scripts/compare_kernel_builds.py OLD_BUILD_DIR NEW_BUILD_DIR [--rows 1,2,4,8] [--trees 12,16] [--rounds 14]
    python scripts/compare_kernel_builds.py OLD_BUILD_DIR NEW_BUILD_DIR --decode 3 [--quantize int8]
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import statistics
import time
from pathlib import Path
from types import ModuleType

import torch


def load_build(directory: Path) -> ModuleType:
    """The compiled extension module in a kernel build directory."""
    so = next(directory.glob("*.so"), None)
    if so is None:
        raise SystemExit(f"no compiled module (*.so) in {directory}")
    loader = importlib.machinery.ExtensionFileLoader(directory.name, str(so))
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(directory.name, so, loader=loader))
    loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--trees", default="", help="rows of token-tree steps to time as well (one sequence)")
    ap.add_argument("--rounds", type=int, default=14)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantize", choices=("none", "int8"), default="none", help="int8: the weight-only int8 target")
    ap.add_argument("--sequences", type=int, default=1, help="sequences per step, batched (default 1)")
    ap.add_argument(
        "--decode",
        type=int,
        default=0,
        metavar="N",
        help="compare whole generations on N prompts per evaluation set instead of single steps",
    )
    args = ap.parse_args()
    from step_cost import tree_shape  # scripts/step_cost.py, beside this script

    from dflashkit.generator import SpeculativeGenerator
    from dflashkit.kernels import row_kernels
    from dflashkit.target.fast import ForwardCall

    torch.set_num_threads(args.threads)
    builds = {"old": load_build(args.old), "new": load_build(args.new)}
    if len({b.isa for b in builds.values()} | {row_kernels.label()}) != 1:
        raise SystemExit("both builds must be of the instruction set that runs here")
    running = {"module": builds["old"]}
    row_kernels.kernel = lambda: running["module"]  # every kernel call of the target goes to the chosen build
    if args.decode:
        compare_decoding(builds, running, args)
        return
    target = SpeculativeGenerator.load(quantize=args.quantize).target
    forward = target.fast_forward
    caches = [target.new_cache(capacity=args.context + 64) for _ in range(args.sequences)]
    shapes: dict[str, tuple[int, tuple | None]] = {f"{int(n):2d} rows": (int(n), None) for n in args.rows.split(",")}
    for n in (int(t) for t in args.trees.split(",") if t):
        if args.sequences > 1:
            raise SystemExit("--trees: one sequence")
        shapes[f"tree of {n} rows"] = (n, tree_shape(n))
    times: dict[tuple[str, str], list[float]] = {(b, shape): [] for b in builds for shape in shapes}
    with torch.inference_mode():
        for cache in caches:
            target.forward(torch.randint(0, 1000, (1, args.context)), 0, cache, logits_rows=1)
        for round_ in range(args.rounds + 2):
            for shape, (n, tree) in shapes.items():
                for name in ("old", "new") if round_ % 2 else ("new", "old"):
                    running["module"] = builds[name]
                    ids = [torch.randint(0, 1000, (1, n)) for _ in caches]
                    t0 = time.perf_counter()
                    if len(caches) == 1:
                        target.forward(ids[0], args.context, caches[0], logits_rows=n, tree=tree)
                    else:
                        forward.batch([ForwardCall(i, args.context, c, n) for i, c in zip(ids, caches)], [])
                    elapsed = time.perf_counter() - t0
                    for cache in caches:
                        target.crop(cache, args.context)
                    if round_ >= 2:
                        times[(name, shape)].append(elapsed)
    weights = ", int8 weights" if args.quantize == "int8" else ""
    each = f", {args.sequences} sequences batched (rows per sequence)" if args.sequences > 1 else ""
    print(
        f"target step at {args.context} cached positions{weights}{each}, {args.threads} threads, median of "
        f"{args.rounds}"
    )
    for shape in shapes:
        old, new = (statistics.median(times[(b, shape)]) * 1e3 for b in ("old", "new"))
        print(f"  {shape}: old {old:7.2f} ms  new {new:7.2f} ms  new/old {new / old:.3f}")


def compare_decoding(builds: dict[str, ModuleType], running: dict, args: argparse.Namespace) -> None:
    """Speculative and plain generations with each build, interleaved per prompt (see the module docs)."""
    from dflashkit.generator import SpeculativeGenerator
    from dflashkit.training.evalsets import load_set

    gens = {}
    for name, build in builds.items():  # each generator's weights packed by its own build
        running["module"] = build
        gens[name] = SpeculativeGenerator.load(quantize=args.quantize)
    prompts = [p for s in ("mt-bench", "humaneval", "math500") for p in load_set(s, limit=args.decode, seed=1)]
    for name, gen in gens.items():  # warm-up: one-time costs and the adaptive policies' first estimates
        running["module"] = builds[name]
        gen.generate(prompts[0], max_new_tokens=64)
        gen.generate(prompts[0], max_new_tokens=64, use_drafter=False)
    speeds: dict[tuple[str, str], list[float]] = {(b, mode): [] for b in builds for mode in ("speculative", "plain")}
    for i, prompt in enumerate(prompts):
        for name in ("old", "new") if i % 2 else ("new", "old"):
            running["module"] = builds[name]
            spec = gens[name].generate(prompt, max_new_tokens=128)
            plain = gens[name].generate(prompt, max_new_tokens=128, use_drafter=False)
            if spec.token_ids != plain.token_ids:
                raise SystemExit(f"{name} build, prompt {i}: speculative output differs from plain decoding")
            speeds[(name, "speculative")].append(spec.stats.tokens_per_s)
            speeds[(name, "plain")].append(plain.stats.tokens_per_s)
    weights = "int8" if args.quantize == "int8" else "bf16"
    print(
        f"{len(prompts)} prompts, 128 tokens, {weights} target, {args.threads} threads; each build's speculative "
        "output equal to its plain output"
    )
    for mode in ("speculative", "plain"):
        old, new = speeds[("old", mode)], speeds[("new", mode)]
        ratio = statistics.median(n / o for o, n in zip(old, new))
        print(
            f"  {mode:11s}: old {statistics.median(old):6.1f} tok/s  new {statistics.median(new):6.1f} tok/s  "
            f"new/old (median per prompt) {ratio:.3f}"
        )


if __name__ == "__main__":
    main()
