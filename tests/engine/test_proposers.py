"""The proposer framework: several methods loaded at once, chosen per request; variable-length (or empty) proposals;
per-request proposer state across chunked prefill, preemption and k changing between steps; Predicted Outputs."""

import json

import pytest
import torch

from specserve.engine.errors import InvalidRequestError
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.spec_decode.base import ProposerBase, ProposerNeeds, chain_proposal
from specserve.engine.spec_decode.ngram import NgramProposer, trie
from specserve.engine.spec_decode.ngram_index import NgramIndex
from tests.engine.helpers import make_core, run
from tests.engine.test_greedy_exactness import PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def baseline(tiny):
    return [o.output_token_ids for o in run(make_core(tiny["llama"]), PROMPTS, GREEDY)]


def _both(tiny, **kw):
    """Draft (the default) and ngram loaded together through vLLM's --speculative-config."""
    cfg = [{"method": "draft_model", "model": str(tiny["llama_draft"]), "num_speculative_tokens": 3},
           {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}]
    return make_core(tiny["llama"], speculative_config=json.dumps(cfg), **kw)


def test_ngram_greedy_identical_with_joins(tiny, baseline):
    core = make_core(tiny["llama"], speculative_method="ngram", k=4, prompt_lookup_min=1)
    outs = run(core, PROMPTS, GREEDY, join_after=3, join_from=6)
    assert [o.output_token_ids for o in outs] == baseline
    assert all(o.speculation.method == "ngram" for o in outs)
    assert sum(o.speculation.num_draft_tokens for o in outs) > 0  # random models loop: lookups find something
    assert core.allocator.usage == 0.0 and not core.proposers["ngram"]._state  # per-request state freed


def test_methods_chosen_per_request_in_one_batch(tiny, baseline):
    core = _both(tiny)
    assert list(core.proposers) == ["draft", "ngram"] and core.default_method == "draft"
    methods = [None, "ngram", "none", "draft", "prompt_lookup"]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                             speculative_method=methods[i % len(methods)]) for i in range(len(PROMPTS))]
    outs = run(core, PROMPTS, params, join_after=2, join_from=5)
    assert [o.output_token_ids for o in outs] == baseline
    labels = {None: "draft", "ngram": "ngram", "none": "none", "draft": "draft", "prompt_lookup": "ngram"}
    assert [o.speculation.method for o in outs] == [labels[methods[i % 5]] for i in range(len(PROMPTS))]
    assert all(o.speculation.num_draft_tokens == 0 for o in outs if o.speculation.method == "none")


def test_unknown_or_unloaded_method_is_an_error_naming_the_field(tiny):
    core = make_core(tiny["llama"], tiny["llama_draft"], k=2)
    with pytest.raises(InvalidRequestError) as err:
        core.make_request("a", "hi", SamplingParams(speculative_method="ngram"))
    assert err.value.param == "speculative_method" and "draft" in err.value.message
    with pytest.raises(ValueError, match="^speculative_method: unknown"):
        make_core(tiny["llama"], speculative_method="lookahead")
    with pytest.raises(ValueError, match="^speculative_config.method: method 'ngram' is listed twice"):
        make_core(tiny["llama"], speculative_config='[{"method": "ngram"}, {"method": "prompt_lookup"}]')


def test_self_draft_accepts_everything_across_chunked_prefill_preemption_and_k_changes(tiny, baseline):
    """Broken draft state would only lower acceptance (greedy identity cannot see it): with the target as its own
    draft every proposed token must be accepted, through chunked prefill (16-token budget), preemptions (a
    KV budget of 96 tokens) and k changing step to step (the token budget trims k; per-request k)."""
    core = make_core(tiny["llama"], tiny["llama"], k=4, max_num_batched_tokens=16, block_size=4,
                     kv_cache_memory=24 * 4 * (512 + 512))  # 24 blocks of 4 tokens (target + self-draft, fp32)
    preempted_while_drafting = []
    draft = core.proposers["draft"]
    spy = draft.on_preempt
    draft.on_preempt = lambda req: (preempted_while_drafting.append(req.request_id in draft._computed), spy(req))
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, num_speculative_tokens=(i % 3) * 2)
              for i in range(len(PROMPTS))]
    outs = run(core, PROMPTS, params, join_after=4, join_from=5)
    assert [o.output_token_ids for o in outs] == baseline
    assert sum(preempted_while_drafting) >= 2  # the draft had K/V for them: it must recompute it
    drafted = sum(o.speculation.num_draft_tokens for o in outs)
    assert drafted > 0 and sum(o.speculation.num_accepted_tokens for o in outs) == drafted
    assert not core.proposers["draft"]._computed


