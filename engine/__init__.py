"""specserve's inference engine: continuous batching with lossless speculative decoding (no web stack here)."""

from engine.errors import EngineDeadError, InvalidRequestError, QueueFullError, RequestTooLongError
from engine.llm import LLM
from engine.request import RequestOutput, SpeculationStats
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "SpeculationStats", "InvalidRequestError", "QueueFullError",
           "RequestTooLongError", "EngineDeadError"]
