"""Offline batch API: `LLM(...).generate(prompts, sampling_params)` on the same engine the server uses."""

from __future__ import annotations

from collections.abc import Sequence

from specserve.config.schema import EngineConfig
from specserve.engine.core import EngineCore
from specserve.engine.request import RequestOutput
from specserve.engine.sampling_params import SamplingParams


class LLM:
    """`model=None` runs the bundled demo pair (target + distilled draft). A model without a draft, or
    `num_speculative_tokens=0`, decodes plainly on the same engine; "auto" (the default) adapts k per request and
    step within [0, max_speculative_tokens]; an integer fixes it."""

    def __init__(self, model: str | None = None, draft_model: str | None = None,
                 speculative_method: str | None = None, num_speculative_tokens: int | str = "auto",
                 dtype: str = "auto",
                 device: str = "auto", kv_cache_memory: int | None = None, max_num_seqs: int = 64,
                 max_queue_len: int = 256, seed: int | None = None, **engine_kwargs):
        self.config = EngineConfig(model=model, draft_model=draft_model, speculative_method=speculative_method,
                                   num_speculative_tokens=num_speculative_tokens, dtype=dtype, device=device,
                                   kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                                   max_queue_len=max_queue_len, seed=seed, **engine_kwargs)
        self.engine = EngineCore(self.config)
        self._counter = 0

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); the object is unusable afterwards."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Prompts are strings or token-id lists; one SamplingParams for all or one per prompt. Outputs keep the
        prompts' order. All requests are validated before any is queued."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        requests = []
        for prompt, p in zip(prompts, params):
            requests.append(self.engine.make_request(f"offline-{self._counter}", prompt, p))
            self._counter += 1
        for req in requests:
            self.engine.add_request(req)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(requests):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r.request_id] for r in requests]
