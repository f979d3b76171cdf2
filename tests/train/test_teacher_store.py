"""The one teacher path's per-shard store: what it returns equals a fresh teacher-forced pass, a shard computed once
for a set of taps serves any subset of them (no second forward), and a grown shard is not served stale."""

import random

import pytest
import torch

from specserve.engine.model.hidden import FINAL
from specserve.train import teacher as teacher_mod
from specserve.train.answers import Answer, AnswerCorpus
from specserve.train.medusa import load_target
from specserve.train.teacher import (
    covering_file,
    load_records,
    precompute,
    store_root,
    teacher_forward,
    teacher_signals,
)


@pytest.fixture
def corpus(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))  # each test starts with an empty store
    rng = random.Random(0)
    answers = [Answer([rng.randrange(1, tiny["vocab"]) for _ in range(rng.randrange(2, 6))],
                      [rng.randrange(1, tiny["vocab"]) for _ in range(rng.randrange(0, 7))], 0, 0.0, False)
               for _ in range(11)]
    store = AnswerCorpus(tmp_path / "corpus")
    store.append(answers[:6])
    store.append(answers[6:])
    return tmp_path / "corpus"


def test_store_equals_a_fresh_teacher_pass_and_serves_subsets(tiny, corpus, tmp_path, monkeypatch):
    target = load_target(tiny["llama"], torch.float32).eval()
    records = load_records(corpus, 64)
    assert {r["shard"].name for r in records} == {"shard_00000.safetensors", "shard_00001.safetensors"}
    summary = precompute(target, tiny["llama"], corpus, [0, 1, FINAL], 5)
    assert len(summary["built"]) == 2 and not summary["already_there"]
    fresh = teacher_forward(target, records, [FINAL, 0], 3)
    calls = []
    monkeypatch.setattr(teacher_mod, "teacher_forward", lambda *a, **k: calls.append(a) or [])
    stored = teacher_signals(target, tiny["llama"], records, [FINAL, 0], 3, tmp_path / "unused")
    assert not calls  # a subset of the stored taps and top-k: read, not recomputed
    for f, s in zip(fresh, stored):
        assert torch.equal(f["hidden"], s["hidden"])  # taps in the order asked for
        assert torch.equal(f["top_ids"], s["top_ids"])
        assert torch.equal(f["top_logprobs"], s["top_logprobs"])
    assert precompute(target, tiny["llama"], corpus, [0, FINAL], 5)["already_there"] == [
        "shard_00000.safetensors", "shard_00001.safetensors"]


def test_another_shard_content_or_a_missing_tap_is_not_served(tiny, corpus, tmp_path):
    target = load_target(tiny["llama"], torch.float32).eval()
    precompute(target, tiny["llama"], corpus, [0], 2)
    root, shard = store_root(tiny["llama"]), corpus / "shard_00000.safetensors"
    assert covering_file(root, shard, [0], 2) is not None
    assert covering_file(root, shard, [0, 1], 0) is None
    assert covering_file(root, shard, [0], 3) is None
    other = AnswerCorpus(tmp_path / "other")  # same shard name, other answers
    other.append([Answer([1, 2], [3, 4], 0, 0.0, False)])
    assert covering_file(root, tmp_path / "other" / "shard_00000.safetensors", [0], 2) is None
