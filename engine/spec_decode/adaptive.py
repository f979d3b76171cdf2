"""Adaptive speculation (`num_speculative_tokens: auto`): each step, the k of every adaptive request that maximises
the batch's expected emitted tokens per second, from costs the engine measures while it runs and acceptance it
tracks per request and per position (their product is the survival probability of each draft slot).

Pure arithmetic on host floats (SmartSpec's goodput idea): `plan()` takes the rows and the measured costs;
`LinearCost` fits forward seconds against the step's token count; `AcceptanceTracker` keeps the estimates.
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque
from dataclasses import dataclass

PRIOR_ACCEPT = 0.6  # per-position acceptance of a method before anything is measured: optimistic, so it is tried
REQUEST_RATE = 0.3  # weight of one observation in a request's own estimates
# ... for a tree method's nodes: each is a rare hit (Medusa's first node ~0.25), so at 0.3 three misses in a row
# take the estimate under break-even and the request stops speculating until a lucky probe
TREE_REQUEST_RATE = 0.1
METHOD_RATE = 0.05  # ... in the method-wide estimates a new request starts from
PROBE_EVERY = 16  # a request that has not speculated for this many steps probes with k = 1
# a step speculates only if its plan promises this much more goodput than plain decoding: the estimates are noisy,
# and the costs left out of the model (the draft catching up on tokens it skipped, padding a batch's short queries to
# the longest) make a break-even speculation a loss (SmolLM2 + draft at 16 streams: auto 0.93x plain without it)
MARGIN = 0.03


class LinearCost:
    """seconds ~ a + b * x by exponentially weighted least squares, plus a fixed weak prior (a line through the
    first observation, slope 2% of its intercept per token) so that the slope stays defined when x never varies."""

    def __init__(self, decay: float = 0.97, prior_weight: float = 2.0):
        self.decay, self.prior_weight = decay, prior_weight
        self._stats = [0.0] * 5  # w, sum x, sum y, sum xx, sum xy
        self._prior: list[float] | None = None

    @staticmethod
    def _point(stats: list[float], x: float, y: float, w: float) -> None:
        for i, v in enumerate((w, w * x, w * y, w * x * x, w * x * y)):
            stats[i] += v

    def observe(self, x: float, seconds: float) -> None:
        if self._prior is None:  # the line through the first point whose slope is 2% of its intercept per token
            self._prior = [0.0] * 5
            intercept = seconds / (1 + 0.02 * (x - 1))
            for px in (1.0, 33.0):  # two pseudo-points on it
                self._point(self._prior, px, intercept * (1 + 0.02 * (px - 1)), self.prior_weight / 2)
        self._stats = [v * self.decay for v in self._stats]
        self._point(self._stats, x, seconds, 1.0)

    @property
    def known(self) -> bool:
        return self._prior is not None

    def coefficients(self) -> tuple[float, float]:
        if self._prior is None:
            return 0.0, 0.0
        w, sx, sy, sxx, sxy = (a + b for a, b in zip(self._stats, self._prior))
        var = sxx * w - sx * sx
        slope = max(0.0, (sxy * w - sx * sy) / var) if var > 1e-12 else 0.0
        return max(0.0, (sy - slope * sx) / w), slope

    def __call__(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * x


class RecentMedian:
    """The median of the last `size` values: a proposer's seconds per position, robust to the one-off catch-up
    of a draft model that first reads a whole prompt."""

    def __init__(self, size: int = 15):
        self.values: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> float:
        self.values.append(value)
        return statistics.median(self.values)


class AcceptanceTracker:
    """Per-position acceptance estimates a_j (probability that draft j is accepted given j - 1 were), per request
    and per method; a new request starts from its method's.

    Tree methods (`tree_methods`) propose k nodes, not k positions: there slot j is node j, and what is estimated
    is s_j = P(node j lies on the accepted path) itself. A chain's product of rates would count a sibling as if it
    followed its elder; estimated directly, sum(s_1..s_k) stays the expected accepted tokens of the first k nodes.
    """

    def __init__(self, k_max: int, tree_methods: frozenset = frozenset()):
        self.k_max = max(1, k_max)
        self.tree_methods = tree_methods
        self._method: dict[str, list[float]] = {}
        self._request: dict[str, list[float]] = {}
        self.idle: dict[str, int] = {}  # steps since the request last speculated

    def _prior(self, method: str) -> list[float]:
        if method in self.tree_methods:  # the chain prior's survival, as node probabilities
            return [PRIOR_ACCEPT ** j for j in range(1, self.k_max + 1)]
        return [PRIOR_ACCEPT] * self.k_max

    def rates(self, request_id: str, method: str) -> list[float]:
        own = self._request.get(request_id)
        return own if own is not None else self._method.get(method, self._prior(method))

    def survival(self, request_id: str, method: str) -> list[float]:
        """s_j for j = 1..k_max: the probability that draft slot j is emitted."""
        if method in self.tree_methods:
            return list(self.rates(request_id, method))
        out, s = [], 1.0
        for a in self.rates(request_id, method):
            s *= a
            out.append(s)
        return out

    def observe(self, request_id: str, method: str, k: int, m: int, path: list[int] | None = None) -> None:
        """k proposed, m accepted: positions 1..m passed, m + 1 failed (if m < k), the rest unobserved. For a tree
        method, `path` is the accepted path's nodes (0 = the root; None: a chain, nodes 1..m); every node <= k is
        observed, a hit if it is on the path."""
        own = list(self.rates(request_id, method))
        shared = self._method.setdefault(method, self._prior(method))
        rate = REQUEST_RATE
        if method in self.tree_methods:
            on_path = set(path[1:] if path is not None else range(1, m + 1))
            slots = [(j, 1.0 if j + 1 in on_path else 0.0) for j in range(min(k, self.k_max))]
            rate = TREE_REQUEST_RATE
        else:
            slots = [(j, 1.0 if j < m else 0.0) for j in range(min(k, m + 1, self.k_max))]
        for j, hit in slots:
            own[j] += rate * (hit - own[j])
            shared[j] += METHOD_RATE * (hit - shared[j])
        self._request[request_id] = own
        self.idle[request_id] = 0

    def forget(self, request_id: str) -> None:
        self._request.pop(request_id, None)
        self.idle.pop(request_id, None)


@dataclass(frozen=True)
class Row:
    survival: list[float]  # s_1..s_K of the request
    cap: int  # the most it may propose this step
    method: str
    probe: bool = False  # it has not speculated for PROBE_EVERY steps


def draft_seconds(lengths: dict[str, int], draft_cost: dict[str, float], per_step: frozenset = frozenset()) -> float:
    """A step's proposing time: each method's cost times its longest row, or once if it drafted at all for the
    methods in `per_step` (their cost hardly grows with k: Medusa's heads read one hidden state whatever the tree)."""
    return sum(draft_cost.get(m, 0.0) * (min(n, 1) if m in per_step else n) for m, n in lengths.items())


def goodput(rows: list[Row], ks: list[int], base_tokens: int, base_emitted: float, forward: LinearCost,
            draft_cost: dict[str, float], per_step: frozenset = frozenset()) -> float:
    """Expected emitted tokens per second of a step where rows[i] proposes ks[i] tokens."""
    emitted = base_emitted + sum(sum(r.survival[:k]) for r, k in zip(rows, ks))
    longest: dict[str, int] = {}
    for r, k in zip(rows, ks):
        longest[r.method] = max(longest.get(r.method, 0), k)
    seconds = forward(base_tokens + sum(ks)) + draft_seconds(longest, draft_cost, per_step)
    return emitted / max(seconds, 1e-9)


def plan(rows: list[Row], base_tokens: int, base_emitted: float, forward: LinearCost,
         draft_cost: dict[str, float], per_step: frozenset = frozenset()) -> list[int]:
    """k per row. (1) For each method, the common length L (capped per row) that maximises the step's goodput —
    a proposer's cost grows with its longest row (one batched forward per position), so its first position only
    pays when enough rows share it. (2) On top, single slots, most likely first, while each raises the goodput.
    (3) Unless that promises MARGIN more goodput than plain decoding, nothing; else each row drops trailing slots
    whose survival does not pay for their verify work at the final goodput. (4) Idle rows probe with k = 1.
    Before any cost was measured it proposes the caps, to measure them."""
    if not forward.known:
        return [r.cap for r in rows]
    ks = [0] * len(rows)
    for method in dict.fromkeys(r.method for r in rows):
        idx = [i for i, r in enumerate(rows) if r.method == method]
        best, best_l = -1.0, 0
        for length in range(max(rows[i].cap for i in idx) + 1):
            trial = list(ks)
            for i in idx:
                trial[i] = min(length, rows[i].cap)
            g = goodput(rows, trial, base_tokens, base_emitted, forward, draft_cost, per_step)
            if g > best * (1 + 1e-6):
                best, best_l = g, length
        for i in idx:
            ks[i] = min(best_l, rows[i].cap)
    _add_single_slots(rows, ks, base_tokens, base_emitted, forward, draft_cost, per_step)
    slope = forward.coefficients()[1]
    g = goodput(rows, ks, base_tokens, base_emitted, forward, draft_cost, per_step)
    if g < goodput(rows, [0] * len(rows), base_tokens, base_emitted, forward, draft_cost, per_step) * (1 + MARGIN):
        ks = [0] * len(rows)  # break-even at best: not worth the risk
    for i, r in enumerate(rows):  # a slot is worth its token of verify work if it is emitted often enough
        while ks[i] > 0 and r.survival[ks[i] - 1] < g * slope:
            ks[i] -= 1
        if ks[i] == 0 and r.probe and r.cap > 0:
            ks[i] = 1
    return ks


def _add_single_slots(rows, ks, base_tokens, base_emitted, forward, draft_cost, per_step) -> None:
    """Greedy marginal additions, the most likely next slot first (a heap), each kept only if it raises the
    goodput; O(slots log rows) with incremental sums."""
    emitted = base_emitted + sum(sum(r.survival[:k]) for r, k in zip(rows, ks))
    tokens = base_tokens + sum(ks)
    longest: dict[str, int] = {}
    for r, k in zip(rows, ks):
        longest[r.method] = max(longest.get(r.method, 0), k)

    def seconds(n_tokens: int, lengths: dict[str, int]) -> float:
        return forward(n_tokens) + draft_seconds(lengths, draft_cost, per_step)

    current = emitted / max(seconds(tokens, longest), 1e-9)
    heap = [(-r.survival[ks[i]], i) for i, r in enumerate(rows) if ks[i] < r.cap]
    heapq.heapify(heap)
    while heap:
        neg_s, i = heapq.heappop(heap)
        r = rows[i]
        lengths = dict(longest)
        lengths[r.method] = max(lengths.get(r.method, 0), ks[i] + 1)
        g = (emitted - neg_s) / max(seconds(tokens + 1, lengths), 1e-9)
        if g <= current:
            continue  # this row's next slot does not pay; its later slots are less likely still
        ks[i] += 1
        emitted, tokens, longest, current = emitted - neg_s, tokens + 1, lengths, g
        if ks[i] < r.cap:
            heapq.heappush(heap, (-r.survival[ks[i]], i))
