"""bench/gpu.sh's helpers, which CI cannot run on a GPU: the random-weight models load and disagree with each
other, and the report reads what bench.spec_decode writes."""

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench import gpu_report, random_models


def test_random_models_are_untied_and_two_seeds_disagree(tmp_path):
    params = random_models.build("tiny", tmp_path / "a", seed=0)
    random_models.build("tiny", tmp_path / "b", seed=1)
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "b")
    assert sum(p.numel() for p in a.parameters()) == params
    assert not a.config.tie_word_embeddings
    assert AutoTokenizer.from_pretrained(tmp_path / "a").vocab_size <= a.config.vocab_size
    ids = torch.randint(0, a.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        agree = (a(ids).logits.argmax(-1) == b(ids).logits.argmax(-1)).float().mean().item()
        repeats = (a(ids).logits.argmax(-1) == ids).float().mean().item()
    assert agree < 0.2 and repeats < 0.2  # a tied head would mostly predict the input token, for both models


def test_report_reads_spec_decode_json_and_flags_an_fp32_mismatch(tmp_path):
    (tmp_path / "env.json").write_text(json.dumps({"device": "cuda", "gpu": "H200", "torch": "x", "cuda": "12"}))
    row = {"k": 0, "tokens_per_s": 10.0, "speedup": 1.0, "acceptance_rate": None, "greedy_identical": True}
    for name, dtype, same in [("exact-big+self-b8", "float32", False), ("speed-big+self-b1", "bfloat16", False)]:
        doc = {"benchmark": "spec_decode", "args": {"dtype": dtype, "batch_size": 8},
               "forward_costs": {"target_ms": {"1": 2.0}},
               "rows": [row, {**row, "k": 2, "acceptance_rate": 1.0, "greedy_identical": same}]}
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    doc = gpu_report.main([str(tmp_path)])
    assert [(r["check"], r["pair"], r["k"]) for r in doc["rows"]][:2] == [("exact", "big+self", 0), ("exact", "big+self", 2)]
    assert doc["fp32_greedy_identical"] is False
    assert json.loads((tmp_path / "summary.json").read_text())["rows"] == doc["rows"]
    assert "H200" in gpu_report.table(doc)
