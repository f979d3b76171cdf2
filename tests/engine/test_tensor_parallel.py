"""Tensor parallelism on CPU: 2 ranks over gloo (a worker process beside this one), tiny models, fp32.

Greedy output equals the one-device engine's int4-quantized (split before packing) and through prefix-cache hits
(every method: test_tensor_parallel_methods.py); sampled output keeps the target's law; start-up errors on a worker come back with the rank
named, and refusals leave no worker behind. A killed rank is tested on a real server (tests/api/test_tp_server.py).
The two ranks sum partial products in a different order than one device does, so the logits agree to fp32 rounding,
not bit for bit; greedy identity on these prompts is what the tests hold the engine to."""

import logging
import multiprocessing
import time
from datetime import timedelta

import pytest
import torch

from specserve.engine.parallel.group import TensorParallelGroup, WorkerSpec
from specserve.engine.sampling_params import SamplingParams
from tests.engine.helpers import drive, make_core, run
from tests.engine.test_distribution import CASES, _p_value
from tests.engine.test_distribution import pair  # noqa: F401  (fixture)
from tests.engine.test_greedy_exactness import PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _outputs(model, tp: int, **kw) -> list[list[int]]:
    core = make_core(model, tensor_parallel_size=tp, **kw)
    try:
        outs = run(core, PROMPTS, GREEDY, join_after=3, join_from=6)
        if kw.get("k"):
            assert sum(o.speculation.num_draft_tokens for o in outs) > 0
        return [o.output_token_ids for o in outs]
    finally:
        core.close()


@pytest.mark.slow
def test_prefix_cache_hits_copy_blocks_on_every_rank(tiny):
    """A whole-prompt hit recomputes its last token into a private copy of a shared block: every rank must copy
    its heads' K/V, or the workers' attention reads an empty block and the output changes."""
    prompt = list(range(5, 5 + 32))  # 8 full blocks of 4
    outputs = {}
    for tp in (1, 2):
        core = make_core(tiny["llama"], block_size=4, tensor_parallel_size=tp)
        try:
            first = drive(core, [(0, prompt, GREEDY)])
            again = drive(core, [(0, prompt, GREEDY), (0, prompt, GREEDY)])
        finally:
            core.close()
        assert [o.num_cached_tokens for o in again] == [31, 31]
        outputs[tp] = [o.output_token_ids for o in first + again]
    assert outputs[2] == outputs[1] and len(set(map(tuple, outputs[1]))) == 1


def test_a_self_draft_on_two_ranks_accepts_every_token(tiny):
    """The target as its own draft: the draft runs whole on rank 0, the target split over 2 ranks; greedy, every
    proposed token must be accepted (broken KV or proposer state under TP would show here as rejections, which
    greedy identity alone cannot see)."""
    core = make_core(tiny["llama"], draft=tiny["llama"], k=3, tensor_parallel_size=2)
    try:
        outs = run(core, PROMPTS, GREEDY, join_after=3, join_from=6)
    finally:
        core.close()
    drafted = sum(o.speculation.num_draft_tokens for o in outs)
    assert drafted > 0 and sum(o.speculation.num_accepted_tokens for o in outs) == drafted


def test_int4_target_splits_before_packing(tiny):
    """int4 groups of 32 stay whole on each rank: the split quantized model is the one-device quantized model."""
    kw = dict(k=0, quantization="int4")
    assert _outputs(tiny["llama"], 2, **kw) == _outputs(tiny["llama"], 1, **kw)


@pytest.mark.slow  # statistical law test
def test_sampled_output_keeps_the_target_law_on_two_ranks(pair):  # noqa: F811
    target, draft = pair
    assert _p_value(target, None, CASES["temperature_1"], draft=draft, k=2, tensor_parallel_size=2) > 1e-3


def test_an_idle_engine_outlives_the_groups_timeout(tiny, monkeypatch):
    """Workers wait for commands on a pipe, not in a collective: idling longer than the group's timeout (10 min in
    production, 2 s here) must not end them."""
    monkeypatch.setattr("specserve.engine.parallel.group.COLLECTIVE_TIMEOUT", timedelta(seconds=2))
    core = make_core(tiny["llama"], tensor_parallel_size=2, k=0)
    try:
        first = run(core, PROMPTS[:2], GREEDY)
        time.sleep(4)
        assert [o.output_token_ids for o in run(core, PROMPTS[:2], GREEDY)] == [o.output_token_ids for o in first]
    finally:
        core.close()


def test_a_model_without_a_plan_is_refused_and_no_worker_stays(tiny):
    with pytest.raises(ValueError, match="tensor_parallel_size: GPT2LMHeadModel has no tensor-parallel plan"):
        make_core(tiny["gpt2"], tensor_parallel_size=2)
    assert not multiprocessing.active_children()
    assert not torch.distributed.is_initialized()


def test_config_refusals_name_the_field():
    from specserve.config.schema import EngineConfig

    for kw in (dict(tensor_parallel_size=0), dict(tensor_parallel_size=2, enable_torch_compile=True),
               dict(tensor_parallel_size=2, device="cuda:1")):
        with pytest.raises(ValueError, match="^tensor_parallel_size:"):
            EngineConfig(**kw)


def test_a_worker_start_up_error_reaches_rank_0_with_the_rank_named(tmp_path):
    spec = WorkerSpec(str(tmp_path / "no-such-model"), torch.float32, "cpu", False, None, 0, world=2,
                      log_level=logging.ERROR)
    group = TensorParallelGroup(spec)
    try:
        with pytest.raises(RuntimeError, match="rank 1 failed to start: .*no-such-model"):
            group.wait_ready()
    finally:
        torch.distributed.destroy_process_group()
    assert not multiprocessing.active_children()
