"""The KV block allocator shared by the target's and every proposer's pools (one block id indexes all of them), with
automatic prefix caching.

Blocks are reference counted. With caching on, a FULL block whose K/V were verified is published under a chained
hash of its tokens (engine/sched/prefix_hash.py): a later request whose prompt starts with the same blocks shares them
(reference count + 1, never a copy). A block nobody holds any more keeps its K/V and its hash ("evictable") until the
allocator needs it: plain free blocks are handed out first, then evictable ones, least recently freed first (LRU).

Each published block also records which proposers' KV in it is valid (a draft model's KV lags the target's and is
absent while k = 0): a hit tells each proposer how far its own KV reaches. Published blocks are never written again
by the target (only positions at or past a request's computed length are written, and a published block lies wholly
before it); a request whose whole prompt hits gets a copy of the last block (engine/sched/scheduler.py).
"""

from __future__ import annotations

from collections import OrderedDict


class BlockAllocator:
    """Hands out fixed-size KV blocks. The plain free list is a stack (LIFO): the most recently freed blocks are
    reused first, so light traffic keeps touching the same few blocks and the rest of a demand-zero pool never
    becomes resident memory (a FIFO queue would cycle through every block)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes block 0 first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced: least recently freed first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # published block -> its hash
        self._block_of: dict[bytes, int] = {}  # hash -> the published block holding it
        self._valid: dict[int, set[str]] = {}  # published block -> proposers whose KV in it is valid

    # -- allocation ------------------------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: plain free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    @property
    def cached_blocks(self) -> frozenset[int]:
        return frozenset(self._hash_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"KV cache exhausted: asked {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)  # the least recently freed cached block
                self._unpublish(block)
            self._refs[block] = 1
            out.append(block)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; an unreferenced block becomes evictable if published, else free. The
        tail of a sequence goes first, so it is evicted before its head (the part other requests share)."""
        for block in reversed(blocks):
            if self._refs[block] <= 0:
                raise RuntimeError(f"block {block} freed more often than it was held")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (evictable cached blocks count as free, as in vLLM)."""
        return 1.0 - self.num_free / max(self.num_blocks, 1)

    # -- prefix caching ---------------------------------------------------------------------------------------------

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The published blocks of the longest run of leading hashes that are all cached (changes nothing)."""
        out = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def num_unreferenced(self, blocks: list[int]) -> int:
        """How many of `blocks` sharing would take off the free count (the evictable ones)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def share(self, blocks: list[int]) -> None:
        """One more reference to each published block (an evictable one stops being evictable)."""
        for block in blocks:
            if block not in self._hash_of:
                raise RuntimeError(f"block {block} is not cached: only published blocks are shared")
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1

    def publish(self, block: int, block_hash: bytes, valid: set[str]) -> None:
        """Cache a full block whose target K/V are verified, with the proposers whose KV in it is valid. A hash that
        is already cached keeps its block (this one stays private and is freed plainly), unless this block is valid
        for more proposers (a DFlash request recomputed blocks that a request without DFlash had published): then
        the hash moves here and the old block becomes private to its holders (plain free when they let go)."""
        if not self.enable_caching or block in self._hash_of:
            return
        if self._refs[block] <= 0:
            raise RuntimeError(f"block {block} is published by a request that does not hold it")
        old = self._block_of.get(block_hash)
        if old is not None:
            if not set(valid) > self._valid[old]:
                return
            self._unpublish(old)
            if self._refs[old] == 0:
                del self._evictable[old]
                self._free.append(old)
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        self._valid[block] = set(valid)

    def mark_valid(self, block: int, block_hash: bytes, proposer: str) -> None:
        """A proposer's KV in this published block became valid (its KV caught up with the target's)."""
        if self._block_of.get(block_hash) == block:
            self._valid[block].add(proposer)

    def valid(self, block: int) -> frozenset[str]:
        return frozenset(self._valid.get(block, ()))

    def _unpublish(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]
            del self._valid[block]

    def check_whole(self) -> None:
        """Invariants (tests, debugging): every block is exactly one of held, evictable (then cached) or free."""
        free, evictable = set(self._free), set(self._evictable)
        held = {b for b, r in enumerate(self._refs) if r > 0}
        if free & evictable or (free | evictable) & held or len(free) + len(evictable) + len(held) != self.num_blocks:
            raise AssertionError("allocator lists overlap or lose blocks")
        if not evictable <= set(self._hash_of) or free & set(self._hash_of):
            raise AssertionError("an evictable block is not cached, or a free one still is")
        if any(self._block_of[h] != b for b, h in self._hash_of.items()):
            raise AssertionError("hash table out of step")
