"""The DFlash drafter (block diffusion, arXiv 2602.06036), in z-lab/dflash's checkpoint format.

A stack of Qwen3-style layers with no embedding and no LM head of its own (it borrows the target's, frozen). Its
context is the target's hidden states at `target_layer_ids` (decoder-layer outputs, HF's hidden_states[i + 1]),
concatenated and projected by `fc` (n*H -> H, no bias), then `hidden_norm`. In every layer the keys and values are
[k/v projections of the context ; k/v of the block], the queries come from the block only, and the block attends
to itself bidirectionally. A block is [last emitted token, MASK x (B - 1)]: one forward fills it; position k predicts
the token k places after the anchor.

The context K/V of a position depends only on the target's features there, so a server projects them once per
kept token (engine/spec_decode/dflash/) and training projects whole sequences (train/dflash.py); both then
call the same `forward` with the keys they gathered and a mask.

Checkpoint: `config.json` (a Qwen3 config + `architectures: ["DFlashDraftModel"]`, `block_size`,
`num_target_layers`, `dflash_config: {mask_token_id, target_layer_ids}`; optional `layer_types` / `sliding_window`)
and `model.safetensors`. Ours adds `dflash_vocab.safetensors` (int64 "d2t": the target ids the LM head is
restricted to; drafts are one-hot, so a sub-vocabulary head stays lossless).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3Config, Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

ARCHITECTURE = "DFlashDraftModel"
WEIGHTS_FILE = "model.safetensors"
VOCAB_FILE = "dflash_vocab.safetensors"


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's choice: evenly spaced from layer 1 to L - 3 (the middle layer for a 1-layer drafter)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end - start < num_draft_layers - 1:  # a target too shallow for that rule: spread over all its layers
        start, end = 0, num_target_layers - 1
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [..., N, heads, D] with cos/sin [..., N, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        types = getattr(config, "layer_types", None)
        sliding = types is not None and types[layer_idx] == "sliding_attention"
        self.window = config.sliding_window if sliding else None

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., N, H] (context or block rows) -> (k, v) [..., N, kv_heads, D], k normalised and rotated."""
        shape = (*x.shape[:-1], self.num_kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape))
        return rotate(k, cos, sin), self.v_proj(x).view(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [S, Q, H] block rows; ctx_k/ctx_v [S, L, kv_heads, D]; mask [S, Q, L + Q] (True = attend) -> [S, Q, H]."""
        s, q_len, _ = x.shape
        q = rotate(self.q_norm(self.q_proj(x).view(s, q_len, self.num_heads, self.head_dim)), cos, sin)
        k_new, v_new = self.kv(x, cos, sin)
        k = torch.cat([ctx_k.to(x.dtype), k_new], dim=1).transpose(1, 2)  # [S, kvh, L + Q, D]
        v = torch.cat([ctx_v.to(x.dtype), v_new], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=self.scaling,
                                             enable_gqa=self.num_heads != self.num_kv_heads)  # [S, heads, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(s, q_len, -1))


class DFlashLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        extra = getattr(config, "dflash_config", None) or {}
        self.block_size = int(config.block_size)
        self.mask_token_id = extra.get("mask_token_id")
        self.target_layer_ids = list(extra.get("target_layer_ids") or default_target_layer_ids(
            config.num_target_layers, config.num_hidden_layers))
        self.layers = nn.ModuleList(DFlashLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)

    @property
    def windows(self) -> list[int | None]:
        return [layer.self_attn.window for layer in self.layers]

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [..., N] -> cos, sin [..., N, D]."""
        flat = positions.reshape(1, -1)
        cos, sin = self.rotary_emb(torch.empty((), dtype=dtype, device=positions.device), flat)
        return cos.view(*positions.shape, -1), sin.view(*positions.shape, -1)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """[..., n * H] target features (layers concatenated in target_layer_ids order) -> [..., H]."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Target features [..., N, n * H] at `positions` [..., N] -> per layer (k, v) [..., N, kv_heads, D]."""
        ctx = self.context(features)
        cos, sin = self.rope(positions, ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
                masks: list[torch.Tensor]) -> torch.Tensor:
        """x [S, Q, H] block embeddings at `positions` [S, Q]; ctx_kv per layer [S, L, kv_heads, D]; masks per layer
        [S, Q, L + Q] (layers differ only with sliding windows) -> final-norm hidden states [S, Q, H]."""
        cos, sin = self.rope(positions, x.dtype)
        for layer, (k, v), mask in zip(self.layers, ctx_kv, masks):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)


