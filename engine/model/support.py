"""Which HF causal LMs the paged attention serves exactly, checked at load: config rules first, then one 2-token probe
forward that records each layer's mask pattern (from the mask HF itself builds) and refuses anything else, so an
unsupported model is refused with the feature it needs instead of producing silently different tokens."""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from specserve.engine.errors import InvalidRequestError
from specserve.engine.model.attention import PATTERN_ATTR, SeqChunk, build_metadata, paged_attention, register_attention
from specserve.engine.sched.kv_cache import KVPool

ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}
# config fields that only exist for layers keeping state outside attention (KV), which use_cache=False drops.
# KV sharing (Gemma 3n's num_kv_shared_layers) is served: HF hands the shared K/V of the current tokens to the
# sharing layer's attention, which stores its own copy (exact; the memory sharing would save is not saved).
_STATE_FIELD_PREFIXES = ("mamba_", "ssm_", "conv_", "linear_", "mlstm_", "slstm_", "rwkv_", "lru_", "xlstm")
_STATE_FIELDS = {"layers_block_type", "hybrid_override_pattern", "attn_layer_period", "attn_layer_indices",
                 "full_attn_idxs", "block_types", "layers_num_conv", "d_conv", "conv1d_width", "linear_attn_config"}
_GEOMETRY_FIELDS = {"head_dim", "num_key_value_heads", "num_attention_heads", "hidden_size"}
_PROBE = "specserve_probe"  # attention and mask implementation names used only during the probe forward
_MAX_HORIZON = 1 << 20  # mask patterns are identified up to this position (or max_position_embeddings if smaller)


def unsupported_features(config) -> list[str]:
    """Names of the features of `config` (an HF config) the engine cannot serve exactly; empty when supported."""
    found = []
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if type(text) is not type(config):  # encoder-decoder configs hand back a decoder view of their own type
        found.append(f"a multimodal/composite model ({type(config).__name__}): serve its text model "
                     f"({getattr(text, 'model_type', type(text).__name__)}) instead")
        config = text
    per_layer = sorted(set(getattr(config, "per_layer_attributes", None) or ()) & _GEOMETRY_FIELDS)
    if per_layer:
        found.append(f"per-layer K/V geometry ({', '.join(per_layer)} vary across layers)")
        return found
    types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in types if t not in ATTENTION_LAYER_TYPES})
    if other:
        found.append(f"non-attention layers ({', '.join(other)}) keep state outside the KV cache")
    state = sorted(k for k, v in config.to_dict().items()
                   if v not in (None, False, [], 0) and (k in _STATE_FIELDS or k.startswith(_STATE_FIELD_PREFIXES)))
    if state and not types:  # with layer_types, HF's own cache trusts them: only their non-attention types count
        found.append(f"recurrent/convolution state outside attention ({', '.join(state[:3])})")
    if getattr(config, "kv_lora_rank", None):
        found.append("multi-head latent attention (kv_lora_rank)")
    v_dim = getattr(config, "v_head_dim", None)
    k_dim = getattr(config, "qk_head_dim", None) or getattr(config, "head_dim", None)
    if v_dim and k_dim and v_dim != k_dim:
        found.append(f"value head size {v_dim} != key head size {k_dim}")
    return found


def check_supported(model_or_config) -> None:
    """Raise InvalidRequestError(param="model") naming every unsupported feature of a loaded model or a config.
    For a model this also runs the probe forward, which records on each attention module the mask pattern the
    paged attention applies: a model is served only after passing this check (load_model runs it)."""
    config = getattr(model_or_config, "config", model_or_config)
    found = unsupported_features(config)
    if not found and isinstance(model_or_config, torch.nn.Module):
        found = probe_attention(model_or_config)
    if found:
        name = getattr(config, "model_type", None) or type(config).__name__
        raise InvalidRequestError(f"model: {name} is not supported by the paged attention: {'; '.join(found)}",
                                  "model")


class _MaskSpy:
    """Stands in for the mask HF builds during the probe: keeps the index function HF would evaluate."""

    def __init__(self, mask_function):
        self.mask_function = mask_function

    def __getitem__(self, item):  # some decoder layers slice the mask to the key length
        return self


class _UnsupportedMask(Exception):
    pass


