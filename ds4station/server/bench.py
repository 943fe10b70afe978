"""`ds4station bench serve`: the served path measured the way an agent drives it, beside the engine bench.

One run, one GPU, one file (../shared/BENCHMARKS.md, "The served path is the product"):
1. the engine bench (engine/benchmark.py) on the file: prefill of an N-token prompt and decode after it;
2. `ds4station serve --model FILE` started as its own process with its defaults (the user's path: device
   auto, per-device prefill chunk, warm before ready), waited for until `/health` says ready;
3. the official `openai` client, streaming, as an agent: the first request after ready is a short chat
   prompt (time to first token, TTFT; the client process has paid its own first-use costs first, see
   `_warm_client`, so that they are not counted as the server's), then a few more short
   ones, then `runs` chat requests of an N-token
   prompt (fresh text each time, so no prefix is reused): prefill tok/s from the request to its first token,
   decode tok/s from the stream (tokens after the first over the time from the first to the last).
The table puts each API figure beside the engine's; a gap between them is a defect. Each TTFT is shown as
the client saw it and as the server recorded it (/status: queued -> first token).
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ds4station.ports import port_free

WORDS = ("station model token agent kernel graph cache route layer expert prefill decode stream window block "
         "index query value scale tile warp thread memory card desktop server client request answer tool call "
         "result patch file line code test build run plan speed context session").split()


@dataclass
class Turn:
    """One streamed chat request as the client saw it."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float  # request sent -> first token's text
    stream_s: float  # first token -> last token
    server_timings: dict[str, Any] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=dict)  # its record in /status (ttft_ms: queued -> first token)

    @property
    def prefill_tps(self) -> float:
        return (self.prompt_tokens - self.cached_tokens) / self.ttft_s

    @property
    def decode_tps(self) -> float:
        return (self.completion_tokens - 1) / self.stream_s if self.completion_tokens > 1 and self.stream_s else 0.0


@dataclass
class ServeBench:
    model: str
    prompt_tokens: int
    engine_prefill: float | None = None  # tok/s, engine bench
    engine_decode: float | None = None
    ready_s: float = 0.0  # serve started -> /health ready
    first: Turn | None = None  # the first request after ready (short prompt)
    short: list[Turn] = field(default_factory=list)
    long: list[Turn] = field(default_factory=list)
    batch: dict[str, Any] = field(default_factory=dict)  # the server's step counters and step log (/status batch)

    def step_line(self) -> str:
        """How the server ran its decode steps: how many there were, how many were queued ahead of their tokens
        (DS4STATION_DECODE_AHEAD), and the median one-request decode step of the step log (its recent steps)."""
        if not self.batch:
            return ""
        ms = [r["total_ms"] for r in self.batch.get("step_log", []) if len(r["decoded"]) == 1 and not r["prefilled"]]
        median = f"; median one-request decode step {statistics.median(ms):.3f} ms (of the last {len(ms)})" if ms \
            else ""
        return (f"server: {self.batch.get('decode_steps', 0)} decode steps, {self.batch.get('ahead_steps', 0)} "
                f"queued ahead of their tokens{median}")

    def table(self) -> str:
        def med(values: Sequence[float]) -> float:
            return statistics.median(values) if values else 0.0

        api_prefill, api_decode = med([t.prefill_tps for t in self.long]), med([t.decode_tps for t in self.long])

        def ratio(api: float, engine: float | None) -> str:
            return f"{100 * api / engine:6.1f}%" if engine else "      -"

        def num(v: float | None, unit: str = "") -> str:
            return f"{v:12,.1f}{unit}" if v is not None else f"{'-':>12}"

        n = self.prompt_tokens
        lines = [f"ds4station bench serve: {self.model}; serve ready {self.ready_s:.1f} s after start",
                 "", f"{'what':36} {'engine bench':>12} {'through serve':>13} {'ratio':>7}",
                 f"{f'prefill {n}-token chat prompt, tok/s':36} {num(self.engine_prefill)} {num(api_prefill)} "
                 f"{ratio(api_prefill, self.engine_prefill)}",
                 f"{f'decode after {n} tokens, tok/s':36} {num(self.engine_decode)} {num(api_decode)} "
                 f"{ratio(api_decode, self.engine_decode)}"]
        def server_ttft(turns: Sequence[Turn]) -> str:
            known = [t.server["ttft_ms"] for t in turns if "ttft_ms" in t.server]
            return f" (server {med(known):.1f} ms)" if known else ""

        if self.first is not None:
            lines.append(f"{f'TTFT {self.first.prompt_tokens}-token prompt, first request':36} {'-':>12} "
                         f"{1000 * self.first.ttft_s:10.1f} ms{server_ttft([self.first])}")
        if self.short:
            lines.append(f"{f'TTFT short prompt, median of {len(self.short)}':36} {'-':>12} "
                         f"{1000 * med([t.ttft_s for t in self.short]):10.1f} ms{server_ttft(self.short)}")
        if self.batch:
            lines.append(self.step_line())
        for i, t in enumerate(self.long):
            lines.append(f"  long request {i}: {t.prompt_tokens} prompt tokens ({t.cached_tokens} cached), "
                         f"TTFT {1000 * t.ttft_s:.0f} ms, {t.completion_tokens} tokens at {t.decode_tps:.1f} tok/s; "
                         f"server: prefill {t.server_timings.get('prompt_per_second', 0):,.1f}, decode "
                         f"{t.server_timings.get('predicted_per_second', 0):,.1f} tok/s")
        return "\n".join(lines)


