"""specserve's inference engine: continuous batching with lossless speculative decoding (no web stack here).

The public names load lazily, so that light modules (specserve.engine.spec_decode.registry, read by the config) can be
imported without torch and transformers."""

import importlib

_PUBLIC = {
    "LLM": "specserve.engine.llm", "SamplingParams": "specserve.engine.sampling_params",
    "RequestOutput": "specserve.engine.request", "SpeculationStats": "specserve.engine.request",
    "InvalidRequestError": "specserve.engine.errors", "QueueFullError": "specserve.engine.errors",
    "RequestTooLongError": "specserve.engine.errors", "EngineDeadError": "specserve.engine.errors",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
