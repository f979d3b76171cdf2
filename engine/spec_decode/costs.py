"""What a step costs, as adaptive k plans it: the target forward against its token count and its padded query slots
(a verify batch pads every short row to the widest one: on the demo target, 16 rows with one at k = 4 — 20 tokens,
80 padded slots — measured 134-153 ms a forward, more than all 16 at k = 1 — 32 tokens — at 119-130 ms; all at k = 0:
91-118 ms), and each proposer against the positions it drafts
(an intercept for its per-step work, such as a draft model catching up on the tokens it skipped, a slope per
drafted position and one per drafted position and row: a draft model's forward over 32 rows costs more than over 4).
The forward's cost is measured through verification and bookkeeping, whose work grows with the step's width too. Fitted online by exponentially weighted least squares; every step's one-step-ahead prediction is
kept beside what was measured (`PredictionLog`), so that a bench can print how well the model matches the step.

Pure arithmetic on host floats.
"""

from __future__ import annotations

import math
from collections import deque


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on a small dense system; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-18:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


class OnlineLinear:
    """seconds ~ c . (1, x_1, .., x_n) by exponentially weighted least squares, coefficients kept >= 0, plus a weak
    prior set by the first observation (`prior(x, seconds)` -> pseudo-observations, not decayed), so that a
    direction the data never varied along keeps the prior's slope instead of an undefined one."""

    def __init__(self, num_features: int, prior, decay: float = 0.97):
        self.n = num_features + 1
        self.prior, self.decay = prior, decay
        self._xtx = [[0.0] * self.n for _ in range(self.n)]
        self._xty = [0.0] * self.n
        self._prior: tuple[list[list[float]], list[float]] | None = None
        self._coef: list[float] | None = None

    @staticmethod
    def _add(xtx, xty, x: tuple, y: float, w: float) -> None:
        row = (1.0, *x)
        for i, a in enumerate(row):
            xty[i] += w * a * y
            for j, b in enumerate(row):
                xtx[i][j] += w * a * b

    def observe(self, x: tuple, seconds: float) -> None:
        if self._prior is None:
            pxtx, pxty = [[0.0] * self.n for _ in range(self.n)], [0.0] * self.n
            for px, py, pw in self.prior(x, seconds):
                self._add(pxtx, pxty, px, py, pw)
            self._prior = (pxtx, pxty)
        d = self.decay
        self._xtx = [[v * d for v in row] for row in self._xtx]
        self._xty = [v * d for v in self._xty]
        self._add(self._xtx, self._xty, x, seconds, 1.0)
        self._coef = None

    @property
    def known(self) -> bool:
        return self._prior is not None

    def coefficients(self) -> list[float]:
        if self._prior is None:
            return [0.0] * self.n
        if self._coef is None:
            pxtx, pxty = self._prior
            a = [[u + v for u, v in zip(r1, r2)] for r1, r2 in zip(self._xtx, pxtx)]
            b = [u + v for u, v in zip(self._xty, pxty)]
            free = list(range(self.n))
            while True:  # active set: a slope that fits negative is held at 0 and the rest refit (costs never
                sub = _solve([[a[i][j] for j in free] for i in free], [b[i] for i in free])  # fall with work)
                if sub is None:
                    sub = [b[0] / max(a[0][0], 1e-12)] + [0.0] * (len(free) - 1)
                negative = [i for i, c in zip(free, sub) if c < 0 and i != 0]
                if not negative:
                    break
                free = [i for i in free if i not in negative]
            coef = [0.0] * self.n
            for i, c in zip(free, sub):
                coef[i] = c
            coef[0] = max(0.0, coef[0])
            self._coef = coef
        return self._coef

    def __call__(self, *x: float) -> float:
        c = self.coefficients()
        return c[0] + sum(ci * xi for ci, xi in zip(c[1:], x))


def forward_prior(x: tuple, seconds: float) -> list[tuple[tuple, float, float]]:
    """The target forward before it was measured twice: the plane through the first step whose per-token slope is 2%
    of its intercept and whose padded slots are free — three pseudo-points of total weight 2."""
    tokens = x[0]
    intercept = seconds / (1 + 0.02 * (tokens - 1))
    line = [((t, p), intercept * (1 + 0.02 * (t - 1))) for t, p in ((1, 1), (9, 9), (1, 9))]
    return [(px, py, 2 / 3) for px, py in line]


