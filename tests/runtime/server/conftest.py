"""Server fixtures: a real uvicorn server on a loopback port over the tiny Llama."""

from __future__ import annotations

import pytest

from server_harness import ServerThread


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerThread(tiny_llama, probe_skip_window=0.3).start()
    yield srv
    srv.stop()
