"""Loads HF causal LMs and tokenizers, resolves `auto` device/dtype, and checks a draft against its target."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.attention import ATTN_IMPLEMENTATION, register_attention
from engine.errors import InvalidRequestError

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "float64": torch.float64}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` = bf16 where the device supports it (on this kind of CPU bf16 matmuls are several times faster)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16
    if dtype not in _DTYPES:
        raise InvalidRequestError(f"dtype: unknown dtype {dtype!r}; use one of auto, {', '.join(_DTYPES)}", "dtype")
    return _DTYPES[dtype]


def check_model_path(path: str | os.PathLike, field: str = "model") -> None:
    """A path-like name must exist locally; anything else is left to transformers as a hub id."""
    text = str(path)
    looks_local = text.startswith((".", "/", "~")) or text.count("/") > 1  # hub ids are "name" or "org/name"
    if looks_local and not Path(text).expanduser().exists():
        raise FileNotFoundError(f"{field}: no model directory at {text}")


def load_model(path: str | os.PathLike, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False):
    register_attention()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, trust_remote_code=trust_remote_code)
    if not getattr(model, "_supports_attention_backend", False):
        raise InvalidRequestError(
            f"model {path}: {type(model).__name__} does not route attention through transformers' "
            "AttentionInterface, which the engine's paged KV cache needs", "model")
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model.to(device).eval()


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False):
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def check_draft_compatible(target_path, draft_path, target_tok, target_cfg, draft_cfg) -> None:
    """Draft and target must share the vocabulary: same tokens for the same ids."""
    if Path(draft_path, "tokenizer.json").exists() or Path(draft_path, "tokenizer_config.json").exists():
        draft_tok = load_tokenizer(draft_path)
        if draft_tok.get_vocab() != target_tok.get_vocab():
            raise InvalidRequestError(
                f"draft_model {draft_path} does not share the target's tokenizer vocabulary ({target_path})",
                "draft_model")
    if draft_cfg.vocab_size < len(target_tok):
        raise InvalidRequestError(
            f"draft_model {draft_path}: vocab_size {draft_cfg.vocab_size} is smaller than the target tokenizer's "
            f"{len(target_tok)} tokens", "draft_model")


def bundled_model_paths() -> tuple[Path, Path]:
    """The demo pair: $SPECSERVE_MODELS_DIR, else models/ of a source checkout."""
    root = Path(os.environ.get("SPECSERVE_MODELS_DIR") or Path(__file__).resolve().parents[1] / "models")
    return root / "demo-target", root / "demo-draft"


def default_kv_cache_memory(device: torch.device) -> int:
    """A modest default: min(4 GiB, RAM / 4) on CPU (RAM = the container's limit when there is one); half of the
    free memory on CUDA."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(4 << 30, min(ram, _cgroup_memory_limit() or ram) // 4)


def _cgroup_memory_limit() -> int | None:
    """A container's memory limit (cgroup v2, then v1), so the default fits inside the container, not the node."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):
            return int(text)
    return None
