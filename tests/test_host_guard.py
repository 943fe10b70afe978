"""The browser guard of a server without --api-key, against a real uvicorn server with raw httpx requests: a Host
that is not this machine (DNS rebinding) and a cross-origin Origin (the text/plain "simple" POST that skips the
CORS preflight included) get 403 in the endpoint's error shape and never reach the engine; loopback names, the
listening address, --allow-host names, the server's own origin and --cors origins pass; /health stays open;
with --api-key the key is the guard."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ds4station.commands import serve
from ds4station.engine.demo import make_model
from ds4station.engine.scheduler import Scheduler
from ds4station.server.app import BackgroundServer, create_app

CTX = 256
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("guard") / "tiny.gguf", preset="tiny", seed=0, quant="q2")


@pytest.fixture(scope="module")
def engine(model_path: Path):
    from ds4station.engine.engine import Engine

    return Engine.load(model_path, ctx=CTX, device="cpu", sessions=4)  # tests run two servers at once


@pytest.fixture
def start(engine, model_path: Path) -> Iterator:
    made: list[BackgroundServer] = []

    def run(**kw) -> BackgroundServer:
        scheduler = Scheduler(lambda: engine, ctx=CTX, sessions=1, owns_engine=False)
        made.append(BackgroundServer(create_app(scheduler, model_name="tiny", model_path=str(model_path), ctx=CTX,
                                                **kw)).start())
        assert made[-1].wait_ready(30) and scheduler.state == "ready"
        return made[-1]

    yield run
    for srv in made:
        srv.stop()


def requests_served(srv: BackgroundServer) -> int:
    return httpx.get(srv.url + "/status").json()["totals"]["requests"]


def test_a_foreign_host_is_refused_in_each_apis_shape_and_health_stays_open(start) -> None:
    srv = start()
    evil = {"Host": "attacker.example:8000"}
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers=evil)
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    assert "attacker.example" in r.json()["error"]["message"] and "--allow-host" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/messages", json=CHAT, headers=evil)
    assert r.status_code == 403 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "permission_error"
    for path in ("/v1/models", "/status", "/metrics"):
        assert httpx.get(srv.url + path, headers=evil).status_code == 403
    assert httpx.get(srv.url + "/health", headers=evil).status_code == 200  # liveness probes name any host
    assert requests_served(srv) == 0  # nothing reached the engine
    port = srv.url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST", "127.0.0.2:9", "localhost."):
        assert httpx.get(srv.url + "/v1/models", headers={"Host": host}).status_code == 200, host
    for host in ("localhost.attacker.example", "127.0.0.1.nip.io", "[::2]", ""):
        assert httpx.get(srv.url + "/v1/models", headers={"Host": host}).status_code == 403, host


def test_allowed_hosts_are_added_and_a_star_allows_any(start) -> None:
    srv = start(allowed_hosts=["box.lan", "[fd00::5]"])
    for host in ("box.lan", "BOX.LAN:8000", "[fd00::5]:8000"):
        assert httpx.get(srv.url + "/v1/models", headers={"Host": host}).status_code == 200, host
    assert httpx.get(srv.url + "/v1/models", headers={"Host": "other.lan"}).status_code == 403
    srv = start(allowed_hosts=["*"])
    assert httpx.get(srv.url + "/v1/models", headers={"Host": "anything.example"}).status_code == 200


def test_cross_origin_browser_requests_are_refused_unless_cors_allows_them(start) -> None:
    srv = start()
    simple = {"Origin": "http://evil.example", "Content-Type": "text/plain"}  # no preflight for this one
    r = httpx.post(srv.url + "/v1/chat/completions", content=json.dumps(CHAT), headers=simple)
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert "--cors http://evil.example" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/messages", content=json.dumps(CHAT), headers=simple)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    preflight = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(srv.url + "/v1/chat/completions", headers=preflight)
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    for origin in ("null", "file://", "http://localhost:1"):  # a port is part of the origin
        assert httpx.get(srv.url + "/v1/models", headers={"Origin": origin}).status_code == 403, origin
    assert requests_served(srv) == 0
    own = srv.url  # the server's own origin is not cross-origin
    assert httpx.get(srv.url + "/v1/models", headers={"Origin": own}).status_code == 200
    assert httpx.post(srv.url + "/v1/chat/completions", json=CHAT).status_code == 200  # no Origin: not a browser

    srv = start(cors=["http://app.example"])
    allowed = {"Origin": "http://app.example"}
    r = httpx.options(srv.url + "/v1/chat/completions", headers={**allowed, "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers=allowed)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    assert httpx.get(srv.url + "/v1/models", headers={"Origin": "http://evil.example"}).status_code == 403


def test_with_an_api_key_the_key_is_the_guard(start) -> None:
    srv = start(api_key="k")
    foreign = {"Host": "box.example", "Origin": "http://evil.example"}
    assert httpx.get(srv.url + "/v1/models", headers=foreign).status_code == 401
    r = httpx.get(srv.url + "/v1/models", headers={**foreign, "Authorization": "Bearer k"})
    assert r.status_code == 200


def test_serve_allows_its_listening_address_and_every_allow_host_name(model_path: Path) -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--model", str(model_path), "--ctx", str(CTX), "--sessions", "1", "--device", "cpu",
                              "--host", "127.0.0.1", "--allow-host", "a.lan,b.lan", "--allow-host", "c.lan"])
    app, _ = serve.build(args)
    srv = BackgroundServer(app).start()
    try:
        for host in ("a.lan", "b.lan:1", "c.lan", "127.0.0.1"):
            assert httpx.get(srv.url + "/v1/models", headers={"Host": host}, timeout=60).status_code == 200, host
        assert httpx.get(srv.url + "/v1/models", headers={"Host": "d.lan"}).status_code == 403
    finally:
        srv.stop()
