"""The contract every speculation method implements, and what it is given to build itself.

A step runs, for the rows the scheduler gave a speculative budget k_i:
  1. `propose(requests, ks, generator)` -> a Proposal with at most ks[i] tokens per row (possibly none): a chain,
     or a tree of one-hot candidates (parents per node, engine/sample/tree.py) when the method declares `tree`;
  2. one target forward over every row's last token + its proposed nodes, then verification (engine/sample/verifier.py);
  3. `on_hidden(requests, chunks)` for methods that declared `hidden_layers`: the target's hidden states of the
     tokens whose K/V the target kept this step (prefill chunks too, when `hidden_rows == "all"`);
  4. `on_verified(requests, rows)`: per row, the tokens emitted and how many proposed tokens were accepted.
Per-request state belongs to the proposer (keyed by request id), told about preemption and free by the engine.
Every method derives from ProposerBase; the engine reaches them only through the router (spec_decode/router.py).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from specserve.engine.request import Request


@dataclass(frozen=True)
class ProposerNeeds:
    """What a method asks of the engine; the engine reads this, never the method's class."""

    hidden_layers: tuple[int, ...] = ()  # target layers whose hidden states it reads (engine/model/hidden.py ids)
    hidden_rows: str = "verified"  # "verified": the kept rows that produced tokens; "all": every kept token
    returns_probs: bool = False  # proposals carry the exact distributions the tokens were drawn from (chains)
    tree: bool = False  # proposals may branch (one-hot candidates only)
    typical_acceptance: tuple[float, float] | None = None  # (posterior_threshold, alpha): Medusa's LOSSY rule
    cost_per_step: bool = False  # propose() costs about the same at any k (not one pass per drafted position)
    # KV it keeps per position of a sequence, in its own pool under the target's block ids (prefix caching shares
    # it with the target's blocks): "none"; "own" (it catches up by itself from any point, as a draft model);
    # "target" (made from the target's forward, as DFlash's context: only the target's recompute can refill it).
    # A method other than "none" implements kv_valid_tokens, on_cache_hit and copy_blocks.
    prefix_kv: str = "none"


@dataclass(frozen=True)
class HiddenChunk:
    """Target hidden states of consecutive positions start, start + 1, ... of one request (K/V kept)."""

    start: int
    states: dict[int, torch.Tensor]  # layer id -> [n, H]


@dataclass(frozen=True)
class Proposal:
    token_ids: torch.Tensor  # [S, K] long on the device; -1 beyond each row's count
    num_tokens: list[int]  # [S] tokens proposed per row: 0 <= num_tokens[i] <= the k the row was given
    probs: torch.Tensor | None = None  # [S, K, V] the distributions the tokens were drawn from; None = one-hot
    parents: list[list[int]] | None = None  # [S][n] tree parent of each node (0 = the last token); None = chains


@dataclass(frozen=True)
class VerifiedRow:
    """What verification did with one row's proposal."""

    num_proposed: int
    num_accepted: int  # proposed tokens emitted before the first rejection
    emitted: list[int] = field(default_factory=list)  # accepted tokens + the target's own (recovered / bonus) one


@dataclass(frozen=True)
class ProposerContext:
    """Built once by the engine for every loaded method."""

    target_path: str
    target_config: object  # the target's HF config
    tokenizer: object
    vocab_size: int  # the target's
    device: torch.device
    dtype: torch.dtype
    trust_remote_code: bool = False
    tree_attention: bool = True  # the target can verify trees (no sliding-window or chunked layers)
    lm_head: torch.Tensor | None = None  # [V, H] the target's output embedding (methods that share it)
    input_embeddings: torch.nn.Module | None = None  # the target's token embedding (methods that share it)
    quantization: str | None = None  # the target's weight-only quantization: drafters that follow it (EAGLE-3, draft)


