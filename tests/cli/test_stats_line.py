"""The lines `dflashkit generate` prints after the text (text mode): figures a newcomer reads, why the text ended, the
comparison with plain decoding, and the note when the adaptive block size decoded (nearly) every step plainly. Built
here from synthetic results, so that every branch is seen."""

from __future__ import annotations

import re

from dflashkit.cli.generate import summary_lines
from dflashkit.decoding.lossless import Divergence
from dflashkit.decoding.stats import DecodeStats
from dflashkit.generator import GenerationResult


def stats(
    tokens: int, prefill: float, decode: float, steps: list[tuple[int, int]], adaptive: bool = True
) -> DecodeStats:
    """DecodeStats of `tokens` new tokens; `steps`: (drafted, accepted) per verify step."""
    s = DecodeStats(block_size=16, new_tokens=tokens, prefill_s=prefill, decode_s=decode, adaptive=adaptive)
    for drafted, accepted in steps:
        s.record_step(drafted, accepted)
    return s


def result(s: DecodeStats, finish: str = "length", prompt: int = 10, **kw) -> GenerationResult:
    return GenerationResult(
        text="x", token_ids=list(range(s.new_tokens)), from_draft=[], stats=s, finish_reason=finish,
        prompt_tokens=prompt, **kw,
    )  # fmt: skip


def test_the_stats_line_and_why_the_text_ended() -> None:
    s = stats(128, 0.1, 0.7, [(15, 2)] * 40)  # τ 3.0, 128 tokens in 0.8 s
    lines = summary_lines(result(s), True, 128, 8192)
    assert lines == [
        "128 tokens in 0.80 s, 160 tok/s · τ 3.00 tokens per target pass · stopped at --max-new-tokens 128"
    ]
    (line,) = summary_lines(result(s, "stop"), True, 256, 8192)
    assert line.endswith("· ended at end of text")
    (line,) = summary_lines(result(s, "stop", stop_string="\n\n"), True, 256, 8192)
    assert line.endswith("· stopped at '\\n\\n'")
    (line,) = summary_lines(result(s, prompt=8192 - 128), True, 500, 8192)
    assert line.endswith("· stopped at the target's context (8192 tokens)")
    plain = stats(20, 0.5, 1.5, [(0, 0)] * 19, adaptive=False)
    (line,) = summary_lines(result(plain), False, 20, 8192)
    assert line == "20 tokens in 2.00 s, 10.0 tok/s · plain decoding (no drafter) · stopped at --max-new-tokens 20"


def test_the_comparison_with_plain_decoding() -> None:
    spec = stats(33, 0.2, 0.5, [(15, 2)] * 11)  # 32 tokens after the first in 0.5 s: 64 tok/s
    ar = stats(33, 0.2, 1.0, [(0, 0)] * 32, adaptive=False)  # 32 tok/s after the prompt
    lines = summary_lines(result(spec, ar=result(ar)), True, 33, 8192)
    assert (
        lines[1]
        == "plain decoding 32.0 tok/s vs speculative 64.0 tok/s after the prompt → 2.00x faster, identical output"
    )
    slower = result(stats(33, 0.2, 2.0, [(15, 0)] * 33), ar=result(ar))
    assert "→ 2.00x slower, identical output" in summary_lines(slower, True, 33, 8192)[1]

    tie = Divergence(index=7, spec_token=5, ar_token=6, margin=0.0, max_abs_logit=12.5, tie=True)
    other = result(stats(33, 0.2, 1.0, [(0, 0)] * 32, adaptive=False))
    other.token_ids[7] = 99
    parted = result(spec, ar=other, divergence=tie)
    assert (
        "; outputs differ from token 7: speculative 5 vs plain 6, margin 0.0 at max |logit| 12.5: a numerical tie"
        in (summary_lines(parted, True, 33, 8192)[1])
    )
    sampled = result(spec, ar=other)  # rejection sampling: outputs differ, no divergence judged
    assert "outputs not compared" in summary_lines(sampled, True, 33, 8192)[1]


def test_a_mostly_plain_adaptive_run_says_so() -> None:
    plain_steps = [(0, 0)] * 18 + [(3, 1)] * 2  # 18 of 20 steps at block 1
    lines = summary_lines(result(stats(22, 0.1, 1.0, plain_steps)), True, 22, 8192)
    assert len(lines) == 2 and re.fullmatch(
        r"note: 18 of 20 steps were decoded plainly: the adaptive block size found that drafting did not pay on this "
        r"machine .*--block-size N drafts every step\)",
        lines[1],
    ), lines
    drafted = [(0, 0)] * 10 + [(3, 1)] * 10  # half drafted: no note
    assert len(summary_lines(result(stats(30, 0.1, 1.0, drafted)), True, 30, 8192)) == 1
    fixed = stats(20, 0.1, 1.0, plain_steps, adaptive=False)  # a fixed block size: the policy chose nothing
    assert len(summary_lines(result(fixed), True, 20, 8192)) == 1
    short = stats(3, 0.1, 0.1, [(0, 0)] * 2)  # too few steps to say anything
    assert len(summary_lines(result(short), True, 3, 8192)) == 1


def test_a_quantized_target_is_named() -> None:
    s = stats(10, 0.1, 0.4, [(3, 1)] * 5)
    s.target_weights = "int8 weight-only (per-channel)"
    lines = summary_lines(result(s), True, 10, 8192)
    assert lines[-1] == (
        "note: target weights int8 weight-only (per-channel): exact w.r.t. the quantized target, not the --dtype one"
    )
