"""Prefix caching bookkeeping: chained block hashes, reference counts, LRU eviction, per-proposer validity."""

import pytest
import torch
from transformers import LlamaConfig

from specserve.engine.sched.block_allocator import BlockAllocator
from specserve.engine.sched.kv_cache import KVPool
from specserve.engine.sched.prefix_hash import block_hash, extend_block_hashes, root_hash


def _hashes(tokens, block_size=4, salt=None):
    out = []
    extend_block_hashes(out, tokens, block_size, root_hash("model", salt))
    return out


def test_hashes_chain_over_everything_before_the_block():
    a = _hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(a) == 2  # full blocks only: token 9 is in a partial block
    b = _hashes([0, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different first: different identity
    assert _hashes([1, 2, 3, 4, 5, 6, 7, 8]) == a
    assert a[1] == block_hash(a[0], [5, 6, 7, 8])


def test_hashes_depend_on_namespace_and_salt():
    tokens = list(range(8))
    assert _hashes(tokens, salt="tenant-a") != _hashes(tokens, salt="tenant-b") != _hashes(tokens)
    other = []
    extend_block_hashes(other, tokens, 4, root_hash("another model"))
    assert other[0] != _hashes(tokens)[0]


def test_hashes_extend_incrementally():
    tokens = list(range(10))
    grown = []
    extend_block_hashes(grown, tokens[:5], 4, root_hash("model"))
    extend_block_hashes(grown, tokens, 4, root_hash("model"))
    assert grown == _hashes(tokens)


def _published(alloc, n, hashes):
    blocks = alloc.allocate(n)
    for b, h in zip(blocks, hashes):
        alloc.publish(b, h, set())
    return blocks


def test_freed_published_blocks_stay_cached_and_are_shared_by_reference():
    alloc = BlockAllocator(num_blocks=6, block_size=4, enable_caching=True)
    hashes = _hashes(list(range(12)))
    blocks = _published(alloc, 3, hashes)
    assert alloc.lookup(hashes) == blocks
    alloc.free(blocks)
    assert alloc.num_free == 6 and alloc.usage == 0.0  # evictable blocks count as free
    assert alloc.lookup(hashes) == blocks and alloc.num_cached == 3  # but still hit
    alloc.share(blocks[:2])
    alloc.share(blocks[:1])
    assert [alloc.ref_count(b) for b in blocks] == [2, 1, 0] and alloc.num_free == 4
    alloc.free(blocks[:1])
    alloc.free(blocks[:2])
    assert [alloc.ref_count(b) for b in blocks] == [0, 0, 0] and alloc.num_free == 6
    alloc.check_whole()


def test_lookup_stops_at_the_first_missing_block():
    alloc = BlockAllocator(num_blocks=6, block_size=4, enable_caching=True)
    hashes = _hashes(list(range(12)))
    blocks = alloc.allocate(3)
    alloc.publish(blocks[0], hashes[0], set())
    alloc.publish(blocks[2], hashes[2], set())  # (never happens in the engine; lookup must still stop)
    assert alloc.lookup(hashes) == blocks[:1]
    assert alloc.lookup(_hashes([9] * 12)) == []


def test_plain_free_blocks_go_first_then_least_recently_freed_cached_ones():
    alloc = BlockAllocator(num_blocks=4, block_size=4, enable_caching=True)
    a = _published(alloc, 2, _hashes(list(range(8))))
    b = _published(alloc, 1, _hashes([7] * 4))
    alloc.free(a)  # a's tail first: a[1] is older than a[0]
    alloc.free(b)
    assert alloc.allocate(1) == [3]  # the never-cached block
    assert alloc.allocate(1) == [a[1]]  # then LRU: a's tail, freed first
    assert alloc.lookup(_hashes(list(range(8)))) == [a[0]]  # evicting it dropped its hash, the head stays
    assert alloc.num_cached == 2
    alloc.check_whole()


def test_sharing_takes_a_cached_block_off_the_eviction_list():
    alloc = BlockAllocator(num_blocks=2, block_size=4, enable_caching=True)
    hashes = _hashes(list(range(4)))
    [blk] = _published(alloc, 1, hashes)
    alloc.free([blk])
    alloc.share([blk])
    assert alloc.num_free == 1 and alloc.allocate(1) != [blk]
    with pytest.raises(RuntimeError, match="exhausted"):
        alloc.allocate(1)  # the shared block is never handed out
    alloc.check_whole()


def test_a_hash_keeps_its_first_block_and_duplicates_stay_private():
    alloc = BlockAllocator(num_blocks=4, block_size=4, enable_caching=True)
    hashes = _hashes(list(range(4)))
    first, second = alloc.allocate(2)
    alloc.publish(first, hashes[0], set())
    alloc.publish(second, hashes[0], set())  # the same tokens computed twice (two requests at once)
    assert alloc.lookup(hashes) == [first]
    alloc.free([second])
    assert alloc.num_cached == 1 and alloc.allocate(1) == [second]  # went back to the plain free list
    alloc.check_whole()


def test_validity_per_proposer_is_recorded_and_upgraded_on_the_published_block_only():
    alloc = BlockAllocator(num_blocks=4, block_size=4, enable_caching=True)
    hashes = _hashes(list(range(8)))
    a, b = alloc.allocate(2)
    alloc.publish(a, hashes[0], {"draft"})
    alloc.publish(b, hashes[1], set())
    assert alloc.valid(a) == {"draft"} and alloc.valid(b) == set()
    alloc.mark_valid(b, hashes[1], "draft")
    assert alloc.valid(b) == {"draft"}
    [c] = alloc.allocate(1)
    alloc.mark_valid(c, hashes[1], "dflash")  # not the block cached under that hash: no effect
    assert alloc.valid(b) == {"draft"} and alloc.valid(c) == set()


def test_caching_off_publishes_nothing():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    hashes = _hashes(list(range(4)))
    [blk] = alloc.allocate(1)
    alloc.publish(blk, hashes[0], set())
    assert alloc.lookup(hashes) == [] and alloc.num_cached == 0
    alloc.free([blk])
    alloc.check_whole()


def test_double_free_and_unheld_publish_are_refused():
    alloc = BlockAllocator(num_blocks=2, block_size=4, enable_caching=True)
    [blk] = alloc.allocate(1)
    alloc.free([blk])
    with pytest.raises(RuntimeError, match="freed more often"):
        alloc.free([blk])
    with pytest.raises(RuntimeError, match="does not hold"):
        alloc.publish(blk, _hashes(list(range(4)))[0], set())
    with pytest.raises(RuntimeError, match="not cached"):
        alloc.share([blk])


def test_copy_blocks_copies_every_layer_and_leaves_the_source():
    cfg = LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2)
    pool = KVPool.allocate(cfg, num_blocks=3, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    for i, t in enumerate(pool.key + pool.value):
        t[0].copy_(torch.randn_like(t[0]) + i)
    before = [t[0].clone() for t in pool.key + pool.value]
    pool.copy_blocks([0], [2])
    for t, ref in zip(pool.key + pool.value, before):
        assert torch.equal(t[2], ref) and torch.equal(t[0], ref) and not t[1].any()


def test_a_duplicate_valid_for_more_proposers_takes_over_the_hash():
    alloc = BlockAllocator(num_blocks=4, block_size=4, enable_caching=True)
    hashes = _hashes(list(range(4)))
    old, new = alloc.allocate(2)
    alloc.publish(old, hashes[0], set())  # published by a request without DFlash: no context K/V
    alloc.free([old])  # evictable
    alloc.publish(new, hashes[0], {"dflash"})  # the same tokens recomputed by a DFlash request
    assert alloc.lookup(hashes) == [new] and alloc.valid(new) == {"dflash"}
    assert alloc.num_cached == 1 and alloc.allocate(1) == [old]  # the old block went back to the plain free list
    alloc.publish(old, hashes[0], set())  # fewer valid proposers: no takeover
    assert alloc.lookup(hashes) == [new]
    alloc.check_whole()
