"""Building an engine's parts from its config, once: device and dtype, tokenizer, the target (quantized, sharded,
compiled as asked), the proposers and their controller and router, the KV pool and its allocator, the scheduler, the
request builder. EngineCore (engine/core.py) takes them and steps."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.config.schema import EngineConfig
from specserve.engine.admission import RequestBuilder
from specserve.engine.model.attention import PATTERN_ATTR
from specserve.engine.model.compile import compile_model
from specserve.engine.model.cpu_kernels import build as cpu_kernels
from specserve.engine.model.fast_layers import prefill_chunk_limit
from specserve.engine.model.loader import (
    check_model_path,
    default_kv_cache_memory,
    demo_model_paths,
    load_model,
    load_tokenizer,
    resolve_chat_template,
    resolve_device,
    resolve_dtype,
    resolve_quantization,
)
from specserve.engine.model.runner import ModelRunner
from specserve.engine.parallel.target import ShardedTarget
from specserve.engine.sample.grammar import grammar_compiler
from specserve.engine.sched.block_allocator import BlockAllocator
from specserve.engine.sched.kv_cache import KVPool, kv_bytes_per_token
from specserve.engine.sched.scheduler import Scheduler
from specserve.engine.spec_decode.base import ProposerContext
from specserve.engine.spec_decode.controller import AdaptiveController, CostSource
from specserve.engine.spec_decode.prediction import PredictionProposer
from specserve.engine.spec_decode.registry import NONE, load_proposers
from specserve.engine.spec_decode.router import ProposalRouter

log = logging.getLogger("specserve.engine")


@dataclass
class EngineParts:
    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    model_path: str
    tokenizer: object
    quantization: str | None
    sharded: ShardedTarget | None  # tensor_parallel_size > 1: the workers holding the other slices
    vocab_size: int
    default_method: str
    num_speculative_tokens: int
    controller: AdaptiveController
    router: ProposalRouter
    max_model_len: int
    allocator: BlockAllocator
    target: ModelRunner  # (or the sharded target's runner)
    compiled: bool
    scheduler: Scheduler
    generator: torch.Generator
    eos_token_ids: set[int]
    grammars: object
    builder: RequestBuilder


def assemble(config: EngineConfig, cost_source: CostSource | None) -> EngineParts:
    """`cost_source`: where adaptive k's costs come from (None: the engine's own timings; tests inject a model).
    Tensor-parallel workers started before a failure are stopped before the error propagates."""
    started: list[ShardedTarget] = []
    try:
        return _assemble(config, cost_source, started)
    except BaseException:
        for sharded in started:
            sharded.abort()
        raise


def _assemble(config: EngineConfig, cost_source: CostSource | None, started: list) -> EngineParts:
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    target_path, demo_draft = model_paths(config)
    check_model_path(target_path, "model")
    remote = config.trust_remote_code
    tokenizer = load_tokenizer(target_path, remote)
    if config.chat_template:
        tokenizer.chat_template = resolve_chat_template(config.chat_template)
    kernels = not config.enable_torch_compile and cpu_kernels.for_device(device) is not None
    quantization = resolve_quantization(config.quantization, target_path, device, dtype, kernels)
    if config.quantization == "auto" and quantization is not None:
        log.info("quantization auto: %s keeps its 4-bit weights (%s)", target_path, quantization)
    sharded = None
    if config.tensor_parallel_size > 1:  # the workers start loading their slices now, beside rank 0
        sharded = ShardedTarget(config, target_path, dtype, device, quantization)
        started.append(sharded)
    target = load_model(target_path, dtype, device, remote, quantization=quantization,
                        dense_from_rows=config.quantization_dense_rows,
                        shard=sharded.shard if sharded else None,
                        cpu_kernels=not config.enable_torch_compile)
    if sharded:
        sharded.attach(target)
    kv_heads = sharded.kv_heads(target.config) if sharded else None  # per rank; None: all
    vocab_size = target.config.vocab_size
    tree_attention = all(getattr(m, PATTERN_ATTR, None) is None for m in target.modules())
    ctx = ProposerContext(str(target_path), target.config, tokenizer, vocab_size, device, dtype, remote,
                          tree_attention, target.get_output_embeddings().weight, target.get_input_embeddings(),
                          quantization)
    proposers, adaptive = load_proposers(config, ctx, demo_draft)  # name -> proposer; default first
    default_method = next(iter(proposers), NONE)
    num_speculative_tokens = max([p.num_speculative_tokens for p in proposers.values()], default=0)
    controller = AdaptiveController(num_speculative_tokens,
                                    frozenset(n for n, p in proposers.items() if p.needs.tree),
                                    frozenset(n for n, p in proposers.items() if p.needs.cost_per_step),
                                    config.max_num_batched_tokens, cost_source)
    router = ProposalRouter(proposers, PredictionProposer(device), tree_attention, controller.observe_proposal)
    limits = [config.max_model_len, target.config.max_position_embeddings,
              *(p.max_model_len for p in proposers.values())]
    max_model_len = min(x for x in limits if x)
    per_token = kv_bytes_per_token(target.config, dtype, max(kv_heads) if kv_heads else None)
    per_token += sum(p.kv_bytes_per_token() for p in proposers.values())
    budget = config.kv_cache_memory or default_kv_cache_memory(device)
    num_blocks = budget // (per_token * config.block_size)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory: {budget} bytes hold no block of {config.block_size} tokens")
    allocator = BlockAllocator(num_blocks, config.block_size, config.enable_prefix_caching)
    hidden_layers = tuple(sorted({i for p in proposers.values() for i in p.needs.hidden_layers}))
    runner = ModelRunner(target, KVPool.allocate(target.config, num_blocks, config.block_size, dtype, device,
                                                 kv_heads and kv_heads[0]), device, vocab_size,
                         hidden_layers=hidden_layers)
    if sharded:
        runner = sharded.runner(runner)
    for p in proposers.values():
        p.bind_kv(num_blocks, config.block_size)
    compiled = config.enable_torch_compile and compile_model(target, device)
    runner.stable_shapes = compiled
    scheduler = Scheduler(allocator, config.max_num_seqs, config.max_num_batched_tokens, max_model_len,
                          {n: p.needs.prefix_kv for n, p in router.kv_proposers.items()},
                          prefill_chunk_limit(target))
    seed = config.seed if config.seed is not None else random.randrange(1 << 62)
    generator = torch.Generator(device=device).manual_seed(seed)
    eos_token_ids = eos_ids(target, tokenizer)
    grammars = grammar_compiler(tokenizer, vocab_size, eos_token_ids)
    builder = RequestBuilder(tokenizer, vocab_size, max_model_len, default_method,
                             {n: p.num_speculative_tokens for n, p in proposers.items()}, adaptive,
                             allocator.num_blocks, allocator.block_size, frozenset(eos_token_ids), device,
                             f"{Path(target_path).resolve()}|{dtype}|{quantization}|{config.quantization_dense_rows}|"
                             f"{config.trust_remote_code}",
                             grammars)
    return EngineParts(config, device, dtype, str(target_path), tokenizer, quantization, sharded, vocab_size,
                       default_method, num_speculative_tokens, controller, router, max_model_len, allocator, runner,
                       compiled, scheduler, generator, eos_token_ids, grammars, builder)


def model_paths(config: EngineConfig) -> tuple[Path | str, Path | str | None]:
    """(target, the draft a draft method without a model uses: the bundled one for the demo target)."""
    if config.model is not None:
        return config.model, None
    return demo_model_paths()


def eos_ids(model, tokenizer) -> set[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
