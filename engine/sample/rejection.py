"""Vectorised chain rejection sampler with flashinfer's `chain_speculative_sampling` semantics
(docs/methods.md: accept, residual, bonus; emitted counts only).

No loop over positions and no host sync: the caller reads the result once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.sample.sampler import sample


@dataclass(frozen=True)
class RejectionOutput:
    output_token_ids: torch.Tensor  # [B, K+1] long, emitted tokens padded with -1
    num_emitted_draft_tokens: torch.Tensor  # [B] draft tokens emitted before the first rejection


def rejection_sample(
    target_probs: torch.Tensor,  # [B, K+1, V] p: the target's processed distribution at each position
    draft_probs: torch.Tensor | None,  # [B, K, V] q: exactly what each draft token was sampled from; None = one-hot
    draft_token_ids: torch.Tensor,  # [B, K] long; entries at positions >= num_draft_tokens are ignored
    num_draft_tokens: torch.Tensor,  # [B] long, k of each row (0..K)
    uniforms: torch.Tensor,  # [B, K] U[0, 1)
    noise: torch.Tensor,  # [B, V] Exp(1): one draw serves whichever position ends up sampled
) -> RejectionOutput:
    """Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), left to right; at the first rejection emit a draw
    from norm(max(0, p_i - q_i)); if all k_b are accepted emit a bonus draw from p_{k_b + 1}."""
    batch, k_plus_1, vocab = target_probs.shape
    k_max = k_plus_1 - 1
    pos = torch.arange(k_max, device=target_probs.device)[None, :]  # [1, K]
    valid = pos < num_draft_tokens[:, None]  # [B, K]
    ids = draft_token_ids.clamp_min(0)  # [B, K]
    if draft_probs is None:  # deterministic proposer: q is one-hot at the draft token
        draft_probs = torch.nn.functional.one_hot(ids, vocab).to(target_probs.dtype) * valid[..., None]
    p_x = target_probs[:, :k_max].gather(-1, ids[..., None]).squeeze(-1)  # [B, K]
    q_x = draft_probs.gather(-1, ids[..., None]).squeeze(-1)  # [B, K]
    # u < p/q  <=>  u*q < p for q > 0; a token the draft could not have sampled (q = 0) is never accepted.
    accepted = (uniforms * q_x < p_x) & (q_x > 0) & valid  # [B, K]
    num_emitted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B] leading run of acceptances
    rows = torch.arange(batch, device=target_probs.device)
    p_j = target_probs[rows, num_emitted]  # [B, V] target at the first rejected (or bonus) position
    q_pad = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, vocab)], dim=1)  # [B, K+1, V]
    rejected_here = num_emitted < num_draft_tokens  # [B] False: every draft accepted -> bonus from p
    q_j = q_pad[rows, num_emitted] * rejected_here[:, None]  # [B, V]
    residual = (p_j - q_j).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    # 0/0 guard: when p == q numerically the rejection branch is (almost) never taken; if it is, sample from p.
    final = torch.where(mass > 1e-12, residual / mass.clamp_min(1e-30), p_j)  # [B, V]
    next_token = sample(final, noise)  # [B]
    return RejectionOutput(_emitted(draft_token_ids, num_emitted, next_token), num_emitted)


def _emitted(draft_token_ids: torch.Tensor, num_emitted: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
    """[B, K+1]: the accepted drafts, then the recovered / bonus token, padded with -1."""
    batch, k_max = draft_token_ids.shape
    pos = torch.arange(k_max, device=draft_token_ids.device)[None, :]
    out = torch.where(pos < num_emitted[:, None], draft_token_ids, torch.full_like(draft_token_ids, -1))
    out = torch.cat([out, out.new_full((batch, 1), -1)], dim=1)
    out[torch.arange(batch, device=out.device), num_emitted] = next_token
    return out


def greedy_accept(
    target_ids: torch.Tensor,  # [B, K+1] long: the target's argmax at each position (p one-hot there)
    draft_token_ids: torch.Tensor,  # [B, K] long; entries at positions >= num_draft_tokens are ignored
    num_draft_tokens: torch.Tensor,  # [B] long
    draft_q_x: torch.Tensor | None = None,  # [B, K] q of each draft token; None = one-hot proposer (q_x = 1)
) -> RejectionOutput:
    """rejection_sample() when every p is one-hot at target_ids, on ids alone (O(B·K), no vocabulary-sized work):
    x_i is accepted iff it is the argmax (and q(x_i) > 0, as there); at the first rejection the residual
    max(0, p - q) is non-zero only at the argmax, and the bonus draw from a one-hot p is its argmax."""
    k_max = draft_token_ids.shape[1]
    pos = torch.arange(k_max, device=target_ids.device)[None, :]  # [1, K]
    valid = pos < num_draft_tokens[:, None]
    accepted = (draft_token_ids == target_ids[:, :k_max]) & valid  # [B, K]
    if draft_q_x is not None:
        accepted &= draft_q_x > 0
    num_emitted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B]
    next_token = target_ids.gather(1, num_emitted[:, None])[:, 0]  # the argmax at the first rejection, or the bonus
    return RejectionOutput(_emitted(draft_token_ids, num_emitted, next_token), num_emitted)