def window_mask(mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Restrict mask [S, Q, K] to keys within `window` positions behind each query (None: unchanged)."""
    if window is None:
        return mask
    return mask & (q_pos[:, :, None] - k_pos[:, None, :] < window)


def block_masks(drafter: DFlashDrafter, ctx_visible: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                same_block: torch.Tensor) -> list[torch.Tensor]:
    """Per-layer masks [S, Q, L + Q]: ctx_visible [S, Q, L] (which context keys each query may see), same_block
    [S, Q, Q] (which block keys), key positions k_pos [S, L + Q]; windows applied per layer."""
    full = torch.cat([ctx_visible, same_block], dim=2)
    by_window = {w: window_mask(full, q_pos, k_pos, w) for w in set(drafter.windows)}
    return [by_window[w] for w in drafter.windows]


# -- checkpoints ---------------------------------------------------------------------------------------------------

def read_config(directory: str | Path, field: str = "draft_model") -> Qwen3Config:
    path = Path(directory).expanduser() / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{field}: no DFlash drafter at {directory} (config.json missing)")
    raw = json.loads(path.read_text())
    if ARCHITECTURE not in (raw.get("architectures") or []):
        raise ValueError(f"{field}: {directory} is not a DFlash drafter (architectures {raw.get('architectures')}, "
                         f"expected {ARCHITECTURE}); for a draft model use --speculative-method draft")
    for key in ("block_size", "hidden_size", "num_hidden_layers"):
        if not isinstance(raw.get(key), int) or raw[key] < 1:
            raise ValueError(f"{field}: {directory}/config.json: {key} must be a positive integer")
    if raw["block_size"] < 2:
        raise ValueError(f"{field}: {directory}/config.json: block_size must be >= 2")
    extra = raw.get("dflash_config") or {}
    if not isinstance(extra.get("mask_token_id"), int):
        raise ValueError(f"{field}: {directory}/config.json: dflash_config.mask_token_id is required")
    if "num_target_layers" not in raw and not extra.get("target_layer_ids"):
        raise ValueError(f"{field}: {directory}/config.json: needs num_target_layers or dflash_config.target_layer_ids")
    return Qwen3Config.from_dict(raw)


def load_drafter(directory: str | Path, dtype: torch.dtype, device: torch.device, field: str = "draft_model"
                 ) -> tuple[DFlashDrafter, torch.Tensor | None]:
    """-> (the drafter, d2t [Vc] or None). Weights: model.safetensors, or a sharded safetensors index."""
    directory = Path(directory).expanduser()
    drafter = DFlashDrafter(read_config(directory, field))
    state = {}
    index = directory / f"{WEIGHTS_FILE}.index.json"
    if (directory / WEIGHTS_FILE).is_file():
        state = load_file(str(directory / WEIGHTS_FILE))
    elif index.is_file():
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            state.update(load_file(str(directory / shard)))
    else:
        raise FileNotFoundError(f"{field}: no {WEIGHTS_FILE} in {directory}")
    state = {k.removeprefix("model."): v for k, v in state.items()}
    result = drafter.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if "rotary_emb" not in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"{field}: {directory}: weights do not match the config (missing {missing[:4]}, "
                         f"unexpected {result.unexpected_keys[:4]})")
    d2t = None
    if (directory / VOCAB_FILE).is_file():
        d2t = load_file(str(directory / VOCAB_FILE))["d2t"].long()
    drafter.rotary_emb = Qwen3RotaryEmbedding(drafter.config)  # inv_freq in fp32 before the dtype cast
    inv_freq = drafter.rotary_emb.inv_freq
    drafter = drafter.to(device=device, dtype=dtype).eval()
    drafter.rotary_emb.inv_freq = inv_freq.to(device)  # RoPE angles stay fp32 (cos/sin are cast per call)
    return drafter, (None if d2t is None else d2t.to(device))


def check_against_target(drafter: DFlashDrafter, target_config, vocab_size: int, field: str = "draft_model") -> None:
    """The drafter reads the target's layers, embedding and LM head: they must be the ones it was trained on."""
    cfg = drafter.config
    if cfg.hidden_size != target_config.hidden_size:
        raise ValueError(f"{field}: the DFlash drafter's hidden_size {cfg.hidden_size} != the target's "
                         f"{target_config.hidden_size} (it shares the target's embedding and LM head)")
    layers = target_config.num_hidden_layers
    expected = getattr(cfg, "num_target_layers", None)
    if expected is not None and expected != layers:
        raise ValueError(f"{field}: the DFlash drafter was built for a {expected}-layer target; this one has {layers}")
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < layers]
    if bad:
        raise ValueError(f"{field}: target_layer_ids {bad} are outside the target's {layers} layers")
    if not 0 <= drafter.mask_token_id < vocab_size:
        raise ValueError(f"{field}: mask_token_id {drafter.mask_token_id} is outside the target's vocabulary "
                         f"({vocab_size})")


def save_drafter(drafter: DFlashDrafter, directory: str | Path, d2t: torch.Tensor | None = None,
                 extra: dict | None = None) -> None:
    """Writes z-lab's format (config.json + model.safetensors), plus our d2t file when the head is restricted."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    raw = drafter.config.to_dict()
    raw.update({"architectures": [ARCHITECTURE], "block_size": drafter.block_size,
                "dflash_config": {"mask_token_id": drafter.mask_token_id,
                                  "target_layer_ids": drafter.target_layer_ids}, **(extra or {})})
    raw.pop("dtype", None)
    raw["torch_dtype"] = "bfloat16"
    (directory / "config.json").write_text(json.dumps(raw, indent=1, default=str) + "\n")
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()
             if "rotary_emb" not in k}
    save_file(state, str(directory / WEIGHTS_FILE))
    if d2t is not None:
        save_file({"d2t": d2t.long().cpu().contiguous()}, str(directory / VOCAB_FILE))


def new_config(target_config, num_layers: int, block_size: int, mask_token_id: int,
               target_layer_ids: list[int] | None = None, intermediate_size: int | None = None) -> Qwen3Config:
    """A drafter config for `target_config` (a Llama/Qwen-style HF config): the target's width, heads and RoPE."""
    t = target_config
    layers = target_layer_ids or default_target_layer_ids(t.num_hidden_layers, num_layers)
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    rope = dict(getattr(t, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    return Qwen3Config(vocab_size=t.vocab_size, hidden_size=t.hidden_size,
                       intermediate_size=intermediate_size or t.intermediate_size, num_hidden_layers=num_layers,
                       num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
                       head_dim=head_dim, rms_norm_eps=t.rms_norm_eps,
                       attention_bias=bool(getattr(t, "attention_bias", False)),
                       hidden_act=getattr(t, "hidden_act", "silu"),
                       max_position_embeddings=t.max_position_embeddings, rope_parameters=rope,
                       tie_word_embeddings=False, architectures=[ARCHITECTURE], block_size=block_size,
                       num_target_layers=t.num_hidden_layers,
                       dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": list(layers)})
