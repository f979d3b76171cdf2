"""specserve's inference engine: continuous batching with lossless speculative decoding (no web stack here).

The public names load lazily, so that light modules (engine.proposers.registry, read by the config) can be
imported without torch and transformers."""

import importlib

_PUBLIC = {
    "LLM": "engine.llm", "SamplingParams": "engine.sampling_params", "RequestOutput": "engine.request",
    "SpeculationStats": "engine.request", "InvalidRequestError": "engine.errors", "QueueFullError": "engine.errors",
    "RequestTooLongError": "engine.errors", "EngineDeadError": "engine.errors",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
