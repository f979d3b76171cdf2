"""Target side of a speculative step: the processed target distribution at every verified position (penalties see
the draft tokens before each position), the rejection sampler, and log-probs — all batched, one host read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.request import Request
from specserve.engine.sample.rejection import greedy_accept, rejection_sample
from specserve.engine.sample.sampler import (
    SamplingTensors,
    argmax_rows,
    depth_noise,
    exponential_noise,
    processed_probs,
    uniform_noise,
)
from specserve.engine.sample.tree import ancestor_matrix, chain_parents, tree_sample, typical_accept


@dataclass(frozen=True)
class DraftBatch:
    """The proposals of one verify step, one row per request (rows with k = 0 propose nothing)."""

    token_ids: torch.Tensor  # [B, K] long, -1 beyond each row's count
    parents: torch.Tensor | None = None  # [B, K] long tree parents (engine/sample/tree.py); None: every row is a chain
    probs: torch.Tensor | None = None  # [P, K, V] q of the rows in prob_rows (sampled chains); the rest are one-hot
    prob_rows: tuple[int, ...] = ()
    tree_rows: tuple[int, ...] = ()  # rows whose proposal branches (the rest are chains)
    typical: dict[int, tuple[float, float]] | None = None  # tree row -> (threshold, alpha): LOSSY typical acceptance


@dataclass
class VerifyResult:
    tokens: list[list[int]]  # per request: the emitted tokens (accepted drafts, then one recovered/bonus token)
    num_accepted: list[int]  # draft tokens emitted per request
    paths: list[list[int]]  # per request: node of each emitted token's row (0 = the last token, then accepted nodes)
    non_finite: list[bool]  # the target's logits for this request held NaN/inf: its tokens must not be used
    logprobs: list[tuple[list[float], list[list[tuple[int, float]]]] | None]  # per request, per emitted token


def verify(logits: torch.Tensor, requests: list[Request], ks: list[int], offsets: list[int], drafts: DraftBatch,
           default_generator: torch.Generator) -> VerifyResult:
    """logits [N, V]: request b owns rows offsets[b] .. offsets[b] + ks[b] (spec_decode/layout.py), row j the target
    after node j.

    Chains go through the chain rejection sampler (residual rule; q one-hot for lookups: k uniforms and one
    vocabulary-sized draw per row); trees through the tree rule (one vocabulary-sized draw per depth)."""
    device = logits.device
    draft_ids = drafts.token_ids
    batch, k_max = len(requests), draft_ids.shape[1]
    greedy = all(r.params.greedy and not r.params.has_penalties for r in requests)
    if greedy and not any(ks):
        return _plain_greedy(logits if offsets == list(range(batch)) else logits[offsets], requests)
    num_draft = torch.tensor(ks, device=device)
    offsets = torch.tensor(offsets, device=device)  # [B] first row of each request
    j = torch.arange(k_max + 1, device=device)[None, :]
    pad_index = offsets[:, None] + torch.minimum(j, num_draft[:, None])  # [B, K+1]; padding repeats the last row
    if greedy and not drafts.tree_rows and not drafts.prob_rows:
        # greedy chains (and plain steps), the common case: argmax ids alone decide (greedy_accept), so none of the
        # general rule's tensors (ancestors, sampling parameters, noise) are built: ~0.8 ms of a 4-row CPU step
        out = greedy_accept(argmax_rows(logits)[pad_index], draft_ids, num_draft)
        tokens, emitted = out.output_token_ids, out.num_emitted_draft_tokens
        path = torch.minimum(j, emitted[:, None])
    else:
        tokens, emitted, path = _general(logits, requests, ks, drafts, num_draft, pad_index, j, default_generator)
    emit_index = offsets[:, None] + path  # [B, K+1] logits row of each emitted token
    lp = _logprob_tensors(logits, requests, emit_index, tokens)
    # one reduction instead of isfinite's two vocabulary-sized passes (2.6 ms a step at batch 16 on the 2-core EPYC):
    # NaN/inf anywhere makes the sum non-finite (so does a finite row whose sum overflows fp32: |logits| ~ 1e34)
    bad_rows = (~torch.isfinite(logits.sum(dim=-1))).long()  # [N]
    bad = torch.zeros(batch, dtype=torch.long, device=device).index_add_(
        0, torch.repeat_interleave(torch.arange(batch, device=device), num_draft + 1), bad_rows)  # [B]
    host = torch.cat([tokens, path, emitted[:, None], bad[:, None]], dim=1).tolist()  # the one host sync
    w = k_max + 1
    counts_m = [row[2 * w] for row in host]
    return VerifyResult([row[: m + 1] for row, m in zip(host, counts_m)], counts_m,
                        [row[w: w + m + 1] for row, m in zip(host, counts_m)], [row[2 * w + 1] > 0 for row in host],
                        _logprob_lists(lp, requests, counts_m))


def _plain_greedy(logits: torch.Tensor, requests: list[Request]) -> VerifyResult:
    """A step without drafts, every row greedy: logits [B, V], row b request b's, whose argmax is its token (what
    the rule gives, with a third of its tensor operations: ~0.3 ms of a 10 ms one-stream CPU step)."""
    batch = len(requests)
    ids = argmax_rows(logits)  # [B]
    lp = _logprob_tensors(logits, requests, torch.arange(batch, device=logits.device)[:, None], ids[:, None])
    host = torch.stack([ids, (~torch.isfinite(logits.sum(dim=-1))).long()], dim=1).tolist()  # the one host sync
    return VerifyResult([[t] for t, _ in host], [0] * batch, [[0] for _ in host], [bad > 0 for _, bad in host],
                        _logprob_lists(lp, requests, [0] * batch))


def _general(logits: torch.Tensor, requests: list[Request], ks: list[int], drafts: DraftBatch,
             num_draft: torch.Tensor, pad_index: torch.Tensor, j: torch.Tensor, default_generator: torch.Generator):
    """The exact rule for any mix of rows (sampled, penalised, trees, chains with q) -> tokens, emitted, path."""
    device, vocab = logits.device, logits.shape[-1]
    draft_ids = drafts.token_ids
    batch, k_max = len(requests), draft_ids.shape[1]
    parents = drafts.parents if drafts.parents is not None else chain_parents(batch, k_max, device)
    parents = torch.where(j[:, 1:] <= num_draft[:, None], parents, torch.zeros_like(parents))  # padding: leaves
    ancestors = ancestor_matrix(parents)  # [B, K+1, K+1]
    row_params = [r.params for r, k in zip(requests, ks) for _ in range(k + 1)]
    st = SamplingTensors.from_params(row_params, device)
    counts = _penalty_counts(requests, ks, draft_ids, ancestors, vocab) if st.any_penalty else None
    trees, with_q = set(drafts.tree_rows), set(drafts.prob_rows)
    # all greedy, no penalties: p is one-hot at the argmax, and chains need only the argmax ids (greedy_accept)
    target_ids = argmax_rows(logits)[pad_index] if st.all_greedy and counts is None else None  # [B, K+1]
    p_nodes = processed_probs(logits, st, counts)[pad_index] if target_ids is None or trees else None  # [B, K+1, V]
    gens = [r.generator for r in requests]
    tokens = torch.full((batch, k_max + 1), -1, dtype=torch.long, device=device)
    emitted = torch.zeros(batch, dtype=torch.long, device=device)
    path = torch.minimum(j, num_draft[:, None]).clone()  # [B, K+1] chains: node j is row j
    chains = [(list(drafts.prob_rows), drafts.probs), ([b for b in range(batch) if b not in trees | with_q], None)]
    for rows, q in chains:  # sampled chains with their q, then one-hot chains
        if not rows:
            continue
        idx = torch.tensor(rows, device=device)
        if target_ids is not None:  # greedy: the same result as the general rule on one-hot p, with no noise
            q_x = None if q is None else q.gather(-1, draft_ids[idx].clamp_min(0)[..., None]).squeeze(-1)
            out = greedy_accept(target_ids[idx], draft_ids[idx], num_draft[idx], q_x)
        else:
            sub = [gens[b] for b in rows]
            uniforms = uniform_noise(sub, [ks[b] for b in rows], k_max, default_generator, device)  # [R, K]
            noise = torch.ones(len(rows), vocab, device=device) if st.all_greedy else \
                exponential_noise(sub, vocab, default_generator, device)  # [R, V]
            out = rejection_sample(p_nodes[idx], q, draft_ids[idx], num_draft[idx], uniforms, noise)
        tokens[idx], emitted[idx] = out.output_token_ids, out.num_emitted_draft_tokens
        path[idx] = torch.minimum(j, out.num_emitted_draft_tokens[:, None])
    if trees:
        rows = sorted(trees)
        idx = torch.tensor(rows, device=device)
        noise = torch.ones(len(rows), k_max + 1, vocab, device=device) if st.all_greedy else \
            depth_noise([gens[b] for b in rows], [ks[b] + 1 for b in rows], k_max + 1, vocab, default_generator,
                        device)  # [T, K+1, V]
        relaxed = relaxed_rows = None
        if drafts.typical:  # opted into by --medusa-typical-acceptance only
            thr, alpha = zip(*[drafts.typical.get(b, (1.0, 1.0)) for b in rows])
            relaxed = typical_accept(p_nodes[idx], draft_ids[idx], parents[idx], torch.tensor(thr, device=device),
                                     torch.tensor(alpha, device=device))
            relaxed_rows = torch.tensor([b in drafts.typical for b in rows], device=device)
        t, m, pth = tree_sample(p_nodes[idx], draft_ids[idx].clamp_min(0), parents[idx], ancestors[idx],
                                num_draft[idx], noise, relaxed, relaxed_rows)
        tokens[idx], emitted[idx], path[idx] = t, m, pth
    return tokens, emitted, path


def _penalty_counts(requests: list[Request], ks: list[int], draft_ids: torch.Tensor, ancestors: torch.Tensor,
                    vocab: int) -> torch.Tensor:
    """[N, V]: occurrences of each token among the output tokens before each verified position: the request's
    output, then the proposed tokens on the node's own path (a chain's path is every draft before it)."""
    device = draft_ids.device
    outs = [r.output_token_ids for r in requests]
    width = max(1, max(len(o) for o in outs))
    padded = torch.full((len(outs), width), vocab, dtype=torch.long)
    for b, o in enumerate(outs):
        padded[b, : len(o)] = torch.tensor(o, dtype=torch.long)
    base = torch.zeros(len(outs), vocab + 1, device=device)
    base.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    drafts = torch.nn.functional.one_hot(draft_ids.clamp_min(0), vocab).float() * (draft_ids >= 0)[..., None]
    before = torch.bmm(ancestors[:, :, 1:].float(), drafts)  # [B, K+1, V] tokens of nodes on each node's path
    per_pos = base[:, None, :vocab] + before
    rows = [(b, j) for b, k in enumerate(ks) for j in range(k + 1)]
    b_idx = torch.tensor([b for b, _ in rows], device=device)
    j_idx = torch.tensor([j for _, j in rows], device=device)
    return per_pos[b_idx, j_idx]


def _logprob_tensors(logits, requests, emit_index, out_ids):
    want = [b for b, r in enumerate(requests) if r.params.logprobs is not None]
    if not want:
        return None
    top_n = max(1, max(requests[b].params.logprobs for b in want))
    idx = torch.tensor(want, device=logits.device)
    logsm = torch.log_softmax(logits[emit_index[idx]], dim=-1)  # [W, K+1, V] of the target's raw logits
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
