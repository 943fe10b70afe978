"""The `ds4station` command: the control panel by default, and one subcommand per tool.

Each subcommand lives in ds4station/commands/ exposing `add_arguments(parser)` and `run(args) -> int`;
those modules import heavy packages (torch, textual, fastapi) only inside run(), so building the parser is
cheap and `ds4station detect` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# The CUDA caching allocator maps memory in growable segments instead of fixed blocks: the warm-up's prefills
# of every length and the captured step graphs then leave no stranded reserve. Measured on the H200 with the
# full q2 file (docs/PERFORMANCE.md): one resident stage used 90.9 GiB without it, 84.7 GiB with it, which is
# what the planner predicts. A user's own setting wins.
ALLOC_CONF = "expandable_segments:True"

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "pull": ("ds4station.commands.pull", "download a DeepSeek-V4-Flash GGUF from the Hugging Face hub (resumable)"),
    "make-model": ("ds4station.commands.make_model", "write a DS4 GGUF with random weights (demo model or full shape)"),
    "inspect": ("ds4station.commands.inspect", "print a GGUF's config, tensor check and per-layer bytes"),
    "generate": ("ds4station.commands.generate", "generate text from a prompt (the demo model by default)"),
    "detect": ("ds4station.commands.detect", "list GPUs with live telemetry (NVIDIA via NVML, AMD via sysfs)"),
    "plan": ("ds4station.commands.plan", "propose a route, context and expert caches for these GPUs (or a SPEC)"),
    "worker": ("ds4station.commands.worker", "run one pipeline stage for a coordinator (serve/generate --route)"),
    "serve": ("ds4station.commands.serve", "the local API server for coding agents (OpenAI, Responses, Anthropic)"),
    "tui": ("ds4station.commands.tui", "the control panel (also what `ds4station` with no command opens)"),
    "bench": ("ds4station.commands.bench", "measure: the model on a GPU, the kernels, or the AMD/NVIDIA compile check"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds4station", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["tui", *argv]  # `ds4station [--model PATH ...]` opens the control panel
    args = build_parser().parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)  # before any command imports torch
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
