"""Helpers to drive EngineCore directly: staggered arrivals, run to completion."""

from __future__ import annotations

from config.schema import EngineConfig
from engine.core import EngineCore
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams


def make_core(model, draft=None, k=4, **kw) -> EngineCore:
    kw.setdefault("kv_cache_memory", 1 << 24)
    kw.setdefault("seed", 0)
    return EngineCore(EngineConfig(model=str(model), draft_model=str(draft) if draft else None,
                                   num_speculative_tokens=k if draft or "speculative_method" in kw else 0,
                                   dtype=kw.pop("dtype", "float32"),
                                   device=kw.pop("device", "cpu"), **kw))


def run(core: EngineCore, prompts, params: SamplingParams | list[SamplingParams], join_after: int | None = None,
        join_from: int | None = None) -> list[RequestOutput]:
    """Run prompts to completion; with join_after, prompts[join_from:] arrive after `join_after` steps."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [core.make_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    split = len(reqs) if join_after is None else (join_from if join_from is not None else len(reqs) // 2)
    for r in reqs[:split]:
        core.add_request(r)
    final: dict[str, RequestOutput] = {}
    steps = 0
    while len(final) < len(reqs):
        if steps == join_after:
            for r in reqs[split:]:
                core.add_request(r)
        for out in core.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
        assert steps < 10_000
    return [final[r.request_id] for r in reqs]
