"""Issue 19, item 3 on the user's path: `ds4station serve` on FILE, turn 1 with a long answer, turn 2 with the
answer's reasoning dropped (and, in a second conversation, sent back): turn 2's cached tokens as the server
reports them, and the pool's counters.

    python3 docs/scripts/turn_reuse.py FILE.gguf [WORDS=2500] [ANSWER_TOKENS=1500]
"""
import json
import random
import subprocess
import sys
import time

import httpx
import openai

from ds4station.server.bench import wait_ready

port = 8017
url = f"http://127.0.0.1:{port}"
n_words = int(sys.argv[2]) if len(sys.argv) > 2 else 2500
n_answer = int(sys.argv[3]) if len(sys.argv) > 3 else 1500
proc = subprocess.Popen([sys.executable, "-m", "ds4station.cli", "serve", "--model", sys.argv[1], "--port", str(port)],
                        stdout=subprocess.DEVNULL)
try:
    t0 = time.monotonic()
    wait_ready(url, proc, 900)
    print(f"ready in {time.monotonic() - t0:.1f} s", flush=True)
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    words = "station model token agent kernel graph cache route layer expert prefill decode stream window".split()
    for send_back in (False, True):
        rng = random.Random(int(send_back))
        user1 = " ".join(rng.choice(words) for _ in range(n_words))
        m1 = [{"role": "user", "content": user1}]
        r1 = c.chat.completions.create(model="m", messages=m1, max_tokens=n_answer, temperature=0)
        msg = r1.choices[0].message
        reasoning = getattr(msg, "reasoning_content", None) or (msg.model_extra or {}).get("reasoning_content")
        a = {"role": "assistant", "content": msg.content or ""}
        if send_back and reasoning:
            a["reasoning_content"] = reasoning
        m2 = m1 + [a, {"role": "user", "content": "Now shorter, please."}]
        r2 = c.chat.completions.create(model="m", messages=m2, max_tokens=8, temperature=0)
        d2 = r2.usage.prompt_tokens_details
        print(json.dumps({"reasoning_sent_back": send_back, "turn1_prompt": r1.usage.prompt_tokens,
                          "turn1_completion": r1.usage.completion_tokens, "turn1_finish": r1.choices[0].finish_reason,
                          "turn1_reasoning_chars": len(reasoning or ""), "turn2_prompt": r2.usage.prompt_tokens,
                          "turn2_cached": d2.cached_tokens if d2 else None}), flush=True)
    st = httpx.get(url + "/status").json()["sessions"]
    print("sessions", {k: st[k] for k in ("prefix_hits", "prefix_misses", "resets", "checkpoint_hits")}, flush=True)
finally:
    proc.terminate()
    proc.wait(30)
