"""SamplingParams: what one request asks of the sampler, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.engine.errors import InvalidRequestError
from specserve.engine.sample.grammar import GrammarSpec

MAX_LOGPROBS = 20


def _check(cond: bool, param: str, message: str) -> None:
    if not cond:
        raise InvalidRequestError(f"{param}: {message}", param=param)


@dataclass
class SamplingParams:
    """Per-request sampling settings (temperature 0 = greedy).

    `num_speculative_tokens=None` uses the k of the request's method; 0 disables speculation for this request; a
    value above the method's k is clamped to it. `seed` gives the request its own torch.Generator, so its output
    does not depend on the other requests in the batch (for a fixed k).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: the rest of the model length
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n log-probs of the target's raw logits per emitted token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    num_speculative_tokens: int | None = None
    skip_special_tokens: bool = True
    speculative_method: str | None = None  # one of the methods the engine loaded, or "none"; None: its default
    prediction: str | list[int] | None = None  # Predicted Outputs: the expected completion (text or token ids)
    cache_salt: str | None = None  # prefix caching: only requests with the same salt share cached KV blocks
    structured: GrammarSpec | None = None  # the output must match this grammar (engine/sample/grammar.py)
    logit_bias: dict[int, float] | None = None  # OpenAI's: added to the logits of these token ids (-100..100)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        _check(self.temperature >= 0, "temperature", "must be >= 0")
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be -1, 0 (off) or a positive integer")
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative token ids")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
               f"must be between 0 and {MAX_LOGPROBS}")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        _check(self.num_speculative_tokens is None or self.num_speculative_tokens >= 0, "num_speculative_tokens",
               "must be >= 0")
        _check(self.speculative_method is None or isinstance(self.speculative_method, str), "speculative_method",
               "must be a string")
        _check(self.prediction is None or isinstance(self.prediction, str)
               or (isinstance(self.prediction, list) and all(isinstance(t, int) and t >= 0 for t in self.prediction)),
               "prediction", "must be a string or a list of token ids")
        _check(self.logit_bias is None or (len(self.logit_bias) <= 300 and all(
            isinstance(t, int) and t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias.items())),
            "logit_bias", "at most 300 token ids (non-negative integers) with biases in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
