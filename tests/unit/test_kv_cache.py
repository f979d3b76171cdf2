"""Block allocator bookkeeping and KV geometry of HF configs."""

import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from specserve.engine.sched.block_allocator import BlockAllocator
from specserve.engine.sched.kv_cache import KVPool, kv_bytes_per_token, kv_geometry


@pytest.mark.parametrize("tokens, blocks", [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_blocks_for_rounds_up(tokens, blocks):
    assert BlockAllocator(10, 16).blocks_for(tokens) == blocks


def test_allocate_free_usage():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    assert alloc.num_free == 8 and alloc.usage == 0.0
    a = alloc.allocate(3)
    b = alloc.allocate(2)
    assert len(a) == 3 and len(b) == 2
    assert len(set(a) | set(b)) == 5 and set(a + b) <= set(range(8))
    assert alloc.num_free == 3 and alloc.usage == pytest.approx(5 / 8)
    assert alloc.can_allocate(3) and not alloc.can_allocate(4)
    alloc.free(a)
    assert alloc.num_free == 6 and alloc.usage == pytest.approx(2 / 8)
    c = alloc.allocate(6)
    assert set(c) == set(range(8)) - set(b)  # freed blocks are handed out again; live ones never are
    assert alloc.usage == 1.0 and alloc.can_allocate(0) and not alloc.can_allocate(1)
    assert alloc.allocate(0) == []


def test_exhausted_allocator_raises_and_keeps_its_state():
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    held = alloc.allocate(3)
    with pytest.raises(RuntimeError, match="exhausted"):
        alloc.allocate(2)
    assert alloc.num_free == 1  # a failed allocation takes nothing
    assert alloc.allocate(1) not in held
    with pytest.raises(RuntimeError):
        alloc.allocate(1)


def test_empty_allocator_usage():
    alloc = BlockAllocator(num_blocks=0, block_size=16)
    assert alloc.usage == 1.0 and not alloc.can_allocate(1) and alloc.can_allocate(0)


def test_kv_geometry_llama_gqa():
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    assert kv_geometry(cfg) == (3, 2, 16)
    explicit = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=2,
                           head_dim=32)
    assert kv_geometry(explicit) == (2, 1, 32)  # head_dim given explicitly, not hidden / heads
    assert kv_bytes_per_token(cfg, torch.float32) == 2 * 3 * 2 * 16 * 4
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 2 * 3 * 2 * 16 * 2


def test_kv_geometry_gpt2():
    cfg = GPT2Config(n_embd=96, n_layer=5, n_head=6)
    assert kv_geometry(cfg) == (5, 6, 16)  # no GQA: every head has its own K/V
    assert kv_bytes_per_token(cfg, torch.float16) == 2 * 5 * 6 * 16 * 2


def test_kv_pool_shapes():
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    pool = KVPool.allocate(cfg, num_blocks=5, block_size=8, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert len(pool.key) == len(pool.value) == 3 and pool.block_size == 8
    for t in pool.key + pool.value:
        assert t.shape == (5, 8, 2, 16) and t.dtype == torch.bfloat16
    assert len({t.data_ptr() for t in pool.key + pool.value}) == 6  # no two layers share storage


def test_freed_blocks_are_reused_last_in_first_out():
    """Light traffic keeps reusing the same few blocks (a FIFO would walk the whole pool and touch all of it)."""
    alloc = BlockAllocator(num_blocks=64, block_size=4)
    assert alloc.allocate(3) == [0, 1, 2]
    for _ in range(20):
        blocks = alloc.allocate(2)
        alloc.free(blocks)
    assert blocks == [3, 4]


def _resident_bytes() -> int:
    import os
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_cpu_pool_is_zero_and_costs_memory_only_where_written():
    cfg = LlamaConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=4)
    before = _resident_bytes()
    pool = KVPool.allocate(cfg, num_blocks=4096, block_size=16, dtype=torch.float32, device=torch.device("cpu"))
    size = sum(t.numel() * t.element_size() for t in pool.key_store + pool.value_store)
    assert size >= 512 << 20
    assert _resident_bytes() - before < size // 16  # demand-zero pages: nothing resident yet
    for t in pool.key_store + pool.value_store:
        t[:2] = 1.0  # write two blocks per layer
    assert _resident_bytes() - before < size // 16
    assert float(pool.key_store[0][2:10].abs().sum()) == 0.0 and float(pool.value_store[-1][-1].abs().sum()) == 0.0
