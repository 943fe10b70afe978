"""Predicted (planner) vs measured (device) bytes per stage (issue 18), one fresh process per case.

    [EXPANDABLE=1] python3 docs/scripts/footprint_check.py FILE.gguf resident-1s,two-stages,...

Each case loads the engine as `serve --plan` would (chunk 2048, rollback 1024, its sessions and route), runs a
prompt of 2 x 2048 + 17 tokens (131,072 for resident-1M, timed) and 8 decode steps, then compares what
nvidia-smi reports per process (a CPU worker: its peak resident memory while the prompt and the decode steps
run, sampled every 5 ms; the load's peak is printed beside it) with the planner's prediction (`evaluate` with
the speed preset's footprint and the case's sessions). EXPANDABLE=1 sets
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as the `ds4station` command does.
"""

import json
import os
import subprocess
import sys
import time

path = sys.argv[1]
CASES = {
    "resident-1s": dict(route="cuda:0=embed,0-42,output", ctx=32768, sessions=1),
    "resident-2s": dict(route="cuda:0=embed,0-42,output", ctx=32768, sessions=2),
    "stream-8GiB": dict(route="cuda:0=embed,0-42,output,cache=8GiB", ctx=32768, sessions=2),
    "two-stages": dict(route="cuda:0=embed,0-20,output; cuda:0=21-42", ctx=32768, sessions=2),
    "cpu-stage": dict(route="cuda:0=embed,0-40,output; cpu=41-42", ctx=32768, sessions=2, warm=False),
    "resident-1M": dict(route="cuda:0=embed,0-42,output", ctx=1048576, sessions=1, long=131072),
}


