"""Sampling a chain from a drafter, depth by depth, the way verification needs it: q is exactly the distribution each
draft token was drawn from, after the request's own logit_bias, grammar state, temperature and filters (so the
target's p and the draft's q are processed alike; penalties are left to p); greedy rows draw the argmax (one-hot q).
Shared by every method that drafts from logits (draft model, EAGLE-3)."""

from __future__ import annotations

import torch

from specserve.engine.request import Request
from specserve.engine.sample.grammar import apply_bitmask, biased, fill_next_token_bitmask, words
from specserve.engine.sample.sampler import SamplingTensors, argmax_rows, exponential_noise, processed_probs, sample
from specserve.engine.spec_decode.base import Proposal


class ChainSampler:
    def __init__(self, requests: list[Request], ks: list[int], vocab: int, device: torch.device,
                 default_generator: torch.Generator):
        self.requests, self.vocab, self.device, self.default_generator = requests, vocab, device, default_generator
        k_max = max(ks)
        self.token_ids = torch.full((len(requests), k_max), -1, dtype=torch.long, device=device)  # [S, K]
        self.probs = torch.zeros(len(requests), k_max, vocab, device=device)  # [S, K, V]
        self.st = SamplingTensors.from_params([r.params for r in requests], device, penalties=False)
        self.active = list(range(len(requests)))  # rows still drafting at this depth
        self.grammars = {a: r.grammar for a, r in enumerate(requests) if r.grammar is not None}
        self.consumed = dict.fromkeys(self.grammars, 0)  # drafts each matcher took (rolled back at the end)
        self.counts = list(ks)  # a grammar request's proposal ends where its grammar is complete

    def draw(self, depth: int, logits: torch.Tensor) -> torch.Tensor:
        """logits [A, V] of the active rows at this depth -> their draft tokens [A] (recorded with their q)."""
        active, requests = self.active, self.requests
        idx = torch.tensor(active, device=self.device)
        if any(requests[a].params.logit_bias for a in active):  # q sees the request's bias as p does
            logits = biased(logits, [requests[a].params.logit_bias for a in active])
        if self.grammars:  # q' = the draft's distribution under the same grammar state the target will see
            logits = self._constrained(logits)
        q = processed_probs(logits, _select(self.st, idx))  # [A, V]
        if self.st.all_greedy:  # one-hot q: the argmax needs no noise (and greedy rows consume none)
            drafted = argmax_rows(q)
        else:
            noise = exponential_noise([requests[a].generator for a in active], self.vocab, self.default_generator,
                                      self.device)
            drafted = sample(q, noise)  # [A]
        self.token_ids[idx, depth] = drafted
        self.probs[idx, depth] = q
        if self.grammars:
            for a, tok in zip(active, drafted.tolist()):
                if a in self.grammars:
                    self.consumed[a] += self.grammars[a].try_consume_tokens([tok])
                    if self.consumed[a] <= depth or self.grammars[a].is_stopped():
                        self.counts[a] = depth + 1
        return drafted

    def advance(self, depth: int) -> list[int]:
        """After `draw` at this depth: the positions (within the active rows) that draft another token; the active
        rows become those."""
        keep = [n for n, a in enumerate(self.active) if self.counts[a] > depth + 1]
        self.active = [self.active[n] for n in keep]
        return keep

    def proposal(self) -> Proposal:
        for a, matcher in self.grammars.items():
            matcher.rollback(self.consumed[a])
        return Proposal(self.token_ids, self.counts, self.probs)

    def _constrained(self, logits: torch.Tensor) -> torch.Tensor:
        masks = torch.full((len(self.active), words(logits.shape[-1])), -1, dtype=torch.int32)
        for n, a in enumerate(self.active):
            if a in self.grammars:
                fill_next_token_bitmask(self.grammars[a], masks, n)
        return apply_bitmask(logits, masks)


def _select(st: SamplingTensors, idx: torch.Tensor) -> SamplingTensors:
    """Rows idx of every per-row tensor; host flags stay conservative (a superset of what the rows need)."""
    fields = {name: getattr(st, name)[idx] if isinstance(getattr(st, name), torch.Tensor) else getattr(st, name)
              for name in st.__dataclass_fields__}
    return SamplingTensors(**fields)
