"""Adaptive speculation (`num_speculative_tokens: auto`): each step, the k of every adaptive request that maximises
the batch's expected emitted tokens per second (SmartSpec's goodput idea), from the fitted step costs
(engine/spec_decode/costs.py) and the tracked acceptance (engine/spec_decode/acceptance.py; their product with the
verify rule is each draft slot's survival probability).

Pure arithmetic on host floats: `plan()` takes the rows, what the step holds besides them, and the costs.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from specserve.engine.spec_decode.costs import StepCosts


@dataclass(frozen=True)
class Row:
    survival: list[float]  # s_1..s_K of the request
    cap: int  # the most it may propose this step
    method: str
    probe: bool = False  # idle long enough to probe with k = 1 whatever the plan says


@dataclass(frozen=True)
class StepBase:
    """What the step computes whatever the adaptive rows choose."""

    tokens: int  # every row's 1 + fixed-k rows' drafts + prefill tokens
    emitted: float  # tokens emitted without any adaptive draft (one per decoding row)
    decode_rows: int  # rows in the verify batch, padded together to the widest
    width: int = 1  # the widest row the fixed-k rows make


class Batch:
    """A plan under evaluation: per-row k, with what goodput needs (emitted, tokens, each method's longest row and
    drafting rows, the widest row) kept incrementally, so that pricing one more slot is O(methods)."""

    def __init__(self, rows: list[Row], ks: list[int], base: StepBase, costs: StepCosts, per_step: frozenset):
        self.rows, self.ks, self.base, self.costs, self.per_step = rows, list(ks), base, costs, per_step
        self.emitted = base.emitted + sum(sum(r.survival[:k]) for r, k in zip(rows, ks))
        self.tokens = base.tokens + sum(ks)
        self.width = max([base.width, *[1 + k for k in ks]])
        self.drafts: dict[str, tuple[int, int]] = {}  # method -> (longest row, rows drafting)
        for r, k in zip(rows, ks):
            if k:
                n, count = self.drafts.get(r.method, (0, 0))
                self.drafts[r.method] = (max(n, k), count + 1)

    def _seconds(self, tokens: int, width: int, drafts: dict[str, tuple[int, int]]) -> float:
        """Per-step methods run one position whatever their longest row."""
        runs = {m: (min(n, 1) if m in self.per_step else n, count) for m, (n, count) in drafts.items()}
        return self.costs.step(tokens, self.base.decode_rows * width, runs)

    def goodput(self) -> float:
        return self.emitted / max(self._seconds(self.tokens, self.width, self.drafts), 1e-9)

    def _grown(self, i: int) -> tuple[int, dict[str, tuple[int, int]]]:
        """(width, drafts) if row i proposed one more slot."""
        k, method = self.ks[i] + 1, self.rows[i].method
        n, count = self.drafts.get(method, (0, 0))
        return max(self.width, 1 + k), {**self.drafts, method: (max(n, k), count + (k == 1))}

    def with_slot(self, i: int) -> tuple[float, float]:
        """(emitted, goodput) if row i proposed one more slot."""
        emitted = self.emitted + self.rows[i].survival[self.ks[i]]
        width, drafts = self._grown(i)
        return emitted, emitted / max(self._seconds(self.tokens + 1, width, drafts), 1e-9)

    def add_slot(self, i: int, emitted: float) -> None:
        self.width, self.drafts = self._grown(i)
        self.emitted, self.tokens = emitted, self.tokens + 1
        self.ks[i] += 1


def goodput(rows: list[Row], ks: list[int], base: StepBase, costs: StepCosts,
            per_step: frozenset = frozenset()) -> float:
    """Expected emitted tokens per second of a step where rows[i] proposes ks[i] tokens."""
    return Batch(rows, ks, base, costs, per_step).goodput()


def plan(rows: list[Row], base: StepBase, costs: StepCosts, per_step: frozenset = frozenset()) -> list[int]:
    """k per row. (1) For each method, the common length L (capped per row) that maximises the step's goodput: a
    proposer's cost grows with its longest row and the verify batch is padded to its widest row, so uniform lengths
    are what the hardware rewards. (2) On top, single slots, most likely first, while each raises the goodput. (3) Each
    row then drops trailing slots whose survival does not pay for their verify token at the final goodput, and idle
    rows probe with k = 1. Before any cost was measured it proposes the caps, to measure them."""
    if not costs.known:
        return [r.cap for r in rows]
    ks = [0] * len(rows)
    for method in dict.fromkeys(r.method for r in rows):
        idx = [i for i, r in enumerate(rows) if r.method == method]
        best, best_l = -1.0, 0
        for length in range(max(rows[i].cap for i in idx) + 1):
            trial = list(ks)
            for i in idx:
                trial[i] = min(length, rows[i].cap)
            g = goodput(rows, trial, base, costs, per_step)
            if g > best * (1 + 1e-6):
                best, best_l = g, length
        for i in idx:
            ks[i] = min(best_l, rows[i].cap)
    batch = Batch(rows, ks, base, costs, per_step)
    _add_single_slots(batch)
    ks, g = batch.ks, batch.goodput()
    per_token = costs.forward.coefficients()[1]
    for i, r in enumerate(rows):  # a slot is worth its token of verify work if it is emitted often enough
        while ks[i] > 0 and r.survival[ks[i] - 1] < g * per_token:
            ks[i] -= 1
        if ks[i] == 0 and r.probe and r.cap > 0:
            ks[i] = 1
    return ks


def _add_single_slots(batch: Batch) -> None:
    """Greedy marginal additions, the most likely next slot first (a heap), each kept only if it raises the
    goodput; O(slots log rows)."""
    current = batch.goodput()
    heap = [(-r.survival[batch.ks[i]], i) for i, r in enumerate(batch.rows) if batch.ks[i] < r.cap]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        emitted, g = batch.with_slot(i)
        if g <= current:
            continue  # this row's next slot does not pay; its later slots are less likely still
        batch.add_slot(i, emitted)
        current = g
        if batch.ks[i] < batch.rows[i].cap:
            heapq.heappush(heap, (-batch.rows[i].survival[batch.ks[i]], i))