def host_rss(pid: int) -> dict[str, int]:
    """The process's resident memory from /proc (bytes): VmRSS and its anonymous / file / shmem parts (a
    CPU stage: anonymous is what it allocated, file and shmem the pages of the mapped GGUF it touched)."""
    out = {}
    for line in open(f"/proc/{pid}/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) << 10
    return out


class Sampler:
    """Peak VmRSS / RssAnon / RssShmem / RssFile of this process's children (the stage workers), sampled
    every 5 ms, per phase: "load" (Engine.load) and "run" (the prompt and decode steps). A CPU stage's
    measured memory is its peak VmRSS of the run phase."""

    def __init__(self):
        import threading

        self.phase, self.peaks, self.stop = "load", {}, False
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def kids(self):
        import glob

        out = []
        for f in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
            try:
                out += [int(x) for x in open(f).read().split()]
            except OSError:
                pass
        return out

    def run(self):
        while not self.stop:
            for pid in self.kids():
                try:
                    r = host_rss(pid)
                except OSError:
                    continue
                pk = self.peaks.setdefault(self.phase, {}).setdefault(pid, {})
                r["AnonShmem"] = r.get("RssAnon", 0) + r.get("RssShmem", 0)
                for k, v in r.items():
                    pk[k] = max(pk.get(k, 0), v)
            time.sleep(0.005)


def used_by_pid() -> dict[int, int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
    ).stdout
    return {int(p): int(m) << 20 for p, m in (l.split(",") for l in out.strip().splitlines() if l.strip())}


def predict(c: dict) -> list[int]:
    import dataclasses

    from ds4station.model.gguf import GGUFFile
    from ds4station.model.route import parse_route
    from ds4station.planner import evaluate, load_preset, parse_gpu_spec, shape_from_specs

    f = GGUFFile.open(path)
    shape = shape_from_specs(f.path.name, f.config, f.tensor_specs())
    route = parse_route(c["route"], 43)
    st = load_preset("speed")
    st = dataclasses.replace(
        st, footprint=dataclasses.replace(st.footprint, sessions=c["sessions"], prefill_chunk=2048, rollback=1024)
    )
    budgets = parse_gpu_spec(",".join("cpu" if s.device == "cpu" else "139GiB" for s in route.stages), 120 * 2**30)
    plan = evaluate(shape, route, budgets, st, c["ctx"])
    return [s.footprint.predicted_bytes for s in plan.stages], [dataclasses.asdict(s.footprint) for s in plan.stages]


def run_case(name: str) -> None:
    import torch

    from ds4station.engine.engine import Engine

    c = CASES[name]
    sampler = Sampler()
    t0 = time.monotonic()
    e = Engine.load(path, c["ctx"], c["route"], sessions=c["sessions"], chunk=2048, rollback=1024,
                    warm=c.get("warm", True))
    load_s = time.monotonic() - t0
    sampler.phase = "run"
    s = e.new_session()
    gen = torch.Generator().manual_seed(1)
    n = c.get("long", 2 * 2048 + 17)
    toks = torch.randint(1000, 120000, (n,), generator=gen).tolist()
    t = time.monotonic()
    lg = s.extend(toks)
    torch.cuda.synchronize()
    pre = time.monotonic() - t
    out = [int(lg.argmax())]
    for _ in range(8):
        out.append(int(s.extend([out[-1]]).argmax()))
    pids = [os.getpid(), *[p.pid for p in e.procs.values()]]
    used = used_by_pid()
    free, total = torch.cuda.mem_get_info()
    pred, parts = predict(c)
    row = {
        "case": name,
        **c,
        "load_s": round(load_s, 1),
        "prefill_tokens": n,
        "prefill_s": round(pre, 2),
        "prefill_tok_s": round(n / pre, 1),
        "measured": [used.get(p) or sampler.peaks.get("run", {}).get(p, {}).get("VmRSS") for p in pids],
        "host": {p: host_rss(p) for p in pids},
        "predicted": pred,
        "peaks": sampler.peaks,
        "device_used": total - free,
        "torch_reserved": torch.cuda.memory_reserved(),
        "torch_peak_alloc": torch.cuda.max_memory_allocated(),
        "kv_allocated": e.runner.kv_bytes(),
        "parts": parts,
        "cache": (e.stage_stats()[0].get("expert_cache") or {}).get("device_bytes"),
    }
    print("ROW " + json.dumps(row), flush=True)
    s.close()
    e.close()


if __name__ == "__main__":
    if len(sys.argv) > 3:
        run_case(sys.argv[3])
        sys.exit(0)
    names = sys.argv[2].split(",")
    for name in names:
        env = dict(os.environ)
        if os.environ.get("EXPANDABLE"):
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        r = subprocess.run(
            [sys.executable, __file__, path, "", name], capture_output=True, text=True, timeout=400, env=env
        )
        rows = [l[4:] for l in r.stdout.splitlines() if l.startswith("ROW ")]
        if not rows:
            print(name, "FAILED", r.stderr[-1500:], flush=True)
            continue
        row = json.loads(rows[0])
        G = 2**30
        meas = [m / G if m else None for m in row["measured"]]
        pred = [p / G for p in row["predicted"]]
        tag = " (expandable segments)" if os.environ.get("EXPANDABLE") else ""
        measured = [f"{m:.2f}" if m else "-" for m in meas]
        err = ["%+.1f%%" % (100 * (p - m) / m) if m else "-" for p, m in zip(pred, meas, strict=True)]
        print(
            f"{name}{tag}: measured {measured} GiB, predicted {[f'{p:.2f}' for p in pred]} GiB, err {err}; "
            f"prefill {row['prefill_tokens']} tok {row['prefill_tok_s']} tok/s; load {row['load_s']} s",
            flush=True,
        )
        print("  host " + json.dumps(row["host"]), flush=True)
        for ph, per in row["peaks"].items():
            for pid, pk in per.items():
                values = ", ".join(f"{k} {v / G:.2f}" for k, v in pk.items())
                print(f"  peak {ph} pid {pid}: {values} GiB", flush=True)
        print(
            "  "
            + json.dumps(
                {
                    k: row[k]
                    for k in ("device_used", "torch_reserved", "torch_peak_alloc", "kv_allocated", "cache", "parts")
                }
            ),
            flush=True,
        )
