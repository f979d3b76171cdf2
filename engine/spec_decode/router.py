"""The router between the engine and its proposers. Each speculative row asks its proposer (a request with a
prediction asks the prediction first, then its method where the prediction offers nothing); the answers become one
DraftBatch for verification; after the step each proposer is told what happened to its rows."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specserve.engine.request import Request
from specserve.engine.sample.tree import check_tree
from specserve.engine.sample.verifier import DraftBatch
from specserve.engine.spec_decode.base import Proposal
from specserve.engine.spec_decode.step_results import hidden_chunks, verified_rows


@dataclass
class RowProposal:
    """What one row's proposer proposed (host lists; probs on the device)."""

    owner: str  # the proposer's name
    tokens: list[int]
    parents: list[int] | None = None  # a tree (node j's parent at j - 1); None: a chain
    probs: torch.Tensor | None = None  # [n, V] q of a sampled chain
    typical: tuple[float, float] | None = None  # a tree verified by typical acceptance (LOSSY, opt-in)
    tree_depth: int = 0  # a tree's depth (set once it is checked); a chain's is its length

    @property
    def depth(self) -> int:
        """Draft positions the proposal reaches: what per-position acceptance counts (nodes of a tree share them)."""
        return self.tree_depth if self.is_tree else len(self.tokens)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None and self.parents != list(range(len(self.parents)))


class ProposalRouter:
    """The engine's one door to the proposers: proposals (with their measured cost), one call after each verified
    step (hidden states, then what was accepted), and the lifecycle hooks (preempt, free, prefix-cache hits)."""

    def __init__(self, proposers: dict, prediction, tree_attention: bool, on_cost=None):
        """`on_cost(method, positions, rows, seconds)` hears what each proposer call took (the adaptive
        controller)."""
        self.proposers = proposers  # name -> loaded method, the default first
        self.prediction = prediction  # the engine-owned Predicted Outputs proposer
        self.tree_attention = tree_attention
        # proposers keeping KV per position, which prefix caching shares and validates with the target's
        self.kv_proposers = {n: p for n, p in proposers.items() if p.needs.prefix_kv != "none"}
        self.on_cost = on_cost

    def all(self) -> list:
        return [*self.proposers.values(), self.prediction]

    def population(self, req: Request) -> str | None:
        """The acceptance population of the request's next drafts (ProposerBase.population); a request with a
        prediction drafts from it first, so it keeps its method's name; None: nothing to propose this step."""
        p = self.proposers.get(req.method)
        return req.method if p is None or req.prediction_token_ids else p.population(req)

    def hidden_reader(self, req: Request):
        """The proposer that reads this request's target hidden states, if any."""
        p = self.proposers.get(req.method)
        return p if p is not None and p.needs.hidden_layers else None

    def propose(self, requests: list[Request], ks: list[int], generator: torch.Generator) -> list[RowProposal | None]:
        """Row i gets at most ks[i] >= 1 nodes, or None when its proposers have nothing."""
        rows: list[RowProposal | None] = [None] * len(requests)

        def ask(proposer, idx: list[int]) -> None:
            caps = [min(ks[i], proposer.num_speculative_tokens) for i in idx]
            t0 = time.perf_counter()
            prop = proposer.propose([requests[i] for i in idx], caps, generator)
            rows_ids = prop.token_ids.tolist()  # (the host read ends the timing: the proposer's work is done)
            if self.on_cost is not None:
                positions = 1 if proposer.needs.cost_per_step else max(caps)
                self.on_cost(proposer.name, positions, len(idx), time.perf_counter() - t0)
            for j, i in enumerate(idx):
                n = prop.num_tokens[j]
                if n:
                    rows[i] = self._row(proposer, prop, j, rows_ids[j][:n], caps[j])

        predicted = [i for i, r in enumerate(requests) if r.prediction_token_ids]
        if predicted:
            ask(self.prediction, predicted)
        by_method: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            if rows[i] is None and r.method in self.proposers:
                by_method.setdefault(r.method, []).append(i)
        for name, idx in by_method.items():
            ask(self.proposers[name], idx)
        return rows

    def after_step(self, seqs, proposals: list[RowProposal | None], layout, paths: dict[int, list[int]],
                   hidden: dict, hidden_rows) -> None:
        """After the tokens are appended: each hidden-state reader gets the states of the tokens whose K/V were kept,
        then each proposer hears what verification did with its rows."""
        if hidden:
            for name, (reqs, chunks) in hidden_chunks(seqs, layout, paths, hidden, hidden_rows,
                                                      self.hidden_reader).items():
                self.proposers[name].on_hidden(reqs, chunks)
        for name, (reqs, rows) in verified_rows(seqs, proposals, paths).items():
            owner = self.prediction if name == self.prediction.name else self.proposers[name]
            owner.on_verified(reqs, rows)

    def preempt(self, req: Request) -> None:
        for p in self.all():
            p.on_preempt(req)

    def free(self, req: Request) -> None:
        for p in self.all():
            p.on_free(req)

    def kv_valid_tokens(self, req: Request) -> int | None:
        """Leading positions of the request whose KV its own proposer holds; None: its method keeps no KV."""
        p = self.kv_proposers.get(req.method)
        return None if p is None else p.kv_valid_tokens(req)

    def cache_hit(self, req: Request, num_tokens: int) -> None:
        self.kv_proposers[req.method].on_cache_hit(req, num_tokens)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        for p in self.kv_proposers.values():
            p.copy_blocks(src, dst)

    def _row(self, proposer, prop: Proposal, j: int, tokens: list[int], cap: int) -> RowProposal:
        """Checks what a proposer returned against the contract (a violation is a bug in that method)."""
        if len(tokens) > cap or any(t < 0 for t in tokens):
            raise RuntimeError(f"proposer {proposer.name}: row {j} proposed {tokens} with a budget of {cap}")
        parents = None if prop.parents is None else list(prop.parents[j][: len(tokens)])
        row = RowProposal(proposer.name, tokens, parents, None if prop.probs is None else prop.probs[j, : len(tokens)],
                          proposer.needs.typical_acceptance)
        if row.is_tree:
            if not (proposer.needs.tree and self.tree_attention) or row.probs is not None:
                raise RuntimeError(f"proposer {proposer.name}: a tree where only chains are allowed")
            row.tree_depth = check_tree(parents, tokens)
        return row


