"""Token counts on the command line: `--ctx 32K`, `--ctx 1M` are accepted everywhere a context is taken,
garbage is refused by argparse naming the accepted forms, and `serve` refuses a context beyond the model's
limit before anything is bound."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ds4station.cli import build_parser
from ds4station.engine.demo import make_model
from ds4station.model.config import TINY


@pytest.mark.parametrize(("argv", "want"), [
    (["serve", "--ctx", "32K"], 32768),
    (["serve", "--ctx", "4096"], 4096),
    (["generate", "--prompt", "hi", "--ctx", "1M"], 1 << 20),
    (["generate", "--prompt", "hi", "--ctx", "8k"], 8192),
    (["plan", "--ctx", "1M"], 1048576),
    (["plan", "--ctx", " 64K "], 65536),
])
def test_ctx_takes_token_counts(argv: list[str], want: int) -> None:
    args = build_parser().parse_args(argv)
    assert args.ctx == want and type(args.ctx) is int


def test_other_token_flags_take_the_same_forms() -> None:
    args = build_parser().parse_args(["serve", "--max-tokens", "2K", "--rollback", "1K", "--prefill-chunk", "512"])
    assert (args.max_tokens, args.rollback, args.prefill_chunk) == (2048, 1024, 512)
    assert build_parser().parse_args(["serve"]).ctx is None  # the model's own limit decides later


@pytest.mark.parametrize("command", ["serve", "generate", "plan"])
@pytest.mark.parametrize("bad", ["lots", "1.5K", "32KB", "-5", "1G", ""])
def test_ctx_garbage_exits_2_naming_the_forms(command: str, bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([command, f"--ctx={bad}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--ctx" in err and "not a token count" in err and repr(bad) in err
    assert "32768" in err and "32K" in err and "1M" in err


def test_serve_refuses_a_context_beyond_the_model_before_binding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import ds4station.server.app as server_app
    from ds4station.commands import serve

    model = make_model(tmp_path / "tiny.gguf")
    assert TINY.context_length == 4096

    def no_server(*a: object, **k: object) -> None:  # only proves it is never reached
        raise AssertionError("the server was started, for a context the model cannot take")

    monkeypatch.setattr(server_app, "serve", no_server)
    args = build_parser().parse_args(["serve", "--model", str(model), "--ctx", "8K", "--port", "1"])
    t0 = time.monotonic()
    assert serve.run(args) == 2
    assert time.monotonic() - t0 < 30  # refused from the header, no weights loaded
    err = capsys.readouterr().err
    assert "--ctx 8192 is outside this model's context" in err and "4,096" in err
    # the same file with a context it can take gets as far as starting the server (which is then refused here)
    args = build_parser().parse_args(["serve", "--model", str(model), "--ctx", "4K", "--port", "1", "--device", "cpu"])
    with pytest.raises(AssertionError, match="the server was started"):
        serve.run(args)
