"""The `ds4station` entry point: every subcommand registered, and the control panel as the default."""

from __future__ import annotations

import pytest

from ds4station import cli


def test_every_command_builds_its_parser() -> None:
    parser = cli.build_parser()
    for name in cli.COMMANDS:
        with pytest.raises(SystemExit) as e:
            parser.parse_args([name, "--help"])
        assert e.value.code == 0


def test_bare_options_go_to_the_control_panel(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_run(args):  # the real panel needs a terminal; this checks what it would be given
        seen.update(vars(args))
        return 0

    import ds4station.commands.tui as tui

    monkeypatch.setattr(tui, "run", fake_run)
    assert cli.main(["--port", "8123", "--preset", "context"]) == 0
    assert seen["command"] == "tui" and seen["port"] == 8123 and seen["preset"] == "context"
    seen.clear()
    assert cli.main([]) == 0 and seen["command"] == "tui"
