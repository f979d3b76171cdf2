"""Tensor-parallel sharding of an HF decoder by its own plan (`config.base_model_tp_plan`, e.g. Llama's
`layers.*.self_attn.q_proj: colwise`), done on plain `nn.Linear` weights: no DTensor, no change to the modules.

- Attention is split by whole heads. A rank gets a contiguous range of query heads and the K/V heads they read
  (`head_ranges`): whole K/V groups per rank when there are at least as many K/V heads as ranks (uneven counts are
  fine: SmolLM2's 9 query / 3 K/V heads over 2 ranks are 6 + 3 / 2 + 1), or one K/V head replicated on the ranks
  that share its group when there are fewer (vLLM's rule). HF attention reshapes with `-1` heads, and the paged
  attention reads the head counts off the tensors, so the modules run their slice unchanged.
- The MLP's intermediate features are split in runs of `unit` (32 for int4 groups) as evenly as they go.
- `colwise` layers keep their output rows (and bias) of the rank's range; `rowwise` layers keep the input columns of
  it, their bias only on rank 0, and their output is summed over the ranks (`attach_all_reduce`: one all-reduce per
  attention block and one per MLP). After each sum the residual stream is whole on every rank, so hidden states read
  by a proposer need no gather.

Sharding happens on the dtype's weights before any quantization packs them (load_model's `shard` hook); embeddings,
norms and the LM head stay whole on every rank.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
from torch import nn

from specserve.engine.errors import InvalidRequestError
from specserve.engine.sched.kv_cache import kv_geometry

FIELD = "tensor_parallel_size"
SHARDED = ("colwise", "rowwise")
REPLICATED = ("replicated_with_grad_allreduce",)  # per-head norms (Qwen3, Gemma 3): the same on every rank


@dataclass(frozen=True)
class HeadRange:
    """Rank's query heads [q_start, q_end) and K/V heads [kv_start, kv_end) of the full model."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int


