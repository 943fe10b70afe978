"""`ds4station bench WHAT`: measurements. `kernels` times the Triton kernels at the model's real shapes on
the GPU; `compile` builds every kernel ahead of time for NVIDIA and AMD targets (no GPU needed) and reports
registers, spills, shared memory and the instructions that matter.

`model` (the default) times one GPU stage at the real shape; `serve` starts the server on a file and
measures it through the HTTP API like an agent, beside the engine bench of the same file. Each WHAT is one
entry in BENCHES (name -> (handler, help)).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from ds4station.model.sizes import token_count


def _kernels(args: argparse.Namespace) -> int:
    import torch

    from ds4station.kernels import benchmark

    if not torch.cuda.is_available():
        print("bench kernels needs a CUDA or ROCm GPU; none is visible to torch. "
              "On a CPU-only machine, `ds4station bench compile` checks the kernels build.", file=sys.stderr)
        return 2
    rows = [int(r) for r in args.rows.split(",") if r]
    info, results = benchmark.run_all(rows, args.prefill_tokens, args.only, sweep=args.sweep)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"info": info, "results": benchmark.as_dicts(results)}, fh, indent=1)
    print(benchmark.format_table(info, results))
    return 0


def _compile(args: argparse.Namespace) -> int:
    from ds4station.kernels import compile_check

    targets = [t for t in args.targets.split(",") if t] or None
    reports = compile_check.compile_all(targets=targets, only=args.only)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([r.as_dict() for r in reports], fh, indent=1)
    print(compile_check.format_table(reports))
    problems = compile_check.problems(reports)
    for p in problems:
        print(f"PROBLEM: {p}", file=sys.stderr)
    return 1 if problems else 0


def _model(args: argparse.Namespace) -> int:
    import torch

    from ds4station.engine import benchmark
    from ds4station.model.sizes import parse_tokens

    if not torch.cuda.is_available():
        print("bench model measures a GPU; none is visible to torch.", file=sys.stderr)
        return 2

    def ints(text: str) -> tuple[int, ...]:
        return tuple(parse_tokens(v) for v in text.split(",") if v.strip())

    res = benchmark.run(args.random_shape, model=args.model, prompts=ints(args.prompts), prefills=ints(args.prefills),
                        decode_tokens=args.decode_tokens, runs=args.runs, chunk=args.chunk)
    return _report(args, res)


def _report(args: argparse.Namespace, res) -> int:
    """Print a bench's table, and write its result as JSON where --json names a file."""
    if args.json:
        import dataclasses

        with open(args.json, "w") as fh:
            json.dump(dataclasses.asdict(res), fh, indent=1)
    print(res.table())
    return 0


def _serve(args: argparse.Namespace) -> int:
    import shlex

    from ds4station.server import bench

    if not args.model:
        print("bench serve needs --model FILE: it starts `ds4station serve` on that file", file=sys.stderr)
        return 2
    engine = True
    if args.no_engine_bench:
        engine = False
    else:
        import torch

        if not torch.cuda.is_available():
            print("bench serve compares the server with the engine bench on a GPU; none is visible to torch "
                  "(--no-engine-bench times the server alone)", file=sys.stderr)
            return 2
    prompt = args.prompt_tokens or 8192
    try:
        res = bench.run(args.model, prompt_tokens=prompt, decode_tokens=args.decode_tokens, runs=args.runs,
                        port=args.port, serve_args=shlex.split(args.serve_args), engine_bench=engine)
    except (RuntimeError, TimeoutError) as e:  # a port in use, a server that exited or never became ready
        print(f"bench serve: {e}", file=sys.stderr)
        return 1
    return _report(args, res)


