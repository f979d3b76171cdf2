"""Stats the engine emits every step, and their running totals; the server maps them to Prometheus."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preempted: int = 0
    num_prompt_tokens: int = 0  # prefill tokens computed this step
    num_generation_tokens: int = 0  # tokens emitted this step
    num_drafts: int = 0  # sequences that proposed >= 1 token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0  # draft tokens emitted (before the first rejection)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [k]: sequences whose draft j was emitted
    speculative_tokens_chosen: list[int] = field(default_factory=list)  # k of each drafting sequence
    accepted_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify step, bonus included
    draft_methods: list[str] = field(default_factory=list)  # the method of each drafting sequence (same order)
    draft_depths: list[int] = field(default_factory=list)  # positions each one's proposal reaches (a tree: its depth)
    prefix_cache_queries: int = 0  # prompt tokens of requests admitted for the first time
    prefix_cache_hits: int = 0  # of those, tokens whose KV came from the prefix cache
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    step_seconds: float = 0.0


@dataclass
class EngineTotals:
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    def add(self, s: StepStats) -> None:
        self.num_steps += 1
        self.num_prompt_tokens += s.num_prompt_tokens
        self.num_generation_tokens += s.num_generation_tokens
        self.num_drafts += s.num_drafts
        self.num_draft_tokens += s.num_draft_tokens
        self.num_accepted_tokens += s.num_accepted_tokens
        self.num_preemptions += s.num_preempted
        self.prefix_cache_queries += s.prefix_cache_queries
        self.prefix_cache_hits += s.prefix_cache_hits
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(s.num_accepted_tokens_per_pos) - len(per_pos)))
        for j, n in enumerate(s.num_accepted_tokens_per_pos):
            per_pos[j] += n

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None
