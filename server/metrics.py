"""Prometheus metrics in a registry owned by the app, fed from the engine's per-step stats and outputs.

Derived PromQL: acceptance rate = rate(specserve_spec_decode_num_accepted_tokens_total[5m])
/ rate(specserve_spec_decode_num_draft_tokens_total[5m]); mean accepted length = 1 + rate(accepted[5m]) /
rate(specserve_spec_decode_num_drafts_total[5m]).
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specserve.engine.request import RequestOutput
from specserve.engine.stats import StepStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
ACCEPTANCE_WINDOW_SECONDS = 60.0
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
_REQUEST = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Metrics:
    def __init__(self, model: str, method: str, num_speculative_tokens: int):
        disable_created_metrics()  # no *_created series: they double the output and no dashboard uses them
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.model, self.method = model, method
        spec, mod = ["model", "method"], ["model"]
        k_max = max(num_speculative_tokens, 1)
        self.num_drafts = Counter("specserve_spec_decode_num_drafts", "Sequence-steps that proposed >= 1 draft token",
                                  spec, registry=r)
        self.num_draft_tokens = Counter("specserve_spec_decode_num_draft_tokens", "Draft tokens proposed", spec,
                                        registry=r)
        self.num_accepted_tokens = Counter("specserve_spec_decode_num_accepted_tokens",
                                           "Draft tokens emitted (accepted before the first rejection)", spec,
                                           registry=r)
        self.accepted_per_pos = Counter("specserve_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens emitted at each draft position (0-based; a tree's depth)",
                                        spec + ["position"], registry=r)
        self.acceptance_rate = Gauge("specserve_spec_decode_acceptance_rate",
                                     f"Accepted / draft tokens over the last {ACCEPTANCE_WINDOW_SECONDS:.0f} s "
                                     "in which speculation ran", spec, registry=r)
        self.accepted_length = Histogram("specserve_spec_decode_accepted_length",
                                         "Tokens emitted per verify step (accepted drafts + 1 recovered/bonus)",
                                         spec, buckets=tuple(range(1, k_max + 2)), registry=r)
        self.chosen_k = Histogram("specserve_spec_decode_num_speculative_tokens",
                                  "Draft tokens k chosen per drafting sequence per step", spec,
                                  buckets=tuple(range(1, k_max + 1)), registry=r)
        self.draft_seconds = Histogram("specserve_spec_decode_draft_seconds", "Draft proposal time per step", spec,
                                       buckets=_LATENCY, registry=r)
        self.verify_seconds = Histogram("specserve_spec_decode_verify_seconds",
                                        "Target forward + verification time per step", spec, buckets=_LATENCY,
                                        registry=r)
        self.ttft = Histogram("specserve_time_to_first_token_seconds", "Arrival to first token", mod,
                              buckets=_LATENCY + (60.0,), registry=r)
        self.itl = Histogram("specserve_inter_token_latency_seconds",
                             "Time between tokens; the tokens of one step share its interval equally", mod,
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("specserve_e2e_request_latency_seconds", "Arrival to finish", mod, buckets=_REQUEST,
                             registry=r)
        self.queue_time = Histogram("specserve_request_queue_time_seconds", "Arrival to first scheduling", mod,
                                    buckets=_LATENCY + (60.0,), registry=r)
        self.prompt_tokens = Counter("specserve_prompt_tokens", "Prompt (prefill) tokens computed", mod, registry=r)
        self.generation_tokens = Counter("specserve_generation_tokens", "Tokens generated", mod, registry=r)
        self.success = Counter("specserve_request_success", "Requests finished normally", mod + ["finish_reason"],
                               registry=r)
        self.failure = Counter("specserve_request_failure", "Requests refused or ended early", mod + ["reason"],
                               registry=r)
        self.running = Gauge("specserve_num_requests_running", "Requests in the running batch", mod, registry=r)
        self.waiting = Gauge("specserve_num_requests_waiting", "Requests waiting for admission", mod, registry=r)
        self.kv_usage = Gauge("specserve_kv_cache_usage_ratio", "Fraction of KV cache blocks in use", mod,
                              registry=r)
        # an info gauge (value 1) in the Gateway API Inference Extension's model-server protocol shape: its endpoint
        # picker reads the block size and block count from these label names (vLLM's, GPU or not) to size its
        # approximate prefix-cache index; set once the engine has sized its KV pool
        self.cache_config = Gauge("specserve_cache_config_info", "KV cache configuration (labels; value 1)",
                                  mod + ["block_size", "num_gpu_blocks"], registry=r)
        self.prefix_queries = Counter("specserve_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache (each request once)", mod,
                                      registry=r)
        self.prefix_hits = Counter("specserve_prefix_cache_hits",
                                   "Prompt tokens whose KV came from the prefix cache", mod, registry=r)
        self.connections = Gauge("specserve_http_connections", "Open HTTP connections", registry=r)
        self.connections_closed = Counter("specserve_http_connections_closed",
                                          "Connections the server closed before a request arrived whole (reason: "
                                          "header_timeout, body_timeout, header_limit, invalid_http, evicted, refused)",
                                          ["reason"], registry=r)
        for metric in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.acceptance_rate,
                       self.accepted_length, self.chosen_k, self.draft_seconds, self.verify_seconds):
            metric.labels(model, method)  # present (at 0) before the first step
        for metric in (self.ttft, self.itl, self.e2e, self.queue_time, self.prompt_tokens, self.generation_tokens,
                       self.running, self.waiting, self.kv_usage, self.prefix_queries, self.prefix_hits):
            metric.labels(model)
        self._window: deque[tuple[float, int, int]] = deque()  # (time, drafted, accepted) per speculative step
        self._last_token_time: dict[str, float] = {}  # engine thread only

    def set_cache_config(self, block_size: int, num_blocks: int) -> None:
        self.cache_config.labels(self.model, str(block_size), str(num_blocks)).set(1)

    def on_step(self, s: StepStats, outputs: list[RequestOutput]) -> None:
        """Called on the engine thread after each step (and after aborts)."""
        now = time.monotonic()
        m, k = self.model, self.method
        if s.num_drafts:
            # per drafting sequence, labelled with its request's method (requests may choose theirs)
            for method, chosen, length, depth in zip(s.draft_methods, s.speculative_tokens_chosen, s.accepted_lengths,
                                                     s.draft_depths):
                self.num_drafts.labels(m, method).inc()
                self.num_draft_tokens.labels(m, method).inc(chosen)
                self.num_accepted_tokens.labels(m, method).inc(length - 1)
                for pos in range(depth):  # every proposed position (a tree's depth) gets its series, accepted or not
                    self.accepted_per_pos.labels(m, method, str(pos)).inc(1 if pos < length - 1 else 0)
                self.accepted_length.labels(m, method).observe(length)
                self.chosen_k.labels(m, method).observe(chosen)
            self.draft_seconds.labels(m, k).observe(s.draft_seconds)  # per step: the server's default method
            self._update_acceptance(now, s.num_draft_tokens, s.num_accepted_tokens)
        if s.step_seconds:
            self.verify_seconds.labels(m, k).observe(s.verify_seconds)
        self.prompt_tokens.labels(m).inc(s.num_prompt_tokens)
        self.generation_tokens.labels(m).inc(s.num_generation_tokens)
        self.running.labels(m).set(s.num_running)
        self.waiting.labels(m).set(s.num_waiting)
        self.kv_usage.labels(m).set(s.kv_cache_usage)
        self.prefix_queries.labels(m).inc(s.prefix_cache_queries)
        self.prefix_hits.labels(m).inc(s.prefix_cache_hits)
        for out in outputs:
            self._observe_output(out, now)

    def _update_acceptance(self, now: float, drafted: int, accepted: int) -> None:
        self._window.append((now, drafted, accepted))
        while self._window and self._window[0][0] < now - ACCEPTANCE_WINDOW_SECONDS:
            self._window.popleft()
        total = sum(d for _, d, _ in self._window)
        if total:
            self.acceptance_rate.labels(self.model, self.method).set(sum(a for _, _, a in self._window) / total)

    def _observe_output(self, out: RequestOutput, now: float) -> None:
        m, n = self.model, len(out.delta_token_ids)
        if n:
            prev = self._last_token_time.get(out.request_id)
            if prev is None:
                self.ttft.labels(m).observe(out.first_token_time - out.arrival_time)
                prev, n = out.first_token_time, n - 1  # tokens after the first share the rest of the step
            for _ in range(n):
                self.itl.labels(m).observe((now - prev) / n)
            self._last_token_time[out.request_id] = now
        if out.finished:
            self._last_token_time.pop(out.request_id, None)
            if out.first_scheduled_time is not None:
                self.queue_time.labels(m).observe(out.first_scheduled_time - out.arrival_time)
            if out.finish_reason in ("stop", "length"):
                self.success.labels(m, out.finish_reason).inc()
                self.e2e.labels(m).observe(out.finished_time - out.arrival_time)
            else:
                self.record_failure(out.finish_reason or "error")

    def record_failure(self, reason: str) -> None:
        """Engine thread (aborts) or event loop (refused requests): prometheus_client counters are thread-safe."""
        self.failure.labels(self.model, reason).inc()

    def watch_connections(self, count) -> None:
        self.connections.set_function(count)

    def record_connection_closed(self, reason: str) -> None:
        self.connections_closed.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
