"""What a disk KV checkpoint of a 32K-token Flash prompt costs to write and to read back (engine/kvdisk.py):
the state `KVCache.state()` saves (float32 KV), through `write_state_file` / `read_state_file` (CRC-32 of
every tensor) and `KVCache.load_state`, on this machine's disk; then checks the restored state is the saved one.

    python docs/scripts/kv_disk_io.py [DIR] [POSITIONS]
"""
import pathlib
import sys
import tempfile
import time

import torch

from ds4station.engine.kv import KVCache
from ds4station.engine.kvdisk import read_state_file, write_state_file
from ds4station.model.config import FLASH

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
n = int(sys.argv[2]) if len(sys.argv) > 2 else 32768
ctx = n + 1024
saved = KVCache(FLASH, None, ctx, dtype=torch.float32, chunk=2048)
saved.advance(n)
for _, t in saved.state():
    t.normal_()
info = {"key": "bench", "positions": n}
for i in range(3):
    t0 = time.perf_counter()
    nbytes = write_state_file(root / "stage0.kv", info, saved.state())
    t1 = time.perf_counter()
    restored = KVCache(FLASH, None, ctx, dtype=torch.float32, chunk=2048)
    t2 = time.perf_counter()
    restored.load_state(n, read_state_file(root / "stage0.kv", info, "cpu"))
    t3 = time.perf_counter()
    print(f"run {i}: {nbytes / 2**20:.0f} MiB, write {t1 - t0:.2f} s, read + check + load {t3 - t2:.2f} s")
same = all(torch.equal(a, b) for (_, a), (_, b) in zip(saved.state(), restored.state(), strict=True))
print("restored state identical:", same)
