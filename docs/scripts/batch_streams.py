"""Issue 19 items 1-2 on the user's path: `serve` on the GPU, driven over HTTP by concurrent streaming openai
clients. usage: batch.py MODEL TAG [serve args...]; env TESTS=streams,long (default both), TEMPERATURE=T (the
requests' sampling temperature, default 0: greedy), STEPS=FILE (every
step of the server's step log, polled from /status while the tests run, one JSON line each, with the test it
belongs to; a summary of each test's steps is printed either way)."""
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import openai

from ds4station.engine.tokenizer import Tokenizer
from ds4station.model.gguf import GGUFFile
from ds4station.server.bench import chat_text, stream_turn, wait_ready

model, tag, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
tests = os.environ.get("TESTS", "streams,long").split(",")
port = 8019
url = f"http://127.0.0.1:{port}"
tok = Tokenizer.from_metadata(GGUFFile.open(model).metadata)
t0 = time.monotonic()
proc = subprocess.Popen([sys.executable, "-m", "ds4station.cli", "serve", "--model", model, "--port", str(port),
                         *extra],
                        stdout=subprocess.DEVNULL)


class StepLog:
    """Every step of the server's step log (/status shows the last 64): polled while the tests run."""

    def __init__(self) -> None:
        self.steps: dict[int, dict] = {}
        self.test = ""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self.stop.wait(0.25):
                try:
                    log = c.get(url + "/status").json()["batch"]["step_log"]
                except Exception:
                    continue
                for r in log:
                    self.steps.setdefault(r["step"], {**r, "test": self.test})

    def summary(self, test: str, streams: int = 0) -> dict:
        """The sums of each part of the test's steps; with `streams`, also the steady state: the median step in
        which all of them decoded and no prompt was prefilled, and its decode rate."""
        rows = [r for r in self.steps.values() if r["test"] == test]
        keys = ("wait_ms", "prefill_ms", "sample_ms", "forward_ms", "show_ms", "total_ms")
        span = (max(r["at"] for r in rows) - min(r["at"] for r in rows)) * 1000 if rows else 0.0
        steady = sorted(r["total_ms"] for r in rows if len(r["decoded"]) == streams and not r["prefilled"])
        if steady:
            ms = steady[len(steady) // 2]
            extra = {"steady_steps": len(steady), "steady_step_ms": round(ms, 2),
                     "steady_tok_s": round(1000 * streams / ms, 1)}
        else:
            extra = {}
        return {"test": test, "steps": len(rows), "span_ms": round(span, 1), **extra,
                "decode_rows": sum(len(r["decoded"]) for r in rows),
                "prefill_tokens": sum(sum(r["prefilled"].values()) for r in rows),
                **{k: round(sum(r[k] for r in rows), 1) for k in keys}}


steplog = StepLog()


def client() -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=900)


def together(texts, max_tokens, delays=None):
    """Each text as its own streamed request from its own thread (sent `delays[i]` s after the first)."""
    out = [None] * len(texts)

    def one(i):
        time.sleep((delays or [0] * len(texts))[i])
        c = client()
        t = time.perf_counter()
        try:
            turn = stream_turn(c, texts[i], max_tokens, float(os.environ.get("TEMPERATURE", "0")))
        except Exception as e:  # reported below, once every request has ended
            out[i] = e
            return
        out[i] = (t, t + turn.ttft_s, t + turn.ttft_s + turn.stream_s, turn)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    failed = [f"request {i}: {r!r}" for i, r in enumerate(out) if isinstance(r, Exception)]
    if failed:
        raise SystemExit(f"[{tag}] {len(failed)} of {len(texts)} requests failed: " + "; ".join(failed))
    return out