def draft_batch(rows: list[RowProposal | None], vocab: int, device: torch.device) -> DraftBatch:
    """Rows of one verify step (None: no proposal) -> tensors, padded to the widest row."""
    width = max([len(r.tokens) for r in rows if r is not None], default=0)
    ids = torch.full((len(rows), width), -1, dtype=torch.long)
    tree_rows = tuple(b for b, r in enumerate(rows) if r is not None and r.is_tree)
    parents = torch.arange(width).repeat(len(rows), 1) if tree_rows else None  # chains: node j's parent is j - 1
    for b, r in enumerate(rows):
        if r is None:
            continue
        n = len(r.tokens)
        ids[b, :n] = torch.tensor(r.tokens, dtype=torch.long)
        if b in tree_rows:
            parents[b, :n] = torch.tensor(r.parents, dtype=torch.long)
    prob_rows = tuple(b for b, r in enumerate(rows) if r is not None and r.probs is not None)
    probs = None
    if prob_rows:  # one padding op, not a copy per row
        probs = torch.nn.utils.rnn.pad_sequence([rows[b].probs for b in prob_rows], batch_first=True)  # [P, n, V]
        probs = torch.nn.functional.pad(probs, (0, 0, 0, width - probs.shape[1]))  # [P, K, V]
    typical = {b: rows[b].typical for b in tree_rows if rows[b].typical is not None}
    return DraftBatch(ids.to(device), None if parents is None else parents.to(device), probs, prob_rows, tree_rows,
                      typical or None)
