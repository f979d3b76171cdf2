"""The bundled demo pair: found with no model arguments, loads offline, and speculates for real."""

import os
import subprocess
import sys

import pytest

from engine import LLM, SamplingParams
from engine.loader import bundled_model_paths

TARGET, DRAFT = bundled_model_paths()
pytestmark = pytest.mark.skipif(not (TARGET.exists() and DRAFT.exists()), reason="bundled demo pair not present")


PROMPTS = ["import os\nimport sys\n\n\ndef main():\n", "class Foo(object):\n    def __init__(self, name):\n        ",
           "    for i in range(len(items)):\n        if ", '"""Utilities for parsing command line arguments."""\n\nimport ']


def test_llm_without_arguments_uses_the_demo_pair():
    llm = LLM(kv_cache_memory=64 << 20, seed=0)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert llm.engine.model_path == str(TARGET)
    assert all(o.speculation.method == "draft" and len(o.output_token_ids) == 32 and o.text for o in outs)
    drafted = sum(o.speculation.num_draft_tokens for o in outs)
    accepted = sum(o.speculation.num_accepted_tokens for o in outs)
    # a trained pair, not random weights (which accept ~0): 0.35 here, 0.55 on the benchmark's held-out prompts
    assert accepted / drafted > 0.25


def test_cli_generate_without_model_flags_offline():
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "server.cli", "generate", "--max-tokens", "12",
                           "--kv-cache-memory", str(64 << 20), "def main():"], capture_output=True, text=True,
                          timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def main():") and "method=draft" in proc.stderr
