"""Graceful shutdown of a real `ds4station serve` process (SIGTERM needs the main thread, so a subprocess on the
tiny model, CPU): new requests are refused with 503 at once, open requests finish within --shutdown-grace, and
the streams still open after it end with an error event in their API's shape, so the official openai and
anthropic SDKs raise instead of returning a truncated answer as if it were complete; the process exits 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from ds4station.engine.demo import make_model
from ds4station.engine.tokenizer import EOS

ROOT = Path(__file__).resolve().parents[1]
MESSAGES = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("shutdown") / "tiny.gguf", preset="tiny", seed=0, quant="q2")


class Served:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def status(self) -> dict:
        return httpx.get(self.url + "/status", timeout=30).json()

    def wait_for(self, ready, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready(self.status()):
            assert time.monotonic() < deadline
            time.sleep(0.05)


@pytest.fixture
def start(model_path: Path, tmp_path: Path) -> Iterator:
    procs: list[subprocess.Popen[bytes]] = []

    def run(grace: float) -> Served:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = tmp_path / f"serve-{len(procs)}.log"
        # one torch thread, as conftest sets for the test processes: more only fight over a loaded CI machine's cores
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "ds4station.cli", "serve", "--model", str(model_path), "--port", str(port),
               "--device", "cpu", "--ctx", "2048", "--sessions", "1", "--shutdown-grace", str(grace)]
        with log.open("wb") as out:
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
        served = Served(procs[-1], f"http://127.0.0.1:{port}", log)
        deadline = time.monotonic() + 120
        while True:
            assert procs[-1].poll() is None, log.read_text()
            try:
                if httpx.get(served.url + "/health", timeout=5).status_code == 200:
                    return served
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)

    yield run
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def clients(srv: Served) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    return (openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60),
            anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60))


def no_eos(model_path: Path) -> dict[str, int]:
    from ds4station.engine.tokenizer import Tokenizer
    from ds4station.model.gguf import GGUFFile

    return {str(Tokenizer.from_metadata(GGUFFile.open(model_path).metadata).token_id(EOS)): -100}


def streaming(oai: openai.OpenAI, model_path: Path, max_tokens: int) -> Iterator:
    """An OpenAI stream of `max_tokens` (EOS biased away), read up to its first content chunk."""
    chunks = iter(oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=max_tokens, stream=True,
                                              logit_bias=no_eos(model_path), extra_body={"thinking": False}))
    while not next(chunks).choices[0].delta.content:
        pass
    return chunks


def test_sigterm_mid_stream_ends_both_sdks_streams_with_an_error_and_exits(start, model_path: Path) -> None:
    grace = 1.0
    srv = start(grace)
    oai, ant = clients(srv)
    # 1500 tokens (EOS biased away) run far past the grace period; the Anthropic stream waits behind it
    chunks = streaming(oai, model_path, 1500)
    queued = ant.messages.create(model="tiny", max_tokens=1500, messages=MESSAGES, stream=True)
    events = iter(queued)
    assert next(events).type == "message_start"
    srv.wait_for(lambda s: s["queue"]["length"] == 1)

    srv.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    deadline = signalled + 10
    while (health := httpx.get(srv.url + "/health", timeout=5)).json()["status"] != "stopping":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert health.status_code == 503
    refused = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}, timeout=5)
    assert refused.status_code == 503 and refused.headers["retry-after"]

    errors: dict[str, BaseException] = {}

    def drain_anthropic() -> None:
        try:
            for _ in events:
                pass
        except anthropic.APIError as e:
            errors["anthropic"] = e

    reader = threading.Thread(target=drain_anthropic)
    reader.start()
    with pytest.raises(openai.APIError) as failed:
        for _ in chunks:
            pass
    reader.join(30)
    assert "shutting down" in str(failed.value)
    assert "anthropic" in errors and "shutting down" in str(errors["anthropic"])
    assert srv.proc.wait(grace + 15) == 0
    assert time.monotonic() - signalled < grace + 10
    log = srv.log.read_text()
    assert "ending 2 request(s) still open after the 1 s grace period" in log
    assert "Traceback" not in log, log


def test_requests_that_finish_within_the_grace_period_complete_normally(start, model_path: Path) -> None:
    srv = start(60.0)
    oai, ant = clients(srv)
    chunks = streaming(oai, model_path, 40)
    answers: list[anthropic.types.Message] = []
    behind = threading.Thread(target=lambda: answers.append(ant.messages.create(
        model="tiny", max_tokens=8, messages=MESSAGES, thinking={"type": "disabled"})))
    behind.start()
    srv.wait_for(lambda s: s["queue"]["length"] == 1)
    srv.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length"  # the whole answer, then [DONE]
    behind.join(30)
    assert answers and answers[0].stop_reason in ("max_tokens", "end_turn")  # the queued one ran too
    answered = time.monotonic()
    assert srv.proc.wait(30) == 0
    exited = time.monotonic()
    assert exited - answered < 15 and exited - signalled < 60  # nothing left open: no waiting out the grace
    assert "Traceback" not in srv.log.read_text()