def test_predicted_outputs_right_wrong_and_partial(tiny, baseline):
    core = _both(tiny)
    right = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prediction=b) for b in baseline[:3]]
    wrong = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prediction=[7] * 30)]
    edited = baseline[4][:8] + [3, 4, 5] + baseline[4][8:]  # an insertion the output will not contain
    partial = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prediction=edited)]
    outs = run(core, PROMPTS[:3] + [PROMPTS[3], PROMPTS[4]], right + wrong + partial, join_after=1, join_from=3)
    assert [o.output_token_ids for o in outs] == baseline[:5]  # a prediction never changes the output
    for o in outs[:3]:  # the true output as prediction: every proposed token accepted, 9 tokens a step
        s = o.speculation
        assert s.method == "prediction" and s.num_accepted_tokens == s.num_draft_tokens >= 20
        assert s.num_steps <= 4 and (s.accepted_prediction_tokens, s.rejected_prediction_tokens) == (24, 0)
    s = outs[3].speculation  # wrong: the default method (draft) fills in; only the counts change
    assert s.accepted_prediction_tokens == sum(t == 7 for t in baseline[3][:1]) and s.rejected_prediction_tokens > 0
    s = outs[4].speculation  # re-aligned after the inserted tokens: most of the rest still accepted
    assert s.accepted_prediction_tokens == 24 and s.rejected_prediction_tokens == 3
    assert s.num_accepted_tokens >= 18


def test_ngram_trees_greedy_identical(tiny, baseline):
    """Trees of several continuations: fp32 greedy output identical to plain decoding in a batch with joins and
    chunked prefill."""
    core = make_core(tiny["llama"], speculative_method="ngram", k=6, prompt_lookup_min=1, prompt_lookup_branches=3,
                     max_num_batched_tokens=24)
    assert core.proposers["ngram"].needs.tree
    outs = run(core, PROMPTS, GREEDY, join_after=3, join_from=6)
    assert [o.output_token_ids for o in outs] == baseline
    assert sum(o.speculation.num_accepted_tokens for o in outs) > 0


class OracleTree(ProposerBase):
    """A test method that knows each request's true greedy output and proposes a tree whose FIRST branch is wrong
    after one token and whose second branch is the truth: every step must then accept the whole second branch,
    through its K/V moved into place (a wrong mask, position or move shows up as a rejection or a wrong token)."""

    name = "oracle"
    truth: dict = {}  # prompt tuple -> greedy output (the test sets it on the loaded instance)

    @classmethod
    def load(cls, cfg, ctx):
        return cls(ProposerNeeds(tree=True), 7)

    def propose(self, requests, ks, gen):
        drafts, parents = [], []
        for req, k in zip(requests, ks):
            true = self.truth[tuple(req.prompt_token_ids)][req.num_output_tokens:]
            right = true[: k - 1]  # the true branch: k - 1 nodes, + 1 wrong node = k
            if len(right) < 3:
                drafts.append(true[:k])
                parents.append(list(range(len(drafts[-1]))))
                continue
            wrong = [right[0], (right[1] + 1) % 300]  # shares the first token, then leaves the truth
            # nodes: 1 = right[0] (shared), 2 = wrong[1] (child of 1), 3.. = right[1:] (child of 1, then a chain)
            tokens = [right[0], wrong[1], *right[1:]]
            par = [0, 1, 1, *range(3, 3 + len(right) - 2)]
            drafts.append(tokens)
            parents.append(par)
        return chain_proposal(drafts, torch.device("cpu"), parents)


def test_tree_side_branch_accepted_with_kv_moved_into_place(tiny, baseline, monkeypatch):
    from types import MappingProxyType

    import specserve.engine.spec_decode.registry as registry
    monkeypatch.setattr(registry, "PROPOSERS", MappingProxyType(
        {**registry.PROPOSERS, "oracle": "tests.engine.test_proposers:OracleTree"}))
    core = make_core(tiny["llama"], speculative_config='{"method": "oracle", "num_speculative_tokens": 7}',
                     max_num_batched_tokens=40)
    prompts = [core.tokenize(p) for p in PROMPTS]
    core.proposers["oracle"].truth = {tuple(p): b for p, b in zip(prompts, baseline)}
    moved = []
    copy = core.target.kv.copy_slots
    core.target.kv.copy_slots = lambda src, dst: (moved.append(len(src)), copy(src, dst))
    outs = run(core, PROMPTS, GREEDY, join_after=2, join_from=4)
    assert [o.output_token_ids for o in outs] == baseline
    assert sum(moved) > 20  # side branches were accepted, their K/V moved
    for o in outs:  # every step accepts the whole true branch (k - 1 nodes of k), the short last steps aside
        s = o.speculation
        assert s.num_accepted_tokens == s.num_draft_tokens - (s.num_steps - 1) - 0 or \
            s.num_accepted_tokens >= s.num_draft_tokens - s.num_steps, s


