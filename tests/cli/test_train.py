"""`dflashkit data`, `train` and `ngram-store` as a newcomer meets them, at the parser: presets fill in only the options
left out, --resume/--no-resume, a help text for every option, and next-step commands that parse with today's CLI."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dflashkit.cli import train as train_cli
from dflashkit.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def subparser(name: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


# ---- presets ------------------------------------------------------------------------------------------------


def test_the_smoke_preset_fills_in_the_options_left_out() -> None:
    args = parse("train", "--preset", "smoke", "--data", "D")
    applied = train_cli.apply_preset(args, train_cli.TRAIN_PRESETS)
    smoke = train_cli.TRAIN_PRESETS["smoke"]
    assert applied == smoke
    assert (args.layers, args.steps, args.anchors, args.seqs_per_step) == (
        smoke["layers"],
        smoke["steps"],
        smoke["anchors"],
        smoke["seqs_per_step"],
    )
    assert (args.draft_vocab, args.max_seq_len, args.eval_every) == (
        smoke["draft_vocab"],
        smoke["max_seq_len"],
        smoke["eval_every"],
    )
    # smaller than the defaults in every setting that sets a step's cost or the run's length
    default = train_cli.TRAIN_PRESETS["default"]
    for name in ("steps", "anchors", "seqs_per_step", "draft_vocab", "max_seq_len"):
        assert smoke[name] < default[name], name


@pytest.mark.parametrize("before", [True, False], ids=["flags-before-preset", "flags-after-preset"])
def test_options_given_win_over_the_preset_whatever_their_order(before: bool) -> None:
    flags = ["--steps", "2000", "--anchors", "7", "--layers", "2"]  # 2000: the default's value, given on purpose
    argv = [*flags, "--preset", "smoke"] if before else ["--preset", "smoke", *flags]
    args = parse("train", *argv)
    applied = train_cli.apply_preset(args, train_cli.TRAIN_PRESETS)
    assert (args.steps, args.anchors, args.layers) == (2000, 7, 2)
    assert "steps" not in applied and "anchors" not in applied and "layers" not in applied
    assert args.seqs_per_step == train_cli.TRAIN_PRESETS["smoke"]["seqs_per_step"]  # not given: the preset's


def test_the_default_preset_is_the_options_own_defaults() -> None:
    args = parse("train")
    assert args.preset == "default"
    before = vars(args).copy()
    train_cli.apply_preset(args, train_cli.TRAIN_PRESETS)
    assert vars(args) == before
    for name, value in train_cli.TRAIN_PRESETS["default"].items():
        assert before[name] == value, name
    assert (args.steps, args.anchors, args.seqs_per_step, args.max_seq_len, args.lr) == (2000, 32, 8, 768, 6e-4)


def test_a_preset_leaves_the_depth_of_an_init_drafter_alone() -> None:
    args = parse("train", "--preset", "smoke", "--init", "SOME-DRAFTER")
    applied = train_cli.apply_preset(args, train_cli.TRAIN_PRESETS)
    assert args.layers is None and "layers" not in applied  # the trainer takes the --init drafter's depth
    assert args.steps == train_cli.TRAIN_PRESETS["smoke"]["steps"]


def test_the_data_smoke_preset() -> None:
    args = parse("data", "--preset", "smoke", "--max-new-tokens", "32")
    train_cli.apply_preset(args, train_cli.DATA_PRESETS)
    assert (args.num_prompts, args.max_new_tokens) == (train_cli.DATA_PRESETS["smoke"]["num_prompts"], 32)
    args = parse("data")
    train_cli.apply_preset(args, train_cli.DATA_PRESETS)
    assert (args.num_prompts, args.max_new_tokens) == (1024, 256)


def test_an_unknown_preset_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse("train", "--preset", "tiny")
    assert e.value.code == 2 and "invalid choice: 'tiny'" in capsys.readouterr().err


# ---- resuming -----------------------------------------------------------------------------------------------


def test_resume_is_on_by_default_and_both_spellings_parse() -> None:
    assert parse("train").resume is True
    assert parse("train", "--resume").resume is True  # was refused with the top-level usage
    assert parse("train", "--no-resume").resume is False
    (action,) = [a for a in subparser("train")._actions if a.dest == "resume"]
    assert action.option_strings == ["--resume", "--no-resume"]
    assert "re-running the same command resumes" in action.help and "--no-resume starts over" in action.help


# ---- help ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["data", "train", "ngram-store"])
def test_every_option_has_a_help_text(command: str) -> None:
    missing = [
        a.option_strings[0]
        for a in subparser(command)._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()
    ]
    assert not missing, f"dflashkit {command}: no help for {missing}"


@pytest.mark.parametrize("command", ["data", "train", "ngram-store"])
def test_an_option_without_a_default_value_says_what_decides_it(command: str) -> None:
    """None is left only where something decided later sets the value; the help says what."""
    unsaid = [
        a.option_strings[0]
        for a in subparser(command)._actions
        if a.option_strings
        and not a.required
        and a.default is None
        and a.nargs != 0
        and not any(word in (a.help or "") for word in ("default", "with --"))
    ]
    assert not unsaid, f"dflashkit {command}: None defaults without a word on what decides them: {unsaid}"


def test_train_help_states_the_defaults_and_the_smoke_values() -> None:
    text = " ".join(subparser("train").format_help().split())
    for flag, default, smoke in (
        ("--steps", "2000", "60"),
        ("--anchors", "32", "4"),
        ("--seqs-per-step", "8", "4"),
        ("--max-seq-len", "768", "256"),
    ):
        assert f"(default: {default}; smoke preset: {smoke})" in text, flag
    assert "a few minutes on 2 CPU cores" in text


def test_the_parser_defaults_match_the_modules_they_stand_for() -> None:
    """cli/train.py names these values so that its parser needs no torch; they must stay the modules' own."""
    from dflashkit.drafter import ngram_store
    from dflashkit.target.loading import DEFAULT_TARGET

    assert train_cli.EMBEDDED_TARGET == DEFAULT_TARGET
    assert (train_cli.NGRAM_N, train_cli.NGRAM_MIN_COUNT, train_cli.NGRAM_MAX_DRAFT) == (
        ngram_store.DEFAULT_N,
        ngram_store.DEFAULT_MIN_COUNT,
        ngram_store.DEFAULT_MAX_DRAFT,
    )
    args = parse("ngram-store", "--data", "D", "--out", "O")
    assert (args.n, args.min_count, args.max_draft) == (3, 2, 7)


