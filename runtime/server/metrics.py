"""Prometheus metrics, named like vLLM's (``vllm:`` → ``kubellm:``), labelled by model name.

Gauges and cache counters are read from the engine at scrape time; per-request histograms and
token counters are fed from the engine thread after each step. docs/metrics.md maps every name.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kubellm.runtime.engine.llm_engine import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

# What the Gateway API Inference Extension's endpoint picker reads from every pod (its model-server protocol), as
# the fields of an engineConfigs entry of its core-metrics-extractor; docs/gateway.md hands it to the EPP.
# loraSpec is empty because no LoRA adapters are served (the EPP then skips LoRA affinity).
ENDPOINT_PICKER_METRICS = {
    "queuedRequestsSpec": "kubellm:num_requests_waiting",
    "runningRequestsSpec": "kubellm:num_requests_running",
    "kvUsageSpec": "kubellm:kv_cache_usage_perc",
    "loraSpec": "",
    "cacheInfoSpec": "kubellm:cache_config_info",
}


class ServerMetrics:
    def __init__(self, model_name: str, engine_state, registry: CollectorRegistry | None = None):
        """``engine_state`` is the AsyncEngine: its gauges and engine are read at scrape time."""
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry

        def counter(name, doc, extra=()):
            return Counter(name, doc, labels + list(extra), registry=r)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.prompt_tokens = counter("kubellm:prompt_tokens", "Prefill tokens processed (prompt tokens of "
                                     "requests that produced their first token).")
        self.generation_tokens = counter("kubellm:generation_tokens", "Generated tokens.")
        self.request_success = counter("kubellm:request_success", "Finished requests by finish reason.",
                                       ["finished_reason"])
        self.request_rejected = counter("kubellm:request_rejected", "Requests refused before reaching the "
                                        "engine, by reason (queue_full, kv_cache_full, draining, invalid...).",
                                        ["reason"])
        self.ttft = histogram("kubellm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("kubellm:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             _LATENCY_BUCKETS)
        self.e2e = histogram("kubellm:e2e_request_latency_seconds", "End-to-end request latency.",
                             _LATENCY_BUCKETS)
        self.queue_time = histogram("kubellm:request_queue_time_seconds", "Time from arrival to first schedule.",
                                    _LATENCY_BUCKETS)
        self.prompt_len = histogram("kubellm:request_prompt_tokens", "Prompt length of finished requests.",
                                    _TOKEN_BUCKETS)
        self.gen_len = histogram("kubellm:request_generation_tokens", "Output length of finished requests.",
                                 _TOKEN_BUCKETS)
        self._last_token: dict[str, float] = {}
        r.register(_EngineCollector(model_name, engine_state))
        # Children bound once: .labels() takes a lock and builds a key per call, and observe_step runs on the
        # engine thread after every step.
        (self._prompt_tokens, self._generation_tokens, self._ttft, self._itl, self._e2e, self._queue_time,
         self._prompt_len, self._gen_len) = (
            m.labels(model_name=model_name) for m in (self.prompt_tokens, self.generation_tokens, self.ttft,
                                                      self.itl, self.e2e, self.queue_time, self.prompt_len,
                                                      self.gen_len))
        self._success: dict[str, object] = {}

    def observe_step(self, outputs: list[RequestOutput], step_time: float) -> None:
        """Called on the engine thread with a step's outputs."""
        now = time.monotonic()
        generated = 0
        for out in outputs:
            n_new = len(out.new_token_ids)
            m = out.metrics
            if n_new:
                generated += n_new
                last = self._last_token.get(out.request_id)
                if last is None:  # first token(s) of this request
                    self._prompt_tokens.inc(len(out.prompt_token_ids))
                    if m.first_token_time is not None:
                        self._ttft.observe(m.first_token_time - m.arrival_time)
                else:
                    self._itl.observe((now - last) / n_new)
                self._last_token[out.request_id] = now
            if out.finished:
                self._last_token.pop(out.request_id, None)
                reason = out.finish_reason
                if reason not in self._success:
                    self._success[reason] = self.request_success.labels(model_name=self.model_name,
                                                                        finished_reason=reason)
                self._success[reason].inc()
                self._e2e.observe(now - m.arrival_time)
                if m.first_scheduled_time is not None:
                    self._queue_time.observe(m.first_scheduled_time - m.arrival_time)
                self._prompt_len.observe(len(out.prompt_token_ids))
                self._gen_len.observe(len(out.token_ids))
        if generated:
            self._generation_tokens.inc(generated)

    def rejected(self, reason: str) -> None:
        self.request_rejected.labels(model_name=self.model_name, reason=reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Scrape-time values straight from the engine (plain int/float reads; no locking needed)."""

    def __init__(self, model_name: str, state):
        self.model_name, self.state = model_name, state

    def describe(self):
        return []

    def collect(self):
        state, labels, value = self.state, ["model_name"], [self.model_name]
        stats = state.stats or state.engine.stats()

        def gauge(name, doc, v):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name, doc, v):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge("kubellm:num_requests_waiting", "Requests queued for the engine (the autoscaling signal).",
                    state.num_waiting)
        yield gauge("kubellm:num_requests_running", "Requests in the running batch.", state.num_running)
        yield gauge("kubellm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", stats.kv_usage)
        yield gauge("kubellm:kv_cache_blocks_total", "KV-cache blocks in the pool.", stats.kv_blocks_total)
        # vLLM's info-style gauge with its label names: the endpoint picker's prefix-cache scorer reads them.
        info = GaugeMetricFamily("kubellm:cache_config_info", "KV-cache configuration in the labels (value 1).",
                                 labels=[*labels, "block_size", "num_gpu_blocks"])
        info.add_metric([*value, str(state.block_size), str(stats.kv_blocks_total)], 1)
        yield info
        yield counter("kubellm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_queries)
        yield counter("kubellm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", stats.prefix_hits)
        yield counter("kubellm:num_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks.",
                      stats.num_preemptions)
        if stats.speculation is not None:  # vLLM's spec_decode counters
            spec = stats.speculation
            yield counter("kubellm:spec_decode_num_drafts", "Draft proposals verified.", spec.num_drafts)
            yield counter("kubellm:spec_decode_num_draft_tokens", "Draft tokens verified.", spec.num_draft_tokens)
            yield counter("kubellm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                          spec.num_accepted_tokens)
