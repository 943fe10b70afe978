"""The server's own first requests (server/warmup.py): one streamed request per API dialect through the real
ASGI stack before /health says ok, leaving no trace in what clients see (statistics, metrics, the live KV,
request ids). A real uvicorn server on the tiny model (CPU)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from ds4station.engine.demo import make_model
from ds4station.engine.scheduler import Scheduler
from ds4station.server import warmup
from ds4station.server.app import BackgroundServer, create_app

CTX = 1024


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    from ds4station.engine.engine import Engine

    path = make_model(tmp_path_factory.mktemp("model") / "tiny.gguf", preset="tiny", seed=0, quant="q2")
    return Engine.load(path, ctx=CTX, device="cpu", sessions=2)


def _server(engine, **kw) -> tuple[BackgroundServer, Scheduler]:
    scheduler = Scheduler(lambda: engine, ctx=CTX, sessions=2, owns_engine=False)
    app = create_app(scheduler, model_name="tiny", model_path="tiny.gguf", ctx=CTX, **kw)
    return BackgroundServer(app).start(), scheduler


def test_health_waits_for_the_warm_up_which_leaves_nothing_behind(engine, monkeypatch) -> None:
    calls: list[str] = []
    real_call = warmup.call
    gate = threading.Event()

    async def recorded(app, path, body, api_key):  # the real requests, held until the test has looked
        calls.append(path)
        await asyncio.to_thread(gate.wait, 30)
        return await real_call(app, path, body, api_key)

    monkeypatch.setattr(warmup, "call", recorded)
    srv, scheduler = _server(engine)
    try:
        assert scheduler.ready.wait(30)
        deadline = time.monotonic() + 10
        while not calls:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading" and "first requests" in r.json()["reason"]
        gate.set()
        assert srv.wait_ready(30)
        assert httpx.get(srv.url + "/health").status_code == 200
        assert calls == ["/v1/chat/completions", "/v1/messages", "/v1/responses"]
        st = httpx.get(srv.url + "/status").json()
        assert st["totals"]["requests"] == 0 and st["throughput"]["recent"] == []
        assert st["sessions"]["live"] == [] and st["sessions"]["prefix_misses"] == 0
        assert st["queue"]["length"] == 0 and st["running"] == []  # every warm-up request ran to its end
        metrics = httpx.get(srv.url + "/metrics").text
        assert "/v1/chat/completions" not in metrics and "/v1/messages" not in metrics
        # the first client request is request 1, with nothing cached from the warm-up
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        recent = httpx.get(srv.url + "/status").json()["throughput"]["recent"]
        assert [x["id"] for x in recent] == [1]
        assert 'route="/v1/chat/completions",status="200"} 1.0' in httpx.get(srv.url + "/metrics").text
    finally:
        gate.set()
        srv.stop()


def test_every_dialect_answers_the_warm_up_and_a_failure_is_reported(engine) -> None:
    srv, scheduler = _server(engine, api_key="k")
    try:
        assert srv.wait_ready(30)
        app = srv.server.config.app
        assert asyncio.run(warmup.warm(app, "tiny", "k")) == []
        failed = asyncio.run(warmup.warm(app, "tiny", "wrong key"))  # the check can fail: 401 from each dialect
        assert len(failed) == 3 and all(" 401 " in f for f in failed)
        assert scheduler.status()["totals"]["requests"] == 0
    finally:
        srv.stop()
