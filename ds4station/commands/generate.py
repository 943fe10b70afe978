"""`ds4station generate`: run a prompt through a DS4 GGUF on this machine and stream the text.

It drives the same engine through the same scheduler as `ds4station serve` (one live session), so both stop,
sample and report identically: the same prompt and sampling settings give the same tokens. Without --model
it uses the built-in demo model (random weights, created in the user's cache directory on first use),
which checks the whole path from file to text without a real download.
"""

from __future__ import annotations

import argparse

from ds4station.commands.worker import add_pipeline_arguments, pipeline_options
from ds4station.model.sizes import token_count


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="path of a DS4 GGUF (default: the built-in demo model)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as one user turn of the chat template")
    p.add_argument("--max-tokens", type=token_count, default=128, metavar="N",
                   help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (same seed, same text)")
    p.add_argument("--ctx", type=token_count, default=4096, metavar="N",
                   help="context length to allocate KV for, e.g. 4096, 32K, 1M (default 4096)")
    p.add_argument("--prefill-chunk", type=token_count, default=None, metavar="N",
                   help="tokens per prefill step (default: 2048 on a GPU, 256 on the CPU)")
    p.add_argument("--device", default="auto",
                   help="where a single-stage engine runs: auto (the GPU when one is visible, else cpu), cpu, "
                        "cuda:N (default auto)")
    add_pipeline_arguments(p)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import sys

    from ds4station.engine import chat
    from ds4station.engine.engine import Engine, check_settings, default_chunk
    from ds4station.engine.sampler import SamplingParams
    from ds4station.engine.scheduler import Finished, Job, Scheduler, Text
    from ds4station.engine.tokenizer import Tokenizer
    from ds4station.model.gguf import GGUFFile

    if args.model is None:
        from ds4station.engine.demo import demo_model_path

        path = str(demo_model_path())
        print(f"(no --model: using the built-in demo model {path}; its weights are random)", file=sys.stderr)
    else:
        path = args.model
    opts = pipeline_options(args)
    try:
        gguf = GGUFFile.open(path)
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed, max_tokens=args.max_tokens)
        route = check_settings(gguf, args.ctx, opts.pop("route"), opts.pop("expert_cache"), args.activation_bits,
                               args.device)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = Tokenizer.from_metadata(gguf.metadata)
    if args.chat:  # the prompt and the banned tokens of a chat request to `serve` without tools
        prompt = chat.encode_prompt(tok, [{"role": "user", "content": args.prompt}], tools=None, thinking=False)
        banned = chat.banned_tokens(tok, thinking=False, tools=False)
    else:  # as /v1/completions: BOS + the text
        prompt, banned = [gguf.config.bos_id, *tok.encode(args.prompt, allow_special=False)], []
    if len(prompt) >= args.ctx:
        print(f"error: the prompt ({len(prompt)} tokens) does not fit in --ctx {args.ctx}", file=sys.stderr)
        return 2
    chunk = args.prefill_chunk or default_chunk(route.stages[0].device)
    # one prompt: no warm-up of every prefill length and position (serve's "ready means warm"); the kernels
    # this prompt needs compile as it runs
    scheduler = Scheduler(lambda: Engine.load(path, args.ctx, route, sessions=1, chunk=chunk, warm=False, **opts),
                          sessions=1, max_queue=1, prefill_chunk=chunk, ctx=args.ctx)
    job = Job(prompt=prompt, max_tokens=min(args.max_tokens, args.ctx - len(prompt)), sampling=params,
              stop_tokens={tok.eos_id}, banned_tokens=banned, kind="generate")

    async def stream() -> Finished:
        handle = scheduler.submit(job)
        async for event in handle.events():
            if isinstance(event, Text):
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, Finished):
                return event
        raise AssertionError("the scheduler ended a job without Finished")

    scheduler.start()
    try:
        scheduler.ready.wait()
        if scheduler.state != "ready":
            print(f"error: {scheduler.error}", file=sys.stderr)
            return 2
        fin = asyncio.run(stream())
    finally:
        scheduler.stop()
    sys.stdout.write("\n")
    if fin.error:
        print(f"error: {fin.error}", file=sys.stderr)
        return 1
    d = fin.timings.as_dict()
    print(f"prompt: {fin.prompt_tokens} tokens, {d['prompt_per_second']:.1f} tok/s | decode: "
          f"{fin.completion_tokens} tokens, {d['predicted_per_second']:.1f} tok/s | finish: {fin.reason}",
          file=sys.stderr)
    return 0
