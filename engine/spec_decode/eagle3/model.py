"""The EAGLE-3 drafter: one Llama decoder layer that reads the target's own hidden states.

Three target layers (low, middle, high: by default the inputs of layers 2, N//2 and N-3, HF's hidden_states[i]) are
concatenated and fused by `fc` (3 Ht -> H) into g. The layer's input at a row is [input_layernorm(embedding of the
token) ; hidden_norm(h)] (2H wide: q/k/v project from 2H), its residual is h itself, and h is g for a real row or the
drafter's own previous output (pre-norm) for a drafted one. `lm_head` covers a draft sub-vocabulary: draft id i is
target id i + d2t[i]. Embeddings are the target's (frozen), unless a checkpoint brings its own.

Rows and positions (this engine's convention, equivalent under RoPE to the EAGLE authors'): the row at position t
pairs g_{t-1} (the feature of position t - 1) with the token at t and predicts the token at t + 1. So the drafter's
K/V at position t depends on positions <= t only, as every paged-KV block must (prefix caching names a block by
its own tokens).

Checkpoints: vLLM's speculators format (config.json with `speculators_config` and `transformer_layer_config`,
weights `fc`, `layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d`) and the EAGLE authors' layout (a Llama config with
`draft_vocab_size`, weights `midlayer.*`), both in model.safetensors (or the authors' pytorch_model.bin).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from specserve.engine.spec_decode.dflash.model import rotate

WEIGHTS_FILE = "model.safetensors"
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")  # speculators variants this engine does not run


def default_layer_ids(num_target_layers: int) -> list[int]:
    """speculators' / vLLM's default: the inputs of layers 2, N // 2 and N - 3 (HF hidden_states indices)."""
    return [2, num_target_layers // 2, num_target_layers - 3]


def new_config(target_config, draft_vocab_size: int, intermediate_size: int | None = None,
               num_heads: int | None = None, num_kv_heads: int | None = None) -> LlamaConfig:
    """A drafter layer as wide as the target (what the fused features and shared embeddings need)."""
    heads = num_heads or target_config.num_attention_heads
    return LlamaConfig(vocab_size=target_config.vocab_size, hidden_size=target_config.hidden_size,
                       intermediate_size=intermediate_size or target_config.intermediate_size,
                       num_hidden_layers=1, num_attention_heads=heads,
                       num_key_value_heads=num_kv_heads or getattr(target_config, "num_key_value_heads", heads),
                       head_dim=target_config.hidden_size // heads, rms_norm_eps=target_config.rms_norm_eps,
                       max_position_embeddings=target_config.max_position_embeddings,
                       rope_parameters=dict(getattr(target_config, "rope_parameters", None) or {}) or None,
                       draft_vocab_size=draft_vocab_size, tie_word_embeddings=False)


@dataclass(frozen=True)
class Eagle3Format:
    layer_ids: list[int]  # HF hidden_states indices (the input of that target layer); [] = the default
    norm_before_residual: bool = False
    layout: str = "speculators"  # or "eagle" (the authors': midlayer.*)


class Eagle3Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        width = 2 * config.hidden_size  # [embedding ; hidden]
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)


