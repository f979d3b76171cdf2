"""EngineClient: the only surface the server uses (generate / abort / health / stats)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from specserve.engine.request import RequestOutput
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.stats import EngineTotals, StepStats


@dataclass(frozen=True)
class EngineHealth:
    state: str  # "loading" | "ready" | "dead" | "stopped"
    error: str | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"


@dataclass(frozen=True)
class EngineSnapshot:
    totals: EngineTotals
    last_step: StepStats
    num_running: int
    num_waiting: int
    kv_cache_usage: float


class EngineClient(Protocol):
    tokenizer: object  # for the caller's thread (chat templates, token strings)
    max_model_len: int  # longest prompt + output in tokens (set once loaded)

    def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None):
        """Validate and enqueue at once (errors raise here); returns an async iterator of outputs whose
        aclose() aborts the request."""
        ...

    def generate(self, prompt: str | list[int], params: SamplingParams,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Incremental outputs (text deltas); raises InvalidRequestError / QueueFullError / EngineDeadError."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def health(self) -> EngineHealth: ...

    def stats(self) -> EngineSnapshot: ...
