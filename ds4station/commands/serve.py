"""`ds4station serve`: the local API server for coding agents (OpenAI, Responses, Anthropic) on one engine.

    ds4station serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--cors ORIGIN,...]
                     [--allow-host NAME] [--ctx N] [--sessions N] [--batch N] [--prefill-budget N] [--queue N]
                     [--max-tokens N] [--device auto] [--draft off|lookup|mtp] [--mtp FILE] [--draft-tokens K]
                     [--kv-disk-dir DIR [--kv-disk-budget SIZE] [--kv-disk-min N]]
                     [--restarts N] [--shutdown-grace S] [--trace FILE] ...

With no --model it serves the built-in demo model (created on first use). It listens on 127.0.0.1 unless
told otherwise; binding elsewhere without --api-key prints a warning. Without --api-key, requests must be
addressed to a loopback name, the listening address or an --allow-host name, and browsers' cross-origin
requests need --cors. Everything that can be checked without loading the weights (the file, the context
length, the route, expert caches) is checked before the port is bound; `/health` says ready once the weights
are loaded and the engine is warm. A stage that dies is restarted (--restarts attempts); SIGTERM / SIGINT
let the open requests finish for --shutdown-grace seconds, end the rest with an error event and exit.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ds4station.commands.worker import add_pipeline_arguments, pipeline_options
from ds4station.model.footprint import FootprintSettings
from ds4station.model.sizes import token_count

DEFAULT_CTX = 32768
_FOOTPRINT = FootprintSettings()  # serve's defaults are the planner's: one owner for sessions and rollback
DEFAULT_SHUTDOWN_GRACE = 5.0
DEFAULT_TRACE_MAX_MB = 64
DEFAULT_TRACE_KEEP = 3
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="GGUF model file (default: the built-in demo model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("DS4_API_KEY"),
                   help="require this key (Authorization: Bearer or x-api-key); default $DS4_API_KEY")
    p.add_argument("--cors", default="", help="comma-separated origins allowed by CORS (default: none)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="without --api-key, also answer requests whose Host is NAME (repeatable or comma-separated; "
                        "'*' any); by default only localhost, 127.0.0.1, [::1] and the --host address")
    p.add_argument("--ctx", type=token_count, default=None, metavar="N",
                   help=f"context length per session, e.g. 32K or 1M (default: the model's, at most {DEFAULT_CTX})")
    p.add_argument("--plan", default=None, metavar="FILE",
                   help="run a launch file written by `ds4station plan --out FILE`: its model, route, context, "
                        "sessions, prefill chunk, rollback and KV dtype (flags that contradict it are refused)")
    p.add_argument("--sessions", type=int, default=None,
                   help=f"live KV sessions kept for prefix reuse, each a KV slot allocated at load "
                        f"(default {_FOOTPRINT.sessions})")
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help="requests that run at once, decoding in one batched step (each holds one of the "
                        "--sessions KV slots; default: all of them)")
    p.add_argument("--prefill-budget", type=token_count, default=None, metavar="N",
                   help="prompt tokens prefilled per step over all prompts in progress, between two decode steps "
                        "of the running requests (default and at most: the prefill chunk)")
    p.add_argument("--queue", type=int, default=16, help="requests that may wait for a place in the batch")
    p.add_argument("--max-tokens", type=token_count, default=4096, metavar="N",
                   help="default generation limit per request (default 4096)")
    p.add_argument("--prefill-chunk", type=token_count, default=None, metavar="N",
                   help="tokens per prefill step (default: 2048 on a GPU, 256 on the CPU)")
    p.add_argument("--rollback", type=token_count, default=None, metavar="N",
                   help=f"tokens a live session can roll back in place for prefix reuse (default "
                        f"{_FOOTPRINT.rollback}); further back, to the end of its last prompt, it always can")
    p.add_argument("--draft", choices=("off", "lookup", "mtp"), default="off",
                   help="speculative decoding: 'lookup' drafts the next tokens from earlier occurrences of the "
                        "last ones in the prompt and output (prompt lookup), 'mtp' from the model's MTP layer "
                        "(in the model file, or --mtp FILE); the drafts are verified in one forward and the "
                        "output is unchanged (default off)")
    p.add_argument("--mtp", default=None, metavar="FILE",
                   help="the MTP layer's own GGUF for --draft mtp (`ds4station pull mtp`); default: the model "
                        "file's own MTP layer (make-model --mtp)")
    p.add_argument("--draft-tokens", type=int, default=4, metavar="K",
                   help="tokens drafted per step with --draft (default 4, at most 16)")
    p.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                   help="save long prompts' KV states to DIR and restore them when a later prompt starts with one "
                        "(after its live session was evicted, or after a restart); default: off")
    p.add_argument("--kv-disk-budget", default="16GiB", metavar="SIZE",
                   help="the most the --kv-disk-dir checkpoints take; the least recently used go first "
                        "(default 16GiB)")
    p.add_argument("--kv-disk-min", type=token_count, default=1024, metavar="N",
                   help="save only prompts of at least N tokens to --kv-disk-dir (default 1024)")
    p.add_argument("--max-body-mb", type=float, default=32.0, help="largest request body accepted")
    p.add_argument("--keepalive", type=float, default=10.0, help="seconds between SSE keep-alives while silent")
    p.add_argument("--device", default="auto",
                   help="where a single-stage engine runs: auto (the GPU when one is visible, else cpu), cpu, "
                        "cuda:N (default auto)")
    p.add_argument("--name", default=None, help="model id reported by /v1/models (default: the file name)")
    p.add_argument("--restarts", type=int, default=3, metavar="N",
                   help="when a pipeline stage dies, reload the route up to N times (backoff 1, 2, 4 ... s); "
                        "0: stay down (default 3)")
    p.add_argument("--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE, metavar="SECONDS",
                   help="on SIGTERM / SIGINT, let open requests finish this long before ending them with an "
                        f"error event (default {DEFAULT_SHUTDOWN_GRACE:g})")
    p.add_argument("--parent-pid", type=int, default=None, metavar="PID",
                   help="stop at once when the process PID stops being this server's parent (the control panel "
                        "passes its own, so the server dies with it)")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="append a JSON line per request to FILE: prompt hash and length, reused / prefilled "
                        "tokens and why, output, tool calls, finish reason, timings")
    p.add_argument("--trace-max-mb", type=float, default=DEFAULT_TRACE_MAX_MB, metavar="MB",
                   help=f"rotate the trace at this size (default {DEFAULT_TRACE_MAX_MB})")
    p.add_argument("--trace-keep", type=int, default=DEFAULT_TRACE_KEEP, metavar="N",
                   help=f"rotated trace files kept (FILE.1 ... FILE.N, default {DEFAULT_TRACE_KEEP})")
    add_pipeline_arguments(p)


def build(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The FastAPI app for these arguments and uvicorn's settings (the engine loads when the app starts)."""
    from ds4station.engine.demo import demo_model_path
    from ds4station.engine.engine import Engine, check_mtp, check_settings, default_chunk
    from ds4station.engine.scheduler import Scheduler
    from ds4station.engine.stage import MTP_IN_MODEL
    from ds4station.model.footprint import kv_bytes, stage_mtp_bytes
    from ds4station.model.gguf import GGUFFile
    from ds4station.planner.launch import ENGINE_KV_DTYPES
    from ds4station.server.app import create_app
    from ds4station.server.trace import RequestTrace

    kv_dtype = "float32"
    if args.plan:
        apply_launch(args)
        kv_dtype = args.kv_dtype
    sessions = _FOOTPRINT.sessions if args.sessions is None else args.sessions
    rollback = _FOOTPRINT.rollback if args.rollback is None else args.rollback
    path = args.model or str(demo_model_path())
    gguf = GGUFFile.open(path)  # reads the header only; fails early with a clear message
    cfg = gguf.config
    ctx = args.ctx or min(cfg.context_length, DEFAULT_CTX)
    if ctx < 16:
        raise ValueError(f"--ctx {ctx} is too small (16 tokens at least)")
    if sessions < 1:
        raise ValueError("--sessions must be at least 1")
    if args.restarts < 0 or args.shutdown_grace < 0 or rollback < 0:
        raise ValueError("--restarts, --rollback and --shutdown-grace cannot be negative")
    opts = pipeline_options(args)
    route = check_settings(gguf, ctx, opts.pop("route"), opts.pop("expert_cache"), args.activation_bits,
                           args.device)
    if args.mtp and args.draft != "mtp":
        raise ValueError("--mtp FILE is the MTP layer for --draft mtp; add --draft mtp (or drop --mtp)")
    mtp = check_mtp(gguf, (args.mtp or MTP_IN_MODEL) if args.draft == "mtp" else None)
    chunk = args.prefill_chunk or default_chunk(route.stages[0].device)
    batch = sessions if args.batch is None else args.batch
    if not 1 <= batch <= sessions:
        raise ValueError(f"--batch {batch}: use 1 to {sessions}; each running request holds one of the --sessions "
                         f"{sessions} KV slots (raise --sessions to run more at once)")
    # Prompt tokens per step: at most one chunk, by default the device's chunk (H200: a 32K prompt prefilled at
    # 2,298 tok/s in 2,048-token pieces against 2,123 in 1,024-token ones, and a 20-token request arriving
    # meanwhile still had its first token in 0.40 s; docs/PERFORMANCE.md, twenty-second session).
    budget = args.prefill_budget or min(chunk, default_chunk(route.stages[0].device))
    if budget > chunk:
        raise ValueError(f"--prefill-budget {budget} exceeds the prefill chunk {chunk}: a step prefills at most one "
                         "chunk; raise --prefill-chunk or lower the budget")
    kv_disk = disk_settings(args)
    per_session = kv_bytes(cfg, None, ctx, "f32" if kv_dtype == "float32" else "f16", chunk=chunk,
                           rollback=rollback)
    print(f"ds4station serve: {path}: route {route}, ctx {ctx}, prefill chunk {chunk} (budget {budget} per step), "
          f"batch {batch}, rollback {rollback}, KV "
          f"{per_session / 2**20:.1f} MiB per session x {sessions} session(s) = "
          f"{per_session * sessions / 2**20:.1f} MiB", file=sys.stderr)

    shape = serve_shape(gguf, mtp)  # the model as the footprint sees it, with the MTP layer's tensors if any
    fs = FootprintSettings(prefill_chunk=chunk, kv_dtype={v: k for k, v in ENGINE_KV_DTYPES.items()}[kv_dtype],
                           sessions=sessions, rollback=rollback, mtp=bool(mtp))
    if mtp:
        at = route.output_stage
        extra = stage_mtp_bytes(shape, ctx, fs, embed=route.stages[at].embed)
        print(f"ds4station serve: --draft mtp: the MTP layer ({'the model file' if mtp == MTP_IN_MODEL else mtp}) "
              f"adds {extra / 2**20:.1f} MiB to stage {at} (its weights"
              f"{'' if route.stages[at].embed else ', a copy of the token embedding'} and {sessions} session(s)' "
              "state)", file=sys.stderr)
    for warning in check_host_memory(shape, route, ctx, fs):
        print(f"warning: {warning}", file=sys.stderr)

    def load() -> Any:
        return Engine.load(path, ctx, route, sessions=sessions, chunk=chunk, rollback=rollback, kv_dtype=kv_dtype,
                           progress=scheduler.report_load,
                           verify_rows=args.draft_tokens + 1 if args.draft != "off" else 0, mtp=mtp or None,
                           **opts)

    scheduler = Scheduler(load, sessions=sessions, max_queue=args.queue, prefill_chunk=chunk, ctx=ctx, batch=batch,
                          prefill_budget=budget, max_restarts=args.restarts, kv_disk=kv_disk, draft=args.draft,
                          draft_tokens=args.draft_tokens)
    trace = None
    if args.trace:
        trace = RequestTrace(args.trace, scheduler, max_bytes=max(1, int(args.trace_max_mb * 2**20)),
                             keep=args.trace_keep)
    hosts = [h.strip() for value in args.allow_host for h in value.split(",") if h.strip()]
    if args.host not in WILDCARD_HOSTS:
        hosts.append(args.host)
    name = args.name or os.path.splitext(os.path.basename(path))[0]
    app = create_app(scheduler, model_name=name, model_path=str(path), ctx=ctx, api_key=args.api_key or None,
                     cors=[o.strip() for o in args.cors.split(",") if o.strip()], allowed_hosts=hosts,
                     max_body_bytes=int(args.max_body_mb * 1024 * 1024), default_max_tokens=args.max_tokens,
                     keepalive_s=args.keepalive, trace=trace)
    return app, {"host": args.host, "port": args.port}


