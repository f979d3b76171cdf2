"""EngineCore: the synchronous step loop — schedule() -> execute() -> update() — over target, draft and KV cache.

One step drafts for every decoding sequence, runs ONE target forward over the whole ragged batch (prefill chunks
and k + 1 verify positions alike), verifies with the batched rejection sampler, then appends tokens, rolls back
rejected positions (O(1): computed lengths only) and frees finished requests' blocks.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import torch

from config.schema import EngineConfig
from engine.attention import SeqChunk
from engine.errors import InvalidRequestError, QueueFullError, RequestTooLongError
from engine.kv_cache import BlockAllocator, KVPool, kv_bytes_per_token
from engine.loader import (check_draft_compatible, check_model_path, default_kv_cache_memory, demo_model_paths,
                           is_gguf, load_model, load_tokenizer, resolve_chat_template, resolve_device,
                           resolve_dtype)
from engine.model_runner import ModelRunner
from engine.request import Request, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler, requested_k
from engine.spec.draft_model import DraftModelProposer
from engine.stats import EngineTotals, StepStats
from engine.verifier import verify
from engine.vocab_map import load_vocab_map

log = logging.getLogger("specserve.engine")


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        target_path, draft_path = self._model_paths(config)
        check_model_path(target_path, "model")
        if draft_path is not None and config.method == "draft":
            check_model_path(draft_path, "draft_model")
        self.model_path = str(target_path)
        remote = config.trust_remote_code
        self.tokenizer = load_tokenizer(target_path, remote)
        if config.chat_template:
            self.tokenizer.chat_template = resolve_chat_template(config.chat_template)
        target = load_model(target_path, self.dtype, self.device, remote)
        self.method = config.method
        draft = (load_model(draft_path, self.dtype, self.device, remote, field="draft_model")
                 if self.method == "draft" else None)
        self.vocab_size = target.config.vocab_size
        draft_map = None
        if draft is not None:
            draft_map = None if is_gguf(draft_path) else load_vocab_map(draft_path, self.vocab_size, self.device)
            check_draft_compatible(target_path, draft_path, self.tokenizer, target.config, draft.config, draft_map)
        limits = [config.max_model_len, target.config.max_position_embeddings,
                  draft.config.max_position_embeddings if draft is not None else None]
        self.max_model_len = min(x for x in limits if x)
        per_token = kv_bytes_per_token(target.config, self.dtype)
        per_token += kv_bytes_per_token(draft.config, self.dtype) if draft is not None else 0
        budget = config.kv_cache_memory or default_kv_cache_memory(self.device)
        num_blocks = budget // (per_token * config.block_size)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory: {budget} bytes hold no block of {config.block_size} tokens")
        self.allocator = BlockAllocator(num_blocks, config.block_size)
        self.target = ModelRunner(target, KVPool.allocate(target.config, num_blocks, config.block_size, self.dtype,
                                                          self.device), self.device, self.vocab_size)
        self.proposer = None
        if draft is not None:
            kv = KVPool.allocate(draft.config, num_blocks, config.block_size, self.dtype, self.device)
            runner = ModelRunner(draft, kv, self.device, self.vocab_size, draft_map)
            self.proposer = DraftModelProposer(runner, self.device)
        self.num_speculative_tokens = config.num_speculative_tokens if self.proposer else 0
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, self.num_speculative_tokens)
        seed = config.seed if config.seed is not None else random.randrange(1 << 62)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.eos_token_ids = self._eos_ids(target)
        self.requests: dict[str, Request] = {}
        self.totals = EngineTotals()
        self.last_step = StepStats()

    @staticmethod
    def _model_paths(config: EngineConfig) -> tuple[Path | str, Path | str | None]:
        if config.model is not None:
            return config.model, config.draft_model
        target, draft = demo_model_paths()
        return target, config.draft_model or draft

    def _eos_ids(self, model) -> set[int]:
        ids = getattr(model.generation_config, "eos_token_id", None)
        ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # -- requests ---------------------------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequestError(f"prompt: token ids must be integers in [0, {self.vocab_size})", "prompt")
        return list(prompt)

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     prompt_token_ids: list[int] | None = None) -> Request:
        """Validate and build a request (raises InvalidRequestError / RequestTooLongError); does not enqueue.
        `prompt_token_ids` skips tokenising `prompt` (callers on other threads use their own tokenizer)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id: {request_id!r} is already in use", "request_id")
        ids = self.tokenize(prompt if prompt_token_ids is None else prompt_token_ids)
        if not ids:
            raise InvalidRequestError("prompt: must contain at least one token", "prompt")
        n = len(ids)
        if n >= self.max_model_len:
            raise RequestTooLongError(f"This model's maximum context length is {self.max_model_len} tokens; the "
                                      f"prompt has {n} tokens.")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise RequestTooLongError(f"This model's maximum context length is {self.max_model_len} tokens; the "
                                      f"prompt has {n} tokens and max_tokens is {max_tokens}.", param="max_tokens")
        need = min(n + max_tokens + self.num_speculative_tokens, self.max_model_len)
        if self.allocator.blocks_for(need) > self.allocator.num_blocks:
            raise RequestTooLongError(f"the request needs up to {need} tokens of KV cache but kv_cache_memory holds "
                                      f"{self.allocator.num_blocks * self.allocator.block_size}", param="max_tokens")
        k = requested_k(params.num_speculative_tokens, self.num_speculative_tokens)
        method = self.method if k > 0 else "none"
        return Request(request_id, prompt if isinstance(prompt, str) else None, ids, params, self.tokenizer,
                       self.eos_token_ids, max_tokens, method, self.device)

    def add_request(self, request: Request, enforce_queue_limit: bool = True) -> None:
        if enforce_queue_limit and len(self.scheduler.waiting) >= self.config.max_queue_len:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_queue_len} requests)")
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        req.finish(reason)
        self.scheduler.free(req)
        return req.make_output()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step -----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        stats = StepStats(num_preempted=len(sched.preempted))
        seqs = sched.seqs
        if seqs:
            sampling = [s for s in seqs if s.samples]
            spec = [s for s in sampling if s.num_draft_tokens > 0]
            proposal = self.proposer.propose([s.request for s in spec], [s.num_draft_tokens for s in spec],
                                             self.generator) if spec else None
            t1 = time.perf_counter()
            logits = self._target_forward(seqs, spec, proposal)
            for s in seqs:
                s.request.num_computed_tokens += s.num_new_tokens
                stats.num_prompt_tokens += s.num_new_tokens if s.is_prefill else 0
            if sampling:
                self._verify_and_update(sampling, spec, proposal, logits, stats)
            stats.draft_seconds, stats.verify_seconds = t1 - t0, time.perf_counter() - t1
        outputs = [s.request.make_output() for s in seqs if s.samples or s.request.finished]
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        stats.num_running, stats.num_waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        stats.kv_cache_usage = self.allocator.usage
        stats.step_seconds = time.perf_counter() - t0
        self.totals.add(stats)
        self.last_step = stats
        return outputs

    def _target_forward(self, seqs: list[ScheduledSeq], spec: list[ScheduledSeq], proposal) -> torch.Tensor:
        ids, chunks, rows, slots = [], [], [], []
        for s in seqs:
            req, k, n = s.request, s.num_draft_tokens, s.num_new_tokens
            start = req.num_computed_tokens
            if k:  # last emitted token, then k draft tokens filled in on the device below
                slots.extend(range(len(ids) + 1, len(ids) + 1 + k))
                ids.extend([req.token_ids[-1]] + [0] * k)
            else:
                ids.extend(req.token_ids[start:start + n])
            if s.samples:
                rows.extend(range(len(ids) - k - 1, len(ids)))
            chunks.append(SeqChunk(req.block_ids, start, n))
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        if spec:
            r = [i for i, s in enumerate(spec) for _ in range(s.num_draft_tokens)]
            c = [j for s in spec for j in range(s.num_draft_tokens)]
            input_ids[torch.tensor(slots, device=self.device)] = proposal.token_ids[r, c]
        return self.target.forward(input_ids, chunks, torch.tensor(rows, dtype=torch.long))  # [N, V]

    def _verify_and_update(self, sampling, spec, proposal, logits, stats: StepStats) -> None:
        ks = [s.num_draft_tokens for s in sampling]
        k_max = max(ks)
        draft_ids = torch.full((len(sampling), k_max), -1, dtype=torch.long, device=self.device)  # [B, K]
        draft_probs = None
        if spec:
            where = torch.tensor([i for i, s in enumerate(sampling) if s.num_draft_tokens], device=self.device)
            draft_ids[where] = proposal.token_ids
            if proposal.probs is not None:
                draft_probs = torch.zeros(len(sampling), k_max, self.vocab_size, device=self.device)  # [B, K, V]
                draft_probs[where] = proposal.probs
        res = verify(logits, [s.request for s in sampling], ks, draft_ids, draft_probs, self.generator)
        stats.num_accepted_tokens_per_pos = [0] * k_max
        for b, s in enumerate(sampling):
            req, k, m = s.request, ks[b], res.num_accepted[b]
            if k:
                req.speculation.num_steps += 1
                req.speculation.num_draft_tokens += k
                req.speculation.num_accepted_tokens += m
                stats.num_drafts += 1
                stats.num_draft_tokens += k
                stats.num_accepted_tokens += m
                stats.speculative_tokens_chosen.append(k)
                stats.accepted_lengths.append(m + 1)
                for j in range(m):
                    stats.num_accepted_tokens_per_pos[j] += 1
            try:  # a fault in one request (bad logits, a tokenizer error) ends that request alone
                if res.non_finite[b]:
                    raise FloatingPointError("the target produced non-finite logits")
                lp = res.logprobs[b]
                for j, tok in enumerate(res.tokens[b]):
                    self._append(req, tok, None if lp is None else TokenLogprob(tok, lp[0][j], lp[1][j]))
                    stats.num_generation_tokens += 1
                    if req.finished:
                        break
            except Exception as exc:
                log.exception("request %s failed", req.request_id)
                req.fail(f"{type(exc).__name__}: {exc}")
            req.num_computed_tokens = min(req.num_computed_tokens, len(req.token_ids) - 1)  # roll back rejects
            if self.proposer is not None:
                self.proposer.rollback(req)
            if req.finished:
                self.scheduler.free(req)

    def _append(self, req: Request, token: int, logprob: TokenLogprob | None) -> None:
        req.token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if req.logprobs is not None:
            req.logprobs.append(logprob)
        if token in req.stop_token_ids:
            req.finish("stop")
        elif req.detokenizer.append(token):
            req.finish("stop")
        elif req.num_output_tokens >= req.max_tokens or len(req.token_ids) >= self.max_model_len:
            req.finish("length")
