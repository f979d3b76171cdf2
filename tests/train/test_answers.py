"""The kept corpus of the target's own answers: shards round-trip exactly, the manifest counts them, a rerun of
selfgen appends only what is missing, and the corpus in the repository is readable and consistent."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from specserve.train.answers import Answer, AnswerCorpus, read_shard, record_key

ROOT = Path(__file__).resolve().parents[2]


def test_shards_round_trip_and_the_manifest_counts_them(tmp_path):
    corpus = AnswerCorpus(tmp_path / "c")
    first = [Answer([1, 2, 3], [4, 5], 0, 0.0, False), Answer([65535, 0], [], 1, 0.8, True)]
    corpus.append(first)
    corpus.append([Answer([7], [8, 9, 10], 0, 0.0, False)])
    again = AnswerCorpus(tmp_path / "c")  # read back from disk
    assert list(again) == first + [Answer([7], [8, 9, 10], 0, 0.0, False)]
    assert again.manifest["totals"] == {"records": 3, "prompt_tokens": 6, "output_tokens": 5}
    assert again.keys() == {record_key([1, 2, 3], 0), record_key([65535, 0], 1), record_key([7], 0)}
    assert record_key([1, 2, 3], 0) != record_key([1, 2, 3], 1)
    with pytest.raises(ValueError, match="uint16"):
        corpus.append([Answer([70000], [1], 0, 0.0, False)])
    assert AnswerCorpus(tmp_path / "c").manifest["totals"]["records"] == 3  # the refused shard was not listed


def test_selfgen_appends_only_what_is_missing(tiny, tmp_path):
    from specserve.train.selfgen import generate_answers

    model = tmp_path / "model"
    shutil.copytree(tiny["llama"], model)
    tok = PreTrainedTokenizerFast.from_pretrained(model)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    tok.save_pretrained(model)
    out = tmp_path / "corpus"
    first = generate_answers(str(model), out, max_minutes=5, max_tokens=4, batch=3, shard_size=2, passes=2,
                             max_answers=3)
    corpus = AnswerCorpus(out)
    assert first["answers_this_run"] == 3 == corpus.manifest["totals"]["records"]
    assert [s["records"] for s in corpus.manifest["shards"]] == [2, 1]
    assert all(len(a.output_ids) <= 4 and a.pass_ == 0 and a.temperature == 0.0 for a in corpus)
    second = generate_answers(str(model), out, max_minutes=5, max_tokens=4, batch=3, shard_size=2, passes=2,
                              max_answers=3)
    corpus = AnswerCorpus(out)
    assert second["answers_this_run"] == 3 and corpus.manifest["totals"]["records"] == 6
    assert len(corpus.keys()) == 6  # nothing answered twice
    assert corpus.manifest["num_prompts"] > 1000 and corpus.manifest["passes"] == {"0": 0.0, "1": 0.8}


def test_the_kept_corpus_is_consistent():
    """models/corpus/*: every listed shard exists, its counts match the manifest, ids are in the vocabulary."""
    manifests = sorted((ROOT / "models" / "corpus").glob("*/manifest.json"))
    assert manifests, "models/corpus holds the kept corpus (in git)"
    for path in manifests:
        corpus = AnswerCorpus(path.parent)
        assert corpus.manifest["shards"], path
        for entry, shard in zip(corpus.manifest["shards"], corpus.shards):
            records = read_shard(shard)
            assert len(records) == entry["records"], shard
            assert sum(len(a.output_ids) for a in records) == entry["output_tokens"], shard
            assert sum(len(a.prompt_ids) for a in records) == entry["prompt_tokens"], shard
        assert json.loads(path.read_text())["totals"]["output_tokens"] == corpus.num_tokens()
        assert len(corpus.keys()) == corpus.manifest["totals"]["records"]  # no answer twice
