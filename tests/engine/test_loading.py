"""Model loading: draft/target vocabulary check, dtype/device resolution, the CLI's generate command."""

import subprocess
import sys

import pytest
import torch

from specserve.engine import LLM, SamplingParams
from specserve.engine.errors import InvalidRequestError
from specserve.engine.model.loader import resolve_device, resolve_dtype
from tests.tiny_models import build_word_tokenizer, save_llama


def test_draft_with_other_vocabulary_is_refused(tiny, tmp_path):
    build_word_tokenizer(tmp_path / "tok", 40)
    other = save_llama(tmp_path / "other", tmp_path / "tok", 40, layers=1)
    with pytest.raises(InvalidRequestError, match="vocabulary") as err:
        LLM(model=str(tiny["llama"]), draft_model=str(other), dtype="float32", device="cpu",
            kv_cache_memory=1 << 22)
    assert err.value.param == "draft_model"


def test_auto_resolution(monkeypatch):
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32  # bf16 emulated on AVX2-only CPUs: slower
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    with pytest.raises(InvalidRequestError):
        resolve_dtype("int3", torch.device("cpu"))


def test_llm_accepts_strings_token_ids_and_param_lists(tiny):
    llm = LLM(model=str(tiny["llama"]), draft_model=str(tiny["llama_draft"]), num_speculative_tokens=2,
              dtype="float32", device="cpu", kv_cache_memory=1 << 22, seed=0)
    outs = llm.generate(["café", [5, 6, 7]], [SamplingParams(max_tokens=3, ignore_eos=True),
                                             SamplingParams(max_tokens=5, ignore_eos=True, temperature=0)])
    assert [len(o.output_token_ids) for o in outs] == [3, 5]
    assert outs[1].prompt_token_ids == [5, 6, 7]
    assert outs[1].speculation.method == "draft"
    assert set(vars(outs[1].speculation)) == {"method", "num_draft_tokens", "num_accepted_tokens", "num_steps",
                                              "accepted_prediction_tokens", "rejected_prediction_tokens",
                                              "steps_by_k"}
    by_k = outs[1].speculation.steps_by_k
    assert set(by_k) <= {0, 1, 2} and by_k.get(0, 0) >= 1  # the prefill step emits the first token, verifying nothing
    assert sum(n for k, n in by_k.items() if k) == outs[1].speculation.num_steps
    assert sum(k * n for k, n in by_k.items()) == outs[1].speculation.num_draft_tokens
    assert outs[1].speculation.accepted_prediction_tokens is None  # no prediction given
    single = llm.generate("café", SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(single) == 1


def test_cli_generate_with_draft(tiny):
    proc = subprocess.run([sys.executable, "-m", "specserve", "generate", "--model", str(tiny["llama"]),
                           "--draft-model", str(tiny["llama_draft"]), "--dtype", "float32", "--max-tokens", "8",
                           "--kv-cache-memory", str(1 << 22), "The quick"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The quick")
    assert "method=draft" in proc.stderr and "acceptance_rate=" in proc.stderr


def test_cli_reports_bad_model_path(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "specserve", "generate", "--model", str(tmp_path / "nope"), "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "nope" in proc.stderr


def test_chat_template_override_from_file_or_inline(tiny, tmp_path):
    from tests.engine.helpers import make_core

    inline = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text("FILE:" + inline)
    msgs = [{"role": "user", "content": "hi"}]
    for value, expected in ((inline, "[user] hi\n"), (str(path), "FILE:[user] hi\n")):
        core = make_core(tiny["llama"], chat_template=value)
        assert core.tokenizer.apply_chat_template(msgs, tokenize=False) == expected
    with pytest.raises(InvalidRequestError, match="chat_template") as e:
        make_core(tiny["llama"], chat_template=str(tmp_path / "missing.jinja"))
    assert e.value.param == "chat_template"


def test_sub_vocabulary_draft_must_match_its_map(tiny, tmp_path):
    from specserve.engine.model.vocab_map import save_vocab_map
    from tests.engine.helpers import make_core

    draft = save_llama(tmp_path / "d", tiny["llama"], 17, layers=1, hidden=32, heads=2, kv_heads=1)
    save_vocab_map(draft, torch.arange(10))  # 10 ids + unknown = 11 rows, but the draft has 17
    with pytest.raises(InvalidRequestError, match="vocabulary map") as e:
        make_core(tiny["llama"], draft)
    assert e.value.param == "draft_model"
