"""`enable_torch_compile`: the target's forward through torch.compile. Greedy output of a compiled engine equals the
eager engine's on a tiny fp32 model, speculation on the compiled target stays exact, steps that compiled are kept out
of adaptive k's cost fit, and without a C++ compiler the engine runs eager."""

import logging

import pytest

from specserve.engine.core import EngineCore
from specserve.engine.model import compile as compile_mod
from specserve.engine.sampling_params import SamplingParams
from tests.engine.helpers import make_core, run
from tests.engine.test_greedy_exactness import PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.skipif(compile_mod.cxx_compiler() is None, reason="TorchInductor needs a C++ compiler on CPU")
def test_compiled_engine_is_exact_and_its_compiling_steps_are_not_costs(tiny, monkeypatch):
    expected = [o.output_token_ids for o in run(make_core(tiny["llama"]), PROMPTS[:3], GREEDY)]
    monkeypatch.setattr(EngineCore, "_warm_up", lambda self: None)  # compile during the run, as cost samples would
    core = make_core(tiny["llama"], speculative_method="ngram", k=4, enable_torch_compile=True)
    assert core.compiled
    forwards, observed = [], []  # per forward: did it compile a graph; the steps the cost fit saw
    target_forward, observe = core._target_forward, core.controller.observe_forward

    def spy_forward(*a, **kw):
        before = compile_mod.compilations()
        out = target_forward(*a, **kw)
        forwards.append(compile_mod.compilations() > before)
        return out

    core._target_forward = spy_forward
    core.controller.observe_forward = lambda *a, **kw: (observed.append(a), observe(*a, **kw))
    outs = run(core, PROMPTS[:3], GREEDY, join_after=2, join_from=2)
    assert [o.output_token_ids for o in outs] == expected
    assert sum(o.speculation.num_draft_tokens for o in outs) > 0
    assert any(forwards)  # it compiled (a test that could not fail otherwise) ...
    assert len(observed) == forwards.count(False) > 0  # ... and only the steps that did not are cost samples


@pytest.mark.slow
@pytest.mark.skipif(compile_mod.cxx_compiler() is None, reason="TorchInductor needs a C++ compiler on CPU")
def test_a_compiled_engine_warms_up_before_serving_and_forgets_it(tiny):
    core = make_core(tiny["llama"], enable_torch_compile=True)
    assert core.compiled and not core.has_unfinished() and not core.requests
    assert core.totals.num_generation_tokens == 0  # the warm-up's tokens are not in the metrics
    before = compile_mod.compilations()
    run(core, PROMPTS[:1], GREEDY)
    assert compile_mod.compilations() == before  # one stream decoding: a shape the warm-up compiled
    # every other batch composition too (the metadata is padded so that no size is 1 and both query groups are
    # there): several prompts at once, and prompts arriving while others decode
    long = [p * 6 for p in PROMPTS[:4]]  # prefill chunks beyond the short query group
    for prompts, join in ((PROMPTS[:2], None), (PROMPTS[2:5] + long[:1], None), (long[1:3] + PROMPTS[5:7], 3),
                          (PROMPTS[7:], 2), (long[3:], None)):
        run(core, prompts, GREEDY, join_after=join)
    assert compile_mod.compilations() == before


def test_without_a_cxx_compiler_the_engine_runs_eager(tiny, monkeypatch, caplog):
    monkeypatch.setattr(compile_mod, "cxx_compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger=compile_mod.__name__):
        core = make_core(tiny["llama"], enable_torch_compile=True)
    assert not core.compiled
    assert "no C++ compiler" in caplog.text
    assert [o.output_token_ids for o in run(core, PROMPTS[:1], GREEDY)] == \
        [o.output_token_ids for o in run(make_core(tiny["llama"]), PROMPTS[:1], GREEDY)]
