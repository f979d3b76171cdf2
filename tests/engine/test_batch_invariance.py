"""No batch-mate changes a row: one request's logprobs alone and in a crowd — a prompt longer than the native query
limit (fast_layers.NATIVE_QUERY) and other requests arriving while it decodes — are equal to the bit, on the CPU
kernels at every level this machine executes, for both CPU defaults (int4 with fp32 activations where bf16 is not
native, int4 in bf16 where it is). Greedy identity alone could hold by luck of margins; logprobs show any rounding."""

from pathlib import Path

import pytest
import torch

from specserve.engine.model import fast_layers
from specserve.engine.model.cpu_kernels import build
from specserve.engine.model.quantize import Q8Head
from specserve.engine.sampling_params import SamplingParams
from tests.engine.helpers import drive, make_core
from tests.tiny_models import save_llama

pytestmark = pytest.mark.skipif(build.load() is None, reason="no C compiler to build the CPU kernels")
PROBE = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=5)
OTHERS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny, tmp_path_factory):
    """Heads of 64 (the kernels' vector attention), room for prompts past NATIVE_QUERY, and an output head of exact
    8-bit groups, as a GGUF's Q8_0 head is (the demo's: it stays 8-bit on the kernels, Q8Head)."""
    from transformers import AutoModelForCausalLM

    path = save_llama(tmp_path_factory.mktemp("invariance") / "llama", Path(tiny["llama"]).parent / "tok",
                      tiny["vocab"], hidden=256, heads=4, kv_heads=2, seed=3, max_len=1024)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    head = model.lm_head.weight
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(-127, 128, head.shape, generator=g).float().view(head.shape[0], -1, 32)
    codes[..., 0] = 127  # each group's largest code, as Q8_0's scale makes it
    scales = (torch.rand(head.shape[0], head.shape[1] // 32, 1, generator=g) * 2e-3).half().float()
    with torch.no_grad():
        head.copy_((codes * scales).view_as(head))
    model.save_pretrained(path)
    return path


def logprobs(out) -> list:
    return [(t.token_id, t.logprob, t.top) for t in out.logprobs]


def crowd(core, probe, long_prompt: list[int]) -> list:
    """the probe from step 0; the long prompt at step 3, short prompts at steps 4 and 6 -> the outputs"""
    return drive(core, [(0, probe, PROBE), (3, long_prompt, OTHERS), (4, "def main():", OTHERS),
                        (6, "verifies them", OTHERS)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_rows_logprobs_do_not_depend_on_its_batch_mates(model, kernel_level, dtype):
    core = make_core(model, quantization="int4", dtype=dtype, kv_cache_memory=1 << 26)
    assert core.target.kernels is not None and core.scheduler.max_prefill_chunk == fast_layers.NATIVE_QUERY
    assert isinstance(core.target.model.get_output_embeddings(), Q8Head)
    long_prompt = torch.randint(1, 200, (fast_layers.NATIVE_QUERY + 150,),
                                generator=torch.Generator().manual_seed(1)).tolist()
    alone = drive(core, [(0, "The quick brown fox", PROBE)])[0]
    crowded = crowd(core, "The quick brown fox", long_prompt)
    assert logprobs(crowded[0]) == logprobs(alone)
    assert len(crowded[1].prompt_token_ids) > fast_layers.NATIVE_QUERY and len(crowded[1].output_token_ids) == 6


def test_without_the_chunk_limit_a_long_prompt_changes_its_batch_mates_rounding(model, monkeypatch):
    """The test above can fail: a 400-token chunk sends its whole forward, the probe's decode row included, down the
    op-by-op path, and the probe's logprobs move in their last bits."""
    core = make_core(model, quantization="int4", kv_cache_memory=1 << 26)
    long_prompt = torch.randint(1, 200, (fast_layers.NATIVE_QUERY + 150,),
                                generator=torch.Generator().manual_seed(1)).tolist()
    alone = drive(core, [(0, "The quick brown fox", PROBE)])[0]
    core.scheduler.max_prefill_chunk = core.scheduler.max_num_batched_tokens
    crowded = crowd(core, "The quick brown fox", long_prompt)
    assert crowded[0].output_token_ids == alone.output_token_ids  # the same tokens, by margins
    assert logprobs(crowded[0]) != logprobs(alone)
