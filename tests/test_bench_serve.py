"""`ds4station bench serve` end to end on the demo model (CPU): a real `serve` process, the official openai
client streaming chat requests, and the table it prints."""

from __future__ import annotations

import socket

import pytest

from ds4station.engine.demo import make_model
from ds4station.engine.stage import WARM_POSITIONS, warm_lengths, warm_positions
from ds4station.engine.tokenizer import Tokenizer
from ds4station.model.gguf import GGUFFile
from ds4station.ports import free_port, port_free
from ds4station.server import bench


def test_chat_text_reaches_the_asked_prompt_length(tmp_path) -> None:
    from ds4station.engine import chat

    path = make_model(tmp_path / "tiny.gguf")
    tok = Tokenizer.from_metadata(GGUFFile.open(path).metadata)
    for n in (20, 300):
        text = bench.chat_text(tok, n, seed=1)
        got = len(tok.encode(chat.render_prompt([{"role": "user", "content": text}], tools=None, thinking=False)))
        assert n <= got <= n + 8  # the fewest words that reach n tokens (a word is a few tokens)
    assert bench.chat_text(tok, 300, seed=1) != bench.chat_text(tok, 300, seed=2)  # fresh text per run


def test_bench_serve_drives_a_real_server_like_an_agent(tmp_path) -> None:
    path = make_model(tmp_path / "tiny.gguf")
    res = bench.run(str(path), prompt_tokens=300, decode_tokens=8, runs=2, short_runs=1, port=free_port(),
                    serve_args=["--device", "cpu"], engine_bench=False, ready_timeout=120, log=lambda _: None)
    assert res.first is not None and res.first.ttft_s > 0 and len(res.short) == 1 and len(res.long) == 2
    for turn in res.long:
        assert 300 <= turn.prompt_tokens <= 310 and turn.cached_tokens < 10  # fresh text: little reuse
        assert turn.completion_tokens >= 1 and turn.prefill_tps > 0
        assert turn.server_timings["prompt_n"] == turn.prompt_tokens - turn.cached_tokens
    for turn in (res.first, *res.short, *res.long):  # the server's own record of each turn, matched in order
        assert turn.server["prompt_tokens"] == turn.prompt_tokens
        assert 0 < turn.server["ttft_ms"] <= 1000 * turn.ttft_s
    table = res.table()
    assert "prefill 300-token chat prompt, tok/s" in table and "TTFT" in table and "through serve" in table
    assert "(server " in table
    # how the server ran its steps: on a CPU none is queued ahead of its tokens
    assert res.batch["decode_steps"] >= 8 and res.batch["ahead_steps"] == 0
    assert "decode steps, 0 queued ahead of their tokens; median one-request decode step" in table


def test_warm_up_covers_the_length_classes_and_position_buckets() -> None:
    lengths = warm_lengths(2048)
    assert lengths[:15] == list(range(1, 16)) and lengths[-1] == 2048
    for b in (16, 32, 64, 128, 256, 512, 1024, 2048):  # a power of two and the odd length below it
        assert b in lengths and b - 1 in lengths
    assert warm_lengths(100) == [*range(1, 17), 31, 32, 63, 64, 100]
    assert warm_positions(8512) == [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert warm_positions(1 << 20)[-1] == WARM_POSITIONS // 2


def test_bench_serve_refuses_a_port_in_use(tmp_path) -> None:
    """A server already on the port would answer the bench in place of the one it starts (and measure it)."""

    path = make_model(tmp_path / "tiny.gguf")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(RuntimeError, match=f"port {s.getsockname()[1]} is in use"):
            bench.run(str(path), port=s.getsockname()[1], engine_bench=False, log=lambda _: None)


def test_a_port_whose_server_just_stopped_is_free() -> None:
    """A server that closed its connections first leaves them in TIME_WAIT on its port for up to a minute; a new
    server binds it all the same (uvicorn sets SO_REUSEADDR), so the bench must not call it in use (it did, and a
    terminated bench's test failed on it under load). A listening socket still makes it in use."""
    import time

    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's listener
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        assert not port_free(port)
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = srv.accept()
        conn.close()  # the server closes first: its end of the connection waits in TIME_WAIT
        time.sleep(0.05)
        client.close()
    with socket.socket() as plain:  # a bind without SO_REUSEADDR (the old check) is refused
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
    assert port_free(port)


def test_a_terminated_bench_stops_the_server_it_started(tmp_path) -> None:
    """SIGTERM to `bench serve` (as `timeout` sends) stops its server too: the server runs in a process group of
    its own, and was left holding the GPU and the port."""
    import os
    import signal
    import subprocess
    import sys
    import time

    path = make_model(tmp_path / "tiny.gguf")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ds4station.cli", "bench", "serve", "--model", str(path),
                             "--port", str(port), "--no-engine-bench", "--prompt-tokens", "300", "--runs", "50",
                             "--serve-args", "--device cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:  # the server is up once the bench sends its first request
            if "first request after ready" in line:
                break
        assert not port_free(port)
        proc.send_signal(signal.SIGTERM)
        rest = proc.stdout.read()  # what the bench printed after the signal (a failure shows it)
        assert proc.wait(90) == 128 + signal.SIGTERM, rest[-3000:]
        deadline = time.monotonic() + 30
        while not port_free(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert port_free(port)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
