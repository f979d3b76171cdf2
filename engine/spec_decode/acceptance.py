"""Acceptance estimates for adaptive k: per draft slot, counts of hits over trials, for each method's recent
population and for each request, combined like a Beta posterior whose prior is the population.

- A chain's slot j estimates a_j = P(draft j accepted | drafts 1..j-1 were); its survival is the running product.
  A tree method's slot j is node j (nodes listed best first), estimated directly as s_j = P(node j lies on the
  accepted path), kept non-increasing in j.
- Before a method was ever observed its population stands at the uninformative prior: each draft position a coin
  flip (a_j = 1/2; a tree's node j: 2^-j), held with the weight of `PRIOR_WEIGHT` observations.
- A request's estimate is its own decayed counts plus `PRIOR_WEIGHT` observations of its population: the first
  steps follow the population, its own evidence takes over within a few steps, and old evidence fades
  (`REQUEST_DECAY` per step, whether it speculated or not) — so a request that stopped speculating drifts back to
  its population's estimate within a few steps instead of being parked by a bad start.

A population is named by a key: the method's name, or a refinement a proposer offers for one step of one request
(`ProposerBase.population`: n-gram lookup names the length of the suffix it matched, "ngram/4"), whose prior is the
method's pooled estimate (every refinement's rows feed the pool too); a tree method's refinements are trees. A
request keeps its own evidence per key.

The same rule and constants hold for every method: no per-method rates.
"""

from __future__ import annotations

PRIOR_WEIGHT = 2.0  # pseudo-observations of the prior (the population's for a request; the coin flip's for a method)
REQUEST_DECAY = 0.8  # a request's evidence weight after each step: ~5 steps of memory
POPULATION_DECAY = 0.99  # a method's evidence weight after each row observed: ~100 rows of memory
PROBE_EVERY = 16  # a request idle this many steps while its whole population is below break-even probes with k = 1


class _Counts:
    __slots__ = ("hits", "trials")

    def __init__(self, k: int):
        self.hits, self.trials = [0.0] * k, [0.0] * k

    def decay(self, factor: float) -> None:
        self.hits = [h * factor for h in self.hits]
        self.trials = [t * factor for t in self.trials]

    def add(self, slots: list[tuple[int, float]]) -> None:
        for j, hit in slots:
            self.hits[j] += hit
            self.trials[j] += 1.0

    def mean(self, prior: list[float], weight: float) -> list[float]:
        return [(h + weight * p) / (t + weight) for h, t, p in zip(self.hits, self.trials, prior)]


def method_of(key: str) -> str:
    """The method a population key belongs to ("ngram/4" -> "ngram"; a method's own name is its own key)."""
    return key.split("/", 1)[0]


class AcceptanceTracker:
    def __init__(self, k_max: int, tree_methods: frozenset = frozenset()):
        self.k_max = max(1, k_max)
        self.tree_methods = tree_methods
        self._method: dict[str, _Counts] = {}
        self._request: dict[str, dict[str, _Counts]] = {}  # request id -> population key -> its own evidence
        self.idle: dict[str, int] = {}  # steps since the request last speculated

    def _is_tree(self, key: str) -> bool:
        return method_of(key) in self.tree_methods

    def _uninformed(self, method: str) -> list[float]:
        if self._is_tree(method):
            return [0.5 ** j for j in range(1, self.k_max + 1)]
        return [0.5] * self.k_max

    def _monotone(self, method: str, values: list[float]) -> list[float]:
        if not self._is_tree(method):
            return values
        out, low = [], 1.0
        for v in values:  # best-first nodes: a later node is never more likely than an earlier one
            low = min(low, v)
            out.append(low)
        return out

    def population(self, method: str) -> list[float]:
        """The method's per-slot estimates over its recent rows; a refinement ("ngram/4") starts from its method's
        pooled estimate, which every refinement's rows also feed."""
        counts = self._method.get(method)
        base = method_of(method)
        prior = self.population(base) if base != method else self._uninformed(method)
        return self._monotone(method, prior if counts is None else counts.mean(prior, PRIOR_WEIGHT))

    def rates(self, request_id: str, method: str) -> list[float]:
        """Per-slot estimates of one request (chains: conditional acceptance; trees: node survival)."""
        pop = self.population(method)
        own = self._request.get(request_id, {}).get(method)
        return pop if own is None else self._monotone(method, own.mean(pop, PRIOR_WEIGHT))

    def survival(self, request_id: str, method: str) -> list[float]:
        """s_j for j = 1..k_max: the probability that draft slot j is emitted."""
        if self._is_tree(method):
            return self.rates(request_id, method)
        out, s = [], 1.0
        for a in self.rates(request_id, method):
            s *= a
            out.append(s)
        return out

    def observe(self, request_id: str, method: str, k: int, m: int, path: list[int] | None = None) -> None:
        """k proposed, m accepted: positions 1..m passed, m + 1 failed (if m < k), the rest unobserved. For a tree
        method, `path` is the accepted path's nodes (0 = the root; None: a chain, nodes 1..m); every node <= k is
        observed, a hit if it is on the path."""
        if self._is_tree(method):
            on_path = set(path[1:] if path is not None else range(1, m + 1))
            slots = [(j, 1.0 if j + 1 in on_path else 0.0) for j in range(min(k, self.k_max))]
        else:
            slots = [(j, 1.0 if j < m else 0.0) for j in range(min(k, m + 1, self.k_max))]
        mine = self._request.setdefault(request_id, {})
        for counts in mine.values():
            counts.decay(REQUEST_DECAY)
        mine.setdefault(method, _Counts(self.k_max)).add(slots)
        for key in dict.fromkeys((method, method_of(method))):  # the refinement and its method's pool
            shared = self._method.setdefault(key, _Counts(self.k_max))
            shared.decay(POPULATION_DECAY)
            shared.add(slots)
        self.idle[request_id] = 0

    def idle_step(self, request_id: str) -> int:
        """The request did not speculate this step: its evidence fades like a step's. -> steps idle so far."""
        for counts in self._request.get(request_id, {}).values():
            counts.decay(REQUEST_DECAY)
        self.idle[request_id] = self.idle.get(request_id, 0) + 1
        return self.idle[request_id]

    def forget(self, request_id: str) -> None:
        self._request.pop(request_id, None)
        self.idle.pop(request_id, None)
