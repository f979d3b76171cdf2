"""The Proposer protocol every speculation method implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.request import Request


@dataclass(frozen=True)
class Proposal:
    token_ids: torch.Tensor  # [S, K] long on the device; -1 beyond each row's k
    probs: torch.Tensor | None  # [S, K, V] exactly the distributions the tokens were drawn from; None = one-hot


class Proposer(Protocol):
    method: str

    def propose(self, requests: list[Request], ks: list[int], default_generator: torch.Generator) -> Proposal:
        """Draft ks[i] tokens for requests[i] (every ks[i] >= 1), consuming seeded requests' generators only."""
        ...

    def rollback(self, request: Request) -> None:
        """After verification: forget state past the tokens the request actually kept."""
        ...
