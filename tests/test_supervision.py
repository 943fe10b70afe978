"""A supervised route behind the API server: a stage worker killed with SIGKILL fails the request in flight (an
error event in its stream) and the queued and new ones (503 + Retry-After), the scheduler reloads the route by
itself and requests are served again, without restarting the server; when every restart fails, /health stays
503 with the reason. Real worker processes over gloo (a 3-stage CPU route of the tiny model), a real uvicorn
server, the official openai SDK as the client."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from ds4station.commands import serve
from ds4station.engine.demo import make_model
from ds4station.engine.engine import Engine
from ds4station.engine.scheduler import Scheduler
from ds4station.server.app import BackgroundServer, create_app

ROUTE = "cpu=embed,0-1; cpu=2-3; cpu=4-5,output"
CTX = 2048
MESSAGES = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("supervised") / "tiny.gguf", preset="tiny", seed=0, quant="q2")


def oai(srv: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def status(srv: BackgroundServer) -> dict:
    return httpx.get(srv.url + "/status", timeout=30).json()


def wait_for(srv: BackgroundServer, ready, timeout: float = 90.0) -> dict:
    """Poll /status until `ready(status)` holds; -> that status."""
    deadline = time.monotonic() + timeout
    while not ready(st := status(srv)):
        assert time.monotonic() < deadline, st
        time.sleep(0.05)
    return st


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_killed_stage_fails_its_requests_with_503_then_the_route_restarts(model_path: Path, capfd) -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--model", str(model_path), "--route", ROUTE, "--ctx", str(CTX), "--sessions", "1",
                              "--restarts", "2"])
    app, _ = serve.build(args)
    srv = BackgroundServer(app).start()
    try:
        st = wait_for(srv, lambda s: s["state"] == "ready")
        assert srv.wait_ready(60)  # and the server's own first requests are done
        pids = [s["pid"] for s in st["stages"]]
        assert pids[0] == os.getpid() and all(alive(p) for p in pids[1:]), st["stages"]
        client = oai(srv)
        eos = app.state.ds4.tokenizer.eos_id
        stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1500, stream=True,
                                                logit_bias={str(eos): -100}, extra_body={"thinking": False})
        chunks = iter(stream)
        while not next(chunks).choices[0].delta.content:  # decoding now
            pass
        queued: list[BaseException] = []

        def behind() -> None:
            try:
                client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                               extra_body={"thinking": False})
            except BaseException as e:
                queued.append(e)

        waiter = threading.Thread(target=behind)
        waiter.start()
        wait_for(srv, lambda s: s["queue"]["length"] == 1)
        os.kill(pids[1], signal.SIGKILL)

        with pytest.raises(openai.APIError) as in_flight:  # the open stream ends with an error event
            for _ in chunks:
                pass
        assert "stage 1" in str(in_flight.value) and "restarting" in str(in_flight.value)
        waiter.join(60)
        assert len(queued) == 1 and isinstance(queued[0], openai.APIStatusError)
        assert queued[0].status_code == 503 and int(queued[0].response.headers["retry-after"]) >= 1

        health = httpx.get(srv.url + "/health", timeout=30)  # the backoff alone lasts a second
        assert health.status_code == 503 and health.headers["retry-after"]
        assert health.json()["status"] == "restarting" and health.json()["attempt"] == 1
        assert "stage 1" in health.json()["reason"]
        refused = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                             json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2})
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert "error" in refused.json()

        st = wait_for(srv, lambda s: s["state"] == "ready")  # restarted on its own
        assert st["restarts"] == 1 and st["restart"] is None
        new_pids = [s["pid"] for s in st["stages"]]
        assert all(s["state"] == "up" for s in st["stages"])
        assert set(new_pids[1:]).isdisjoint(pids[1:]) and not alive(pids[2])  # the old workers are gone
        answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3,
                                                logit_bias={str(eos): -100}, extra_body={"thinking": False})
        assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 3
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
    finally:
        srv.stop()
    err = capfd.readouterr().err
    assert "restarting the route in 1 s (attempt 1 of 2)" in err and "the route is serving again" in err


def test_when_every_restart_fails_health_stays_503_with_the_reason(model_path: Path, tmp_path: Path,
                                                                   capfd) -> None:
    path = tmp_path / "tiny.gguf"
    shutil.copy(model_path, path)
    scheduler = Scheduler(lambda: Engine.load(path, 256, ROUTE, sessions=1), ctx=256, sessions=1, max_restarts=2,
                          restart_backoff=0.05)
    srv = BackgroundServer(create_app(scheduler, model_name="tiny", model_path=str(path), ctx=256)).start()
    try:
        st = wait_for(srv, lambda s: s["state"] == "ready")
        assert srv.wait_ready(60)
        broken = tmp_path / "broken.gguf"
        broken.write_bytes(b"GGUF" + b"\0" * 64)
        os.replace(broken, path)  # a new file: the running engine keeps its mapping of the old one
        os.kill(st["stages"][2]["pid"], signal.SIGKILL)  # while idle: the scheduler's health poll notices
        st = wait_for(srv, lambda s: s["state"] == "failed")
        health = httpx.get(srv.url + "/health", timeout=30)
        assert health.status_code == 503 and health.json()["status"] == "error"
        reason = health.json()["reason"]
        assert "stage 2" in reason and "did not come back after 2 restart attempt(s)" in reason, reason
        refused = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                             json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_not_ready"
    finally:
        srv.stop()
    err = capfd.readouterr().err
    assert "restart attempt 1 of 2 failed" in err and "restart attempt 2 of 2 failed" in err


_FAILING_LOAD = """
import socket, sys
from ds4station.engine.scheduler import Scheduler
from ds4station.server.app import create_app, serve

def load():
    raise OSError(12, "Cannot allocate memory")  # what a too-large KV or weight mapping gives on a real machine

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
app = create_app(Scheduler(load, ctx=256), model_name="tiny", model_path="tiny.gguf", ctx=256)
sys.exit(serve(app, "127.0.0.1", port, shutdown_grace=1.0, log_level="warning"))
"""


def test_a_model_that_fails_to_load_ends_serve_with_the_reason() -> None:
    """No server left answering 503 forever: the first load failing ends the process, non-zero, the reason on
    stderr (the control panel shows the exit and the log)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FAILING_LOAD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "loading the model failed: OSError: [Errno 12] Cannot allocate memory" in done.stderr
