"""Probes, metrics, disconnects and load shedding against a real server on loopback."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_harness import ServerThread

PROMPT = {"prompt": "Once upon a time", "ignore_eos": True}


def metrics(server) -> dict[str, float]:
    """Every sample as 'name{label=value,...}' → value."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_startup_and_liveness_report_a_healthy_server(server):
    assert httpx.get(server.url + "/health/startup").json() == {"status": "started"}
    live = httpx.get(server.url + "/health/live").json()
    assert live["status"] == "alive" and live["heartbeat_age_s"] < 5


def test_readiness_runs_a_real_generation_when_idle(server):
    time.sleep(server.options.probe_skip_window + 0.2)
    before = metrics(server).get("kubellm:generation_tokens_total{}", 0)
    ready = httpx.get(server.url + "/health/ready", timeout=30)
    assert ready.status_code == 200 and ready.json()["probe"] == "ok"
    assert metrics(server)["kubellm:generation_tokens_total{}"] == before + 1  # the probe's one token


def test_readiness_skips_the_probe_while_tokens_flow(server):
    done = threading.Event()

    def long_request():
        httpx.post(server.url + "/v1/completions", json={**PROMPT, "max_tokens": 150}, timeout=60)
        done.set()

    threading.Thread(target=long_request, daemon=True).start()
    deadline = time.monotonic() + 10
    while server.state.engine.num_running == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    ready = httpx.get(server.url + "/health/ready", timeout=30).json()
    assert ready["probe"] == "skipped", ready
    done.wait(60)
    server.wait_idle()


def test_metrics_parse_and_move_as_requests_flow(server):
    before = metrics(server)
    for name in ("kubellm:num_requests_waiting", "kubellm:num_requests_running", "kubellm:kv_cache_usage_perc",
                 "kubellm:prefix_cache_queries_total", "kubellm:prefix_cache_hits_total",
                 "kubellm:num_preemptions_total"):
        assert f"{name}{{}}" in before, name
    long_prompt = {"prompt": list(range(10, 60)), "ignore_eos": True, "max_tokens": 5}  # > 3 KV blocks
    for _ in range(2):  # the second one reuses the first one's blocks
        assert httpx.post(server.url + "/v1/completions", json=long_prompt, timeout=30).status_code == 200
    after = metrics(server)
    assert after["kubellm:generation_tokens_total{}"] >= before.get("kubellm:generation_tokens_total{}", 0) + 10
    assert after["kubellm:request_success_total{finished_reason=length}"] >= 2
    assert after["kubellm:time_to_first_token_seconds_count{}"] >= 2
    assert after["kubellm:e2e_request_latency_seconds_count{}"] >= 2
    assert after["kubellm:inter_token_latency_seconds_count{}"] >= 8
    assert after["kubellm:request_queue_time_seconds_count{}"] >= 2
    assert after["kubellm:prefix_cache_hits_total{}"] > before["kubellm:prefix_cache_hits_total{}"]  # same prompt
    assert after["kubellm:num_requests_running{}"] == 0


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = metrics(server).get("kubellm:request_success_total{finished_reason=abort}", 0)
    with httpx.stream("POST", server.url + "/v1/completions", json={**PROMPT, "max_tokens": 400, "stream": True},
                      timeout=30) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data:") for line in got)
        assert server.used_blocks() > 0
    server.wait_idle(timeout=5)  # the abort lands within an engine step or so
    assert metrics(server)["kubellm:request_success_total{finished_reason=abort}"] == before + 1


def test_liveness_fails_when_the_engine_loop_is_wedged(tiny_llama):
    srv = ServerThread(tiny_llama, liveness_timeout=0.5).start()
    try:
        release = threading.Event()
        engine = srv.engine
        real_step = engine.step

        def wedged_step():
            release.wait(30)
            return real_step()

        engine.step = wedged_step
        worker = threading.Thread(target=lambda: httpx.post(srv.url + "/v1/completions",
                                                            json={**PROMPT, "max_tokens": 2}, timeout=60))
        worker.start()
        time.sleep(1.0)
        live = httpx.get(srv.url + "/health/live", timeout=10)
        assert live.status_code == 503 and "heartbeat" in live.json()["reason"]
        release.set()
        worker.join(30)
        time.sleep(0.2)
        assert httpx.get(srv.url + "/health/live", timeout=10).status_code == 200
    finally:
        srv.stop()


@pytest.mark.parametrize("overload", [10])
def test_overload_is_shed_with_429_and_admitted_requests_complete(tiny_llama, overload):
    max_queue = 2
    srv = ServerThread(tiny_llama, engine_kwargs={"max_num_seqs": 2}, max_queue=max_queue).start()
    try:
        n = overload * (max_queue + 2)

        def send(_):
            return httpx.post(srv.url + "/v1/completions", json={**PROMPT, "max_tokens": 40}, timeout=120)

        with ThreadPoolExecutor(max_workers=n) as pool:
            responses = list(pool.map(send, range(n)))
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429}, codes
        shed = [r for r in responses if r.status_code == 429]
        assert shed and all(r.headers.get("retry-after") for r in shed)
        assert all(r.json()["error"]["code"] == "queue_full" for r in shed)
        ok = [r for r in responses if r.status_code == 200]
        assert len(ok) >= max_queue and all(r.json()["usage"]["completion_tokens"] == 40 for r in ok)
        assert metrics(srv)["kubellm:request_rejected_total{reason=queue_full}"] == len(shed)
        srv.wait_idle()
    finally:
        srv.stop()


@pytest.mark.parametrize("phase", ["loading", "failed", "draining"])
def test_models_answers_503_until_ready_so_pollers_wait(phase):
    """Tools wait for a server by polling /v1/models (as with vLLM): it must not list the model before
    requests can be served."""
    from fastapi.testclient import TestClient

    from kubellm.runtime.server.app import ServerOptions, ServerState, build_app

    state = ServerState(ServerOptions(served_model_name="tiny"), phase=phase)
    resp = TestClient(build_app(state)).get("/v1/models")
    assert resp.status_code == 503 and resp.headers["retry-after"]
    assert resp.json()["error"]["code"] == "not_ready" and phase in resp.json()["error"]["message"]


def test_models_lists_the_served_model_once_ready(server):
    data = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in data] == ["tiny"] and data[0]["max_model_len"] == 512
