"""The server panel: state (starting, loading with per-stage progress, ready, crashed with its last log
lines), the API endpoint and key; and the clients panel: ready-to-copy settings for opencode, Claude Code
and Codex."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text
from textual.widgets import Static

from ..launcher import error_lines
from ..messages import ServerView, StageLoad
from ..telemetry import bar

GiB = 1 << 30

_STATE_STYLE = {"ready": "bold green", "loading": "bold yellow", "starting": "yellow", "crashed": "bold red",
                "error": "bold red", "stopped": "dim"}


# The clients the panel gives settings for: key -> (name, the file it goes in, the snippet's format)
CLIENTS = {"1": ("opencode", "opencode.json", "json"), "2": ("Claude Code", "claude-code.sh", "shell"),
           "3": ("Codex", "codex-config.toml", "toml")}


def client_snippets(base_url: str, model: str, api_key: str | None) -> dict[str, str]:
    """Copy-paste settings, each valid as printed (tests parse them): opencode's config (JSON, an
    OpenAI-compatible provider), the shell line that starts Claude Code on the Anthropic API, and Codex's
    ~/.codex/config.toml (the Responses API, web search off: the server refuses OpenAI's hosted tools by
    name; the key read from DS4_API_KEY)."""
    import json
    import shlex

    options: dict[str, str] = {"baseURL": f"{base_url}/v1"}
    if api_key:
        options["apiKey"] = api_key
    opencode = {"$schema": "https://opencode.ai/config.json", "model": f"ds4/{model}",
                "provider": {"ds4": {"npm": "@ai-sdk/openai-compatible", "name": "ds4station", "options": options,
                                     "models": {model: {"name": model}}}}}
    env = {"ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_AUTH_TOKEN": api_key or "none", "ANTHROPIC_MODEL": model}
    claude = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " claude"
    codex = [f"model = {json.dumps(model)}", 'model_provider = "ds4"',
             'web_search = "disabled"  # a tool OpenAI runs on its own servers: this server has none', "",
             "[model_providers.ds4]",
             'name = "ds4station"', f"base_url = {json.dumps(base_url + '/v1')}", 'wire_api = "responses"']
    if api_key:
        codex.append('env_key = "DS4_API_KEY"  # export DS4_API_KEY=<the key> before `codex`')
    return {"opencode": json.dumps(opencode, indent=2), "Claude Code": claude, "Codex": "\n".join(codex)}


def _loading(stages: list[StageLoad]) -> list[Text]:
    """One line per stage: a bar of bytes loaded when the server reports them, else loading/loaded."""
    out = []
    for st in stages:
        line = Text(f"  stage {st.label}: ")
        if st.done:
            line.append(f"loaded ({st.weights_bytes / GiB:.2f} GiB)", style="green")
        elif st.loaded_bytes is not None and st.weights_bytes:
            frac = st.loaded_bytes / st.weights_bytes
            line.append(bar(frac, 10), style="yellow")
            line.append(f" {st.loaded_bytes / GiB:.2f}/{st.weights_bytes / GiB:.2f} GiB ({frac:.0%})")
        else:
            line.append(f"loading {st.weights_bytes / GiB:.2f} GiB of weights…", style="yellow")
        out.append(line)
    return out


class ServerPanel(Static):
    def show(self, view: ServerView | None) -> None:
        self.update(self.render_view(view))

    @staticmethod
    def render_view(view: ServerView | None) -> RenderableType:
        if view is None:
            return Text.assemble(("no server running", "dim"), " — press ", ("l", "bold"),
                                 " to launch the current plan")
        head = Text.assemble(("● ", _STATE_STYLE.get(view.state, "")), (view.state, _STATE_STYLE.get(view.state, "")),
                             f"  pid {view.pid}" if view.pid else "",
                             f"  up {view.uptime_s:.0f}s" if view.state != "stopped" else "")
        parts: list[RenderableType] = [head]
        if view.state in ("crashed", "error"):
            parts.append(Text(view.reason or "", style="red"))
            lines = error_lines(view.log_tail)
            parts.append(Text("the server's traceback:" if lines and lines[0].startswith("Traceback")
                              else "last log lines:", style="bold"))
            parts += [Text("  " + line, style="dim", overflow="fold") for line in lines]
            return Group(*parts)
        if view.state in ("starting", "loading"):
            parts.append(Text(view.reason or "", style="dim"))
            parts += _loading(view.stages)
            return Group(*parts)
        if view.state == "stopped":
            parts.append(Text((view.reason or "") + "; every process of it has exited. l launches again.", style="dim"))
            return Group(*parts)
        parts.append(Text.assemble(("API  ", "bold"), f"{view.base_url}/v1", ("  OpenAI, Responses", "dim")))
        parts.append(Text.assemble(("     ", "bold"), view.base_url, ("  Anthropic", "dim")))
        parts.append(Text.assemble(("key  ", "bold"), view.api_key or "none (listening on this machine only)"))
        keys = "  ".join(f"{k} {name}" for k, (name, _, _) in CLIENTS.items())
        parts.append(Text.assemble(("copy ", "bold"), keys, ("  (settings under Clients)", "dim")))
        return Group(*parts)


class ClientsPanel(Static):
    """The running server's settings for each client, as printed valid JSON / shell / TOML, with its copy key."""

    def show(self, view: ServerView | None) -> None:
        if view is None or view.state != "ready":
            self.update(Text("the client settings appear here once a server is ready (l launches one)", style="dim"))
            return
        model = ((view.status or {}).get("model") or {}).get("name") or "ds4"
        snippets = client_snippets(view.base_url, model, view.api_key)
        parts: list[RenderableType] = []
        for key, (name, _, _) in CLIENTS.items():
            parts.append(Text.assemble((f"{name}", "bold"), (f"  (press {key} to copy)", "dim")))
            parts += [Text("  " + line, overflow="fold") for line in snippets[name].splitlines()]
        self.update(Group(*parts))
