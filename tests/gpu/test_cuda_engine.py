"""GPU checks (skipped without CUDA): greedy exactness and KV release on the device."""

import pytest
import torch

from specserve.engine.sampling_params import SamplingParams
from tests.engine.helpers import make_core, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["The quick brown fox", "def main():", "café", "Speculative decoding proposes tokens"]


@pytest.mark.parametrize("k", [1, 4])
def test_cuda_greedy_spec_identical(tiny, k):
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    base = run(make_core(tiny["llama"], device="cuda"), PROMPTS, greedy)
    core = make_core(tiny["llama"], tiny["llama_draft"], k=k, device="cuda")
    spec = run(core, PROMPTS, greedy, join_after=2)
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in base]
    assert core.allocator.usage == 0.0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_two_ranks_greedy_equal_one_gpu(tiny):
    """Tensor parallelism on 2 GPUs (NCCL for the all-reduces, gloo for rank 0's commands), fp32."""
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    base = run(make_core(tiny["llama"], device="cuda"), PROMPTS, greedy)
    core = make_core(tiny["llama"], tiny["llama_draft"], k=3, device="cuda", tensor_parallel_size=2)
    try:
        spec = run(core, PROMPTS, greedy, join_after=2)
    finally:
        core.close()
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in base]
