"""Draft-model proposer: a small LM sharing the target's tokenizer (or mapped onto a sub-vocabulary of it), with its
own paged KV cache indexed by the same block ids as the target's.

Each round it first feeds whatever it has not seen (the last emitted token; two tokens after a fully accepted
round, since it never fed its own last draft; the whole prompt the first time or after a preemption), then drafts
k tokens autoregressively, one batched forward per position, dropping rows whose k is reached.
"""

from __future__ import annotations

import torch

from specserve.config.schema import SpeculativeMethodConfig
from specserve.engine.model.attention import SeqChunk
from specserve.engine.model.loader import check_draft_compatible, check_model_path, is_gguf, load_model
from specserve.engine.model.runner import ModelRunner
from specserve.engine.model.vocab_map import load_vocab_map
from specserve.engine.request import Request
from specserve.engine.sched.kv_cache import KVPool, kv_bytes_per_token
from specserve.engine.spec_decode.base import Proposal, ProposerBase, ProposerContext, ProposerNeeds, VerifiedRow
from specserve.engine.spec_decode.draft_sampling import ChainSampler


class DraftModelProposer(ProposerBase):
    name = "draft"
    uses_draft_model = True

    def __init__(self, model, vocab_size: int, device: torch.device, dtype: torch.dtype, num_speculative_tokens: int,
                 vocab_map=None):
        super().__init__(ProposerNeeds(returns_probs=True, prefix_kv="own"), num_speculative_tokens,
                         model.config.max_position_embeddings)
        self.model = model
        self.vocab_size = vocab_size
        self.device = device
        self.dtype = dtype
        self.vocab_map = vocab_map
        self.runner: ModelRunner | None = None  # once bind_kv sized its cache
        self._computed: dict[str, int] = {}  # request id -> positions whose draft K/V are valid

    @classmethod
    def load(cls, cfg: SpeculativeMethodConfig, ctx: ProposerContext) -> "DraftModelProposer":
        check_model_path(cfg.model, "draft_model")
        draft = load_model(cfg.model, ctx.dtype, ctx.device, ctx.trust_remote_code, field="draft_model",
                           quantization=ctx.quantization)
        draft_map = None if is_gguf(cfg.model) else load_vocab_map(cfg.model, ctx.vocab_size, ctx.device)
        check_draft_compatible(ctx.target_path, cfg.model, ctx.tokenizer, ctx.target_config, draft.config, draft_map)
        return cls(draft, ctx.vocab_size, ctx.device, ctx.dtype, cfg.k_max, draft_map)

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model.config, self.dtype)

    def bind_kv(self, num_blocks: int, block_size: int) -> None:
        kv = KVPool.allocate(self.model.config, num_blocks, block_size, self.dtype, self.device)
        self.runner = ModelRunner(self.model, kv, self.device, self.vocab_size, self.vocab_map)

    def propose(self, requests: list[Request], ks: list[int], default_generator: torch.Generator) -> Proposal:
        chain = ChainSampler(requests, ks, self.vocab_size, self.device, default_generator)
        # catch-up forward: every token the draft has not seen yet; logits at each sequence's last token
        chunks, ids = [], []
        for req in requests:
            done = self._computed.get(req.request_id, 0)
            new = req.token_ids[done:]
            chunks.append(SeqChunk(req.block_ids, done, len(new)))
            ids.extend(new)
        last_rows = torch.cumsum(torch.tensor([c.num_new for c in chunks]), 0) - 1
        logits = self.runner.forward(torch.tensor(ids, dtype=torch.long), chunks, last_rows)  # [S, V]
        for j in range(max(ks)):
            drafted = chain.draw(j, logits)
            keep = chain.advance(j)
            if not keep:
                break
            chunks = [SeqChunk(requests[a].block_ids, len(requests[a].token_ids) + j, 1) for a in chain.active]
            keep_idx = torch.tensor(keep, device=self.device)
            logits = self.runner.forward(drafted[keep_idx], chunks, torch.arange(len(chain.active)))
        for req, k in zip(requests, chain.counts):
            self._computed[req.request_id] = len(req.token_ids) + k - 1
        return chain.proposal()

    def on_verified(self, requests: list[Request], rows: list[VerifiedRow]) -> None:
        for req in requests:  # valid draft K/V: every kept token but the newest, which the draft has not fed yet
            if req.request_id in self._computed:
                self._computed[req.request_id] = min(self._computed[req.request_id], len(req.token_ids) - 1)

    def on_preempt(self, request: Request) -> None:
        self._computed.pop(request.request_id, None)  # its blocks are gone: catch up from position 0

    def kv_valid_tokens(self, request: Request) -> int:
        return self._computed.get(request.request_id, 0)

    def on_cache_hit(self, request: Request, num_tokens: int) -> None:
        self._computed[request.request_id] = num_tokens  # the catch-up starts past the shared blocks' draft KV

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.runner.kv.copy_blocks(src, dst)

    def on_free(self, request: Request) -> None:
        self._computed.pop(request.request_id, None)

