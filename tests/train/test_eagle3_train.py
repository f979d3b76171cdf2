"""`specserve train eagle3` on a tiny target: the training-time-test loss falls, the held-out agreement beats the
untrained drafter's, and the exported drafter (speculators format) runs in the engine, greedy-exact."""

import random

import pytest
import torch

from specserve.engine.sampling_params import SamplingParams
from specserve.train.answers import Answer, AnswerCorpus
from specserve.train.eagle3 import TTTBatch, make_batch, unroll
from specserve.train.loop import TrainConfig
from tests.engine.helpers import make_core, run
from tests.tiny_models import save_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_eagle3_training_learns_and_exports_a_drafter_the_engine_runs(tiny, tmp_path):
    from specserve.train.eagle3 import train_eagle3

    target = save_llama(tmp_path / "t6", tiny["llama"], tiny["vocab"], layers=6, seed=7)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, tiny["vocab"]) for _ in range(rng.randrange(3, 9))] for _ in range(96)]
    outs = run(make_core(target), prompts, GREEDY)
    AnswerCorpus(tmp_path / "corpus").append([Answer(p, o.output_token_ids, 0, 0.0, False)
                                              for p, o in zip(prompts, outs)])
    cfg = TrainConfig(steps=80, lr=3e-3, warmup_steps=5, max_minutes=3, ckpt_dir=str(tmp_path / "ckpt"),
                      log_every=1000, seed=0)
    summary = train_eagle3(str(target), tmp_path / "corpus", tmp_path / "out", cfg, ttt_steps=3, draft_vocab=128,
                           batch_tokens=512)
    before, after = summary["heldout_before"], summary["heldout_trained"]
    assert len(after["top1_by_step"]) == 3
    assert after["top1_by_step"][0] > before["top1_by_step"][0] + 0.1, (before, after)
    assert after["tau"] > before["tau"]
    assert summary["last_train_loss"] < summary["first_train_loss"]
    plain = [o.output_token_ids for o in run(make_core(target), prompts[:6], GREEDY)]
    core = make_core(target, speculative_method="eagle3", k=3, draft=tmp_path / "out")
    spec = run(core, prompts[:6], GREEDY)
    assert [o.output_token_ids for o in spec] == plain
    assert sum(o.speculation.num_accepted_tokens for o in spec) > 0
    # continuing from the export starts where it ended (same held-out report) and keeps its draft vocabulary
    again = TrainConfig(steps=3, lr=1e-4, warmup_steps=1, max_minutes=3, ckpt_dir=str(tmp_path / "ckpt2"),
                        log_every=1000, seed=1)
    resumed = train_eagle3(str(target), tmp_path / "corpus", tmp_path / "out2", again, ttt_steps=3,
                           batch_tokens=512, init_drafter=str(tmp_path / "out"), curve_every=200)
    assert resumed["heldout_before"]["tau"] == pytest.approx(after["tau"], abs=0.02)
    assert resumed["draft_vocab"] == summary["draft_vocab"]
    assert resumed["curve"] and resumed["curve"][0]["train_tokens_seen"] < 200


def test_epoch_sampler_serves_every_batch_once_per_epoch_and_reports_the_curve():
    from specserve.train.eagle3 import EpochSampler

    batches = [TTTBatch(*([None] * 6), num_tokens=n) for n in (30, 50, 70)]
    reports = iter(range(100))
    sampler = EpochSampler(batches, seed=3, report=lambda: {"tau": next(reports)}, curve_every=100)
    first = [id(sampler(step)) for step in range(3)]
    second = [id(sampler(step)) for step in range(3, 6)]
    assert sorted(first) == sorted(second) == sorted(id(b) for b in batches)
    assert sampler.epoch == 2 and sampler.tokens == 300
    # one report as each multiple of 100 is crossed, taken before the batch that crosses it
    assert [c["train_tokens_seen"] // 100 for c in sampler.curve] == [0, 1, 2]
    assert [c["tau"] for c in sampler.curve] == [0, 1, 2]


def test_training_time_test_masks(tiny, tmp_path):
    """Step k's row r sits at position r + 1 + k and is scored there; a row past the sequence is never scored."""
    from specserve.train.eagle3 import build_drafter

    target = save_llama(tmp_path / "t6", tiny["llama"], tiny["vocab"], layers=6, seed=7)
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(target)
    drafter = build_drafter(model, [2, 3, 3], torch.arange(tiny["vocab"]))
    n, h = 7, model.config.hidden_size
    record = {"prompt_ids": torch.tensor([1, 2, 3], dtype=torch.int32), "output_ids": torch.tensor([4, 5, 6, 7])}
    teacher = {"hidden": torch.randn(n, 3 * h).bfloat16(), "top_ids": torch.randint(0, tiny["vocab"], (n, 2)),
               "top_logprobs": torch.full((n, 2), -0.7).half()}
    batch: TTTBatch = make_batch([(record, teacher)], torch.arange(tiny["vocab"]))
    assert batch.scored[0].tolist() == [False, False, True, True, True, True, False]  # positions 2..5 predict answers
    steps = unroll(drafter, model.get_input_embeddings(), batch, 3)
    for k, (hidden, scored) in enumerate(steps):
        assert hidden.shape == (1, n - 1, h)
        want = [batch.scored[0, r + 1 + k].item() if r + 1 + k < n else False for r in range(n - 1)]
        assert scored[0].tolist() == want
