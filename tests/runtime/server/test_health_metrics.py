"""Probes, metrics, disconnects and load shedding against a real server on loopback."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kubellm.runtime.server.metrics import ENDPOINT_PICKER_METRICS
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


def endpoint_picker_reads(server) -> dict[str, tuple[str, dict[str, str], float]]:
    """What the endpoint picker extracts: per engineConfigs field, (family type, labels, value) of the family's
    one sample, as its core-metrics-extractor does from a scrape of the pod's port."""
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    out = {}
    for field, name in ENDPOINT_PICKER_METRICS.items():
        if name:
            (sample,) = families[name].samples  # one pod serves one model: exactly one series
            out[field] = (families[name].type, sample.labels, sample.value)
    return out


def test_metrics_satisfy_the_endpoint_pickers_model_server_protocol(server):
    """The Gateway API Inference Extension's model-server protocol: queued and running requests and KV-cache
    use as gauges that follow the load, and the KV-cache configuration in cache_config_info's labels."""
    server.wait_idle()
    idle = endpoint_picker_reads(server)
    assert set(idle) == {"queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"}
    assert {kind for kind, _, _ in idle.values()} == {"gauge"}
    assert [idle[f][2] for f in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec")] == [0, 0, 0]
    _, info, value = idle["cacheInfoSpec"]
    assert value == 1
    assert int(info["block_size"]) == server.engine_config.block_size == 16
    assert int(info["num_gpu_blocks"]) == server.engine.block_manager.num_blocks == 128

    with httpx.stream("POST", server.url + "/v1/completions", json={**PROMPT, "max_tokens": 200, "stream": True},
                      timeout=60) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # running, with KV blocks
        busy = endpoint_picker_reads(server)
        assert busy["runningRequestsSpec"][2] == 1
        assert 0 < busy["kvUsageSpec"][2] <= 1
    server.wait_idle(timeout=15)


def test_gateway_docs_give_the_endpoint_picker_these_names():
    text = (Path(__file__).resolve().parents[3] / "docs" / "gateway.md").read_text()
    blocks = [d for b in re.findall(r"```yaml\n(.*?)```", text, re.S) for d in yaml.safe_load_all(b)]
    (config,) = [b for b in blocks if isinstance(b, dict) and b.get("kind") == "EndpointPickerConfig"]
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    (engine,) = extractor["parameters"]["engineConfigs"]
    assert extractor["parameters"]["defaultEngine"] == engine.pop("name")
    assert engine == ENDPOINT_PICKER_METRICS
    for field, name in ENDPOINT_PICKER_METRICS.items():  # the mapping table names them too
        assert f"| `{name}` | `{field}` |" in text or not name, field


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
