"""Typed, frozen configuration. Field names follow vLLM where one exists (max_num_seqs, max_model_len, ...)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

GiB = 1 << 30
# The demo target's default method, the best measured on each kind of device (docs/benchmarks.md): on a GPU the
# EAGLE-3 drafter (the highest acceptance of the learned proposers on held-out chat); on CPU n-gram prompt lookup,
# whose drafts cost nothing to make: there every verified row costs ~15-25% of a step (the multi-row int4 products
# are multiply-add bound), so EAGLE-3's drafting and hidden-state upkeep cost about what its 0.3-0.5 acceptance
# saves (0.95-1.06x plain through the server), while n-gram lookup ran 1.09-1.16x / 1.15-1.21x / 1.01-1.15x plain at
# 1 / 4 / 16 streams ("The CPU default method"). A --draft-model without a method gets the draft model.
DEMO_METHOD = "eagle3"
DEMO_CPU_METHOD = "ngram"
AUTO = "auto"  # num_speculative_tokens: k adapts per request and per step (engine/spec_decode/adaptive.py)


def demo_method(device: str) -> str:
    """The demo target's default method on `device` ("auto": CUDA when torch sees a GPU, as the engine resolves it)."""
    if device == AUTO:
        import torch  # here, not at the top: only the demo default needs to know the device

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return DEMO_METHOD if str(device).startswith("cuda") else DEMO_CPU_METHOD