def disk_settings(args: argparse.Namespace) -> Any:
    """The disk KV checkpoint settings (None without --kv-disk-dir); the directory is created and must be
    writable, checked before the port is bound."""
    from ds4station.engine.kvdisk import DiskSettings
    from ds4station.model.sizes import parse_size

    if not args.kv_disk_dir:
        return None
    budget = parse_size(args.kv_disk_budget)
    if budget <= 0 or args.kv_disk_min < 1:
        raise ValueError("--kv-disk-budget must be positive and --kv-disk-min at least 1 token")
    root = os.path.abspath(os.path.expanduser(args.kv_disk_dir))
    try:
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".probe{os.getpid()}")
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"--kv-disk-dir {args.kv_disk_dir}: cannot write there ({e.strerror or e})") from None
    return DiskSettings(root, budget, args.kv_disk_min)


def available_ram() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def serve_shape(gguf: Any, mtp: str) -> Any:
    """The model file's shape for the footprint, with the MTP layer's tensors as their file stores them when
    `mtp` (check_mtp's answer: "", MTP_IN_MODEL or the layer's own GGUF) names one."""
    from ds4station.engine.stage import MTP_IN_MODEL
    from ds4station.model.footprint import shape_from_specs
    from ds4station.model.gguf import GGUFFile

    layer = []
    if mtp == MTP_IN_MODEL:
        layer = gguf.mtp_specs()
    elif mtp:
        f = GGUFFile.open_mtp(mtp, gguf.config)
        try:
            layer = f.mtp_specs()
        finally:
            f.release()
    return shape_from_specs(gguf.path.name, gguf.config, gguf.tensor_specs(), layer)


