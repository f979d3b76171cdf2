"""Exact rules of the rejection sampler: hand-computed cases and the law of its output."""

import torch

from specserve.engine.sample.rejection import greedy_accept, rejection_sample
from specserve.engine.sample.sampler import sample


def _one(target, draft, ids, k=None, seed=0):
    target = torch.tensor(target)[None]
    draft = torch.tensor(draft)[None]
    ids = torch.tensor(ids)[None]
    k = torch.tensor([ids.shape[1] if k is None else k])
    gen = torch.Generator().manual_seed(seed)
    uniforms = torch.rand(1, ids.shape[1], generator=gen)
    noise = torch.empty(1, target.shape[-1]).exponential_(generator=gen)
    return rejection_sample(target, draft, ids, k, uniforms, noise)


def test_flashinfer_documented_example():
    # flashinfer's documented example: token 2 accepted (p/q = 2), token 1 rejected (p = 0), residual is [.8,0,0,0].
    for seed in range(20):
        out = _one([[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]],
                   [[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]], [2, 1], seed=seed)
        assert out.output_token_ids.tolist() == [[2, 0, -1]]
        assert out.num_emitted_draft_tokens.tolist() == [1]


def test_emitted_count_stops_at_the_first_rejection():
    # position 0 is rejected for sure (p = 0); position 1 would pass on its own (p/q >= 1) but is never emitted.
    for seed in range(20):
        out = _one([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]],
                   [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]], [0, 2], seed=seed)
        assert out.output_token_ids.tolist() == [[1, -1, -1]]
        assert out.num_emitted_draft_tokens.tolist() == [0]


def test_all_accepted_gives_bonus_token():
    out = _one([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]],
               [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], [1, 2])
    assert out.output_token_ids.tolist() == [[1, 2, 0]]
    assert out.num_emitted_draft_tokens.tolist() == [2]


def test_per_row_k_and_padding():
    # row 0 proposes 2, row 1 proposes 0 (plain decode: bonus from p_0), greedy one-hot targets.
    target = torch.tensor([[[0, 1.0, 0], [0, 0, 1.0], [1.0, 0, 0]],
                           [[0, 0, 1.0], [1.0, 0, 0], [0, 1.0, 0]]])
    draft = torch.tensor([[[0, 1.0, 0], [0, 1.0, 0]], [[1.0, 0, 0], [1.0, 0, 0]]])
    ids = torch.tensor([[1, 1], [0, 0]])
    out = rejection_sample(target, draft, ids, torch.tensor([2, 0]), torch.rand(2, 2), torch.ones(2, 3))
    assert out.output_token_ids.tolist() == [[1, 2, -1], [2, -1, -1]]
    assert out.num_emitted_draft_tokens.tolist() == [1, 0]


def test_one_hot_draft_is_exact_match_rule():
    target = torch.tensor([[[0.1, 0.9, 0.0], [0.5, 0.5, 0.0]]])
    out = rejection_sample(target, None, torch.tensor([[2]]), torch.tensor([1]), torch.zeros(1, 1), torch.ones(1, 3))
    assert out.num_emitted_draft_tokens.tolist() == [0]  # p(2) = 0: rejected, residual = p minus nothing at 2
    assert out.output_token_ids[0, 0].item() in (0, 1)


