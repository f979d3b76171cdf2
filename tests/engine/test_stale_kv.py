"""Masked key slots never reach an output: NaN written into every free uncached block (stale slots a later request
reuses) leaves the next requests' greedy tokens unchanged, and the null block that padding reads is never written."""

import pytest
import torch

from specserve.engine.sampling_params import SamplingParams
from tests.engine.helpers import make_core, run
from tests.tiny_families import prompts, save_family

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sinks_model(tmp_path_factory):
    return save_family("gpt_oss", tmp_path_factory.mktemp("stale"))  # windows + sinks: the manual attention path


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_nan_in_freed_blocks_does_not_change_the_next_requests(tiny, sinks_model, arch):
    path, draft = (tiny["llama"], tiny["llama_draft"]) if arch == "llama" else (sinks_model, sinks_model)
    ids = prompts(seed=1) + prompts(seed=2)  # uneven lengths: block-table padding in every batch
    core = make_core(path, draft, k=3, block_size=4, max_num_batched_tokens=16)
    first = [o.output_token_ids for o in run(core, ids, GREEDY)]
    assert core.allocator.usage == 0.0
    pools = [core.target.kv, core.proposer.runner.kv]
    stale = sorted(set(range(core.allocator.num_blocks)) - core.allocator.cached_blocks)
    assert len(stale) > core.allocator.num_blocks // 2
    for kv in pools:  # every block is free now: poison all that the prefix cache does not hold (those are read
        for t in kv.key + kv.value:  # again, by design), key and value, every layer
            t[stale] = float("nan")
    second = [o.output_token_ids for o in run(core, ids, GREEDY, join_after=2)]
    assert second == first
    for kv in pools:  # the null block stays zero: nothing ever writes it
        for t in kv.key_store + kv.value_store:
            assert torch.equal(t[kv.null_block], torch.zeros_like(t[kv.null_block]))
