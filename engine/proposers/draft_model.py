"""Draft-model proposer: a small LM sharing the target's tokenizer, with its own paged KV cache.

Each round it first feeds whatever it has not seen (the last emitted token; two tokens after a fully accepted
round, since it never fed its own last draft; the whole prompt the first time), then drafts k tokens
autoregressively, one batched forward per position, dropping rows whose k is reached.
"""

from __future__ import annotations

import torch

from engine.attention import SeqChunk
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampler import SamplingTensors, exponential_noise, processed_probs, sample
from engine.spec.base import Proposal


class DraftModelProposer:
    method = "draft"

    def __init__(self, runner: ModelRunner, device: torch.device):
        self.runner = runner
        self.device = device

    def propose(self, requests: list[Request], ks: list[int], default_generator: torch.Generator) -> Proposal:
        num, k_max, vocab = len(requests), max(ks), self.runner.vocab_size
        token_ids = torch.full((num, k_max), -1, dtype=torch.long, device=self.device)  # [S, K]
        probs = torch.zeros(num, k_max, vocab, device=self.device)  # [S, K, V]
        st_all = SamplingTensors.from_params([r.params for r in requests], self.device, penalties=False)
        # catch-up forward: every token the draft has not seen yet; logits at each sequence's last token
        chunks, ids = [], []
        for req in requests:
            new = req.token_ids[req.num_draft_computed_tokens:]
            chunks.append(SeqChunk(req.block_ids, req.num_draft_computed_tokens, len(new)))
            ids.extend(new)
        last_rows = torch.cumsum(torch.tensor([c.num_new for c in chunks]), 0) - 1
        logits = self.runner.forward(torch.tensor(ids, dtype=torch.long), chunks, last_rows)  # [S, V]
        active = list(range(num))
        for j in range(k_max):
            idx = torch.tensor(active, device=self.device)
            q = processed_probs(logits, _select(st_all, idx))  # [A, V]
            if st_all.all_greedy:  # one-hot q: the argmax needs no noise (and greedy rows consume none)
                drafted = q.argmax(dim=-1)
            else:
                noise = exponential_noise([requests[a].generator for a in active], vocab, default_generator,
                                          self.device)
                drafted = sample(q, noise)  # [A]
            token_ids[idx, j] = drafted
            probs[idx, j] = q
            keep = [n for n, a in enumerate(active) if ks[a] > j + 1]
            if not keep:
                break
            active = [active[n] for n in keep]
            chunks = [SeqChunk(requests[a].block_ids, len(requests[a].token_ids) + j, 1) for a in active]
            keep_idx = torch.tensor(keep, device=self.device)
            logits = self.runner.forward(drafted[keep_idx], chunks, torch.arange(len(active)))
        for req, k in zip(requests, ks):
            req.num_draft_computed_tokens = len(req.token_ids) + k - 1
        return Proposal(token_ids, probs)

    def rollback(self, request: Request) -> None:
        # valid draft K/V: all kept tokens except the newest one, which the draft has not fed yet
        request.num_draft_computed_tokens = min(request.num_draft_computed_tokens, len(request.token_ids) - 1)


def _select(st: SamplingTensors, idx: torch.Tensor) -> SamplingTensors:
    """Rows idx of every per-row tensor; host flags stay conservative (a superset of what the rows need)."""
    fields = {name: getattr(st, name)[idx] if isinstance(getattr(st, name), torch.Tensor) else getattr(st, name)
              for name in st.__dataclass_fields__}
    return SamplingTensors(**fields)