def probe_attention(model) -> list[str]:
    """One 2-token forward through the paged attention on a one-block pool: records each layer's mask pattern and
    returns the problems found (a mask that is not causal/windowed/chunked, attention arguments the paged attention
    refuses, K/V that do not fit the pool, layers whose attention runs twice or never)."""
    register_attention()
    config = model.config
    horizon = min(getattr(config, "max_position_embeddings", None) or 1 << 16, _MAX_HORIZON)
    patterns: dict[int, tuple | None] = {}

    def spy_mask(*args, mask_function=None, **kwargs):
        return _MaskSpy(mask_function)

    def probe(module, query, key, value, attention_mask, **kwargs):
        pattern = None  # no mask built: HF's SDPA runs plain causal (a mask tensor of its own is refused below)
        if isinstance(attention_mask, _MaskSpy):
            if id(attention_mask) not in patterns:
                patterns[id(attention_mask)] = mask_pattern(attention_mask.mask_function, horizon)
            pattern, attention_mask = patterns[id(attention_mask)], None
        setattr(module, PATTERN_ATTR, pattern)
        return paged_attention(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(_PROBE, probe)
    AttentionMaskInterface.register(_PROBE, spy_mask)
    previous = config._attn_implementation
    param = next(model.parameters())
    found = []
    model.set_attn_implementation(_PROBE)
    try:
        kv = KVPool.allocate(config, 1, 2, param.dtype, param.device)
        md, positions = build_metadata(kv, [SeqChunk([0], 0, 2)], param.device)
        with torch.inference_mode():
            model(input_ids=torch.tensor([[1, 2]], device=param.device), position_ids=positions[None],
                  use_cache=False, logits_to_keep=1, specserve_metadata=md)
        missing = sorted(set(range(len(kv.key_store))) - md.layers_seen)
        if missing:
            found.append(f"layers {missing[:8]} never run the attention interface")
        found += _disagreements(model, horizon)
    except _UnsupportedMask as exc:
        found.append(str(exc))
    except Exception as exc:  # noqa: BLE001 - whatever stops the probe forward is the reason for refusing
        text = str(exc).strip().splitlines()
        if "_MaskSpy" in str(exc):
            found.append("the model computes its own attention mask or bias from HF's mask")
        else:
            found.append(f"the probe forward failed ({type(exc).__name__}: {text[0][:200] if text else ''})")
    finally:
        model.set_attn_implementation(previous)
    return found


def config_pattern(config, layer_idx: int) -> tuple[str, int] | None:
    """The pattern HF's own KV cache gives a layer (transformers' get_layer_types_and_kwargs): decode steps in
    generate() see only what that cache keeps, so the engine must match it as well as the mask."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None) or None
    chunk = getattr(config, "attention_chunk_size", None) or None
    kind = types[layer_idx] if types else ("sliding_attention" if window else "chunked_attention" if chunk else None)
    if kind == "sliding_attention":
        return "window", window
    if kind == "chunked_attention":
        return "chunk", chunk
    return None


def _disagreements(model, horizon: int) -> list[str]:
    """Layers whose mask (what HF's prefill applies) and cache (what its decode steps keep) differ: HF generate()
    itself is then not one attention pattern, so no engine output could match it."""
    for module in model.modules():
        if hasattr(module, PATTERN_ATTR):
            mask = getattr(module, PATTERN_ATTR)
            cache = config_pattern(model.config, module.layer_idx)
            if cache is not None and cache[1] >= horizon:
                cache = None  # a window or chunk no sequence can exceed
            if mask != cache:
                return [f"layer {module.layer_idx}: the model's attention mask ({_describe(mask)}) and its config's "
                        f"KV cache ({_describe(cache)}) disagree"]
    return []


def _describe(pattern: tuple[str, int] | None) -> str:
    return "causal" if pattern is None else f"{'sliding window' if pattern[0] == 'window' else 'chunks'} {pattern[1]}"


def mask_pattern(mask_function, horizon: int) -> tuple[str, int] | None:
    """Identify an HF index mask function (batch, head, q_idx, kv_idx) -> bool as None (causal), ("window", w)
    (kv in (q - w, q]) or ("chunk", c) (kv in [q // c * c, q]) by evaluating it on rows of query positions up to
    `horizon`; raise _UnsupportedMask for anything else (bidirectional, sparse, padding-dependent, ...)."""
    def row(q: int) -> torch.Tensor:
        kv = torch.arange(q + 2)
        try:
            out = mask_function(torch.tensor(0), torch.tensor(0), torch.tensor(q), kv)
        except Exception as exc:  # noqa: BLE001 - an index function we cannot evaluate is an unsupported mask
            raise _UnsupportedMask(f"attention mask not recognised ({type(exc).__name__})") from exc
        return torch.as_tensor(out, dtype=torch.bool).expand(q + 2)

    def first_visible(q: int) -> int:
        return int(row(q).int().argmax())

    top = horizon - 1
    lo = first_visible(top)
    candidates = [None] if lo == 0 else [("window", top - lo + 1)]
    if lo > 0:
        candidates.append(("chunk", lo - first_visible(lo - 1)))
    for cand in candidates:
        size = cand[1] if cand else 1
        if size < 1:
            continue
        probe_qs = {0, 1, 2, 3, size - 1, size, size + 1, 2 * size - 1, 2 * size, 2 * size + 1, 3 * size + 2,
                    top - 1, top} | set(torch.randint(0, horizon, (8,), generator=torch.Generator().manual_seed(0))
                                         .tolist())
        if all(torch.equal(row(q), _expected_row(cand, q)) for q in sorted(probe_qs) if 0 <= q <= top):
            return cand
    raise _UnsupportedMask("attention mask is not causal, sliding-window or chunked")


def _expected_row(pattern: tuple[str, int] | None, q: int) -> torch.Tensor:
    kv = torch.arange(q + 2)  # [q + 2]: every earlier key, the query itself, one future key
    visible = kv <= q
    if pattern is not None and pattern[0] == "window":
        visible &= kv > q - pattern[1]
    elif pattern is not None:
        visible &= kv // pattern[1] == q // pattern[1]
    return visible
