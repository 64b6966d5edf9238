"""Write the command-line reference page, docs/cli.md, from the `dflashkit` argument parser itself.

Every subcommand of ``dflashkit.cli.main.build_parser()`` gets a section: what it does, a synopsis, and a table of
its arguments in the parser's order (grouped as ``--help`` groups them): every flag with its aliases, its value
(metavar or choices), its default as the parser holds it ("—" for none) and its help text. The page is a pure
function of the parser: defaults read from the environment (``$DFLASHKIT_API_KEY``) are left out while it is built,
so every machine writes the same page.

    python scripts/cli_reference.py                          # print the page
    python scripts/cli_reference.py --write docs/cli.md      # rewrite the page
    python scripts/cli_reference.py --check docs/cli.md      # exit 1 if the page is out of date

``tests/test_cli_reference.py`` runs the check.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# environment variables that CLI defaults may be read from: cleared while the parser is built
ENVIRONMENT_PREFIXES = ("DFLASHKIT_", "OPENAI_", "ANTHROPIC_")
NONE = "—"


def build_parser_without_environment() -> argparse.ArgumentParser:
    """``dflashkit.cli.main.build_parser()``, built with no ``DFLASHKIT_*`` (etc.) variables in the environment."""
    sys.path.insert(0, str(ROOT))
    from dflashkit.cli.main import build_parser

    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(ENVIRONMENT_PREFIXES)}
    try:
        return build_parser()
    finally:
        os.environ.update(saved)


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of every subcommand, in the parser's order."""
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {choice.dest: choice.help or "" for choice in sub._choices_actions}
    return [(name, helps.get(name, ""), p) for name, p in sub.choices.items()]


CODE_SPAN = re.compile(r"(`[^`]*`)")


def _escaped(text: str, table: bool) -> str:
    """``text`` on one line with ``<`` (and in a table ``|``) escaped outside code spans, where Markdown would read
    them as HTML or a cell border; inside a code span both are literal already."""
    out = []
    for part in CODE_SPAN.split(re.sub(r"\s+", " ", text).strip()):
        if not CODE_SPAN.fullmatch(part):
            part = part.replace("<", "&lt;")
            if table:
                part = part.replace("|", "\\|")
        out.append(part)
    return "".join(out)


def cell(text: str) -> str:
    """Text for a Markdown table cell."""
    return _escaped(text, table=True)


def prose(text: str) -> str:
    """Text for a Markdown paragraph."""
    return _escaped(text, table=False)


def sentence(text: str) -> str:
    text = text.strip()
    if not text:
        return text
    text = text[0].upper() + text[1:]
    return text if text.endswith((".", "!", "?")) else text + "."


def _lower_first(text: str) -> str:
    text = text.strip().rstrip(".")
    return text[:1].lower() + text[1:]


def code(value: object) -> str:
    return "`" + str(value).replace("`", "'") + "`"


def flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return code(positional_name(action))
    return ", ".join(code(s) for s in action.option_strings)


def positional_name(action: argparse.Action) -> str:
    return str(action.metavar or action.dest.upper())


def takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def value(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    """What the argument takes: its choices, else its metavar as ``--help`` shows it; "flag" for none."""
    if not action.option_strings:
        return "positional"
    if not takes_value(action):
        return "flag"
    if action.choices is not None and action.metavar is None:
        return " \\| ".join(code(c) for c in action.choices)
    metavar = formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
    return code(metavar)


def default(action: argparse.Action) -> str:
    """The default as the parser holds it: "required", "—" for none, "off" for a flag not given."""
    if action.required:
        return "required"
    d = action.default
    if isinstance(action, argparse.BooleanOptionalAction):
        if d is None:
            return NONE
        on, off = action.option_strings[0], next(s for s in action.option_strings if s.startswith("--no-"))
        return code(on if d else off)
    if not takes_value(action):  # store_true / store_false / store_const / count: the flag is not given
        return "off"
    if d is None or d == "" or d == [] or d is argparse.SUPPRESS:
        return NONE
    if isinstance(d, (list, tuple)):
        return ", ".join(code(x) for x in d)
    return code(d)


def help_text(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    """The option's help as written (a plain formatter: the command's own appends the default, which this page
    shows in its own column)."""
    if not action.help:
        return NONE
    return cell(argparse.HelpFormatter(formatter._prog)._expand_help(action))


def synopsis(name: str, parser: argparse.ArgumentParser) -> str:
    """``dflashkit NAME`` with its positional arguments and required options, then ``[options]``."""
    formatter = parser._get_formatter()
    words = ["dflashkit", name]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if not action.option_strings:
            words.append(formatter._format_args(action, positional_name(action)))
        elif action.required:
            words.append(f"{action.option_strings[0]} {value_words(action, formatter)}")
    words.append("[options]")
    return " ".join(words)


def value_words(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    return formatter._format_args(action, formatter._get_default_metavar_for_optional(action))


def options_table(actions: list[argparse.Action], formatter: argparse.HelpFormatter) -> list[str]:
    lines = ["| Option | Value | Default | Description |", "| --- | --- | --- | --- |"]
    for action in actions:
        lines.append(
            f"| {flags(action)} | {value(action, formatter)} | {default(action)} | {help_text(action, formatter)} |"
        )
    return lines


def section(name: str, summary: str, parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    lines = [f"## dflashkit {name}", ""]
    if summary:
        lines += [prose(sentence(summary)), ""]
    if parser.description:
        lines += [prose(parser.description.replace("%(prog)s", parser.prog)), ""]
    lines += ["```text", synopsis(name, parser), "```", ""]
    main_actions: list[argparse.Action] = []
    groups: list[tuple[str, list[argparse.Action]]] = []
    for group in parser._action_groups:
        actions = [
            a for a in group._group_actions if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS
        ]
        if not actions:
            continue
        if group.title in ("positional arguments", "options", "optional arguments"):
            main_actions += actions
        else:
            groups.append((group.title or "", actions))
    if main_actions:
        lines += options_table(main_actions, formatter) + [""]
    for title, actions in groups:
        lines += [f"### {sentence(title).rstrip('.')}", ""]
        group = next(g for g in parser._action_groups if g.title == title)
        if group.description:
            lines += [prose(sentence(group.description)), ""]
        lines += options_table(actions, formatter) + [""]
    return lines


def render(parser: argparse.ArgumentParser) -> str:
    commands = subcommands(parser)
    lines = [
        "# Command line reference",
        "",
        "<!-- Generated by scripts/cli_reference.py from the argument parser: edit the CLI, then run",
        "     python scripts/cli_reference.py --write docs/cli.md -->",
        "",
        f"`dflashkit` ({prose(_lower_first(parser.description or ''))}) has the commands below. This page lists "
        "every option of each, generated from the parser itself by `scripts/cli_reference.py` "
        "(`python scripts/cli_reference.py --check docs/cli.md` fails when the page is out of date); "
        "`dflashkit COMMAND --help` prints the same in a terminal.",
        "",
        f"In the tables, *Default* is the value the parser holds when the option is not given: {NONE} means none "
        "(the help text then says what happens), *off* a flag that is not given, *required* an argument that must "
        "be given. Every command also takes `-h`, `--help`.",
        "",
        "| Command | What it does |",
        "| --- | --- |",
    ]
    for name, summary, _ in commands:
        lines.append(f"| [`dflashkit {name}`](#dflashkit-{name}) | {cell(sentence(summary))} |")
    lines.append("")
    for name, summary, sub in commands:
        lines += section(name, summary, sub)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", metavar="PATH", type=Path, help="write the page to PATH")
    mode.add_argument("--check", metavar="PATH", type=Path, help="exit 1 if PATH differs from the page")
    args = parser.parse_args(argv)

    page = render(build_parser_without_environment())
    if args.write is not None:
        args.write.write_text(page, encoding="utf-8")
        return 0
    if args.check is not None:
        current = args.check.read_text(encoding="utf-8") if args.check.is_file() else None
        if current != page:
            print(
                f"{args.check} is out of date; run python scripts/cli_reference.py --write {args.check}",
                file=sys.stderr,
            )
            return 1
        return 0
    sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
