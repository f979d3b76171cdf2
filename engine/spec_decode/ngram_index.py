"""An incremental n-gram index over one growing token sequence: pure Python, O(new tokens x n sizes) per update.

For every n in [n_min, n_max] it maps each n-gram that has a continuation to the positions right after its latest
occurrences (the most recent `keep` of them), so a lookup of the sequence's own suffix finds where that suffix was
last followed by something — or, for trees, the last few places.
"""

from __future__ import annotations


class NgramIndex:
    def __init__(self, n_min: int, n_max: int, keep: int = 1):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"prompt_lookup_min/max: need 1 <= min <= max, got {n_min}, {n_max}")
        if keep < 1:
            raise ValueError(f"prompt_lookup_branches: must be >= 1, got {keep}")
        self.n_min, self.n_max, self.keep = n_min, n_max, keep
        self._next: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions that followed it, latest first
        self._indexed = 0  # continuations at positions < this are in the index

    def update(self, tokens: list[int]) -> None:
        """Index every continuation position added since the last call (tokens only ever grow)."""
        for e in range(max(self._indexed, 1), len(tokens)):  # tokens[e] continues the n-grams ending at e - 1
            for n in range(self.n_min, min(self.n_max, e) + 1):
                key = tuple(tokens[e - n:e])
                seen = self._next.get(key)
                if seen is None:
                    self._next[key] = [e]
                else:
                    seen.insert(0, e)
                    del seen[self.keep:]
        self._indexed = max(self._indexed, len(tokens))

    def match_length(self, tokens: list[int]) -> int:
        """The length of the longest suffix of `tokens` (n_max down to n_min) seen before with a continuation; 0 when
        none is."""
        for n in range(min(self.n_max, len(tokens)), self.n_min - 1, -1):
            if tuple(tokens[len(tokens) - n:]) in self._next:
                return n
        return 0

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix of `tokens` (n_max down to n_min) seen before."""
        found = self.continuations(tokens, k, 1)
        return found[0] if found else []

    def continuations(self, tokens: list[int], k: int, branches: int) -> list[list[int]]:
        """Up to `branches` different continuations (each up to k tokens), best first: the longest matching
        suffix's latest occurrences, then shorter suffixes'."""
        out: list[list[int]] = []
        used: set[int] = set()
        for n in range(min(self.n_max, len(tokens)), self.n_min - 1, -1):
            for e in self._next.get(tuple(tokens[len(tokens) - n:]), ()):
                cont = tokens[e:e + k]
                if e not in used and cont not in out:
                    used.add(e)
                    out.append(cont)
                    if len(out) == branches:
                        return out
        return out
