"""Token-counting scheduler (nano-vllm / vLLM V1 style): every step, hand each running request the tokens that let
its computed length catch up with its target length (prompt chunk, or last token + k draft tokens), within
max_num_batched_tokens and the KV budget; then admit waiting requests. Preempts (recompute) when blocks run out;
the engine tells the proposers (SchedulerOutput.preempted).

Prefix caching: a request being admitted (first time, or after a preemption) starts from the longest run of cached
full blocks of its tokens (engine/sched/block_allocator.py), shared by reference. A hit covering the whole prompt still
recomputes the last token (its logits are needed), into a private copy of the last block (SchedulerOutput.copies:
the engine copies every pool's block before the forward). After each step the engine publishes the blocks whose
K/V became full and verified (`publish`), with the proposer validity the request's proposer reports."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from specserve.engine.request import Request, RequestStatus
from specserve.engine.sched.block_allocator import BlockAllocator
from specserve.engine.sched.prefix_hash import extend_block_hashes


def requested_k(want: int | None, method_k: int) -> int:
    """A request's k before per-step limits: its own (capped at its method's), or the method's when unset."""
    return method_k if want is None else min(want, method_k)


@dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    num_new_tokens: int  # target tokens fed this step
    num_draft_tokens: int  # k: draft tokens among them (decode only)
    is_prefill: bool
    emits: bool  # the step reaches the sequence's last token, so the target emits tokens for it


@dataclass(frozen=True)
class CacheHit:
    """A request admitted onto cached blocks: tell its proposer how much of its own KV those blocks hold."""

    request: Request
    num_tokens: int  # target positions reused (the request's computed length)
    proposer_tokens: int  # of those, the leading positions whose KV is valid for the request's proposer


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (shared block, private copy): copy every pool
    cache_hits: list[CacheHit] = field(default_factory=list)  # only requests whose proposer keeps per-position KV
    prefix_queries: int = 0  # prompt tokens of first admissions looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens reused


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, proposer_kv: dict[str, str] | None = None,
                 max_prefill_chunk: int | None = None):
        """proposer_kv: method -> how its per-position KV is made: "own" (it catches up by itself, as a draft model
        does: a hit is used whole) or "target" (from the target's forward, as DFlash's context: a hit stops where
        the method's KV is missing, so that the target recomputes those positions). max_prefill_chunk: the widest
        prompt chunk a step computes (fast_layers.prefill_chunk_limit), None: the token budget alone."""
        self.allocator = allocator
        self.proposer_kv = dict(proposer_kv or {})
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_prefill_chunk = max_prefill_chunk or max_num_batched_tokens
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
        self._release(req)
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
                k, n = 0, min(missing, budget, self.max_prefill_chunk)
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
            n = self._admit(req, budget, out)
            if not n:
                break  # waits until blocks are freed
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.seqs.append(self._scheduled(req, n, 0))
            budget -= n
        return out

    def _admit(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        """Blocks for a waiting request's first chunk, starting from its longest cached prefix. -> tokens it computes
        this step (0: its blocks do not fit; nothing changed)."""
        bs, total = self.allocator.block_size, len(req.token_ids)
        hit = self._cached_prefix(req)
        whole = len(hit) * bs >= total  # the last token is recomputed, into a private copy of the last block
        start = total - 1 if whole else len(hit) * bs
        shared = hit[:-1] if whole else hit
        n = min(total - start, budget, self.max_prefill_chunk)
        new = self.allocator.blocks_for(start + n) - len(shared)
        if new + self.allocator.num_unreferenced(hit) > self.allocator.num_free:
            return 0
        self.allocator.share(hit)  # the copied block too, until the fresh ones are taken: they cannot evict it
        fresh = self.allocator.allocate(new)
        if whole:
            self.allocator.free(hit[-1:])
            out.copies.append((hit[-1], fresh[0]))
        req.block_ids = shared + fresh
        req.num_computed_tokens = start
        req.num_published_blocks = len(shared)
        method = req.method if req.method in self.proposer_kv else None
        valid = self._leading_valid(hit, method) if method else 0
        req.num_marked_blocks = min(valid, len(shared))
        if method and start:
            out.cache_hits.append(CacheHit(req, start, min(valid * bs, start)))
        if req.first_scheduled_time is None:  # first admission: cached_tokens and the hit metrics count it once
            req.num_cached_tokens = start
            out.prefix_queries += total
            out.prefix_hits += start
        return n

    def _cached_prefix(self, req: Request) -> list[int]:
        """The cached blocks a request may start from: its longest cached run of full blocks, cut where its
        proposer's KV is missing if that KV comes from the target's forward."""
        if not self.allocator.enable_caching:
            return []
        extend_block_hashes(req.block_hashes, req.token_ids, self.allocator.block_size, req.cache_root)
        hit = self.allocator.lookup(req.block_hashes)
        method = req.method
        if hit and self.proposer_kv.get(method) == "target":
            hit = hit[:self._leading_valid(hit, method)]
        return hit

    def _leading_valid(self, blocks: list[int], method: str) -> int:
        n = 0
        while n < len(blocks) and method in self.allocator.valid(blocks[n]):
            n += 1
        return n

    def publish(self, req: Request, proposer_tokens: int | None) -> None:
        """Cache the request's blocks whose target K/V are now full and verified (positions below its computed
        length, after rollback), each with whether its proposer's KV there is valid (`proposer_tokens`: how many
        leading positions its proposer's KV covers; None: its proposer keeps none); mark older blocks valid as
        that KV catches up. Rejected drafts never reach a published block: they lie at or past the computed length."""
        if not self.allocator.enable_caching:
            return
        bs = self.allocator.block_size
        full = req.num_computed_tokens // bs
        if full > req.num_published_blocks:
            extend_block_hashes(req.block_hashes, req.token_ids, bs, req.cache_root)
            for i in range(req.num_published_blocks, full):
                covered = proposer_tokens is not None and proposer_tokens >= (i + 1) * bs
                valid = {req.method} if covered else set()
                self.allocator.publish(req.block_ids[i], req.block_hashes[i], valid)
            req.num_published_blocks = full
        if proposer_tokens is not None:
            upto = min(full, proposer_tokens // bs)
            for i in range(req.num_marked_blocks, upto):
                self.allocator.mark_valid(req.block_ids[i], req.block_hashes[i], req.method)
            req.num_marked_blocks = max(req.num_marked_blocks, upto)

    def _release(self, req: Request) -> None:
        self.allocator.free(req.block_ids)
        req.block_ids = []
        req.num_published_blocks = req.num_marked_blocks = 0

    @staticmethod
    def _scheduled(req: Request, n: int, k: int) -> ScheduledSeq:
        decode = k > 0 or (n == 1 and req.num_computed_tokens == len(req.token_ids) - 1 and req.num_output_tokens)
        return ScheduledSeq(req, n, k, is_prefill=not decode,
                            emits=req.num_computed_tokens + n - k == len(req.token_ids))

    def free(self, req: Request) -> None:
        """Release a finished or aborted request's blocks at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
