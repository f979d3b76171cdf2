"""Load-time support check: mask patterns identified from HF's own index functions, config-driven refusals."""

import pytest
import torch
from transformers import DeepseekV3Config, Gemma3Config, GraniteMoeHybridConfig, Lfm2Config, LlamaConfig
from transformers.masking_utils import (
    and_masks,
    bidirectional_mask_function,
    causal_mask_function,
    chunked_overlay,
    sliding_window_causal_mask_function,
)

from specserve.engine.errors import InvalidRequestError
from specserve.engine.model.support import check_supported, config_pattern, mask_pattern


def test_mask_patterns_of_hf_mask_functions():
    assert mask_pattern(causal_mask_function, 4096) is None
    assert mask_pattern(sliding_window_causal_mask_function(7), 4096) == ("window", 7)
    chunked = and_masks(chunked_overlay(6, torch.zeros(1, dtype=torch.long)), causal_mask_function)
    assert mask_pattern(chunked, 4096) == ("chunk", 6)
    assert mask_pattern(sliding_window_causal_mask_function(8192), 4096) is None  # wider than any sequence


@pytest.mark.parametrize("fn", [bidirectional_mask_function, lambda b, h, q, kv: kv <= q + 1,
                                lambda b, h, q, kv: (kv <= q) & (kv % 2 == 0)])
def test_other_masks_are_refused(fn):
    with pytest.raises(Exception, match="not causal, sliding-window or chunked"):
        mask_pattern(fn, 1024)


def test_config_patterns_follow_layer_types():
    cfg = LlamaConfig(num_hidden_layers=2)
    assert config_pattern(cfg, 0) is None
    cfg.sliding_window = 5  # no layer_types: every layer (Mistral style)
    assert config_pattern(cfg, 1) == ("window", 5)
    cfg.layer_types = ["full_attention", "sliding_attention"]
    assert [config_pattern(cfg, i) for i in range(2)] == [None, ("window", 5)]


@pytest.mark.parametrize("config, reason", [
    (Lfm2Config(num_hidden_layers=2, full_attn_idxs=[1]), "non-attention layers (conv)"),
    (GraniteMoeHybridConfig(), "non-attention layers (linear_attention)"),
    (DeepseekV3Config(), "multi-head latent attention"),
    (Gemma3Config(), "multimodal/composite model"),
])
def test_config_refusals_name_the_feature(config, reason):
    with pytest.raises(InvalidRequestError) as err:
        check_supported(config)
    assert err.value.param == "model" and reason in err.value.message


def test_plain_config_is_supported():
    check_supported(LlamaConfig(num_hidden_layers=2))
