"""README's command table is the parser: every flag a row shows exists on its command, and every flag of every
command is written somewhere in the README (the guide: document every command and flag users touch)."""

import argparse
import re
from pathlib import Path

from ds4station.cli import COMMANDS, build_parser

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _options() -> dict[str, set[str]]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {o for a in p._actions if a.help != argparse.SUPPRESS
                   for o in a.option_strings if o.startswith("--") and o != "--help"}
            for name, p in sub.choices.items()}


def _table_rows() -> list[tuple[str, str]]:
    """(command, the row's first cell) of the Commands table."""
    section = README.split("## Commands", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        m = re.match(r"\| `ds4station ([^`]*)`", line)
        if m:
            words = [w for w in m.group(1).split() if re.fullmatch(r"[a-z][a-z-]*", w)]
            cmd = words[0] if words and words[0] in COMMANDS else "tui"
            rows.append((cmd, line.split(" | ")[0]))
    return rows


def test_every_command_has_a_row_and_every_row_flag_exists() -> None:
    """Each subcommand has a row of the Commands table, and every `--flag` a row shows is one of its command's."""
    options = _options()
    rows = _table_rows()
    assert {cmd for cmd, _ in rows} == set(COMMANDS)
    for cmd, cell in rows:
        for flag in re.findall(r"--[a-z][a-z0-9-]*", cell):
            assert flag in options[cmd], f"README shows `{flag}` for `ds4station {cmd}`, which has no such flag"


def test_every_flag_is_documented() -> None:
    """Every flag of every command (but those argparse hides) is written somewhere in the README."""
    missing = sorted(f"{cmd} {flag}" for cmd, flags in _options().items() for flag in flags
                     if not re.search(re.escape(flag) + r"(?![a-z0-9-])", README))
    assert not missing, f"flags the README never mentions: {missing}"


def test_every_environment_variable_is_documented() -> None:
    """Every DS4STATION_* variable the package reads is written in the README."""
    package = Path(__file__).resolve().parent.parent / "ds4station"
    names = {n for f in package.rglob("*.py") for n in re.findall(r"DS4STATION_[A-Z0-9_]+", f.read_text())}
    assert names and not sorted(n for n in names if n not in README)
