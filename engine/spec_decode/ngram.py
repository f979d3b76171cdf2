"""n-gram (prompt lookup) proposer: drafts the tokens that followed the latest earlier occurrence of the request's
own suffix in its prompt and output (vLLM's `ngram`, HF's prompt lookup). No model: proposals are one-hot, their
length varies per row, and often there are none. Each request's index grows by the new tokens only.

With `prompt_lookup_branches` b > 1 and several different continuations, it proposes a small tree instead: the
continuations (at most k of them) merged into a trie (shared prefixes once), each cut to k // (number found) tokens
so the tree holds at most k nodes; one continuation alone keeps the whole chain of k.
"""

from __future__ import annotations

import torch

from specserve.config.schema import SpeculativeMethodConfig
from specserve.engine.request import Request
from specserve.engine.spec_decode.base import LookupProposer, Proposal, ProposerContext, ProposerNeeds, chain_proposal
from specserve.engine.spec_decode.ngram_index import NgramIndex


def trie(paths: list[list[int]]) -> tuple[list[int], list[int]]:
    """Token paths from the root -> (node tokens, node parents) with shared prefixes merged (node j's parent at
    index j - 1; 0 = the root). Pure."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}
    for path in paths:
        node = 0
        for t in path:
            nxt = children.get((node, t))
            if nxt is None:
                tokens.append(t)
                parents.append(node)
                nxt = children[(node, t)] = len(tokens)
            node = nxt
    return tokens, parents


class NgramProposer(LookupProposer):
    name = "ngram"

    def __init__(self, num_speculative_tokens: int, n_min: int, n_max: int, device: torch.device,
                 branches: int = 1):
        super().__init__(device, num_speculative_tokens, ProposerNeeds(tree=branches > 1))
        NgramIndex(n_min, n_max, branches)  # validates the sizes once, at load
        self.n_min, self.n_max, self.branches = n_min, n_max, branches

    @classmethod
    def load(cls, cfg: SpeculativeMethodConfig, ctx: ProposerContext) -> "NgramProposer":
        branches = cfg.prompt_lookup_branches if ctx.tree_attention else 1  # windowed targets verify chains only
        return cls(cfg.k_max, cfg.prompt_lookup_min, cfg.prompt_lookup_max, ctx.device, branches)

    def _index(self, req: Request) -> NgramIndex:
        """The request's index, brought up to its tokens."""
        index = self._state.get(req.request_id)
        if index is None:
            index = self._state[req.request_id] = NgramIndex(self.n_min, self.n_max, self.branches)
        index.update(req.token_ids)
        return index

    def population(self, request: Request) -> str | None:
        """Drafts continuing a longer matched suffix are accepted more often: each match length is its own
        population ("ngram/4"); no match, no drafts."""
        n = self._index(request).match_length(request.token_ids)
        return f"{self.name}/{n}" if n else None

    def propose(self, requests: list[Request], ks: list[int], default_generator: torch.Generator) -> Proposal:
        drafts, parents = [], []
        for req, k in zip(requests, ks):
            index = self._index(req)
            found = index.continuations(req.token_ids, k, min(self.branches, k))  # each branch >= 1 node
            depth = k // max(1, len(found))
            tokens, par = trie([c[:depth] for c in found])
            drafts.append(tokens)
            parents.append(par)
        return chain_proposal(drafts, self.device, parents if self.branches > 1 else None)
