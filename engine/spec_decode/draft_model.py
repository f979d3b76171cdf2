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
from specserve.engine.sample.grammar import apply_bitmask, biased, fill_next_token_bitmask, words
from specserve.engine.sample.sampler import SamplingTensors, exponential_noise, processed_probs, sample
from specserve.engine.sched.kv_cache import KVPool, kv_bytes_per_token
from specserve.engine.spec_decode.base import Proposal, ProposerBase, ProposerContext, ProposerNeeds, VerifiedRow


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
        draft = load_model(cfg.model, ctx.dtype, ctx.device, ctx.trust_remote_code, field="draft_model")
        draft_map = None if is_gguf(cfg.model) else load_vocab_map(cfg.model, ctx.vocab_size, ctx.device)
        check_draft_compatible(ctx.target_path, cfg.model, ctx.tokenizer, ctx.target_config, draft.config, draft_map)
        return cls(draft, ctx.vocab_size, ctx.device, ctx.dtype, cfg.k_max, draft_map)

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model.config, self.dtype)

    def bind_kv(self, num_blocks: int, block_size: int) -> None:
        kv = KVPool.allocate(self.model.config, num_blocks, block_size, self.dtype, self.device)
        self.runner = ModelRunner(self.model, kv, self.device, self.vocab_size, self.vocab_map)

    def propose(self, requests: list[Request], ks: list[int], default_generator: torch.Generator) -> Proposal:
        num, k_max, vocab = len(requests), max(ks), self.vocab_size
        token_ids = torch.full((num, k_max), -1, dtype=torch.long, device=self.device)  # [S, K]
        probs = torch.zeros(num, k_max, vocab, device=self.device)  # [S, K, V]
        st_all = SamplingTensors.from_params([r.params for r in requests], self.device, penalties=False)
        # catch-up forward: every token the draft has not seen yet; logits at each sequence's last token
        chunks, ids = [], []
        for req in requests:
            done = self._computed.get(req.request_id, 0)
            new = req.token_ids[done:]
            chunks.append(SeqChunk(req.block_ids, done, len(new)))
            ids.extend(new)
        last_rows = torch.cumsum(torch.tensor([c.num_new for c in chunks]), 0) - 1
        logits = self.runner.forward(torch.tensor(ids, dtype=torch.long), chunks, last_rows)  # [S, V]
        active = list(range(num))
        grammars = {a: r.grammar for a, r in enumerate(requests) if r.grammar is not None}
        consumed = dict.fromkeys(grammars, 0)  # drafts each grammar request's matcher took (rolled back below)
        counts = list(ks)  # a grammar request's proposal ends where its grammar is complete (nothing comes after)
        for j in range(k_max):
            idx = torch.tensor(active, device=self.device)
            if any(requests[a].params.logit_bias for a in active):  # q sees the request's bias as p does
                logits = biased(logits, [requests[a].params.logit_bias for a in active])
            if grammars:  # q' = the draft's distribution under the same grammar state the target will see
                logits = self._constrained(logits, active, grammars)
            q = processed_probs(logits, _select(st_all, idx))  # [A, V]
            if st_all.all_greedy:  # one-hot q: the argmax needs no noise (and greedy rows consume none)
                drafted = q.argmax(dim=-1)
            else:
                noise = exponential_noise([requests[a].generator for a in active], vocab, default_generator,
                                          self.device)
                drafted = sample(q, noise)  # [A]
            token_ids[idx, j] = drafted
            probs[idx, j] = q
            if grammars:
                for a, tok in zip(active, drafted.tolist()):
                    if a in grammars:
                        consumed[a] += grammars[a].try_consume_tokens([tok])
                        if consumed[a] <= j or grammars[a].is_stopped():
                            counts[a] = j + 1
            keep = [n for n, a in enumerate(active) if counts[a] > j + 1]
            if not keep:
                break
            active = [active[n] for n in keep]
            chunks = [SeqChunk(requests[a].block_ids, len(requests[a].token_ids) + j, 1) for a in active]
            keep_idx = torch.tensor(keep, device=self.device)
            logits = self.runner.forward(drafted[keep_idx], chunks, torch.arange(len(active)))
        for a, matcher in grammars.items():
            matcher.rollback(consumed[a])
        for req, k in zip(requests, counts):
            self._computed[req.request_id] = len(req.token_ids) + k - 1
        return Proposal(token_ids, counts, probs)

    def _constrained(self, logits: torch.Tensor, active: list[int], grammars: dict) -> torch.Tensor:
        masks = torch.full((len(active), words(logits.shape[-1])), -1, dtype=torch.int32)
        for n, a in enumerate(active):
            if a in grammars:
                fill_next_token_bitmask(grammars[a], masks, n)
        return apply_bitmask(logits, masks)

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


def _select(st: SamplingTensors, idx: torch.Tensor) -> SamplingTensors:
    """Rows idx of every per-row tensor; host flags stay conservative (a superset of what the rows need)."""
    fields = {name: getattr(st, name)[idx] if isinstance(getattr(st, name), torch.Tensor) else getattr(st, name)
              for name in st.__dataclass_fields__}
    return SamplingTensors(**fields)
