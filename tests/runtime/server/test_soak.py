"""A bounded soak against a real `kubellm serve` (its own process, the tiny Llama): rounds of streaming
completions, 16 at a time, with sampled lengths, a different seed each, a fifth cut mid-stream by the client
and a tenth malformed. After a warm-up round the server's memory must stay flat: a round adds at most a few
MiB of RSS, and no request or KV block is left behind.

Memory held per request is what this catches: oneDNN kept one JIT primitive (~0.5 MiB) per distinct GEMM row
count, and continuous batching changes the row count nearly every step (runtime/layers/linear.py, ROW_BUCKETS):
before the fix a 500-request round here added tens of MiB."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from types import SimpleNamespace

import httpx
import psutil
import pytest
from test_health_metrics import metrics

from server_harness import free_port, wait_ready

CONCURRENCY, WARMUP, ROUND = 16, 300, 500
MAX_GROWTH_MIB = 8


async def _request(client: httpx.AsyncClient, url: str, rng: random.Random, seed: int) -> str:
    kind = rng.random()
    if kind < 0.1:
        resp = await client.post(url + "/v1/completions", content=b'{"model": "tiny", "prompt": ',
                                 headers={"content-type": "application/json"})
        return "malformed" if resp.status_code == 400 else f"malformed got {resp.status_code}"
    words = " ".join(rng.choice(("once", "upon", "a", "time", "there", "was")) for _ in range(rng.randint(1, 50)))
    body = {"model": "tiny", "prompt": words, "max_tokens": rng.randint(1, 24), "temperature": 0.8, "seed": seed,
            "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return f"stream got {resp.status_code}: {(await resp.aread())[:200]!r}"
        lines = 0
        async for _ in resp.aiter_lines():
            lines += 1
            if kind < 0.3 and lines >= 2:
                return "cut"
    return "done"


def _round(url: str, count: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)

    async def run() -> list[str]:
        gate = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(i: int) -> str:
                async with gate:
                    return await _request(client, url, rng, seed * 100_000 + i)
            return await asyncio.gather(*(one(i) for i in range(count)))

    outcomes: dict[str, int] = {}
    for outcome in asyncio.run(run()):
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_memory_stays_flat_over_rounds_of_requests(tiny_llama, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kubellm.runtime.cli", "serve", "--model", str(tiny_llama), "--port", str(port),
             "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "512",
             "--max-num-batched-tokens", "256", "--kv-cache-memory", "32MiB"],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, [proc], log.read_text, timeout=600)
        process = psutil.Process(proc.pid)
        _round(url, WARMUP, seed=1)
        rss, outcomes = [], []
        for seed in (2, 3):
            outcomes.append(_round(url, ROUND, seed))
            rss.append(process.memory_info().rss / 2**20)
        for got in outcomes:
            assert set(got) <= {"done", "cut", "malformed"}, got
        series = metrics(SimpleNamespace(url=url))
        assert series["kubellm:num_requests_running{}"] == 0 and series["kubellm:kv_cache_usage_perc{}"] == 0
        assert rss[1] - rss[0] <= MAX_GROWTH_MIB, f"RSS after each round (MiB): {rss}"
    finally:
        proc.terminate()
        proc.wait(60)