def check_host_memory(shape: Any, route: Any, ctx: int, fs: FootprintSettings) -> list[str]:
    """The host-memory guard: what the route draws on system RAM (CPU stages, pinned staging of streaming GPU
    stages; the page cache its streamed experts want) against what is available now. Raises ValueError when it
    cannot run; -> warnings (below the host reserve, streamed experts partly on the disk)."""
    from ds4station.model.footprint import stage_footprint
    from ds4station.planner.propose import host_messages, host_need

    kinds = ["cpu" if s.device == "cpu" else "gpu" for s in route.stages]
    footprints = [stage_footprint(shape, s.layers, ctx, fs, embed=s.embed, output=s.output,
                                  expert_cache_bytes=s.expert_cache_bytes, device_kind=k)
                  for s, k in zip(route.stages, kinds, strict=True)]
    errors, warnings = host_messages(host_need(shape, list(route.stages), footprints, kinds), available_ram())
    if errors:
        raise ValueError(errors[0] + "; free memory, shorten --ctx, use fewer --sessions or move CPU layers to a GPU")
    return warnings


def apply_launch(args: argparse.Namespace) -> None:
    """Fill args from the launch file `args.plan` (planner/launch.py); a flag given as well must agree with
    it, or this raises naming both."""
    from ds4station.planner.launch import read_launch

    launch = read_launch(args.plan)
    where = f"--plan {args.plan}"
    if launch.model is None and args.model is None:
        raise ValueError(f"{where} names no model file (it was planned for a named shape); add --model FILE")
    wanted = {"model": launch.model or None, "route": launch.route, "ctx": launch.ctx, "sessions": launch.sessions,
              "prefill_chunk": launch.prefill_chunk, "rollback": launch.rollback}
    for key, value in wanted.items():
        given = getattr(args, key)
        if key == "model" and launch.model == "" and given is not None:
            raise ValueError(f"{where} is a plan for the built-in demo model but --model {given!r} was given; "
                             "drop --model or plan for that file with `ds4station plan --model FILE --out`")
        if given is not None and value is not None and given != value:
            flag = "--" + key.replace("_", "-")
            raise ValueError(f"{where} sets {key} = {value!r} but {flag} {given!r} was given; drop {flag} or "
                             "write a new launch file with `ds4station plan ... --out`")
        if value is not None:
            setattr(args, key, value)
    if args.expert_cache is not None:
        raise ValueError(f"{where}: the launch file's route sets each stage's expert cache; drop --expert-cache")
    if launch.draft != "off":  # planned with it (the MTP layer counted): --draft may repeat it, not change it
        if args.draft not in ("off", launch.draft):
            raise ValueError(f"{where} sets draft = {launch.draft!r} but --draft {args.draft} was given; drop "
                             "--draft or write a new launch file with `ds4station plan ... --out`")
        if launch.mtp is not None and args.mtp is not None and args.mtp != launch.mtp:
            raise ValueError(f"{where} sets mtp = {launch.mtp!r} but --mtp {args.mtp!r} was given; drop --mtp")
        args.draft, args.mtp = launch.draft, args.mtp if launch.mtp is None else launch.mtp
    args.kv_dtype = launch.engine_kv_dtype


def run(args: argparse.Namespace) -> int:
    from ds4station.server.app import serve

    try:
        app, where = build(args)
    except (OSError, ValueError) as e:  # bad file, context, route or expert-cache size: nothing is bound yet
        print(f"ds4station serve: {e}", file=sys.stderr)
        return 2
    if where["host"] not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"warning: listening on {where['host']} without --api-key: anyone who can reach this port can use "
              "the model", file=sys.stderr)
    print(f"ds4station serve: http://{where['host']}:{where['port']}/v1 (OpenAI, Responses), "
          f"http://{where['host']}:{where['port']} (Anthropic); /health, /status, /metrics", file=sys.stderr)
    return serve(app, where["host"], where["port"], shutdown_grace=args.shutdown_grace, parent_pid=args.parent_pid)
