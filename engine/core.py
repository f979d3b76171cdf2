"""EngineCore: the synchronous step loop over the target, the loaded proposers and the KV cache.

`step()`: adaptive requests get this step's k (engine/spec_decode/controller.py); the scheduler hands each running
request a token budget (a prefill chunk, or its last token + up to k proposed tokens); each request's proposer
proposes at most that many (possibly none; a chain or a tree); ONE target forward runs over the whole ragged batch
(prefill chunks and 1 + proposed verify positions alike); `verify()` applies the chain rejection rule or the tree
rule; then tokens are appended, rejected positions rolled back (O(1): computed lengths only; an accepted tree path's
K/V moved into place), the proposers told what was accepted (and given target hidden states where they asked), and
finished requests' blocks freed. The parts it steps are built once by engine/assembly.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from specserve.config.schema import EngineConfig
from specserve.engine.assembly import EngineParts, assemble
from specserve.engine.errors import InvalidRequestError
from specserve.engine.model.attention import SHORT_QUERY, SeqChunk
from specserve.engine.model.compile import compilations
from specserve.engine.request import Request, RequestOutput, TokenLogprob
from specserve.engine.sample.grammar import advance_grammar, apply_bitmask, biased, verify_bitmasks
from specserve.engine.sample.verifier import verify
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.sched.scheduler import ScheduledSeq
from specserve.engine.spec_decode.controller import CostSource
from specserve.engine.spec_decode.layout import RowLayout
from specserve.engine.spec_decode.prediction import prediction_usage
from specserve.engine.spec_decode.router import RowProposal, draft_batch
from specserve.engine.spec_decode.step_results import count_speculation, path_moves
from specserve.engine.stats import EngineTotals, StepStats

log = logging.getLogger("specserve.engine")


class EngineCore:
    def __init__(self, config: EngineConfig, cost_source: CostSource | None = None):
        """`cost_source`: where adaptive k's costs come from (None: the engine's own timings; tests inject a model)."""
        parts = assemble(config, cost_source)
        for f in dataclasses.fields(EngineParts):  # the parts as attributes: self.target, self.scheduler, ...
            setattr(self, f.name, getattr(parts, f.name))
        self.requests: dict[str, Request] = {}
        self.totals = EngineTotals()
        self.last_step = StepStats()
        if self.compiled:
            try:
                self._warm_up()
            except BaseException:
                if self.sharded is not None:
                    self.sharded.abort()
                raise

    def _warm_up(self) -> None:
        """With a compiled target: compile before serving the shape classes a step meets, so that no request waits
        on the compiler for them; then forget the warm-up's counts. The metadata's shapes are stable
        (ModelRunner.stable_shapes), so the classes are one vs several input tokens and logits rows: a lone prefill
        (one logits row), one sequence decoding (one token), several prefilling and decoding together."""
        t0, graphs = time.perf_counter(), compilations()
        bs = self.config.block_size
        ids = self.tokenizer.encode("Warm up the compiled forward with a few words of prompt and some more.")
        ids = (ids * (4 * bs // max(len(ids), 1) + 1))[: 4 * bs]  # any valid ids, 4 blocks of them
        # one sequence (prefill, then decoding), then three of different lengths together
        for lengths in ([bs // 2], [bs + 3, 2 * bs + 5, 4 * bs - 1]):
            params = SamplingParams(max_tokens=bs, temperature=0.0, ignore_eos=True)
            for i, n in enumerate(lengths):
                self.add_request(self.make_request(f"warm-up-{len(lengths)}-{i}", ids[:n], params))
            while self.has_unfinished():
                self.step()
        self.totals, self.last_step = EngineTotals(), StepStats()
        log.info("compile: warmed up in %.1f s (%d graphs)", time.perf_counter() - t0, compilations() - graphs)

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one device)."""
        if self.sharded is not None:
            self.sharded.close()

    @property
    def proposers(self) -> dict:
        """name -> loaded method, the default first (read-only use: the step reaches them through the router)."""
        return self.router.proposers

    @property
    def proposer(self):
        """The default method's proposer (None without speculation)."""
        return self.proposers.get(self.default_method)

    # -- requests ---------------------------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.builder.tokenize(prompt)

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     prompt_token_ids: list[int] | None = None) -> Request:
        """Validate and build a request without enqueueing it; safe on any thread (engine/admission.py)."""
        return self.builder.build(request_id, prompt, params, prompt_token_ids)

    def add_request(self, request: Request) -> None:
        """Enqueue (on the step loop's thread). Admission limits (max_queue_len) belong to the caller that can
        answer "retry later": AsyncEngine.submit."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request_id: {request.request_id!r} is already in use", "request_id")
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        req.finish(reason)
        self._free(req)
        return req.make_output()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step -----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """schedule -> propose -> forward -> verify -> update, each a call into the part that owns it; stats are
        collected beside."""
        t0 = time.perf_counter()
        self.controller.plan(self.scheduler.running, self.router.population)
        sched = self.scheduler.schedule()
        self._apply_preemptions_and_cache_hits(sched)
        stats = StepStats(num_preempted=len(sched.preempted), prefix_cache_queries=sched.prefix_queries,
                          prefix_cache_hits=sched.prefix_hits)
        seqs = sched.seqs
        if seqs:
            t_propose = time.perf_counter()
            seqs, proposals = self._propose(seqs)
            layout = RowLayout.build(seqs)
            graphs = compilations() if self.compiled else 0
            t_forward = time.perf_counter()
            stats.draft_seconds = t_forward - t_propose
            logits, hidden, hidden_rows = self._target_forward(seqs, proposals, layout)
            self._advance_computed(seqs, stats)
            paths = self._verify_and_update(seqs, proposals, layout, logits, stats)
            self.router.after_step(seqs, proposals, layout, paths, hidden, hidden_rows)
            self._publish_and_free(seqs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # what the step launched is part of its cost
            stats.verify_seconds = time.perf_counter() - t_forward
            # the adaptive planner's step cost: the forward and everything its width drives (verification, the
            # tree rule's K/V moves, hidden states handed to proposers), against its token and padded-slot counts
            short = [s.num_new_tokens for s in seqs if s.num_new_tokens <= SHORT_QUERY]  # padded together
            kind = ("tree" if any(p is not None and p.is_tree for p in proposals)
                    else "chain" if any(p is not None for p in proposals) else "plain")
            if not self.compiled or compilations() == graphs:  # a step that compiled a new shape is no cost sample
                self.controller.observe_forward(sum(s.num_new_tokens for s in seqs),
                                                len(short) * max(short, default=0), stats.verify_seconds, kind)
        return self._step_outputs(seqs, stats, t0)

    def _apply_preemptions_and_cache_hits(self, sched) -> None:
        """Before anything computes: proposers told of preempted requests; private copies of shared blocks (in
        every pool); each hit request's proposer told how much of its own KV the shared blocks hold (it catches up
        from there)."""
        for req in sched.preempted:
            self.router.preempt(req)
        if sched.copies:
            src, dst = [c[0] for c in sched.copies], [c[1] for c in sched.copies]
            self.target.kv.copy_blocks(src, dst)
            self.router.copy_blocks(src, dst)
        for hit in sched.cache_hits:
            self.router.cache_hit(hit.request, hit.proposer_tokens)

    def _propose(self, seqs: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], list[RowProposal | None]]:
        """Proposals for the rows the scheduler gave a speculative budget; each such row then computes 1 + what was
        proposed (the scheduler reserved 1 + k). -> (seqs trimmed to their proposals, proposal per seq)."""
        spec = [i for i, s in enumerate(seqs) if s.emits and s.num_draft_tokens > 0]
        proposals: list[RowProposal | None] = [None] * len(seqs)
        if not spec:
            return seqs, proposals
        rows = self.router.propose([seqs[i].request for i in spec], [seqs[i].num_draft_tokens for i in spec],
                                   self.generator)
        seqs = list(seqs)
        for i, row in zip(spec, rows):
            n = 0 if row is None else len(row.tokens)
            seqs[i] = dataclasses.replace(seqs[i], num_new_tokens=1 + n, num_draft_tokens=n)
            proposals[i] = row
        return seqs, proposals

    def _target_forward(self, seqs: list[ScheduledSeq], proposals: list[RowProposal | None], layout: RowLayout):
        """ONE forward over every sequence's new tokens (prefill chunks; last token + proposed nodes).
        -> (logits [N, V] at the layout's logit rows, hidden states if a proposer asked, the rows they were taken
        at: None = every token row)."""
        ids, chunks = [], []
        for s, prop in zip(seqs, proposals):
            req, n = s.request, s.num_new_tokens
            start = req.num_computed_tokens
            if prop is not None:  # the last emitted token, then the proposed nodes
                ids.extend([req.token_ids[-1], *prop.tokens])
            else:
                ids.extend(req.token_ids[start:start + n])
            parents = tuple(prop.parents) if prop is not None and prop.is_tree else None
            chunks.append(SeqChunk(req.block_ids, start, n, parents))
        input_ids = torch.tensor(ids, dtype=torch.long)
        logits_rows = torch.tensor(layout.logit_rows, dtype=torch.long)
        readers = [self.router.hidden_reader(s.request) for s in seqs]
        if not any(readers):
            logits, _ = self.target.run(input_ids, chunks, logits_rows)
            return logits, {}, None
        every = any(r is not None and r.needs.hidden_rows == "all" for r in readers)
        hidden_rows = None if every else logits_rows  # None: every token row
        logits, hidden = self.target.run(input_ids, chunks, logits_rows, hidden_rows, capture=True)
        return logits, hidden, hidden_rows

    def _advance_computed(self, seqs: list[ScheduledSeq], stats: StepStats) -> None:
        """The forward's K/V are in the cache: computed lengths advance (verification rolls rejects back)."""
        for s in seqs:
            s.request.num_computed_tokens += s.num_new_tokens
            stats.num_prompt_tokens += s.num_new_tokens if s.is_prefill else 0

    def _verify_and_update(self, seqs, proposals, layout: RowLayout, logits, stats: StepStats) -> dict[int, list[int]]:
        """Verify every emitting sequence, append what it emitted, roll back rejected positions (and move an
        accepted tree path's K/V into place). -> seq index -> its emitted rows' nodes (0 = the last token)."""
        if not layout.emitting:
            return {}
        reqs = [seqs[i].request for i in layout.emitting]
        props = [proposals[i] for i in layout.emitting]
        if any(r.params.logit_bias for r in reqs):
            logits = biased(logits, layout.per_row([r.params.logit_bias for r in reqs]))
        if any(r.grammar is not None for r in reqs):
            logits = apply_bitmask(logits, verify_bitmasks(reqs, props, layout, self.vocab_size))
        res = verify(logits, reqs, layout.ks, layout.logit_offsets, draft_batch(props, self.vocab_size, self.device),
                     self.generator)
        stats.num_accepted_tokens_per_pos = [0] * max(layout.ks)
        moves: tuple[list[int], list[int]] = ([], [])
        for b, (req, prop) in enumerate(zip(reqs, props)):
            k, m = layout.ks[b], res.num_accepted[b]
            req.speculation.steps_by_k[k] = req.speculation.steps_by_k.get(k, 0) + 1
            if k:
                count_speculation(req, k, m, stats, prop.depth)
                self.controller.observe_verified(req.request_id, prop.owner, k, m, res.paths[b])
                if prop.is_tree:
                    root = layout.roots[layout.emitting[b]]
                    src, dst = path_moves(req.block_ids, self.allocator.block_size, root, res.paths[b])
                    moves[0].extend(src)
                    moves[1].extend(dst)
            self._emit(req, res, b, stats)
            req.num_computed_tokens = min(req.num_computed_tokens, len(req.token_ids) - 1)  # roll back rejects
        if moves[0]:
            self.target.kv.copy_slots(*moves)
        return {i: res.paths[b] for b, i in enumerate(layout.emitting)}

    def _emit(self, req: Request, res, b: int, stats: StepStats) -> None:
        """Append the b-th verified row's tokens until the request finishes; a fault here (bad logits, a tokenizer
        error) ends this request alone."""
        try:
            if res.non_finite[b]:
                raise FloatingPointError("the target produced non-finite logits")
            lp = res.logprobs[b]
            for j, tok in enumerate(res.tokens[b]):
                self._append(req, tok, None if lp is None else TokenLogprob(tok, lp[0][j], lp[1][j]))
                stats.num_generation_tokens += 1
                if req.grammar is not None and advance_grammar(req.grammar, tok) and not req.finished:
                    req.finish("stop")  # the grammar is complete: plain decoding would stop here too
                if req.finished:
                    break
        except Exception as exc:
            log.exception("request %s failed", req.request_id)
            req.fail(f"{type(exc).__name__}: {exc}")

    def _publish_and_free(self, seqs: list[ScheduledSeq]) -> None:
        """Full, verified blocks become shareable (with the proposer KV they hold); finished requests let go."""
        for s in seqs:
            if s.request.finish_reason != "error":  # a failed request's last K/V may be what failed: keep it out
                self.scheduler.publish(s.request, self.router.kv_valid_tokens(s.request))
            if s.request.finished:
                self._free(s.request)

    def _step_outputs(self, seqs: list[ScheduledSeq], stats: StepStats, t0: float) -> list[RequestOutput]:
        outputs = [s.request.make_output() for s in seqs if s.emits or s.request.finished]
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        stats.num_running, stats.num_waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        stats.kv_cache_usage = self.allocator.usage
        stats.step_seconds = time.perf_counter() - t0
        self.totals.add(stats)
        self.last_step = stats
        return outputs

    def _free(self, req: Request) -> None:
        if req.prediction_token_ids:
            usage = prediction_usage(req.prediction_token_ids, req.output_token_ids)
            req.speculation.accepted_prediction_tokens, req.speculation.rejected_prediction_tokens = usage
        self.scheduler.free(req)
        self.controller.forget(req.request_id)
        self.router.free(req)

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

