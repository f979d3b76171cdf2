"""Predicted Outputs (OpenAI's `prediction` on chat completions): drafts the next tokens of the text the client
expects the completion to be, keeping a pointer into it that follows the output.

While the output keeps matching, the pointer advances token by token. At a divergence (an insertion, a deletion,
an edit) alignment is lost, and the proposer re-aligns on the longest suffix of the output (MAX_N down to MIN_N
tokens) that occurs in the prediction — preferring the first occurrence at or after the last aligned place — so
one divergence does not poison the rest. Where the prediction offers nothing the engine asks the server's default
method. Proposals are one-hot (a lookup, not a distribution): verification stays exact for any sampling.
"""

from __future__ import annotations

import bisect
import difflib

import torch

from specserve.engine.request import Request
from specserve.engine.spec_decode.base import LookupProposer, Proposal, chain_proposal

MIN_N, MAX_N = 2, 8  # suffix lengths tried when re-aligning (a single token matches too much of a text)
DEFAULT_K = 8  # tokens per step when the request does not set num_speculative_tokens (predictions are long runs)
MAX_K = 16  # the most a request may ask for


class PredictionAligner:
    """Pure Python state of one request: the prediction, its n-gram positions, and the aligned pointer."""

    def __init__(self, prediction: list[int]):
        self.prediction = list(prediction)
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> increasing positions right after it
        for n in range(MIN_N, MAX_N + 1):
            for e in range(n, len(self.prediction) + 1):
                self._ends.setdefault(tuple(self.prediction[e - n:e]), []).append(e)
        self.pointer: int | None = 0  # prediction[pointer] is the expected next output token; None = lost
        self._last_aligned = 0
        self._seen = 0  # output tokens already followed

    def follow(self, output: list[int]) -> None:
        """Advance over the output tokens appended since the last call (O(new tokens) + a re-alignment)."""
        for t in output[self._seen:]:
            p = self.pointer
            if p is not None and p < len(self.prediction) and self.prediction[p] == t:
                self.pointer = p + 1
                self._last_aligned = self.pointer
            else:
                self.pointer = None
        self._seen = len(output)
        if self.pointer is None:
            self.pointer = self._realign(output)

    def _realign(self, output: list[int]) -> int | None:
        for n in range(min(MAX_N, len(output)), MIN_N - 1, -1):
            ends = self._ends.get(tuple(output[len(output) - n:]))
            if ends:
                i = bisect.bisect_left(ends, self._last_aligned)
                e = ends[i] if i < len(ends) else ends[-1]
                self._last_aligned = e
                return e
        return None

    def draft(self, k: int) -> list[int]:
        return [] if self.pointer is None else self.prediction[self.pointer:self.pointer + k]


def prediction_usage(prediction: list[int], output: list[int]) -> tuple[int, int]:
    """(accepted, rejected) with OpenAI's meaning: prediction tokens that appear in the completion (in order: the
    matching blocks of a diff), and the rest of the prediction — not a count of rejection events."""
    matcher = difflib.SequenceMatcher(None, prediction, output, autojunk=False)
    accepted = sum(block.size for block in matcher.get_matching_blocks())
    return accepted, len(prediction) - accepted


class PredictionProposer(LookupProposer):
    """Engine-owned (not a server method): active for requests that carry a prediction."""

    name = "prediction"

    def __init__(self, device: torch.device):
        super().__init__(device, MAX_K)

    @classmethod
    def load(cls, method_config, context) -> "PredictionProposer":
        return cls(context.device)

    def propose(self, requests: list[Request], ks: list[int], default_generator: torch.Generator) -> Proposal:
        drafts = []
        for req, k in zip(requests, ks):
            aligner = self._state.get(req.request_id)
            if aligner is None:
                aligner = self._state[req.request_id] = PredictionAligner(req.prediction_token_ids or [])
            aligner.follow(req.output_token_ids)
            drafts.append(aligner.draft(k))
        return chain_proposal(drafts, self.device)
