"""`dflashkit bench --quick`: a run sized to the CPU it runs on, to finish in about five minutes.

The quick preset (``QUICK`` in :mod:`dflashkit.bench.command`) is a starting point, not a promise: on a laptop-class
AVX2 CPU, transformers' bf16 ``generate`` runs at a few tokens per second and the preset took over a quarter of an
hour. So before the run, short generations are timed: dflashkit's plain decoding (the baseline "ar"), one DFlash
method (standing for all of them: with an untrained drafter they run slower than plain decoding, with a trained one
faster), and each peer (transformers' ``generate``, llama.cpp). The run is estimated from those speeds, and what does
not fit the budget is cut, in this order, each only while the estimate is still over and only where no option
fixed it:

1. peers slower than dflashkit's plain decoding, the slowest first (they would take most of the time);
2. new tokens per turn, 64 -> 32;
3. DFlash block sizes, down to "auto" (the library's default);
4. temperatures, down to greedy (0: also the token-for-token losslessness check);
5. questions per data set, down to 1.

:func:`plan_quick` decides from given speeds (no model: tests give it made-up ones); :func:`measure_speeds` times
the generations; :func:`apply_quick` does both for the command and applies the plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

QUICK_BUDGET_S = 300.0  # what --quick promises: about 5 minutes, loading and measuring included
QUICK_MIN_TOKENS = 32  # the fewest new tokens per turn --quick cuts to (fewer: τ and speeds mean little)
WARMUP_TOKENS = 16  # the runner's warm-up generation per method (BenchConfig.warmup_tokens)
# A short greedy generation on one prompt runs faster than the run's mix (longer prompts, sampling, which slows
# llama.cpp's DFlash most, the checks between generations): `dflashkit bench --quick` on 2 AMD EPYC Zen 4 cores
# (AVX512-BF16), 2026-11-28, took 240 s where the raw estimate said 167, so estimates are scaled by this.
ESTIMATE_MARGIN = 1.45
BASELINE = "ar"  # its measured speed stands for the dflashkit methods (but DFlash) and for peers not measured


@dataclass(frozen=True)
class Speed:
    """A timed generation: seconds to the first new token (prefill) and new tokens per second after it."""

    ttft_s: float
    tokens_per_s: float

    def seconds(self, tokens: int) -> float:
        """The time one generation of `tokens` new tokens is estimated to take."""
        return self.ttft_s + max(0, tokens - 1) / self.tokens_per_s


@dataclass(frozen=True)
class QuickMethod:
    """A method of the run as the sizing sees it: its name, family ("dflashkit" or a peer's), and a DFlash
    method's block size (None for the others)."""

    name: str
    family: str
    block_size: int | str | None = None


@dataclass
class QuickPlan:
    """What --quick chose: the settings, the methods it left out (name: why), the estimate, and the reasons."""

    limit: int
    max_new_tokens: int
    temperatures: list[float]
    block_sizes: list[int | str]
    left_out: dict[str, str]
    estimate_s: float
    budget_s: float
    full_estimate_s: float  # the preset as asked, before any cut
    cuts: list[str] = field(default_factory=list)  # one line per cut, in order
    spent_s: float = 0.0  # of the budget, spent before the plan (loading, measuring)

    @property
    def fits(self) -> bool:
        return self.estimate_s <= self.budget_s

    def as_dict(self) -> dict[str, Any]:
        """For results.json."""
        return {
            "budget_s": round(self.budget_s, 1),
            "spent_s": round(self.spent_s, 1),
            "estimate_s": round(self.estimate_s, 1),
            "full_estimate_s": round(self.full_estimate_s, 1),
            "cuts": list(self.cuts),
            "left_out": dict(self.left_out),
        }


def plan_quick(
    methods: Sequence[QuickMethod],
    speeds: dict[str, Speed],
    settings: dict[str, Any],
    prompts: Callable[[int], int],
    budget_s: float,
    fixed: frozenset[str] = frozenset(),
    margin: float = ESTIMATE_MARGIN,
) -> QuickPlan:
    """Cut the quick run until its estimate fits `budget_s` (see the module docstring for the order).

    `methods`: those that can run here (the baseline "ar" among them); `speeds`: measured speeds by method name:
    "ar" (dflashkit's plain decoding: it stands for the other dflashkit methods and any peer not measured), a DFlash
    method's (it stands for the DFlash methods not measured; none: "ar" does) and the peers';
    `settings`: limit, max_new_tokens, temperatures, block_sizes as the preset and options give them;
    `prompts(limit)`: the turns the run generates per temperature with `limit` questions per data set;
    `fixed`: the settings an explicit option gave ("limit", "max_new_tokens", "temperatures", "block_sizes",
    "methods"), never cut; `margin`: what every estimate is scaled by (see ESTIMATE_MARGIN).
    """
    loop = speeds[BASELINE]
    state = {
        "limit": settings["limit"],
        "max_new_tokens": settings["max_new_tokens"],
        "temperatures": list(settings["temperatures"]),
        "block_sizes": list(settings["block_sizes"]),
    }
    left_out: dict[str, str] = {}

    drafting = next((speeds[m.name] for m in methods if m.block_size is not None and m.name in speeds), loop)

    def speed_of(m: QuickMethod) -> Speed:
        return speeds.get(m.name, drafting if m.block_size is not None else loop)

    def kept() -> list[QuickMethod]:
        return [m for m in methods if m.name not in left_out]

    def cost(ms: Sequence[QuickMethod]) -> float:
        runs = prompts(state["limit"]) * len(state["temperatures"])
        per_method = (
            speed_of(m).seconds(WARMUP_TOKENS) + runs * speed_of(m).seconds(state["max_new_tokens"]) for m in ms
        )
        return margin * sum(per_method)

    full = cost(methods)
    cuts: list[str] = []

    def over() -> bool:
        return cost(kept()) > budget_s

    slow = [
        m
        for m in methods
        if m.family != "dflashkit" and m.name in speeds and speed_of(m).tokens_per_s < loop.tokens_per_s
    ]
    dropped: list[str] = []
    for m in sorted(slow, key=lambda m: speed_of(m).tokens_per_s):  # the slowest first
        if not over() or "methods" in fixed:
            break
        rate = speed_of(m).tokens_per_s
        left_out[m.name] = (
            f"left out by --quick: {rate:.1f} tok/s here, slower than dflashkit's plain decoding "
            f"({loop.tokens_per_s:.1f}); its generations would take ~{cost([m]) / 60:.1f} min "
            f"(--methods ar,{_option_name(m.name)} runs it)"
        )
        dropped.append(f"{m.name} ({rate:.1f} tok/s, ~{cost([m]) / 60:.1f} min)")
    if dropped:
        cuts.append(f"left out the peers slower than dflashkit's plain decoding: {', '.join(dropped)}")
    if over() and "max_new_tokens" not in fixed and state["max_new_tokens"] > QUICK_MIN_TOKENS:
        cuts.append(f"{QUICK_MIN_TOKENS} new tokens per turn instead of {state['max_new_tokens']}")
        state["max_new_tokens"] = QUICK_MIN_TOKENS
    sizes = state["block_sizes"]
    if over() and "block_sizes" not in fixed and "auto" in sizes and len(sizes) > 1:
        why = "left out by --quick: block size 'auto' only (the library's default)"
        left_out.update({m.name: why for m in kept() if m.block_size is not None and m.block_size != "auto"})
        others = ", ".join(str(b) for b in sizes if b != "auto")
        cuts.append(f"DFlash block size 'auto' only (the library's default), not also {others}")
        state["block_sizes"] = ["auto"]
    temps = state["temperatures"]
    if over() and "temperatures" not in fixed and len(temps) > 1 and 0.0 in temps:
        cuts.append(f"greedy only (temperature 0), not {', '.join(f'{t:g}' for t in temps)}")
        state["temperatures"] = [0.0]
    if over() and "limit" not in fixed and state["limit"] > 1:
        cuts.append(f"1 question per data set instead of {state['limit']}")
        state["limit"] = 1
    return QuickPlan(
        limit=state["limit"],
        max_new_tokens=state["max_new_tokens"],
        temperatures=state["temperatures"],
        block_sizes=state["block_sizes"],
        left_out=left_out,
        estimate_s=cost(kept()),
        budget_s=budget_s,
        full_estimate_s=full,
        cuts=cuts,
    )


def _option_name(method: str) -> str:
    """The --methods name that runs a peer."""
    if method.startswith("llama-server"):
        return "llama-server"
    return {"hf-generate": "hf", "hf-prompt-lookup": "hf-pld"}.get(method, method)


def describe(plan: QuickPlan, speeds: dict[str, Speed]) -> list[str]:
    """The lines --quick prints: the measured speeds, the preset's estimate, what was cut and why, the result."""
    measured = ", ".join(f"{name} {speed.tokens_per_s:.1f}" for name, speed in speeds.items())
    lines = [
        f"--quick: measured tokens per second after the first: {measured}",
        f"--quick: the quick preset would take ~{(plan.full_estimate_s + plan.spent_s) / 60:.1f} min here; "
        f"the budget is {QUICK_BUDGET_S / 60:.0f} min ({plan.spent_s:.0f} s of it spent loading and measuring)",
    ]
    if not plan.cuts:
        lines.append("--quick: the preset fits: nothing cut")
    lines += [f"--quick: {cut}" for cut in plan.cuts]
    chosen = (
        f"{plan.limit} question(s) per data set, {plan.max_new_tokens} new tokens, temperatures "
        f"{','.join(f'{t:g}' for t in plan.temperatures)}, block sizes {','.join(map(str, plan.block_sizes))}"
    )
    lines.append(f"--quick: running {chosen}: ~{(plan.estimate_s + plan.spent_s) / 60:.1f} min in all")
    if not plan.fits:
        lines.append(
            "--quick: that is over the budget even after every cut: this CPU is slower than --quick was sized for "
            "(set --limit, --max-new-tokens, --methods yourself to go smaller)"
        )
    return lines


def measure_speeds(methods: Sequence[Any], prompt_ids: list[int], stop: frozenset[int]) -> dict[str, Speed]:
    """Time short greedy generations, each after a warm-up: the baseline "ar" and one DFlash method (32 new tokens),
    and every peer (12: some run at a few tokens per second). A peer that fails here is not timed: the run's own
    warm-up skips it with the reason."""
    from dflashkit.bench.methods import DFlash, Request

    dflash = [m for m in methods if isinstance(m, DFlash)]
    drafting = next((m for m in dflash if m.name == "dflash-auto"), dflash[0] if dflash else None)
    timed = [(m, 32) for m in methods if m.name == BASELINE] + ([(drafting, 32)] if drafting is not None else [])
    timed += [(m, 12) for m in methods if m.family != "dflashkit"]
    speeds = {}
    for method, tokens in timed:
        try:
            method.warmup(Request(prompt_ids, 4, 0.0, 0, stop))
            t = time.perf_counter()
            record = method.generate(Request(prompt_ids, tokens, 0.0, 0, stop))
            total = time.perf_counter() - t
        except Exception:
            if method.name == BASELINE:
                raise
            continue
        n, after = record.new_tokens, record.total_s - record.ttft_s
        rate = (n - 1) / after if n > 1 and after > 0 else max(n, 1) / total
        speeds[method.name] = Speed(record.ttft_s, rate)
    return speeds


def apply_quick(
    args: Any,
    session: Any,
    methods: list[Any],
    settings: dict[str, Any],
    config: Any,
    started: float,
    log: Callable[[str], None],
    all_methods: Sequence[str] = (),
) -> tuple[list[Any], QuickPlan]:
    """Size a --quick run: measure, plan (:func:`plan_quick`), then apply the plan to `config` (a BenchConfig) and
    `settings`, and put the methods it leaves out in `methods` as skipped ones that say why; log what was chosen.
    `started`: time.perf_counter() when the command started (loading counts against the budget); `all_methods`:
    the --methods default, which a user who names methods departs from (then the methods are theirs, never cut)."""
    from dflashkit.bench.datasets import load_questions
    from dflashkit.bench.methods import DFlash, Unavailable
    from dflashkit.text import encode_chat

    fixed = {k for k in ("limit", "max_new_tokens", "temperatures", "block_sizes") if getattr(args, k) is not None}
    if args.methods != ",".join(all_methods):
        fixed.add("methods")
    runnable = [m for m in methods if not m.unavailable()]
    sized = [QuickMethod(m.name, m.family, m.block_size if isinstance(m, DFlash) else None) for m in runnable]

    counted: dict[int, int] = {}

    def prompts(limit: int) -> int:  # the turns the runner generates per temperature (its seeded subsets)
        if limit not in counted:
            sets = [load_questions(spec, limit or None, config.seed)[1] for spec in config.datasets]
            counted[limit] = sum(len(q.turns[: config.max_turns]) for qs in sets for q in qs)
        return counted[limit]

    first = load_questions(config.datasets[0], 1, config.seed)[1][0].turns[0]
    prompt_ids = encode_chat(session.tokenizer, [{"role": "user", "content": first}])
    stop = frozenset(session.eos_token_ids)
    speeds = measure_speeds(runnable, prompt_ids, stop)
    elapsed = time.perf_counter() - started
    plan = plan_quick(sized, speeds, settings, prompts, QUICK_BUDGET_S - elapsed, frozenset(fixed))
    plan.spent_s = elapsed
    for line in describe(plan, speeds):
        log(line)

    config.limit, config.max_new_tokens = plan.limit, plan.max_new_tokens
    config.temperatures = list(plan.temperatures)
    settings.update(limit=plan.limit, max_new_tokens=plan.max_new_tokens, temperatures=list(plan.temperatures))
    settings["block_sizes"] = list(plan.block_sizes)
    out = []
    for m in methods:
        if m.name in plan.left_out:
            m.close()
            m = Unavailable(m.name, m.family, plan.left_out[m.name], m.comparable, m.note)
        out.append(m)
    return out, plan
