"""End to end, sampled speculative output follows the target's exact law.

A 6-token vocabulary makes the exact joint law of the first three generated tokens cheap to compute with plain HF
forwards; the engine draws 10k samples with a *different* random draft (so rejections and residual draws are common) and
a chi-square test compares. The same test with a biased sampler (resampling from the target on rejection) must fail.
"""

import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from specserve.engine.model.cpu_kernels.build import for_device
from specserve.engine.model.quantize import quantize_linears
from specserve.engine.sampling_params import SamplingParams
from tests.engine.helpers import make_core, run
from tests.tiny_models import build_word_tokenizer, save_llama
from tests.unit.test_rejection import _resample_from_target

pytestmark = pytest.mark.slow  # statistical law tests (tools/test.sh runs the slow tier)

V = 6
N = 10_000
PROMPT = [0, 3, 1]
CASES = {
    "temperature_1": dict(temperature=1.0),
    "top_k": dict(temperature=0.7, top_k=3),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "penalties": dict(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.6),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinyvocab")
    build_word_tokenizer(root / "tok", V)
    target = save_llama(root / "target", root / "tok", V, layers=1, hidden=32, heads=2, kv_heads=2, seed=10)
    draft = save_llama(root / "draft", root / "tok", V, layers=1, hidden=32, heads=2, kv_heads=1, seed=11)
    return target, draft


def _reference(logits: np.ndarray, kw: dict, counts: np.ndarray) -> np.ndarray:
    """Straightforward per-row processing: penalties, temperature, top-k, top-p (smallest set reaching top_p)."""
    x = logits - kw.get("frequency_penalty", 0) * counts - kw.get("presence_penalty", 0) * (counts > 0)
    x = x / kw["temperature"]
    if kw.get("top_k"):
        x = np.where(x < np.sort(x)[::-1][kw["top_k"] - 1], -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if kw.get("top_p", 1.0) < 1.0:
        keep, mass = [], 0.0
        for i in np.argsort(-p, kind="stable"):
            keep.append(i)
            mass += p[i]
            if mass >= kw["top_p"]:
                break
        p = np.where(np.isin(np.arange(V), keep), p, 0.0)
        p /= p.sum()
    return p


def _exact_law(target_path, kw, prompt=PROMPT, quantization=None) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    if quantization:  # the law of the quantized model is the one the engine must follow
        quantize_linears(model, quantization, torch.float32, kernels=for_device(torch.device("cpu")))

    def next_probs(prefix, generated):
        with torch.no_grad():
            logits = model(torch.tensor([prefix])).logits[0, -1].double().numpy()
        return _reference(logits, kw, np.bincount(generated, minlength=V).astype(float))

    law = np.zeros((V, V, V))
    p1 = next_probs(prompt, [])
    for a in range(V):
        p2 = next_probs(prompt + [a], [a])
        for b in range(V):
            law[a, b] = p1[a] * p2[b] * next_probs(prompt + [a, b], [a, b])
    return law.ravel()


def _p_value(target_path, draft_path, kw, prompt=PROMPT, max_tokens=4, quantization=None, **engine) -> float:
    engine = engine or dict(draft=draft_path, k=2)
    core = make_core(target_path, max_num_seqs=2048, max_num_batched_tokens=8192, kv_cache_memory=1 << 26, seed=1,
                     quantization=quantization, **engine)
    try:
        outs = run(core, [prompt] * N, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw))
    finally:
        core.close()  # tensor-parallel workers, if any
    seqs = np.array([o.output_token_ids[:3] for o in outs])  # t2, t3 come from one k = 2 chain
    assert sum(o.speculation.num_draft_tokens for o in outs) >= 2 * N  # the draft really proposed
    observed = np.bincount(seqs[:, 0] * V * V + seqs[:, 1] * V + seqs[:, 2], minlength=V ** 3).astype(float)
    expected = _exact_law(target_path, kw, prompt, quantization) * N
    assert observed[expected == 0].sum() == 0, "sampled a sequence the target law forbids"
    big = expected >= 5  # chi-square needs populated cells; pool the rest into one
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    obs, exp = (obs[:-1], exp[:-1]) if exp[-1] == 0 else (obs, exp)
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.parametrize("case", list(CASES))
def test_first_three_tokens_follow_target_law(pair, case):
    assert _p_value(*pair, CASES[case]) > 1e-3


def test_an_int4_target_keeps_its_own_law(pair):
    """Weight-only int4 target (the draft unquantized): sampled output follows the quantized target's law."""
    assert _p_value(*pair, CASES["temperature_1"], quantization="int4") > 1e-3


def test_law_check_fails_on_resampling_from_the_target(pair, monkeypatch):
    monkeypatch.setattr("specserve.engine.sample.verifier.rejection_sample", _resample_from_target)
    assert _p_value(*pair, CASES["temperature_1"]) < 1e-6


@pytest.fixture(scope="module")
def mapped_draft(pair, tmp_path_factory):
    """A sub-vocabulary draft: it can propose only target ids 1, 3, 5 (plus an unknown input id)."""
    from specserve.engine.model.vocab_map import save_vocab_map

    root = tmp_path_factory.mktemp("mapped")
    draft = save_llama(root / "draft", pair[0], 4, layers=1, hidden=32, heads=2, kv_heads=1, seed=12)
    save_vocab_map(draft, torch.tensor([1, 3, 5]))
    return draft


def test_sub_vocabulary_draft_keeps_target_law(pair, mapped_draft):
    """q is zero outside the draft's sub-vocabulary; the residual then supplies those tokens exactly."""
    assert _p_value(pair[0], mapped_draft, CASES["temperature_1"]) > 1e-3


# every token occurs ~5 times with different followers: with 1-grams and 3 branches, the n-gram method proposes a
# tree of up to 3 continuations of depth 2 (k = 6) after whatever token was sampled first
TREE_PROMPT = [random.Random(3).randrange(V) for _ in range(30)]


TREE_ENGINE = dict(max_tokens=8, speculative_method="ngram", k=6, prompt_lookup_min=1, prompt_lookup_max=1,
                   prompt_lookup_branches=3)


@pytest.mark.parametrize("case", ["temperature_1", "penalties"])
def test_ngram_tree_keeps_target_law(pair, case):
    """The tree rule end to end (depth-indexed noise, path penalties, the accepted path's K/V moved)."""
    assert _p_value(pair[0], None, CASES[case], TREE_PROMPT, **TREE_ENGINE) > 1e-3


def test_tree_law_check_fails_on_a_lossy_tree_rule(pair, monkeypatch):
    from tests.unit.test_tree import _lossy_tree_sample

    monkeypatch.setattr("specserve.engine.sample.verifier.tree_sample", _lossy_tree_sample)
    assert _p_value(pair[0], None, CASES["temperature_1"], TREE_PROMPT, **TREE_ENGINE) < 1e-6
