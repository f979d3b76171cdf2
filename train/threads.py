"""Picks the intra-op thread count per step by timing, for CPUs shared with other jobs.

With 2 OpenMP threads on 2 cores, one busy core from another process stalls every barrier (measured:
~1,000 tok/s alone, ~200 tok/s beside one pytest); 1 thread then wins, so we probe and switch.
"""
from __future__ import annotations

import torch


class ThreadTuner:
    def __init__(self, max_threads: int, probe_every: int = 30, margin: float = 0.1):
        self.options = (max_threads, 1) if max_threads > 1 else (1,)
        self.current = self.options[0]
        self.probe_every = probe_every
        self.margin = margin
        self.seconds: dict[int, float] = {}  # EMA of step time per thread count
        self._active = self.current

    def before_step(self, step: int) -> int:
        probing = len(self.options) > 1 and step % self.probe_every == self.probe_every - 1
        self._active = [t for t in self.options if t != self.current][0] if probing else self.current
        if torch.get_num_threads() != self._active:
            torch.set_num_threads(self._active)
        return self._active

    def after_step(self, seconds: float) -> None:
        old = self.seconds.get(self._active)
        # Probes are rare, so the probed count's estimate is the latest sample, not a stale average.
        if old is None or self._active != self.current:
            self.seconds[self._active] = seconds
        else:
            self.seconds[self._active] = 0.7 * old + 0.3 * seconds
        if self._active != self.current and seconds < self.seconds[self.current] * (1 - self.margin):
            self.current = self._active
