"""`ds4station generate`: run a prompt through a DS4 GGUF on this machine and stream the text.

Without --model it uses the built-in demo model (random weights, created in the user's cache directory on
first use), which checks the whole path from file to text without a real download.
"""

from __future__ import annotations

import argparse

from ds4station.commands.worker import add_pipeline_arguments, pipeline_options


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="path of a DS4 GGUF (default: the built-in demo model)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as one user turn of the chat template")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (same seed, same text)")
    p.add_argument("--ctx", type=int, default=4096, help="context length to allocate KV for (default 4096)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    add_pipeline_arguments(p)


def run(args: argparse.Namespace) -> int:
    import sys

    from ds4station.engine.pipeline import load_engine
    from ds4station.engine.runtime import GenerationStats
    from ds4station.engine.sampler import SamplingParams

    if args.model is None:
        from ds4station.engine.demo import demo_model_path

        path = demo_model_path()
        print(f"(no --model: using the built-in demo model {path}; its weights are random)", file=sys.stderr)
    else:
        path = args.model
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed, max_tokens=args.max_tokens)
        engine = load_engine(path, args.ctx, device=args.device, **pipeline_options(args))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.chat:
        from ds4station.engine.chat import render_prompt

        text = render_prompt([{"role": "user", "content": args.prompt}], tools=None, thinking=False)
        prompt = engine.tokenizer.encode(text)
    else:
        prompt = [engine.cfg.bos_id, *engine.tokenizer.encode(args.prompt, allow_special=False)]
    stats = GenerationStats()
    try:
        for piece in engine.generate(prompt, params, stats=stats):
            sys.stdout.write(piece)
            sys.stdout.flush()
    except ValueError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    finally:
        close = getattr(engine, "close", None)  # a pipeline engine stops its worker processes
        if close is not None:
            close()
    sys.stdout.write("\n")
    print(f"prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.1f} tok/s | "
          f"decode: {stats.generated_tokens} tokens, {stats.decode_tps:.1f} tok/s | finish: {stats.finish_reason}",
          file=sys.stderr)
    return 0