class ProposerBase(abc.ABC):
    """Every speculation method derives from this. `load` builds it from its method config; `__init__` records,
    once, what it asks of the engine (`needs`), the most tokens it proposes, and any length limit of its own.
    The hooks default to what a stateless method does (nothing)."""

    name: ClassVar[str]
    uses_draft_model: ClassVar[bool] = False  # load() reads method_config.model (the demo's bundled one when unset)

    def __init__(self, needs: ProposerNeeds, num_speculative_tokens: int, max_model_len: int | None = None):
        self.needs = needs
        self.num_speculative_tokens = num_speculative_tokens  # the most it proposes per step (requests may ask less)
        self.max_model_len = max_model_len  # a limit of its own on sequence length (a draft model's); None: none

    @classmethod
    @abc.abstractmethod
    def load(cls, method_config, context: ProposerContext) -> "ProposerBase":
        """Build the method from its config (a SpeculativeMethodConfig) and what the engine loaded."""

    @abc.abstractmethod
    def propose(self, requests: list[Request], ks: list[int], default_generator: torch.Generator) -> Proposal:
        """Up to ks[i] >= 1 tokens for requests[i], consuming seeded requests' generators only."""

    def population(self, request: Request) -> str | None:
        """Before this step's plan: the population whose acceptance the request's next drafts are expected to have
        (engine/spec_decode/acceptance.py; the method's name unless the method knows better, like the length of an
        n-gram match), or None when it will propose nothing for it this step (then it plans k = 0)."""
        return self.name

    def kv_bytes_per_token(self) -> int:
        """KV bytes it keeps per token of a sequence (a draft model's cache; 0 for stateless lookups)."""
        return 0

    def bind_kv(self, num_blocks: int, block_size: int) -> None:
        """Allocate its own cache once the engine has sized the shared block budget (block ids are shared)."""

    def on_hidden(self, requests: list[Request], chunks: list[HiddenChunk]) -> None:
        """Only for methods with `needs.hidden_layers`: chunks[i] for requests[i], after the tokens are appended."""

    def on_verified(self, requests: list[Request], rows: list[VerifiedRow]) -> None:
        """After the tokens are appended to each request (rows[i] for requests[i])."""

    def on_preempt(self, request: Request) -> None:
        """The request's KV blocks were dropped; it will be recomputed from its tokens."""

    def on_free(self, request: Request) -> None:
        """The request finished or was aborted: forget it."""

    # only with needs.prefix_kv != "none":
    def kv_valid_tokens(self, request: Request) -> int:
        """How many leading positions of the request hold its valid KV in this method's pool."""
        return 0

    def on_cache_hit(self, request: Request, num_tokens: int) -> None:
        """The request starts on cached blocks holding this method's valid KV for its first num_tokens positions."""

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks of its pool (a request's private copy of a shared block)."""


def chain_proposal(drafts: list[list[int]], device: torch.device, parents: list[list[int]] | None = None
                   ) -> Proposal:
    """One-hot chains (or trees, with `parents`) of varying size (possibly empty) -> a Proposal."""
    ids = torch.full((len(drafts), max(1, max(len(d) for d in drafts))), -1, dtype=torch.long)
    for i, d in enumerate(drafts):
        ids[i, : len(d)] = torch.tensor(d, dtype=torch.long)
    return Proposal(ids.to(device), [len(d) for d in drafts], parents=parents)


class LookupProposer(ProposerBase):
    """Base of model-free methods that draft from token sequences: no KV cache, and nothing to undo after
    verification or preemption (tokens are only ever appended: the state catches up at the next propose);
    per-request state is dropped at free."""

    def __init__(self, device: torch.device, num_speculative_tokens: int, needs: ProposerNeeds = ProposerNeeds()):
        super().__init__(needs, num_speculative_tokens)
        self.device = device
        self._state: dict[str, object] = {}

    def on_free(self, request: Request) -> None:
        self._state.pop(request.request_id, None)
