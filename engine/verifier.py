"""Target side of a speculative step: the processed target distribution at every verified position (penalties see
the draft tokens before each position), the rejection sampler, and log-probs — all batched, one host read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.rejection import rejection_sample
from engine.request import Request
from engine.sampler import SamplingTensors, exponential_noise, processed_probs, uniform_noise


@dataclass
class VerifyResult:
    tokens: list[list[int]]  # per request: the emitted tokens (accepted drafts, then one recovered/bonus token)
    num_accepted: list[int]  # draft tokens emitted per request
    num_accepted_independent: list[int]
    non_finite: list[bool]  # the target's logits for this request held NaN/inf: its tokens must not be used
    logprobs: list[tuple[list[float], list[list[tuple[int, float]]]] | None]  # per request, per emitted token


def verify(logits: torch.Tensor, requests: list[Request], ks: list[int], draft_ids: torch.Tensor,
           draft_probs: torch.Tensor | None, default_generator: torch.Generator) -> VerifyResult:
    """logits [N, V]: request b owns rows off_b .. off_b + k_b (N = sum(k_b + 1)); draft_ids [B, K]; probs [B, K, V]."""
    device, vocab = logits.device, logits.shape[-1]
    batch, k_max = len(requests), draft_ids.shape[1]
    num_draft = torch.tensor(ks, device=device)
    offsets = torch.cumsum(num_draft + 1, 0) - (num_draft + 1)  # [B] first row of each request
    j = torch.arange(k_max + 1, device=device)[None, :]
    pad_index = offsets[:, None] + torch.minimum(j, num_draft[:, None])  # [B, K+1]; padding repeats the last row
    row_params = [r.params for r, k in zip(requests, ks) for _ in range(k + 1)]
    st = SamplingTensors.from_params(row_params, device)
    counts = _penalty_counts(requests, ks, draft_ids, vocab) if st.any_penalty else None
    p_rows = processed_probs(logits, st, counts)  # [N, V]
    gens = [r.generator for r in requests]
    uniforms = uniform_noise(gens, ks, k_max, default_generator, device)  # [B, K]
    # [B, V]; an all-greedy batch samples one-hot rows, for which any positive noise gives the argmax
    noise = torch.ones(batch, vocab, device=device) if st.all_greedy else \
        exponential_noise(gens, vocab, default_generator, device)
    out = rejection_sample(p_rows[pad_index], draft_probs, draft_ids, num_draft, uniforms, noise)
    lp = _logprob_tensors(logits, requests, pad_index, out.output_token_ids)
    bad_rows = (~torch.isfinite(logits).all(dim=-1)).long()  # [N]
    bad = torch.zeros(batch, dtype=torch.long, device=device).index_add_(
        0, torch.repeat_interleave(torch.arange(batch, device=device), num_draft + 1), bad_rows)  # [B]
    host = torch.cat([out.output_token_ids, out.num_emitted_draft_tokens[:, None],
                      out.num_accepted_independent[:, None], bad[:, None]], dim=1).tolist()  # the one host sync
    emitted = [row[k_max + 1] for row in host]
    tokens = [row[: m + 1] for row, m in zip(host, emitted)]
    return VerifyResult(tokens, emitted, [row[k_max + 2] for row in host], [row[k_max + 3] > 0 for row in host],
                        _logprob_lists(lp, requests, emitted))


def _penalty_counts(requests: list[Request], ks: list[int], draft_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, V]: occurrences of each token among the output tokens before each verified position, drafts included."""
    device = draft_ids.device
    outs = [r.output_token_ids for r in requests]
    width = max(1, max(len(o) for o in outs))
    padded = torch.full((len(outs), width), vocab, dtype=torch.long)
    for b, o in enumerate(outs):
        padded[b, : len(o)] = torch.tensor(o, dtype=torch.long)
    base = torch.zeros(len(outs), vocab + 1, device=device)
    base.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    drafts = torch.nn.functional.one_hot(draft_ids.clamp_min(0), vocab).float() * (draft_ids >= 0)[..., None]
    before = torch.cat([drafts.new_zeros(len(outs), 1, vocab), drafts.cumsum(1)], dim=1)  # [B, K+1, V]
    per_pos = base[:, None, :vocab] + before
    rows = [(b, j) for b, k in enumerate(ks) for j in range(k + 1)]
    b_idx = torch.tensor([b for b, _ in rows], device=device)
    j_idx = torch.tensor([j for _, j in rows], device=device)
    return per_pos[b_idx, j_idx]


def _logprob_tensors(logits, requests, pad_index, out_ids):
    want = [b for b, r in enumerate(requests) if r.params.logprobs is not None]
    if not want:
        return None
    top_n = max(1, max(requests[b].params.logprobs for b in want))
    idx = torch.tensor(want, device=logits.device)
    logsm = torch.log_softmax(logits[pad_index[idx]], dim=-1)  # [W, K+1, V] of the target's raw logits
    chosen = logsm.gather(-1, out_ids[idx].clamp_min(0)[..., None]).squeeze(-1)  # [W, K+1]
    top = logsm.topk(top_n, dim=-1)
    return want, chosen, top.values, top.indices


def _logprob_lists(lp, requests, emitted):
    result = [None] * len(requests)
    if lp is None:
        return result
    want, chosen, top_v, top_i = lp
    chosen, top_v, top_i = chosen.tolist(), top_v.tolist(), top_i.tolist()
    for w, b in enumerate(want):
        n, count = requests[b].params.logprobs, emitted[b] + 1
        result[b] = (chosen[w][:count],
                     [list(zip(top_i[w][j][:n], top_v[w][j][:n])) for j in range(count)])
    return result
