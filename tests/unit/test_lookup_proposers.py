"""n-gram index and Predicted Outputs alignment: pure functions over token lists."""

import random

import pytest

from specserve.engine.spec_decode.ngram import trie
from specserve.engine.spec_decode.ngram_index import NgramIndex
from specserve.engine.spec_decode.prediction import MIN_N, PredictionAligner, prediction_usage


def test_ngram_lookup_follows_the_latest_earlier_occurrence_of_the_longest_suffix():
    idx = NgramIndex(1, 3)
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    idx.update(toks)
    assert idx.lookup(toks, 3) == [7, 5, 2]  # suffix (2, 3): latest earlier occurrence is followed by 7
    toks2 = toks + [4]
    idx.update(toks2)
    assert idx.lookup(toks2, 3) == []  # 4 never seen before
    idx3 = NgramIndex(1, 3)
    toks3 = [1, 2, 3, 9, 8, 2, 3, 1, 2, 3]
    idx3.update(toks3)
    assert idx3.lookup(toks3, 2) == [9, 8]  # the 3-gram (1, 2, 3) wins over the later 2-gram (2, 3) -> 1


def test_ngram_respects_min_and_k_and_validates_sizes():
    idx = NgramIndex(2, 4)
    toks = [5, 6, 7, 5]
    idx.update(toks)
    assert idx.lookup(toks, 4) == []  # only a 1-gram (5) matches: below prompt_lookup_min
    toks += [6]
    idx.update(toks)
    assert idx.lookup(toks, 1) == [7]
    assert idx.lookup(toks, 10) == [7, 5, 6]  # runs to the end of the sequence
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramIndex(3, 2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramIndex(0, 2)


def test_ngram_incremental_updates_equal_one_update_of_everything():
    rng = random.Random(0)
    toks = [rng.randrange(6) for _ in range(300)]
    grown, whole = NgramIndex(1, 4), NgramIndex(1, 4)
    pos = 0
    while pos < len(toks):
        pos += rng.randrange(1, 9)
        grown.update(toks[:pos])
    whole.update(toks)
    assert grown._next == whole._next
    for end in range(5, 300, 17):
        fresh = NgramIndex(1, 4)
        fresh.update(toks[:end])
        partial = NgramIndex(1, 4)
        for p in range(1, end + 1):
            partial.update(toks[:p])
        assert partial.lookup(toks[:end], 5) == fresh.lookup(toks[:end], 5)


def test_ngram_continuations_latest_first_then_shorter_suffixes():
    toks = [1, 2, 3, 9, 1, 2, 4, 8, 2, 7, 1, 2]
    idx = NgramIndex(1, 2, keep=3)
    idx.update(toks)
    # suffix (1, 2): followed by 4 (latest) and 3; then the 1-gram (2): its occurrences before 4 and 3 are taken,
    # so the next new one is the 2 followed by 7
    assert idx.continuations(toks, 2, 3) == [[4, 8], [3, 9], [7, 1]]
    assert idx.continuations(toks, 2, 1) == [[4, 8]] and idx.lookup(toks, 2) == [4, 8]
    assert NgramIndex(1, 2, keep=1).continuations(toks, 2, 3) == []  # nothing indexed yet
    with pytest.raises(ValueError, match="prompt_lookup_branches"):
        NgramIndex(1, 2, keep=0)


def test_ngram_match_length_is_the_longest_suffix_with_a_continuation():
    idx = NgramIndex(2, 4)
    seq = [1, 2, 3, 4, 9, 1, 2, 3, 4]
    idx.update(seq)
    assert idx.match_length(seq) == 4  # [1, 2, 3, 4] was followed by 9
    assert idx.match_length([7, 2, 3, 4]) == 3 and idx.match_length([7, 8, 3, 4]) == 2
    assert idx.match_length([7, 8, 9, 4]) == 0 and idx.match_length([4]) == 0  # below n_min: no match


def test_ngram_population_names_the_match_length_and_none_without_one():
    from types import SimpleNamespace

    import torch

    from specserve.engine.spec_decode.ngram import NgramProposer

    p = NgramProposer(4, 2, 4, torch.device("cpu"))
    req = SimpleNamespace(request_id="r", token_ids=[1, 2, 3, 4, 9, 1, 2, 3])
    assert p.population(req) == "ngram/3"
    req.token_ids = req.token_ids + [4]
    assert p.population(req) == "ngram/4"
    assert p.population(SimpleNamespace(request_id="s", token_ids=[5, 6, 7, 8])) is None


def test_trie_merges_shared_prefixes():
    tokens, parents = trie([[5, 6, 7], [5, 6, 8], [9]])
    assert tokens == [5, 6, 7, 8, 9] and parents == [0, 1, 2, 2, 0]
    assert trie([]) == ([], [])


def _follow(prediction, output, k=4):
    """Drafts the aligner offers before each output token."""
    al = PredictionAligner(prediction)
    drafts = []
    for i in range(len(output) + 1):
        al.follow(output[:i])
        drafts.append(al.draft(k))
    return drafts


def test_prediction_followed_exactly_drafts_the_rest():
    pred = list(range(100, 120))
    drafts = _follow(pred, pred)
    assert drafts[0] == [100, 101, 102, 103]
    assert all(d == pred[i:i + 4] for i, d in enumerate(drafts))


def test_prediction_realigns_after_an_insertion_and_a_deletion():
    pred = list(range(100, 140))
    inserted = pred[:10] + [7, 8, 9] + pred[10:]  # the model adds three tokens, then goes on with the prediction
    drafts = _follow(pred, inserted)
    assert drafts[11] == []  # right after the divergence: no suffix of >= MIN_N tokens matches
    assert drafts[13 + MIN_N] == pred[10 + MIN_N:14 + MIN_N]  # re-aligned once MIN_N predicted tokens follow
    deleted = pred[:10] + pred[20:]  # the model skips ten predicted tokens
    drafts = _follow(pred, deleted)
    assert drafts[10 + MIN_N] == pred[20 + MIN_N:24 + MIN_N]


def test_prediction_prefers_the_occurrence_after_the_last_aligned_place():
    block = [1, 2, 3, 4, 5]
    pred = block + [50, 51] + block + [60, 61]
    out = block + [50, 51] + [9] + block  # diverges, then repeats the block: should align to the second copy
    al = PredictionAligner(pred)
    al.follow(out)
    assert al.draft(2) == [60, 61]


def test_prediction_usage_counts_prediction_tokens_present_in_the_completion():
    assert prediction_usage([1, 2, 3, 4], [1, 2, 3, 4]) == (4, 0)
    assert prediction_usage([1, 2, 3, 4], [1, 9, 9, 9, 9, 3, 4]) == (3, 1)
    assert prediction_usage([1, 2, 3], [7, 8]) == (0, 3)
    # rejected is about the prediction, not rejection events: never more than the prediction's length
    acc, rej = prediction_usage([5] * 3, [5, 6] * 10)
    assert acc == 3 and rej == 0
