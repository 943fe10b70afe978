"""`ds4station serve`: the local API server for coding agents (OpenAI, Responses, Anthropic) on one engine.

    ds4station serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--cors ORIGIN,...]
                     [--ctx N] [--sessions N] [--queue N] [--max-tokens N] [--device cpu] ...

With no --model it serves the built-in demo model (created on first use). It listens on 127.0.0.1 unless
told otherwise; binding elsewhere without --api-key prints a warning.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ds4station.commands.worker import add_pipeline_arguments, pipeline_options

DEFAULT_CTX = 32768


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="GGUF model file (default: the built-in demo model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("DS4_API_KEY"),
                   help="require this key (Authorization: Bearer or x-api-key); default $DS4_API_KEY")
    p.add_argument("--cors", default="", help="comma-separated origins allowed by CORS (default: none)")
    p.add_argument("--ctx", type=int, default=None,
                   help=f"context length per session (default: the model's, at most {DEFAULT_CTX})")
    p.add_argument("--sessions", type=int, default=2, help="live KV sessions kept for prefix reuse (default 2)")
    p.add_argument("--queue", type=int, default=16, help="requests that may wait behind the running one")
    p.add_argument("--max-tokens", type=int, default=4096, help="default generation limit per request")
    p.add_argument("--prefill-chunk", type=int, default=256, help="tokens per prefill step")
    p.add_argument("--rollback", type=int, default=1024,
                   help="tokens a live session can roll back for prefix reuse (default 1024)")
    p.add_argument("--max-body-mb", type=float, default=32.0, help="largest request body accepted")
    p.add_argument("--keepalive", type=float, default=10.0, help="seconds between SSE keep-alives while silent")
    p.add_argument("--device", default="cpu", help="torch device for the engine (default cpu)")
    p.add_argument("--name", default=None, help="model id reported by /v1/models (default: the file name)")
    add_pipeline_arguments(p)


def build(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The FastAPI app for these arguments and uvicorn's settings (the engine loads when the app starts)."""
    from ds4station.engine.demo import demo_model_path
    from ds4station.engine.gguf import GGUFFile
    from ds4station.engine.scheduler import Scheduler
    from ds4station.server.app import create_app

    path = args.model or str(demo_model_path())
    cfg = GGUFFile.open(path).config  # reads the header only; fails early with a clear message
    ctx = args.ctx or min(cfg.context_length, DEFAULT_CTX)
    if ctx < 16:
        raise SystemExit(f"--ctx {ctx} is too small")
    if args.sessions < 1:
        raise SystemExit("--sessions must be at least 1")

    from ds4station.engine.kv import kv_bytes
    from ds4station.engine.pipeline import check_settings

    opts = pipeline_options(args)
    check_settings(path, opts["route"], opts["expert_cache"], args.activation_bits, args.device)

    per_session = kv_bytes(cfg, None, ctx, chunk=args.prefill_chunk, rollback=args.rollback)
    print(f"ds4station serve: {path}: ctx {ctx}, KV {per_session / 2**20:.1f} MiB per session x {args.sessions} "
          f"live session(s) = {per_session * args.sessions / 2**20:.1f} MiB", file=sys.stderr)

    def load() -> Any:
        from ds4station.engine.pipeline import load_engine

        return load_engine(path, ctx, device=args.device, chunk=args.prefill_chunk, rollback=args.rollback,
                           progress=scheduler.report_load, **opts)

    scheduler = Scheduler(load, sessions=args.sessions, max_queue=args.queue, prefill_chunk=args.prefill_chunk,
                          ctx=ctx)
    name = args.name or os.path.splitext(os.path.basename(path))[0]
    app = create_app(scheduler, model_name=name, model_path=str(path), ctx=ctx, api_key=args.api_key or None,
                     cors=[o.strip() for o in args.cors.split(",") if o.strip()],
                     max_body_bytes=int(args.max_body_mb * 1024 * 1024), default_max_tokens=args.max_tokens,
                     keepalive_s=args.keepalive)
    return app, {"host": args.host, "port": args.port}


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ds4station.engine.gguf import GGUFError

    try:
        app, where = build(args)
    except (GGUFError, ValueError) as e:  # bad file, route or expert-cache size
        print(f"ds4station serve: {e}", file=sys.stderr)
        return 2
    if where["host"] not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"warning: listening on {where['host']} without --api-key: anyone who can reach this port can use "
              "the model", file=sys.stderr)
    print(f"ds4station serve: http://{where['host']}:{where['port']}/v1 (OpenAI, Responses), "
          f"http://{where['host']}:{where['port']} (Anthropic); /health, /status, /metrics", file=sys.stderr)
    uvicorn.run(app, host=where["host"], port=where["port"], log_level="info", timeout_graceful_shutdown=5)
    return 0
