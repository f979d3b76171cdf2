"""Token-counting scheduler (nano-vllm / vLLM V1 style): every step, hand each running request the tokens that let
its computed length catch up with its target length (prompt chunk, or last token + k draft tokens), within
max_num_batched_tokens and the KV budget; then admit waiting requests. Preempts (recompute) when blocks run out;
the engine tells the proposers (SchedulerOutput.preempted)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache import BlockAllocator
from engine.request import Request, RequestStatus


def requested_k(want: int | None, method_k: int) -> int:
    """A request's k before per-step limits: its own (capped at its method's), or the method's when unset."""
    return method_k if want is None else min(want, method_k)


@dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    num_new_tokens: int  # target tokens fed this step
    num_draft_tokens: int  # k: draft tokens among them (decode only)
    is_prefill: bool
    samples: bool  # the step reaches the sequence's last token, so the target emits tokens for it


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def choose_k(self, req: Request, token_budget: int) -> int:
        """k for this step: the request's k (resolved against its method when it was made), bounded by the tokens
        it may still emit (a step emits up to k + 1), the model length and the step's token budget. Its proposer
        may then propose fewer (or none): the step computes only what was proposed."""
        k = req.planned_k if req.adaptive and req.planned_k is not None else req.num_speculative_tokens
        remaining = req.max_tokens - req.num_output_tokens
        return max(0, min(k, remaining - 1, self.max_model_len - len(req.token_ids), token_budget - 1))

    def _ensure_blocks(self, req: Request, num_tokens: int) -> bool:
        need = self.allocator.blocks_for(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need):
            return False
        req.block_ids.extend(self.allocator.allocate(need))
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Recompute preemption: drop the KV and requeue at the front; the request keeps its output so far."""
        self.running.remove(req)
        self.allocator.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            missing = len(req.token_ids) - req.num_computed_tokens
            if missing == 1 and req.num_computed_tokens > 0:  # decode: last token + k drafts
                k = self.choose_k(req, budget)
                n = 1 + k
            else:  # (chunked) prefill, also after a preemption
                k, n = 0, min(missing, budget)
            while not self._ensure_blocks(req, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is RequestStatus.WAITING:
                break  # it preempted itself: nothing else can fit either
            out.seqs.append(self._scheduled(req, n, k))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(len(req.token_ids) - req.num_computed_tokens, budget)
            if not self._ensure_blocks(req, n):
                break  # waits until blocks are freed
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.seqs.append(self._scheduled(req, n, 0))
            budget -= n
        return out

    @staticmethod
    def _scheduled(req: Request, n: int, k: int) -> ScheduledSeq:
        decode = k > 0 or (n == 1 and req.num_computed_tokens == len(req.token_ids) - 1 and req.num_output_tokens)
        return ScheduledSeq(req, n, k, is_prefill=not decode,
                            samples=req.num_computed_tokens + n - k == len(req.token_ids))

    def free(self, req: Request) -> None:
        """Release a finished or aborted request's blocks at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.allocator.free(req.block_ids)
        req.block_ids = []
