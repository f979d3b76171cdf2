"""num_speculative_tokens "auto" in the engine: output unchanged (fp32 greedy), k falls where speculation cannot pay
(a random draft: almost everything rejected) and stays up where it does (n-gram lookups on looping output).

The policy tests run on modelled costs (tests/engine/helpers.py ModelCosts, injected as the engine's cost source),
so what they decide does not depend on this machine's speed or load; one test keeps the real timings (slow tier)
and asserts only what holds on any machine."""

import pytest

from specserve.config.schema import EngineConfig
from specserve.engine.sampling_params import SamplingParams
from tests.engine.helpers import ModelCosts, make_core, run
from tests.engine.test_greedy_exactness import PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
# a step of the tiny target: 20 ms + 0.4 ms per token; a draft position 4 ms (a real draft model's order of cost)
COSTS = {"base": 0.020, "per_token": 0.0004, "draft": {"draft": 0.004, "ngram": 0.0}}


@pytest.fixture(scope="module")
def baseline(tiny):
    return [o.output_token_ids for o in run(make_core(tiny["llama"]), PROMPTS, GREEDY)]


def _chosen(core):
    """Spy: the number of tokens each drafting row proposed, per step."""
    ks = []
    step = core.step

    def spy():
        outs = step()
        ks.extend(core.last_step.speculative_tokens_chosen)
        return outs
    core.step = spy
    return ks


def test_auto_with_a_draft_that_does_not_pay_backs_off_and_keeps_the_output(tiny, baseline):
    fixed = make_core(tiny["llama"], tiny["llama_draft"], k=4)
    fixed_outs = run(fixed, PROMPTS, GREEDY)
    auto = make_core(tiny["llama"], tiny["llama_draft"], k="auto", max_speculative_tokens=4,
                     cost_source=ModelCosts(**COSTS))
    assert auto.builder.adaptive_methods == {"draft"}
    outs = run(auto, PROMPTS, GREEDY, join_after=3, join_from=6)
    assert [o.output_token_ids for o in outs] == baseline
    drafted = sum(o.speculation.num_draft_tokens for o in outs)
    # the k auto chose, per response: decode steps without drafts (k = 0) as well as the drafting ones
    assert all(sum(k * n for k, n in o.speculation.steps_by_k.items()) == o.speculation.num_draft_tokens for o in outs)
    assert sum(o.speculation.steps_by_k.get(0, 0) for o in outs) > len(outs)  # more than the first-token steps
    fixed_drafted = sum(o.speculation.num_draft_tokens for o in fixed_outs)
    assert 0 < drafted < 0.5 * fixed_drafted  # it tried, measured, and backed off (probes keep it above 0)


def test_auto_keeps_speculating_where_it_pays(tiny, baseline):
    """Looping random models: lookups are mostly right and cost nothing, so auto keeps (nearly) all of what a fixed
    k gains."""
    fixed = run(make_core(tiny["llama"], speculative_method="ngram", k=6), PROMPTS, GREEDY)
    runs = []
    for _ in range(2):
        core = make_core(tiny["llama"], speculative_method="ngram", k="auto", max_speculative_tokens=6,
                         cost_source=ModelCosts(**COSTS))
        chosen = _chosen(core)
        outs = run(core, PROMPTS, GREEDY, join_after=2, join_from=5)
        runs.append(chosen)
        assert [o.output_token_ids for o in outs] == baseline
        accepted = sum(o.speculation.num_accepted_tokens for o in outs)
        assert accepted >= 0.9 * sum(o.speculation.num_accepted_tokens for o in fixed) and accepted >= 60
        # a slot costs 2% of a step here, and lookups on looping output are mostly right: it proposes what the
        # lookups find (up to 4 tokens on these prompts, as a fixed k = 6 does) and keeps nearly all it accepts
        assert max(chosen) >= 4
        planned = core.controller.report()["accepted_prediction"]["ngram"]  # what auto expected of its drafts
        assert planned["steps"] > 0 and 0 < planned["accepted"] <= accepted and planned["expected"] > 0
    assert runs[0] == runs[1]  # on modelled costs the policy is deterministic


@pytest.mark.slow  # the engine's own timings: only what holds on any machine, busy or idle
def test_auto_on_measured_costs_keeps_the_output_and_speculates(tiny, baseline):
    core = make_core(tiny["llama"], speculative_method="ngram", k="auto", max_speculative_tokens=6)
    outs = run(core, PROMPTS, GREEDY, join_after=2, join_from=5)
    assert [o.output_token_ids for o in outs] == baseline
    assert sum(o.speculation.num_accepted_tokens for o in outs) > 0
    report = core.controller.report()
    assert report["step_prediction"]["steps"] > 0 and "ngram" in report["proposer_seconds"]


def test_an_explicit_k_is_kept_and_auto_parses_everywhere(tiny):
    core = make_core(tiny["llama"], tiny["llama_draft"], k="auto", max_speculative_tokens=3)
    req = core.make_request("a", "hi", SamplingParams(num_speculative_tokens=2))
    assert not req.adaptive and req.num_speculative_tokens == 2
    req = core.make_request("b", "hi", SamplingParams())
    assert req.adaptive and req.num_speculative_tokens == 3
    assert EngineConfig(num_speculative_tokens="AUTO").num_speculative_tokens == "auto"
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens="many")
    cfg = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": "auto"}',
                       max_speculative_tokens=5)
    assert cfg.speculative_methods[0].adaptive and cfg.speculative_methods[0].k_max == 5
