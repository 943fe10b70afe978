"""Issue 19 items 1-2 on the user's path: `serve` on the GPU, driven over HTTP by concurrent streaming openai
clients. usage: batch.py MODEL TAG [serve args...]; env TESTS=streams,long (default both)."""
import json, os, subprocess, sys, threading, time
import httpx, openai
from ds4station.model.gguf import GGUFFile
from ds4station.engine.tokenizer import Tokenizer
from ds4station.server.bench import chat_text, stream_turn, wait_ready

model, tag, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
tests = os.environ.get("TESTS", "streams,long").split(",")
port = 8019
url = f"http://127.0.0.1:{port}"
tok = Tokenizer.from_metadata(GGUFFile.open(model).metadata)
t0 = time.monotonic()
proc = subprocess.Popen([sys.executable, "-m", "ds4station.cli", "serve", "--model", model, "--port", str(port), *extra],
                        stdout=subprocess.DEVNULL)


def client() -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=900)


def together(texts, max_tokens, delays=None):
    """Each text as its own streamed request from its own thread (sent `delays[i]` s after the first)."""
    out = [None] * len(texts)

    def one(i):
        time.sleep((delays or [0] * len(texts))[i])
        c = client()
        t = time.perf_counter()
        turn = stream_turn(c, texts[i], max_tokens)
        out[i] = (t, t + turn.ttft_s, t + turn.ttft_s + turn.stream_s, turn)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out


try:
    wait_ready(url, proc, 900)
    print(f"[{tag}] ready in {time.monotonic() - t0:.1f} s", flush=True)
    client().models.list()
    seed = 100
    if "streams" in tests:
        together([chat_text(tok, 64, 1)], 8)  # the client side warm
        single = None
        for n in (1, 2, 4, 8):
            texts = [chat_text(tok, 600, seed + i) for i in range(n)]
            seed += n
            res = together(texts, 200)
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
        st = httpx.get(url + "/status").json()
        print(f"[{tag}] batch", json.dumps(st.get("batch")), flush=True)
    if "long" in tests:
        long_text, short = chat_text(tok, 32768, 7), chat_text(tok, 20, 8)
        res = together([long_text, short], 16, delays=[0, 4.0])
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
        for r in status["batch"]["step_log"]:
            print(f"[{tag}] step", json.dumps(r), flush=True)
        res = together([chat_text(tok, 32768, 9)], 16)
        print(json.dumps({"tag": tag, "long_alone_prompt": res[0][3].prompt_tokens,
                          "long_alone_prefill_tok_s": round(res[0][3].prompt_tokens / (res[0][1] - res[0][0]), 1)}),
              flush=True)
    if "metrics" in tests:
        m = httpx.get(url + "/metrics").text
        print("\n".join(line for line in m.splitlines() if line.startswith(("ds4_step", "ds4_decode", "ds4_batch",
                                                                            "ds4_running", "ds4_steps"))))
finally:
    proc.terminate()
    proc.wait(60)
