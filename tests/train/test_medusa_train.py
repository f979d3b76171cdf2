"""`specserve train medusa` smoke tests on a tiny random target: stage 1 lowers the loss and its heads beat the
untrained (zero-initialised) ones on acceptance in the engine; stage 2 writes a new target with the heads inside,
and the engine's greedy Medusa output on it equals that new target's own greedy output."""
from __future__ import annotations

import json

import pytest
import torch

from specserve.engine.sampling_params import SamplingParams
from specserve.engine.spec_decode.medusa.heads import MedusaHeads
from specserve.train.cli import add_train_parser
from specserve.train.loop import TrainConfig
from specserve.train.medusa import future_labels, train_stage1, train_stage2
from tests.engine.helpers import make_core, run

PROMPTS = [f"def f{i}(x):" for i in range(12)] + [f"The quick {w}" for w in ("fox", "dog", "café", "brown")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
CHAIN = [[0], [0, 0], [0, 0, 0]]


@pytest.fixture(scope="module")
def records(tiny):
    """The target's own greedy answers, in the selfgen set's record format."""
    core = make_core(tiny["llama"])
    outs = run(core, PROMPTS, GREEDY)
    return [{"index": i, "prompt_index": i, "prompt_ids": torch.tensor(o.prompt_token_ids, dtype=torch.int32),
             "output_ids": torch.tensor(o.output_token_ids, dtype=torch.int32)} for i, o in enumerate(outs)]


def test_future_labels_shift_by_k_plus_two():
    seq = torch.tensor([10, 11, 12, 13, 14])
    labels = future_labels(seq, n_prompt=2, width=3)  # positions 1, 2, 3; the LM head at t predicts t + 1
    assert labels.tolist() == [[13, 14, -100], [14, -100, -100], [-100, -100, -100]]


def _accepted(tiny, heads_dir) -> int:
    core = make_core(tiny["llama"], speculative_method="medusa", k=3, medusa_heads=str(heads_dir),
                     medusa_choices=json.dumps(CHAIN))
    return sum(o.speculation.num_accepted_tokens for o in run(core, PROMPTS, GREEDY))


def test_stage1_loss_falls_and_trained_heads_beat_untrained(tiny, records, tmp_path):
    cfg = TrainConfig(steps=150, batch_size=128, lr=1e-2, warmup_steps=10, ckpt_dir=str(tmp_path / "ckpt"),
                      log_every=50, threads=1)
    report = train_stage1(str(tiny["llama"]), records, tmp_path / "heads", cfg, num_heads=3, choose=False)
    assert report["last_train_loss"] < 0.7 * report["first_train_loss"]
    MedusaHeads(3, 1, 64).save(tmp_path / "zero")
    trained, untrained = _accepted(tiny, tmp_path / "heads"), _accepted(tiny, tmp_path / "zero")
    assert trained > untrained
    # resumable: a second run with more steps starts from the checkpoint, not from step 0
    cfg.steps = 160
    again = train_stage1(str(tiny["llama"]), records, tmp_path / "heads", cfg, num_heads=3, choose=False)
    assert again["steps"] == 160
    # continuing from exported heads starts at their accuracy
    cont = train_stage1(str(tiny["llama"]), records, tmp_path / "heads2", TrainConfig(
        steps=1, batch_size=128, lr=1e-9, warmup_steps=1, ckpt_dir=str(tmp_path / "ckpt2"), threads=1),
        num_heads=3, choose=False, init_heads=str(tmp_path / "heads"))
    assert cont["top1_accuracy_untrained"] == again["top1_accuracy"]


def test_stage2_writes_a_new_target_that_carries_its_heads(tiny, records, tmp_path):
    cfg = TrainConfig(steps=3, batch_size=4, lr=1e-3, warmup_steps=1, ckpt_dir=str(tmp_path / "ckpt"), threads=1)
    out = tmp_path / "target2"
    summary = train_stage2(str(tiny["llama"]), records, out, cfg, num_heads=2, warmup_steps=2)
    assert set(summary["phases"]) == {"warmup", "joint"} and summary["phases"]["joint"]["steps"] == 3
    assert (out / "config.json").exists() and (out / "medusa_config.json").exists()
    plain = [o.output_token_ids for o in run(make_core(out), PROMPTS[:4], GREEDY)]
    medusa = make_core(out, speculative_method="medusa", k=4)  # heads found in the model directory
    outs = run(medusa, PROMPTS[:4], GREEDY)
    assert [o.output_token_ids for o in outs] == plain
    assert sum(o.speculation.num_draft_tokens for o in outs) > 0


def test_cli_parses_medusa():
    import argparse

    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "medusa", "--model", "m", "--data", "d", "--out", "o", "--stage", "2",
                              "--medusa-num-heads", "5"])
    assert (args.train_kind, args.stage, args.medusa_num_heads, args.target) == ("medusa", 2, 5, "m")
