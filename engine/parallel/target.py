"""Rank 0's handle on a target split over tensor-parallel ranks: starts the workers before rank 0 loads (they load
at the same time), cuts rank 0's own slice, and turns rank 0's ModelRunner into one that drives every rank."""

from __future__ import annotations

import logging
import os

import torch

from specserve.engine.model.runner import ModelRunner
from specserve.engine.parallel import group
from specserve.engine.parallel.group import TensorParallelGroup, WorkerSpec
from specserve.engine.parallel.runner import TensorParallelRunner
from specserve.engine.parallel.shard import attach_all_reduce, check_shardable, local_kv_heads, shard_model
from specserve.engine.parallel.worker import shard_unit


class ShardedTarget:
    def __init__(self, config, path, dtype: torch.dtype, device: torch.device, quantization: str | None):
        world = config.tensor_parallel_size
        if device.type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size: {world} ranks need {world} GPUs; "
                             f"{torch.cuda.device_count()} visible")
        self.spec = WorkerSpec(str(path), dtype, device.type, config.trust_remote_code, quantization,
                               config.quantization_dense_rows, world, threads=max(1, (os.cpu_count() or 1) // world),
                               log_level=logging.getLogger("specserve").getEffectiveLevel() or logging.INFO,
                               timeout_s=group.COLLECTIVE_TIMEOUT.total_seconds())
        self.group = TensorParallelGroup(self.spec)
        self._rowwise: list[str] = []

    def shard(self, model) -> None:
        """load_model's `shard` hook on rank 0."""
        check_shardable(model, self.spec.world)
        self._rowwise = shard_model(model, 0, self.spec.world, shard_unit(self.spec))

    def attach(self, model) -> None:
        """After rank 0 has loaded: its all-reduces, then every worker ready (or its error raised)."""
        import torch.distributed as dist

        attach_all_reduce(model, self._rowwise, dist.group.WORLD)
        self.group.wait_ready()

    def kv_heads(self, config) -> list[int]:
        return local_kv_heads(config, self.spec.world)

    def runner(self, local: ModelRunner) -> TensorParallelRunner:
        """Every worker allocates its pool like rank 0's; -> the runner the engine steps."""
        self.group.send("kv", local.kv.num_blocks, local.kv.block_size)
        return TensorParallelRunner(local, self.group)

    def close(self) -> None:
        self.group.close()

    def abort(self) -> None:
        """Start-up failed on rank 0: end the workers wherever they are (they may not read commands yet)."""
        import torch.distributed as dist

        self.group.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
