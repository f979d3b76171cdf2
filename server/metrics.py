"""Prometheus metrics in a registry owned by the app, fed from the engine's per-step stats.

Derived PromQL: acceptance rate = rate(specserve_spec_decode_num_accepted_tokens_total[5m])
/ rate(specserve_spec_decode_num_draft_tokens_total[5m]); mean accepted length = 1 + rate(accepted[5m]) /
rate(specserve_spec_decode_num_drafts_total[5m]).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine.request import RequestOutput
from engine.stats import StepStats

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, model: str, method: str):
        disable_created_metrics()  # no *_created series: they double the output and no dashboard uses them
        self.registry = CollectorRegistry(auto_describe=True)
        self.model, self.method = model, method
        spec = ["model", "method"]
        r = self.registry
        self.num_drafts = Counter("specserve_spec_decode_num_drafts", "Sequence-steps that proposed >= 1 draft token",
                                  spec, registry=r)
        self.num_draft_tokens = Counter("specserve_spec_decode_num_draft_tokens", "Draft tokens proposed", spec,
                                        registry=r)
        self.num_accepted_tokens = Counter("specserve_spec_decode_num_accepted_tokens",
                                           "Draft tokens emitted (accepted before the first rejection)", spec,
                                           registry=r)
        self.accepted_per_pos = Counter("specserve_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens emitted at each draft position (0-based)",
                                        spec + ["position"], registry=r)
        self.running = Gauge("specserve_num_requests_running", "Requests in the running batch", ["model"],
                             registry=r)
        self.waiting = Gauge("specserve_num_requests_waiting", "Requests waiting for admission", ["model"],
                             registry=r)
        for c in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens):
            c.labels(model, method)  # present (at 0) before the first step
        self.running.labels(model)
        self.waiting.labels(model)

    def on_step(self, s: StepStats, outputs: list[RequestOutput]) -> None:
        """Called on the engine thread after each step (prometheus_client is thread-safe)."""
        m, k = self.model, self.method
        if s.num_drafts:
            self.num_drafts.labels(m, k).inc(s.num_drafts)
            self.num_draft_tokens.labels(m, k).inc(s.num_draft_tokens)
            self.num_accepted_tokens.labels(m, k).inc(s.num_accepted_tokens)
            for pos, n in enumerate(s.num_accepted_tokens_per_pos):
                self.accepted_per_pos.labels(m, k, str(pos)).inc(n)
        self.running.labels(m).set(s.num_running)
        self.waiting.labels(m).set(s.num_waiting)

    def render(self) -> bytes:
        return generate_latest(self.registry)