# ---- what the commands say before and after ---------------------------------------------------------------------


def test_a_cpu_run_at_the_default_settings_is_told_how_to_make_it_short() -> None:
    args = parse("train")
    hint = train_cli._train_hint(args, train_cli.apply_preset(args, train_cli.TRAIN_PRESETS), "cpu")
    assert hint and "--preset smoke" in hint and "--time-budget" in hint and "2000 steps" in hint
    assert train_cli._train_hint(args, {}, "cpu", resuming=True) is None  # resuming: the user chose
    assert train_cli._train_hint(args, {}, "cuda") is None
    args = parse("train", "--steps", "50")
    assert train_cli._train_hint(args, train_cli.apply_preset(args, train_cli.TRAIN_PRESETS), "cpu") is None
    args = parse("train", "--preset", "smoke", "--steps", "50")
    hint = train_cli._train_hint(args, train_cli.apply_preset(args, train_cli.TRAIN_PRESETS), "cpu")
    assert hint.startswith("--preset smoke:") and "--anchors 4" in hint and "--steps" not in hint


def dflashkit_lines(text: str) -> list[list[str]]:
    """The commands a next-steps message shows, as words (a trailing `# comment` dropped)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(("dflashkit ", "python ")):
            lexer = shlex.shlex(line, posix=True)
            lexer.whitespace_split, lexer.commenters = True, "#"
            out.append(list(lexer))
    return out


def _eval_drafter_help() -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "eval_drafter.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-500:]
    return done.stdout


@pytest.mark.parametrize("target", [None, "Qwen/Qwen3-8B"])
def test_the_next_steps_after_training_are_commands_that_parse(tmp_path: Path, target: str | None) -> None:
    drafter, data = tmp_path / "a run" / "drafter", str(tmp_path / "data")
    drafter.mkdir(parents=True)  # --drafter and export's folder are checked while parsing
    text = train_cli.train_next_steps(drafter, data, target)
    assert str(drafter) in text.splitlines()[0]
    lines = dflashkit_lines(text)
    commands = {words[1]: words for words in lines}
    assert set(commands) == {"generate", "ngram-store", "scripts/eval_drafter.py", "export"}
    for words in lines:
        if words[0] == "dflashkit":
            args = build_parser().parse_args(words[1:])  # exits (fails the test) on a flag the CLI lacks
            if args.command != "ngram-store":  # the commands that load the target name it, unless embedded
                assert args.target == target, words
    generate = build_parser().parse_args(commands["generate"][1:])
    assert generate.compare_ar and Path(generate.drafter) == drafter  # the quoted path with its space survives
    store = build_parser().parse_args(commands["ngram-store"][1:])
    assert (store.data, Path(store.out)) == (data, drafter)
    export = build_parser().parse_args(commands["export"][1:])
    assert export.format == "hf" and Path(export.drafter) == drafter
    script = commands["scripts/eval_drafter.py"]
    assert script[0] == "python" and script[script.index("--drafter") + 1] == str(drafter)
    if target is None:  # the script's flags exist (checked once)
        help_text = _eval_drafter_help()
        assert all(w in help_text for w in script if w.startswith("--"))


def test_the_next_steps_after_data_and_ngram_store_parse(tmp_path: Path) -> None:
    out = tmp_path / "my data"
    text = train_cli.data_next_steps(out, None, 16)
    assert "16 answers" in text and str(out) in text
    lines = dflashkit_lines(text)
    assert len(lines) == 2
    for words in lines:
        args = build_parser().parse_args(words[1:])
        assert args.command == "train" and Path(args.data) == out
    assert [w for w in lines[1] if w.startswith("--preset")] == ["--preset"]
    (only,) = dflashkit_lines(train_cli.data_next_steps(out, "Qwen/Qwen3-8B", 16, preset="smoke"))
    args = build_parser().parse_args(only[1:])
    assert args.preset == "smoke" and args.target == "Qwen/Qwen3-8B"
    (tmp_path / "d").mkdir()
    (generate,) = dflashkit_lines(train_cli.ngram_store_next_steps(tmp_path / "d", "smollm2-135m-instruct"))
    args = build_parser().parse_args(generate[1:])
    assert args.command == "generate" and Path(args.drafter) == tmp_path / "d" and args.target is None
