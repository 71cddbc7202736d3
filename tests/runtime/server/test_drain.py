"""Graceful drain of a real `kubellm serve` process on SIGTERM."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from server_harness import free_port


@pytest.fixture
def serve(tiny_llama, tmp_path):
    procs = []

    def start(drain_timeout: float, admin_port: int = 0):
        port = free_port()
        log = open(tmp_path / f"serve-{port}.log", "w")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(
            [sys.executable, "-m", "kubellm.runtime.cli", "serve", "--model", str(tiny_llama), "--host", "127.0.0.1",
             "--port", str(port), "--admin-port", str(admin_port), "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "512",
             "--served-model-name", "tiny", "--drain-timeout", str(drain_timeout)],
            stdout=log, stderr=subprocess.STDOUT)
        procs.append((proc, log))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health/ready", timeout=5).status_code == 200:
                    return proc, url, tmp_path / f"serve-{port}.log"
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (tmp_path / f"serve-{port}.log").read_text()
            time.sleep(0.1)
        raise AssertionError("server did not become ready")

    yield start
    for proc, log in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()


def test_drain_is_refused_on_the_serving_port_and_served_only_on_loopback(serve):
    """Security: any client of the Service reaches the serving port, so it must not be able to drain a
    replica. The drain control is on a second listener bound to 127.0.0.1 only."""
    admin_port = free_port()
    proc, url, log = serve(drain_timeout=5, admin_port=admin_port)
    for method in ("POST", "GET", "PUT"):
        r = httpx.request(method, url + "/admin/drain", timeout=10)
        assert r.status_code in (404, 405), (method, r.status_code)
        assert "error" in r.json()
    time.sleep(0.5)
    assert proc.poll() is None
    assert httpx.get(url + "/health/ready", timeout=30).status_code == 200
    assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30).status_code == 200
    listening = [c.laddr for c in psutil.Process(proc.pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    assert (("127.0.0.1", admin_port)) in [(a.ip, a.port) for a in listening], listening
    assert not [a for a in listening if a.port == admin_port and a.ip != "127.0.0.1"], listening

    admin = f"http://127.0.0.1:{admin_port}"
    assert httpx.get(admin + "/admin/status", timeout=10).json()["phase"] == "ready"
    r = httpx.post(admin + "/admin/drain", timeout=10)
    assert r.status_code == 202 and r.json() == {"status": "draining"}
    assert proc.wait(timeout=60) == 0
    assert "drain started (POST /admin/drain (loopback))" in log.read_text()


def test_a_taken_admin_port_is_a_clear_start_up_error(tiny_llama, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        proc = subprocess.run(
            [sys.executable, "-m", "kubellm.runtime.cli", "serve", "--model", str(tiny_llama), "--host", "127.0.0.1",
             "--port", str(free_port()), "--admin-port", str(taken.getsockname()[1])],
            capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "cannot bind the admin listener" in proc.stderr and "--admin-port" in proc.stderr


def _stream(url: str, max_tokens: int, results: list, started: threading.Event):
    """One streaming completion; records (finish_reason, completion tokens from usage, saw [DONE])."""
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    finish, tokens, done = None, 0, False
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            started.set()
            if chunk["choices"]:
                finish = chunk["choices"][0]["finish_reason"] or finish
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    results.append((finish, tokens, done))


def _start_streams(url, n, max_tokens):
    results: list = []
    events = [threading.Event() for _ in range(n)]
    threads = [threading.Thread(target=_stream, args=(url, max_tokens, results, e), daemon=True) for e in events]
    for t in threads:
        t.start()
    for e in events:
        assert e.wait(60), "a stream never started"
    return threads, results


def test_sigterm_lets_in_flight_streams_finish_refuses_new_work_and_exits_0(serve):
    proc, url, log = serve(drain_timeout=60)
    # Long enough (the tiny model's whole context) that the streams are still running during the checks below;
    # the checks come first, before anything else can let the drain finish.
    threads, results = _start_streams(url, 8, max_tokens=480)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while (ready := httpx.get(url + "/health/ready", timeout=10).status_code) == 200 and time.monotonic() < deadline:
        time.sleep(0.005)  # the signal handler runs on the server's event loop, a moment after delivery
    assert ready == 503
    refused = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert refused.json()["error"]["code"] == "draining"
    assert not results, "the streams finished before the drain checks ran; the test proves nothing"
    for t in threads:
        t.join(120)
    assert proc.wait(timeout=60) == 0
    assert time.monotonic() - sent < 60
    assert len(results) == 8 and all(r == ("length", 480, True) for r in results), results
    text = log.read_text()
    assert "drain started (SIGTERM)" in text and "drain complete" in text


def test_drain_timeout_aborts_the_rest_with_a_final_chunk(serve):
    proc, url, log = serve(drain_timeout=0.1)  # far below what 8 streams of 490 tokens take on the tiny model
    threads, results = _start_streams(url, 8, max_tokens=490)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(120)
    assert proc.wait(timeout=60) == 0
    assert len(results) == 8
    assert all(finish == "abort" and done and 0 < tokens < 490 for finish, tokens, done in results), results
    assert "aborting 8 requests" in log.read_text()