def parse_k(value, field: str = "num_speculative_tokens", minimum: int = 0) -> int | str:
    """'auto' or an integer >= minimum (from a flag, an env var, YAML or JSON)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == AUTO:
            return AUTO
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{field}: must be 'auto' or an integer, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{field}: must be 'auto' or an integer >= {minimum}, got {value!r}")
    return value


QUANTIZATIONS = ("int8", "int4")  # weight-only; engine/model/quantize.py

@dataclass(frozen=True)
class SpeculativeMethodConfig:
    """One loaded speculation method (vLLM's `speculative_config` keys). `method` is checked against the engine's
    registry when the engine loads it."""

    method: str
    model: str | None = None  # the draft model of method "draft"
    num_speculative_tokens: int | str = AUTO  # "auto": adapts within [0, max_speculative_tokens]; an int: fixed
    max_speculative_tokens: int = 4
    prompt_lookup_min: int = 2  # ngram: shortest suffix looked up
    prompt_lookup_max: int = 4  # ngram: longest suffix looked up (tried first)
    prompt_lookup_branches: int = 1  # ngram: > 1 proposes a tree of up to this many continuations
    medusa_heads: str | None = None  # medusa: the heads' directory (None: inside the target's, or the bundled ones)
    medusa_choices: str | None = None  # medusa: the tree, a JSON list of rank paths (None: the heads' own)
    medusa_typical_acceptance: bool = False  # medusa: Medusa's typical acceptance instead of the exact rule: LOSSY
    posterior_threshold: float = 0.09  # typical acceptance: accept x if p(x) > min(this, alpha * exp(-H(p)))
    posterior_alpha: float = 0.3
    speculative_eagle_topk: int = 1  # eagle3: > 1 drafts dynamic trees, expanding this many nodes per depth

    def __post_init__(self) -> None:
        check_medusa_fields(self, "speculative_config.")
        if not isinstance(self.method, str) or not self.method:
            raise ValueError("speculative_config.method: must be a non-empty string")
        object.__setattr__(self, "num_speculative_tokens",
                           parse_k(self.num_speculative_tokens, "speculative_config.num_speculative_tokens", 1))
        if not isinstance(self.max_speculative_tokens, int) or self.max_speculative_tokens < 1:
            raise ValueError("speculative_config.max_speculative_tokens: must be an integer >= 1")
        if not (isinstance(self.prompt_lookup_min, int) and isinstance(self.prompt_lookup_max, int)
                and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max):
            raise ValueError("speculative_config.prompt_lookup_min: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if not isinstance(self.prompt_lookup_branches, int) or self.prompt_lookup_branches < 1:
            raise ValueError("speculative_config.prompt_lookup_branches: must be an integer >= 1")
        if not isinstance(self.speculative_eagle_topk, int) or self.speculative_eagle_topk < 1:
            raise ValueError("speculative_config.speculative_eagle_topk: must be an integer >= 1")


    @property
    def adaptive(self) -> bool:
        return self.num_speculative_tokens == AUTO

    @property
    def k_max(self) -> int:
        """The most tokens the method proposes per step."""
        return self.max_speculative_tokens if self.adaptive else self.num_speculative_tokens


def check_medusa_fields(config, prefix: str = "") -> None:
    """Medusa's fields: typical acceptance (lossy) only where it was asked for by its flag, and sane posteriors."""
    for name in ("posterior_threshold", "posterior_alpha"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ValueError(f"{prefix}{name}: must be a number in (0, 1], got {value!r}")
    if not isinstance(config.medusa_typical_acceptance, bool):
        raise ValueError(f"{prefix}medusa_typical_acceptance: must be true or false")


def parse_speculative_config(text: str, max_speculative_tokens: int = 4) -> tuple[SpeculativeMethodConfig, ...]:
    """vLLM's --speculative-config: a JSON object, or a list of them (several methods; the first is the default)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"speculative_config: invalid JSON ({exc.msg} at position {exc.pos})") from None
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(x, dict) for x in items):
        raise ValueError("speculative_config: must be a JSON object or a non-empty list of objects")
    known = {f.name for f in fields(SpeculativeMethodConfig)}
    out = []
    for item in items:
        item = dict(item)
        if "draft_model" in item and "model" not in item:
            item["model"] = item.pop("draft_model")
        unknown = sorted(set(item) - known)
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]}: unknown key (known: {', '.join(sorted(known))})")
        if "method" not in item:
            raise ValueError("speculative_config.method: required")
        item.setdefault("max_speculative_tokens", max_speculative_tokens)
        out.append(SpeculativeMethodConfig(**item))
    return tuple(out)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF directory, hub id or .gguf file; None: the demo target (SmolLM2 GGUF)
    draft_model: str | None = None  # None with model=None: the bundled demo draft
    speculative_method: str | None = None  # a registry name or "none"; None: "draft" with a draft model, the demo
    # target's demo_method(device) without one
    num_speculative_tokens: int | str = AUTO  # "auto": k adapts per request and step; an int fixes it; 0: off
    max_speculative_tokens: int = 4  # the ceiling of "auto" (and the KV sizing for it)
    prompt_lookup_min: int = 2  # ngram: shortest suffix looked up
    prompt_lookup_max: int = 4  # ngram: longest suffix looked up
    prompt_lookup_branches: int = 1  # ngram: > 1 proposes a tree of up to this many continuations
    medusa_heads: str | None = None  # medusa: heads directory; None: the target directory's, or the bundled ones
    medusa_choices: str | None = None  # medusa: tree as a JSON list of rank paths; None: the heads' measured one
    medusa_typical_acceptance: bool = False  # medusa: typical acceptance (Medusa's own rule): LOSSY, off by default
    posterior_threshold: float = 0.09  # typical acceptance only
    posterior_alpha: float = 0.3  # typical acceptance only
    speculative_eagle_topk: int = 1  # eagle3: > 1 drafts dynamic trees (SGLang's flag); k is then the node budget
    speculative_config: str | None = None  # vLLM's JSON (object or list); replaces the flat speculation fields
    dtype: str = "auto"  # auto = bf16 where the device computes it natively, else fp16 (CUDA) or fp32 (CPU)
    quantization: str | None = "auto"  # weight-only int8 / int4 linear layers (CPU kernels); auto: a Q4_1 GGUF's own
    # 4-bit weights on CPU (int4), else none; None / "none": the dtype's weights
    quantization_dense_rows: int = 0  # > 0: forwards of at least this many rows run a dense copy of quantized layers
    enable_torch_compile: bool = False  # the target's forward through torch.compile (engine/model/compile.py)
    device: str = "auto"  # auto = cuda when present
    tensor_parallel_size: int = 1  # > 1: the target split over this many ranks (engine/parallel/), rank r on cuda:r
    kv_cache_memory: int | None = None  # bytes for target + draft KV; None: min(4 GiB, RAM / 4) on CPU
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_queue_len: int = 256
    block_size: int = 16
    enable_prefix_caching: bool = True  # reuse cached KV blocks of a repeated prefix (vLLM's flag and default)
    seed: int | None = None  # seeds the engine's generator (requests without their own seed)
    trust_remote_code: bool = False  # let transformers run code shipped with a model (off unless the operator asks)
    chat_template: str | None = None  # a Jinja file or inline template replacing the model's (vLLM's flag)

    def __post_init__(self) -> None:
        checks = [
            (self.max_speculative_tokens >= 1, "max_speculative_tokens", "must be >= 1"),
            (self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1"),
            (self.max_queue_len >= 0, "max_queue_len", "must be >= 0"),
            (self.block_size >= 1, "block_size", "must be >= 1"),
            (self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory", "must be > 0"),
            (self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be >= 2"),
            (1 <= self.prompt_lookup_min <= self.prompt_lookup_max, "prompt_lookup_min",
             "need 1 <= prompt_lookup_min <= prompt_lookup_max"),
            (self.prompt_lookup_branches >= 1, "prompt_lookup_branches", "must be >= 1"),
            (self.speculative_eagle_topk >= 1, "speculative_eagle_topk", "must be >= 1"),
            (self.quantization_dense_rows >= 0, "quantization_dense_rows", "must be >= 0 (0: packed kernels only)"),
            (self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1"),
            (self.tensor_parallel_size == 1 or not self.enable_torch_compile, "tensor_parallel_size",
             "enable_torch_compile is not supported with tensor parallelism (the all-reduces run in forward hooks)"),
            (self.tensor_parallel_size == 1 or self.device in ("auto", "cpu", "cuda"), "tensor_parallel_size",
             "with tensor parallelism, device must be auto, cpu or cuda (rank r runs on cuda:r)"),
        ]
        for ok, name, msg in checks:
            if not ok:
                raise ValueError(f"{name}: {msg}")
        check_medusa_fields(self)
        quant = None if self.quantization in (None, "", "none") else str(self.quantization).lower()
        if quant is not None and quant not in (AUTO, *QUANTIZATIONS):
            raise ValueError(f"quantization: {self.quantization!r} is not one of auto, none, {', '.join(QUANTIZATIONS)}")
        object.__setattr__(self, "quantization", quant)
        object.__setattr__(self, "num_speculative_tokens", parse_k(self.num_speculative_tokens))
        # the methods, parsed once here; their names are checked where the registry lives
        # (specserve.engine.spec_decode.registry.check_methods: the server's CLI before listening, the engine at load)
        object.__setattr__(self, "_speculative_methods", self._parse_methods())
        for m in self.speculative_methods:
            if m.method in ("draft", "draft_model") and m.model is None and self.model is not None:
                raise ValueError("draft_model: speculative method 'draft' needs a draft model")
            if m.medusa_typical_acceptance and m.method != "medusa":
                raise ValueError(f"medusa_typical_acceptance: only the medusa method has it (method {m.method!r})")
        if self.medusa_typical_acceptance and not any(m.method == "medusa" for m in self.speculative_methods):
            raise ValueError("medusa_typical_acceptance: set, but no medusa method is loaded")

    @property
    def speculative_methods(self) -> tuple[SpeculativeMethodConfig, ...]:
        """The methods to load, the default first: from `speculative_config`, else from the flat fields. A draft
        method without a model on the demo target means the bundled demo draft (the engine resolves it)."""
        return self._speculative_methods

    def _parse_methods(self) -> tuple[SpeculativeMethodConfig, ...]:
        if self.speculative_config:
            return parse_speculative_config(self.speculative_config, self.max_speculative_tokens)
        if self.num_speculative_tokens == 0:
            return ()
        method = self.speculative_method
        if method is None and self.model is None and self.draft_model is None:
            method = demo_method(self.device)
        elif method is None:
            method = "draft" if self.draft_model is not None else "none"
        if method.strip().lower() == "none":
            return ()
        return (SpeculativeMethodConfig(method, self.draft_model, self.num_speculative_tokens,
                                        self.max_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max,
                                        self.prompt_lookup_branches, self.medusa_heads, self.medusa_choices,
                                        self.medusa_typical_acceptance, self.posterior_threshold,
                                        self.posterior_alpha, self.speculative_eagle_topk),)

    @property
    def method(self) -> str:
        """The default method's name ("none" without speculation), before the registry canonicalises aliases."""
        methods = self.speculative_methods
        return methods[0].method if methods else "none"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # the Docker image sets 0.0.0.0
    port: int = 8000
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on /v1/* when set
    served_model_name: str | None = None  # default: the model path's last component (SmolLM2-135M-Instruct: demo)
    shutdown_timeout: float = 30.0  # seconds in-flight requests may finish after SIGTERM
    log_level: str = "info"
    log_format: str = "text"  # "text" | "json": one line per finished request either way
    api_key_file: str | None = None  # read the API key from this file (alternative to api_key)
    auth_probes: bool = False  # also require the API key on /health and /metrics
    cors_allow_origins: str | None = None  # comma-separated origins ("*" for any); None: CORS off
    max_request_bytes: int = 4 << 20  # larger request bodies get HTTP 413
    request_timeout: float | None = None  # seconds a request may take; then it ends with an error (504)
    log_prompts: bool = False  # put prompt and completion text in the request log lines (off: never)
    tool_call_parser: str = "hermes"  # how tool calls look in the model's output (server/tools.py)
    prefix_caching_per_key: bool = True  # with several API keys, requests of different keys never share cached KV
    responses_store_max_entries: int = 1000  # /v1/responses with store: true keeps at most this many (oldest out)
    responses_store_max_age: float = 3600.0  # ... for at most this many seconds
    # the transport (server/transport.py): what a connection may cost before it has sent a whole request
    max_connections: int | None = None  # None: from the descriptor limit (server/transport.py)
    max_header_count: int = 100  # more request headers: HTTP 431
    max_header_bytes: int = 32 << 10  # a larger request head: HTTP 431
    header_timeout: float = 20.0  # seconds for a request head to arrive (from accept, or its first byte)
    body_idle_timeout: float = 20.0  # seconds between two reads of a request body
    body_timeout: float = 120.0  # seconds for a whole request body to arrive
    keep_alive_timeout: float = 5.0  # seconds an idle connection is kept between requests

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port: must be in [0, 65535]")
        if self.shutdown_timeout < 0:
            raise ValueError("shutdown_timeout: must be >= 0")
        if self.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ValueError("log_level: must be one of critical, error, warning, info, debug, trace")
        if self.log_format not in ("text", "json"):
            raise ValueError("log_format: must be 'text' or 'json'")
        if self.tool_call_parser not in ("hermes", "llama3_json"):
            raise ValueError("tool_call_parser: must be 'hermes' or 'llama3_json'")
        if self.api_key and self.api_key_file:
            raise ValueError("api_key_file: give either api_key or api_key_file, not both")
        if self.max_request_bytes < 1:
            raise ValueError("max_request_bytes: must be >= 1")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError("request_timeout: must be > 0")
        if self.responses_store_max_entries < 0:
            raise ValueError("responses_store_max_entries: must be >= 0 (0: store nothing)")
        if self.responses_store_max_age <= 0:
            raise ValueError("responses_store_max_age: must be > 0")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("max_connections: must be >= 1")
        if self.max_header_count < 1:
            raise ValueError("max_header_count: must be >= 1")
        if self.max_header_bytes < 1024:
            raise ValueError("max_header_bytes: must be >= 1024")
        for name in ("header_timeout", "body_idle_timeout", "body_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0")


@dataclass(frozen=True)
class AppConfig:
    engine: EngineConfig
    server: ServerConfig
