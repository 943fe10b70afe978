"""`ds4station worker`: run one pipeline stage for a coordinator (`serve` / `generate` with --route).

    ds4station worker --coordinator HOST:PORT --rank N [--model PATH] [--device DEV] [--expert-cache SIZE]

The coordinator starts local workers itself (adding --device, --threads and --parent-pid); start one by hand
on another host for a stage the coordinator was told is remote. The worker reads the model path, route and
context size from the coordinator; --model, --device and --expert-cache override them for this host.
Exit codes: 0 after a shutdown, 2 for a stage that cannot run as configured (e.g. an expert cache smaller
than one layer's expert table: the message states the minimum), 1 for other failures, 3 when the
coordinator went away.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT",
                   help="the coordinator's rendezvous address (printed by serve/generate for remote stages)")
    p.add_argument("--rank", type=int, required=True, help="the stage to run (1 = the second stage of the route)")
    p.add_argument("--model", default=None, help="GGUF path on this host (default: the coordinator's path)")
    p.add_argument("--device", default=None,
                   help="torch device on this host (default: the route's device for this stage)")
    p.add_argument("--expert-cache", default=None, metavar="SIZE",
                   help="stream routed experts through a cache of SIZE (e.g. 2GiB) instead of the route's setting")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch in this process")
    p.add_argument("--connect-timeout", type=float, default=60.0, help="seconds to wait for the coordinator")
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)  # set by a local coordinator


def add_pipeline_arguments(p: argparse.ArgumentParser) -> None:
    """The route / streaming flags `serve` and `generate` share (kept here: this module imports no torch)."""
    g = p.add_argument_group("pipeline stages and expert streaming")
    g.add_argument("--route", default=None, metavar="ROUTE",
                   help="stages as 'cuda:0=embed,0-11,output; cuda:1=12-17,cache=2GiB; ...' or a .toml file of "
                        "[[stages]]; one process per stage (default: everything in this process)")
    g.add_argument("--expert-cache", default=None, metavar="SIZE",
                   help="stream routed experts from the GGUF through a cache of SIZE per stage (e.g. 2GiB); "
                        "a route's cache=SIZE overrides it for that stage (default: experts resident)")
    g.add_argument("--activation-bits", type=int, choices=(16, 32), default=16,
                   help="precision of the state sent between stages (32 = exactly the single-process result)")
    g.add_argument("--dist-addr", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="where the stages rendezvous (default: a free local port; use this host's address and "
                        "a fixed port when workers join from other hosts)")
    g.add_argument("--remote-ranks", default="", metavar="N,M",
                   help="stages whose worker is started by hand on another host with "
                        "`ds4station worker --coordinator HOST:PORT --rank N` (default: none)")


def pipeline_options(args: argparse.Namespace) -> dict[str, object]:
    """Keyword arguments for `ds4station.engine.engine.Engine.load` from those flags."""
    remote = [int(r) for r in str(getattr(args, "remote_ranks", "") or "").split(",") if r.strip()]
    opts: dict[str, object] = {"route": args.route, "expert_cache": args.expert_cache,
                               "activation_bits": args.activation_bits}
    if args.route is not None:
        opts.update(dist_addr=args.dist_addr, remote=remote)
    return opts


def run(args: argparse.Namespace) -> int:
    from ds4station.engine.stage import run_worker
    from ds4station.model.sizes import parse_size

    try:
        cache = parse_size(args.expert_cache) if args.expert_cache is not None else None
    except ValueError as e:
        print(f"ds4station worker: --expert-cache: {e}", file=sys.stderr)
        return 2
    return run_worker(args.coordinator, args.rank, model=args.model, device=args.device, expert_cache=cache,
                      threads=args.threads, parent_pid=args.parent_pid, connect_timeout=args.connect_timeout)


def main(argv: list[str] | None = None) -> int:
    """`python -m ds4station.commands.worker ...`: how a coordinator starts local workers (independent of
    which commands the `ds4station` entry point registers)."""
    parser = argparse.ArgumentParser(prog="ds4station worker", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
