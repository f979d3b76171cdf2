"""The adaptive controller: everything `num_speculative_tokens: auto` decides and learns, in one owner. Each step it
plans the k of every decoding adaptive request (engine/spec_decode/adaptive.py: the batch's expected emitted tokens
per second under the fitted step costs and the tracked acceptance); it hears what the target forward and each
proposer call cost, and what verification accepted.

Costs come from an injected `CostSource`: `MeasuredCosts` passes on the wall-clock seconds the engine measured
around the real work (production); a test passes a model of the costs instead, so that what the policy decides
does not depend on how busy the machine running the test is.
"""

from __future__ import annotations

from typing import Protocol

from specserve.engine.request import Request
from specserve.engine.spec_decode.acceptance import PROBE_EVERY, AcceptanceTracker, method_of
from specserve.engine.spec_decode.adaptive import Row, StepBase, plan
from specserve.engine.spec_decode.costs import StepCosts


class CostSource(Protocol):
    def forward(self, num_tokens: int, padded: int, measured: float) -> float:
        """Seconds to attribute to a target forward and its verification over `num_tokens` tokens, whose short rows
        were padded to `padded` query slots, that took `measured` seconds."""

    def propose(self, method: str, num_positions: int, num_rows: int, measured: float) -> float:
        """Seconds to attribute to a `method` proposal for `num_rows` rows reaching `num_positions` positions (1 for
        the methods whose cost is per step) that took `measured` seconds."""


class MeasuredCosts:
    """Production: what the engine measured."""

    def forward(self, num_tokens: int, padded: int, measured: float) -> float:
        return measured

    def propose(self, method: str, num_positions: int, num_rows: int, measured: float) -> float:
        return measured


class AdaptiveController:
    def __init__(self, k_max: int, tree_methods: frozenset, per_step_methods: frozenset, max_num_batched_tokens: int,
                 costs: CostSource | None = None):
        self.source = costs if costs is not None else MeasuredCosts()
        self.max_num_batched_tokens = max_num_batched_tokens
        self.per_step_methods = per_step_methods  # proposers whose cost hardly grows with k
        self.costs = StepCosts()
        self.tracker = AcceptanceTracker(k_max, tree_methods)
        self._expected: dict[str, float] = {}  # request -> accepted drafts its planned k was expected to yield
        self._population: dict[str, str] = {}  # request -> the acceptance population its last plan assumed
        self.accepted_log: dict[str, list[float]] = {}  # method -> [expected, accepted, steps] of planned drafts

    def plan(self, running: list[Request], population=None) -> None:
        """This step's k (`planned_k`) of every decoding adaptive request; others keep their fixed k.
        `population(request)` names the acceptance population of its next drafts, None when its method has nothing
        to propose this step (default: the method's name)."""
        decoding = [r for r in running if r.num_computed_tokens == len(r.token_ids) - 1 and r.num_computed_tokens]
        auto = [r for r in decoding if r.adaptive]
        if not auto:
            return
        fixed = [r.num_speculative_tokens for r in decoding if not r.adaptive]
        pending = sum(len(r.token_ids) - r.num_computed_tokens for r in running) - len(decoding)
        base = StepBase(min(len(decoding) + sum(fixed) + pending, self.max_num_batched_tokens), len(decoding),
                        len(decoding), 1 + max(fixed, default=0))
        rows = []
        for r in auto:
            key = population(r) if population is not None else r.method
            self._population[r.request_id] = key or r.method
            s = self.tracker.survival(r.request_id, key or r.method)
            idle = self.tracker.idle.get(r.request_id, 0)
            rows.append(Row(s, r.num_speculative_tokens if key else 0, r.method, idle >= PROBE_EVERY))
        ks = plan(rows, base, self.costs, self.per_step_methods)
        for r, row, k in zip(auto, rows, ks):
            r.planned_k = k
            if k == 0:
                self.tracker.idle_step(r.request_id)
            else:
                self._expected[r.request_id] = sum(row.survival[:k])

    def observe_forward(self, num_tokens: int, padded: int, measured: float, kind: str = "step") -> None:
        """`kind` (plain, chain, tree) only labels the step in the prediction log."""
        self.costs.observe_forward(num_tokens, padded, self.source.forward(num_tokens, padded, measured), kind)

    def observe_proposal(self, method: str, num_positions: int, num_rows: int, measured: float) -> None:
        self.costs.observe_proposal(method, num_positions, num_rows,
                                    self.source.propose(method, num_positions, num_rows, measured))

    def observe_verified(self, request_id: str, method: str, k: int, m: int, path: list[int] | None) -> None:
        """Request `request_id` proposed k nodes with `method`, m were accepted (`path`: a tree's accepted nodes)."""
        key = self._population.get(request_id, method)  # what its plan assumed, if its method drafted
        self.tracker.observe(request_id, key if method_of(key) == method else method, k, m, path)
        expected = self._expected.pop(request_id, None)
        if expected is not None:  # planned this step (a proposer may have returned fewer than planned)
            log = self.accepted_log.setdefault(method, [0.0, 0.0, 0])
            log[0], log[1], log[2] = log[0] + expected, log[1] + m, log[2] + 1

    def forget(self, request_id: str) -> None:
        self.tracker.forget(request_id)
        self._expected.pop(request_id, None)
        self._population.pop(request_id, None)

    def report(self) -> dict:
        """The fitted costs and how well they predicted the steps (for benches and debugging)."""
        f = self.costs.forward.coefficients()
        return {"forward_seconds": {"intercept": f[0], "per_token": f[1], "per_padded_slot": f[2]},
                "proposer_seconds": {m: dict(zip(("intercept", "per_position", "per_row_position"), c.coefficients()))
                                     for m, c in self.costs.proposers.items()},
                "step_prediction": self.costs.log.summary(),
                "accepted_prediction": {m: {"steps": n, "expected": round(e, 1), "accepted": a,
                                            "accepted_over_expected": round(a / e, 3) if e else None}
                                        for m, (e, a, n) in self.accepted_log.items()}}
