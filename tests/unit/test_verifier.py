"""verify()'s greedy-chain shortcut (no sampling tensors, ancestors or noise) against the general rule it skips."""

from types import SimpleNamespace

import pytest
import torch

from specserve.engine.sample.verifier import DraftBatch, _general, verify
from specserve.engine.sampling_params import SamplingParams


def _case(seed: int, ks: list[int], vocab: int = 50):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(sum(k + 1 for k in ks), vocab, generator=g)
    argmax = logits.argmax(-1)
    k_max = max(ks)
    drafts = torch.full((len(ks), k_max), -1, dtype=torch.long)
    row = 0
    for b, k in enumerate(ks):
        for i in range(k):  # the target's own argmax mostly, so that acceptance runs deep; a wrong token sometimes
            right = torch.rand((), generator=g) < 0.75
            drafts[b, i] = argmax[row + i] if right else (argmax[row + i] + 1) % vocab
        row += k + 1
    return logits, drafts


@pytest.mark.parametrize("ks", [[0, 3, 1, 4, 2, 4], [0, 0, 0]])  # chains, and a step with no drafts at all
def test_greedy_chains_match_the_general_rule(ks):
    offsets = [sum(k + 1 for k in ks[:b]) for b in range(len(ks))]
    requests = [SimpleNamespace(params=SamplingParams(temperature=0.0, logprobs=2 if b == 1 else None),
                                generator=None, output_token_ids=[1, 2]) for b in range(len(ks))]
    for seed in range(20):
        logits, drafts = _case(seed, ks)
        if seed % 2:
            logits[len(ks) - 1, 3] = float("nan")  # a poisoned row is reported, whatever else happens
        batch = DraftBatch(token_ids=drafts)
        result = verify(logits, requests, ks, offsets, batch, torch.Generator())
        device = logits.device
        num_draft = torch.tensor(ks)
        j = torch.arange(max(ks) + 1)[None, :]
        pad_index = torch.tensor(offsets)[:, None] + torch.minimum(j, num_draft[:, None])
        tokens, emitted, path = _general(logits, requests, ks, batch, num_draft, pad_index, j, torch.Generator())
        assert result.num_accepted == emitted.tolist()
        assert result.tokens == [t[: m + 1] for t, m in zip(tokens.tolist(), emitted.tolist())]
        assert result.paths == [p[: m + 1] for p, m in zip(path.tolist(), emitted.tolist())]
        assert result.logprobs[1] is not None and len(result.logprobs[1][0]) == emitted[1] + 1
        assert result.logprobs[0] is None
        poisoned = [(seed % 2 == 1 and sum(k + 1 for k in ks[:b]) <= len(ks) - 1 <= sum(k + 1 for k in ks[:b + 1]) - 1)
                    for b in range(len(ks))]
        assert result.non_finite == poisoned
        assert device.type == "cpu"


def test_greedy_chains_emit_the_argmax_after_the_first_miss():
    logits = torch.full((3, 8), -5.0)
    logits[0, 4] = logits[1, 6] = logits[2, 2] = 5.0  # argmax 4, 6, 2
    requests = [SimpleNamespace(params=SamplingParams(temperature=0.0), generator=None, output_token_ids=[])]
    batch = DraftBatch(token_ids=torch.tensor([[4, 1]]))  # the first draft right, the second wrong
    result = verify(logits, requests, [2], [0], batch, torch.Generator())
    assert result.tokens == [[4, 6]] and result.num_accepted == [1] and result.paths == [[0, 1]]
