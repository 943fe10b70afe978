"""Streamed experts on one GPU (issue 18): greedy tokens vs resident, decode tok/s, hit rate, device memory.

    python3 docs/scripts/streaming_matrix.py FILE.gguf OUT.json ",32GiB,8GiB,2GiB" [CTX=8192] [TOKENS=40]

One engine per cache size ("" = resident), each after a 512-token prompt (seed 7) decoding TOKENS greedy
tokens; decode tok/s over the tokens after the fifth; hit rate and GB/s over the whole run (prefill included).
"""

import gc
import hashlib
import json
import sys
import time

import torch

from ds4station.engine.engine import Engine

path, out = sys.argv[1], sys.argv[2]
caches = sys.argv[3].split(",")  # "" = resident
ctx = int(sys.argv[4]) if len(sys.argv) > 4 else 8192
N = int(sys.argv[5]) if len(sys.argv) > 5 else 40
gen = torch.Generator().manual_seed(7)
prompt = torch.randint(1000, 120000, (512,), generator=gen).tolist()
rows = []
for c in caches:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.monotonic()
    e = Engine.load(path, ctx=ctx, device="cuda", expert_cache=c or None, sessions=1)
    load_s = time.monotonic() - t0
    s = e.new_session()
    torch.cuda.synchronize()
    t = time.monotonic()
    logits = s.extend(prompt)
    torch.cuda.synchronize()
    pre_s = time.monotonic() - t
    toks = [int(logits.argmax())]
    stamps = []
    for _ in range(N):
        toks.append(int(s.extend([toks[-1]]).argmax()))
        stamps.append(time.monotonic())
    dec = (len(stamps) - 5) / (stamps[-1] - stamps[4])
    st = e.stage_stats()[0]
    cache = st.get("expert_cache") or {}
    h = hashlib.sha256(json.dumps(toks).encode()).hexdigest()[:16]
    row = {
        "cache": c or "resident",
        "load_s": round(load_s, 1),
        "prefill_tok_s": round(len(prompt) / pre_s, 1),
        "decode_tok_s": round(dec, 2),
        "hash": h,
        "tokens": toks[:8],
        "hit_rate": round(cache["hits"] / cache["lookups"], 3) if cache.get("lookups") else None,
        "gb_per_s": cache.get("gb_per_s"),
        "misses": cache.get("misses"),
        "bytes_read": cache.get("bytes_read"),
        "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 2),
    }
    print(json.dumps(row), flush=True)
    rows.append(row)
    s.close()
    e.close()
    del s, e
    gc.collect()
    torch.cuda.empty_cache()
json.dump(rows, open(out, "w"), indent=1)
hashes = {r["hash"] for r in rows}
print("same greedy tokens everywhere:", len(hashes) == 1)