class Eagle3Drafter(nn.Module):
    def __init__(self, config: LlamaConfig, fmt: Eagle3Format, target_hidden_size: int, own_embeddings: bool):
        super().__init__()
        self.config, self.format = config, fmt
        h = config.hidden_size
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        self.fc = nn.Linear(3 * target_hidden_size, h, bias=False)
        self.self_attn = Eagle3Attention(config)
        self.mlp = LlamaMLP(config)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))  # target id = i + d2t[i]
        self.embed_tokens = nn.Embedding(config.vocab_size, h) if own_embeddings else None
        self.rotary_emb = LlamaRotaryEmbedding(config)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[Vd] the target id of each draft id."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [..., D]."""
        flat = positions.reshape(1, -1)
        cos, sin = self.rotary_emb(torch.empty(0, dtype=dtype, device=flat.device), flat)
        return cos.view(*positions.shape, -1), sin.view(*positions.shape, -1)

    def kv_and_query(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """emb, hidden [..., N, H], positions [..., N] -> (q [..., N, heads, D], k, v [..., N, kv_heads, D],
        residual [..., N, H])."""
        attn = self.self_attn
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # [..., N, 2H]
        cos, sin = self.rope(positions, x.dtype)
        q = rotate(attn.q_proj(x).unflatten(-1, (attn.num_heads, attn.head_dim)), cos, sin)
        k = rotate(attn.k_proj(x).unflatten(-1, (attn.num_kv_heads, attn.head_dim)), cos, sin)
        v = attn.v_proj(x).unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        residual = self.hidden_norm(hidden) if self.format.norm_before_residual else hidden
        return q, k, v, residual

    def attend_and_finish(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, residual: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor:
        """q [S, Q, heads, D]; keys/values [S, L, kv_heads, D] (the rows' own included); mask [S, Q, L] (True =
        attend); residual [S, Q, H] -> the layer's output h_out [S, Q, H] (pre-norm: what the next depth reads)."""
        attn = self.self_attn
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.to(q.dtype).transpose(1, 2),
                                             values.to(q.dtype).transpose(1, 2), attn_mask=mask[:, None],
                                             scale=attn.scaling, enable_gqa=attn.num_heads != attn.num_kv_heads)
        h = residual + attn.o_proj(out.transpose(1, 2).flatten(-2))
        return h + self.mlp(self.post_attention_layernorm(h))

    def logits(self, h_out: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., Vd] over the draft vocabulary."""
        return self.lm_head(self.norm(h_out))


def _read_config(directory: Path) -> tuple[LlamaConfig, Eagle3Format, int | None]:
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(f"draft_model: {directory} has no config.json (an EAGLE-3 drafter directory expected)")
    raw = json.loads(path.read_text())
    if "speculators_config" in raw or "transformer_layer_config" in raw:
        algorithm = (raw.get("speculators_config") or {}).get("algorithm", "eagle3")
        if algorithm != "eagle3" or "transformer_layer_config" not in raw:
            raise ValueError(f"draft_model: {path}: a speculators checkpoint of algorithm {algorithm!r}, not eagle3")
        for flag in UNSUPPORTED_FLAGS:
            if raw.get(flag):
                raise ValueError(f"draft_model: {path}: {flag}=true is an EAGLE-3 variant this engine does not run")
        layer = dict(raw["transformer_layer_config"])
        layer["draft_vocab_size"] = raw.get("draft_vocab_size", layer.get("vocab_size"))
        fmt = Eagle3Format(list(raw.get("eagle_aux_hidden_state_layer_ids") or []),
                           bool(raw.get("norm_before_residual", False)), "speculators")
        target_hidden = raw.get("target_hidden_size")
    else:
        if "draft_vocab_size" not in raw:
            raise ValueError(f"draft_model: {path}: neither a speculators config nor an EAGLE-3 one "
                             "(draft_vocab_size missing)")
        layer, target_hidden = raw, raw.get("target_hidden_size")
        fmt = Eagle3Format(list(raw.get("eagle_aux_hidden_state_layer_ids") or []),
                           bool(raw.get("norm_before_residual", False)), "eagle")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"draft_model: {path}: EAGLE-3 drafters have one layer, this one "
                         f"{layer.get('num_hidden_layers')}")
    layer = {k: v for k, v in layer.items() if k not in ("architectures", "model_type")}
    return LlamaConfig(**layer), fmt, target_hidden


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    if (directory / WEIGHTS_FILE).is_file():
        return load_file(str(directory / WEIGHTS_FILE))
    if (directory / "pytorch_model.bin").is_file():
        return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"draft_model: {directory} has no {WEIGHTS_FILE} (or pytorch_model.bin)")


def _our_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """speculators' `layers.0.*` and the authors' `midlayer.*` -> this module's names; t2d is not needed."""
    out = {}
    for name, tensor in weights.items():
        name = name.removeprefix("model.")
        for prefix in ("layers.0.", "midlayer."):
            if name.startswith(prefix):
                name = name[len(prefix):]
        if name != "t2d":
            out[name] = tensor
    return out


def load_drafter(directory: str | Path, target_config, dtype: torch.dtype, device: torch.device) -> Eagle3Drafter:
    """A checkpoint in either format, checked against the target (ValueError naming draft_model)."""
    directory = Path(directory).expanduser()
    config, fmt, target_hidden = _read_config(directory)
    weights = _our_names(_read_weights(directory))
    hidden = target_config.hidden_size
    if (target_hidden or hidden) != hidden or config.vocab_size != target_config.vocab_size:
        raise ValueError(f"draft_model: {directory}: made for a target with hidden size {target_hidden or hidden} and "
                         f"vocabulary {config.vocab_size}; this target has {hidden} and {target_config.vocab_size}")
    n = target_config.num_hidden_layers
    ids = fmt.layer_ids or default_layer_ids(n)
    if len(ids) != 3 or not all(1 <= i <= n - 1 for i in ids):
        raise ValueError(f"draft_model: {directory}: eagle_aux_hidden_state_layer_ids {ids} must be 3 layers in "
                         f"[1, {n - 1}] of this {n}-layer target")
    fmt = Eagle3Format(list(ids), fmt.norm_before_residual, fmt.layout)
    drafter = Eagle3Drafter(config, fmt, hidden, own_embeddings="embed_tokens.weight" in weights)
    if "d2t" not in weights:  # the full vocabulary: identity
        weights["d2t"] = torch.zeros(drafter.draft_vocab_size, dtype=torch.long)
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not m.startswith("rotary_emb.")]
    if missing or unexpected:
        raise ValueError(f"draft_model: {directory}: weights do not match an EAGLE-3 drafter (missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]})")
    targets = drafter.draft_to_target
    if int(targets.min()) < 0 or int(targets.max()) >= target_config.vocab_size:
        raise ValueError(f"draft_model: {directory}: d2t maps draft ids outside the target's vocabulary")
    return drafter.to(device=device, dtype=dtype).eval()


def save_drafter(drafter: Eagle3Drafter, directory: str | Path, target_path: str = "") -> Path:
    """The speculators format (what vLLM loads), with the target's hidden-state layer ids written out."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    layer = drafter.config.to_dict()
    for key in ("draft_vocab_size", "architectures", "transformers_version"):
        layer.pop(key, None)
    raw = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "draft_vocab_size": drafter.draft_vocab_size, "norm_before_residual": drafter.format.norm_before_residual,
           "target_hidden_size": drafter.fc.in_features // 3,
           "eagle_aux_hidden_state_layer_ids": list(drafter.format.layer_ids), "transformer_layer_config": layer,
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}],
                                  "verifier": {"name_or_path": target_path}}}
    (directory / "config.json").write_text(json.dumps(raw, indent=1, default=str) + "\n")
    state = {}
    for name, tensor in drafter.state_dict().items():
        if name.startswith("rotary_emb.") or name.startswith("embed_tokens."):
            continue
        key = name if name.split(".")[0] in ("fc", "norm", "lm_head", "d2t") else "layers.0." + name
        state[key] = tensor.detach().contiguous().cpu()
    t2d = torch.zeros(drafter.config.vocab_size, dtype=torch.bool)
    t2d[drafter.draft_to_target.cpu()] = True
    state["t2d"] = t2d
    save_file(state, str(directory / WEIGHTS_FILE))
    return directory
