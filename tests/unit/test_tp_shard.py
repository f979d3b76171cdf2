"""How the target splits over tensor-parallel ranks: head ranges (each query head keeps its own K/V head), feature
runs, the model's plan, and that the slices of a layer pair sum back to the whole layer pair."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from specserve.engine.errors import InvalidRequestError
from specserve.engine.parallel.shard import HeadRange, even_split, head_ranges, local_kv_heads, shard_model, sharding_plan


def test_even_split_keeps_whole_units_and_covers_everything():
    assert even_split(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert even_split(1536, 2, 32) == [(0, 768), (768, 1536)]
    assert even_split(96, 2, 32) == [(0, 64), (64, 96)]  # 3 groups: 2 + 1
    assert even_split(50, 2, 32) == [(0, 25), (25, 50)]  # not whole groups: single features


@pytest.mark.parametrize("heads,kv,world,expected", [
    (4, 2, 2, [HeadRange(0, 2, 0, 1), HeadRange(2, 4, 1, 2)]),
    (9, 3, 2, [HeadRange(0, 6, 0, 2), HeadRange(6, 9, 2, 3)]),  # SmolLM2-135M: uneven, whole K/V groups
    (8, 8, 4, [HeadRange(2 * r, 2 * r + 2, 2 * r, 2 * r + 2) for r in range(4)]),
    (4, 1, 2, [HeadRange(0, 2, 0, 1), HeadRange(2, 4, 0, 1)]),  # one K/V head, replicated
    (8, 2, 4, [HeadRange(0, 2, 0, 1), HeadRange(2, 4, 0, 1), HeadRange(4, 6, 1, 2), HeadRange(6, 8, 1, 2)]),
])
def test_head_ranges_keep_each_query_head_with_its_kv_head(heads, kv, world, expected):
    ranges = head_ranges(heads, kv, world)
    assert ranges == expected
    group = heads // kv
    for r in ranges:  # the local uniform mapping (local q // local group) equals the global one (q // group)
        local_group = (r.q_end - r.q_start) // (r.kv_end - r.kv_start)
        for i, q in enumerate(range(r.q_start, r.q_end)):
            assert r.kv_start + i // local_group == q // group


@pytest.mark.parametrize("heads,kv,world", [(4, 1, 3), (2, 1, 4), (6, 4, 2)])
def test_impossible_head_splits_are_refused_naming_the_field(heads, kv, world):
    with pytest.raises(InvalidRequestError) as err:
        head_ranges(heads, kv, world)
    assert err.value.param == "tensor_parallel_size" and str(err.value).startswith("tensor_parallel_size:")


def test_models_without_a_plan_are_refused(tiny):
    gpt2 = AutoModelForCausalLM.from_pretrained(tiny["gpt2"])
    with pytest.raises(InvalidRequestError, match="no tensor-parallel plan"):
        sharding_plan(gpt2)


def _pair_output(model, x):
    return model.model.layers[0].mlp(x)


@torch.no_grad()
def test_slices_sum_to_the_whole_mlp_and_attention_projections(tiny):
    """Two ranks' MLPs (colwise gate/up, rowwise down) add up to the full MLP; q/k/v keep their heads' rows."""
    full = AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float64).eval()
    ranks = [AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float64).eval() for _ in range(2)]
    rowwise = [shard_model(m, r, 2) for r, m in enumerate(ranks)]
    assert rowwise[0] == [n for n in sharding_plan(full) if n.endswith(("o_proj", "down_proj"))]
    x = torch.randn(3, full.config.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(sum(_pair_output(m, x) for m in ranks), _pair_output(full, x))
    attn = [m.model.layers[1].self_attn for m in ranks]
    whole = full.model.layers[1].self_attn
    head_dim = whole.head_dim
    assert torch.equal(torch.cat([a.q_proj.weight for a in attn]), whole.q_proj.weight)
    assert torch.equal(torch.cat([a.k_proj.weight for a in attn]), whole.k_proj.weight)
    assert attn[1].k_proj.weight.shape[0] == head_dim  # 2 K/V heads: one each
    assert torch.equal(torch.cat([a.o_proj.weight for a in attn], dim=1), whole.o_proj.weight)
    assert local_kv_heads(full.config, 2) == [1, 1]


@torch.no_grad()
def test_rowwise_bias_is_added_once():
    from specserve.engine.parallel.shard import _keep_columns

    torch.manual_seed(0)
    whole = nn.Linear(8, 4).double()
    parts = [nn.Linear(8, 4).double() for _ in range(2)]
    for r, part in enumerate(parts):
        part.load_state_dict(whole.state_dict())
        _keep_columns(part, 4 * r, 4 * r + 4, keep_bias=r == 0)
    assert parts[1].bias is None and parts[1].in_features == 4
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(parts[0](x[:, :4]) + parts[1](x[:, 4:]), whole(x))