try:
    wait_ready(url, proc, 900)
    print(f"[{tag}] ready in {time.monotonic() - t0:.1f} s", flush=True)
    client().models.list()
    steplog.thread.start()
    seed = 100
    if "streams" in tests:
        together([chat_text(tok, 64, 1)], 8)  # the client side warm
        single = None
        for n in (1, 2, 4, 8):
            texts = [chat_text(tok, 600, seed + i) for i in range(n)]
            seed += n
            steplog.test = f"streams{n}"
            res = together(texts, 200)
            time.sleep(0.5)  # the poller's last look
            rates = [(r[3].completion_tokens - 1) / max(r[2] - r[1], 1e-9) for r in res]
            first, last = min(r[1] for r in res), max(r[2] for r in res)
            total = sum(r[3].completion_tokens - 1 for r in res)
            agg = total / (last - first)
            single = single or rates[0]
            print(json.dumps({"tag": tag, "streams": n, "per_stream_tok_s": [round(x, 1) for x in rates],
                              "min_stream": round(min(rates), 1), "sum_of_rates": round(sum(rates), 1),
                              "aggregate_tok_s": round(agg, 1), "x_single": round(agg / single, 2),
                              "min_vs_single": round(min(rates) / single, 2),
                              "ttft_s": [round(r[1] - r[0], 2) for r in res],
                              "completion": [r[3].completion_tokens for r in res]}), flush=True)
            print(f"[{tag}] steps", json.dumps(steplog.summary(f"streams{n}", n)), flush=True)
        st = httpx.get(url + "/status").json()
        print(f"[{tag}] batch", json.dumps(st.get("batch")), flush=True)
    if "long" in tests:
        long_text, short = chat_text(tok, 32768, 7), chat_text(tok, 20, 8)
        steplog.test = "long+short"
        res = together([long_text, short], 16, delays=[0, 4.0])
        time.sleep(0.5)
        print(f"[{tag}] steps", json.dumps(steplog.summary("long+short")), flush=True)
        (ls, lf, ll, lt), (ss, sf, sl, stt) = res
        print(json.dumps({"tag": tag, "long_prompt": lt.prompt_tokens, "long_ttft_s": round(lf - ls, 2),
                          "long_prefill_tok_s": round(lt.prompt_tokens / (lf - ls), 1),
                          "short_prompt": stt.prompt_tokens, "short_sent_at_s": round(ss - ls, 2),
                          "short_ttft_s": round(sf - ss, 3), "short_done_before_long": sl < lf}), flush=True)
        # the server's own view: each request's queue_ms and TTFT (a TTFT the server did not see is the HTTP
        # side's), and where the worker's time went step by step
        status = httpx.get(url + "/status").json()
        for r in status["throughput"]["recent"][-2:]:
            print(f"[{tag}] server record", json.dumps(r), flush=True)
        # the steps around the short request's: the first 12 that decoded it
        short_id = min(status["throughput"]["recent"][-2:], key=lambda r: r["prompt_tokens"])["id"]
        shown = [r for r in sorted(steplog.steps.values(), key=lambda r: r["step"]) if r["test"] == "long+short"]
        first = next((i for i, r in enumerate(shown) if str(short_id) in r["prefilled"] or short_id in r["decoded"]), 0)
        for r in shown[max(0, first - 3):first + 12]:
            print(f"[{tag}] step", json.dumps({k: v for k, v in r.items() if k != "test"}), flush=True)
        steplog.test = "long alone"
        res = together([chat_text(tok, 32768, 9)], 16)
        time.sleep(0.5)
        print(f"[{tag}] steps", json.dumps(steplog.summary("long alone")), flush=True)
        print(json.dumps({"tag": tag, "long_alone_prompt": res[0][3].prompt_tokens,
                          "long_alone_prefill_tok_s": round(res[0][3].prompt_tokens / (res[0][1] - res[0][0]), 1)}),
              flush=True)
    if "metrics" in tests:
        m = httpx.get(url + "/metrics").text
        print("\n".join(line for line in m.splitlines() if line.startswith(("ds4_step", "ds4_decode", "ds4_batch",
                                                                            "ds4_running", "ds4_steps"))))
finally:
    steplog.stop.set()
    if os.environ.get("STEPS"):
        with open(os.environ["STEPS"], "w") as f:
            for r in sorted(steplog.steps.values(), key=lambda r: r["step"]):
                f.write(json.dumps(r) + "\n")
    proc.terminate()
    proc.wait(60)