def _replay_ngram(prompt, truth, k, branches, max_tokens=24):
    """(steps, accepted) a fresh n-gram lookup per step would give against the known greedy output."""
    tokens, steps, accepted = list(prompt), 0, 0
    while len(tokens) - len(prompt) < max_tokens:
        done = len(tokens) - len(prompt)
        budget = min(k, max_tokens - done - 1)
        m = 0
        if budget > 0:
            index = NgramIndex(2, 4, branches)
            index.update(tokens)
            found = index.continuations(tokens, budget, branches)
            nodes, parents = trie([c[: budget // max(1, len(found))] for c in found])
            node = 0
            while True:  # greedy walk: the child carrying the true next token
                child = next((j + 1 for j, (t, par) in enumerate(zip(nodes, parents))
                              if par == node and t == truth[done + m]), None)
                if child is None:
                    break
                node, m = child, m + 1
            if nodes:
                steps, accepted = steps + 1, accepted + m
        tokens += truth[done: done + m + 1]
    return steps, accepted


@pytest.mark.parametrize("branches", [1, 3])
def test_ngram_acceptance_equals_a_fresh_lookup_each_step(tiny, baseline, branches):
    """Random models repeat themselves (loops of 2-5 tokens), so lookups find their own output. Broken incremental
    index state would only lower acceptance, which greedy identity cannot see: every request's steps and accepted
    count must equal a replay that builds a fresh index each step."""
    core = make_core(tiny["llama"], speculative_method="ngram", k=6, prompt_lookup_branches=branches)
    outs = run(core, PROMPTS, GREEDY, join_after=2, join_from=5)
    assert [o.output_token_ids for o in outs] == baseline
    for p, o in zip(PROMPTS, outs):
        assert (o.speculation.num_steps, o.speculation.num_accepted_tokens) == \
            _replay_ngram(core.tokenize(p), o.output_token_ids, 6, branches)
    assert sum(o.speculation.num_accepted_tokens for o in outs) >= 40


class HiddenRecorder(ProposerBase):
    """A test method that reads target hidden states of every computed token (as DFlash will) and proposes what
    n-gram lookup would; it keeps, per request, the states at each position — truncated where they restart."""

    name = "recorder"
    LAYERS = (0, 1, -1)

    def __init__(self, rows):
        super().__init__(ProposerNeeds(hidden_layers=self.LAYERS, hidden_rows=rows), 3)
        self.lookup = NgramProposer(3, 1, 3, torch.device("cpu"))
        self.states: dict[str, dict[int, dict[int, torch.Tensor]]] = {}
        self.finished: dict[str, dict[int, dict[int, torch.Tensor]]] = {}

    @classmethod
    def load(cls, cfg, ctx):
        return cls(cfg.model or "all")

    def propose(self, requests, ks, gen):
        return self.lookup.propose(requests, ks, gen)

    def on_hidden(self, requests, chunks):
        for req, chunk in zip(requests, chunks):
            per_pos = self.states.setdefault(req.request_id, {})
            n = next(iter(chunk.states.values())).shape[0]
            for j in range(n):
                per_pos[chunk.start + j] = {layer: h[j].clone() for layer, h in chunk.states.items()}

    def on_free(self, req):
        self.finished[req.request_id] = self.states.pop(req.request_id, {})
        self.lookup.on_free(req)


@pytest.mark.parametrize("rows", ["all", "verified"])
def test_hidden_states_from_the_target_forward_equal_hf(tiny, monkeypatch, rows):
    """Layers 0, 1 and the final norm, captured by hooks during the engine's own forwards (chunked prefill,
    speculative verify with rejections, a preemption), equal HF's output_hidden_states of the final sequence at
    every position delivered; 'all' delivers every position, 'verified' at least the last one of each step."""
    from types import MappingProxyType

    from transformers import AutoModelForCausalLM

    import specserve.engine.spec_decode.registry as registry
    monkeypatch.setattr(registry, "PROPOSERS", MappingProxyType(
        {**registry.PROPOSERS, "recorder": "tests.engine.test_proposers:HiddenRecorder"}))
    cfg = json.dumps({"method": "recorder", "model": rows, "num_speculative_tokens": 3})
    core = make_core(tiny["llama"], speculative_config=cfg, max_num_batched_tokens=16, block_size=4,
                     kv_cache_memory=24 * 4 * 512)
    outs = run(core, PROMPTS[:6], GREEDY, join_after=2, join_from=3)
    rec = core.proposers["recorder"]
    assert sum(o.speculation.num_draft_tokens for o in outs) > sum(o.speculation.num_accepted_tokens for o in outs)
    assert core.totals.num_preemptions > 0
    hf = AutoModelForCausalLM.from_pretrained(str(tiny["llama"]), dtype=torch.float32).eval()
    for i, o in enumerate(outs):
        seq = o.prompt_token_ids + o.output_token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states  # embeddings, layer 0, 1 (normed)
        got = rec.finished[f"r{i}"]
        if rows == "all":  # every position but those of the finishing step (the request is freed right after)
            assert sorted(got) == list(range(len(got))) and len(got) >= len(seq) - 1 - 4, (i, sorted(got))
        else:
            assert len(got) >= o.speculation.num_steps - 1
        for pos, states in got.items():
            assert torch.allclose(states[0], ref[1][0, pos], atol=1e-4), (i, pos)
            assert torch.allclose(states[-1], ref[2][0, pos], atol=1e-4), (i, pos)