def _draft(args: argparse.Namespace) -> int:
    from ds4station.engine import draft_bench
    from ds4station.engine.stage import MTP_IN_MODEL
    from ds4station.model.gguf import GGUFFile

    if not args.model:
        print("bench draft needs --model FILE (with --mtp FILE, or a model file holding the MTP layer, it also "
              "measures the MTP drafts)", file=sys.stderr)
        return 2
    ks = [int(k) for k in args.k.split(",") if k.strip()]
    mtp = args.mtp or (MTP_IN_MODEL if GGUFFile.open(args.model).has_mtp else None)
    res = draft_bench.run(args.model, mtp=mtp, ks=ks, prompt=args.prompt_tokens or 512,
                          tokens=args.decode_tokens, device=args.device, log=lambda m: print(m, file=sys.stderr))
    return _report(args, res)


# name -> (handler, one-line help)
BENCHES: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
    "kernels": (_kernels, "time every Triton kernel at the real decode / prefill shapes (GPU)"),
    "model": (_model, "decode / prefill tok/s of one GPU stage at the real shape (default)"),
    "serve": (_serve, "start `ds4station serve --model FILE`, drive it with the openai client like an agent, and "
                      "print its prefill / decode / TTFT beside the engine bench of the same file"),
    "draft": (_draft, "speculative decoding on one engine: a verification's cost against a decode step, "
                      "decode with always-right drafts and with the MTP layer's, break-even acceptance (--model)"),
    "compile": (_compile, "compile every kernel for cuda sm_90/sm_86 and hip gfx906/gfx1100/gfx1151 (no GPU)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", nargs="?", default="model", choices=sorted(BENCHES),
                        help="; ".join(f"{name}: {text}" for name, (_, text) in sorted(BENCHES.items())))
    parser.add_argument("--only", default="", help="run only cases whose name contains this text")
    parser.add_argument("--json", default="", help="also write the results as JSON to this file")
    kern = parser.add_argument_group("kernels")
    kern.add_argument("--rows", default="1,4", help="decode activation rows to time, comma-separated (1-8)")
    kern.add_argument("--prefill-tokens", type=token_count, default=2048, help="tokens of the prefill matmuls")
    kern.add_argument("--sweep", action="store_true", help="also time decode tile variants at a few shapes")
    model = parser.add_argument_group("model")
    model.add_argument("--random-shape", default="flash-q2", choices=["flash-q2", "tiny-q2"],
                       help="build this shape with random valid weights in GPU memory (default flash-q2)")
    model.add_argument("--model", default=None, help="a DS4 GGUF file instead of random weights")
    model.add_argument("--prompts", default="0,8192,32768", help="decode after prompts of these lengths (8K forms too)")
    model.add_argument("--prefills", default="2048,8192,32768", help="prefill speed at these prompt lengths")
    model.add_argument("--decode-tokens", type=token_count, default=64, help="tokens per timed decode run (default 64)")
    model.add_argument("--runs", type=int, default=3, help="timed decode runs; the median is reported")
    model.add_argument("--chunk", type=token_count, default=2048, help="prefill chunk (tokens per step)")
    serve = parser.add_argument_group("serve")
    serve.add_argument("--prompt-tokens", type=token_count, default=None, metavar="N",
                       help="length of the long chat prompt (default 8K)")
    serve.add_argument("--port", type=int, default=8017, help="port for the server under test (default 8017)")
    serve.add_argument("--serve-args", default="", help="extra arguments for `ds4station serve`, quoted")
    serve.add_argument("--no-engine-bench", action="store_true", help="time the server alone (no GPU needed)")
    draft = parser.add_argument_group("draft (also --model, --prompt-tokens: default 512, --decode-tokens)")
    draft.add_argument("--k", default="1,2,3", help="drafted tokens per verification to measure, comma-separated")
    draft.add_argument("--mtp", default=None, metavar="FILE",
                       help="the MTP layer's GGUF (default: the model file's own, when it holds one)")
    draft.add_argument("--device", default="auto", help="auto (the GPU when one is visible), cpu or cuda:N")
    comp = parser.add_argument_group("compile")
    comp.add_argument("--targets", default="", help="comma-separated target names (default: all); "
                      "sm90, sm86, gfx906, gfx1100, gfx1151")


def run(args: argparse.Namespace) -> int:
    handler, _ = BENCHES[args.what]
    return handler(args)
