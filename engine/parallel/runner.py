"""Rank 0's target runner under tensor parallelism: the engine calls it exactly like a ModelRunner; every call that
touches the target's weights or KV is first sent to the workers, which replay it on their slices, so the
all-reduces inside the forward line up on every rank."""

from __future__ import annotations

import torch

from specserve.engine.model.runner import ModelRunner
from specserve.engine.parallel.group import TensorParallelGroup


class ShardedKV:
    """The target KV pool's operations outside a forward (prefix-block copies, tree-path moves), on every rank."""

    def __init__(self, local, group: TensorParallelGroup):
        self.local, self.group = local, group

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        self.group.send("copy_slots", src, dst)
        self.local.copy_slots(src, dst)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.group.send("copy_blocks", src, dst)
        self.local.copy_blocks(src, dst)

    def __getattr__(self, name):  # shapes and stores of rank 0's own slice (read-only use)
        return getattr(self.local, name)


class TensorParallelRunner:
    def __init__(self, local: ModelRunner, group: TensorParallelGroup):
        self.local, self.group = local, group
        self.kv = ShardedKV(local.kv, group)

    def __getattr__(self, name):  # model, device, vocab_size, taps, stable_shapes of rank 0's runner
        return getattr(self.local, name)

    def forward(self, input_ids: torch.Tensor, chunks, logits_index: torch.Tensor) -> torch.Tensor:
        return self.run(input_ids, chunks, logits_index)[0]

    def run(self, input_ids: torch.Tensor, chunks, logits_index: torch.Tensor, hidden_rows=None, capture=False):
        """ModelRunner.run on every rank; hidden states and logits come from rank 0's (whole) residual stream."""
        try:
            self.group.send("run", input_ids.tolist(), chunks)
            return self.local.run(input_ids, chunks, logits_index, hidden_rows, capture)
        except Exception as exc:  # a half-run forward leaves the workers inside a collective: no way back
            self.group.fatal(f"rank 0's forward failed ({type(exc).__name__}: {exc})")
            raise
