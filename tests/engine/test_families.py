"""One tiny random model per architecture family: engine greedy tokens (fp32, plain and self-speculative) equal HF
generate(), or the model is refused at load with a named reason. CI runs the common families plus one per
attention feature; tools/families.py runs every family transformers registers."""

import pytest

from tests.tiny_families import (
    CHUNK,
    NEW_TOKENS,
    PROMPT_LENGTHS,
    SOFTCAP,
    WINDOW,
    check_family,
    save_family,
    tiny_config,
)

# family -> "exact", or a phrase the refusal must contain
CI_FAMILIES = {
    "llama": "exact", "qwen3": "exact", "qwen3_moe": "exact", "gemma": "exact", "phi3": "exact",  # phi3: window
    "gpt2": "exact", "gpt_neox": "exact", "opt": "exact", "gpt_bigcode": "exact",  # multi-query K/V
    "mistral": "exact",  # sliding window on every layer
    "mixtral": "exact",  # MoE + sliding window
    "qwen2": "exact",  # one full and one sliding layer (max_window_layers)
    "gemma3_text": "exact",  # mixed local/global layers
    "gemma2": "exact",  # soft-capping + mixed local/global
    "gpt_oss": "exact",  # attention sinks + mixed local/global
    "llama4_text": "exact",  # chunked attention
    "phimoe": "exact",  # window only in HF's mask (not passed to attention)
    "lfm2": "non-attention layers (conv)",  # hybrid: convolution layers
    "granitemoehybrid": "non-attention layers (linear_attention)",  # hybrid: Mamba layers
    "deepseek_v3": "multi-head latent attention",  # value head size != key head size
    "gemma3n_text": "exact",  # KV sharing: the sharing layers store a copy of the shared K/V
    "diffllama": "more than once per forward",  # two attentions per layer
    "moshi": "disagree",  # config window that HF's mask does not apply
    "doge": "its own attention mask",  # dynamic mask computed in the model
    "nemotron": "does not pass the forward's kwargs",
}
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


def test_tiny_configs_cross_the_features():
    longest = max(PROMPT_LENGTHS) + NEW_TOKENS
    assert longest > 3 * WINDOW and longest > 3 * CHUNK
    assert tiny_config("gemma2").attn_logit_softcapping == SOFTCAP
    assert tiny_config("gemma3_text").layer_types == ["sliding_attention", "full_attention"]
    assert tiny_config("qwen2").layer_types == ["full_attention", "sliding_attention"]
    assert tiny_config("llama4_text").attention_chunk_size == CHUNK


@pytest.mark.parametrize("family", CI_FAMILIES)
def test_family_is_exact_or_refused(root, family):
    status = check_family(save_family(family, root))
    expected = CI_FAMILIES[family]
    if expected == "exact":
        assert status == "exact"
    else:
        assert status.startswith("refused: ") and expected in status, status
