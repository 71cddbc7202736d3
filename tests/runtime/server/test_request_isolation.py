"""One request must not freeze the others: a huge prompt is tokenized off the event loop (or refused before it
is tokenized), a huge body is refused while it is read, and a client that leaves is not an error."""

from __future__ import annotations

import gc
import logging
import threading
import time

import httpx
import pytest

CHAT = "/v1/chat/completions"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _live_latencies(url: str, until: threading.Event) -> list[float]:
    """Seconds each /health/live took, polled back to back until ``until`` is set."""
    latencies = []
    with httpx.Client(timeout=30) as client:
        while not until.is_set():
            start = time.monotonic()
            assert client.get(url + "/health/live").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)
    return latencies


def test_liveness_answers_while_a_huge_prompt_is_tokenized(server, monkeypatch):
    # Let a 2.5 MB message through the character cap, so the server really renders and tokenizes it.
    monkeypatch.setattr(server.options, "max_prompt_chars", 10**8, raising=False)
    body = {"messages": [{"role": "user", "content": "hello world foo bar " * 125_000}], "max_tokens": 1}
    done, result = threading.Event(), {}

    def big_request():
        start = time.monotonic()
        result["response"] = httpx.post(server.url + CHAT, json=body, timeout=120)
        result["seconds"] = time.monotonic() - start
        done.set()

    worker = threading.Thread(target=big_request)
    worker.start()
    latencies = _live_latencies(server.url, done)
    worker.join()
    resp = result["response"]
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded", resp.text
    assert result["seconds"] > 0.75, "the prompt took too little work to show anything"
    assert len(latencies) >= 5 and max(latencies) < 0.5, (result["seconds"], max(latencies))


@pytest.mark.parametrize("path, body, param", [
    (CHAT, {"messages": [{"role": "user", "content": "a " * 4_000_000}]}, "messages"),
    ("/tokenize", {"prompt": "a " * 4_000_000}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a " * 4_000_000}]}, "messages"),
    ("/v1/completions", {"prompt": ["hi", "a " * 4_000_000]}, "prompt"),
])
def test_a_prompt_that_cannot_fit_the_context_is_refused_before_tokenizing(server, path, body, param):
    start = time.monotonic()
    resp = httpx.post(server.url + path, json=body, timeout=120)
    seconds = time.monotonic() - start
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == param, error
    assert "8000000 characters" in error["message"]
    assert seconds < 3.0  # tokenizing 8 MB takes ~10 s on this tokenizer


def test_a_chunked_body_over_the_limit_is_refused_while_it_is_read(server):
    limit = server.options.max_request_bytes
    chunk, sent = b" " * 2**20, []

    def upload():  # 256 MiB of JSON whitespace, without a Content-Length
        yield b'{"prompt": "hi",'
        for _ in range(256):
            sent.append(len(chunk))
            yield chunk

    gc.collect()
    before = _rss_bytes()
    try:
        resp = httpx.post(server.url + "/v1/completions", content=upload(), timeout=60,
                          headers={"content-type": "application/json"})
    except httpx.TransportError:  # the server closed the connection mid-upload before httpx read the 413
        resp = None
    grown = _rss_bytes() - before
    assert grown < 48 * 2**20, f"RSS grew {grown / 2**20:.0f} MiB during the upload"
    if resp is not None:
        assert resp.status_code == 413, resp.text
        error = resp.json()["error"]
        assert error["code"] == "request_too_large" and str(limit) in error["message"]
    assert sum(sent) < 64 * 2**20, "the server kept reading past the limit"
    assert httpx.get(server.url + "/health/live", timeout=10).status_code == 200


def test_a_chunked_body_within_the_limit_is_served(server):
    def upload():
        yield b'{"prompt": "hi", "max_tokens": 2'
        yield b" " * 2**20
        yield b"}"

    resp = httpx.post(server.url + "/v1/completions", content=upload(), timeout=60,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1, resp.text


def test_a_client_that_leaves_a_non_streaming_request_logs_no_traceback(server, caplog):
    caplog.set_level(logging.DEBUG, logger="asyncio")
    body = {"prompt": "hi", "max_tokens": 400, "ignore_eos": True}
    for _ in range(3):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    server.wait_idle()  # the requests were aborted
    time.sleep(0.2)
    gc.collect()  # asyncio reports a future's lost exception when the future is collected
    lost = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]
    assert not lost, lost
