"""BlockPool: the paged KV cache's allocator and its prefix-cache index (block ids only; the
tensors live in the executor).

A block is held while its reference count is > 0 and free otherwise. A full, computed block may
be indexed by the hash of its tokens and of every token before it (`chain_hash`); when the last
holder frees it, it stays indexed on the free list, so a later prompt with the same prefix revives
it instead of recomputing it. The free list is in LRU order (oldest freed first) and allocation
takes from its head, dropping the index entry of what it takes: that is the eviction.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Digest of a block of tokens and, through `parent`, of every token before it."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._index: dict[bytes, int] = {}
        self.num_evictions = 0
        self.num_query_tokens = 0  # prompt tokens looked up in the index
        self.num_hit_tokens = 0  # of those, found cached

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Indexed blocks, held or free."""
        return len(self._index)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._unindex(b)
            self._refs[b] = 1
            blocks.append(b)
        return blocks

    def free(self, blocks: list[int]) -> None:
        # NOTE: last block first, so a prompt's tail is evicted before the prefix it extends
        for b in reversed(blocks):
            if self._refs[b] <= 0:
                raise RuntimeError(f"KV block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None

    # ---- prefix cache -----------------------------------------------------------------------

    def match(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest indexed prefix of `hashes` (nothing is taken)."""
        blocks = []
        if self.enable_caching:
            for h in hashes:
                b = self._index.get(h)
                if b is None:
                    break
                blocks.append(b)
        return blocks

    def num_free_among(self, blocks: list[int]) -> int:
        return sum(self._refs[b] == 0 for b in blocks)

    def acquire(self, blocks: list[int]) -> None:
        """Hold cached blocks found by match() (reviving free ones)."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1

    def register(self, block: int, h: bytes) -> None:
        """Index a full, computed block under its chain hash (first writer wins)."""
        if self.enable_caching and self._hash_of[block] is None and h not in self._index:
            self._index[h] = block
            self._hash_of[block] = h

    def clear_cache(self) -> None:
        """Forget every indexed block (held ones stay held; free ones are plainly free)."""
        self._index.clear()
        self._hash_of = [None] * self.num_blocks

    def _unindex(self, b: int) -> None:
        h = self._hash_of[b]
        if h is not None:
            del self._index[h]
            self._hash_of[b] = None
            self.num_evictions += 1

    def check_invariants(self) -> None:
        free = set(self._free)
        assert all(r >= 0 for r in self._refs), "negative refcount"
        used = {b for b, r in enumerate(self._refs) if r > 0}
        assert not (free & used), "a free block is referenced"
        assert len(free) + len(used) == self.num_blocks, "blocks lost: free + used != total"
        assert all(self._hash_of[b] == h for h, b in self._index.items()), "index out of sync"
        assert sum(h is not None for h in self._hash_of) == len(self._index), "stale block hash"
