"""Request state inside the engine and the RequestOutput it reports after each step."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace

import torch

from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpeculationStats:
    """Per request: accepted = draft tokens emitted before the first rejection (flashinfer's emitted count).

    acceptance rate = num_accepted_tokens / num_draft_tokens; mean accepted length = 1 + accepted / num_steps.
    """

    method: str = "none"
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_steps: int = 0
    accepted_prediction_tokens: int | None = None  # Predicted Outputs (OpenAI's meaning), set when it finishes
    rejected_prediction_tokens: int | None = None
    # the request's token-emitting steps by the number of draft tokens (tree nodes) they verified, 0 = none:
    # with `auto` this is the k it chose, step by step
    steps_by_k: dict[int, int] = field(default_factory=dict)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class RequestOutput:
    """One step's report of a request: deltas since the previous report, and the cumulative output as views of the
    request's own append-only lists (a report costs O(new tokens), not O(length): `output_token_ids` and `logprobs`
    copy on access)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    speculation: SpeculationStats
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (usage.prompt_tokens_details)
    arrival_time: float = 0.0  # time.monotonic() of the engine's clock
    first_scheduled_time: float | None = None  # left the waiting queue (queue time = this - arrival)
    first_token_time: float | None = None
    finished_time: float | None = None
    # the request's prompt + output ids and its logprobs (shared, append-only) and their lengths at this report
    all_token_ids: list[int] = field(default_factory=list, repr=False)
    num_token_ids: int = 0
    all_logprobs: list[TokenLogprob] | None = field(default=None, repr=False)
    num_logprobs: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):self.num_token_ids]

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """Cumulative; None unless requested."""
        return None if self.all_logprobs is None else self.all_logprobs[:self.num_logprobs]


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer, eos_token_ids: set[int], max_tokens: int, label: str, device: torch.device,
                 num_speculative_tokens: int = 0, prediction_token_ids: list[int] | None = None,
                 method: str | None = None, adaptive: bool = False, cache_root: bytes = b"",
                 grammar=None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output: what the scheduler counts against
        self.params = params
        self.max_tokens = max_tokens
        self.stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
        self.generator = (torch.Generator(device=device).manual_seed(params.seed)
                          if params.seed is not None else None)
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop,
                                                  params.skip_special_tokens)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # target positions whose K/V are in the cache
        # the request's speculation method (its proposer where a prediction, if it has one, offers nothing)
        self.method = method or label
        self.num_speculative_tokens = num_speculative_tokens  # its k (the scheduler may give fewer per step)
        self.adaptive = adaptive  # k chosen per step by engine/spec_decode/adaptive.py, at most num_speculative_tokens
        self.planned_k: int | None = None  # this step's choice for an adaptive request
        self.prediction_token_ids = prediction_token_ids  # Predicted Outputs: the expected completion, tokenised
        self.block_ids: list[int] = []
        self.grammar = grammar  # an llguidance matcher over the output so far (engine/sample/grammar.py), or None
        # prefix caching (engine/sched/block_allocator.py): the hash chain's root (model + salt), the hashes of the full
        # blocks of token_ids so far, blocks published (target KV verified) and blocks marked valid for the
        # request's proposer; prompt tokens reused at its first admission (OpenAI's cached_tokens)
        self.cache_root = cache_root
        self.block_hashes: list[bytes] = []
        self.num_published_blocks = 0
        self.num_marked_blocks = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.speculation = SpeculationStats(method=label)  # label: "prediction", the method, or "none" (no k)
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self._logprobs_sent = 0
        self._tokens_sent = 0
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: str) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.finished_time = time.monotonic()
        if reason != "error":
            self.detokenizer.flush()

    def fail(self, message: str) -> None:
        """End this request with an error (finish_reason "error"); the batch carries on without it."""
        self.error = message
        self.finish("error")

    def make_output(self) -> RequestOutput:
        """Snapshot with the deltas since the previous snapshot; O(new tokens)."""
        n = len(self.token_ids)
        delta_ids = self.token_ids[max(self._tokens_sent, len(self.prompt_token_ids)):n]
        self._tokens_sent = n
        delta_lp, n_lp = None, 0
        if self.logprobs is not None:
            n_lp = len(self.logprobs)
            delta_lp = self.logprobs[self._logprobs_sent:n_lp]
            self._logprobs_sent = n_lp
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            text=self.detokenizer.text, finished=self.finished, finish_reason=self.finish_reason,
            speculation=replace(self.speculation, steps_by_k=dict(self.speculation.steps_by_k)),  # a snapshot
            delta_text=self.detokenizer.take_delta(self.finished), delta_token_ids=delta_ids,
            delta_logprobs=delta_lp, error=self.error, num_cached_tokens=self.num_cached_tokens,
            arrival_time=self.arrival_time, first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time, finished_time=self.finished_time,
            all_token_ids=self.token_ids, num_token_ids=n, all_logprobs=self.logprobs, num_logprobs=n_lp)
