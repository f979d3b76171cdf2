"""The draft-to-target vocabulary map: ids in, logits out, validation."""

import pytest
import torch

from specserve.engine.model.vocab_map import VocabMap, load_vocab_map, save_vocab_map


def test_ids_and_logits_round_trip(tmp_path):
    vm = VocabMap.from_d2t(torch.tensor([4, 0, 7]), target_vocab=10)
    assert vm.draft_vocab == 4
    assert vm.to_draft_ids(torch.tensor([4, 0, 7, 1, 9])).tolist() == [0, 1, 2, 3, 3]  # 3 = unknown
    logits = torch.tensor([[1.0, 2.0, 3.0, 99.0]])  # [N, Vd + 1]; the unknown id's logit is dropped
    full = vm.to_target_logits(logits, 10)
    assert full.shape == (1, 10)
    assert full[0, [4, 0, 7]].tolist() == [1.0, 2.0, 3.0]
    assert torch.isinf(full[0, [1, 2, 3, 5, 6, 8, 9]]).all()
    probs = torch.softmax(full, -1)
    assert probs[0, [1, 2, 3, 5, 6, 8, 9]].sum() == 0  # q is exactly zero outside the map
    save_vocab_map(tmp_path, torch.tensor([4, 0, 7]))
    again = load_vocab_map(tmp_path, 10, torch.device("cpu"))
    assert torch.equal(again.d2t, vm.d2t) and torch.equal(again.t2d, vm.t2d)
    assert load_vocab_map(tmp_path / "missing", 10, torch.device("cpu")) is None


@pytest.mark.parametrize("d2t", [[], [0, 10], [-1], [2, 2]])
def test_bad_maps_are_refused(d2t):
    with pytest.raises(ValueError, match="d2t"):
        VocabMap.from_d2t(torch.tensor(d2t, dtype=torch.long), target_vocab=10)