def proposer_prior(x: tuple, seconds: float) -> list[tuple[tuple, float, float]]:
    """A proposer before it was measured twice: all its cost per drafted position, whatever the rows (a plane through
    the origin and the first call), three pseudo-points of total weight 2, close together so that they have little
    leverage over real lengths. Features: (positions, rows x positions)."""
    positions, rows = max(x[0], 1), max(x[1] / max(x[0], 1), 1)
    per = seconds / positions
    return [((p, p * r), p * per, 2 / 3) for p, r in ((1, rows), (2, rows), (1, 2 * rows))]


class PredictionLog:
    """Recent steps' predicted and measured seconds (the prediction made before the step was observed), overall and
    per kind of step (plain, chain, tree: a cost the model lacks a feature for shows as one kind's bias)."""

    def __init__(self, size: int = 2000):
        self.ratios: deque[tuple[str, float]] = deque(maxlen=size)  # (kind, measured / predicted)

    def add(self, predicted: float, measured: float, kind: str = "step") -> None:
        if predicted > 0 and measured > 0:
            self.ratios.append((kind, measured / predicted))

    @staticmethod
    def _stats(ratios: list[float]) -> dict:
        r = sorted(ratios)
        errs = sorted(abs(math.log(x)) for x in r)
        return {"steps": len(r), "median_measured_over_predicted": round(r[len(r) // 2], 3),
                "median_abs_error": round(math.exp(errs[len(errs) // 2]) - 1, 3),
                "p90_abs_error": round(math.exp(errs[int(len(errs) * 0.9)]) - 1, 3)}

    def summary(self) -> dict:
        """steps, the median of measured / predicted (the bias) and the median |log| error as a ratio; the same per
        kind under "by_kind"."""
        if not self.ratios:
            return {"steps": 0}
        kinds: dict[str, list[float]] = {}
        for kind, r in self.ratios:
            kinds.setdefault(kind, []).append(r)
        return {**self._stats([r for _, r in self.ratios]),
                "by_kind": {k: self._stats(v) for k, v in sorted(kinds.items())}}


class StepCosts:
    """The fitted cost of a step: `forward(tokens, padded)` + each method's `propose(method, positions, rows)`."""

    def __init__(self):
        self.forward = OnlineLinear(2, forward_prior)
        self.proposers: dict[str, OnlineLinear] = {}
        self.log = PredictionLog()
        self._pending = [0.0, 0.0]  # this step's proposals so far: predicted, measured

    @property
    def known(self) -> bool:
        return self.forward.known

    def propose(self, method: str, positions: int, rows: int) -> float:
        """Seconds of one `method` call drafting `positions` positions for `rows` rows (0 positions: not called)."""
        model = self.proposers.get(method)
        return model(positions, positions * rows) if positions and model is not None else 0.0

    def step(self, tokens: int, padded: int, drafts: dict[str, tuple[int, int]]) -> float:
        """A step over `tokens` tokens with `padded` short query slots, where each method drafts
        drafts[method] = (positions, rows)."""
        return self.forward(tokens, padded) + sum(self.propose(m, n, r) for m, (n, r) in drafts.items())

    def observe_proposal(self, method: str, positions: int, rows: int, seconds: float) -> None:
        model = self.proposers.setdefault(method, OnlineLinear(2, proposer_prior))
        if model.known:
            self._pending[0] += model(positions, positions * rows)
        self._pending[1] += seconds
        model.observe((positions, positions * rows), seconds)

    def observe_forward(self, tokens: int, padded: int, seconds: float, kind: str = "step") -> None:
        """The step's forward; it closes the step: its prediction (forward + the proposals heard since the last
        forward) is logged against the measurement, under `kind`."""
        if self.forward.known:
            self.log.add(self.forward(tokens, padded) + self._pending[0], seconds + self._pending[1], kind)
        self.forward.observe((tokens, padded), seconds)
        self._pending = [0.0, 0.0]
