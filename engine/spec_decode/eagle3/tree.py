"""EAGLE-2's dynamic draft tree, as bookkeeping over a batch of rows (the proposer runs the drafter's forwards).

Every node carries the cumulative log-probability of its path under the drafter. The root's `topk` best children
are the first frontier; each depth, every frontier node is expanded into its `topk` best children and the `topk`
best of those (by cumulative log-probability) become the next frontier. A row's tree is its `budget` best nodes of
all that were generated: a child's score never exceeds its parent's (ties go to the older node), so the best
`budget` nodes always include their ancestors and form a tree. Expansion can stop as soon as no frontier node
scores above a row's budget-th best node: none of their descendants could enter any tree. Nodes are listed best
first.

Candidates are deterministic (the drafter's top-k, whatever the request's temperature), so verification uses the
one-hot tree rule and stays exact.
"""

from __future__ import annotations

import torch


class DynamicTree:
    def __init__(self, root_logp: torch.Tensor, topk: int):
        """root_logp [S, Vd]: the drafter's log-probabilities for the first drafted position of each row."""
        top = root_logp.topk(topk, dim=-1)
        self.topk = topk
        self.tokens = [top.indices]  # per generation: [S, n] draft ids of the candidates
        self.parents = [torch.full_like(top.indices, -1)]  # their parent candidate's index (-1: the root)
        self.scores = [top.values]  # their cumulative log-probabilities
        self.count = topk  # candidates so far
        self.front = torch.arange(topk, device=root_logp.device).expand_as(top.indices)  # [S, w] candidate index
        self.front_tokens, self.front_scores = top.indices, top.values
        self.front_rows = torch.zeros_like(top.indices)  # the frontier row of the previous depth each node came from

    def done(self, budgets: torch.Tensor) -> bool:
        """budgets [S] long: True when no frontier node can enter any row's tree any more."""
        scores = torch.cat(self.scores, dim=-1)  # [S, C]
        if scores.shape[1] < int(budgets.max()):
            return False
        kth = scores.sort(dim=-1, descending=True).values.gather(1, (budgets.clamp_min(1) - 1)[:, None])[:, 0]
        kth = torch.where(budgets > 0, kth, torch.full_like(kth, float("inf")))  # a row with no budget is done
        return bool((self.front_scores.max(dim=-1).values < kth).all())

    def expand(self, logp: torch.Tensor) -> None:
        """logp [S, w, Vd]: the drafter's log-probabilities after each frontier node -> the next frontier (its
        nodes' rows in this frontier are `front_rows`)."""
        s, w = self.front.shape
        top = logp.topk(self.topk, dim=-1)  # [S, w, topk]
        scores = (self.front_scores[..., None] + top.values).reshape(s, -1)
        tokens = top.indices.reshape(s, -1)
        parents = self.front[..., None].expand(s, w, self.topk).reshape(s, -1)
        self.tokens.append(tokens)
        self.parents.append(parents)
        self.scores.append(scores)
        best = scores.topk(min(self.topk, scores.shape[1]), dim=-1).indices  # [S, w']
        self.front = self.count + best
        self.front_tokens, self.front_scores = tokens.gather(1, best), scores.gather(1, best)
        self.front_rows = best // self.topk
        self.count += scores.shape[1]

    def select(self, budgets: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Each row's best `budget` nodes, best first -> (draft ids, parents with 0 = the root and j = the j-th node
        of the list). Best first is a topological order (a parent outscores its child or ties with it and is
        older), and any prefix is a tree: node j means "the j-th best" at every budget, which is what the
        adaptive planner's per-node acceptance estimates assume."""
        scores = torch.cat(self.scores, dim=-1).float().cpu()
        tokens = torch.cat(self.tokens, dim=-1).cpu().tolist()
        parents = torch.cat(self.parents, dim=-1).cpu().tolist()
        order = scores.sort(dim=-1, descending=True, stable=True).indices.tolist()  # ties: the older node first
        out_tokens, out_parents = [], []
        for row, budget in enumerate(budgets):
            chosen = order[row][:budget]
            place = {c: j + 1 for j, c in enumerate(chosen)}
            out_tokens.append([tokens[row][c] for c in chosen])
            out_parents.append([place[parents[row][c]] if parents[row][c] >= 0 else 0 for c in chosen])
        return out_tokens, out_parents
