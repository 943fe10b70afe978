"""Issue 19 item 4 on the user's path: a 32K-token conversation restored from a disk KV checkpoint through
`serve`, against prefilling it. usage: kv_disk_serve.py MODEL KV_DIR [TOKENS] [serve args...]

`serve --sessions 1 --kv-disk-dir KV_DIR`: turn A (a TOKENS-token chat prompt) is prefilled and saved at its
end; an unrelated request takes the only session; A is sent again and is restored from the disk. Prints the
time to first token of each, the cached tokens the server reports, and /status sessions.disk."""
import json
import subprocess
import sys
import time

import httpx
import openai

from ds4station.engine.tokenizer import Tokenizer
from ds4station.model.gguf import GGUFFile
from ds4station.server.bench import chat_text, stream_turn, wait_ready

model, kv_dir = sys.argv[1], sys.argv[2]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 32768
extra = sys.argv[4:]
port = 8021
url = f"http://127.0.0.1:{port}"
tok = Tokenizer.from_metadata(GGUFFile.open(model).metadata)
t0 = time.monotonic()
proc = subprocess.Popen([sys.executable, "-m", "ds4station.cli", "serve", "--model", model, "--port", str(port),
                         "--sessions", "1", "--ctx", str(n + 8192), "--kv-disk-dir", kv_dir, *extra],
                        stdout=subprocess.DEVNULL)
try:
    wait_ready(url, proc, 900)
    print(f"ready in {time.monotonic() - t0:.1f} s", flush=True)
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=900)
    c.models.list()
    long_text = chat_text(tok, n, 31)
    rows = []
    for label, text in (("A, prefilled", long_text), ("B, unrelated (takes the session)", chat_text(tok, 600, 32)),
                        ("A again, from the disk", long_text)):
        turn = stream_turn(c, text, 8)
        rows.append({"turn": label, "prompt": turn.prompt_tokens, "cached": turn.cached_tokens,
                     "ttft_s": round(turn.ttft_s, 3)})
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"restore_speedup": round(rows[0]["ttft_s"] / rows[2]["ttft_s"], 1)}), flush=True)
    print("disk", json.dumps(httpx.get(url + "/status").json()["sessions"].get("disk")), flush=True)
finally:
    proc.terminate()
    proc.wait(60)
