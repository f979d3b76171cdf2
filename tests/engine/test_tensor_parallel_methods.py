"""Every speculation method on 2 ranks (gloo, tiny Llama, fp32): one engine per size holds them all (requests pick
the method), and each method's greedy output in a batch with late arrivals equals the one-device engine's. EAGLE-3,
DFlash and Medusa read hidden states from rank 0's whole residual stream; the tree methods (Medusa, n-gram with
branches) move accepted K/V on every rank. The ranks sum partial products in another order than one device, so
logits agree to fp32 rounding; greedy identity on these prompts is what the test holds the engine to."""

import json
import multiprocessing

import pytest

from specserve.engine.sampling_params import SamplingParams
from specserve.engine.spec_decode.eagle3.model import save_drafter
from tests.engine.helpers import make_core, run
from tests.engine.test_dflash import save_random
from tests.engine.test_eagle3 import random_drafter
from tests.engine.test_greedy_exactness import PROMPTS
from tests.engine.test_medusa import TREE, random_heads

K = {"none": 0, "draft": 3, "eagle3": 3, "medusa": 6, "dflash": 3, "ngram": 6}


@pytest.fixture(scope="module")
def engines(tiny, tmp_path_factory):
    """{1: one-device engine, 2: two-rank engine}, both with every method loaded (the draft model the default)."""
    root = tmp_path_factory.mktemp("tp-methods")
    methods = [{"method": "draft", "model": str(tiny["llama_draft"]), "num_speculative_tokens": 3},
               {"method": "eagle3", "num_speculative_tokens": 3,
                "model": str(save_drafter(random_drafter(tiny["llama"], [1, 1, 1]), root / "eagle3"))},
               {"method": "medusa", "num_speculative_tokens": 6,
                "medusa_heads": str(random_heads(64).save(root / "medusa", {"medusa_choices": TREE}))},
               {"method": "dflash", "num_speculative_tokens": 3,
                "model": str(save_random(tiny["llama"], root / "dflash"))},
               {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_branches": 3}]
    cores = {tp: make_core(tiny["llama"], tensor_parallel_size=tp, speculative_config=json.dumps(methods),
                           kv_cache_memory=1 << 25) for tp in (1, 2)}
    yield cores
    cores[2].close()
    assert not multiprocessing.active_children()  # close() stopped the worker


@pytest.mark.parametrize("method", ["none", "draft", "eagle3",
                                    *(pytest.param(m, marks=pytest.mark.slow) for m in ("medusa", "dflash", "ngram"))])
def test_two_ranks_greedy_equal_one_device(engines, method):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, speculative_method=method,
                            num_speculative_tokens=K[method])
    outs = {tp: run(core, PROMPTS, params, join_after=3, join_from=6) for tp, core in engines.items()}
    assert [o.output_token_ids for o in outs[2]] == [o.output_token_ids for o in outs[1]]
    if K[method]:
        assert sum(o.speculation.num_draft_tokens for o in outs[2]) > 0
        assert all(o.speculation.method == method for o in outs[2])
