"""The control panel (`ds4station` with no arguments, or `ds4station tui`): detect, plan, launch, watch.

Options exist for fake hardware and for choosing what to plan; a bare `ds4station` passes a Namespace
without them, so run() reads every option with a default.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="PATH", help="a DS4 GGUF to plan and serve (default: the built-in demo model)")
    src.add_argument("--shape", metavar="NAME", help="plan a named shape without its file (flash-q2, flash-f16, ...): "
                     "the plan is shown, nothing can be launched")
    p.add_argument("--preset", default="speed", metavar="speed|context", help="planner preset (default speed)")
    p.add_argument("--sysfs-root", default="/", metavar="PATH",
                   help="read AMD sysfs under PATH (e.g. tests/fixtures/sysfs/gfx906-workstation for fake cards)")
    p.add_argument("--no-nvml", action="store_true", help="do not query NVIDIA GPUs")
    p.add_argument("--host-ram", metavar="SIZE", help="system RAM the planner may use (default: this machine's)")
    p.add_argument("--host", default="127.0.0.1", help="address launched servers listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port for launched servers (default: a free one)")
    p.add_argument("--api-key", default=os.environ.get("DS4_API_KEY"),
                   help="API key launched servers require (default $DS4_API_KEY; none on 127.0.0.1 is fine)")
    p.add_argument("--refresh", type=float, default=1.0, metavar="SECONDS", help="refresh interval (default 1)")
    p.add_argument("--serve-args", default="", metavar="'FLAGS'",
                   help="more `ds4station serve` flags for the servers the panel launches, e.g. '--draft lookup "
                        "--kv-disk-dir ~/.cache/ds4station/kv' (the plan sets the route, context, sessions, chunk, "
                        "rollback and KV dtype; --host, --port and --api-key are the panel's own)")


# serve flags the panel sets itself (from its own options and the plan's launch file)
PANEL_FLAGS = ("--plan", "--model", "--host", "--port", "--api-key", "--parent-pid", "--route", "--ctx", "--sessions",
               "--prefill-chunk", "--rollback", "--expert-cache")


def serve_extra(text: str) -> list[str]:
    """The --serve-args words, checked against `serve`'s own parser (a bad flag is said now, not when the
    launched server exits); flags the panel or the plan set are refused by name."""
    import shlex

    from ds4station.commands import serve

    words = shlex.split(text)
    taken = [w.split("=", 1)[0] for w in words if w.split("=", 1)[0] in PANEL_FLAGS]
    if taken:
        raise ValueError(f"--serve-args: {', '.join(taken)} is set by the panel or its plan; leave it out")
    parser = argparse.ArgumentParser(prog="ds4station serve", add_help=False, exit_on_error=False)
    serve.add_arguments(parser)
    try:
        _, unknown = parser.parse_known_args(words)
    except (argparse.ArgumentError, SystemExit) as e:
        raise ValueError(f"--serve-args {text!r}: {e}") from None
    if unknown:
        raise ValueError(f"--serve-args: `ds4station serve` has no {' '.join(unknown)}")
    return words


def _exit_on(signum: int, frame: object) -> None:
    # SystemExit unwinds the app and runs the launcher's atexit hook, which stops any server we started;
    # the default action of SIGTERM/SIGHUP (closing the terminal) would skip it and orphan the server.
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    import signal

    from ds4station.model.sizes import parse_size
    from ds4station.planner import PresetError, load_preset
    from ds4station.tui.app import Ds4StationApp

    try:  # fail here with a message, not inside the running app
        load_preset(getattr(args, "preset", "speed"))
        if getattr(args, "shape", None):
            from ds4station.planner import named_shape

            named_shape(args.shape)
        if getattr(args, "model", None):  # a file that cannot be served is said now, not planned as the demo
            from ds4station.model.gguf import GGUFFile

            GGUFFile.open(args.model)
        host_ram = getattr(args, "host_ram", None)
        host_ram_bytes = parse_size(host_ram) if host_ram else None
        extra = serve_extra(getattr(args, "serve_args", "") or "")
    except (PresetError, ValueError, OSError) as e:
        print(f"ds4station: {e}", file=sys.stderr)
        return 2

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on)

    app = Ds4StationApp(
        sysfs_root=getattr(args, "sysfs_root", "/"), use_nvml=not getattr(args, "no_nvml", False),
        host_ram=host_ram_bytes, model_path=getattr(args, "model", None), model_shape=getattr(args, "shape", None),
        preset=getattr(args, "preset", "speed"), poll_interval=getattr(args, "refresh", 1.0),
        host=getattr(args, "host", "127.0.0.1"), port=getattr(args, "port", None),
        api_key=getattr(args, "api_key", None) or os.environ.get("DS4_API_KEY"), serve_extra=extra,
    )
    app.run()
    return int(app.return_code or 0)
