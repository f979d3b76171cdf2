"""Weight-only quantization (`quantization: int8 | int4`): the packed kernels compute the dequantized weights'
product, a Q4_1-style group (codes spanning 0..15) is recovered exactly, and speculation stays exact with respect to
the quantized target (fp32 activations): speculative greedy output equals plain greedy output of the same quantized
model. (The law test at T = 1 on an int4 target is in test_distribution.py.)"""

import pytest
import torch
from torch import nn

from specserve.config.schema import EngineConfig
from specserve.engine.model.quantize import Int4Linear, Int8Linear, PackedLinear, int4_codes, quantize_linears
from specserve.engine.sampling_params import SamplingParams
from tests.engine.helpers import make_core, run
from tests.engine.test_greedy_exactness import PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _linear(n=64, k=96, seed=0, bias=True):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    return lin


def test_int8_linear_is_the_dequantized_product():
    lin = _linear()
    q = Int8Linear(lin, torch.float32)
    w = q.qweight.float() * q.scales[:, None]
    x = torch.randn(5, 96)
    assert torch.allclose(q(x), x @ w.T + lin.bias, atol=1e-4)
    assert (w - lin.weight).abs().max() <= lin.weight.abs().max() / 127  # half a step at most, per channel
    assert q(torch.randn(2, 3, 96)).shape == (2, 3, 64)


def test_int4_linear_is_the_dequantized_product():
    lin = _linear()
    q = Int4Linear(lin, torch.float32)
    codes, scales, low = int4_codes(lin.weight)
    w = (codes.view(64, 3, 32).float() * scales[..., None] + low[..., None]).view(64, 96)
    x = torch.randn(5, 96)
    assert torch.allclose(q(x), x @ w.T + lin.bias, atol=1e-2 * (x @ w.T).abs().max().item())
    assert q(torch.randn(2, 3, 96)).shape == (2, 3, 64)


def test_a_q4_1_group_is_recovered_exactly():
    """Q4_1 blocks (llama.cpp: d = (max - min) / 15, so the codes span 0..15): the same codes, scales and minima."""
    torch.manual_seed(1)
    codes = torch.randint(0, 16, (16, 64), dtype=torch.int32)
    codes[:, ::32] = 0
    codes[:, 1::32] = 15
    d = torch.rand(16, 2) * 0.01 + 1e-3
    m = -torch.rand(16, 2) * 0.1
    w = codes.view(16, 2, 32).float() * d[..., None] + m[..., None]
    got, scales, low = int4_codes(w.view(16, 64))
    assert torch.equal(got, codes) and torch.allclose(scales, d, rtol=1e-5) and torch.equal(low, m)


def test_quantize_linears_keeps_the_head_and_refuses_unknown_modes():
    model = nn.Sequential()
    model.add_module("proj", _linear())
    model.add_module("lm_head", _linear())
    assert quantize_linears(model, "int8", torch.float32) == 1
    assert isinstance(model.proj, Int8Linear) and type(model.lm_head) is nn.Linear
    with pytest.raises(ValueError, match="quantization"):
        quantize_linears(model, "int3", torch.float32)


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_a_dense_copy_runs_forwards_from_its_row_count_and_matches_the_kernel(cls):
    lin = _linear()
    q = cls(lin, torch.float32)
    q.keep_dense(4, torch.float32)
    narrow, wide = torch.randn(3, 96), torch.randn(2, 2, 96)  # 3 rows: the kernel; 4 rows: the dense copy
    assert torch.equal(q(narrow), q._mm(narrow) + lin.bias)
    assert torch.equal(q(wide), (wide.view(4, 96) @ q.dense_weight.T + lin.bias).view(2, 2, 64))
    assert torch.allclose(q._mm(wide.view(4, 96)), wide.view(4, 96) @ q.dense_weight.T, atol=1e-5)  # same weights


def test_quantize_linears_keeps_dense_copies_only_when_asked():
    for rows, dense in ((0, False), (8, True)):
        model = nn.Sequential()
        model.add_module("proj", _linear())
        quantize_linears(model, "int4", torch.float32, dense_from_rows=rows)
        assert hasattr(model.proj, "dense_weight") == dense and "_codes" not in vars(model.proj)
    with pytest.raises(ValueError, match="quantization_dense_rows"):
        EngineConfig(quantization="int4", quantization_dense_rows=-1)


def test_config_names_the_field():
    assert EngineConfig().quantization == "auto" and EngineConfig(quantization=None).quantization is None
    assert EngineConfig(quantization="INT4").quantization == "int4"
    assert EngineConfig(quantization="none").quantization is None
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="fp8")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_speculation_is_exact_on_the_quantized_target(tiny, mode):
    plain = make_core(tiny["llama"], quantization=mode)
    assert any(isinstance(m, (Int8Linear, Int4Linear)) for m in plain.target.model.modules())
    expected = [o.output_token_ids for o in run(plain, PROMPTS, GREEDY)]
    unquantized = [o.output_token_ids for o in run(make_core(tiny["llama"]), PROMPTS, GREEDY)]
    assert expected != unquantized  # the quantized model is a different model (a test that could not fail otherwise)
    for kw in (dict(draft=tiny["llama_draft"], k=3), dict(speculative_method="ngram", k=4)):
        core = make_core(tiny["llama"], quantization=mode, **kw)
        if "draft" in kw:  # the draft model follows the target's quantization
            assert any(isinstance(m, PackedLinear) for m in core.proposers["draft"].model.modules())
        outs = run(core, PROMPTS, GREEDY, join_after=2, join_from=5)
        assert [o.output_token_ids for o in outs] == expected
        assert sum(o.speculation.num_draft_tokens for o in outs) > 0
    # wide forwards (verify rows, batched prefill) on the dense copy: the same weights, fp32 rounding apart
    outs = run(make_core(tiny["llama"], quantization=mode, quantization_dense_rows=3, speculative_method="ngram", k=4),
               PROMPTS, GREEDY, join_after=2, join_from=5)
    assert [o.output_token_ids for o in outs] == expected


def test_eagle3_drafter_follows_the_quantization_and_stays_exact(tiny, tmp_path):
    from specserve.engine.spec_decode.eagle3.model import save_drafter
    from tests.engine.test_eagle3 import random_drafter

    drafter = save_drafter(random_drafter(tiny["llama"], [1, 1, 1]), tmp_path / "eagle3")
    expected = [o.output_token_ids for o in run(make_core(tiny["llama"], quantization="int8"), PROMPTS, GREEDY)]
    core = make_core(tiny["llama"], quantization="int8", speculative_method="eagle3", k=3, draft=drafter)
    assert any(isinstance(m, PackedLinear) for m in core.proposers["eagle3"].drafter.modules())
    outs = run(core, PROMPTS, GREEDY, join_after=2, join_from=5)
    assert [o.output_token_ids for o in outs] == expected
    assert sum(o.speculation.num_draft_tokens for o in outs) > 0
