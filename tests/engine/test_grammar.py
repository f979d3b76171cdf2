"""Grammar-constrained decoding, exact under speculation (engine/sample/grammar.py): greedy identity with and without
speculation under a grammar (fp32), sampled outputs under a bounded JSON Schema all validate, the law of sampled
output under a grammar with a sampled draft (chi-square; cutting the draft at its first forbidden token is the
biased control that must fail), and the matcher left as it was after masks for a partly invalid proposal."""

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from specserve.engine.errors import InvalidRequestError
from specserve.engine.sample.grammar import GrammarSpec, node_bitmasks
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.spec_decode.base import Proposal
from specserve.engine.spec_decode.draft_model import DraftModelProposer
from specserve.engine.spec_decode.draft_sampling import ChainSampler
from tests.engine.helpers import make_core, run
from tests.tiny_models import build_letter_tokenizer, save_llama

PROMPTS = ["The quick brown fox", "def main():", "Speculative decoding", "café", "x", "lazy dog. def"]
WORDS = GrammarSpec("regex", r"[a-z]{2,6}( [a-z]{2,6}){3}\.", "guided_regex")
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["red", "green", "blue"]},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "tag", "ok"], "additionalProperties": False}
JSON_SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))


def _greedy(spec, **kw):
    return SamplingParams(temperature=0.0, max_tokens=48, structured=spec, **kw)


@pytest.fixture(scope="module")
def plain(tiny):
    core = make_core(tiny["llama"])
    return {name: [o.output_token_ids for o in run(core, PROMPTS, _greedy(spec))]
            for name, spec in (("words", WORDS), ("json", JSON_SPEC))}


@pytest.mark.parametrize("engine", [dict(draft="llama_draft", k=3), dict(draft="llama", k=4),
                                    dict(speculative_method="ngram", k=3),
                                    dict(speculative_method="ngram", k=6, prompt_lookup_min=1,
                                         prompt_lookup_branches=3)])
@pytest.mark.parametrize("grammar", ["words", "json"])
def test_greedy_identical_with_and_without_speculation_under_a_grammar(tiny, plain, engine, grammar):
    engine = dict(engine)
    if "draft" in engine:
        engine["draft"] = tiny[engine["draft"]]
    core = make_core(tiny["llama"], **engine)
    spec = WORDS if grammar == "words" else JSON_SPEC
    outs = run(core, PROMPTS, _greedy(spec), join_after=2)
    assert [o.output_token_ids for o in outs] == plain[grammar]
    drafted = sum(o.speculation.num_draft_tokens for o in outs)
    assert drafted > 0
    if engine.get("draft") == tiny["llama"]:  # the target as its own draft, masked alike: every draft accepted
        assert sum(o.speculation.num_accepted_tokens for o in outs) == drafted
    for o in outs:
        if grammar == "words":
            assert re.fullmatch(WORDS.value, o.text), o.text
        else:
            jsonschema.validate(json.loads(o.text), SCHEMA)
        assert o.finish_reason == "stop"  # the grammar completed


def test_sampled_outputs_under_a_bounded_schema_all_validate(tiny):
    core = make_core(tiny["llama"], tiny["llama_draft"], k=3)
    params = [SamplingParams(temperature=1.0, max_tokens=64, seed=i, structured=JSON_SPEC) for i in range(48)]
    outs = run(core, ["{"] * 48, params)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in outs}) > 10  # really sampled
    assert core.allocator.usage == 0.0


def test_a_bad_grammar_is_refused_naming_the_field(tiny):
    core = make_core(tiny["llama"])
    for spec in (GrammarSpec("json_schema", json.dumps({"type": "integr"})),
                 GrammarSpec("regex", "(unclosed", "guided_regex"), GrammarSpec("choice", "[]", "guided_choice"),
                 GrammarSpec("grammar", "start: (", "guided_grammar")):
        with pytest.raises(InvalidRequestError) as err:
            core.make_request("bad", "x", _greedy(spec))
        assert err.value.param == spec.field


