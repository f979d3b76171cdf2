"""Tiny random models of every causal-LM family transformers registers, with windows, chunks and soft-caps small
enough that short prompts cross them, and the exactness check: engine greedy tokens (plain and self-speculative)
against HF generate(), or a refusal at load."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from specserve.engine.errors import InvalidRequestError
from specserve.engine.sampling_params import SamplingParams
from tests.engine.helpers import make_core, run
from tests.tiny_models import _save, build_word_tokenizer

VOCAB = 128
WINDOW = 5  # sliding window: the prompts below are 3..19 tokens, plus 12 generated
CHUNK = 6  # chunked attention (Llama 4)
SOFTCAP = 0.5  # attention logit soft-cap, small enough to bend random-init logits
NEW_TOKENS = 12
PROMPT_LENGTHS = (3, 9, 19)
# config fields set wherever the family's config has them (top level and nested text/vision/audio configs)
SIZES = {
    "vocab_size": VOCAB, "max_position_embeddings": 256, "n_positions": 256, "n_ctx": 256, "max_seq_len": 256,
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2,
    "num_layers": 2, "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "num_key_value_heads": 2,
    "num_kv_heads": 2, "head_dim": 16, "rotary_dim": 8, "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "encoder_layers": 2, "decoder_layers": 2,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
    "moe_num_experts": 4, "num_experts_per_tok": 2, "moe_k": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "qk_head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "mamba_d_state": 16, "mamba_n_heads": 4,
    "mamba_d_head": 32, "mamba_chunk_size": 16, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8,
    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16, "laurel_rank": 8,
    # features: a window / chunk the prompts cross; Qwen-style configs get one full and one sliding layer, LFM2 one
    # convolution and one attention layer
    "sliding_window": WINDOW, "attention_chunk_size": CHUNK, "use_sliding_window": True, "max_window_layers": 1,
    "full_attn_idxs": [1],
    # sharper random models: untied, wider init and a larger attention scale, so that windows, caps and sinks
    # change greedy tokens (a tied, near-uniform tiny model mostly echoes its input embedding)
    "query_pre_attn_scalar": 16, "initializer_range": 0.1, "tie_word_embeddings": False,
    "is_decoder": True, "bos_token_id": 1, "eos_token_id": VOCAB - 1, "pad_token_id": 0,
}
SUB_CONFIGS = ("text_config", "vision_config", "audio_config", "decoder_config", "encoder_config")


def families() -> list[str]:
    """Every model_type transformers maps to a causal LM class."""
    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _overrides(config) -> dict:
    present = config.to_dict()
    kw = {k: v for k, v in SIZES.items() if k in present}
    if present.get("attn_logit_softcapping") is not None:
        kw["attn_logit_softcapping"] = SOFTCAP
    return kw


def tiny_config(model_type: str):
    """The family's default config shrunk to 2 layers, hidden 64, vocab 128; windows/chunks/caps made small. Where
    the full-size config mixes layer types (local/global, attention/recurrent), the two layers keep two of them."""
    default = AutoConfig.for_model(model_type)
    kw = _overrides(default)
    for name in SUB_CONFIGS:
        sub = getattr(default, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            kw[name] = sub.to_dict() | _overrides(sub)
    text, default_text = kw.get("text_config", kw), default.get_text_config(decoder=True)
    types = list(dict.fromkeys(getattr(default_text, "layer_types", None) or []))[:2]
    text.pop("layer_types", None)  # recomputed for 2 layers (window, max_window_layers, ...) unless mixed
    if len(types) > 1:
        text["layer_types"] = types
    if getattr(default_text, "num_kv_shared_layers", 0):  # KV sharing (Gemma 3n): layers 2.. reuse layers 0..'s K/V
        text |= {"num_hidden_layers": 2 * len(types), "layer_types": types * 2, "num_kv_shared_layers": len(types),
                 "activation_sparsity_pattern": None}
    return type(default)(**kw)


def save_family(model_type: str, root: Path, seed: int = 0) -> Path:
    """Write a tiny random model of the family plus a word-level tokenizer to root/model_type."""
    tok_dir = root / "tokenizer"
    if not tok_dir.exists():
        build_word_tokenizer(tok_dir, VOCAB)
    config = tiny_config(model_type)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _save(model, root / model_type, tok_dir)


def prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB - 1, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(path: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    outs = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=0, eos_token_id=None, min_new_tokens=NEW_TOKENS)
        outs.append(y[0, len(ids):].tolist())
    return outs


def engine_greedy(path: Path, prompt_ids: list[list[int]], speculative: bool) -> list[list[int]]:
    """Plain: 4-token blocks. Speculative: the model as its own draft (k=3), 8-token steps (chunked prefill)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    if speculative:
        core = make_core(path, path, k=3, block_size=4, max_num_batched_tokens=8)
        outs = run(core, prompt_ids, params, join_after=2, join_from=1)
    else:
        outs = run(make_core(path, block_size=4), prompt_ids, params)
    return [o.output_token_ids for o in outs]


def check_family(path: Path) -> str:
    """'exact', or 'refused: <reason>' (raises AssertionError naming the first differing run otherwise)."""
    ids = prompts()
    try:
        plain = engine_greedy(path, ids, speculative=False)
    except InvalidRequestError as exc:
        return f"refused: {exc.message}"
    ref = hf_greedy(path, ids)
    assert plain == ref, f"plain engine != HF generate: {plain} != {ref}"
    spec = engine_greedy(path, ids, speculative=True)
    assert spec == ref, f"self-speculative engine != HF generate: {spec} != {ref}"
    return "exact"
