"""Host-side block management of a paged KV pool, with prefix caching (as vLLM's automatic prefix caching).

A block is *free* (no content worth keeping), *in use* (reference count > 0: some sequences' block tables hold it)
or *cached* (reference count 0 but it holds a full block of tokens under a known hash: reusable until evicted).
A full block's hash chains its parent's: h_i = hash(h_{i-1}, tokens of block i), so equal hashes mean equal
prefixes. Allocation takes free blocks first, then evicts the least recently released cached block.

    blocks = BlockManager(num_blocks, block_size)
    hit = blocks.match(tokens)            # cached blocks of the longest full-block prefix (referenced now)
    new = blocks.allocate(n)              # or None when even eviction cannot supply n blocks
    blocks.register(block, h)             # a block just filled with the tokens behind hash h
    blocks.release(table)                 # a sequence is done (or preempted) with its blocks
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

__all__ = ["BlockManager", "block_hashes"]


def block_hashes(
    tokens: Sequence[int], block_size: int, known: Sequence[int] = (), upto: int | None = None
) -> list[int]:
    """Chained hashes of the full blocks of `tokens[:upto]` (a trailing partial block has none); `known` = the
    hashes of its first blocks, already computed (they are extended, not recomputed)."""
    hashes = list(known)
    parent = hashes[-1] if hashes else None
    end = len(tokens) if upto is None else upto
    for start in range(len(hashes) * block_size, end - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        hashes.append(parent)
    return hashes


class BlockManager:
    """Reference-counted pool blocks with a prefix cache and LRU eviction (all host-side Python)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks = {num_blocks}, block_size = {block_size}: both must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = collections.deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # block -> hash (full, registered blocks)
        self._block_of: dict[int, int] = {}  # hash -> block
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # refs 0, LRU first

    @property
    def num_available(self) -> int:
        """Blocks an allocation could get now (free + evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks holding a cached prefix (evictable; part of `num_available`)."""
        return len(self._cached)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def match(self, tokens: Sequence[int]) -> list[int]:
        """The cached blocks holding the longest full-block prefix of `tokens`, each referenced once more."""
        found = []
        for h in block_hashes(tokens, self.block_size):
            block = self._block_of.get(h)
            if block is None:
                break
            found.append(block)
        for block in found:
            self._acquire(block)
        return found

    def allocate(self, n: int) -> list[int] | None:
        """n blocks (reference count 1 each), evicting least recently used cached blocks if needed; None (and no
        change) if fewer than n are available."""
        if n > self.num_available:
            return None
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._cached.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
            self._refs[block] = 1
            out.append(block)
        return out

    def register(self, block: int, block_hash: int) -> None:
        """Marks `block` (in use) as holding the full block behind `block_hash`. If another block already holds it,
        nothing changes (the duplicate is freed when released)."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is not in use; only blocks a sequence holds can be registered")
        if block_hash not in self._block_of and block not in self._hash_of:
            self._block_of[block_hash], self._hash_of[block] = block, block_hash

    def release(self, blocks: Sequence[int]) -> None:
        """Drops one reference from each block; unreferenced blocks become cached (if registered) or free. Blocks are
        released last-first, so a sequence's tail is evicted before its shared prefix."""
        for block in reversed(blocks):
            if self._refs[block] < 1:
                raise ValueError(f"block {block} released more often than it was acquired")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    def _acquire(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._cached[block]
        self._refs[block] += 1
