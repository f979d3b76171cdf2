"""Medusa proposer: K heads over the target's last hidden state propose a tree of candidates from their top-k per depth
(the tree shape is `medusa_choices`, engine/spec_decode/medusa/tree.py), verified by the engine's lossless tree rule.

State: the final-norm hidden state of each request's last kept position (the row whose logits emitted the newest
token), handed over by the engine after every target forward (`on_hidden`); nothing to undo on rejection, since
the engine only hands over kept rows. Proposals are one-hot, so verification is exact at any temperature — unless
`medusa_typical_acceptance` is set, which swaps in Medusa's own typical acceptance: LOSSY.

A row given a budget of k < the tree's size gets the tree's first k nodes (the trainer orders them best first, and
any prefix of that order is a tree).
"""

from __future__ import annotations

from pathlib import Path

import torch

from specserve.config.schema import SpeculativeMethodConfig
from specserve.engine.model.hidden import FINAL
from specserve.engine.model.loader import DEMO_MEDUSA_DIR, bundled_for_demo
from specserve.engine.request import Request
from specserve.engine.spec_decode.base import (
    HiddenChunk,
    Proposal,
    ProposerBase,
    ProposerContext,
    ProposerNeeds,
    VerifiedRow,
)
from specserve.engine.spec_decode.medusa.heads import VOCAB_FILE, find_heads, load_heads, load_vocab
from specserve.engine.spec_decode.medusa.tree import default_tree, layout, parse_choices


def heads_directory(cfg: SpeculativeMethodConfig, ctx: ProposerContext) -> Path:
    """--medusa-heads, else heads inside the target's directory, else the bundled heads of the demo target."""
    if cfg.medusa_heads:
        path = Path(cfg.medusa_heads).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"medusa_heads: no heads directory at {cfg.medusa_heads}")
        return path
    target = Path(ctx.target_path).expanduser()
    if target.is_dir() and find_heads(target) is not None:
        return target
    bundled = bundled_for_demo(target, DEMO_MEDUSA_DIR)
    if bundled is not None and find_heads(bundled):
        return bundled
    raise ValueError(f"medusa_heads: speculative method 'medusa' needs heads: none in {ctx.target_path}; pass "
                     "--medusa-heads DIR (train them with `specserve train medusa`)")


class MedusaProposer(ProposerBase):
    name = "medusa"

    def __init__(self, heads, lm_head: torch.Tensor | None, choices: list[tuple[int, ...]], device: torch.device,
                 num_speculative_tokens: int, typical: tuple[float, float] | None = None,
                 vocab_ids: torch.Tensor | None = None):
        """vocab_ids [Vc]: the target ids shared heads may propose (lm_head then holds those rows only)."""
        super().__init__(ProposerNeeds(hidden_layers=(FINAL,), tree=True, cost_per_step=True,
                                       typical_acceptance=typical), min(num_speculative_tokens, len(choices)))
        self.heads = heads
        self.lm_head = lm_head
        self.vocab_ids = vocab_ids
        self.device = device
        self.choices = choices
        parents, head_of, rank_of = layout(choices)
        self.parents = parents
        self.head_index = torch.tensor(head_of, device=device)
        self.rank_index = torch.tensor(rank_of, device=device)
        # the first n nodes read heads 0..heads_for[n] - 1 and ranks 0..ranks_for[n] - 1: a step computes no more
        self.heads_for = [0] + [max(head_of[:n]) + 1 for n in range(1, len(choices) + 1)]
        self.ranks_for = [0] + [max(rank_of[:n]) + 1 for n in range(1, len(choices) + 1)]
        self._hidden: dict[str, torch.Tensor] = {}  # request id -> [H] state of its last kept position

    @classmethod
    def load(cls, cfg: SpeculativeMethodConfig, ctx: ProposerContext) -> "MedusaProposer":
        if not ctx.tree_attention:
            raise ValueError("speculative_method: medusa verifies trees, which this target's attention (sliding "
                             "window or chunked layers) cannot")
        directory = heads_directory(cfg, ctx)
        hidden = ctx.target_config.hidden_size
        heads, config = load_heads(directory, hidden, ctx.vocab_size)
        if heads.shared_lm_head and ctx.lm_head is None:
            raise ValueError("medusa_heads: these heads share the target's LM head, which the target does not expose")
        if cfg.medusa_choices:
            choices = parse_choices(cfg.medusa_choices, heads.num_heads)
        elif config.get("medusa_choices"):
            choices = parse_choices(config["medusa_choices"], heads.num_heads, f"medusa_choices (in {directory})")
        else:
            choices = default_tree(heads.num_heads)
        heads = heads.to(device=ctx.device, dtype=ctx.dtype).eval()
        k = len(choices) if cfg.adaptive else cfg.num_speculative_tokens
        typical = (cfg.posterior_threshold, cfg.posterior_alpha) if cfg.medusa_typical_acceptance else None
        ids, lm_head = load_vocab(directory, ctx.vocab_size), ctx.lm_head
        if ids is not None:
            if not heads.shared_lm_head:
                raise ValueError(f"medusa_heads: {VOCAB_FILE} is for heads that share the target's LM head; these "
                                 "heads have their own projections")
            ids = ids.to(ctx.device)
            lm_head = lm_head.detach()[ids].contiguous()  # [Vc, H] once, not a gather per step
        return cls(heads, lm_head, choices, ctx.device, k, typical, ids)

    @torch.no_grad()
    def candidates(self, hidden: torch.Tensor, width: int) -> torch.Tensor:
        """[S, H] last hidden states -> [S, width] the token of the first `width` tree nodes (node j + 1 at index
        j), computing only the heads and ranks those nodes read."""
        logits = self.heads.logits(hidden, self.lm_head, self.heads_for[width])  # [K', S, V or Vc]
        top = logits.topk(self.ranks_for[width], dim=-1).indices  # [K', S, R]
        nodes = top[self.head_index[:width], :, self.rank_index[:width]].t()  # [S, width]
        return nodes if self.vocab_ids is None else self.vocab_ids[nodes]

    def propose(self, requests: list[Request], ks: list[int], default_generator: torch.Generator) -> Proposal:
        width = self.num_speculative_tokens
        ids = torch.full((len(requests), width), -1, dtype=torch.long, device=self.device)
        counts = [0] * len(requests)
        live = [i for i, r in enumerate(requests) if r.request_id in self._hidden]
        if live:
            used = max(min(ks[i], width) for i in live)
            states = torch.stack([self._hidden[requests[i].request_id] for i in live])
            nodes = self.candidates(states, used)  # [L, used]
            caps = torch.tensor([min(ks[i], width) for i in live], device=self.device)
            keep = torch.arange(used, device=self.device)[None, :] < caps[:, None]
            ids[torch.tensor(live, device=self.device), :used] = torch.where(keep, nodes, torch.full_like(nodes, -1))
            for i in live:
                counts[i] = min(ks[i], width)
        return Proposal(ids, counts, parents=[self.parents[:width]] * len(requests))

    def on_hidden(self, requests: list[Request], chunks: list[HiddenChunk]) -> None:
        for req, chunk in zip(requests, chunks):
            self._hidden[req.request_id] = chunk.states[FINAL][-1]

    def on_verified(self, requests: list[Request], rows: list[VerifiedRow]) -> None:
        pass  # the kept rows' hidden states came through on_hidden

    def on_preempt(self, request: Request) -> None:
        pass  # the last position's state stays right: a preemption drops K/V, never tokens

    def on_free(self, request: Request) -> None:
        self._hidden.pop(request.request_id, None)