def test_masks_leave_the_matcher_as_it_was(tiny):
    core = make_core(tiny["llama"])
    matcher = core.grammars.matcher(GrammarSpec("regex", "ab(c|d)e"))
    ids = {ch: core.tokenizer.convert_tokens_to_ids(ch) for ch in "abcdex"}
    assert matcher.consume_tokens([ids["a"]])
    before = matcher.compute_bitmask()
    # a chain b, x (forbidden), e and a tree: b -> {c, d} -> e under d
    chain = node_bitmasks(matcher, [0, 1, 2], [ids["b"], ids["x"], ids["e"]], core.vocab_size)
    tree = node_bitmasks(matcher, [0, 1, 1, 3], [ids["b"], ids["c"], ids["d"], ids["e"]], core.vocab_size)
    assert matcher.compute_bitmask() == before  # every tentative token rolled back

    def allowed(row):
        bits = ((row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)[:core.vocab_size]
        return set(bits.nonzero()[:, 0].tolist())
    text = [core.tokenizer.decode([t]) for t in range(core.vocab_size)]  # (multi-letter tokens count too)
    assert all(re.fullmatch("b(c|d)?e?|bce|bde", text[t]) for t in allowed(chain[0])) and ids["b"] in allowed(chain[0])
    assert {ids["c"], ids["d"]} <= allowed(chain[1]) and ids["x"] not in allowed(chain[1])
    assert allowed(chain[2]) == allowed(chain[3]) == set(range(core.vocab_size))  # past a forbidden token: open
    assert ids["e"] in allowed(tree[2]) and ids["e"] in allowed(tree[3]) and ids["c"] not in allowed(tree[3])
    assert allowed(tree[4]) == {core.tokenizer.eos_token_id}  # "abde" is complete: only the end of sequence


# -- the law of sampled output under a grammar, with a sampled draft -------------------------------------------

V = 6  # a..e + EOS
N = 4000
LAW_REGEX = "[bd][ace][bd][ace]"
PROMPT = [0, 3, 1]


@pytest.fixture(scope="module")
def letters(tmp_path_factory):
    root = tmp_path_factory.mktemp("letters")
    build_letter_tokenizer(root / "tok", V)
    target = save_llama(root / "target", root / "tok", V, layers=1, hidden=32, heads=2, kv_heads=2, seed=10)
    draft = save_llama(root / "draft", root / "tok", V, layers=1, hidden=32, heads=2, kv_heads=1, seed=11)
    return target, draft


def _exact_law(target_path) -> np.ndarray:
    """P(t1..t4) under the grammar: each position the target's softmax restricted to the allowed letters."""
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    allowed = [[1, 3], [0, 2, 4], [1, 3], [0, 2, 4]]

    def probs(prefix, pos):
        with torch.no_grad():
            logits = model(torch.tensor([prefix])).logits[0, -1].double()
        p = torch.zeros(V, dtype=torch.float64)
        p[allowed[pos]] = torch.softmax(logits[allowed[pos]], dim=0)
        return p.numpy()

    law = np.zeros((V,) * 4)
    for a in allowed[0]:
        pa = probs(PROMPT, 0)[a]
        for b in allowed[1]:
            pb = probs(PROMPT + [a], 1)[b]
            for c in allowed[2]:
                pc = probs(PROMPT + [a, b], 2)[c]
                law[a, b, c] = pa * pb * pc * probs(PROMPT + [a, b, c], 3)
    return law.ravel()


def _p_value(letters) -> float:
    target, draft = letters
    core = make_core(target, draft, k=3, max_num_seqs=2048, max_num_batched_tokens=8192, kv_cache_memory=1 << 26,
                     seed=1)
    spec = GrammarSpec("regex", LAW_REGEX)
    outs = run(core, [PROMPT] * N, SamplingParams(temperature=1.0, max_tokens=8, structured=spec))
    assert all(o.finish_reason == "stop" and len(o.output_token_ids) == 4 for o in outs)
    assert sum(o.speculation.num_draft_tokens for o in outs) >= N // 2  # the draft really proposed
    seqs = np.array([o.output_token_ids for o in outs])
    observed = np.bincount(((seqs[:, 0] * V + seqs[:, 1]) * V + seqs[:, 2]) * V + seqs[:, 3],
                           minlength=V ** 4).astype(float)
    expected = _exact_law(target) * N
    assert observed[expected == 0].sum() == 0, "sampled a sequence the grammar forbids"
    big = expected >= 5
    obs, exp = np.append(observed[big], observed[~big].sum()), np.append(expected[big], expected[~big].sum())
    obs, exp = (obs[:-1], exp[:-1]) if exp[-1] == 0 else (obs, exp)
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.slow  # statistical law test
def test_sampled_output_under_a_grammar_follows_the_constrained_law(letters):
    assert _p_value(letters) > 1e-3


@pytest.mark.slow  # statistical law test
def test_law_check_fails_when_a_sampled_draft_is_cut_at_its_first_forbidden_token(letters, monkeypatch):
    """The control: the draft samples from its unconstrained q and the proposal is cut where the grammar first
    refuses it. Verification then sees a q that is not what the kept tokens were drawn from: biased."""
    monkeypatch.setattr(ChainSampler, "_constrained", lambda self, logits: logits)
    propose = DraftModelProposer.propose

    def cut(self, requests, ks, generator):
        prop = propose(self, requests, ks, generator)
        ids, counts = prop.token_ids.clone(), list(prop.num_tokens)
        for i, req in enumerate(requests):
            valid = req.grammar.validate_tokens(ids[i, :counts[i]].tolist())
            counts[i] = min(counts[i], valid)
            ids[i, counts[i]:] = -1
            self._computed[req.request_id] = len(req.token_ids) + max(counts[i], 1) - 1  # what it fed and kept
        return Proposal(ids, counts, prop.probs)
    monkeypatch.setattr(DraftModelProposer, "propose", cut)
    assert _p_value(letters) < 1e-6


@pytest.mark.parametrize("engine", [dict(draft="llama_draft", k=3), dict(speculative_method="ngram", k=3)])
def test_logit_bias_is_exact_under_speculation(tiny, engine):
    engine = dict(engine)
    if "draft" in engine:
        engine["draft"] = tiny[engine["draft"]]
    bias = {65: 4.0, 66: 3.5, 67: -100.0}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logit_bias=bias)
    plain = run(make_core(tiny["llama"]), PROMPTS, params)
    outs = run(make_core(tiny["llama"], **engine), PROMPTS, params, join_after=2)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in plain]
    self_draft = run(make_core(tiny["llama"], tiny["llama"], k=3), PROMPTS, params)  # q biased as p is
    drafted = sum(o.speculation.num_draft_tokens for o in self_draft)
    assert drafted > 0 and sum(o.speculation.num_accepted_tokens for o in self_draft) == drafted
    unbiased = run(make_core(tiny["llama"]), PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert [o.output_token_ids for o in plain] != [o.output_token_ids for o in unbiased]  # the bias did something
    assert all(67 not in o.output_token_ids for o in plain)
    with pytest.raises(InvalidRequestError) as err:
        make_core(tiny["llama"]).make_request("r", "x", SamplingParams(logit_bias={10_000: 1.0}))
    assert err.value.param == "logit_bias"
