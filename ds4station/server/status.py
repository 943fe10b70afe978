"""Operations endpoints: GET /health, GET /status (JSON for the TUI) and GET /metrics (Prometheus).

`router` holds /health, which needs no API key; app.py mounts `status` and `metrics` behind the key check.

/health is 503 with the reason while the model loads, while the route restarts after a stage died (with the
attempt), while the server shuts down, when loading or every restart failed, or when the engine reports a stage
down. /status is one JSON document with what the control panel shows: the model, the state (and the restart
in progress), the route and per-stage memory and worker pids, KV use and live sessions, the queue and the
running request, recent throughput, expert-cache stats.
/metrics exposes counters and histograms from the scheduler's per-request reports.

An engine may offer `status() -> dict` (keys `route`, `stages`, `expert_cache`, `health`: None or the reason a
stage is down); the CPU reference engine does not need to, and sensible defaults are reported for it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ds4station.engine.scheduler import Finished, Job, Scheduler

router = APIRouter()

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)


class Metrics:
    """The Prometheus metrics of one server (its own registry, so several servers can share a process)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http = Counter("ds4_http_requests", "HTTP requests by route and status code", ["route", "status"],
                            registry=r)
        self.generations = Counter("ds4_generations", "Finished generations by endpoint and finish reason",
                                   ["kind", "reason"], registry=r)
        self.prompt_tokens = Counter("ds4_prompt_tokens", "Prompt tokens of finished generations", registry=r)
        self.cached_tokens = Counter("ds4_prompt_cached_tokens", "Prompt tokens served from the live KV",
                                     registry=r)
        self.completion_tokens = Counter("ds4_completion_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("ds4_time_to_first_token_seconds", "Queueing + prefill + first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("ds4_time_per_output_token_seconds", "Decode time per generated token",
                              buckets=_TPOT_BUCKETS, registry=r)
        r.register(_SchedulerCollector(scheduler))

    def observe(self, job: Job, fin: Finished) -> None:
        """Called by the scheduler's worker thread for every finished request."""
        self.generations.labels(job.kind, fin.reason).inc()
        self.prompt_tokens.inc(fin.prompt_tokens)
        self.cached_tokens.inc(fin.cached_tokens)
        self.completion_tokens.inc(fin.completion_tokens)
        if fin.completion_tokens:
            self.ttft.observe(fin.ttft_ms / 1000.0)
        if fin.completion_tokens > 1:
            self.tpot.observe(fin.timings.predicted_ms / 1000.0 / fin.completion_tokens)


class _SchedulerCollector(Collector):
    """Gauges read from the scheduler at scrape time (queue, sessions, KV bytes, prefix-cache counters)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterator[Any]:
        st = self.scheduler.status()
        yield GaugeMetricFamily("ds4_queue_length", "Requests waiting for a place in the batch", st["queue"]["length"])
        yield GaugeMetricFamily("ds4_running", "Requests running now (prefilling or decoding)", len(st["running"]))
        batch = st["batch"]
        yield GaugeMetricFamily("ds4_batch_limit", "Requests that may run at once (--batch)", batch["limit"])
        last = batch["last_step"] or {"decoded": 0, "prefill_tokens": 0}
        yield GaugeMetricFamily("ds4_step_decode_batch", "Requests in the last step's batched decode",
                                last["decoded"])
        yield GaugeMetricFamily("ds4_step_prefill_tokens", "Prompt tokens prefilled in the last step",
                                last["prefill_tokens"])
        yield GaugeMetricFamily("ds4_step_seconds", "Worker time of the last step (its host time: on a GPU, what it "
                                "waited for included)", last.get("ms", 0.0) / 1000)
        yield CounterMetricFamily("ds4_steps", "Scheduler steps run", batch["steps"])
        yield CounterMetricFamily("ds4_decode_steps", "Steps that ran a decode (batched or one request)",
                                  batch["decode_steps"])
        yield CounterMetricFamily("ds4_decode_rows", "Tokens decoded by the steps' decodes (rows / steps = mean "
                                  "batch)", batch["decode_rows"])
        yield CounterMetricFamily("ds4_step_prefill_tokens_sum", "Prompt tokens prefilled by the steps",
                                  batch["prefill_tokens"])
        yield CounterMetricFamily("ds4_decode_ahead_steps", "Decode steps queued before the tokens they feed were "
                                  "read (the GPU did not wait for the host)", batch.get("ahead_steps", 0))
        draft = st.get("draft") or {}
        if draft.get("source", "off") != "off":  # serve --draft
            yield CounterMetricFamily("ds4_draft_verify_steps", "Steps that verified drafted tokens", draft["steps"])
            yield CounterMetricFamily("ds4_draft_tokens", "Drafted tokens verified", draft["drafted"])
            yield CounterMetricFamily("ds4_draft_accepted", "Drafted tokens accepted", draft["accepted"])
        sessions = st["sessions"]
        yield GaugeMetricFamily("ds4_live_sessions", "Live KV sessions held", len(sessions["live"]))
        yield GaugeMetricFamily("ds4_kv_bytes", "Bytes of KV held by the live sessions", sessions["kv_bytes"])
        yield GaugeMetricFamily("ds4_kv_tokens", "Tokens held by the live sessions",
                                sum(s["tokens"] for s in sessions["live"]))
        yield CounterMetricFamily("ds4_prefix_cache_hits", "Requests that reused a live KV prefix",
                                  sessions["prefix_hits"])
        yield CounterMetricFamily("ds4_prefix_cache_misses", "Requests prefilled from scratch",
                                  sessions["prefix_misses"])
        yield CounterMetricFamily("ds4_prefix_checkpoint_hits", "Prefix hits served from a session's prompt "
                                  "checkpoint, further back than --rollback", sessions["checkpoint_hits"])
        disk = sessions.get("disk")
        if disk:  # serve --kv-disk-dir
            yield CounterMetricFamily("ds4_kv_disk_hits", "Prompts served from a disk KV checkpoint", disk["hits"])
            yield CounterMetricFamily("ds4_kv_disk_saves", "Prompts' KV states saved to the disk", disk["saves"])
            yield CounterMetricFamily("ds4_kv_disk_failures", "Disk KV checkpoints that failed to save or load "
                                      "(each logged)", disk["failures"])
            yield GaugeMetricFamily("ds4_kv_disk_bytes", "Bytes the disk KV checkpoints take (at most)",
                                    disk["used_bytes"])
            yield GaugeMetricFamily("ds4_kv_disk_budget_bytes", "The disk KV checkpoints' budget", disk["budget_bytes"])
            yield GaugeMetricFamily("ds4_kv_disk_entries", "Disk KV checkpoints of this model and route",
                                    disk["entries"])
        yield GaugeMetricFamily("ds4_ready", "1 when the model is loaded and serving", 1 if st["state"] == "ready"
                                else 0)
        cache = _engine_status(self.scheduler).get("expert_cache")
        if cache:  # streamed routed experts (a route stage with cache=), summed over the stages
            for key, help_ in (("lookups", "Routed-expert lookups"), ("hits", "Routed experts found in the cache"),
                               ("misses", "Routed experts read from the model file"),
                               ("prefetched", "Misses read ahead of their layer (hash-routed layers)"),
                               ("evictions", "Routed experts evicted from the cache")):
                yield CounterMetricFamily(f"ds4_expert_cache_{key}", help_, cache[key])
            yield CounterMetricFamily("ds4_expert_cache_read_bytes", "Bytes of routed experts streamed in",
                                      cache["bytes_read"])
            yield CounterMetricFamily("ds4_expert_cache_stream_seconds", "Wall time spent streaming routed experts",
                                      cache["stream_s"])
            yield GaugeMetricFamily("ds4_expert_cache_capacity_bytes", "Bytes of the expert caches",
                                    cache["capacity_bytes"])


def _engine_status(scheduler: Scheduler) -> dict[str, Any]:
    engine = scheduler.engine
    hook = getattr(engine, "status", None)
    if callable(hook):
        try:
            return dict(hook())
        except Exception as e:  # a stage that cannot answer is down
            return {"health": f"engine status failed: {type(e).__name__}: {e}"}
    return {}


@router.api_route("/", methods=["GET", "HEAD"])
async def root(request: Request) -> JSONResponse:
    """What answers here (clients' connectivity checks, e.g. Claude Code's HEAD /): the server and its model."""
    st = request.app.state.ds4
    return JSONResponse({"name": "ds4station", "model": st.model_name, "health": "/health"})


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    st = request.app.state.ds4
    sched: Scheduler = st.scheduler
    if sched.state == "loading":
        return JSONResponse({"status": "loading", "reason": "the model is loading"}, status_code=503,
                            headers={"Retry-After": "5"})
    if sched.state == "restarting":
        restart = sched.restart or {}
        return JSONResponse({"status": "restarting", "reason": sched.unavailable(),
                             "attempt": restart.get("attempt"), "attempts": restart.get("attempts")},
                            status_code=503, headers={"Retry-After": "5"})
    if sched.state == "stopping":
        return JSONResponse({"status": "stopping", "reason": sched.unavailable()}, status_code=503)
    if sched.state != "ready":
        return JSONResponse({"status": "error", "reason": sched.error or f"the engine is {sched.state}"},
                            status_code=503)
    down = _engine_status(sched).get("health")
    if down:
        return JSONResponse({"status": "error", "reason": down}, status_code=503)
    if not st.warm.is_set():
        return JSONResponse({"status": "loading", "reason": "the server is making its first requests"},
                            status_code=503, headers={"Retry-After": "1"})
    return JSONResponse({"status": "ok", "model": st.model_name})


async def status(request: Request) -> dict[str, Any]:
    st = request.app.state.ds4
    sched: Scheduler = st.scheduler
    s = sched.status()
    engine = sched.engine
    cfg = getattr(engine, "cfg", None)
    extra = _engine_status(sched)
    n_layers = getattr(cfg, "n_layers", None)
    device = str(getattr(engine, "device", "cpu"))
    recent = s["recent"]
    done = [r for r in recent if r["completion_tokens"]]
    return {
        "model": {"name": st.model_name, "path": st.model_path, "ctx": st.ctx,
                  "config": None if cfg is None else {k: getattr(cfg, k) for k in (
                      "n_layers", "dim", "vocab_size", "n_experts", "n_experts_used", "context_length")}},
        "state": s["state"], "error": s["error"], "restart": s["restart"], "restarts": s["restarts"],
        "uptime_s": round(time.time() - st.started_at, 3),
        "route": extra.get("route") or (f"{device}: embed, 0-{n_layers - 1}, output" if n_layers else None),
        "stages": _stages(sched, extra, device, n_layers, s["sessions"]["kv_bytes"]),
        "kv": {"bytes": s["sessions"]["kv_bytes"], "tokens": sum(x["tokens"] for x in s["sessions"]["live"]),
               "ctx": st.ctx},
        "sessions": s["sessions"], "queue": s["queue"], "running": s["running"], "batch": s["batch"],
        "draft": s["draft"],
        "throughput": {
            "recent": recent,
            "prompt_tokens_per_second": _mean(r["prompt_per_second"] for r in recent if r["prompt_per_second"]),
            "decode_tokens_per_second": _mean(r["predicted_per_second"] for r in done if r["predicted_per_second"]),
        },
        "totals": s["totals"], "replay_store": {"entries": len(st.replay), "hits": st.replay.hits},
        "expert_cache": extra.get("expert_cache"),
    }


def _stages(sched: Scheduler, extra: dict[str, Any], device: str, n_layers: int | None,
            kv_bytes: int) -> list[dict[str, Any]]:
    """The engine's stages (one placeholder while it loads), stage 0 with its weight bytes read so far."""
    stages = [dict(st) for st in extra.get("stages") or [{"device": device, "layers": [0, n_layers],
                                                          "kv_bytes": kv_bytes}]]
    if sched.load_progress is not None:
        stages[0]["loaded_bytes"], stages[0]["weights_bytes"] = sched.load_progress
    return stages


def _mean(values: Any) -> float | None:
    vals = list(values)
    return round(sum(vals) / len(vals), 3) if vals else None


async def metrics(request: Request) -> Response:
    m: Metrics = request.app.state.ds4.metrics
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
