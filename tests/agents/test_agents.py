"""Real coding agents against `ds4station serve`: Claude Code (Anthropic Messages), Codex CLI (Responses) and
opencode (Chat Completions), at the versions tests/agents/package.json pins, installed by `make agents` into
.agents/. Each runs one non-interactive turn with its default tools against the demo model on the CPU,
configured from the control panel's own client snippets (`client_snippets`, the source the README's setups
are printed from), offline; then the same turn again, which must reuse the live KV: the server's usage
figures (/status) show the second run's prompts served from the cache.

Without .agents/ these tests are skipped, unless DS4_AGENTS_REQUIRED is set (CI sets it): then a missing
install is a failure that says the npm registry could not be reached, never a pass.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ds4station.ports import free_port
from ds4station.tui.widgets.server_panel import client_snippets

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / ".agents" / "node_modules" / ".bin"
PINNED = json.loads((Path(__file__).with_name("package.json")).read_text())["dependencies"]
TURN_TIMEOUT = 420  # a cold first turn prefills Claude Code's ~25K-token prompt on two CPU cores

pytestmark = pytest.mark.slow


def _cli(name: str) -> Path:
    path = BIN / name
    if not path.exists():
        why = (f"{path} is missing: `make agents` did not install the agent clients (could the npm registry be "
               "reached?)")
        if os.environ.get("DS4_AGENTS_REQUIRED"):
            pytest.fail(why)
        pytest.skip(why + "; run `make agents` to run these tests")
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """`ds4station serve` on the built-in demo model (made in a private cache), as a user starts it."""
    _cli("claude")  # skip or fail before starting anything
    root = tmp_path_factory.mktemp("agents")
    port = free_port()
    env = {**os.environ, "XDG_CACHE_HOME": str(root / "cache"), "PYTHONUNBUFFERED": "1"}
    log = (root / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "ds4station.cli", "serve", "--port", str(port), "--device", "cpu"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, (root / "serve.log").read_text()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "serve was not ready in 180 s"
        time.sleep(0.2)
    model = httpx.get(url + "/status", timeout=5).json()["model"]["name"]
    try:
        yield {"url": url, "model": model, "root": root, "snippets": client_snippets(url, model, None)}
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _records(url: str) -> list[dict[str, Any]]:
    return httpx.get(url + "/status", timeout=5).json()["throughput"]["recent"]


def _run_twice(served: dict[str, Any], argv: list[str], env: dict[str, str], cwd: Path) -> list[list[dict[str, Any]]]:
    """The same turn twice; each run's finished-request records from /status."""
    runs = []
    for _ in range(2):
        seen = {r["id"] for r in _records(served["url"])}
        done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=TURN_TIMEOUT,
                              stdin=subprocess.DEVNULL)
        text = done.stdout + done.stderr
        assert done.returncode == 0, text[-3000:]
        assert "API Error" not in text and "ERROR:" not in text, text[-3000:]
        runs.append([r for r in _records(served["url"]) if r["id"] not in seen])
        assert runs[-1], f"{argv[0]} sent no request: {text[-2000:]}"
        # The agent's main request ends cleanly. A side request (opencode's title) runs beside it since
        # requests are batched, and the agent hangs up on it when it exits: cancelled, never an error.
        main = max(runs[-1], key=lambda r: r["prompt_tokens"])
        ends = [(r["id"], r["reason"], r["prompt_tokens"], r.get("error")) for r in runs[-1]]
        assert main["reason"] in ("stop", "tool_calls", "tool_use"), ends
        assert all(r["reason"] in ("stop", "tool_calls", "tool_use", "cancelled") for r in runs[-1]), ends
    return runs


def _assert_reused(runs: list[list[dict[str, Any]]]) -> None:
    """The second run's biggest prompt (the agent's main request: system prompt, tools, the task) was served
    from the live KV: all of it but the last token or so."""
    main = max(runs[1], key=lambda r: r["prompt_tokens"])
    assert main["prompt_tokens"] > 2000, main  # a real agent's prompt, tokenised by the demo vocabulary
    assert main["cached_tokens"] >= main["prompt_tokens"] - 64, runs


def _env(served: dict[str, Any], **extra: str) -> dict[str, str]:
    home = served["root"] / "home"
    home.mkdir(exist_ok=True)
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "TERM") if k in os.environ}
    return {**keep, "HOME": str(home), "NO_COLOR": "1", **extra}


def _version(cli: Path) -> str:
    return subprocess.run([str(cli), "--version"], capture_output=True, text=True, timeout=60).stdout


def test_claude_code_runs_a_turn_and_reuses_its_prefix(served: dict[str, Any], tmp_path: Path) -> None:
    cli = _cli("claude")
    assert PINNED["@anthropic-ai/claude-code"] in _version(cli)
    words = shlex.split(served["snippets"]["Claude Code"])  # ANTHROPIC_BASE_URL=... ... claude
    assert words[-1] == "claude"
    env = _env(served, **dict(w.split("=", 1) for w in words[:-1]), DISABLE_TELEMETRY="1",
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
    runs = _run_twice(served, [str(cli), "-p", "Say hello.", "--output-format", "json"], env, tmp_path)
    assert all(r["kind"] == "messages" for run in runs for r in run)
    _assert_reused(runs)


def test_codex_runs_a_turn_and_reuses_its_prefix(served: dict[str, Any], tmp_path: Path) -> None:
    cli = _cli("codex")
    assert PINNED["@openai/codex"] in _version(cli)
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(served["snippets"]["Codex"])
    env = _env(served, CODEX_HOME=str(home))
    runs = _run_twice(served, [str(cli), "exec", "--skip-git-repo-check", "Say hello."], env, tmp_path)
    assert all(r["kind"] == "responses" for run in runs for r in run)
    _assert_reused(runs)


def test_opencode_runs_a_turn_and_reuses_its_prefix(served: dict[str, Any], tmp_path: Path) -> None:
    cli = _cli("opencode")
    assert PINNED["opencode-ai"] in _version(cli)
    config = tmp_path / "opencode.json"
    config.write_text(served["snippets"]["opencode"])
    env = _env(served, OPENCODE_CONFIG=str(config), OPENCODE_DISABLE_AUTOUPDATE="1",
               OPENCODE_DISABLE_MODELS_FETCH="1")
    runs = _run_twice(served, [str(cli), "run", "Say hello."], env, tmp_path)
    assert all(r["kind"] == "chat" for run in runs for r in run)
    _assert_reused(runs)
