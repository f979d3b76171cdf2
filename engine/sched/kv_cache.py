"""Engine-owned paged KV cache: one preallocated pool per model, indexed by the block ids of
engine/sched/block_allocator.py.

A sequence's blocks are listed in its block table; rolling back rejected tokens only lowers its computed length
(the stale entries are overwritten later), so rollback is O(1) and never copies tensors. Stale entries are never
read either: attention gathers them as the pool's null block (see KVPool).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import torch


def kv_geometry(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of an HF decoder config (Llama- and GPT-2-style names; multi-query)."""
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = 1 if getattr(config, "multi_query", False) else getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layers, kv_heads, head_dim


def kv_bytes_per_token(config, dtype: torch.dtype, kv_heads: int | None = None) -> int:
    """`kv_heads`: a tensor-parallel rank's share (None: all the model's)."""
    layers, all_heads, head_dim = kv_geometry(config)
    kv_heads = kv_heads or all_heads
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class KVPool:
    """Per-layer key and value storage, each [num_blocks + 1, block_size, num_kv_heads, head_dim].

    Blocks 0 .. num_blocks - 1 are the allocator's; the extra last one is the null block: all zeros, never
    allocated and never written. Attention reads every key slot it must not see (block-table padding, a sequence's
    positions past its length: stale entries of a previous owner or of rolled-back drafts) from the null block
    instead of from the slot itself, so whatever a freed block holds (even NaN or inf) cannot reach an output; this
    costs one block per pool and no work on allocation, free or rollback (which stays O(1)), unlike zeroing blocks.
    """

    key_store: list[torch.Tensor]
    value_store: list[torch.Tensor]
    block_size: int
    _mappings: list = field(default_factory=list, repr=False)  # keeps the CPU pools' anonymous mappings alive

    @property
    def num_blocks(self) -> int:
        return self.key_store[0].shape[0] - 1 if self.key_store else 0

    @property
    def null_block(self) -> int:
        return self.num_blocks

    @property
    def key(self) -> list[torch.Tensor]:
        """The allocatable blocks of each layer: views [num_blocks, block_size, num_kv_heads, head_dim]."""
        return [t[:-1] for t in self.key_store]

    @property
    def value(self) -> list[torch.Tensor]:
        return [t[:-1] for t in self.value_store]

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """K/V of flat slots src[i] -> dst[i] in every layer (an accepted tree path moved into place); all sources
        are read before any destination is written."""
        device = self.key_store[0].device
        s, d = torch.tensor(src, device=device), torch.tensor(dst, device=device)
        for store in (*self.key_store, *self.value_store):
            rows = store.view(-1, *store.shape[2:])  # [slots, H_kv, D]
            rows.index_copy_(0, d, rows.index_select(0, s))

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Whole blocks src[i] -> dst[i] in every layer (a private copy of a shared prefix block)."""
        device = self.key_store[0].device
        s, d = torch.tensor(src, device=device), torch.tensor(dst, device=device)
        for store in (*self.key_store, *self.value_store):
            store.index_copy_(0, d, store.index_select(0, s))

    @staticmethod
    def allocate(config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 kv_heads: int | None = None) -> "KVPool":
        """`kv_heads`: a tensor-parallel rank's share of the heads (None: all of them)."""
        layers, all_heads, head_dim = kv_geometry(config)
        kv_heads = kv_heads or all_heads
        shape = (num_blocks + 1, block_size, kv_heads, head_dim)  # + the null block
        mappings: list = []
        keys = [zeroed(shape, dtype, device, mappings) for _ in range(layers)]
        values = [zeroed(shape, dtype, device, mappings) for _ in range(layers)]
        return KVPool(keys, values, block_size, mappings)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, mappings: list) -> torch.Tensor:
    """A zero-filled tensor. On the CPU it lives in an anonymous memory mapping, whose pages the OS zero-fills
    on first touch: the pool costs resident memory only for the blocks actually written (torch.zeros would write
    every page at start). Never uninitialised memory: the null block and unwritten slots must read as zeros."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    buf = mmap.mmap(-1, max(1, count * torch.empty((), dtype=dtype).element_size()),
                    flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mappings.append(buf)
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)


def slot_table(block_ids: list[list[int]], starts: torch.Tensor, counts: torch.Tensor, block_size: int,
               null_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat pool slots of positions starts[i] .. starts[i] + counts[i] - 1 of each sequence -> (slots [S, Q], real
    [S, Q]) with Q = max(counts); padding (and any position past a sequence's blocks) reads the null block."""
    width = int(counts.max()) if len(counts) else 0
    pos = starts[:, None] + torch.arange(width)[None, :]  # [S, Q]
    longest = max((len(b) for b in block_ids), default=0)
    tables = torch.full((len(block_ids), longest + 1), null_block, dtype=torch.long)
    for i, blocks in enumerate(block_ids):
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
    real = (torch.arange(width)[None, :] < counts[:, None]) & (pos // block_size < longest)
    block = tables.gather(1, (pos // block_size).clamp(0, longest))
    real &= block != null_block
    slots = torch.where(real, block * block_size + pos % block_size, torch.full_like(pos, null_block * block_size))
    return slots, real
