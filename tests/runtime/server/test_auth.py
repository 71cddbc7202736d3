"""Optional API keys on the OpenAI routes; probes and metrics stay open."""

from __future__ import annotations

import httpx
import openai
import pytest

from kubellm.runtime.server.auth import api_keys_from
from server_harness import MODEL_NAME, ServerThread

KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def keyed_server(tiny_llama):
    srv = ServerThread(tiny_llama, api_keys=KEYS).start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": "key-one"},
                                     {"Authorization": "Basic key-one"}, {"Authorization": "Bearer"}])
def test_requests_without_a_valid_key_get_401_with_an_openai_error(keyed_server, headers):
    for method, path, body in [("GET", "/v1/models", None),
                               ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                               ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})]:
        r = httpx.request(method, keyed_server.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer"


def test_any_configured_key_works_through_the_openai_client(keyed_server):
    for key in KEYS:
        client = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=key)
        out = client.completions.create(model=MODEL_NAME, prompt="Once", max_tokens=3)
        assert out.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="wrong").models.list()


def test_health_and_metrics_stay_open_for_the_kubelet_and_prometheus(keyed_server):
    for path in ("/health/live", "/health/ready", "/health/startup", "/metrics"):
        assert httpx.get(keyed_server.url + path, timeout=30).status_code == 200, path


def test_keys_come_from_flags_or_the_environment():
    assert api_keys_from(["a"], {"KUBELLM_API_KEY": "b"}) == ("a",)
    assert api_keys_from(None, {"KUBELLM_API_KEY": " b , c,,"}) == ("b", "c")
    assert api_keys_from([], {}) == ()
