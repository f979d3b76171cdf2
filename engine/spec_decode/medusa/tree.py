"""Medusa candidate trees: a tree is a list of paths ("medusa_choices", as in the Medusa project), each path the
ranks taken in successive heads' top-k — [0] is head 0's best guess, [0, 1] head 0's best then head 1's second, and
so on. The node of path p proposes token topk(head len(p) - 1)[p[-1]] under the node of p[:-1] (the root for
length 1). Pure functions: parsing and checking user trees, the node layout, and the default tree picked from
measured per-head accuracy and measured verify cost.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Sequence


def parse_choices(value, num_heads: int, field: str = "medusa_choices") -> list[tuple[int, ...]]:
    """A JSON text or a list of paths -> the paths, checked: non-empty lists of ranks >= 0, no longer than the heads,
    every prefix present, no repeats. Kept in the given order when every path already comes after its prefix: then
    the first k nodes are a tree too, and a list written best first (as `specserve train medusa` writes it) gives a
    row with a budget of k its k best nodes. Otherwise sorted by length, stably (as the Medusa project does)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field}: invalid JSON ({exc.msg} at position {exc.pos})") from None
    if not isinstance(value, list) or not value:
        raise ValueError(f"{field}: must be a non-empty JSON list of paths such as [[0], [0, 0], [1]]")
    paths: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    for i, p in enumerate(value):
        if (not isinstance(p, list) or not p
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p)):
            raise ValueError(f"{field}[{i}]: a path is a non-empty list of ranks >= 0, got {p!r}")
        path = tuple(p)
        if len(path) > num_heads:
            raise ValueError(f"{field}[{i}]: path {p} is deeper than the {num_heads} heads")
        if path in seen:
            raise ValueError(f"{field}[{i}]: path {p} is listed twice")
        seen.add(path)
        paths.append(path)
    for i, path in enumerate(paths):
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"{field}[{i}]: path {list(path)} has no node for its prefix {list(path[:-1])}")
    placed: set[tuple[int, ...]] = set()
    for path in paths:
        if len(path) > 1 and path[:-1] not in placed:
            return sorted(paths, key=len)
        placed.add(path)
    return paths


def layout(paths: Sequence[tuple[int, ...]]) -> tuple[list[int], list[int], list[int]]:
    """-> (parent node, head, rank) per node; node j >= 1 is paths[j - 1], node 0 the root."""
    index = {(): 0}
    parents, heads, ranks = [], [], []
    for j, path in enumerate(paths, start=1):
        index[path] = j
        parents.append(index[path[:-1]])
        heads.append(len(path) - 1)
        ranks.append(path[-1])
    return parents, heads, ranks


def path_probabilities(paths: Sequence[tuple[int, ...]], accuracy: Sequence[Sequence[float]]) -> list[float]:
    """P(a path's tokens are all right), treating the heads as independent (Medusa's own approximation):
    the product of accuracy[head][rank] along it (0 beyond the measured ranks)."""
    out = []
    for path in paths:
        prob = 1.0
        for head, rank in enumerate(path):
            row = accuracy[head] if head < len(accuracy) else ()
            prob *= row[rank] if rank < len(row) else 0.0
        out.append(prob)
    return out


def best_paths(accuracy: Sequence[Sequence[float]], max_nodes: int) -> list[tuple[tuple[int, ...], float]]:
    """The `max_nodes` most probable paths (best first; prefix-closed, since a path is never more probable than its
    prefix), by best-first search over ranks."""
    heap: list[tuple[float, tuple[int, ...]]] = [(-p, (r,)) for r, p in enumerate(accuracy[0]) if p > 0]
    heapq.heapify(heap)
    out: list[tuple[tuple[int, ...], float]] = []
    while heap and len(out) < max_nodes:
        neg, path = heapq.heappop(heap)
        out.append((path, -neg))
        depth = len(path)
        if depth < len(accuracy):
            for r, p in enumerate(accuracy[depth]):
                if p > 0:
                    heapq.heappush(heap, (neg * p, path + (r,)))
    return out


def choose_tree(accuracy: Sequence[Sequence[float]], cost: Callable[[int], float], max_nodes: int = 64,
                head_cost: float = 0.0) -> tuple[list[tuple[int, ...]], dict]:
    """The tree that maximises expected tokens per second: its n nodes are the n most probable paths, and n is
    chosen by (1 + sum of their probabilities) / (cost(n + 1) + head_cost), against plain decoding's 1 / cost(1).
    accuracy[h][r]: measured P(head h's rank-r token is right); cost(rows): measured seconds of one verify forward
    with that many query rows. -> (paths best first, what was weighed)."""
    ranked = best_paths(accuracy, max_nodes)
    plain = 1.0 / cost(1)
    best_n, best_rate, expected = 0, plain, 1.0
    total = 1.0
    for n, (_, prob) in enumerate(ranked, start=1):
        total += prob
        rate = total / (cost(n + 1) + head_cost)
        if rate > best_rate:
            best_n, best_rate, expected = n, rate, total
    paths = [p for p, _ in ranked[:best_n]]
    return paths, {"nodes": best_n, "expected_tokens_per_step": round(expected, 3),
                   "predicted_speedup": round(best_rate / plain, 3)}


def default_accuracy(num_heads: int, ranks: int = 10) -> list[list[float]]:
    """A stand-in for heads that carry no measured tree: head h's rank r right with 0.5 * 0.7^h * 0.5^r (the
    shape of the Medusa paper's per-head accuracies, scaled down)."""
    return [[0.5 * 0.7 ** h * 0.5 ** r for r in range(ranks)] for h in range(num_heads)]


def default_tree(num_heads: int, max_nodes: int = 15) -> list[tuple[int, ...]]:
    return [p for p, _ in best_paths(default_accuracy(num_heads), max_nodes)]