def test_greedy_accept_equals_the_general_rule_on_one_hot_targets():
    """All-greedy steps skip the vocabulary-sized work: the rule on argmax ids must give what the general sampler
    gives on one-hot p, for one-hot and sampled q, ragged k, matches and misses (and q = 0 at a draft token)."""
    gen = torch.Generator().manual_seed(7)
    batch, k_max, vocab = 64, 5, 6
    target_ids = torch.randint(0, vocab, (batch, k_max + 1), generator=gen)
    p = torch.nn.functional.one_hot(target_ids, vocab).float()
    match = torch.rand(batch, k_max, generator=gen) < 0.7
    drafts = torch.where(match, target_ids[:, :k_max], torch.randint(0, vocab, (batch, k_max), generator=gen))
    ks = torch.randint(0, k_max + 1, (batch,), generator=gen)
    drafts = torch.where(torch.arange(k_max)[None] < ks[:, None], drafts, torch.full_like(drafts, -1))
    q = torch.rand(batch, k_max, vocab, generator=gen)
    q[torch.rand(batch, k_max, generator=gen) < 0.1, :] = 0.0  # rows whose draft token has q = 0
    q[..., 0] += 1e-3
    q = q / q.sum(-1, keepdim=True)
    uniforms = torch.rand(batch, k_max, generator=gen)
    noise = torch.empty(batch, vocab).exponential_(generator=gen)
    for draft_q in (None, q):
        want = rejection_sample(p, draft_q, drafts, ks, uniforms, noise)
        q_x = None if draft_q is None else draft_q.gather(-1, drafts.clamp_min(0)[..., None]).squeeze(-1)
        got = greedy_accept(target_ids, drafts, ks, q_x)
        assert torch.equal(got.output_token_ids, want.output_token_ids)
        assert torch.equal(got.num_emitted_draft_tokens, want.num_emitted_draft_tokens)
    assert 0 < int(want.num_emitted_draft_tokens.sum()) < int(ks.sum())  # both matches and misses were exercised


# --- distribution tests -------------------------------------------------------------------------------------------

N = 60_000
P = torch.tensor([[0.05, 0.40, 0.10, 0.30, 0.15],  # p_1
                  [0.50, 0.05, 0.05, 0.20, 0.20],  # p_2 (given an accepted first draft)
                  [0.10, 0.10, 0.60, 0.10, 0.10]])  # p_3 (bonus)
Q = torch.tensor([[0.40, 0.05, 0.30, 0.05, 0.20],
                  [0.05, 0.60, 0.05, 0.10, 0.20]])


def _draw(sampler_fn, seed=1234):
    gen = torch.Generator().manual_seed(seed)
    target = P[None].expand(N, -1, -1).contiguous()
    draft = Q[None].expand(N, -1, -1).contiguous()
    ids = torch.stack([torch.multinomial(Q[i], N, replacement=True, generator=gen) for i in range(2)], dim=1)
    uniforms = torch.rand(N, 2, generator=gen)
    noise = torch.empty(N, 5).exponential_(generator=gen)
    return sampler_fn(target, draft, ids, torch.full((N,), 2), uniforms, noise)


def _law_errors(out):
    """Max |empirical - exact| of the first token, the second given the first was an accepted draft, the third."""
    toks, emitted = out.output_token_ids, out.num_emitted_draft_tokens
    errs = [(torch.bincount(toks[:, 0], minlength=5) / N - P[0]).abs().max().item()]
    for pos in (1, 2):
        sel = toks[emitted >= pos, pos]
        errs.append((torch.bincount(sel, minlength=5) / len(sel) - P[pos]).abs().max().item())
    return errs


def _resample_from_target(target, draft, ids, k, uniforms, noise):
    """A known biased sampler: on rejection resample from the target instead of the residual."""
    out = rejection_sample(target, draft, ids, k, uniforms, noise)
    rows = torch.arange(len(ids))
    j = out.num_emitted_draft_tokens
    fixed = out.output_token_ids.clone()
    fixed[rows, j] = sample(target[rows, j], noise)
    return type(out)(fixed, j)


def test_output_follows_target_law():
    errs = _law_errors(_draw(rejection_sample))
    assert max(errs) < 0.012, errs  # ~4 standard errors at N = 60k


def test_law_check_catches_seed_002_bias():
    errs = _law_errors(_draw(_resample_from_target))
    assert max(errs) > 0.03, errs


def test_sample_is_exact_draw():
    probs = torch.tensor([[0.1, 0.2, 0.7]]).expand(N, -1)
    noise = torch.empty(N, 3).exponential_(generator=torch.Generator().manual_seed(7))
    freq = torch.bincount(sample(probs, noise), minlength=3) / N
    assert (freq - probs[0]).abs().max() < 0.01