def chat_text(tokenizer: Any, n_tokens: int, seed: int) -> str:
    """User text whose chat prompt (the template around one user turn) is about `n_tokens` tokens long."""
    from ds4station.engine import chat

    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(max(8, n_tokens))]

    def length(k: int) -> int:
        text = " ".join(words[:k])
        return len(chat.encode_prompt(tokenizer, [{"role": "user", "content": text}], tools=None, thinking=False))

    lo, hi = 1, len(words)
    while length(hi) < n_tokens:  # the words tokenise to less than one token each: draw more
        words += [rng.choice(WORDS) for _ in range(len(words))]
        hi = len(words)
    while lo < hi:  # the fewest words that reach n_tokens
        mid = (lo + hi) // 2
        if length(mid) < n_tokens:
            lo = mid + 1
        else:
            hi = mid
    return " ".join(words[:lo])


def stream_turn(client: Any, text: str, max_tokens: int, temperature: float = 0.0,
                logit_bias: dict[str, int] | None = None) -> Turn:
    """One streamed chat request with the official client (greedy unless `temperature`); times measured on this
    side of the wire. `logit_bias`: e.g. the end-of-text token's at -100, so that the answer runs to max_tokens."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model="ds4", messages=[{"role": "user", "content": text}],
                                            max_tokens=max_tokens, temperature=temperature, stream=True,
                                            stream_options={"include_usage": True},
                                            **({"logit_bias": logit_bias} if logit_bias else {}))
    first = last = None
    usage, timings = None, {}
    for chunk in stream:
        extra = chunk.model_extra or {}
        if extra.get("timings"):
            timings = extra["timings"]
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            piece = (delta.content or "") + ((delta.model_extra or {}).get("reasoning_content") or "")
            if piece:
                last = time.perf_counter()
                first = first or last
    if usage is None or first is None or last is None:
        raise RuntimeError("the stream ended without tokens or usage")
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return Turn(usage.prompt_tokens, cached or 0, usage.completion_tokens, first - t0, last - first, timings)


def _warm_client(client: Any) -> None:
    """The client process's own first-use costs, paid before the first request is timed: the connection
    (`models.list()`, no model work), the SDK's lazily imported chat resource (~20 ms) and the parsing of a
    stream chunk. An agent's client is a long-lived process; the server sees nothing of this but a model list."""
    from openai.types.chat import ChatCompletionChunk

    client.models.list()
    client.chat.completions  # noqa: B018 (the lazy import is the point)
    ChatCompletionChunk.model_validate({"id": "warm", "object": "chat.completion.chunk", "created": 0, "model": "m",
                                        "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]})


def _attach_server_records(url: str, turns: list[Turn]) -> dict[str, Any]:
    """The server's own records of these turns (/status throughput.recent, oldest first; the bench's requests
    are the only ones this server saw) -> its step counters and step log (/status batch)."""
    import httpx

    status = httpx.get(url + "/status", timeout=10).json()
    recent = status["throughput"]["recent"]
    if len(recent) >= len(turns):
        for turn, record in zip(turns, recent[-len(turns):], strict=True):
            turn.server = record
    return status.get("batch") or {}


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait until the `serve` process `proc` answers /health at `url` (RuntimeError if it exits first,
    TimeoutError after `timeout` seconds)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"ds4station serve exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"ds4station serve was not ready within {timeout:.0f} s")
        time.sleep(0.2)


def run(model: str, *, prompt_tokens: int = 8192, decode_tokens: int = 64, runs: int = 3, short_runs: int = 3,
        short_tokens: int = 20, port: int = 8017, serve_args: Sequence[str] = (), engine_bench: bool = True,
        ready_timeout: float = 1200.0, log: Callable[[str], None] = print) -> ServeBench:
    try:
        import openai
    except ImportError as e:
        raise RuntimeError("bench serve drives the server with the official openai client: "
                           "pip install 'ds4station[bench]' (or openai)") from e
    from ds4station.engine.tokenizer import Tokenizer
    from ds4station.model.gguf import GGUFFile

    if not port_free(port):  # a server already there would answer the bench in place of the one it starts
        raise RuntimeError(f"port {port} is in use (another ds4station serve?): stop it or pass --port")
    res = ServeBench(model, prompt_tokens)
    if engine_bench:
        import gc

        import torch

        from ds4station.engine import benchmark

        b = benchmark.run(model=model, prompts=(prompt_tokens,), prefills=(prompt_tokens,),
                          decode_tokens=decode_tokens, runs=runs, log=log)
        res.engine_prefill, res.engine_decode = b.prefill[prompt_tokens], b.decode[prompt_tokens]
        del b
        gc.collect()
        torch.cuda.empty_cache()  # the server below needs the card's memory
    gguf = GGUFFile.open(model)
    tok = Tokenizer.from_metadata(gguf.metadata)
    # every request decodes the tokens it asks for (as llama-bench or vLLM's ignore_eos): a model that ends its
    # answers early, as the demo model does, would leave nothing to time
    no_eos = {str(gguf.config.eos_id): -100}
    texts = [chat_text(tok, prompt_tokens, seed) for seed in range(runs)]
    shorts = [chat_text(tok, short_tokens, 100 + seed) for seed in range(1 + short_runs)]
    ctx = prompt_tokens + decode_tokens + 256
    cmd = [sys.executable, "-m", "ds4station.cli", "serve", "--model", model, "--port", str(port),
           *([] if "--plan" in serve_args else ["--ctx", str(max(ctx, 4096))]), *serve_args]  # a plan sets ctx
    log(f"starting: {' '.join(cmd)}")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def terminated(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # through the finally below

    # the server runs in its own process group (a Ctrl-C in the terminal reaches the bench only): a SIGTERM to the
    # bench stops it too, rather than leaving it holding the GPU and the port
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminated) if main else None
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc, ready_timeout)
        res.ready_s = time.monotonic() - t0
        client = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
        _warm_client(client)
        res.first = stream_turn(client, shorts[0], 16, logit_bias=no_eos)
        log(f"first request after ready: TTFT {1000 * res.first.ttft_s:.1f} ms")
        res.short = [stream_turn(client, text, 16, logit_bias=no_eos) for text in shorts[1:]]
        for i, text in enumerate(texts):
            turn = stream_turn(client, text, decode_tokens, logit_bias=no_eos)
            res.long.append(turn)
            log(f"long request {i}: prefill {turn.prefill_tps:,.1f} tok/s, decode {turn.decode_tps:.1f} tok/s")
        res.batch = _attach_server_records(url, [res.first, *res.short, *res.long])
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return res