def even_split(total: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """[0, total) in `parts` contiguous ranges of whole `unit`s (the first ranges one unit longer); pure."""
    if total % unit:
        unit = 1
    units = total // unit
    bounds, start = [], 0
    for p in range(parts):
        n = units // parts + (1 if p < units % parts else 0)
        bounds.append((start * unit, (start + n) * unit))
        start += n
    return bounds


def head_ranges(num_heads: int, num_kv_heads: int, world: int) -> list[HeadRange]:
    """Each rank's heads; raises where no split by whole heads keeps every query head with its own K/V head."""
    group = num_heads // num_kv_heads
    if num_heads % num_kv_heads:
        raise InvalidRequestError(f"{FIELD}: {num_heads} query heads are not a multiple of {num_kv_heads} K/V heads",
                                  FIELD)
    if num_kv_heads >= world:
        kv = even_split(num_kv_heads, world)
        return [HeadRange(a * group, b * group, a, b) for a, b in kv]
    if world % num_kv_heads or group % (world // num_kv_heads):
        raise InvalidRequestError(
            f"{FIELD}: {world} ranks cannot share {num_kv_heads} K/V heads of {group} query heads each evenly (use a "
            f"size that divides {num_heads} query heads with each rank's heads inside one K/V group)", FIELD)
    share = world // num_kv_heads  # ranks per K/V head, each holding a copy of it
    per_rank = group // share
    return [HeadRange(r * per_rank, (r + 1) * per_rank, r // share, r // share + 1) for r in range(world)]


def sharding_plan(model) -> dict[str, str]:
    """Module name (as in model.named_modules()) -> "colwise" | "rowwise" from the model's own plan; raises where
    the model has none or names a style this engine does not split."""
    config = model.config
    plan = getattr(config, "base_model_tp_plan", None) or {}
    name = type(model).__name__
    if not plan:
        raise InvalidRequestError(f"{FIELD}: {name} has no tensor-parallel plan (config.base_model_tp_plan), so the "
                                  "engine does not know how to split it; serve it with tensor_parallel_size 1", FIELD)
    prefix = model.base_model_prefix + "."
    out = {}
    for module_name, module in model.named_modules():
        local = module_name.removeprefix(prefix)
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(local, pattern)), None)
        if style is None or style in REPLICATED:
            continue
        if style not in SHARDED or type(module) is not nn.Linear:
            raise InvalidRequestError(f"{FIELD}: {name}'s plan splits {module_name} ({type(module).__name__}) "
                                      f"{style!r}; the engine splits plain Linear layers colwise or rowwise only",
                                      FIELD)
        out[module_name] = style
    if not out:
        raise InvalidRequestError(f"{FIELD}: {name}'s tensor-parallel plan matched none of its layers", FIELD)
    return out


def check_shardable(model, world: int) -> None:
    """Raises (naming the field) unless `model` splits over `world` ranks."""
    heads, kv_heads = model.config.num_attention_heads, kv_geometry(model.config)[1]
    head_ranges(heads, kv_heads, world)
    sharding_plan(model)


def local_kv_heads(config, world: int) -> list[int]:
    """K/V heads each rank's KV pool holds."""
    _, kv_heads, _ = kv_geometry(config)
    return [r.kv_end - r.kv_start for r in head_ranges(config.num_attention_heads, kv_heads, world)]


@torch.no_grad()
def shard_model(model, rank: int, world: int, unit: int = 1) -> list[str]:
    """Cut the plan's Linear layers to rank's slice, in place. -> names of the rowwise layers, whose outputs need
    `attach_all_reduce` (after any quantization has replaced the modules)."""
    plan = sharding_plan(model)
    _, kv_heads, head_dim = kv_geometry(model.config)
    heads = model.config.num_attention_heads
    hr = head_ranges(heads, kv_heads, world)[rank]
    q_rows = (hr.q_start * head_dim, hr.q_end * head_dim)
    kv_rows = (hr.kv_start * head_dim, hr.kv_end * head_dim)
    modules = dict(model.named_modules())
    rowwise = []
    for name, style in plan.items():
        linear = modules[name]
        parent = modules[name.rpartition(".")[0]]
        attention = hasattr(parent, "head_dim")
        if style == "colwise":
            if not attention:
                span = even_split(linear.out_features, world, unit)[rank]
            elif linear.out_features == heads * head_dim:
                span = q_rows
            elif linear.out_features == kv_heads * head_dim:
                span = kv_rows
            else:
                raise InvalidRequestError(f"{FIELD}: {name} has {linear.out_features} outputs, neither the query nor "
                                          f"the K/V heads' width ({heads} or {kv_heads} x {head_dim}): a fused "
                                          "projection the engine does not split", FIELD)
            _keep_rows(linear, *span)
        else:
            span = q_rows if attention else even_split(linear.in_features, world, unit)[rank]
            _keep_columns(linear, *span, keep_bias=rank == 0)
            rowwise.append(name)
        if attention and hasattr(parent, "num_key_value_groups"):
            parent.num_key_value_groups = (hr.q_end - hr.q_start) // (hr.kv_end - hr.kv_start)
    return rowwise


def _keep_rows(linear: nn.Linear, start: int, end: int) -> None:
    linear.weight = nn.Parameter(linear.weight[start:end].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[start:end].clone(), requires_grad=False)
    linear.out_features = end - start


def _keep_columns(linear: nn.Linear, start: int, end: int, keep_bias: bool) -> None:
    linear.weight = nn.Parameter(linear.weight[:, start:end].contiguous(), requires_grad=False)
    if linear.bias is not None and not keep_bias:
        linear.register_parameter("bias", None)  # added once, on rank 0, before the sum
    linear.in_features = end - start


def attach_all_reduce(model, names: list[str], group) -> None:
    """Sum each named layer's output over the group (in place, inside its forward hook)."""
    import torch.distributed as dist

    def hook(module, args, output):
        dist.all_reduce(output, group=group)
        return output

    modules = dict(model.named_modules())
    for name in names:
        modules[name].register_forward_hook(hook)
