"""The benchmarks' questions stay out of the training prompts (acceptance measured on them would be on training
data otherwise)."""

from bench.prompts import heldout_prompts
from specserve.train.prompts import training_prompts


def test_heldout_questions_are_not_training_prompts():
    train = training_prompts()
    held = heldout_prompts()
    assert len(held) >= 20 and len(train) > 1000
    assert not set(held) & set(train)
    assert not [p for p in train for q in held if q in p]  # nor inside a longer training prompt
