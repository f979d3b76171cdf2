"""Smoke test of the training pipeline: tokenizer + tiny target + tiny distilled draft, all loadable.

CPU only, no network; a few KB of generated text keeps it well under a minute on 2 cores.
"""
from __future__ import annotations

import json

import pytest
import torch

from specserve.train.cli import add_train_parser
from specserve.train.corpus import heldout_prompts, load_corpus
from specserve.train.distill import train_draft
from specserve.train.loop import TrainConfig
from specserve.train.target import train_target

TINY_TARGET = dict(num_layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2)
TINY_DRAFT = dict(num_layers=1, hidden=32, intermediate=64, heads=2, kv_heads=2)


def _write_corpus(root) -> None:
    # Repetitive, code-like text: a tiny model can learn it in a few dozen steps.
    for f in range(6):
        lines = []
        for i in range(60):
            lines.append(f"def func_{f}_{i % 7}(x, y):\n    return x * {i % 5} + y  # café\n\n")
        (root / f"mod_{f}.py").write_text("".join(lines))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("train")
    corpus = root / "corpus"
    corpus.mkdir()
    _write_corpus(corpus)
    cfg = TrainConfig(steps=40, seq_len=64, batch_size=4, lr=3e-3, warmup_steps=5, seed=0,
                      ckpt_dir=str(root / "ckpt-target"), log_every=20)
    target_summary = train_target(root / "target", cfg, corpus=str(corpus), vocab_size=400,
                                  model_kwargs=TINY_TARGET)
    dcfg = TrainConfig(steps=8, seq_len=64, batch_size=4, lr=3e-3, warmup_steps=2, seed=0,
                       ckpt_dir=str(root / "ckpt-draft"), log_every=4)
    draft_summary = train_draft(root / "target", root / "draft", dcfg, corpus=str(corpus),
                                model_kwargs=TINY_DRAFT)
    return root, corpus, target_summary, draft_summary


def test_target_loss_falls_and_exports_loadable_hf_model(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, _, summary, _ = trained
    assert summary["last_train_loss"] < summary["first_train_loss"] - 1.0
    model = AutoModelForCausalLM.from_pretrained(root / "target")
    tok = AutoTokenizer.from_pretrained(root / "target")
    assert model.config.num_key_value_heads == 2
    assert next(model.parameters()).dtype == torch.bfloat16
    text = "def func_1_2(x, y):\n    return x * 3 + y  # café\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text  # byte-level BPE round-trips exactly
    assert tok.eos_token == "<|endoftext|>" and model.generation_config.eos_token_id == tok.eos_token_id
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert (root / "target" / "model.safetensors").exists()
    assert (root / "target" / "chat_template.jinja").exists()
    out = model.generate(torch.tensor([ids[:8]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 12)


def test_draft_is_distilled_and_shares_the_tokenizer(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, _, _, summary = trained
    draft = AutoModelForCausalLM.from_pretrained(root / "draft")
    target = AutoModelForCausalLM.from_pretrained(root / "target")
    assert draft.config.vocab_size == target.config.vocab_size
    assert draft.config.num_hidden_layers == 1
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (root / "draft" / name).read_bytes() == (root / "target" / name).read_bytes()
    assert AutoTokenizer.from_pretrained(root / "draft").eos_token_id == target.config.eos_token_id
    assert summary["embedding_init"] == "projected"
    assert summary["last_train_loss"] < summary["first_train_loss"]
    assert 0.0 <= (summary["heldout_greedy_agreement"] or 0.0) <= 1.0
    saved = json.loads((root / "draft" / "train_summary.json").read_text())
    assert saved["kind"] == "draft"


def test_checkpoint_resumes_at_saved_step(trained):
    root, corpus, summary, _ = trained
    cfg = TrainConfig(steps=42, seq_len=64, batch_size=4, lr=3e-3, warmup_steps=5, seed=0,
                      ckpt_dir=str(root / "ckpt-target"), log_every=20)
    resumed = train_target(root / "target2", cfg, corpus=str(corpus), vocab_size=400,
                           model_kwargs=TINY_TARGET)
    assert resumed["steps"] == 42 and resumed["tokens_seen"] == summary["tokens_seen"] + 2 * 4 * 64


def test_corpus_split_is_deterministic_and_prompts_cut_at_lines(trained):
    _, corpus, _, _ = trained
    a, b = load_corpus(corpus), load_corpus(corpus)
    assert a.files == b.files and a.split_files("train") == b.split_files("train")
    stdlib = load_corpus()
    assert not any("site-packages" in p.parts or "test" in p.parts for p in stdlib.files[:200])
    held = stdlib.split_files("heldout")
    assert 0 < len(held) < 0.05 * len(stdlib.files)
    prompts = heldout_prompts(stdlib, num_prompts=8)
    assert len(prompts) == 8 and all(p.endswith("\n") and len(p) <= 200 for p in prompts)


def test_cli_parses_target_and_draft():
    import argparse

    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "target", "--out", "x", "--max-minutes", "1", "--threads", "2"])
    assert args.train_kind == "target" and args.max_minutes == 1.0 and args.seq_len == 512
    args = parser.parse_args(["train", "draft", "--target", "t", "--out", "d", "--loss", "tvd"])
    assert args.train_kind == "draft" and args.num_layers == 1 and args.loss == "tvd"
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "draft", "--out", "d"])  # --target is required
